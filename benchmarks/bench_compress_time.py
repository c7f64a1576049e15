"""How long compression takes: edgekit against what a user would run instead.

1. INT8 on EfficientNet-Lite0: edgekit's ``int8`` step (defaults: mse ranges, GPTQ rounding, bias
   correction) against ONNX Runtime's ``quantize_static`` (QDQ, per-channel, U8S8) with entropy and
   percentile calibration, on the same calibration images, variants interleaved over ``--rounds``;
   wall and per-process CPU time, and each result's top-1 agreement and KL against FP32 on
   ``--eval`` held-out images (edgekit: its fake-quant model; the peers: their ONNX graphs).
2. GPTQ (4-bit, g128, the ``weight-only`` step's defaults) on SmolLM2-135M: the block walk over all 30
   blocks at ``--gptq-windows`` calibration windows (several counts give the per-window slope, so
   the default 128 windows is extrapolated when the full run does not fit), with a profile split
   into the float forward passes, Hessian accumulation and the column solve.
3. The 4-bit ONNX export of SmolLM2 (``export_causal_lm`` on an RTN W4 g128 model), with its profile.

    python benchmarks/bench_compress_time.py [--parts int8,gptq,export] [--rounds 2] [--threads 1]
        [--gptq-windows 8,16] [--out benchmarks/results/compress_time.json]

CPU time is ``time.process_time()`` of this process (all its threads): on a shared machine wall
time grows with the other jobs, CPU time does not.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def timed(fn: Any) -> tuple[Any, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - c0


def profile_split(pr: cProfile.Profile, buckets: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Cumulative seconds of the first function matching each bucket's (file, name) substrings."""
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for label, keys in buckets.items():
        total = 0.0
        for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in stats.items():
            if any(f"{file}:{name}".endswith(k) for k in keys):
                total += ct
        out[label] = round(total, 2)
    return out


def top_functions(pr: cProfile.Profile, n: int = 12) -> list[tuple[str, float]]:
    stats = pstats.Stats(pr).stats  # type: ignore[attr-defined]
    rows = sorted(((f"{Path(f).name}:{name}", tt) for (f, _l, name), (_cc, _nc, tt, _ct, _c) in stats.items()),
                  key=lambda r: -r[1])
    return [(k, round(v, 2)) for k, v in rows[:n]]


# --------------------------------------------------------------------------------------- INT8


def bench_int8(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from bench_int8 import export, peer_quantize, run_all, session

    from edgekit.compress import StepContext
    from edgekit.compress.int8.calibration import run_module, score
    from edgekit.compress.int8.config import Int8Config
    from edgekit.compress.int8.step import apply
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    h = load_model("efficientnet-lite0")
    calib = load_samples(None, h, split="calib", limit=args.calib)
    ev = load_samples(None, h, split="eval", limit=args.eval)
    fp32 = export(h, work / "fp32")
    ref = run_all(session(fp32, threads=args.threads), ev)
    names = [s.name for s in h.inputs]
    rows: dict[str, dict[str, Any]] = {}

    def edgekit_once() -> Any:
        ctx = StepContext(calib=calib, eval=ev.subset(slice(0, 8)), progress=False)
        return apply(h, Int8Config(calib_samples=args.calib, eval_samples=8), ctx)

    variants = ["edgekit-int8"] + [f"ort-quantize_static-{m}" for m in args.peers]
    for r in range(args.rounds):
        for v in variants:
            if v == "edgekit-int8":
                q, wall, cpu = timed(edgekit_once)
                if r == 0:
                    with torch.no_grad():
                        out = run_module(q.module, ev, names)
                    rows.setdefault(v, {}).update(score(out, ref, None, None))
            else:
                m = v.rsplit("-", 1)[1]
                dst = work / f"{v}.onnx"
                _, wall, cpu = timed(lambda m=m, dst=dst: peer_quantize(fp32, dst, calib, m))
                if r == 0:
                    rows.setdefault(v, {}).update(score(run_all(session(dst, threads=args.threads), ev), ref, None, None))
            row = rows.setdefault(v, {})
            row.setdefault("wall_s", []).append(round(wall, 2))
            row.setdefault("cpu_s", []).append(round(cpu, 2))
            print(f"  int8 round {r} {v}: wall {wall:.1f} s, cpu {cpu:.1f} s", flush=True)
    for row in rows.values():
        row["wall_median_s"] = float(np.median(row["wall_s"]))
        row["cpu_median_s"] = float(np.median(row["cpu_s"]))
    ek = rows["edgekit-int8"]
    for v in variants[1:]:
        ek[f"cpu_ratio_vs_{v}"] = round(ek["cpu_median_s"] / rows[v]["cpu_median_s"], 2)
        ek[f"wall_ratio_vs_{v}"] = round(ek["wall_median_s"] / rows[v]["wall_median_s"], 2)

    # one profiled edgekit run: where the time goes
    pr = cProfile.Profile()
    pr.enable()
    edgekit_once()
    pr.disable()
    split = profile_split(pr, {
        "calibration pass (observe)": ("int8/step.py:calibrate",),
        "equalization": ("equalize.py:equalize",),
        "weight scale search": ("qdq.py:update_weight_scales",),
        "GPTQ Hessians (fx pass)": ("int8/rounding.py:input_hessians",),
        "GPTQ solve": ("int8/rounding.py:gptq_round",),
        "bias correction pass": ("equalize.py:correct_bias",),
        "trace + prepare": ("qdq.py:prepare_qdq",),
        "evaluation (8 samples)": ("calibration.py:run_module",),
        "total": ("int8/step.py:apply",),
    })
    return {"calib_images": len(calib), "eval_images": len(ev), "variants": rows, "profile_s": split,
            "profile_top_self_s": top_functions(pr)}


# --------------------------------------------------------------------------------------- GPTQ


def bench_gptq(args: argparse.Namespace) -> dict[str, Any]:
    from edgekit.compress import StepContext
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import calibration_inputs, quantize_module
    from edgekit.sources.models import load_model

    runs = []
    for w in args.gptq_windows:
        h = load_model("smollm2-135m")
        cfg = WeightOnlyConfig(calib_samples=w, eval_windows=0)
        calib = calibration_inputs(h, cfg, StepContext(progress=False))
        pr = cProfile.Profile()
        pr.enable()
        (_, info), wall, cpu = timed(lambda h=h, cfg=cfg, calib=calib: quantize_module(h.module, cfg, calib))
        pr.disable()
        split = profile_split(pr, {
            "column solve (gptq_quantize)": ("gptq.py:gptq_quantize",),
            "value Hessian (attention-mixed inputs)": ("weight_only/step.py:attention_mixed",),
            "Hessian accumulation (add_batch/add_pair)": ("gptq.py:add_batch", "gptq.py:add_pair"),
            "group inputs (partial block forwards)": ("weight_only/step.py:_group_inputs",),
            "block forwards (next block, float track)": ("weight_only/step.py:_run",),
            "total": ("weight_only/step.py:quantize_module",),
        })
        runs.append({"windows": w, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "blocks": info["blocks"],
                     "profile_s": split, "profile_top_self_s": top_functions(pr)})
        print(f"  gptq {w} windows: wall {wall:.0f} s, cpu {cpu:.0f} s; {split}", flush=True)
    out: dict[str, Any] = {"runs": runs}
    if len(runs) >= 2:  # cpu = a + b * windows
        x = np.array([r["windows"] for r in runs], float)
        y = np.array([r["cpu_s"] for r in runs], float)
        b, a = np.polyfit(x, y, 1)
        out["cpu_fit"] = {"fixed_s": round(float(a), 1), "per_window_s": round(float(b), 2),
                          "extrapolated_128_windows_s": round(float(a + 128 * b), 1)}
    return out


# --------------------------------------------------------------------------------------- export


def bench_export(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from edgekit.compress import StepContext
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import apply as weight_only_apply
    from edgekit.export.lm import export_causal_lm
    from edgekit.sources.models import load_model

    h = load_model("smollm2-135m")
    q = weight_only_apply(h, WeightOnlyConfig(method="rtn", eval_windows=0), StepContext(progress=False))
    pr = cProfile.Profile()
    pr.enable()
    _, wall, cpu = timed(lambda: export_causal_lm(q, work / "w4-onnx"))
    pr.disable()
    split = profile_split(pr, {
        "graph build (fused decoder)": ("lm_graph.py:build_fused_decoder",),
        "traced graph": ("lm.py:_traced_graph",),
        "packed-layer rewrite": ("lm.py:rewrite_packed_graph",),
        "parity check": ("lm.py:check_lm_parity",),
        "total": ("lm.py:export_causal_lm",),
    })
    print(f"  export: wall {wall:.0f} s, cpu {cpu:.0f} s; {split}", flush=True)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "profile_s": split, "profile_top_self_s": top_functions(pr)}


def machine() -> dict[str, Any]:
    import onnxruntime
    import torch

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and "model" not in flags:
                flags = line.split(":", 1)[1].strip()
        cpu_flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f" {f}" in cpu_flags]
    except (OSError, StopIteration):
        isa = []
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    return {"cpu": flags, "isa": isa, "python": platform.python_version(), "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__, "loadavg_at_start": load,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="int8,gptq,export")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime threads")
    p.add_argument("--calib", type=int, default=96, help="calibration images (both tools)")
    p.add_argument("--eval", type=int, default=200, help="held-out images for agreement and KL")
    p.add_argument("--peers", default="entropy,percentile")
    p.add_argument("--gptq-windows", default="8,16")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compress_time.json"))
    args = p.parse_args()
    args.peers = [m for m in args.peers.split(",") if m]
    args.gptq_windows = [int(w) for w in args.gptq_windows.split(",") if w]
    parts = set(args.parts.split(","))

    import torch

    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"machine": machine(), "threads": args.threads}
    with tempfile.TemporaryDirectory(prefix="edgekit-bench-compress-") as tmp:
        if "int8" in parts:
            result["int8"] = bench_int8(args, Path(tmp))
        if "gptq" in parts:
            result["gptq"] = bench_gptq(args)
        if "export" in parts:
            result["export"] = bench_export(args, Path(tmp))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))

    if "int8" in result:
        print(f"\nEfficientNet-Lite0 INT8, {result['int8']['calib_images']} calibration images, "
              f"{args.threads} thread(s), agreement/KL on {result['int8']['eval_images']} eval images")
        print(f"{'variant':32s} {'wall s':>8s} {'cpu s':>8s} {'top-1 agr':>10s} {'KL':>8s}")
        for k, r in result["int8"]["variants"].items():
            print(f"{k:32s} {r['wall_median_s']:8.1f} {r['cpu_median_s']:8.1f} {r['top1_agreement']:10.3f} "
                  f"{r['mean_kl']:8.4f}")
        print("edgekit profile (s):", result["int8"]["profile_s"])
    if "gptq" in result:
        print("\nGPTQ SmolLM2-135M:", json.dumps(result["gptq"].get("cpu_fit")), [
            (r["windows"], r["cpu_s"], r["profile_s"]) for r in result["gptq"]["runs"]])
    if "export" in result:
        print("\n4-bit export SmolLM2:", result["export"]["cpu_s"], "s CPU;", result["export"]["profile_s"])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
