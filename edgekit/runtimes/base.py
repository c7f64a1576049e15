"""The small protocol every runtime implements.

A *runtime* builds an engine folder for a target from a model and loads it back as an
*engine*. An engine knows its inputs, runs feeds, times one run, and (where the
runtime can) times each node. ``onnxruntime``, ``torch`` (AOTInductor) and
``tensorrt`` live in their own modules and are imported only there, so the package
imports without them.

Callers (build, profiling, pipelines) use only what ``Runtime`` and ``Engine`` declare;
nothing outside ``edgekit/runtimes/`` names a runtime.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edgekit.artifact import Manifest, read_manifest
from edgekit.errors import BadInputError
from edgekit.sources.handle import InputSpec
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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class BuildOptions:
    """Settings common to engine builds; runtimes read the ones they understand."""

    precision: str = "fp32"
    threads: int | None = None  # intra-op threads; None = all cores
    optimization_level: str = "all"  # onnxruntime: disable|basic|extended|all
    runtime: str | None = None  # None: the target's first available runtime
    batch: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    runtime: str
    inputs: list[InputSpec]
    outputs: list[str]

    @property
    def settings(self) -> dict[str, Any]:
        """The settings the engine runs with (threads, providers, ...), for the profile record."""
        ...

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]: ...

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        """Latency of one inference in milliseconds (device time where it applies)."""
        ...

    def node_profile(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]: ...

    def close(self) -> None: ...


# A device results folder (written by a runtime's script on the device) carries a copy of
# the manifest of the bundle that made it under this name, so it describes itself.
RESULTS_MANIFEST = "bundle_manifest.json"


def read_folder_manifest(folder: Path) -> Manifest:
    """The manifest of an edgekit folder, or of a device results folder (its bundle's copy)."""
    folder = Path(folder)
    copy = folder / RESULTS_MANIFEST
    if not (folder / "manifest.json").is_file() and copy.is_file():
        try:
            return Manifest.from_dict(json.loads(copy.read_text()))
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise BadInputError(f"{copy} is not an edgekit manifest ({e})") from None
    return read_manifest(folder)


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


class Runtime(Protocol):
    name: str
    input_format: str  # "onnx": build() gets an ONNX path; "module": it gets the ModelHandle

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

    def build(self, model: Any, target: Any, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        """Write the engine's files into ``out_dir`` (a staged folder); return the
        manifest fields: ``files``, ``config`` (settings to record), ``metrics``."""
        ...

    def load(self, engine_dir: Path, manifest: Any, threads: int | None = None) -> Engine: ...


def resolve_onnx(model: Any) -> Path:
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
