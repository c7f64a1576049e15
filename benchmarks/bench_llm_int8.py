"""INT8 (``--bits 8``) of a decoder LLM: where its time and memory go, and which variant to default to.

``--part phases``: ``compress(model, [("int8", ...)])`` through the Python API, as ``edgekit
compress MODEL --bits 8`` runs it, with each phase timed (CPU s: ``time.process_time()`` of this
process, all threads; wall s) and its peak resident memory (a sampler thread reading
``/proc/self/statm`` every 20 ms): loading the model, the gate's float reference, smoothing, the float
ONNX export, simplifying the graph, calibration (the observation pass), inserting Q/DQ, the
verification run, the step's own comparison with the float graph and the gate's comparison. The
config is the step's default but for ``--calib`` (and ``--alpha``), so the phase run also reports the
default on the eval windows (wikipedia, what the gate measures).

``--part variants``: perplexity of INT8 variants (smoothing alpha, layers kept in float, histogram
sample or every value) on **validation** windows, never the gate's eval split (wikipedia): by default
windows of the calibration split (lee-news) after the ones calibrated on; ``--val-split eval``: the
first windows of lee-news's own eval split (documents 240-299), which no causal-LM step calibrates or
evaluates on.

``--part counts``: the number of calibration windows. One float export, then one calibration per
count on the first N lee-news calib windows, each written with the step's default float layers (and
any others named) and scored on the same validation windows; these must come from outside the calib
split (``--val-split eval``) for all 90 of its windows to be a fair candidate.

    python benchmarks/bench_llm_int8.py --part phases [--model smollm2-135m] [--calib 32]
    python benchmarks/bench_llm_int8.py --part variants [--calib 32] [--val 16] [--alphas off,0.5,0.8] [--full-hist]
    python benchmarks/bench_llm_int8.py --part counts --counts 16,32,90 --val-split eval [--val 16]
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PhaseClock:
    """CPU s, wall s and peak RSS per named phase; phases nest (a phase's figures include its children)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.peaks: list[int] = []  # one running peak per open phase
        self._lock = threading.Lock()  # the sampler and the phases both rewrite ``peaks``
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            r = rss()
            with self._lock:
                self.peaks = [max(p, r) for p in self.peaks]

    def wrap(self, module: Any, name: str, label: str) -> None:
        fn = getattr(module, name, None)
        if fn is None:  # a phase this version of the code does not have
            return

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            with self._lock:
                depth = len(self.peaks)
                self.peaks.append(rss())
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with self._lock:
                    peak = max(self.peaks.pop(), rss())
                    self.peaks = [max(p, peak) for p in self.peaks]
                self.rows.append({"phase": label, "depth": depth, "cpu_s": round(time.process_time() - c, 2),
                                  "wall_s": round(time.perf_counter() - w, 2), "peak_rss_mb": round(peak / 2**20)})
                print(f"  {label}: {self.rows[-1]}", file=sys.stderr, flush=True)

        setattr(module, name, timed)

    def stop(self) -> None:
        self._stop.set()


def machine_row() -> dict[str, Any]:
    import onnxruntime
    import torch
    import transformers
    from machine_info import machine
    return {**machine(), "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__}


def part_phases(args: argparse.Namespace) -> dict[str, Any]:
    from edgekit.compress import StepContext, compress
    from edgekit.compress.int8.config import Int8Config

    clock = PhaseClock()
    # compress() imports these at call time: wrapped where they are defined
    models = importlib.import_module("edgekit.sources.models")
    gate = importlib.import_module("edgekit.compress.quality")
    i8 = importlib.import_module("edgekit.compress.int8.step")
    io = importlib.import_module("edgekit.compress.int8.onnx_graph")
    clock.wrap(models, "load_model", "load model")
    clock.wrap(gate, "measure_reference", "gate: float reference (PyTorch)")
    clock.wrap(gate, "compare", "gate: INT8 graph on the eval windows")
    clock.wrap(i8, "_smoothed", "smoothing")
    clock.wrap(i8, "export_onnx", "float ONNX export")
    clock.wrap(io, "check_quantizable", "check quantizable (load graph)")
    clock.wrap(io, "simplify_graph", "simplify graph (ORT basic)")
    clock.wrap(io, "simplify_file", "simplify graph (ORT basic)")  # what calibrate_graph calls since issue 31
    clock.wrap(io, "_observe", "calibration pass (observers)")
    clock.wrap(io, "insert_linear_qdq", "insert Q/DQ")
    clock.wrap(io, "verify_onnx_runs", "verify INT8 graph runs")
    clock.wrap(io, "compare_lm", "step: INT8 vs float graph (compare_lm)")  # before the shared comparison
    clock.wrap(io, "reference_on", "step: float reference of its own (not the gate's windows)")
    clock.wrap(io, "compare_lm_to_reference", "step: INT8 graph vs the gate's float reference (one pass)")
    clock.wrap(io, "quantize_and_verify", "quantize_and_verify (all of it)")
    config = Int8Config(calib_samples=args.calib, **({"smooth_alpha": args.alpha} if args.alpha is not None else {}))
    ctx = StepContext(accept_quality_loss=True, progress=False)
    c0, w0 = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-llm-int8-") as tmp:
        out = compress(args.model, [("int8", config)], Path(tmp) / "out", ctx)
        manifest = json.loads((out / "manifest.json").read_text())
    total = {"cpu_s": round(time.process_time() - c0, 2), "wall_s": round(time.perf_counter() - w0, 2)}
    clock.stop()
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    metrics = ctx.metrics.get("int8", {})
    quality = manifest.get("quality") or manifest.get("metrics", {}).get("quality")
    return {"model": args.model, "calib_samples": args.calib, "alpha": args.alpha, "total": total,
            "peak_rss_mb": round(peak), "phases": clock.rows, "int8": metrics, "quality": quality}


FLOAT_SETS = ((), ("lm_head",), ("down_proj",), ("down_proj", "lm_head"))


def float_sets(spec: str | None) -> tuple[tuple[str, ...], ...]:
    """``--floats`` ("none,down_proj,down_proj+lm_head") as layer-name sets; None: every set of FLOAT_SETS."""
    if spec is None:
        return FLOAT_SETS
    return tuple(() if part == "none" else tuple(part.split("+")) for part in spec.split(","))


def validation_windows(handle: Any, args: argparse.Namespace, calib_windows: int) -> tuple[Any, str]:
    """The windows variants are chosen on, and what they are: lee-news calib windows after the first
    ``calib_windows`` (``--val-split calib``) or the first ``--val`` windows of lee-news's eval split
    (documents 240-299; a causal LM's gate evaluates on wikipedia, so neither is the test data)."""
    from edgekit.sources.data import load_samples

    if args.val_split == "eval":
        return (load_samples("lee-news", handle, split="eval", limit=args.val),
                f"lee-news eval split (documents 240-299), windows 0-{args.val - 1}")
    split = load_samples("lee-news", handle, split="calib", limit=calib_windows + args.val)
    last = calib_windows + args.val - 1
    return (split.subset(slice(calib_windows, calib_windows + args.val)),
            f"lee-news calib split, windows {calib_windows}-{last} (never calibrated on)")


def window_ppl(session: Any, samples: Any) -> float:
    import math

    import numpy as np

    from edgekit.evaluate import window_nll

    nll, n = 0.0, 0
    for b in samples.batches(1):
        logits = session.run(None, {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})[0]
        v = window_nll(np.asarray(logits), b["input_ids"]).astype(np.float64)
        nll, n = nll + float(v.sum()), n + v.size
    return math.exp(nll / max(n, 1))


def part_variants(args: argparse.Namespace) -> dict[str, Any]:
    """Validation perplexity of INT8 variants: smoothing alpha x layers kept in float (one export and one
    calibration per alpha; every float set written from the same ranges)."""
    from edgekit.compress import StepContext
    from edgekit.compress.int8 import onnx_graph as io
    from edgekit.compress.int8 import step as i8
    from edgekit.compress.int8.calibration import HIST_SAMPLE
    from edgekit.compress.int8.config import Int8Config
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.onnx_int8_kernels import host_semantics, session_for
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    handle = load_model(args.model)
    names = [s.name for s in handle.inputs]
    calib = load_samples("lee-news", handle, split="calib", limit=args.calib)
    val, val_note = validation_windows(handle, args, args.calib)
    scheme = i8.resolve_scheme(Int8Config(), None)
    rows: list[dict[str, Any]] = []
    float_ppl = None
    alphas = [None if a == "off" else float(a) for a in args.alphas.split(",")]
    samples: list[int | None] = [None] if args.hist_every else [HIST_SAMPLE] + ([None] if args.full_hist else [])
    with tempfile.TemporaryDirectory(prefix="bench-llm-int8-") as tmp:
        for alpha in alphas:
            c0, w0 = time.process_time(), time.perf_counter()
            h = handle
            if alpha is not None:
                ctx = StepContext(calib=calib, progress=False)  # type: ignore[arg-type]
                h, _ = i8._smoothed(handle, Int8Config(calib_samples=args.calib, smooth_alpha=alpha), ctx)
            folder = export_onnx(h, Path(tmp) / f"fp32-{alpha}", ExportConfig(skip_parity=True))
            src = Path(folder) / "model.onnx"
            export_s = {"cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1)}
            if float_ppl is None:
                import onnxruntime as ort
                float_ppl = window_ppl(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]), val)
                print(f"float validation perplexity {float_ppl:.3f}", file=sys.stderr, flush=True)
            for sample in samples if alpha is None else samples[:1]:
                cal = io.calibrate_graph(src, calib, names, None, 99.99, scheme, placement="linear",
                                         hist_sample=sample)
                for keep in float_sets(args.floats):
                    dst = Path(tmp) / "int8.onnx"
                    c1 = time.process_time()
                    io.write_int8_graph(cal, dst, scheme, keep, verify=False, copy_graph=True)
                    ppl = window_ppl(session_for(dst, host_semantics()), val)
                    row = {"alpha": alpha, "hist_sample": sample, "float": "+".join(keep) or "none",
                           "val_ppl": round(ppl, 3), "val_ratio": round(ppl / float_ppl, 4),
                           "calibration": cal.calibration, "export": export_s,
                           "write_eval_cpu_s": round(time.process_time() - c1, 1)}
                    rows.append(row)
                    print(f"  {row}", file=sys.stderr, flush=True)
            del cal
    return {"model": args.model, "scheme": scheme, "calib_windows": f"lee-news calib split, windows 0-{args.calib - 1}",
            "validation_windows": val_note, "float_val_ppl": round(float_ppl or 0.0, 3), "rows": rows}


def part_counts(args: argparse.Namespace) -> dict[str, Any]:
    """Validation perplexity against the number of calibration windows: one export of the float model, one
    calibration per count (the first N lee-news calib windows, every value into the histograms, as the step
    does), each written with the float layers of ``--floats`` (default: the step's, the FFN down projections)."""
    import onnxruntime as ort

    from edgekit.compress.int8 import onnx_graph as io
    from edgekit.compress.int8 import step as i8
    from edgekit.compress.int8.config import Int8Config
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.onnx_int8_kernels import host_semantics, session_for
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    counts = [int(c) for c in args.counts.split(",")]
    handle = load_model(args.model)
    names = [s.name for s in handle.inputs]
    calib_split = load_samples("lee-news", handle, split="calib", limit=max(counts))
    val, val_note = validation_windows(handle, args, max(counts))
    scheme = i8.resolve_scheme(Int8Config(), None)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-llm-int8-") as tmp:
        c0, w0 = time.process_time(), time.perf_counter()
        src = Path(export_onnx(handle, Path(tmp) / "fp32", ExportConfig(skip_parity=True))) / "model.onnx"
        export_s = {"cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - w0, 1)}
        c0 = time.process_time()
        float_ppl = window_ppl(ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]), val)
        print(f"float validation perplexity {float_ppl:.3f} ({time.process_time() - c0:.1f} CPU s)",
              file=sys.stderr, flush=True)
        for count in counts:
            cal = io.calibrate_graph(src, calib_split.subset(slice(0, count)), names, None, 99.99, scheme,
                                     batch_size=int(handle.extra.get("calib_batch", 8)), placement="linear")
            for keep in float_sets(args.floats or "ffn-down"):
                dst = Path(tmp) / "int8.onnx"
                c1 = time.process_time()
                io.write_int8_graph(cal, dst, scheme, keep, verify=False, copy_graph=True)
                ppl = window_ppl(session_for(dst, host_semantics()), val)
                row = {"calib_windows": count, "float": "+".join(keep) or "none", "val_ppl": round(ppl, 3),
                       "val_ratio": round(ppl / float_ppl, 4), "calibration": cal.calibration,
                       "write_eval_cpu_s": round(time.process_time() - c1, 1), "load_avg": os.getloadavg()}
                rows.append(row)
                print(f"  {row}", file=sys.stderr, flush=True)
            del cal
    return {"model": args.model, "scheme": scheme, "calib_windows": "the first N of lee-news's calib split (90 windows)",
            "validation_windows": val_note, "export": export_s, "float_val_ppl": round(float_ppl, 3), "rows": rows}


def print_counts(result: dict[str, Any]) -> None:
    print(f"validation: {result['validation_windows']}; float perplexity {result['float_val_ppl']}")
    print("| calib windows | kept in float | calibration CPU s | val perplexity | x float |\n|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['calib_windows']} | {r['float']} | {r['calibration']['cpu_s']} | {r['val_ppl']} | "
              f"{r['val_ratio']} |")


def print_variants(result: dict[str, Any]) -> None:
    print(f"validation: {result['validation_windows']}; float perplexity {result['float_val_ppl']}")
    print("| alpha | histogram | kept in float | val perplexity | x float |\n|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['alpha'] or 'off'} | {r['hist_sample'] or 'every value'} | {r['float']} | {r['val_ppl']} | "
              f"{r['val_ratio']} |")


def print_phases(result: dict[str, Any]) -> None:
    print("| phase | CPU s | wall s | peak RSS MB |\n|---|---|---|---|")
    for r in result["phases"]:
        print(f"| {'  ' * r['depth']}{r['phase']} | {r['cpu_s']} | {r['wall_s']} | {r['peak_rss_mb']} |")
    print(f"| total | {result['total']['cpu_s']} | {result['total']['wall_s']} | {result['peak_rss_mb']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("phases", "variants", "counts"), default="phases")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--calib", type=int, default=32)
    p.add_argument("--alpha", type=float, default=None, help="phases: the smoothing alpha (default: the step's)")
    p.add_argument("--alphas", default="off,0.5,0.8", help="variants: smoothing alphas to compare")
    p.add_argument("--val", type=int, default=16, help="variants: validation windows after the calibration ones")
    p.add_argument("--full-hist", action="store_true", help="variants: also calibrate on every value (alpha off)")
    p.add_argument("--hist-every", action="store_true", help="variants: every value only, as the step calibrates")
    p.add_argument("--val-split", choices=("calib", "eval"), default="calib",
                   help="variants, counts: validation windows from lee-news's calib split after the calibration "
                        "ones, or from its eval split")
    p.add_argument("--floats", default=None,
                   help="variants, counts: float sets to score, e.g. none,down_proj,down_proj+lm_head,ffn-down "
                        "(default: variants every set of FLOAT_SETS, counts the step's ffn-down)")
    p.add_argument("--counts", default="16,32,90", help="counts: calibration window counts")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    info = machine_row()
    if args.part == "phases":
        result = part_phases(args)
        print_phases(result)
    elif args.part == "counts":
        result = part_counts(args)
        print_counts(result)
    else:
        result = part_variants(args)
        print_variants(result)
    result = {"machine": info, "load_after": os.getloadavg(), **result}
    print(json.dumps({k: result[k] for k in ("total", "peak_rss_mb", "quality") if k in result}, indent=1, default=str))
    print(f"load average after: {result['load_after']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
