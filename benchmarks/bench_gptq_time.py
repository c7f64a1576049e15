"""Benchmark: how long `edgekit compress smollm2-135m --bits 4` (GPTQ, the default 128 calibration
windows) takes, and what it gives, for the step's defaults and the variants the walk allows.

Each variant runs ``edgekit.compress.compress`` in its own process (``--variants`` picks them), so
its peak resident memory is its own (``ru_maxrss``); the process records its CPU time (all threads,
``time.process_time``), wall time, torch threads, the load average before and after, and the
quality gate's report against the float model on ``--eval-windows`` 512-token Wikipedia windows (the
eval split: never the Lee-news calibration text). The float model's outputs on those windows are
measured once and shared (cached in the work folder).

    python benchmarks/bench_gptq_time.py                              # every variant
    python benchmarks/bench_gptq_time.py --variants default,seed1 --threads 2

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

# variant -> (WeightOnlyConfig overrides, seed)
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 0),
    "seed1": ({}, 1),  # the same defaults on other random top-up windows: the noise of the result
    "value-stride4": ({"value_query_stride": 4}, 0),
    "gptaq32": ({"gptaq_windows": 32}, 0),
    "fast": ({"value_query_stride": 4, "gptaq_windows": 32}, 0),
    "rtn": ({"method": "rtn"}, 0),
}


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from machine_info import machine

    from edgekit.compress import StepContext, compress
    from edgekit.compress.weight_only.config import WeightOnlyConfig

    torch.set_num_threads(args.threads)
    overrides, seed = VARIANTS[name]
    work = Path(args.work)
    reference = _reference(args, work)
    config = WeightOnlyConfig(**{"eval_windows": 0, **overrides})  # the quality gate below measures perplexity
    ctx = StepContext(progress=False, seed=seed, quality_windows=args.eval_windows, quality_reference=reference,
                      accept_quality_loss=True)
    out = work / f"w4-{name}"
    load0 = os.getloadavg()
    w0, c0 = time.perf_counter(), time.process_time()
    compress("smollm2-135m", [("int4", config)], out, ctx)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    man = json.loads((out / "manifest.json").read_text())
    meta = man["steps"][-1]["meta"]
    return {"variant": name, "config": overrides, "seed": seed, "threads": torch.get_num_threads(),
            "quality": man["metrics"]["quality"], "quant_wall_s": meta["seconds"], "quant_cpu_s": meta["cpu_seconds"],
            "compress_wall_s": round(wall, 1), "compress_cpu_s": round(cpu, 1),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in os.getloadavg()],
            "calib_windows": meta.get("calib_windows"), "machine": machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _reference(args: argparse.Namespace, work: Path) -> Any:
    """The float model's outputs on the eval windows, measured once (a numpy archive in the work folder)."""
    import numpy as np

    from edgekit.compress import StepContext
    from edgekit.compress.quality import Reference, measure_reference
    from edgekit.sources.models import load_model

    path = work / f"reference-{args.eval_windows}.npz"
    if path.is_file():
        z = np.load(path, allow_pickle=False)
        n = int(z["n"])
        return Reference(str(z["source"]), [{"input_ids": z[f"ids{i}"], "attention_mask": z[f"mask{i}"]}
                                            for i in range(n)],
                         [z[f"nll{i}"] for i in range(n)], [z[f"top{i}"] for i in range(n)], z["rows"],
                         [z[f"idx{i}"] for i in range(n)])
    ref = measure_reference(load_model("smollm2-135m"), StepContext(progress=False, quality_windows=args.eval_windows))
    arrays: dict[str, Any] = {"n": len(ref.feeds), "source": ref.source, "rows": ref.rows}
    for i, f in enumerate(ref.feeds):
        arrays.update({f"ids{i}": f["input_ids"], f"mask{i}": f["attention_mask"], f"nll{i}": ref.nll[i],  # type: ignore[index]
                       f"top{i}": ref.top[i], f"idx{i}": ref.row_index[i]})
    np.savez(path, **arrays)
    return ref


def table() -> None:
    rows = [json.loads(p.read_text()) for p in sorted(PARTS.glob("*.json"))]
    print("| variant | config | threads | PPL | PPL / float | agreement | quant CPU s | quant wall s | peak RSS MiB | "
          "load before -> after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = r["quality"]
        seed = f", seed {r['seed']}" if r["seed"] else ""
        print(f"| {r['variant']} | {r['config'] or 'defaults'}{seed} | {r['threads']} | {q['perplexity']:.3f} | {q['perplexity_ratio']:.4f} | {q['agreement']:.4f} | "
              f"{r['quant_cpu_s']:.0f} | {r['quant_wall_s']:.0f} | {r['peak_rss_mib']} | "
              f"{r['load_before'][0]} -> {r['load_after'][0]} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=40)
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
    if args.one:
        part = run_variant(args.one, args)
        (PARTS / f"{args.one}.json").write_text(json.dumps(part, indent=1))
        q = part["quality"]
        print(f"{args.one}: ppl {q['perplexity']:.3f} (float {q['perplexity_float']:.3f}), quant CPU "
              f"{part['quant_cpu_s']} s, wall {part['quant_wall_s']} s, peak {part['peak_rss_mib']} MiB", flush=True)
        return
    if not args.table_only:
        for name in args.variants.split(","):
            if name not in VARIANTS:
                raise SystemExit(f"unknown variant {name!r} (choose from {', '.join(VARIANTS)})")
            subprocess.run([sys.executable, __file__, "--one", name, "--threads", str(args.threads),
                            "--eval-windows", str(args.eval_windows), "--work", args.work], check=True)
    table()


if __name__ == "__main__":
    main()
