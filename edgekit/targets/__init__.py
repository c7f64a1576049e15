"""Targets as data: one YAML file per device in this folder, loaded into ``Target``.

A target names the runtimes it prefers, the precisions it supports and the hardware
numbers the roofline estimator needs. Unknown keys are errors. Users pass their own
YAML file with ``--target ./my-board.yaml``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError, bad_choice

TARGETS_DIR = Path(__file__).parent
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4")


@dataclass(frozen=True)
class Target:
    """One device. Throughput figures are dense peaks (sparse are twice)."""

    name: str
    description: str
    kind: str  # "cpu" | "gpu" | "jetson"
    runtimes: tuple[str, ...]  # in order of preference: "onnxruntime", "tensorrt", "torch"
    precisions: tuple[str, ...]
    peak_tops: dict[str, float] = field(default_factory=dict)  # precision -> TFLOPS/TOPS (GPU or CPU)
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
    cores: int | None = None
    isa: tuple[str, ...] = ()
    kernel_overhead_us: float = 5.0  # per-node launch/dispatch overhead for the estimator
    efficiency: dict[str, float] = field(default_factory=dict)  # op class -> fraction of peak (fitted)
    remote: str | None = None  # user@host for remote build/profile
    sources: tuple[str, ...] = ()  # where the numbers come from
    # GPU detail (issue 7): SM count, core counts, DLA precisions, board power.
    sm_count: int | None = None
    cuda_cores: int | None = None
    tensor_cores: int | None = None
    dla_precisions: tuple[str, ...] = ()
    tdp_w: float | None = None
    # field (or "field.key") -> where its number comes from: "facts: ...", "recalled: ...", "derived: ...".
    provenance: dict[str, str] = field(default_factory=dict)
    path: str | None = None  # the YAML file it was read from

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
    def has_gpu(self) -> bool:
        return self.kind in ("gpu", "jetson")

    def tensorrt_version_ok(self, version: str) -> bool:
        """Whether a TensorRT version falls in ``tensorrt_versions`` (always True when unpinned).

        >>> load_target("jetson-agx-orin-64").tensorrt_version_ok("10.3.0.30")
        True
        """
        return version_in_range(version, self.tensorrt_versions)


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


_TUPLE_FIELDS = {f.name for f in dataclasses.fields(Target) if "tuple" in str(f.type)}


def target_from_dict(data: dict[str, Any], path: str | None = None) -> Target:
    known = {f.name for f in dataclasses.fields(Target)} - {"path"}
    if not isinstance(data, dict):
        raise BadInputError(f"target file {path} must hold a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise BadInputError(f"target {data.get('name', path)!r} has unknown keys {unknown} "
                            f"(known: {', '.join(sorted(known))})")
    missing = [k for k in ("name", "description", "kind", "runtimes", "precisions") if k not in data]
    if missing:
        raise BadInputError(f"target {path or data.get('name')!r} lacks required keys {missing}")
    values = {k: tuple(v) if k in _TUPLE_FIELDS and isinstance(v, list) else v for k, v in data.items()}
    bad = [p for p in values["precisions"] if p not in PRECISIONS]
    if bad:
        raise BadInputError(f"target {data['name']!r} lists unknown precisions {bad} (known: {', '.join(PRECISIONS)})")
    return Target(**values, path=path)


def target_files() -> dict[str, Path]:
    return {p.stem: p for p in sorted(TARGETS_DIR.glob("*.yaml"))}


def list_targets() -> list[str]:
    return list(target_files())


def load_target(name_or_path: str | os.PathLike[str] | Target) -> Target:
    """A built-in target by name, or a user's YAML file.

    >>> load_target("cpu").kind
    'cpu'
    """
    import yaml

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
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise BadInputError(f"target file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    target = target_from_dict(data, str(path))
    if target.kind == "cpu" and target.name == "cpu":
        target = _detect_host(target)
    return target


def _detect_host(target: Target) -> Target:
    """The ``cpu`` target is this host: fill in cores and ISA extensions from /proc/cpuinfo."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [name for flag, name in (("avx2", "avx2"), ("avx512f", "avx512"), ("avx512_vnni", "avx512-vnni"),
                                   ("avx_vnni", "avx-vnni"), ("amx_int8", "amx-int8"), ("amx_bf16", "amx-bf16"),
                                   ("asimd", "neon")) if flag in flags]
    return dataclasses.replace(target, cores=os.cpu_count(), isa=tuple(isa) or target.isa)
