"""CPU engines for EfficientNet-Lite0 (issue 20, item 4): edgekit's INT8 model on ONNX Runtime and
on OpenVINO, against ONNX Runtime's ``quantize_static`` and OpenVINO + NNCF on the same
calibration images, and FP32 on both runtimes plus BF16 on OpenVINO.

Per variant: latency at batch 1 on 1 thread (every variant timed in every round, so a
neighbour's load hits all alike; p50 of wall time and of this process's CPU time per run,
because the machine is shared), top-1 agreement and mean KL against ONNX Runtime FP32 on the
held-out evaluation images (the photos+fashion-mnist eval split, disjoint from calibration),
the quantizer's wall and CPU time, and the kernels each engine ran (OpenVINO's execution
graph; ONNX Runtime's inferred MLAS path).

edgekit's engines are built with ``edgekit.build.build_engine`` (``--runtime onnxruntime`` and
``--runtime openvino``), from edgekit's own Q/DQ ONNX; the peers are run with their own APIs
as a user would (an ORT session; ``core.compile_model`` of NNCF's model, at OpenVINO's default
precision hint and at f32).

    python benchmarks/bench_cpu_engines.py [--calib-samples 128] [--peer-method percentile]
        [--rounds 7] [--iters 30] [--edgekit-int8 DIR] [--out benchmarks/results/cpu_engines.json]

``--edgekit-int8 DIR`` reuses a folder written by ``edgekit compress efficientnet-lite0 --bits 8``
(its quantization time is then read from that folder's manifest, ``int8_seconds``).
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions, read_manifest  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_int8 import peer_quantize  # noqa: E402  (the same quantize_static settings as the INT8 benchmark)

MODEL = "efficientnet-lite0"


def cpu_s() -> float:
    """CPU time of this process (all its threads) and of its finished children, in seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    w0, c0 = time.perf_counter(), cpu_s()
    out = fn()
    return out, time.perf_counter() - w0, cpu_s() - c0


def lscpu_flags() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return line.split(":", 1)[1].strip()
    return ""


# --- quantizers -----------------------------------------------------------------------------------


def edgekit_int8(calib_n: int, out: Path) -> Path:
    from edgekit.compress import compress
    from edgekit.compress.int8 import Int8Config

    return compress(MODEL, [("int8", Int8Config(calib_samples=calib_n))], out)


def nncf_quantize(fp32: Path, dst: Path, calib: Any) -> None:
    """NNCF's default post-training quantization of the OpenVINO model (what its docs show)."""
    import nncf
    import openvino as ov

    name = next(iter(calib.inputs))
    model = ov.Core().read_model(str(fp32))
    model.reshape({name: [1, *calib.inputs[name].shape[1:]]})
    data = nncf.Dataset([calib.inputs[name][i:i + 1] for i in range(len(calib))])
    q = nncf.quantize(model, data, subset_size=len(calib))
    ov.save_model(q, str(dst), compress_to_fp16=False)


# --- runners ----------------------------------------------------------------------------------------


class Runner:
    """A variant as two callables: ``run(feeds) -> logits`` and ``time(feeds) -> wall ms``."""

    def __init__(self, run: Callable[[dict[str, np.ndarray]], np.ndarray], close: Callable[[], None] = lambda: None):
        self.run = run
        self.close = close


def edgekit_runner(folder: Path) -> Runner:
    from edgekit.build import load_engine

    engine = load_engine(folder, threads=1)
    return Runner(lambda f: engine.run(f)[0], engine.close)


def ort_runner(path: Path) -> Runner:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return Runner(lambda f: s.run(None, f)[0])


def ov_runner(path: Path, hint: str | None) -> tuple[Runner, dict[str, Any]]:
    import openvino as ov

    core = ov.Core()
    cfg: dict[str, Any] = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY",
                           "ENABLE_CPU_PINNING": False}
    if hint:
        cfg["INFERENCE_PRECISION_HINT"] = hint
    compiled = core.compile_model(core.read_model(str(path)), "CPU", cfg)
    req = compiled.create_infer_request()

    def run(f: dict[str, np.ndarray]) -> np.ndarray:
        req.infer(f)
        return np.array(req.get_output_tensor(0).data)

    from edgekit.runtimes.openvino import exec_graph_kernels, kernel_summary

    return Runner(run), kernel_summary(exec_graph_kernels(compiled))


def evaluate(runner: Runner, ev: Any) -> np.ndarray:
    name = next(iter(ev.inputs))
    return np.concatenate([runner.run({name: ev.inputs[name][i:i + 1]}) for i in range(len(ev))])


def time_variants(runners: dict[str, Runner], feeds: dict[str, np.ndarray], rounds: int,
                  iters: int) -> dict[str, dict[str, float]]:
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    for r in runners.values():  # warm-up
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:
            r.run(feeds)
    for _ in range(rounds):
        for k, r in runners.items():
            for _ in range(iters):
                c0 = time.process_time()
                t0 = time.perf_counter()
                r.run(feeds)
                wall[k].append((time.perf_counter() - t0) * 1e3)
                cpu[k].append((time.process_time() - c0) * 1e3)
    return {k: {"wall_p50_ms": float(np.median(wall[k])), "wall_p90_ms": float(np.percentile(wall[k], 90)),
                "cpu_p50_ms": float(np.median(cpu[k])), "cpu_mean_ms": float(np.mean(cpu[k])), "n": len(wall[k])}
            for k in runners}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--peer-method", default="percentile", choices=["minmax", "entropy", "percentile"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--edgekit-int8", default=None, help="reuse this `edgekit compress --bits 8` folder")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_engines.json"))
    args = ap.parse_args()

    import onnxruntime
    import openvino
    import torch

    from edgekit.build import build_engine
    from edgekit.compress.int8 import score
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.runtimes.base import BuildOptions
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="edgekit-cpu-engines-"))
    h = load_model(MODEL)
    calib = load_samples(None, h, split="calib", limit=args.calib_samples)
    ev = load_samples(None, h, split="eval")
    print(f"calib {len(calib)} ({calib.source}), eval {len(ev)} ({ev.source}); work {work}", flush=True)
    export_onnx(h, work / "fp32", ExportConfig(skip_parity=True))
    fp32 = work / "fp32" / "model.onnx"

    quant: dict[str, dict[str, Any]] = {}
    if args.edgekit_int8:
        ek = Path(args.edgekit_int8)
        secs = read_manifest(ek).metrics.get("int8_seconds")
        quant["edgekit"] = {"reused": str(ek.name), "wall_s": secs, "cpu_s": None,
                            "note": "compressed in a separate `edgekit compress` run; wall time from its manifest"}
    else:
        ek, w, c = timed(lambda: edgekit_int8(args.calib_samples, work / "edgekit-int8"))
        quant["edgekit"] = {"wall_s": round(w, 2), "cpu_s": round(c, 2)}
    print(f"edgekit int8: {quant['edgekit']}", flush=True)
    peer = work / f"ort-{args.peer_method}.onnx"
    _, w, c = timed(lambda: peer_quantize(fp32, peer, calib, args.peer_method))
    quant["ort_quantize_static"] = {"method": args.peer_method, "wall_s": round(w, 2), "cpu_s": round(c, 2)}
    print(f"quantize_static {args.peer_method}: {quant['ort_quantize_static']}", flush=True)
    nncf_xml = work / "nncf" / "model.xml"
    nncf_xml.parent.mkdir()
    _, w, c = timed(lambda: nncf_quantize(fp32, nncf_xml, calib))
    quant["nncf"] = {"wall_s": round(w, 2), "cpu_s": round(c, 2)}
    print(f"nncf: {quant['nncf']}", flush=True)

    engines: dict[str, Path] = {}
    builds = {"ort-fp32": (fp32, "onnxruntime", "fp32"), "ov-fp32": (fp32, "openvino", "fp32"),
              "ov-bf16": (fp32, "openvino", "bf16"), "edgekit-int8-ort": (ek, "onnxruntime", "fp32"),
              "edgekit-int8-ov": (ek, "openvino", "fp32")}
    manifests: dict[str, Any] = {}
    for key, (src, rt, prec) in builds.items():
        t0 = time.perf_counter()
        engines[key] = build_engine(src, "cpu", work / key, BuildOptions(runtime=rt, precision=prec, threads=1))
        m = read_manifest(engines[key])
        manifests[key] = {"precision": m.config["precision"], "session": m.config.get("session"),
                          "kernels": m.metrics.get("kernels"), "engine_parity": m.metrics.get("engine_parity"),
                          "build_s": round(time.perf_counter() - t0, 2)}
        print(f"built {key} ({m.config['precision']}) in {manifests[key]['build_s']} s", flush=True)

    runners: dict[str, Runner] = {k: edgekit_runner(p) for k, p in engines.items()}
    runners[f"ort-quantize_static-{args.peer_method}"] = ort_runner(peer)
    runners["ov-nncf-int8 (default hint)"], k_default = ov_runner(nncf_xml, None)
    runners["ov-nncf-int8 (f32 hint)"], k_f32 = ov_runner(nncf_xml, "f32")
    manifests["ov-nncf-int8 (default hint)"] = {"kernels": k_default}
    manifests["ov-nncf-int8 (f32 hint)"] = {"kernels": k_f32}

    ref = evaluate(runners["ort-fp32"], ev)
    results: dict[str, Any] = {}
    for k, r in runners.items():
        results[k] = {"metrics": score(evaluate(r, ev), ref, None, "agreement"), **manifests.get(k, {})}
        print(f"  {k}: {results[k]['metrics']}", flush=True)
    name = next(iter(ev.inputs))
    lat = time_variants(runners, {name: ev.inputs[name][:1]}, args.rounds, args.iters)
    base = lat["ort-fp32"]["cpu_p50_ms"]
    for k in runners:
        results[k]["latency"] = lat[k]
        results[k]["speedup_vs_ort_fp32_cpu"] = base / lat[k]["cpu_p50_ms"]
    for r in runners.values():
        r.close()
    res = {"model": MODEL, "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(),
                                                           "loadavg": os.getloadavg()},
           "versions": {**package_versions(), "onnxruntime": onnxruntime.__version__, "openvino": openvino.__version__,
                        "nncf": _version("nncf")},
           "calib": {"source": calib.source, "n": len(calib)}, "eval": {"source": ev.source, "n": len(ev)},
           "settings": {"threads": 1, "batch": 1, "rounds": args.rounds, "iters": args.iters,
                        "peer_method": args.peer_method},
           "quantization": quant, "variants": results}
    atomic_write_json(Path(args.out), res)
    print(f"\n{'variant':34s} {'CPU p50':>8s} {'wall p50':>9s} {'xFP32':>6s} {'agree':>7s} {'KL':>7s}")
    for k, r in results.items():
        m, t = r["metrics"], r["latency"]
        print(f"{k:34s} {t['cpu_p50_ms']:8.3f} {t['wall_p50_ms']:9.3f} {r['speedup_vs_ort_fp32_cpu']:6.2f} "
              f"{m['top1_agreement'] * 100:6.1f}% {m['mean_kl']:7.4f}")
    for k, q in quant.items():
        print(f"quantization {k}: wall {q['wall_s']} s, CPU {q['cpu_s']} s")
    print(f"wrote {args.out}")


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
