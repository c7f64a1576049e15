"""Benchmark: how long `edgekit compress smollm2-135m --bits 4` (GPTQ) takes, and what it gives, for the
step's defaults, the variants the walk allows and smaller calibration budgets.

Each variant runs ``edgekit.compress.compress`` in its own process (``--variants`` picks them), so
its peak resident memory is its own (``ru_maxrss``); the process records the step's CPU time, its own
CPU time (all threads, ``time.process_time``), wall time, torch threads, the load average before and
after, and two perplexities of the 4-bit model against the float model:

- **validation** (``--val-windows`` 512-token windows of the Wikipedia *calib* split): the text settings
  are chosen on; no result reports on it;
- **test** (``--eval-windows`` windows of the Wikipedia *eval* split: the quality gate's own windows).

GPTQ calibrates on Lee news, never on Wikipedia. The float model's outputs on both sets of windows are
measured once and shared (cached in the work folder). ``calib32-b`` calibrates on Lee-news windows
32-63 instead of 0-31 (the text holds 90 non-overlapping windows, so a seed changes nothing below 90):
beside ``calib32`` it is the noise of the choice of windows.

    python benchmarks/bench_gptq_time.py --variants calib32,calib64 --threads 1 --eval-windows 16
    python benchmarks/bench_gptq_time.py --saved default --eval-windows 16   # a model already written:
        # its validation perplexity, and the quality gate's CPU time with and without dequantizing once

Results: benchmarks/results/gptq_time/<variant>.json, and the table of those present.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PARTS = ROOT / "benchmarks" / "results" / "gptq_time"

# variant -> (WeightOnlyConfig overrides, seed, first Lee-news calibration window)
VARIANTS: dict[str, tuple[dict[str, Any], int, int]] = {
    "default": ({}, 0, 0),
    "seed1": ({}, 1, 0),  # the same defaults on other random top-up windows: the noise of the result
    "value-stride1": ({"value_query_stride": 1}, 0, 0),  # every query for the value Hessian (the default until 11-28)
    "value-stride2": ({"value_query_stride": 2}, 0, 0),  # every 2nd query for the value Hessian (the default since)
    "value-stride4": ({"value_query_stride": 4}, 0, 0),
    "gptaq32": ({"gptaq_windows": 32}, 0, 0),
    "gptaq16": ({"gptaq_windows": 16}, 0, 0),  # GPTAQ's float track on the first 16 of the 32 windows
    "stride2-gptaq16": ({"value_query_stride": 2, "gptaq_windows": 16}, 0, 0),
    "fast": ({"value_query_stride": 4, "gptaq_windows": 32}, 0, 0),
    "rtn": ({"method": "rtn"}, 0, 0),
    "paper-calib32": ({"method": "gptq", "calib_samples": 32}, 0, 0),  # the paper's GPTQ on the default's windows
    # calibration budgets (all first windows of the Lee-news text: no random top-up below 90)
    "calib16": ({"calib_samples": 16}, 0, 0),
    "calib16-b": ({"calib_samples": 16}, 0, 16),  # windows 16-31
    "calib16-c": ({"calib_samples": 16}, 0, 32),  # windows 32-47
    "calib32": ({"calib_samples": 32}, 0, 0),
    "calib32-b": ({"calib_samples": 32}, 0, 32),  # windows 32-63: the noise of which 32 windows
    "calib48": ({"calib_samples": 48}, 0, 0),
    "calib64": ({"calib_samples": 64}, 0, 0),
    "gptaq32-calib64": ({"calib_samples": 64, "gptaq_windows": 32}, 0, 0),  # Hessians on 64, GPTAQ on 32
    "fast-calib64": ({"calib_samples": 64, "value_query_stride": 4, "gptaq_windows": 32}, 0, 0),
}
VAL_SOURCE = "wikipedia (calib split, first {n} windows: validation)"


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from machine_info import machine

    from edgekit.compress import StepContext, compress
    from edgekit.compress.weight_only.config import WeightOnlyConfig

    torch.set_num_threads(args.threads)
    overrides, seed, first = VARIANTS[name]
    work = Path(args.work)
    reference = _reference(args, work)
    validation = _reference(args, work, validation=True)
    config = WeightOnlyConfig(**{"eval_windows": 0, **overrides})  # the quality gate below measures perplexity
    calib = _calib_windows(work, first, config.calib_samples) if first else None
    ctx = StepContext(progress=False, seed=seed, quality_windows=args.eval_windows, quality_reference=reference,
                      accept_quality_loss=True, calib=calib)
    out = work / f"w4-{name}"
    load0 = os.getloadavg()
    w0, c0 = time.perf_counter(), time.process_time()
    compress("smollm2-135m", [("weight-only", config)], out, ctx)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    man = json.loads((out / "manifest.json").read_text())
    meta = man["steps"][-1]["meta"]
    part = {"variant": name, "config": overrides, "seed": seed, "first_calib_window": first,
            "threads": torch.get_num_threads(), "quality": man["metrics"]["quality"],
            "quant_wall_s": meta["seconds"], "quant_cpu_s": meta["cpu_seconds"],
            "compress_wall_s": round(wall, 1), "compress_cpu_s": round(cpu, 1),
            "process_cpu_s": round(time.process_time(), 1),  # the whole process so far: imports, references too
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
            "calib_windows": meta.get("calib_windows"), "machine": machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    part["validation"] = _validate(out, validation)
    return part


def _validate(out: Path, validation: Any) -> dict[str, Any]:
    """The written model's quality on the validation windows, and the CPU time it took."""
    from edgekit.compress import load_compressed
    from edgekit.compress.quality import compare

    handle = load_compressed(out)
    w0, c0 = time.perf_counter(), time.process_time()
    report = compare(handle, validation)
    return {**report, "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1)}


def measure_saved(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A model this benchmark already wrote (``w4-<name>``): its validation quality, and the quality
    gate's CPU time on the test windows with the packed weights dequantized once (what ``compare`` does)
    and on every forward (as before), which must give the same report."""
    import contextlib

    import torch
    from machine_info import machine

    from edgekit.compress import load_compressed, quality

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    reference = _reference(args, work)
    validation = _reference(args, work, validation=True)
    handle = load_compressed(work / f"w4-{name}")
    gate: dict[str, Any] = {"threads": torch.get_num_threads(), "load_before": round(os.getloadavg()[0], 2)}
    for mode in ("once", "every-forward"):
        if mode == "every-forward":  # the gate as it was: no layer kept dequantized
            quality.dequantized_once = lambda _m: contextlib.nullcontext(0)  # type: ignore[assignment]
        w0, c0 = time.perf_counter(), time.process_time()
        report = quality.compare(handle, reference)
        gate[mode] = {"cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1),
                      "report": report}
    gate["same_report"] = gate["once"]["report"] == gate["every-forward"]["report"]
    gate["load_after"] = round(os.getloadavg()[0], 2)
    path = PARTS / f"{name}.json"
    part = json.loads(path.read_text())
    quality.dequantized_once = _dequantized_once()  # validation as run_variant measures it
    part["validation"] = _validate(work / f"w4-{name}", validation)
    part["gate"] = gate
    part["validation_measured"] = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return part


def _dequantized_once() -> Any:
    from edgekit.export.packing import dequantized_once

    return dequantized_once


def _calib_windows(work: Path, first: int, n: int) -> str:
    """Lee-news calibration windows first..first + n - 1 as an .npz data file (what ``--calib`` takes)."""
    import numpy as np

    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    path = work / f"lee-news-{first}-{first + n}.npz"
    if not path.is_file():
        samples = load_samples("lee-news", load_model("smollm2-135m"), split="calib")
        ids = samples.inputs["input_ids"][first:first + n]
        if len(ids) < n:
            raise SystemExit(f"the Lee-news text holds {len(samples)} windows, fewer than {first + n}")
        np.savez(path, input_ids=ids, attention_mask=np.ones_like(ids))
    return f"{path}@all"  # a data file's calib split is its first quarter; @all: every window


def _reference(args: argparse.Namespace, work: Path, validation: bool = False) -> Any:
    """The float model's outputs on the test windows (the gate's: Wikipedia eval split) or on the
    validation windows (Wikipedia calib split), measured once (a numpy archive in the work folder)."""
    import dataclasses

    import numpy as np

    from edgekit.compress import StepContext
    from edgekit.compress.quality import Reference, measure_reference
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    n_windows = args.val_windows if validation else args.eval_windows
    path = work / (f"reference-val-{n_windows}.npz" if validation else f"reference-{n_windows}.npz")
    if path.is_file():
        z = np.load(path, allow_pickle=False)
        n = int(z["n"])
        return Reference(str(z["source"]), [{"input_ids": z[f"ids{i}"], "attention_mask": z[f"mask{i}"]}
                                            for i in range(n)],
                         [z[f"nll{i}"] for i in range(n)], [z[f"top{i}"] for i in range(n)], z["rows"],
                         [z[f"idx{i}"] for i in range(n)])
    handle = load_model("smollm2-135m")
    if validation:
        held_out = load_samples("wikipedia", handle, split="calib", limit=n_windows)
        ref = measure_reference(handle, StepContext(progress=False, quality_windows=n_windows, eval=held_out))
        ref = dataclasses.replace(ref, source=VAL_SOURCE.format(n=n_windows))
    else:
        ref = measure_reference(handle, StepContext(progress=False, quality_windows=n_windows))
    arrays: dict[str, Any] = {"n": len(ref.feeds), "source": ref.source, "rows": ref.rows}
    for i, f in enumerate(ref.feeds):
        arrays.update({f"ids{i}": f["input_ids"], f"mask{i}": f["attention_mask"], f"nll{i}": ref.nll[i],  # type: ignore[index]
                       f"top{i}": ref.top[i], f"idx{i}": ref.row_index[i]})
    np.savez(path, **arrays)
    return ref


def table() -> None:
    rows = [json.loads(p.read_text()) for p in sorted(PARTS.glob("*.json"))]
    print("| variant | config | threads | validation PPL | test PPL | test PPL / float | test agreement | quant CPU s | "
          "quant wall s | process CPU s | peak RSS MiB | load before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        q, v = r["quality"], r.get("validation")
        extra = (f", seed {r['seed']}" if r["seed"] else "") + (
            f", windows from {r['first_calib_window']}" if r.get("first_calib_window") else "")
        val = f"{v['perplexity']:.3f}" if v else "-"
        print(f"| {r['variant']} | {r['config'] or 'defaults'}{extra} | {r['threads']} | {val} | {q['perplexity']:.3f} | "
              f"{q['perplexity_ratio']:.4f} | {q['agreement']:.4f} | {r['quant_cpu_s']:.0f} | {r['quant_wall_s']:.0f} | "
              f"{r.get('process_cpu_s', '-')} | {r['peak_rss_mib']} | {r['load_before'][0]} -> {r['load_after'][0]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=16, help="test windows (Wikipedia eval split)")
    ap.add_argument("--val-windows", type=int, default=16, help="validation windows (Wikipedia calib split)")
    ap.add_argument("--saved", default=None, help="measure the model variant VARIANT wrote earlier (see above)")
    ap.add_argument("--work", default=None, help="folder for the models and the float reference")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one variant
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.work is None:
        from edgekit.artifact import cache_dir

        args.work = str(cache_dir() / "bench-gptq-time")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    PARTS.mkdir(parents=True, exist_ok=True)
    if args.saved:
        part = measure_saved(args.saved, args)
        (PARTS / f"{args.saved}.json").write_text(json.dumps(part, indent=1))
        g = part["gate"]
        print(f"{args.saved}: validation ppl {part['validation']['perplexity']:.3f}; gate on the test windows "
              f"{g['once']['cpu_s']} CPU s dequantizing once, {g['every-forward']['cpu_s']} on every forward, "
              f"same report: {g['same_report']}", flush=True)
        return
    if args.one:
        part = run_variant(args.one, args)
        (PARTS / f"{args.one}.json").write_text(json.dumps(part, indent=1))
        q, v = part["quality"], part["validation"]
        print(f"{args.one}: validation ppl {v['perplexity']:.3f} (float {v['perplexity_float']:.3f}), test ppl "
              f"{q['perplexity']:.3f} (float {q['perplexity_float']:.3f}), quant CPU {part['quant_cpu_s']} s, "
              f"wall {part['quant_wall_s']} s, process CPU {part['process_cpu_s']} s, "
              f"peak {part['peak_rss_mib']} MiB", flush=True)
        return
    if not args.table_only:
        for name in args.variants.split(","):
            if name not in VARIANTS:
                raise SystemExit(f"unknown variant {name!r} (choose from {', '.join(VARIANTS)})")
            subprocess.run([sys.executable, __file__, "--one", name, "--threads", str(args.threads),
                            "--eval-windows", str(args.eval_windows), "--val-windows", str(args.val_windows),
                            "--work", args.work], check=True)
    table()


if __name__ == "__main__":
    main()
