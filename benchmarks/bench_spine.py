"""Spine benchmark: EfficientNet-Lite0 FP32, batch 1, PyTorch eager versus the edgekit
ONNX Runtime engine, at 1 thread and at all threads.

Method: one real input (a photo that ships with scikit-image, the model's own
preprocessing); every variant warmed up; then interleaved rounds (A B C D, A B C D, ...)
of ``--iters`` timed inferences each, so a neighbour's load on the shared machine hits
all variants alike; p50 / p90 / p99 over all samples, and the median of the per-round
medians. Also checks that the engine's top-1 class matches PyTorch's.

    python benchmarks/bench_spine.py [--rounds 6] [--iters 40] [--out benchmarks/results/spine.json]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions  # noqa: E402


class EagerRunner:
    """PyTorch eager at a fixed thread count (torch's thread count is process-global,
    so it is set before every block)."""

    def __init__(self, module: Any, feeds: dict[str, np.ndarray], threads: int) -> None:
        import torch

        self.torch = torch
        self.module = module
        self.args = [torch.from_numpy(v) for v in feeds.values()]
        self.threads = threads

    def activate(self) -> None:
        self.torch.set_num_threads(self.threads)

    def timed_run(self) -> float:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self.module(*self.args)
            return (time.perf_counter() - t0) * 1e3

    def output(self) -> np.ndarray:
        with self.torch.inference_mode():
            return self.module(*self.args).numpy()


class EngineRunner:
    def __init__(self, engine: Any, feeds: dict[str, np.ndarray]) -> None:
        self.engine = engine
        self.feeds = feeds

    def activate(self) -> None:
        pass

    def timed_run(self) -> float:
        return self.engine.timed_run(self.feeds)

    def output(self) -> np.ndarray:
        return self.engine.run(self.feeds)[0]


def stats(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "min": float(a.min()),
            "cv": float(a.std(ddof=1) / a.mean()) if a.size > 1 else 0.0, "count": int(a.size)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=40, help="timed inferences per variant per round")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--block-seconds", type=float, default=8.0,
                    help="cap on one variant's block (a pathologically slow variant still gets >= 3 samples)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spine.json"))
    args = ap.parse_args(argv)

    import torch

    from edgekit.build import build_engine, load_engine
    from edgekit.loading import load_model
    from edgekit.runtimes.base import BuildOptions

    cores = os.cpu_count() or 1
    torch_threads_default = torch.get_num_threads()
    handle = load_model("efficientnet-lite0")
    feeds = handle.sample_inputs(1)
    with tempfile.TemporaryDirectory(prefix="edgekit-bench-spine-") as tmp:
        t0 = time.perf_counter()
        engine_dir = build_engine(handle, "cpu", Path(tmp) / "engine", BuildOptions())
        build_s = time.perf_counter() - t0
        runners = {
            "pytorch-eager 1 thread": EagerRunner(handle.module, feeds, 1),
            "ort-engine 1 thread": EngineRunner(load_engine(engine_dir, threads=1), feeds),
            f"pytorch-eager {cores} threads": EagerRunner(handle.module, feeds, cores),
            f"ort-engine {cores} threads": EngineRunner(load_engine(engine_dir, threads=cores), feeds),
        }
        ref = None
        top1 = {}
        for name, r in runners.items():
            r.activate()
            out = r.output()
            ref = out if ref is None else ref
            top1[name] = int(out.argmax())
            for _ in range(args.warmup):
                r.timed_run()
        samples: dict[str, list[float]] = {n: [] for n in runners}
        round_p50: dict[str, list[float]] = {n: [] for n in runners}
        for rnd in range(args.rounds):
            order = list(runners) if rnd % 2 == 0 else list(reversed(runners))  # ABCD DCBA ...
            for name in order:
                r = runners[name]
                r.activate()
                time.sleep(0.05)  # let the other runtime's spinning threads go idle
                block: list[float] = []
                t_end = time.perf_counter() + args.block_seconds
                while len(block) < args.iters and (len(block) < 3 or time.perf_counter() < t_end):
                    block.append(r.timed_run())
                samples[name] += block
                round_p50[name].append(float(np.median(block)))
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
        torch.set_num_threads(torch_threads_default)

    base = stats(samples["ort-engine 1 thread"])["p50"]
    results = []
    for name in runners:
        s = stats(samples[name])
        results.append({"variant": name, **s, "median_of_round_p50": float(np.median(round_p50[name])),
                        "round_p50": round_p50[name], "p50_vs_ort_1_thread": s["p50"] / base,
                        "top1": top1[name]})
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    report = {
        "benchmark": "spine", "model": "efficientnet-lite0", "precision": "fp32", "batch": 1,
        "input": "skimage chelsea photo, resize 256, center crop 224, (x-127.5)/127.5",
        "method": f"interleaved rounds (ABCD DCBA ...), {args.rounds} rounds x {args.iters} timed inferences per "
                  f"variant (a block stops after {args.block_seconds} s with >= 3), {args.warmup} warm-up runs each",
        "build_seconds": round(build_s, 1), "top1_agree": len(set(top1.values())) == 1,
        "results": results, "machine": machine_info(), "load_average": load, "versions": package_versions(),
        "date": now_iso(),
        "note": "the machine was shared with parallel jobs while measuring: compare ratios and medians",
    }
    atomic_write_json(args.out, report)
    print_table(report)
    print(f"wrote {args.out}")
    return report


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"EfficientNet-Lite0 FP32 batch 1 (load average {report['load_average']})")
    for col in ("variant", "p50 ms", "p90 ms", "p99 ms", "CV", "median of round p50", "p50 vs ORT 1 thread", "n"):
        t.add_column(col)
    for r in report["results"]:
        t.add_row(r["variant"], f"{r['p50']:.2f}", f"{r['p90']:.2f}", f"{r['p99']:.2f}", f"{r['cv']:.1%}",
                  f"{r['median_of_round_p50']:.2f}", f"{r['p50_vs_ort_1_thread']:.2f}x", str(r["count"]))
    Console(width=150).print(t)


if __name__ == "__main__":
    main()
