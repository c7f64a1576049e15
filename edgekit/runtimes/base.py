"""The small protocol every runtime implements.

A *runtime* builds an engine folder for a target from a model and loads it back as an
*engine*. An engine knows its inputs, runs feeds, times one run, and (where the
runtime can) times each node. ``onnxruntime``, ``torch`` (AOTInductor) and
``tensorrt`` live in their own modules and are imported only there, so the package
imports without them.

Callers (build, profiling, profiling_lm, pipelines) use only what ``Runtime``, ``Engine``
and ``TokenDecoder`` declare; nothing outside ``edgekit/runtimes/`` names a runtime.
"""
from __future__ import annotations

import abc
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edgekit.artifact import Manifest, read_manifest
from edgekit.errors import BadInputError, bad_choice
from edgekit.limits import MAX_DIM, check_file_size
from edgekit.options import option
from edgekit.schema import FieldError, check_fields, read_bytes, read_json
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.ssh import check_data_options, check_destination
from edgekit.targets import Target
from edgekit.targets.runtime_registry import BEST_RUNTIME, RUNTIMES


@dataclass
class NodeTiming:
    """Time of one node (ONNX node, TensorRT layer, or compiled kernel) per inference."""

    name: str
    op_type: str
    time_ms: float
    share: float = 0.0  # of the summed node time
    precision: str = "fp32"  # "int8", "int4", "fp16", "bf16", "fp32", ...
    quantized: bool = False  # runs in integer arithmetic (or reads integer weights)
    calls: int = 1
    kernel: str = ""  # the kernel/ISA that ran it, where the runtime tells or it is inferable
    module: str = ""  # the PyTorch module path the exporter recorded (sources.onnx_file.onnx_node_label)

    @property
    def label(self) -> str:
        """What tables show: the module path, else the node name."""
        return self.module or self.name

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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


class TokenDecoder(Protocol):
    """Prefill and one-token decode steps of a causal LM through its KV cache, as generation
    runs (``Engine.token_decoder``): ``forward`` runs tokens after the cached ones."""

    batch: int
    shared: bool  # the KV cache is updated in place (one preallocated buffer per layer)

    @property
    def vocab_size(self) -> int:
        """The logits' last dimension (what prompt token ids are drawn below)."""
        ...

    def kv_cache_bytes(self, length: int) -> int:
        """Bytes of the KV cache holding ``length`` tokens (every layer's keys and values)."""
        ...

    def reset(self) -> None:
        """Forget the cached tokens."""
        ...

    def forward(self, input_ids: np.ndarray) -> np.ndarray:
        """Run ``input_ids`` (batch, tokens) after the cached tokens; logits (batch, tokens, vocab)."""
        ...


@runtime_checkable
class Engine(Protocol):
    runtime: str
    inputs: list[InputSpec]
    outputs: list[str]

    @property
    def path(self) -> Path | None:
        """The model file the engine runs (an ONNX graph, a plan, an IR, a package), or None."""
        ...

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the engine runs with (threads, providers, ...), for the profile record."""
        ...

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs for ``feeds``, which are checked against ``inputs`` first."""
        ...

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """``run`` for feeds the caller checked once (``check_feeds``) before a timed loop:
        no per-call check where ``run`` has one."""
        ...

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        """Latency of one inference in milliseconds (device time where it applies)."""
        ...

    def node_profile(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]: ...

    def token_decoder(self, max_length: int) -> TokenDecoder | None:
        """Generation through the KV cache for up to ``max_length`` tokens, for a causal LM
        exported with its KV cache; None for other models and for runtimes without a
        KV-cache loop."""
        ...

    def close(self) -> None: ...


class CheckedEngine(abc.ABC):
    """What every engine shares, as in Polygraphy's ``BaseRunner``: the feeds a caller gives
    ``run`` and ``node_profile`` are checked against ``inputs`` here, once, with one message
    style (``check_feeds``: names, dtypes, static dims, expected versus got), before the
    runtime's own code sees them. A runtime implements ``run_unchecked``, ``profile_nodes``
    and ``timed_run`` (one timed inference: callers check the feeds once before a timed loop,
    as ``profiling`` does, so the loop times only the inference).
    """

    runtime: str
    inputs: list[InputSpec]
    outputs: list[str]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs for ``feeds``, checked against ``inputs`` first."""
        check_feeds(self.inputs, feeds)
        return self.run_unchecked(feeds)

    def node_profile(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> list[NodeTiming]:
        """Per-node times for ``feeds`` (checked against ``inputs`` first), averaged over ``iterations``."""
        check_feeds(self.inputs, feeds)
        return self.profile_nodes(feeds, iterations)

    @abc.abstractmethod
    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """``run`` without the check, for feeds already checked."""

    @abc.abstractmethod
    def profile_nodes(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        """``node_profile`` without the check."""

    @abc.abstractmethod
    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        """Latency of one inference in milliseconds (device time where it applies)."""


class NoResultsYet(BadInputError):
    """A folder that will hold recorded results but holds none yet (a build bundle whose script
    has not run on the device): bad input to ``profile``, an expected state to pipelines."""


# A device results folder (written by a runtime's script on the device) carries a copy of
# the manifest of the bundle that made it under this name, so it describes itself.
RESULTS_MANIFEST = "bundle_manifest.json"


# A results folder comes from a machine edgekit does not trust: its files are read as regular
# files only (a FIFO blocked, a device never ends), within a maximum and the memory parsing
# them takes (a sparse file costs the device nothing).
MAX_DEVICE_FILE_BYTES = 256 << 20  # trtexec's exports and log: a large model's per-layer JSON is tens of MB
MAX_DEVICE_NOTE_BYTES = 1 << 20  # the probe, machine, nvpmodel and jetson_clocks records: a few lines
DEVICE_FILE_EXPANSION = 12  # memory per byte: the bytes, the str, and the parsed JSON's objects


def read_device_file(path: Path, what: str, max_bytes: int = MAX_DEVICE_FILE_BYTES) -> bytes:
    """The bytes of a file a device wrote, bounded (see above); one line naming the file
    otherwise."""
    check_file_size(path, max_bytes, what, expansion=DEVICE_FILE_EXPANSION)
    return read_bytes(path, what, max_bytes)


def read_device_text(path: Path, what: str, max_bytes: int = MAX_DEVICE_FILE_BYTES) -> str:
    """``read_device_file`` as text (bytes that are not UTF-8 replaced)."""
    return read_device_file(path, what, max_bytes).decode("utf-8", errors="replace")


def read_folder_manifest(folder: Path) -> Manifest:
    """The manifest of an edgekit folder, or of a device results folder (its bundle's copy)."""
    folder = Path(folder)
    copy = folder / RESULTS_MANIFEST
    if not (folder / "manifest.json").is_file() and copy.is_file():
        try:
            return Manifest.from_dict(read_json(copy, "bundle manifest"))
        except (TypeError, KeyError, AttributeError) as e:
            raise BadInputError(f"{copy} is not an edgekit manifest ({e})") from None
    return read_manifest(folder)


PROVENANCE_STATUS = ("verified", "unverified")


@dataclass
class Provenance:
    """Whether recorded results come from the device and engine they claim: ``verified`` when
    every fact checked (GPU/SM, TensorRT version, engine inputs, batch, layer names) was recorded
    and matched; ``unverified`` when some were not recorded (``reasons``). A mismatch never
    gets here: it is refused. ``checks``: one record per fact (check, result, recorded,
    expected, from)."""

    status: str
    checks: list[dict[str, str]] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.status not in PROVENANCE_STATUS:
            raise FieldError("status", f"unknown provenance {self.status!r} (choose from {', '.join(PROVENANCE_STATUS)})")

    def summary(self) -> str:
        """One line for people: what matched, or why it is unverified."""
        if self.status == "verified":
            return "verified: " + ", ".join(f"{c['check']} {c['recorded']}" for c in self.checks)
        return "UNVERIFIED: " + "; ".join(self.reasons)


@dataclass
class RecordedRun:
    """Timings that a runtime's own tool recorded, usually on the device itself (trtexec's
    exports in a results folder), for profiling to summarize like a local measurement."""

    runtime: str
    latency_ms: list[float]  # one value per timed inference
    nodes: list[NodeTiming] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # how it was measured
    machine: dict[str, Any] = field(default_factory=dict)  # the state of the machine that measured
    warnings: list[str] = field(default_factory=list)
    source: str = "device"  # "device": measured on the target | "measured": on this machine
    throughput_per_s: float | None = None
    engine: str = ""
    target: str | None = None
    model: str | None = None
    provenance: Provenance | None = None  # checked against what the bundle claims (None: not a recorded run)


class Runtime(Protocol):
    name: str
    input_format: str  # "onnx": build() gets an ONNX path; "module": it gets the ModelHandle
    # the Q/DQ form an INT8 graph must take to run well here (edgekit.compress.qdq.SCHEMES, e.g. "trt":
    # TensorRT's symmetric int8), or None when any form runs; the int8 step's default scheme reads it
    int8_scheme: str | None

    def available(self) -> tuple[bool, str]:
        """(usable here, why not)."""
        ...

    def measures_here(self, target: Target) -> bool:
        """Whether an engine built here for ``target`` can be timed here as it would run on
        the target (same device class, or the same GPU architecture)."""
        ...

    def recorded_run(self, folder: Path, manifest: Manifest | None) -> RecordedRun | None:
        """Timings recorded in ``folder`` (an engine, bundle or device results folder), or None
        when it holds none and the engine is to be timed here."""
        ...

    def build(self, model: Path | ModelHandle, target: Target, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        """Write the engine's files into ``out_dir`` (a staged folder); return the
        manifest fields: ``files``, ``config`` (settings to record), ``metrics``."""
        ...

    def load(self, engine_dir: Path, manifest: Manifest, threads: int | None = None) -> Engine: ...


def resolve_onnx(model: str | Path | ModelHandle) -> Path:
    """The ONNX file a runtime builds from: a path, an ONNX artifact folder, or a handle's ``onnx_path``."""
    p = Path(str(getattr(model, "onnx_path", None) or model))
    if p.is_dir():
        return read_manifest(p).path_of(p, "onnx")
    if not p.is_file():
        raise BadInputError(f"ONNX file {str(p)!r} does not exist")
    return p


def host_timed_run(engine: Engine, feeds: dict[str, np.ndarray]) -> float:
    t0 = time.perf_counter()
    engine.run(feeds)
    return (time.perf_counter() - t0) * 1e3


def check_feeds(inputs: list[InputSpec], feeds: dict[str, np.ndarray]) -> None:
    """Polygraphy-style feed check: names, dtypes and static dims, expected versus got."""
    want = {s.name: s for s in inputs}
    missing = sorted(set(want) - set(feeds))
    extra = sorted(set(feeds) - set(want))
    if missing or extra:
        raise BadInputError(f"input names {sorted(feeds)} do not match the model's {sorted(want)}"
                            + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else ""))
    for name, spec in want.items():
        arr = feeds[name]
        if str(arr.dtype) != spec.dtype:
            raise BadInputError(f"input {name!r} has dtype {arr.dtype}; the model expects {spec.dtype}")
        if len(arr.shape) != len(spec.shape) or any(
            isinstance(d, int) and d != a for d, a in zip(spec.shape, arr.shape)
        ):
            raise BadInputError(f"input {name!r} has shape {tuple(arr.shape)}; the model expects "
                                f"{tuple(spec.shape)}")
