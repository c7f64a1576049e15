"""Hashes of what compress and export write, to show that a change which should not change outputs
does not: run it before and after, and compare the tables (or the JSON files).

    python benchmarks/check_outputs.py [--out results/check_outputs.json] [--against results/before.json]

Four outputs, each through the public API: INT8 PTQ of the Fashion-MNIST CNN on its PyTorch path
(the fake-quant weights, and its Q/DQ ONNX export), INT8 of the same CNN's exported ONNX graph (the
ONNX-graph path), and 4-bit round-to-nearest weight-only quantization of a tiny seeded Llama (the
packed weights, and its ONNX export). ONNX files are hashed without the exporter's provenance
metadata (``graph_sha256``: Python stack traces and class paths), safetensors files by their content (``tensors_sha256``). ``--against`` compares
with an earlier run's JSON and exits 1 when a hash differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama() -> Any:
    """A 2-block Llama (GQA, tied embeddings) with seeded random weights (entry point
    ``check_outputs:tiny_llama``, so that the compressed folder reloads its base)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgekit.sources.handle import InputSpec, ModelHandle
    from edgekit.sources.hf import CausalLMWrapper

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=64, use_cache=False)
    module = CausalLMWrapper(LlamaForCausalLM(cfg).eval()).eval()

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        ids = np.random.default_rng(1).integers(0, 128, size=(batch, sequence or 16)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    seq = {0: "batch", 1: "sequence"}
    return ModelHandle(name="tiny-llama", source="check_outputs:tiny_llama", kind="causal-lm", module=module,
                       inputs=[InputSpec("input_ids", ("batch", "sequence"), "int64"),
                               InputSpec("attention_mask", ("batch", "sequence"), "int64")],
                       outputs=["logits"], make_inputs=make_inputs, default_calib=None,
                       dynamic_axes={"input_ids": seq, "attention_mask": seq, "logits": seq})


# Node metadata that PyTorch's exporter records for debugging: each op's Python stack trace (file
# paths and line numbers) and the Python classes (module paths) it was traced through. They change
# whenever code moves, while the graph, its weights and every other field stay as they are.
EXPORTER_PROVENANCE = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.class_hierarchy", "namespace")


def graph_sha256(path: Path) -> str:
    """An ONNX file's SHA-256 without the exporter's provenance metadata (``EXPORTER_PROVENANCE``)."""
    import onnx

    model = onnx.load(str(path))
    for node in model.graph.node:
        kept = [p for p in node.metadata_props if p.key not in EXPORTER_PROVENANCE]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def tensors_sha256(path: Path) -> str:
    """A safetensors file's content: each tensor's name, dtype, shape and bytes, and the metadata,
    in sorted order. The file's own bytes are not stable: safetensors' ``save_model`` drops one name
    of each tied pair (the LM head and its embedding) in an order that Python's hash seed decides,
    which orders the header differently from run to run."""
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(path), framework="np") as f:
        h.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            h.update(f"{name} {t.dtype} {t.shape}".encode())
            h.update(np.ascontiguousarray(t).tobytes())
    return h.hexdigest()


def outputs(work: Path) -> dict[str, str]:
    import edgekit
    from edgekit.compress import INT8_STEP, WEIGHT_ONLY_STEP, StepContext

    def ctx(data: str | None = None) -> StepContext:
        return StepContext(calib=data, eval=data, progress=False)

    hashes: dict[str, str] = {}
    int8 = edgekit.compress("fmnist-cnn", [(INT8_STEP, {"method": "ptq"})], work / "int8", ctx())
    hashes["int8 (PyTorch path) model.safetensors"] = tensors_sha256(int8 / "model.safetensors")
    onnx = edgekit.export_onnx(int8, work / "int8-onnx")
    hashes["int8 (PyTorch path) export model.onnx"] = graph_sha256(onnx / "model.onnx")
    fp32 = edgekit.export_onnx("fmnist-cnn", work / "fp32-onnx")
    graph = edgekit.compress(str(fp32), [(INT8_STEP, {"method": "ptq"})], work / "int8-graph",
                             ctx("fashion-mnist"))  # an ONNX file names no data of its own
    hashes["int8 (ONNX-graph path) model.onnx"] = graph_sha256(graph / "model.onnx")
    rtn = edgekit.compress(tiny_llama(), [(WEIGHT_ONLY_STEP, {"method": "rtn", "bits": 4, "group_size": 32})],
                           work / "rtn4", ctx())
    hashes["weight-only rtn 4-bit model.safetensors"] = tensors_sha256(rtn / "model.safetensors")
    onnx = edgekit.export_onnx(rtn, work / "rtn4-onnx")
    hashes["weight-only rtn 4-bit export model.onnx"] = graph_sha256(onnx / "model.onnx")
    return hashes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results/check_outputs.json"))
    ap.add_argument("--against", type=Path, help="an earlier run's JSON: exit 1 when a hash differs")
    ap.add_argument("--keep", type=Path, help="write the outputs into this new folder (default: a temporary one)")
    a = ap.parse_args()
    if a.keep is not None:
        a.keep.mkdir(parents=True)
        hashes = outputs(a.keep)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hashes = outputs(Path(tmp))
    before = json.loads(a.against.read_text())["hashes"] if a.against else {}
    width = max(map(len, hashes))
    print(f"{'output':<{width}}  sha256" + ("  same as --against" if before else ""))
    for name, digest in hashes.items():
        same = ("  yes" if before.get(name) == digest else "  NO") if before else ""
        print(f"{name:<{width}}  {digest[:16]}{same}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": machine(), "hashes": hashes}, indent=2) + "\n")
    if before and any(before.get(k) != v for k, v in hashes.items()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
