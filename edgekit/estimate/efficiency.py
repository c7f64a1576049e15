"""The fraction of a target's peak a kernel reaches: per operator class, shaped by the
operator's GEMM dimensions, and the memory roof it reads from (cache or DRAM).

Compute: ``peak[precision] * eff[class] * shape_factor``. For a convolution or matrix
product of (batch, M, N, K) the shape factor is the share of the hardware tiles that hold
real work (M and N padded to the tile, K against a pipeline depth) times, on GPUs, the
share of the last wave of tiles over the SMs that is busy.

Memory: tensors that fit in the target's ``cache_mb`` (its L2 or last-level cache) move at
``cache_bandwidth_gbs``: an activation a kernel just wrote and the next reads, and every
weight when the whole model's weights fit. Everything else moves at DRAM bandwidth times
``eff["memory"]``.

CPU targets compute against *kernel rates*, not the datasheet peak: what one core's runtime
kernels reach on large well-shaped work, per op class and precision (``Target.kernel_rates``:
measured on this machine by the probe for the ``cpu`` target, else ``peak_tops`` x
``KERNEL_REACH``). Their efficiency factors are fractions of those rates, fitted once on
measured graphs (``benchmarks/bench_estimate_cpu.py``, in ``targets/cpu.yaml``) and shared by
every CPU target: the rates carry what differs between CPU kinds, the factors what the
runtime makes of real graphs' shapes and layers.

Factors come from, in order: the defaults per target kind below, (CPU targets) the fitted
factors of ``targets/cpu.yaml``, the target YAML's ``efficiency`` mapping, then a calibration
saved by ``edgekit estimate --calibrate``.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.artifact import cache_dir
from edgekit.schema import read_yaml
from edgekit.targets import HOST_TARGET, TARGETS_DIR, Target, load_target

# Fraction of peak per class before any tuning (tuned values live in the target YAML files).
DEFAULT_EFFICIENCY: dict[str, dict[str, float]] = {
    # CPU: fractions of the kernel rates (conv, matmul) or of the best fp32 rate (the rest)
    "cpu": {"conv": 1.0, "depthwise-conv": 1.0, "matmul": 1.0, "attention": 0.4, "elementwise": 0.3,
            "normalization": 0.3, "reduction": 0.3, "data-movement": 0.5, "other": 0.3, "memory": 0.85},
    "gpu": {"conv": 0.5, "depthwise-conv": 0.3, "matmul": 0.6, "attention": 0.4, "elementwise": 0.7,
            "normalization": 0.5, "reduction": 0.5, "data-movement": 0.6, "other": 0.3, "memory": 0.8},
    "jetson": {"conv": 0.6, "depthwise-conv": 0.3, "matmul": 0.65, "attention": 0.45, "elementwise": 0.6,
               "normalization": 0.45, "reduction": 0.45, "data-movement": 0.5, "other": 0.3, "memory": 0.75},
}
# Hardware tile (M, N) and the K over which the pipeline fills, per target kind.
TILES: dict[str, tuple[int, int, int]] = {"cpu": (6, 16, 16), "gpu": (16, 32, 32), "jetson": (16, 32, 32)}
CALIBRATION_SUFFIX = ".efficiency.json"
GEMM_REF_ROWS = 256.0  # the rows of the probe's GEMM (its matmul rates are for this M)
DEFAULT_ROW_DEPTH = 18.0  # CPUs without a 16-row GEMM rate: measured on an AVX2 EPYC (16 rows ran at 0.5x)
INT8_IM2COL_DEPTH = 64.0  # u8 dot-product convolutions over an im2col: K over which the pipeline fills
# (3x3 QLinearConv with 4..32 input channels ran at 0.42..0.9 of the 64-channel rate on an AVX2 EPYC;
# 1..3 channels as 4)
# CPU targets without measured kernel rates: the share of the datasheet peak (``peak_tops`` of the
# same precision) ONNX Runtime's one-thread kernels reach on the probe's shapes. Measured by the probe
# (ONNX Runtime 1.31.1) on an AVX2 AMD EPYC (Zen 3) whose clock, timed on a chain of dependent adds, ran
# at 2.9-3.0 GHz (fp32 peak 32 flop/cycle, int8 through vpmaddubsw twice that): the least disturbed of
# five probes on a busy machine (the others were up to 25% slower). An assumption for other CPU kinds.
KERNEL_REACH: dict[str, float] = {"matmul:fp32": 0.80, "matmul-m16:fp32": 0.40, "conv:fp32": 0.88,
                                  "depthwise-conv:fp32": 0.28,
                                  "depthwise-conv-5x5:fp32": 0.25, "matmul:int8": 0.72, "conv:int8": 0.80,
                                  "depthwise-conv:int8": 0.09, "depthwise-conv-5x5:int8": 0.125}
# Input channels a GPU convolution's tensor-core kernel is padded to, per precision (the K step of
# Ampere's mma instructions over the channel axis: INT8 m16n8k32, FP16 m16n8k16 with 8-channel
# vectorized formats, TF32 m16n8k8 with 4).
CHANNEL_ALIGN: dict[str, int] = {"int8": 32, "int4": 32, "fp8": 16, "fp16": 8, "bf16": 8, "tf32": 4}
# Below this many input channels per group, a GPU's grouped convolution does not feed tensor cores
# (ResNeXt's 4-32): it runs like a depthwise one, bound by memory rather than by tile fill.
GROUPED_TENSOR_CORE_CHANNELS = 32


@dataclass(frozen=True)
class Roofs:
    """A target's roofs as the estimator uses them."""

    kind: str
    peak_tops: dict[str, float]
    dram_gbs: float
    cache_mb: float
    cache_gbs: float
    overhead_us: float
    sm_count: int
    eff: dict[str, float]
    calibration: str | None = None
    host_copy_gbs: float = 0.0  # graph inputs and outputs copied between host and device (0: not counted)
    rates: dict[str, float] = field(default_factory=dict)  # CPU: "class:precision" -> kernel ops/s

    def rate(self, cls: str, precision: str, taps: float | None = None) -> float:
        """Ops per second the class's kernel reaches at a precision: its kernel rate where the
        target has one (int4 weights compute in the int8 kernels, bf16/fp16 scale the fp32 rate by
        the peaks' ratio; a depthwise convolution of ``taps`` taps per output between its 3x3 and 5x5
        rates), else the peak."""
        if self.rates:
            p = "int8" if precision == "int4" else precision
            q = p if p in ("fp32", "int8") else "fp32"
            scale = 1.0 if q == p else self.peak(p) / self.peak("fp32")
            r = self.depthwise_rate(q, taps) if cls == "depthwise-conv" and taps else None
            r = r or self.rates.get(f"{cls}:{q}")
            if r:
                return r * scale
        return self.peak(precision)

    def depthwise_rate(self, precision: str, taps: float) -> float | None:
        """A depthwise kernel's time is a cost per output plus a cost per tap (2 ops each); the 3x3
        and 5x5 rates give both, and so the rate at any kernel size (None without both rates)."""
        r3, r5 = self.rates.get(f"depthwise-conv:{precision}"), self.rates.get(f"depthwise-conv-5x5:{precision}")
        if not (r3 and r5):
            return None
        per3, per5 = 18.0 / r3, 50.0 / r5  # seconds per output
        per_tap = max((per5 - per3) / 16.0, 0.0)  # a 5x5 faster per output than a 3x3 is noise: no tap cost
        per_output = max(per3 - 9.0 * per_tap, 0.0)
        return 2.0 * taps / (per_output + taps * per_tap) if per_output + per_tap > 0 else None

    def peak(self, precision: str) -> float:
        """Ops per second at a precision (the nearest the target has: int4 computes as int8
        or fp16, fp8 as fp16, tf32 as fp32)."""
        for p in (precision, {"int4": "int8", "fp8": "fp16", "tf32": "fp32", "bf16": "fp16"}.get(precision, ""),
                  "fp16", "fp32"):
            if p and self.peak_tops.get(p):
                return self.peak_tops[p] * 1e12
        return 1e12

    def memory_eff(self, cls: str, precision: str) -> float:
        """Fraction of bandwidth: ``class:precision@mem`` / ``class@mem`` where a calibration
        fitted one, else the target's ``memory``."""
        for key in (f"{cls}:{precision}@mem", f"{cls}@mem", "memory"):
            if self.eff.get(key, 0) > 0:
                return float(self.eff[key])
        return 0.7

    def class_eff(self, cls: str, precision: str) -> float:
        for key in (f"{cls}:{precision}", cls, "other"):
            if self.eff.get(key, 0) > 0:
                return float(self.eff[key])
        return 0.3


@functools.cache
def fitted_cpu_efficiency() -> dict[str, float]:
    """The efficiency factors fitted for CPU targets (``targets/cpu.yaml``'s ``efficiency``),
    fractions of kernel rates that every CPU target shares."""
    data = read_yaml(TARGETS_DIR / f"{HOST_TARGET}.yaml", "target file")
    eff = data.get("efficiency", {}) if isinstance(data, dict) else {}
    return {str(k): float(v) for k, v in eff.items()}


def kernel_rates(target: Target) -> dict[str, float]:
    """A CPU target's kernel rates in ops/s: its own (measured), else its peaks x ``KERNEL_REACH``."""
    if target.kind != "cpu":
        return {}
    if target.kernel_rates:
        return {k: v * 1e12 for k, v in target.kernel_rates.items()}
    out = {}
    for key, reach in KERNEL_REACH.items():
        peak = target.peak_tops.get(key.split(":")[1])
        if peak:
            out[key] = peak * reach * 1e12
    return out


def roofs_for(target: Target | str, calibrated: bool = True) -> Roofs:
    """The roofs of a target: kind defaults, (CPU) the shared fitted factors, then its YAML,
    then a saved calibration."""
    target = load_target(target)
    eff = dict(DEFAULT_EFFICIENCY[target.kind])
    if target.kind == "cpu":
        eff.update(fitted_cpu_efficiency())
    eff.update({k: float(v) for k, v in target.efficiency.items()})
    overhead = float(target.kernel_overhead_us)
    path = None
    if calibrated:
        cal = load_calibration(target)
        if cal is not None:
            eff.update({k: float(v) for k, v in cal.get("efficiency", {}).items()})
            if cal.get("kernel_overhead_us") is not None:
                overhead = float(cal["kernel_overhead_us"])
            path = str(cal.get("path"))
    return Roofs(target.kind, dict(target.peak_tops), target.memory_bandwidth_gbs, target.cache_mb,
                 target.cache_bandwidth_gbs or target.memory_bandwidth_gbs, overhead, target.sm_count or 1, eff, path,
                 float(eff.get("host_copy_gbs", target.host_copy_gbs)), kernel_rates(target))


def shape_factor(roofs: Roofs, gemm: tuple[float, float, float, float] | None, depthwise: bool = False,
                 precision: str = "fp16", channels: float | None = None,
                 dot_k: tuple[float, int] | None = None) -> float:
    """Share of peak a (batch, M, N, K) product can use on this kind of hardware (on CPUs relative
    to the probe's GEMM shape, so a little over 1 for products larger than it).

    On GPUs a convolution's input channels are padded to the tensor-core alignment of its
    precision (``CHANNEL_ALIGN``: 32 for INT8, 8 for FP16): a 16-channel INT8 convolution does
    twice the work it needs, a 3-channel one more than ten times (TensorRT runs such layers in
    FP16 instead, which the INT8 estimate's per-layer choice reproduces).

    On CPUs: the rows of A a kernel call streams B for (``m / (m + depth)``, the depth from
    the probe's GEMM rates at 16 and 256 rows, relative to 256 rows, as its rate was measured;
    one row is a GEMV: no such cost), and for integer kernels (``dot_k``: K and taps as the u8
    dot-product kernels see them, input channels padded to a multiple of 4) the padded K, and a
    deeper K pipeline behind an im2col (more than one tap: ``INT8_IM2COL_DEPTH``).
    """
    if gemm is None or depthwise:
        return 1.0
    if roofs.kind != "cpu" and gemm[0] > 1 and channels is not None and channels < GROUPED_TENSOR_CORE_CHANNELS:
        return 1.0  # a grouped convolution with few channels per group: CUDA-core kernels, like a depthwise one
    batch, m, n, k = (max(1.0, x) for x in gemm)
    tm, tn, tk = TILES[roofs.kind]
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    k_share = k / (k + tk)
    if roofs.kind == "cpu" and dot_k is not None:
        padded, taps = dot_k
        k_share = k / (max(padded, k) + (INT8_IM2COL_DEPTH if taps > 1 else tk))
    # a skinny product (M under one tile) runs a GEMV-style kernel: no padding penalty on M
    f = (m / (tiles_m * tm) if m >= tm else 1.0) * (n / (tiles_n * tn)) * k_share
    if roofs.kind == "cpu" and m >= 2:
        depth = row_depth(roofs)
        f *= (m / (m + depth)) / (GEMM_REF_ROWS / (GEMM_REF_ROWS + depth))
    align = CHANNEL_ALIGN.get(precision, 1) if roofs.kind != "cpu" else 1
    if channels and align > 1:
        f *= channels / (math.ceil(channels / align) * align)
    if roofs.kind != "cpu":
        tiles = batch * tiles_m * tiles_n
        f *= tiles / (math.ceil(tiles / roofs.sm_count) * roofs.sm_count)
    return max(f, 1e-3)


def row_depth(roofs: Roofs) -> float:
    """The rows of A over which a CPU GEMM kernel's streaming of B amortizes (``m / (m + depth)``
    of its best rate at ``m`` rows): from the fp32 GEMM rates at 16 and 256 rows, else
    ``DEFAULT_ROW_DEPTH``."""
    r16, r256 = roofs.rates.get("matmul-m16:fp32"), roofs.rates.get("matmul:fp32")
    if not (r16 and r256):
        return DEFAULT_ROW_DEPTH
    q = min(r16 / r256, 1.0)  # = [16 / (16 + d)] / [256 / (256 + d)]
    denom = 16.0 - GEMM_REF_ROWS * q
    return min(max(GEMM_REF_ROWS * 16.0 * (q - 1.0) / denom, 0.0) if denom < 0 else 256.0, 256.0)


# --- saved calibrations (written by calibrate.py) ---------------------------------------------------
def calibration_path(target: Target | str) -> Path:
    """Where a target's fitted factors live: next to a user's YAML, else in the cache."""
    target = load_target(target)
    if target.path and Path(target.path).resolve().parent != Path(TARGETS_DIR).resolve():
        p = Path(target.path)
        return p.with_name(p.stem + CALIBRATION_SUFFIX)
    return cache_dir() / "targets" / f"{target.name}{CALIBRATION_SUFFIX}"


def load_calibration(target: Target | str) -> dict[str, Any] | None:
    """The saved calibration of a target (with ``path``), or None. A file for another
    target name, or one that does not parse, is ignored."""
    target = load_target(target)
    path = calibration_path(target)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict) or data.get("target") != target.name:
        return None
    data["path"] = str(path)
    return data
