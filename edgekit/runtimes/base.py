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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edgekit.artifact import Manifest, read_manifest
from edgekit.errors import BadInputError
from edgekit.limits import check_file_size
from edgekit.runtimes.build_options import CUDNN_ALGO_SEARCH as CUDNN_ALGO_SEARCH
from edgekit.runtimes.build_options import OPTIMIZATION_LEVELS as OPTIMIZATION_LEVELS
from edgekit.runtimes.build_options import TRT_PATHS as TRT_PATHS
from edgekit.runtimes.build_options import BuildExtras as BuildExtras
from edgekit.runtimes.build_options import BuildOptions as BuildOptions
from edgekit.runtimes.build_options import parse_shape_spec as parse_shape_spec
from edgekit.schema import FieldError, check_fields, read_bytes, read_json
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.targets import Target


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
    # the Q/DQ form an INT8 graph must take to run well here (edgekit.compress.int8.config.SCHEMES, e.g. "trt":
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
