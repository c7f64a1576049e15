"""Detection pipeline benchmark (issue 16): examples/driver-monitoring.yaml, FP32 versus
compressed (INT8 detector and landmark net), frame-level, on this CPU.

Both variants are built and evaluated by ``edgekit run`` (shared cache); then the same
real evaluation frames go through each variant's chained stages as deployed (1 thread),
interleaved: in every round each variant times a block of frames, the order alternating,
so a neighbour's load hits both alike. Reported per variant: frame-level p50/p99 (wall
and per-process CPU time), each stage's p50/p99 and share of the mean frame, the sum of
the stage p99s beside the measured frame p99 (p99s do not add), and detection quality:
mAP@0.5 of the compressed detector against the float detector's detections, and both
against the frames' ground truth.

    python benchmarks/bench_pipeline.py [--rounds 10] [--frames-per-round 30] [--cache DIR]
        [--out benchmarks/results/pipeline.json]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")

from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from edgekit.artifact import atomic_write_json, now_iso, package_versions  # noqa: E402
from edgekit.build import load_engine  # noqa: E402
from edgekit.pipelines.frames import FrameRunner, callable_stage, engine_stage, to_frames  # noqa: E402
from edgekit.pipelines.recipe import parse_recipe, read_recipe_data  # noqa: E402
from edgekit.pipelines.run import _import, run_recipe  # noqa: E402

RECIPE = ROOT / "examples" / "driver-monitoring.yaml"


def variants() -> dict[str, dict[str, Any]]:
    raw = read_recipe_data(RECIPE)
    raw["profile"] = {"warmup_ms": 0, "duration_s": 0.0, "iterations": 5, "threads": 1, "max_repeats": 0,
                      "node_profile": False}
    fp32 = copy.deepcopy(raw)
    fp32["name"] = "driver-monitoring-fp32"
    for s in fp32["stages"]:
        s.pop("steps", None)
        if "evaluate" in s:
            s["evaluate"] = {k: v for k, v in s["evaluate"].items() if k not in ("min", "max")}
    return {"fp32": fp32, "int8": raw}


def stages_of(recipe: Any, result: Any) -> tuple[list[Any], list[Any]]:
    stages, engines = [], []
    for spec, r in zip(recipe.stages, result.stages):
        if spec.callable:
            stages.append(callable_stage(spec.name, _import(spec.callable), spec.inputs or None, spec.feeds))
        else:
            e = load_engine(r.artifacts["engine"], threads=1)
            engines.append(e)
            stages.append(engine_stage(spec.name, e, spec.feeds))
    return stages, engines


def pct(a: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(a), q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--frames-per-round", type=int, default=30)
    ap.add_argument("--cache", default=None, help="edgekit run cache (default: a folder under runs/)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline.json"))
    args = ap.parse_args()
    cache = Path(args.cache) if args.cache else ROOT / "runs" / "bench-pipeline-cache"
    t_build = time.perf_counter()
    built: dict[str, tuple[Any, Any]] = {}
    for name, data in variants().items():
        recipe = parse_recipe(data, str(RECIPE))
        result = run_recipe(recipe, ROOT / "runs" / f"bench-pipeline-{name}", cache_dir=cache, progress=False)
        built[name] = (recipe, result)
    build_s = time.perf_counter() - t_build
    recipe0 = built["int8"][0]
    frames = to_frames(_import(recipe0.frames)(), ["image"], recipe0.frames)
    runners: dict[str, FrameRunner] = {}
    engines: list[Any] = []
    for name, (recipe, result) in built.items():
        stages, es = stages_of(recipe, result)
        engines += es
        runners[name] = FrameRunner(stages)
        runners[name].check(frames[0])
    samples: dict[str, dict[str, Any]] = {n: {"total": [], "cpu": [], "stages": {s.name: [] for s in r.stages}}
                                          for n, r in runners.items()}
    for runner in runners.values():  # warm-up
        for f in frames[:8]:
            runner.run(f)
    k = 0
    for rnd in range(args.rounds):
        order = list(runners) if rnd % 2 == 0 else list(reversed(runners))
        for name in order:
            runner, rec = runners[name], samples[name]
            for _ in range(args.frames_per_round):
                c0 = time.process_time()
                total, times, _ = runner.run(frames[k % len(frames)])
                rec["cpu"].append((time.process_time() - c0) * 1e3)
                k += 1
                rec["total"].append(total)
                for s, v in times.items():
                    rec["stages"][s].append(v)
    for r in runners.values():
        r.close()
    for e in engines:
        e.close()
    report: dict[str, Any] = {"date": now_iso(), "machine": machine(), "versions": package_versions(),
                              "recipe": str(RECIPE.relative_to(ROOT)), "rounds": args.rounds,
                              "frames_per_round": args.frames_per_round, "distinct_frames": len(frames),
                              "build_and_eval_seconds": round(build_s, 1), "variants": {}}
    print(f"{'variant':8} {'frame p50':>9} {'frame p99':>9} {'CPU p50':>8} {'sum stage p99s':>14} "
          f"{'p99 gap':>8}  stages (share, p50/p99 ms)")
    for name, rec in samples.items():
        result = built[name][1]
        mean = float(np.mean(rec["total"]))
        stages = {s: {"p50_ms": pct(v, 50), "p99_ms": pct(v, 99), "share": float(np.mean(v)) / mean}
                  for s, v in rec["stages"].items()}
        sum_p99 = sum(v["p99_ms"] for v in stages.values())
        det = next(r for r in result.stages if r.stage == "face-detector").metrics
        onet = next(r for r in result.stages if r.stage == "landmarks").metrics
        v = {"frame_p50_ms": pct(rec["total"], 50), "frame_p99_ms": pct(rec["total"], 99),
             "frame_cv": float(np.std(rec["total"], ddof=1) / mean), "frame_cpu_p50_ms": pct(rec["cpu"], 50),
             "frame_cpu_p99_ms": pct(rec["cpu"], 99), "frames": len(rec["total"]), "stages": stages,
             "sum_of_stage_p99_ms": sum_p99, "detector_map50_vs_float": det.get("map50"),
             "detector_map50_ground_truth": det.get("map50_ground_truth"),
             "detector_score_drift": det.get("score_drift_mean"), "landmarks_top1_agreement": onet.get("top1_agreement"),
             "sizes_mb": {r.stage: r.size_mb for r in result.stages if r.size_mb is not None}}
        report["variants"][name] = v
        print(f"{name:8} {v['frame_p50_ms']:9.2f} {v['frame_p99_ms']:9.2f} {v['frame_cpu_p50_ms']:8.2f} "
              f"{sum_p99:14.2f} {sum_p99 - v['frame_p99_ms']:+8.2f}  "
              + ", ".join(f"{s} {x['share']:.0%} {x['p50_ms']:.2f}/{x['p99_ms']:.2f}" for s, x in stages.items()))
    f, q = report["variants"]["fp32"], report["variants"]["int8"]
    report["ratios"] = {"frame_p50_fp32_over_int8": f["frame_p50_ms"] / q["frame_p50_ms"],
                        "frame_p99_fp32_over_int8": f["frame_p99_ms"] / q["frame_p99_ms"],
                        "frame_cpu_p50_fp32_over_int8": f["frame_cpu_p50_ms"] / q["frame_cpu_p50_ms"]}
    print(f"detector mAP@0.5 vs float: int8 {q['detector_map50_vs_float']}; ground truth: fp32 "
          f"{f['detector_map50_ground_truth']}, int8 {q['detector_map50_ground_truth']}; score drift "
          f"{q['detector_score_drift']}; O-Net top-1 agreement int8 {q['landmarks_top1_agreement']}")
    print(f"speed-up fp32/int8: frame p50 {report['ratios']['frame_p50_fp32_over_int8']:.2f}x, p99 "
          f"{report['ratios']['frame_p99_fp32_over_int8']:.2f}x, CPU p50 "
          f"{report['ratios']['frame_cpu_p50_fp32_over_int8']:.2f}x; load avg {report['machine']['load_avg_1m']}")
    atomic_write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
