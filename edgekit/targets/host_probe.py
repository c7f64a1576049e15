"""This machine's measured figures (the probe), as data: the record, where it is cached, and
how it turns the ``cpu`` target into this machine.

The probe itself (``edgekit.estimate.probe.probe_machine``, ``edgekit targets --probe``) times
the kernels the runtime runs here at one thread; this module only holds what it found. A
probe is cached per machine in ``<cache>/probe/`` under a key of the CPU (model, family and
model numbers, the features that decide kernels), its core count, the runtime's version and
the probe's format, so a probe from another CPU kind, another runtime version or an older
edgekit is never used. ``load_target("cpu")`` applies the cached probe where there is one
(``apply_probe``): its peaks, kernel rates, bandwidths, cache size and per-node overhead
replace the YAML's, and ``provenance`` says they were measured.

CPU figures are one core's: ``peak_tops`` and ``kernel_rates`` are what one thread computes,
``memory_bandwidth_gbs`` what one thread reads (the estimate is for one intra-op thread).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from edgekit.artifact import cache_dir
from edgekit.errors import BadInputError
from edgekit.schema import FieldError, Loc, check_fields, from_mapping, read_json
from edgekit.targets.cpu_isa import cpu_features, int8_kernel

PROBE_FORMAT = 4  # bump when what the probe measures changes: older probes are then measured again
# op class : precision -> what the runtime's kernel computes per second at one thread (GEMMs: 256 rows, and
# 16 rows under "matmul-m16"; depthwise: 3x3, and 5x5 under "depthwise-conv-5x5": the estimator
# interpolates other shapes between them)
RATE_KEYS = ("matmul:fp32", "matmul-m16:fp32", "conv:fp32", "depthwise-conv:fp32", "depthwise-conv-5x5:fp32",
             "matmul:int8", "conv:int8", "depthwise-conv:int8", "depthwise-conv-5x5:int8")
# Sanity bounds for one core: a figure outside them is a broken measurement, not a machine.
RATE_BOUNDS_TOPS = (1e-4, 50.0)
BANDWIDTH_BOUNDS_GBS = (0.1, 2000.0)
OVERHEAD_BOUNDS_US = (0.0, 1000.0)


@dataclass(frozen=True)
class HostProbe:
    """What ``probe_machine`` measured on this machine (one thread)."""

    key: str  # the cache key (``probe_key()``) it was measured under
    cpu: str  # model name
    arch: str
    isa: tuple[str, ...]
    cores: int
    runtime: str  # "onnxruntime 1.31.1": the runtime whose kernels were timed
    threads: int
    int8_kernel: str  # cpu_isa.int8_kernel's family name ("avx2", "avx512-vnni", ...)
    # "7-bit" where the int8 kernels saturate (timed with weights that cannot overflow them; the int8 step's
    # pair-safe 8-bit codes run the same kernel at the same speed), else "8-bit"
    int8_weights: str
    kernel_rates: dict[str, float]  # RATE_KEYS -> TOPS at ``threads``
    kernels: dict[str, str]  # RATE_KEYS -> the operator and shape timed for it
    memory_bandwidth_gbs: float  # one thread reading a buffer far larger than the caches
    cache_bandwidth_gbs: float  # one thread reading buffers up to ``cache_bytes`` (median)
    cache_bytes: int  # the largest buffer one thread reads at >= 1.5x memory bandwidth (the cache roof)
    caches: dict[str, int]  # "L1d", "L2", "L3" -> bytes (one core's; a shared level counts whole)
    kernel_overhead_us: float  # the runtime's time per node that does (almost) no work
    seconds: float  # wall time of the probe
    cpu_seconds: float  # process CPU time of the probe
    created: str
    format: int = PROBE_FORMAT
    kind: str = "cpu-probe"

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "isa", tuple(self.isa))
        for k, v in self.kernel_rates.items():
            if k not in RATE_KEYS:
                raise FieldError(f"kernel_rates.{k}", f"unknown kernel (known: {', '.join(RATE_KEYS)})")
            _check_range(f"kernel_rates.{k}", v, RATE_BOUNDS_TOPS, "TOPS")
        _check_range("memory_bandwidth_gbs", self.memory_bandwidth_gbs, BANDWIDTH_BOUNDS_GBS, "GB/s")
        _check_range("cache_bandwidth_gbs", self.cache_bandwidth_gbs, BANDWIDTH_BOUNDS_GBS, "GB/s")
        _check_range("kernel_overhead_us", self.kernel_overhead_us, OVERHEAD_BOUNDS_US, "us")
        if self.cache_bytes < 1:
            raise FieldError("cache_bytes", f"must be >= 1, got {self.cache_bytes}")
        if self.threads < 1 or self.cores < 1:
            raise FieldError("threads", f"threads and cores must be >= 1, got {self.threads} and {self.cores}")

    @property
    def fp32_tops(self) -> float:
        """The best fp32 rate measured (GEMM or convolution): the probed target's fp32 peak."""
        return max(self.kernel_rates.get("matmul:fp32", 0.0), self.kernel_rates.get("conv:fp32", 0.0))

    @property
    def int8_tops(self) -> float:
        return max(self.kernel_rates.get("matmul:int8", 0.0), self.kernel_rates.get("conv:int8", 0.0))

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _check_range(name: str, value: float, bounds: tuple[float, float], unit: str) -> None:
    lo, hi = bounds
    if not (math.isfinite(value) and lo <= value <= hi):
        raise FieldError(name, f"{value!r} {unit} is outside the sane range {lo:g}-{hi:g} {unit}")


def runtime_version() -> str:
    """The version of the runtime the probe times (ONNX Runtime, the cpu target's first runtime),
    read from the installed package's metadata (nothing is imported); "" where it is missing."""
    try:
        return importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        return ""


def cpu_identity() -> dict[str, str]:
    """/proc/cpuinfo's vendor, family, model and stepping (x86), implementer and part (arm64)."""
    keys = ("vendor_id", "cpu family", "model", "stepping", "cpu implementer", "cpu part", "cpu variant")
    found: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip().lower()
        if k in keys and k not in found:
            found[k] = v.strip()
        if not line.strip() and found:
            break  # the first processor is enough
    return found


def probe_key() -> str:
    """The cache key of this machine's probe: CPU model and numbers, the features that decide
    kernels, core count, runtime version, probe format."""
    arch, isa, model = cpu_features()
    ident = {"cpu": model, **cpu_identity(), "arch": arch, "isa": list(isa), "cores": os.cpu_count() or 1,
             "onnxruntime": runtime_version(), "format": PROBE_FORMAT}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def probe_path(key: str | None = None) -> Path:
    return cache_dir() / "probe" / f"cpu-{key or probe_key()}.json"


def load_probe() -> HostProbe | None:
    """This machine's cached probe, or None (none yet, another machine's key, a file that does
    not parse or fails the sanity bounds: measured again by the next probe)."""
    key = probe_key()
    path = probe_path(key)
    if not path.is_file():
        return None
    try:
        probe = from_mapping(HostProbe, read_json(path, "probe file"), Loc(f"probe file {str(path)!r}"), noun="key")
    except (BadInputError, OSError):
        return None
    return probe if probe.key == key and probe.format == PROBE_FORMAT else None


def host_int8_weights() -> str:
    """The weight grid the int8 kernels of this machine are timed with: "7-bit" where they saturate."""
    arch, isa, _ = cpu_features()
    return "7-bit" if int8_kernel(arch, isa).saturates else "8-bit"


__all__ = ["PROBE_FORMAT", "RATE_KEYS", "HostProbe", "cpu_identity", "host_int8_weights", "load_probe", "probe_key", "probe_path",
           "runtime_version"]
