"""Targets as data: one YAML file per device in this folder, loaded into ``Target``.

A target names the runtimes it prefers, the precisions it supports and the hardware
numbers the roofline estimator needs. Unknown keys are errors. Users pass their own
YAML file with ``--target ./my-board.yaml``.

CPU targets (``kind: cpu``) give one core's figures: ``peak_tops``, ``kernel_rates`` and
``memory_bandwidth_gbs`` are what one thread computes and reads, because CPU estimates are
for one intra-op thread (``build --threads 1``, as calibration and the benchmarks time CPU
engines); ``cores`` is how many cores the CPU has (the ``cpu`` target: this machine's; a
named class of CPUs may leave it out). The ``cpu`` target is this machine: its architecture,
features and cores are detected, and a cached probe (``host_probe``; ``edgekit targets
--probe``) replaces its YAML figures with measured ones.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import FieldError, Loc, check_fields, from_mapping, read_yaml
from edgekit.targets.cpu_isa import ARCHS, FEATURES, Int8Kernel, cpu_features, int8_kernel
from edgekit.targets.host_probe import RATE_KEYS, HostProbe, load_probe, probe_path
from edgekit.targets.runtime_registry import RUNTIMES

TARGETS_DIR = Path(__file__).parent
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4")
KINDS = ("cpu", "gpu", "jetson")
HOST_TARGET = "cpu"  # the target that describes the machine edgekit runs on (detected at load)
TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_CLAUSE = r"\s*(?:>=|<=|==|>|<)\s*\d+(?:\.\d+)*\s*"
VERSION_RANGE = re.compile(rf"{_CLAUSE}(?:,{_CLAUSE})*")  # what version_in_range reads


@dataclass(frozen=True)
class Target:
    """One device. Throughput figures are dense peaks (sparse are twice)."""

    name: str
    description: str
    kind: str  # "cpu" | "gpu" | "jetson"
    runtimes: tuple[str, ...]  # in order of preference: "onnxruntime", "tensorrt", "torch"
    precisions: tuple[str, ...]
    peak_tops: dict[str, float] = field(default_factory=dict)  # precision -> TFLOPS/TOPS (CPU: one core)
    dla_peak_tops: dict[str, float] = field(default_factory=dict)  # precision -> TOPS, all DLA cores
    dla_cores: int = 0
    memory_bandwidth_gbs: float = 0.0
    memory_gb: float = 0.0
    sm: str | None = None  # e.g. "sm_87"
    gpu: str | None = None
    power_modes: tuple[str, ...] = ()
    tensorrt_versions: str | None = None  # e.g. ">=10.3,<10.4" where JetPack pins it
    jetpack: str | None = None
    execution_providers: tuple[str, ...] = ()  # onnxruntime EPs, in order
    cores: int | None = None  # CPU targets: the cores the CPU has (figures are one core's)
    arch: str | None = None  # CPU targets: "x86_64" | "arm64"
    isa: tuple[str, ...] = ()  # CPU features that decide kernels (``cpu_isa.FEATURES``: avx2, avx512_vnni, dotprod, ...)
    kernel_overhead_us: float = 5.0  # per-node launch/dispatch overhead for the estimator
    efficiency: dict[str, float] = field(default_factory=dict)  # op class -> fraction of peak (fitted)
    # CPU targets: "class:precision" (host_probe.RATE_KEYS) -> TOPS one core's runtime kernels reach on
    # large well-shaped work (measured by the probe; else the estimator derives them from peak_tops)
    kernel_rates: dict[str, float] = field(default_factory=dict)
    cache_mb: float = 0.0  # L2 / last-level cache one kernel's working set can live in (estimator)
    cache_bandwidth_gbs: float = 0.0  # bandwidth from that cache (0: as DRAM)
    host_copy_gbs: float = 0.0  # copying graph inputs/outputs between host and device (0: not counted)
    remote: str | None = None  # user@host for remote build/profile
    sources: tuple[str, ...] = ()  # where the numbers come from
    # GPU detail: SM count, core counts, DLA precisions, board power.
    sm_count: int | None = None
    cuda_cores: int | None = None
    tensor_cores: int | None = None
    dla_precisions: tuple[str, ...] = ()
    tdp_w: float | None = None
    # field (or "field.key") -> where its number comes from: "facts: ...", "recalled: ...", "derived: ...".
    provenance: dict[str, str] = field(default_factory=dict)
    path: str | None = field(default=None, metadata={"internal": True})  # the YAML file it was read from
    probe: str | None = field(default=None, metadata={"internal": True})  # the probe file its figures come from

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations; lists in YAML become tuples
        for name in ("runtimes", "precisions", "power_modes", "execution_providers", "isa", "sources",
                     "dla_precisions"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if not TARGET_NAME.fullmatch(self.name):
            raise FieldError("name", f"{self.name!r} must be letters, digits, '_', '.' or '-', starting with a "
                                     "letter or digit")
        if self.kind not in KINDS:
            raise FieldError("kind", f"unknown kind {self.kind!r} (choose from {', '.join(KINDS)})")
        if not self.runtimes:
            raise FieldError("runtimes", f"names no runtime (choose from {', '.join(RUNTIMES)})")
        for i, rt in enumerate(self.runtimes):
            if rt not in RUNTIMES:
                raise FieldError(f"runtimes[{i}]", f"unknown runtime {rt!r} (choose from {', '.join(RUNTIMES)})")
        if not self.precisions:
            raise FieldError("precisions", f"names no precision (choose from {', '.join(PRECISIONS)})")
        for name in ("precisions", "dla_precisions"):
            for i, p in enumerate(getattr(self, name)):
                if p not in PRECISIONS:
                    raise FieldError(f"{name}[{i}]", f"unknown precision {p!r} (choose from {', '.join(PRECISIONS)})")
        for name in ("peak_tops", "dla_peak_tops"):
            for p, v in getattr(self, name).items():
                if p not in PRECISIONS:
                    raise FieldError(f"{name}.{p}", f"unknown precision (choose from {', '.join(PRECISIONS)})")
                if v <= 0:
                    raise FieldError(f"{name}.{p}", f"must be > 0 TOPS, got {v}")
        for key, v in self.kernel_rates.items():
            if key not in RATE_KEYS:
                raise FieldError(f"kernel_rates.{key}", f"unknown kernel (choose from {', '.join(RATE_KEYS)})")
            if v <= 0:
                raise FieldError(f"kernel_rates.{key}", f"must be > 0 TOPS, got {v}")
        for op, v in self.efficiency.items():
            if v <= 0:
                raise FieldError(f"efficiency.{op}", f"must be a fraction of peak > 0, got {v}")
        for name in ("dla_cores", "memory_bandwidth_gbs", "memory_gb", "kernel_overhead_us", "tensor_cores",
                     "cache_mb", "cache_bandwidth_gbs", "host_copy_gbs"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise FieldError(name, f"must be >= 0, got {v}")
        for name in ("cores", "sm_count", "cuda_cores", "tdp_w"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise FieldError(name, f"must be > 0, got {v}")
        if self.arch is not None and self.arch not in ARCHS:
            raise FieldError("arch", f"unknown architecture {self.arch!r} (choose from {', '.join(ARCHS)})")
        for i, f in enumerate(self.isa):
            if f not in FEATURES:
                raise FieldError(f"isa[{i}]", f"unknown CPU feature {f!r} (choose from {', '.join(FEATURES)})")
        if self.sm is not None and not re.fullmatch(r"sm_\d{2,3}", self.sm):
            raise FieldError("sm", f"must look like 'sm_87', got {self.sm!r}")
        if self.tensorrt_versions and not VERSION_RANGE.fullmatch(self.tensorrt_versions):
            # every clause, not only up to the first that fails for some version: the range is
            # written into a bundle's build.sh and README
            raise FieldError("tensorrt_versions", f"bad version range {self.tensorrt_versions!r} "
                                                  "(use e.g. '>=10.3,<10.4')")
        if any(ch.isprintable() is False for ch in self.description):
            raise FieldError("description", f"{self.description!r} must be one line of printable text")

    def supports(self, precision: str) -> bool:
        return precision in self.precisions

    def require_precision(self, precision: str) -> None:
        if precision == "best" and "fp16" in self.precisions and "int8" in self.precisions:
            return  # TensorRT's "best": every precision the GPU has, chosen per layer
        if precision not in self.precisions:
            raise BadInputError(f"target {self.name!r} does not support precision {precision!r} "
                                f"(choose from {', '.join(self.precisions)})")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def int8_kernel(self) -> Int8Kernel | None:
        """The integer kernel family of a CPU target (None for GPU targets, or a CPU target that
        does not say its architecture)."""
        if self.kind != "cpu" or self.arch is None:
            return None
        return int8_kernel(self.arch, self.isa)

    @property
    def identity(self) -> str:
        """What a target-aware result depends on: the name, and for a CPU target its architecture and
        integer kernels (the ``cpu`` target on two machines of different kinds is two targets)."""
        kernel = self.int8_kernel
        return f"{self.name}/{self.arch}/{kernel.name}" if kernel is not None else self.name

    @property
    def is_this_machine(self) -> bool:
        """A CPU target this machine stands for: the ``cpu`` target, or a named CPU target of this
        machine's architecture whose integer kernels are this machine's (an engine built and timed
        here runs the kernels it will run there)."""
        if self.kind != "cpu":
            return False
        if self.name == HOST_TARGET:
            return True
        arch, isa, _ = cpu_features()
        mine = int8_kernel(arch, isa)
        return self.arch == arch and self.int8_kernel is not None and self.int8_kernel.name == mine.name

    @property
    def has_gpu(self) -> bool:
        return self.kind in ("gpu", "jetson")

    def tensorrt_version_ok(self, version: str) -> bool:
        """Whether a TensorRT version falls in ``tensorrt_versions`` (always True when unpinned).

        >>> load_target("jetson-agx-orin-64").tensorrt_version_ok("10.3.0.30")
        True
        """
        return version_in_range(version, self.tensorrt_versions)


TargetLike = str | os.PathLike[str] | Target  # what load_target takes: a built-in name, a YAML path, a Target


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in str(v).strip().split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def version_in_range(version: str, spec: str | None) -> bool:
    """A small subset of PEP 440 specifiers: comma-separated ``>=``, ``>``, ``<=``, ``<``, ``==``
    (``==10.3`` matches 10.3.x). ``None`` or empty matches everything."""
    if not spec:
        return True
    v = _version_tuple(version)
    for clause in spec.split(","):
        clause = clause.strip()
        for op in (">=", "<=", "==", ">", "<"):
            if clause.startswith(op):
                ref = _version_tuple(clause[len(op):])
                break
        else:
            raise BadInputError(f"bad version range {spec!r} (use e.g. '>=10.3,<10.4')")
        head = v[:len(ref)] if op == "==" else v
        width = max(len(head), len(ref))
        a, b = head + (0,) * (width - len(head)), ref + (0,) * (width - len(ref))
        ok = {">=": a >= b, "<=": a <= b, "==": a == b, ">": a > b, "<": a < b}[op]
        if not ok:
            return False
    return True


def target_from_dict(data: object, path: str | None = None) -> Target:
    """A target from plain data (a YAML file's): known keys, types, ranges; errors are one
    line naming the file, the key and the value."""
    target = from_mapping(Target, data, Loc(f"target file {path!r}" if path else "target"), noun="key")
    return dataclasses.replace(target, path=path) if path else target


def target_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TARGETS_DIR.glob("*.yaml"))}


def list_targets() -> list[str]:
    return list(target_files())


def load_target(name_or_path: TargetLike) -> Target:
    """A built-in target by name, or a user's YAML file.

    >>> load_target("cpu").kind
    'cpu'
    """
    if isinstance(name_or_path, Target):
        return name_or_path
    text = str(name_or_path)
    files = target_files()
    if text in files:
        path = files[text]
    elif text.endswith((".yaml", ".yml")) or os.sep in text:
        path = Path(text)
        if not path.is_file():
            raise BadInputError(f"target file {text!r} does not exist")
    else:
        raise bad_choice("target", text, files)
    data = read_yaml(path, "target file")  # bounded, no YAML aliases or tags
    target = target_from_dict(data, str(path))
    if target.kind == "cpu" and target.name == HOST_TARGET:
        target = _detect_host(target, builtin=path.resolve().parent == TARGETS_DIR.resolve())
    return target


def _detect_host(target: Target, builtin: bool = True) -> Target:
    """The ``cpu`` target is this host: architecture, cores and the CPU features that decide
    kernels, read from this machine (``cpu_isa.cpu_features``); the built-in one's figures are
    the cached probe's where there is one (a user's YAML keeps its own)."""
    arch, isa, model = cpu_features()
    description = f"{target.description}: {model}" if model else target.description
    host = dataclasses.replace(target, cores=os.cpu_count(), arch=arch if arch in ARCHS else None,
                               isa=isa or target.isa, description=description)
    probe = load_probe() if builtin else None
    return apply_probe(host, probe) if probe is not None else host


def apply_probe(target: Target, probe: HostProbe, path: str | None = None) -> Target:
    """The ``cpu`` target with this machine's measured figures in place of the YAML's."""
    fp32, int8 = probe.fp32_tops, probe.int8_tops
    peaks = {"fp32": fp32}
    if int8:
        peaks.update(int8=int8, int4=int8)  # 4-bit weights run through the int8 kernels (accuracy level 4)
    if "bf16" in target.precisions:  # bf16 kernels where the CPU has them, else bf16 runs in fp32
        peaks["bf16"] = fp32 * (2.0 if {"avx512_bf16", "amx_bf16"} & set(probe.isa) else 1.0)
    where = f"measured: `edgekit targets --probe` {probe.created}, {probe.runtime}, {probe.threads} thread"
    provenance = {**target.provenance,
                  "peak_tops.fp32": f"{where}: the best of kernel_rates matmul:fp32 and conv:fp32",
                  "kernel_rates": f"{where}: " + "; ".join(f"{k} {v}" for k, v in probe.kernels.items()),
                  "memory_bandwidth_gbs": f"{where}: one thread reading 256 MiB",
                  "cache_bandwidth_gbs": f"{where}: one thread reading buffers up to cache_mb",
                  "cache_mb": f"{where}: the largest buffer one thread reads at 1.5x memory bandwidth or more "
                              f"(caches: " + ", ".join(f"{k} {v >> 10} KiB" for k, v in probe.caches.items()) + ")",
                  "kernel_overhead_us": f"{where}: a chain of 400 Add nodes on 16 floats against one of 10"}
    if int8:
        provenance["peak_tops.int8"] = (f"{where}: the best of kernel_rates matmul:int8 and conv:int8 "
                                        f"({probe.int8_kernel} kernels, {probe.int8_weights} weights)")
    if "bf16" in peaks:
        provenance["peak_tops.bf16"] = ("derived: twice the measured fp32 rate (AVX-512 BF16 / AMX)"
                                        if peaks["bf16"] != fp32 else "derived: the fp32 rate (no bf16 "
                                        "instructions on this CPU: bf16 runs in fp32)")
    return dataclasses.replace(
        target, peak_tops={p: round(v, 6) for p, v in peaks.items() if p in target.precisions},
        kernel_rates=dict(probe.kernel_rates), memory_bandwidth_gbs=probe.memory_bandwidth_gbs,
        cache_mb=round(probe.cache_bytes / 1e6, 4), cache_bandwidth_gbs=probe.cache_bandwidth_gbs,
        kernel_overhead_us=probe.kernel_overhead_us, provenance=provenance,
        sources=(f"measured on this machine ({probe.cpu}, {probe.int8_kernel} int8 kernels) by `edgekit targets "
                 f"--probe` {probe.created}",), probe=path or str(probe_path(probe.key)))

