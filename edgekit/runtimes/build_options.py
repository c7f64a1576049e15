"""How an engine is built: ``BuildOptions`` (the settings every runtime reads) and
``BuildExtras`` (each runtime's own), whose flagged fields make the options of ``edgekit
build`` (``edgekit.options``). Light (no PyTorch or ONNX): the command line reads it to build
its options; ``runtimes.base`` re-exports these names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.limits import MAX_DIM
from edgekit.options import option
from edgekit.schema import FieldError, check_fields
from edgekit.ssh import check_data_options, check_destination
from edgekit.targets.runtime_registry import BEST_RUNTIME, RUNTIMES

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")  # ONNX Runtime graph optimization
CUDNN_ALGO_SEARCH = ("EXHAUSTIVE", "HEURISTIC", "DEFAULT")


@dataclass(frozen=True)
class BuildExtras:
    """Every runtime-specific build setting (``BuildOptions.extra``), declared once: a key
    not declared here is an error, so a typo never builds with a silent default. None
    means "not given" (the runtime's default applies).

    ONNX Runtime's CUDA / TensorRT providers: device_id, cudnn_conv_algo_search,
    gpu_mem_limit_mb, cuda_graph, trt_shapes ({input: {min, opt, max: dims}}).
    TensorRT: workspace_mb, builder_optimization_level (0-5), dla_core, gpu_fallback,
    strongly_typed, min_shapes / opt_shapes / max_shapes (``name:1x3x224x224`` or
    {name: dims}), dims ({axis name: size}), max_batch, trtexec (its path), trt_path
    ("api" | "trtexec" | "bundle"), remote (user@host), engine_cache_dir, and trtexec's
    timing: warmup_ms, duration_s, iterations; check (False skips the offline compatibility
    check), accuracy_samples (images that measure the INT8 Q/DQ conversion's cost).
    SSH, for remote builds: ssh_port, ssh_identity, ssh_options ("Key=Value"; from a recipe
    only those ``edgekit.ssh.SSH_OPTIONS_FROM_DATA`` allows), connect_timeout, remote_timeout,
    build_timeout, remote_edgekit.
    ``trtexec`` and ``remote_edgekit`` name programs: code sets them, a recipe may not.
    PyTorch AOTInductor: device, freezing.
    Set in code only: export (ExportConfig options when ``build_engine`` exports first) and
    feeds (sample inputs, for shapes).
    """

    device_id: int | None = None
    cudnn_conv_algo_search: str | None = None
    gpu_mem_limit_mb: int | None = None
    cuda_graph: bool | None = None
    trt_shapes: dict[str, dict[str, list[int]]] | None = None
    # flags of `edgekit build` (the rest come from recipes)
    workspace_mb: int | None = field(default=None, metadata=option(
        "--workspace-mb", help="TensorRT: builder workspace limit (MB)."))
    builder_optimization_level: int | None = None
    dla_core: int | None = field(default=None, metadata=option(
        "--dla-core", help="TensorRT on Orin: DLA core, with GPU fallback."))
    gpu_fallback: bool | None = None
    strongly_typed: bool | None = None
    min_shapes: str | dict[str, list[int]] | None = None
    opt_shapes: str | dict[str, list[int]] | None = None
    max_shapes: str | dict[str, list[int]] | None = None
    dims: dict[str, int] | None = None
    max_batch: int | None = field(default=None, metadata=option(
        "--max-batch", help="TensorRT: largest batch of the optimization profile."))
    trtexec: str | None = field(default=None, metadata={"program": "set $EDGEKIT_TRTEXEC or put trtexec on PATH"})
    trt_path: str | None = None
    remote: str | None = field(default=None, metadata=option(
        "--host", deprecated=("--remote",), metavar="USER@HOST[:PORT]",
        help="TensorRT: build on the device over SSH (as `edgekit remote build --host`)."))
    engine_cache_dir: str | None = None
    warmup_ms: float | None = None
    duration_s: float | None = None
    iterations: int | None = None
    ssh_port: int | None = None
    ssh_identity: str | None = None
    ssh_options: list[str] | None = field(default=None, metadata={"from_data": check_data_options})
    connect_timeout: int | None = None
    remote_timeout: float | None = None
    build_timeout: float | None = None
    remote_edgekit: str | None = field(default=None, metadata={
        "program": "give --remote-edgekit to `edgekit remote` or set $EDGEKIT_REMOTE_EDGEKIT"})
    device: str | None = None
    freezing: bool | None = None
    check: bool | None = None  # TensorRT: run the offline compatibility check (default on)
    accuracy_samples: int | None = None  # TensorRT INT8: samples that measure the Q/DQ conversion's cost
    export: dict[str, Any] | None = field(default=None, metadata={"internal": True})
    feeds: dict[str, Any] | None = field(default=None, metadata={"internal": True})

    def __post_init__(self) -> None:
        check_fields(self)
        at_least = {"device_id": 0, "gpu_mem_limit_mb": 1, "workspace_mb": 1, "builder_optimization_level": 0,
                    "dla_core": 0, "max_batch": 1, "iterations": 1, "accuracy_samples": 1, "ssh_port": 1, "connect_timeout": 1,
                    "warmup_ms": 0, "duration_s": 0, "remote_timeout": 0, "build_timeout": 0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise FieldError(name, f"must be >= {low}, got {value!r}")
        for name in ("remote_timeout", "build_timeout"):
            if getattr(self, name) == 0:
                raise FieldError(name, "must be > 0 seconds")
        if self.builder_optimization_level is not None and self.builder_optimization_level > 5:
            raise FieldError("builder_optimization_level", f"must be 0 to 5, got {self.builder_optimization_level}")
        if self.remote is not None:
            try:
                check_destination(self.remote)
            except BadInputError as e:
                raise FieldError("remote", str(e)) from None
        if self.ssh_port is not None and self.ssh_port > 65535:
            raise FieldError("ssh_port", f"must be a TCP port (1 to 65535), got {self.ssh_port}")
        if self.cudnn_conv_algo_search is not None and self.cudnn_conv_algo_search not in CUDNN_ALGO_SEARCH:
            raise FieldError("cudnn_conv_algo_search", f"unknown search {self.cudnn_conv_algo_search!r} "
                                                       f"(choose from {', '.join(CUDNN_ALGO_SEARCH)})")
        for name in ("min_shapes", "opt_shapes", "max_shapes", "trt_shapes", "dims", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, str):  # trtexec's text form parses now, not only when the build reads it
                try:
                    value = parse_shape_spec(value)
                except BadInputError as e:
                    raise FieldError(name, str(e)) from None
            _check_dims(name, value)
        if self.trt_path is not None and self.trt_path not in TRT_PATHS:
            raise FieldError("trt_path", f"unknown TensorRT build path {self.trt_path!r} (choose from "
                                         f"{', '.join(TRT_PATHS)})")
        if self.device is not None and not _DEVICE.fullmatch(self.device):
            raise FieldError("device", f"unknown device {self.device!r} (choose from cpu, cuda, cuda:N)")


TRT_PATHS = ("api", "trtexec", "bundle")  # how a TensorRT engine is built (extra["trt_path"])
_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")  # PyTorch AOTInductor's extra["device"]


def parse_shape_spec(spec: Any) -> dict[str, list[int]]:
    """trtexec's shape syntax, ``"input:1x3x224x224,mask:1x128"`` (or ``{"input": [1, 3,
    224, 224]}``) -> ``{name: dims}``; BadInputError naming the bad part."""
    if isinstance(spec, dict):
        return {str(k): [int(x) for x in v] for k, v in spec.items()}
    out = {}
    for part in str(spec).split(","):
        name, _, dims = part.strip().rpartition(":")
        if not name or not dims:
            raise BadInputError(f"bad shape spec {part!r} (use name:1x3x224x224)")
        try:
            out[name.strip("'")] = [int(x) for x in dims.split("x")]
        except ValueError:
            raise BadInputError(f"bad shape spec {part!r} (use name:1x3x224x224)") from None
    return out


def _check_dims(name: str, value: Any) -> None:
    """Every dimension in a shape declaration is a positive size."""
    if isinstance(value, dict):
        for key, sub in value.items():
            _check_dims(f"{name}.{key}", sub)
    elif isinstance(value, list):
        if any(d < 1 or d > MAX_DIM for d in value):
            raise FieldError(name, f"dimensions must be 1 to {MAX_DIM}, got {value}")
    elif isinstance(value, int) and not 1 <= value <= MAX_DIM:
        raise FieldError(name, f"must be 1 to {MAX_DIM}, got {value}")


@dataclass
class BuildOptions:
    """Settings common to engine builds; runtimes read the ones they understand.
    ``extra``: runtime-specific settings, each declared in ``BuildExtras``."""

    precision: str = field(default="fp32", metadata=option(
        "--precision", basic=True, show_default=False,
        help="fp32 | fp16 | bf16 | int8 | fp8 | best (default: fp32, or the model's own)."))
    threads: int | None = field(default=None, metadata=option(
        "--threads", help="Intra-op threads (default: all cores)."))
    optimization_level: str = field(default="all", metadata=option(
        "--opt-level", choices=OPTIMIZATION_LEVELS, help="ONNX Runtime graph optimizations."))
    runtime: str | None = field(default=None, metadata=option(
        "--runtime", basic=True, help="onnxruntime | openvino | torch | tensorrt | best (build with each runtime the "
        "target lists, time them here, keep the fastest); default: the target's first available."))
    batch: int = field(default=1, metadata=option(
        "--batch", bounds=(1, MAX_DIM), help="Batch the engine is optimized for (TensorRT opt shape)."))
    extra: dict[str, Any] = field(default_factory=dict, metadata={"schema": BuildExtras})

    def __post_init__(self) -> None:
        check_fields(self)  # types, and every extra declared in BuildExtras
        if self.optimization_level not in OPTIMIZATION_LEVELS:
            raise bad_choice("optimization level", self.optimization_level, OPTIMIZATION_LEVELS)
        if self.runtime is not None and self.runtime != BEST_RUNTIME and self.runtime not in RUNTIMES:
            raise bad_choice("runtime", self.runtime, (*RUNTIMES, BEST_RUNTIME))
        if self.threads is not None and not 1 <= self.threads <= 4096:
            raise FieldError("threads", f"must be 1 to 4096, got {self.threads}")
        if not 1 <= self.batch <= MAX_DIM:
            raise FieldError("batch", f"must be 1 to {MAX_DIM}, got {self.batch}")
