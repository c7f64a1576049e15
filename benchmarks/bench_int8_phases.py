"""Where EfficientNet-Lite0's INT8 quantization spends its CPU time, phase by phase, and what the
histogram sample costs in agreement.

Runs the int8 step's quantization proper (trace + batch-norm fold, equalization, weight scales,
calibration, GPTQ rounding, bias correction) on the first ``--calib`` images of the model's calib
split, once per ``--hist-sample`` value (values histogrammed per tensor and batch; ``none``: every
value), and reports each phase's CPU time (``time.process_time()``, all threads) and wall time, and
the fake-quant model's top-1 agreement and mean KL against the float model on the **validation**
images: the calib split's images after the calibration ones (never calibrated on, and not the eval
split, on which nothing is chosen). The quality gate (eval split, export, engine) is not part of it:
``edgekit compress`` reports it in ``metrics.int8.seconds``.

    python benchmarks/bench_int8_phases.py [--hist-sample 131072,none] [--threads 1] [--calib 128]
        [--out benchmarks/results/int8_phases.json]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions  # noqa: E402

PHASES = ("prepare", "equalize", "nhwc_check", "scales", "calibrate", "gptq", "bias")


def lscpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return ""


def run_once(sample: int | None, calib: Any, val: Any, names: list[str], module: Any, ref: Any) -> dict[str, Any]:
    from edgekit.compress.int8 import calibration, qdq
    from edgekit.compress.int8.calibration import run_module, score
    from edgekit.compress.int8.config import Int8Config
    from edgekit.compress.int8.equalize import correct_bias, equalize
    from edgekit.compress.int8.rounding import round_model
    from edgekit.compress.int8.step import calibrate

    row: dict[str, Any] = {"hist_sample": sample}

    def timed(label: str, fn: Any) -> Any:
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        row[f"{label}_cpu_s"] = round(time.process_time() - c, 2)
        row[f"{label}_wall_s"] = round(time.perf_counter() - w, 2)
        return out

    defaults = calibration.HistogramObserver.__init__.__defaults__
    assert defaults is not None
    calibration.HistogramObserver.__init__.__defaults__ = (defaults[0], sample, *defaults[2:])
    try:
        c0 = time.process_time()
        gm, plan = timed("prepare", lambda: qdq.prepare_qdq(copy.deepcopy(module), "u8s7"))
        timed("equalize", lambda: equalize(gm, plan))
        nhwc = timed("nhwc_check", lambda: qdq.channels_last_ok(gm, calib, names))
        timed("scales", lambda: qdq.update_weight_scales(gm, plan))
        timed("calibrate", lambda: calibrate(gm, calib, names, Int8Config().calibration_config(), channels_last=nhwc))
        with qdq.fast_fake_quant(gm):
            timed("gptq", lambda: round_model(gm, plan, calib, names, channels_last=nhwc))
            timed("bias", lambda: correct_bias(gm, plan, module, calib, names, channels_last=nhwc))
            qdq.fit_bias_range(gm)
        qdq.clip_weights_to_grid(gm, plan)
        row["total_cpu_s"] = round(time.process_time() - c0, 2)
    finally:
        calibration.HistogramObserver.__init__.__defaults__ = defaults
    row["nhwc"] = nhwc
    with qdq.fast_fake_quant(gm):
        out = run_module(gm, val, names, channels_last=nhwc)
    s = score(out, ref, None, None)
    row.update({"val_top1_agreement": round(s["top1_agreement"], 4), "val_mean_kl": round(s["mean_kl"], 5),
                "val_images": len(val)})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hist-sample", default="131072,none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int8_phases.json"))
    args = ap.parse_args()
    import torch

    from edgekit.compress.int8.calibration import run_module
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(args.threads)
    h = load_model("efficientnet-lite0")
    every = load_samples(None, h, split="calib", limit=None)
    if len(every) <= args.calib:
        raise SystemExit(f"the calib split has {len(every)} images: none left for validation after {args.calib}")
    calib, val = every.subset(slice(0, args.calib)), every.subset(slice(args.calib, len(every)))
    names = [s.name for s in h.inputs]
    module = h.module.eval()
    ref = run_module(module, val, names)
    rows = []
    for v in args.hist_sample.split(","):
        rows.append(run_once(None if v == "none" else int(v), calib, val, names, module, ref))
        print(rows[-1], flush=True)
    print("\n| histogram sample | calibrate CPU s | GPTQ CPU s | bias corr. CPU s | total CPU s | "
          "validation agreement | validation KL |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['hist_sample'] or 'every value'} | {r['calibrate_cpu_s']} | {r['gptq_cpu_s']} | {r['bias_cpu_s']} | "
              f"{r['total_cpu_s']} | {100 * r['val_top1_agreement']:.1f}% | {r['val_mean_kl']:.4f} |")
    atomic_write_json(Path(args.out), {
        "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg": os.getloadavg()},
        "versions": package_versions(), "settings": {"threads": args.threads, "calib": args.calib,
                                                     "validation": f"calib split images {args.calib}-{len(every) - 1}"},
        "rows": rows})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
