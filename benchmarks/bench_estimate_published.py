"""``edgekit estimate`` against published device measurements.

Graphs are built from the architectures in published_models.py (random weights) and
estimated on the matching target and precision with TensorRT's fusions:

| model | target | precision | published | source |
|---|---|---|---|---|
| ResNet-50 v1.5 224 | jetson-agx-orin-64 | int8 | 0.64 ms p90 | MLPerf Inference v3.1, closed, edge, single-stream |
| BERT-large seq 384 (BERT-99) | jetson-agx-orin-64 | int8 | 5.70 ms p90 | MLPerf Inference v3.1, closed, edge, single-stream |
| YOLO11 n/s/m 640 | jetson-agx-orin-64 | fp16 | 2.60 / 3.68 / 6.79 ms | Ultralytics YOLO11 docs, NVIDIA Jetson benchmarks |
| YOLO11 n/s/m 640 | jetson-agx-orin-64 | int8 | 2.45 / 3.01 / 5.12 ms | same |

The target's factors (conv, memory, kernel overhead, host copy bandwidth) are tuned on the
TUNE rows only and the error reported on the others.

    python benchmarks/bench_estimate_published.py              # table + JSON
    python benchmarks/bench_estimate_published.py --defaults   # no tuning: the target file as it is

Writes benchmarks/results/estimate_published.json and the held-out errors to
edgekit/estimate/validation.json.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

OUT = ROOT / "benchmarks" / "results" / "estimate_published.json"
TARGET = "jetson-agx-orin-64"
MLPERF = "MLPerf Inference v3.1 edge closed, single-stream p90, Jetson AGX Orin 64GB (JetPack 5.1.1, TensorRT 8.5.2)"
ULTRA = "Ultralytics docs, YOLO11 on NVIDIA Jetson AGX Orin 64GB, TensorRT, 640"
# (case, graph, precision, published ms, source, split)
PUBLISHED = [
    ("ResNet-50 int8", "resnet50", "int8", 0.64, MLPERF, "tune"),
    ("YOLO11n fp16", "yolo11n", "fp16", 2.60, ULTRA, "tune"),
    ("YOLO11m fp16", "yolo11m", "fp16", 6.79, ULTRA, "tune"),
    ("YOLO11s fp16", "yolo11s", "fp16", 3.68, ULTRA, "held-out"),
    ("YOLO11n int8", "yolo11n", "int8", 2.45, ULTRA, "held-out"),
    ("YOLO11s int8", "yolo11s", "int8", 3.01, ULTRA, "tune"),
    ("YOLO11m int8", "yolo11m", "int8", 5.12, ULTRA, "held-out"),
    ("BERT-99 (BERT-large, seq 384) int8", "bert-large", "int8", 5.70, MLPERF, "held-out"),
]
TUNED_KEYS = ("conv", "memory", "host_copy_gbs")  # int8 convolutions share the conv factor (2x the peak)


def graphs() -> dict[str, tuple[str, dict[str, int]]]:
    """graph name -> (ONNX path, dims), exported once into the cache."""
    import torch
    from bench_estimate import _cache
    from published_models import YOLO11, Bert, ResNet50, export

    out: dict[str, tuple[str, dict[str, int]]] = {}
    torch.manual_seed(0)
    todo = {
        "resnet50": lambda p: export(ResNet50(), (torch.randn(1, 3, 224, 224),), ["input"], p),
        "yolo11n": lambda p: export(YOLO11("n"), (torch.randn(1, 3, 640, 640),), ["images"], p),
        "yolo11s": lambda p: export(YOLO11("s"), (torch.randn(1, 3, 640, 640),), ["images"], p),
        "yolo11m": lambda p: export(YOLO11("m"), (torch.randn(1, 3, 640, 640),), ["images"], p),
        "bert-large": lambda p: export(Bert(24, 1024, 16, 4096), (torch.zeros(1, 384, dtype=torch.long),
                                       torch.zeros(1, 384, dtype=torch.long), torch.ones(1, 384, dtype=torch.long)),
                                       ["input_ids", "token_type_ids", "attention_mask"], p),
    }
    for name, make in todo.items():
        path = _cache() / f"published-{name}.onnx"
        if not path.is_file():
            t0 = time.perf_counter()
            make(str(path))
            print(f"exported {name} in {time.perf_counter() - t0:.0f} s", flush=True)
        out[name] = (str(path), {})
    return out


def _est(paths: dict[str, tuple[str, dict[str, int]]], graph: str, precision: str, eff: dict[str, float] | None,
         overhead: float | None) -> Any:
    from edgekit.estimate import estimate

    path, dims = paths[graph]
    return estimate(path, TARGET, precision, dims=dims, runtime="tensorrt", efficiency=eff,
                    kernel_overhead_us=overhead, calibrated=False)


def tune(paths: dict[str, tuple[str, dict[str, int]]], rows: list[tuple[Any, ...]]) -> tuple[dict[str, float], float]:
    import numpy as np
    from scipy.optimize import minimize

    from edgekit.estimate.efficiency import roofs_for
    from edgekit.targets import load_target

    base = roofs_for(load_target(TARGET), calibrated=False)
    start = {"conv": base.class_eff("conv", "fp16"), "conv:int8": base.class_eff("conv", "int8"),
             "memory": base.eff["memory"], "host_copy_gbs": base.host_copy_gbs or 10.0}
    x0 = np.log([start[k] for k in TUNED_KEYS] + [base.overhead_us])

    def unpack(x: Any) -> tuple[dict[str, float], float]:
        v = np.exp(np.clip(x, math.log(1e-3), math.log(100.0)))
        return {k: float(v[i] if k == "host_copy_gbs" else min(v[i], 1.0)) for i, k in enumerate(TUNED_KEYS)}, \
            float(v[-1])

    def loss(x: Any) -> float:
        eff, ov = unpack(x)
        errs = [math.log(_est(paths, g, p, eff, ov).total_ms / ms) for _, g, p, ms, _, _ in rows]
        return float(sum(e * e for e in errs)) + 0.02 * float(np.sum((x - x0) ** 2))

    res = minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 200, "xatol": 1e-3, "fatol": 1e-5})
    return unpack(res.x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--defaults", action="store_true", help="no tuning: the target file's factors")
    args = ap.parse_args()
    from edgekit.artifact import machine_info, package_versions

    paths = graphs()
    tune_rows = [r for r in PUBLISHED if r[5] == "tune"]
    eff, overhead = (None, None) if args.defaults else tune(paths, tune_rows)
    if eff is not None:
        print("tuned on " + ", ".join(r[0] for r in tune_rows) + ": "
              + ", ".join(f"{k} {v:.3f}" for k, v in eff.items()) + f", kernel overhead {overhead:.2f} us")
    rows = []
    print(f"\n{'split':<9}{'case':<38}{'published':>10}{'estimate':>10}{'error':>8}{'range':>18}{'kernels':>8}"
          f"  fusions")
    for case, g, prec, ms, source, split in PUBLISHED:
        e = _est(paths, g, prec, eff, overhead)
        default = _est(paths, g, prec, None, None)
        r = {"case": case, "graph": g, "precision": prec, "published_ms": ms, "source": source, "split": split,
             "est_ms": e.total_ms, "low_ms": e.low_ms, "high_ms": e.high_ms, "error": e.total_ms / ms - 1,
             "est_default_ms": default.total_ms, "error_default": default.total_ms / ms - 1, "mix": e.op_mix,
             "kernels": e.kernels, "fusions": e.fusions, "gops": e.ops / 1e9,
             "classes": {c["op_class"]: round(c["time_ms"], 4) for c in e.op_classes}}
        rows.append(r)
        print(f"{split:<9}{case:<38}{ms:>10.2f}{e.total_ms:>10.2f}{r['error']:>+8.0%}"
              f"{f'{e.low_ms:.2f}-{e.high_ms:.2f}':>18}{e.kernels:>8}  {e.fusions}")
    summary = {}
    for split in ("tune", "held-out"):
        errs = [abs(r["error"]) for r in rows if r["split"] == split]
        summary[split] = {"cases": len(errs), "median_abs_error": statistics.median(errs), "worst_abs_error": max(errs)}
        print(f"{split}: {len(errs)} cases, median |error| {statistics.median(errs):.0%}, worst {max(errs):.0%}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"benchmark": "estimate_published", "target": TARGET,
                               "tuned": {"efficiency": eff, "kernel_overhead_us": overhead}, "summary": summary,
                               "cases": rows, "machine": machine_info(), "versions": package_versions(),
                               "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1))
    print(f"wrote {OUT.relative_to(ROOT)}")
    from bench_estimate_cpu import _write_validation

    _write_validation(TARGET, "jetson", "published AGX Orin 64GB results not used to tune the target "
                      "(MLPerf v3.1, Ultralytics; benchmarks/bench_estimate_published.py)",
                      [r for r in rows if r["split"] == "held-out"])


if __name__ == "__main__":
    main()
