"""PyTorch-native (torch.export + AOTInductor) engines on a CUDA GPU versus the roofline
estimate for that GPU (issue 8).

    python benchmarks/bench_gpu.py [--target h100-sxm] [--duration-s 3] [--skip-llm]
    python benchmarks/bench_gpu.py --cpu        # the same flow with CPU torch engines (no GPU needed)

Needs an NVIDIA GPU with CUDA (exits 2 with a message otherwise). For EfficientNet-Lite0
(batch 1), the Fashion-MNIST CNN (batch 1) and SmolLM2-135M (128-token prefill and a
one-token forward, no KV cache), at FP32, FP16 and BF16: build a torch engine, profile
it (CUDA-event device time, trtexec method), estimate the same model on the GPU's
target, and compare; then fit the GPU target's efficiency (one factor over all
classes, end to end: kernels do not map to ONNX nodes) and report the error before and
after. Also measures a bf16 matmul and a device copy, the two roofs, to compare with
the target's peak and bandwidth. Writes ``benchmarks/results/gpu.json`` and prints a
Markdown table for RESULTS.md. ``--cpu`` runs the flow on this CPU instead (target ``cpu``,
FP32, 1 thread) and writes ``benchmarks/results/torch_cpu.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PRECISIONS = ("fp32", "fp16", "bf16")


def _gpu_target(name: str) -> str:
    n = name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-sxm"
    if "a100" in n:
        return "a100-80"
    if "l4" in n:
        return "l4"
    if "orin" in n:
        return "jetson-agx-orin-64"
    return "h100-sxm"


def roofs(torch: Any) -> dict[str, float]:
    """Measured bf16 matmul TFLOP/s and device copy GB/s (read + write)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        a @ b
    e.record()
    e.synchronize()
    tflops = 2 * n**3 * 20 / (s.elapsed_time(e) / 1e3) / 1e12
    x = torch.empty(256 * 2**20, device="cuda", dtype=torch.float32)  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    e.synchronize()
    gbs = 2 * x.numel() * 4 * 10 / (s.elapsed_time(e) / 1e3) / 1e9
    return {"bf16_matmul_tflops": round(tflops, 1), "copy_gbs": round(gbs, 1)}


def _with_sequence(handle: Any, seq: int) -> Any:
    """A causal-LM handle whose sample inputs (and traced shapes) have ``seq`` tokens."""
    from edgekit.sources.handle import InputSpec

    orig = handle.make_inputs

    def make_inputs(batch: int = 1, **_: int) -> Any:
        return orig(batch, sequence=seq)

    inputs = [InputSpec(s.name, ("batch", seq), s.dtype) for s in handle.inputs]
    return dataclasses.replace(handle, make_inputs=make_inputs, inputs=inputs, name=f"{handle.name}-seq{seq}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="edgekit target of this GPU (default: from the GPU's name)")
    ap.add_argument("--duration-s", type=float, default=3.0)
    ap.add_argument("--skip-llm", action="store_true")
    ap.add_argument("--cpu", action="store_true",
                    help="Run the same flow with CPU torch engines on the 'cpu' target (no GPU needed; FP32 only, "
                         "no SmolLM2 unless --llm): compile times and CPU latency of the PyTorch-native engine.")
    ap.add_argument("--llm", action="store_true", help="With --cpu: include SmolLM2.")
    ap.add_argument("--precisions", default=None, help="Comma-separated (default fp32,fp16,bf16; --cpu: fp32).")
    args = ap.parse_args()
    import torch

    if args.cpu:
        return run(args, torch, cuda=False)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here (torch.cuda.is_available() is False, torch "
              f"{torch.__version__}); run this script on a machine with an NVIDIA GPU and a CUDA build of torch. "
              "Nothing was measured.", file=sys.stderr)
        return 2
    return run(args, torch, cuda=True)


def run(args: Any, torch: Any, cuda: bool) -> int:
    from bench_estimate import PREFILL, _export, _smollm2_folder

    from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions
    from edgekit.build import build_engine
    from edgekit.estimate import estimate
    from edgekit.estimate.calibrate import Measurement, calibrate
    from edgekit.loading import load_model
    from edgekit.profiling import ProfileConfig, profile_engine
    from edgekit.runtimes.base import BuildOptions
    from edgekit.targets import load_target

    precisions = tuple(args.precisions.split(",")) if args.precisions else (PRECISIONS if cuda else ("fp32",))
    smi = ""
    measured_roofs: dict[str, float] = {}
    if cuda:
        gpu = torch.cuda.get_device_name(0)
        target = load_target(args.target or _gpu_target(gpu))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        print(f"GPU: {gpu}; target {target.name}; {smi}", flush=True)
        measured_roofs = roofs(torch)
        print(f"roofs: {measured_roofs} (target: bf16 {target.peak_tops.get('bf16', target.peak_tops.get('fp16'))} "
              f"TFLOPS, {target.memory_bandwidth_gbs} GB/s)", flush=True)
    else:
        gpu = "none (CPU run)"
        target = load_target(args.target or "cpu")
        print(f"CPU run on target {target.name}: torch engines on this CPU, 1 thread", flush=True)

    from edgekit.sources.fmnist import FashionCNN, fmnist_handle

    torch.manual_seed(0)
    cases: list[tuple[str, Any, Path, dict[str, int]]] = []
    eff = load_model("efficientnet-lite0")
    cases.append(("efficientnet-lite0", eff, _export(eff, "efficientnet-lite0-fp32"), {}))
    fm = fmnist_handle("fmnist-cnn", module=FashionCNN().eval())
    cases.append(("fmnist-cnn", fm, _export(fm, "fmnist-cnn-fp32"), {}))
    gguf = None if (args.skip_llm or (not cuda and not args.llm)) else _smollm2_folder()
    if gguf is not None:
        llm = load_model(str(gguf))
        onnx_llm = _export(str(gguf), "smollm2-135m-fp32")
        import onnx

        m = onnx.load(str(onnx_llm), load_external_data=False)
        seq_names = {d.dim_param for i in m.graph.input for ax, d in enumerate(i.type.tensor_type.shape.dim)
                     if ax == 1 and d.dim_param}
        for seq, label in ((PREFILL, f"smollm2-135m prefill {PREFILL}"), (1, "smollm2-135m decode 1 token")):
            cases.append((label, _with_sequence(llm, seq), onnx_llm, dict.fromkeys(seq_names, seq)))
    rows, measurements = [], []
    for label, handle, onnx_path, dims in cases:
        for prec in precisions:
            if prec not in target.precisions:
                continue
            with tempfile.TemporaryDirectory(prefix="edgekit-gpu-") as tmp:
                t0 = time.perf_counter()
                try:
                    d = build_engine(handle, target, Path(tmp) / "engine",
                                     BuildOptions(runtime="torch", precision=prec, batch=1))
                except Exception as e:
                    rows.append({"model": label, "precision": prec, "error": f"{type(e).__name__}: {e}"})
                    print(f"{label} {prec}: build failed: {e}", flush=True)
                    continue
                build_s = time.perf_counter() - t0
                from edgekit.artifact import read_manifest

                man = read_manifest(d)
                prof = profile_engine(d, ProfileConfig(duration_s=args.duration_s, top_k=10, node_iterations=10,
                                                       threads=None if cuda else 1))
            est = estimate(onnx_path, target, prec, dims=dims, calibrated=False)
            p50 = prof.latency_ms.p50
            row = {"model": label, "precision": prec, "measured_p50_ms": p50, "measured_p99_ms": prof.latency_ms.p99,
                   "cv": prof.latency_ms.cv, "estimate_ms": est.total_ms, "error": (est.total_ms - p50) / p50,
                   "bound": est.bound, "build_s": round(build_s, 1),
                   "compile_s": man.metrics.get("compile_seconds"), "parity": man.metrics.get("parity"),
                   "top_kernels": [n.to_dict() for n in prof.nodes[:5]]}
            rows.append(row)
            measurements.append(Measurement(model=f"{label} {prec}", graph=None, source=onnx_path, p50_ms=p50,
                                            nodes={}, node_ops={}, runtime="torch", threads=None, dims=dims,
                                            batch=1, cv=prof.latency_ms.cv, precision=prec))
            print(f"{label} {prec}: measured p50 {p50:.3f} ms, estimate {est.total_ms:.3f} ms "
                  f"({row['error']:+.0%}), compile {row['compile_s']} s", flush=True)
    report = None
    if measurements and cuda:
        # Per precision the efficiency differs (tensor cores): fit on all, report per case.
        report = calibrate([], target, measurements=measurements, save=True, user_estimates=False)
        print(report.render(), flush=True)
    out = {"benchmark": "gpu" if cuda else "torch-cpu", "note": "torch.export + AOTInductor engines on CUDA versus roofline ESTIMATES",
           "created": now_iso(), "gpu": gpu, "nvidia_smi": smi, "target": target.name, "roofs": measured_roofs,
           "machine": machine_info(), "versions": {**package_versions(), "cuda": torch.version.cuda},
           "precisions": list(precisions),
           "rows": rows, "calibration": report.to_dict() if report else None}
    path = ROOT / "benchmarks" / "results" / ("gpu.json" if cuda else "torch_cpu.json")
    atomic_write_json(path, out)
    print("\n| model | precision | measured p50 ms | estimate ms (before calib.) | error | compile s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r and isinstance(r["error"], str):
            print(f"| {r['model']} | {r['precision']} | build failed: {r['error'][:80]} | | | |")
        else:
            print(f"| {r['model']} | {r['precision']} | {r['measured_p50_ms']:.3f} | {r['estimate_ms']:.3f} | "
                  f"{r['error']:+.0%} | {r['compile_s']} |")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
