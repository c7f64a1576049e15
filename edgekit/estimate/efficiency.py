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

Factors come from, in order: the defaults per target kind below, the target YAML's
``efficiency`` mapping, then a calibration saved by ``edgekit estimate --calibrate``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.artifact import cache_dir
from edgekit.targets import TARGETS_DIR, Target, load_target

# Fraction of peak per class before any tuning (tuned values live in the target YAML files).
DEFAULT_EFFICIENCY: dict[str, dict[str, float]] = {
    "cpu": {"conv": 0.6, "depthwise-conv": 0.15, "matmul": 0.7, "attention": 0.4, "elementwise": 0.3,
            "normalization": 0.3, "reduction": 0.3, "data-movement": 0.5, "other": 0.3, "memory": 0.6},
    "gpu": {"conv": 0.5, "depthwise-conv": 0.3, "matmul": 0.6, "attention": 0.4, "elementwise": 0.7,
            "normalization": 0.5, "reduction": 0.5, "data-movement": 0.6, "other": 0.3, "memory": 0.8},
    "jetson": {"conv": 0.6, "depthwise-conv": 0.3, "matmul": 0.65, "attention": 0.45, "elementwise": 0.6,
               "normalization": 0.45, "reduction": 0.45, "data-movement": 0.5, "other": 0.3, "memory": 0.75},
}
# Hardware tile (M, N) and the K over which the pipeline fills, per target kind.
TILES: dict[str, tuple[int, int, int]] = {"cpu": (6, 16, 16), "gpu": (16, 32, 32), "jetson": (16, 32, 32)}
CALIBRATION_SUFFIX = ".efficiency.json"
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


def roofs_for(target: Target | str, calibrated: bool = True) -> Roofs:
    """The roofs of a target: kind defaults, then its YAML, then a saved calibration."""
    target = load_target(target)
    eff = dict(DEFAULT_EFFICIENCY[target.kind])
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
                 float(eff.get("host_copy_gbs", target.host_copy_gbs)))


def shape_factor(roofs: Roofs, gemm: tuple[float, float, float, float] | None, depthwise: bool = False,
                 precision: str = "fp16", channels: float | None = None) -> float:
    """Share of peak a (batch, M, N, K) product can use on this kind of hardware (0..1].

    On GPUs a convolution's input channels are padded to the tensor-core alignment of its
    precision (``CHANNEL_ALIGN``: 32 for INT8, 8 for FP16): a 16-channel INT8 convolution does
    twice the work it needs, a 3-channel one more than ten times (TensorRT runs such layers in
    FP16 instead, which the INT8 estimate's per-layer choice reproduces)."""
    if gemm is None or depthwise:
        return 1.0
    if roofs.kind != "cpu" and gemm[0] > 1 and channels is not None and channels < GROUPED_TENSOR_CORE_CHANNELS:
        return 1.0  # a grouped convolution with few channels per group: CUDA-core kernels, like a depthwise one
    batch, m, n, k = (max(1.0, x) for x in gemm)
    tm, tn, tk = TILES[roofs.kind]
    tiles_m, tiles_n = math.ceil(m / tm), math.ceil(n / tn)
    # a skinny product (M under one tile) runs a GEMV-style kernel: no padding penalty on M
    f = (m / (tiles_m * tm) if m >= tm else 1.0) * (n / (tiles_n * tn)) * (k / (k + tk))
    align = CHANNEL_ALIGN.get(precision, 1) if roofs.kind != "cpu" else 1
    if channels and align > 1:
        f *= channels / (math.ceil(channels / align) * align)
    if roofs.kind != "cpu":
        tiles = batch * tiles_m * tiles_n
        f *= tiles / (math.ceil(tiles / roofs.sm_count) * roofs.sm_count)
    return max(f, 1e-3)


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
