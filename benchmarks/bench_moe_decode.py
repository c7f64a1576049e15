"""Benchmark: decode of a small mixture of experts against its dense twin, float and 4-bit, on the CPU.

Models (random weights, seeded; the cost of a decode step does not depend on what the weights are):

* ``moe``: a Mixtral-shaped decoder (``MixtralForCausalLM``): hidden 512, 4 layers, 8 query heads
  and 2 KV heads of 64, 8 experts of intermediate 1024, top-2, vocabulary 8192;
* ``dense``: its twin (``MistralForCausalLM``, the same layer without routing) with the same
  active parameters per token: one MLP of intermediate 2 x 1024 = 2048.

Each in float32 and as RTN W4 g128 (``edgekit compress --bits 4 --method rtn``: experts and dense
MLPs packed alike, the router in float), exported by ``export_causal_lm`` (the fused decoder graph:
the MoE layers as one ``MoE`` / ``QMoE`` node each, parity checked against PyTorch as every export
is), then decoded through the IO-bound KV cache: one decode step after a ``--context``-token
prompt, 1 thread, variants interleaved round by round, medians of wall and per-process CPU time (on
a shared machine wall time includes waiting for a core: CPU time is the figure to trust).

Beside it, one MoE layer alone at the same sizes, one token: the routed contrib node against the
routing written in standard ops with every expert computed (one MatMul(NBits) over all experts'
gate/up rows, the routing weights scattered over the experts, one over all experts' down columns):
exact, but E/k times the work; what made the fused graph take the contrib nodes.

    python benchmarks/bench_moe_decode.py            # table + benchmarks/results/moe_decode.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_decode import OrtVariant, time_variants  # noqa: E402
from machine_info import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 512, 4, 8, 2, 8192
EXPERTS, TOP_K, EXPERT_INTER = 8, 2, 1024
GROUP = 128


def _common() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, max_position_embeddings=1024, tie_word_embeddings=False,
                bos_token_id=257, eos_token_id=258, pad_token_id=256)


def save_models(work: Path) -> dict[str, Path]:
    """The MoE and its dense twin as Hugging Face folders (byte-level tokenizer: the ids are random)."""
    import torch
    from tiny_models import byte_tokenizer
    from transformers import MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM

    made = {}
    for name, cls, cfg in (
            ("moe", MixtralForCausalLM, MixtralConfig(**_common(), intermediate_size=EXPERT_INTER,
                                                      num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)),
            ("dense", MistralForCausalLM, MistralConfig(**_common(), intermediate_size=TOP_K * EXPERT_INTER))):
        torch.manual_seed(0)
        folder = work / name
        cls(cfg).eval().save_pretrained(folder, safe_serialization=True)
        byte_tokenizer().save_pretrained(folder)
        made[name] = folder
    return made


def weight_bytes(folder: Path) -> dict[str, float]:
    """File MB, all weights MB, and weights read per decoded token MB: every initializer but the
    embedding table (one row read) and the rotary inputs, with a routed node's experts counted k/E."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    size = {n: len(i.raw_data) if i.raw_data else onnx.numpy_helper.to_array(i).nbytes for n, i in inits.items()}
    embed = {n.input[0] for n in model.graph.node if n.op_type in ("Gather", "GatherBlockQuantized")
             and n.input[0] in inits and size[n.input[0]] > 1e6}
    experts = {name for n in model.graph.node if n.op_type in ("MoE", "QMoE") for name in n.input[2:] if name in inits}
    total = sum(size.values())
    per_token = sum(s for n, s in size.items() if n not in embed and n not in experts and "rotary" not in n)
    per_token += sum(size[n] for n in experts) * TOP_K / EXPERTS
    files = sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx"))
    return {"file_mb": files / 1e6, "weights_mb": total / 1e6, "read_per_token_mb": per_token / 1e6}


# --- one MoE layer: the routed node against every expert computed in standard ops ----------------------


def _layer_graphs(bits: int | None, rng: np.random.Generator) -> dict[str, Any]:
    """(routed, every-expert) graphs of one MoE layer on x (1, 1, HIDDEN), float or 4-bit (block GROUP)."""
    from onnx import TensorProto, helper, numpy_helper

    E, H, inter, k = EXPERTS, HIDDEN, EXPERT_INTER, TOP_K
    router = (rng.standard_normal((H, E)) * 0.05).astype(np.float32)
    x_in = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, H])]
    y_out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    ms = "com.microsoft"
    if bits is None:
        fc1 = (rng.standard_normal((E, 2 * inter, H)) * 0.05).astype(np.float32)  # interleaved gate/up rows
        fc2 = (rng.standard_normal((E, H, inter)) * 0.05).astype(np.float32)
    else:
        fc1_q = rng.integers(0, 256, (E, 2 * inter, H // 2), dtype=np.uint8)
        fc2_q = rng.integers(0, 256, (E, H, inter // 2), dtype=np.uint8)
        fc1_s = (rng.random((E, 2 * inter, H // GROUP)) * 0.01).astype(np.float32)
        fc2_s = (rng.random((E, H, inter // GROUP)) * 0.01).astype(np.float32)
        fc1_z = np.full((E, 2 * inter, H // GROUP // 2), 0x88, np.uint8)
        fc2_z = np.full((E, H, inter // GROUP // 2), 0x88, np.uint8)
    swiglu = dict(activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0, k=k,
                  normalize_routing_weights=1)
    common = [helper.make_node("MatMul", ["x", "router"], ["logits3"]),
              helper.make_node("Reshape", ["logits3", "rows"], ["logits"])]
    inits = {"router": router, "rows": np.array([-1, E], np.int64)}
    if bits is None:
        routed = [helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain=ms, **swiglu)]
        r_inits = {"fc1": fc1, "fc2": fc2}
    else:
        routed = [helper.make_node("QMoE", ["x", "logits", "fc1", "fc1_s", "", "fc2", "fc2_s", "", "", "", "",
                                            "fc1_z", "fc2_z"], ["y"], domain=ms, expert_weight_bits=4,
                                   block_size=GROUP, accuracy_level=4, **swiglu)]
        r_inits = {"fc1": fc1_q, "fc1_s": fc1_s, "fc1_z": fc1_z, "fc2": fc2_q, "fc2_s": fc2_s, "fc2_z": fc2_z}
    # every expert: gate/up of all experts in one matmul (N = E*2I), down of all experts stacked along K
    # (K = E*inter), the routing weight of each expert scattered into a dense (E,) vector (zero if not chosen)
    dense = [helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["top_w", "top_i"], axis=-1),
             helper.make_node("ReduceSum", ["top_w", "last"], ["top_sum"], keepdims=1),
             helper.make_node("Div", ["top_w", "top_sum"], ["top_norm"]),
             helper.make_node("ScatterElements", ["zeros_e", "top_i", "top_norm"], ["route"], axis=-1),
             helper.make_node("Reshape", ["route", "route_shape"], ["route3"])]
    d_inits: dict[str, np.ndarray] = {"k": np.array([k], np.int64), "last": np.array([-1], np.int64),
                                      "zeros_e": np.zeros((1, E), np.float32),
                                      "route_shape": np.array([1, E, 1], np.int64),
                                      "gu_shape": np.array([1, E, inter, 2], np.int64),
                                      "flat": np.array([1, 1, E * inter], np.int64)}
    if bits is None:
        d_inits["w_gu"] = fc1.reshape(E * 2 * inter, H).T.copy()  # (H, E*2I)
        d_inits["w_down"] = fc2.transpose(0, 2, 1).reshape(E * inter, H).copy()  # (E*inter, H)
        dense += [helper.make_node("MatMul", ["x", "w_gu"], ["gu"])]
    else:
        d_inits.update(gu_q=fc1_q.reshape(E * 2 * inter, H // GROUP, GROUP // 2), gu_s=fc1_s.reshape(-1),
                       gu_z=fc1_z.reshape(-1),
                       down_q=fc2_q.reshape(E, H, inter // GROUP, GROUP // 2).transpose(1, 0, 2, 3).reshape(
                           H, E * inter // GROUP, GROUP // 2).copy(),
                       down_s=fc2_s.transpose(1, 0, 2).reshape(-1).copy(),
                       down_z=fc2_z.transpose(1, 0, 2).reshape(-1).copy())
        dense += [helper.make_node("MatMulNBits", ["x", "gu_q", "gu_s", "gu_z"], ["gu"], domain=ms, K=H, N=E * 2 * inter,
                                   bits=4, block_size=GROUP, accuracy_level=4)]
    dense += [helper.make_node("Reshape", ["gu", "gu_shape"], ["gu4"]),  # (1, E, inter, 2): interleaved g, u
              helper.make_node("Split", ["gu4"], ["g", "u"], axis=-1, num_outputs=2),
              helper.make_node("QuickGelu", ["g"], ["act"], domain=ms, alpha=1.0),
              helper.make_node("Mul", ["act", "u"], ["h4"]),
              helper.make_node("Reshape", ["h4", "route_h"], ["h"]),  # (1, E, inter)
              helper.make_node("Mul", ["h", "route3"], ["hw"]),
              helper.make_node("Reshape", ["hw", "flat"], ["hflat"])]
    d_inits["route_h"] = np.array([1, E, inter], np.int64)
    if bits is None:
        dense += [helper.make_node("MatMul", ["hflat", "w_down"], ["y"])]
    else:
        dense += [helper.make_node("MatMulNBits", ["hflat", "down_q", "down_s", "down_z"], ["y"], domain=ms,
                                   K=E * inter, N=H, bits=4, block_size=GROUP, accuracy_level=4)]

    def model(nodes: list[Any], extra: dict[str, np.ndarray]) -> bytes:
        g = helper.make_graph(common + nodes, "moe-layer", x_in, y_out,
                              [numpy_helper.from_array(a, n) for n, a in {**inits, **extra}.items()])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ms, 1)])
        m.ir_version = 10
        return m.SerializeToString()

    return {"routed": model(routed, r_inits), "every expert": model(dense, d_inits)}


def time_layer(runs: int, rounds: int) -> list[dict[str, Any]]:
    import onnxruntime as ort

    rows = []
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, HIDDEN)).astype(np.float32)
    for bits in (None, 4):
        graphs = _layer_graphs(bits, rng)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        sessions = {n: ort.InferenceSession(g, so, providers=["CPUExecutionProvider"]) for n, g in graphs.items()}
        outs = {n: s.run(None, {"x": x})[0] for n, s in sessions.items()}
        ref = outs["routed"]
        agree = float(np.abs(outs["every expert"] - ref).max() / max(float(np.abs(ref).max()), 1e-30))
        rec: dict[str, list[float]] = {n: [] for n in sessions}
        for _ in range(rounds):
            for n, s in sessions.items():
                c0 = time.process_time()
                for _ in range(runs):
                    s.run(None, {"x": x})
                rec[n].append((time.process_time() - c0) * 1e3 / runs)
        for n in sessions:
            rows.append({"weights": "fp32" if bits is None else "W4 g128", "routing": n,
                         "cpu_ms": statistics.median(rec[n]), "max_rel_diff_to_routed": agree if n != "routed" else 0.0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "moe_decode.json"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from edgekit.compress import StepContext, compress, load_compressed, make_config
    from edgekit.export.lm import export_causal_lm
    from edgekit.loading import load_model

    info: dict[str, Any] = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            "versions": {}}
    import onnxruntime
    import transformers

    info["versions"] = {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
                        "transformers": transformers.__version__}
    info["shapes"] = {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS, "vocab": VOCAB,
                      "experts": EXPERTS, "top_k": TOP_K, "expert_intermediate": EXPERT_INTER,
                      "dense_intermediate": TOP_K * EXPERT_INTER, "group": GROUP}
    with tempfile.TemporaryDirectory(prefix="edgekit-moe-bench-") as tmp:
        work = Path(tmp)
        folders = save_models(work)
        exports: dict[str, Path] = {}
        export_info: dict[str, Any] = {}
        for name, folder in folders.items():
            handle = load_model(str(folder))
            info[f"{name}_parameters_m"] = round(sum(p.numel() for p in handle.module.parameters()) / 1e6, 2)
            for label, h in (("fp32", handle), ("W4", None)):
                if h is None:
                    cfg = make_config("weight-only", {"method": "rtn", "bits": 4, "group_size": GROUP, "eval_windows": 0})
                    ctx = StepContext(calib="lee-news", eval="wikipedia", train="lee-news", progress=False)
                    c0 = time.process_time()
                    h = load_compressed(compress(load_model(str(folder)), [("weight-only", cfg)], work / f"{name}-w4", ctx))
                    export_info[f"{name} {label} compress_cpu_s"] = round(time.process_time() - c0, 1)
                c0 = time.process_time()
                out = export_causal_lm(h, work / f"{name}-{label}-onnx")
                manifest = json.loads((out / "manifest.json").read_text())
                export_info[f"{name} {label}"] = {"export_cpu_s": round(time.process_time() - c0, 1),
                                                  "parity_max_abs_diff": manifest["metrics"]["parity"]["max_abs_diff"],
                                                  "parity_passed": manifest["metrics"]["parity"]["passed"]}
                exports[f"{name} {label}"] = out
                del h
        info["exports"] = export_info
        prompt = np.random.default_rng(1).integers(0, 256, args.context).astype(np.int64)
        variants = [OrtVariant(n, f, threads=1, max_length=args.context + args.new_tokens + 8)
                    for n, f in exports.items()]
        timing = time_variants(variants, prompt, args.new_tokens, args.rounds)
        rows = []
        for n, f in exports.items():
            rows.append({"variant": n, **weight_bytes(f), **timing[n]})
        del variants
    info["decode"] = rows
    info["layer"] = time_layer(runs=200, rounds=5)
    info["load_avg_after"] = round(os.getloadavg()[0], 2)
    print(f"\nDecode after {args.context} tokens, 1 thread, medians over {args.rounds} interleaved rounds x "
          f"{args.new_tokens} steps ({info['machine']['cpu']}; load {info['machine']['load_avg_1m']} -> "
          f"{info['load_avg_after']})")
    print(f"| variant | file MB | weights read/token MB | decode CPU ms | decode wall ms | tokens/s (CPU) | "
          f"prefill {args.context} CPU ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['file_mb']:.1f} | {r['read_per_token_mb']:.1f} | {r['step_cpu_ms']:.2f} | "
              f"{r['step_ms']:.2f} | {1e3 / r['step_cpu_ms']:.0f} | {r['prefill_cpu_ms']:.0f} |")
    print("\nOne MoE layer, one token, 1 thread (CPU ms per call, median of 5 rounds x 200)")
    print("| weights | routing | CPU ms | max relative difference to the routed node |")
    print("|---|---|---|---|")
    for r in info["layer"]:
        print(f"| {r['weights']} | {r['routing']} | {r['cpu_ms']:.3f} | {r['max_rel_diff_to_routed']:.2g} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
