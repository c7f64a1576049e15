"""Benchmark: Falcon through the fused decoder graph (``export/lm_falcon.py``): parity and decode speed.

1. Parity, on the tiny Falcon configs of ``tests/tiny_models.py`` (hidden 64, 2 layers, vocabulary
   260, seeded random weights, LayerNorm weights and biases drawn around 1 and 0) in every head
   layout Falcon has: grouped KV (``new_decoder_architecture``, 4 query heads over 2 KV heads, ``ln_attn`` + ``ln_mlp``, and with one norm), multi-query
   (Falcon-7B's), classic multi-head, and the sequential layer with biases; each float, W8 and W4
   (RTN, group 32). Recorded from the export's own checks: the largest logit difference to the
   PyTorch model (a 16-token prefill and a decode step, fp32 compute), the same far into the context,
   the IO-bound KV-cache loop against the plain loop, the distance to the float model; and greedy
   decoding agreement: 24 tokens generated through the ONNX KV cache (``KVCacheDecoder``) against
   transformers' greedy tokens on its own KV cache after 4 random-token prompts of 16.
2. Decode speed of a Falcon-shaped model: the grouped-KV layout of Falcon-40B/180B at a size that
   fits here (hidden 1024, 16 query heads of 64 over 2 KV heads, 8 layers, GELU MLP 4x, Falcon's
   65,024-token vocabulary, tied embedding; 153M parameters, random weights: speed only), float
   against W4 (RTN g128, MatMulNBits with int8 compute, the export's defaults), one ONNX Runtime
   thread, one-token decode steps after a 64-token prompt, interleaved round-robin; wall and
   per-process CPU time per step.

    python benchmarks/bench_falcon_export.py                 # both parts
    python benchmarks/bench_falcon_export.py --parity-only
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "tests", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from machine_info import machine  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LAYOUTS: dict[str, dict[str, Any]] = {
    "grouped KV, 2 norms": {},
    "grouped KV, 1 norm": {"num_ln_in_parallel_attn": 1},
    "multi-query": {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None},
    "multi-head": {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4},
    "sequential, biases": {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None,
                           "parallel_attn": False, "bias": True},
}
PROMPTS, PROMPT_LEN, NEW_TOKENS = 4, 16, 24
SHAPED = dict(vocab_size=65024, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_kv_heads=2,
              new_decoder_architecture=True, max_position_embeddings=2048, bos_token_id=11, eos_token_id=11)


def _ctx() -> Any:
    from edgekit.compress import StepContext

    return StepContext(calib="lee-news", eval="wikipedia", progress=False)


def _compressed(folder: Path, bits: int, group: int, out: Path) -> Any:
    from edgekit.compress import compress, load_compressed, make_config
    from edgekit.loading import load_model

    cfg = make_config("weight-only", {"method": "rtn", "bits": bits, "group_size": group, "eval_windows": 0})
    return load_compressed(compress(load_model(str(folder)), [("weight-only", cfg)], out, _ctx()))


def _torch_greedy(hf: Any, prompt: np.ndarray) -> np.ndarray:
    """``NEW_TOKENS`` greedy tokens from transformers with its own KV cache (``DynamicCache``), argmax
    of the raw logits: ``generate`` would apply its logits processors (EOS suppression) on top."""
    import torch
    from transformers import DynamicCache

    cache, ids, tokens = DynamicCache(), torch.from_numpy(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
            cache, ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tokens.append(int(ids))
    return np.array(tokens)


def greedy_agreement(handle: Any, onnx_path: Path) -> float:
    """Share of greedy tokens the ONNX KV-cache loop and transformers agree on (tokens up to the first
    disagreement of each prompt count; after it the two continue different texts)."""

    from edgekit.export.lm import lm_session
    from edgekit.kv_cache import KVCacheDecoder

    hf = handle.module.model if hasattr(handle.module, "model") else handle.module
    decoder = KVCacheDecoder(lm_session(onnx_path, threads=1, fp32_compute=True), max_length=PROMPT_LEN + NEW_TOKENS)
    rng = np.random.default_rng(0)
    agree = total = 0
    for _ in range(PROMPTS):
        prompt = rng.integers(0, 256, (1, PROMPT_LEN)).astype(np.int64)
        got = decoder.generate(prompt, NEW_TOKENS)[0]
        ref = _torch_greedy(hf, prompt)
        same = got == ref
        first_diff = int(np.argmin(same)) if not same.all() else len(same)
        agree += first_diff
        total += len(same)
    return agree / total


def parity_table(work: Path) -> list[dict[str, Any]]:
    from edgekit.export.lm import export_causal_lm
    from edgekit.loading import load_model

    rows = []
    for name, over in LAYOUTS.items():
        folder = save_tiny("falcon", work / name.replace(" ", "_").replace(",", ""), vary_norms=True, **over)
        for variant in ("float", "W8", "W4"):
            t0, c0 = time.perf_counter(), time.process_time()
            if variant == "float":
                handle = load_model(str(folder))
            else:
                handle = _compressed(folder, 8 if variant == "W8" else 4, 32, folder.parent / variant)
            out = export_causal_lm(handle, folder.parent / f"onnx-{variant}", accuracy_level=None)
            m = json.loads((out / "manifest.json").read_text())
            parity = m["metrics"]["parity"]
            row = {"layout": name, "weights": variant, "graph": m["config"]["graph"], "passed": parity["passed"],
                   "max_abs_diff": parity["max_abs_diff"], "max_rel_diff": parity["max_rel_diff"],
                   "argmax_agreement": parity["argmax_agreement"],
                   "long_context_max_abs_diff": parity["long_context"]["max_abs_diff"],
                   "io_bound_vs_plain": parity["io_binding"]["max_abs_diff_to_plain_loop"],
                   "float_relative_error": m["metrics"].get("parity_float", {}).get("relative_error"),
                   "greedy_agreement": greedy_agreement(handle, out / "model.onnx"),
                   "seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1)}
            rows.append(row)
            print(f"{name:22s} {variant:5s} {row['graph']:6s} max|d| {row['max_abs_diff']:.2e} rel "
                  f"{row['max_rel_diff']:.1e} long {row['long_context_max_abs_diff']:.1e} greedy "
                  f"{row['greedy_agreement']:.3f} float-rel {row['float_relative_error']}", flush=True)
    return rows


def decode_speed(work: Path, rounds: int, new_tokens: int) -> dict[str, Any]:
    import torch
    from tiny_models import byte_tokenizer
    from transformers import FalconConfig, FalconForCausalLM

    from edgekit.export.lm import export_causal_lm, lm_session
    from edgekit.kv_cache import KVCacheDecoder
    from edgekit.loading import load_model

    torch.manual_seed(0)
    model = FalconForCausalLM(FalconConfig(**SHAPED)).eval()
    params = sum(p.numel() for p in model.parameters())
    folder = work / "falcon-shaped"
    model.save_pretrained(folder, safe_serialization=True)
    byte_tokenizer().save_pretrained(folder)
    del model
    paths = {"FP32": export_causal_lm(load_model(str(folder)), work / "fp32-onnx") / "model.onnx",
             "W4 g128": export_causal_lm(_compressed(folder, 4, 128, work / "w4"), work / "w4-onnx") / "model.onnx"}
    sizes = {k: sum(f.stat().st_size for f in v.parent.iterdir() if f.name.startswith("model.onnx"))
             for k, v in paths.items()}
    decoders = {k: KVCacheDecoder(lm_session(v, threads=1), max_length=64 + new_tokens + 1) for k, v in paths.items()}
    prompt = np.random.default_rng(0).integers(0, 256, (1, 64)).astype(np.int64)
    rec: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in decoders}
    for d in decoders.values():  # warm-up
        d.reset()
        d.forward(prompt)
        d.forward(prompt[:, :1])
    for _ in range(rounds):
        for name, d in decoders.items():
            d.reset()
            d.forward(prompt)
            token = prompt[:, :1]
            for i in range(new_tokens):
                c0, t0 = time.process_time(), time.perf_counter()
                d.forward(token)
                rec[name]["wall"].append((time.perf_counter() - t0) * 1e3)
                rec[name]["cpu"].append((time.process_time() - c0) * 1e3)
                token = prompt[:, (i * 7) % 64:(i * 7) % 64 + 1]
    out = {"parameters": params, "config": SHAPED, "prompt": 64, "steps_per_round": new_tokens, "rounds": rounds}
    for name, r in rec.items():
        out[name] = {"step_ms": statistics.median(r["wall"]), "step_cpu_ms": statistics.median(r["cpu"]),
                     "step_cpu_p90_ms": float(np.percentile(r["cpu"], 90)), "onnx_bytes": sizes[name]}
        print(f"{name:8s} decode step {out[name]['step_ms']:.2f} ms wall, {out[name]['step_cpu_ms']:.2f} ms CPU "
              f"(p90 {out[name]['step_cpu_p90_ms']:.2f}), {sizes[name] / 1e6:.0f} MB", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parity-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(RESULTS / "falcon_export.json"))
    args = ap.parse_args()
    import torch

    import edgekit

    torch.set_num_threads(1)
    info: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d")}
    import onnxruntime
    import transformers

    info["versions"] = {"edgekit": edgekit.__version__, "onnxruntime": onnxruntime.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__}
    work = Path(tempfile.mkdtemp(prefix="edgekit-bench-falcon-"))
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        info["parity"] = parity_table(work)
        if not args.parity_only:
            info["decode"] = decode_speed(work, args.rounds, args.new_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["seconds"] = round(time.perf_counter() - t0, 1)
    info["cpu_seconds"] = round(time.process_time() - c0, 1)
    info["machine"]["load_avg_1m_end"] = machine()["load_avg_1m"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=2))
    print(f"wrote {args.out} ({info['seconds']} s wall, {info['cpu_seconds']} s CPU)")


if __name__ == "__main__":
    main()
