"""Time a model as an engine: build it for a target in a temporary folder and profile it.

What a compression step that reports its latency effect (pruning) is given through
``StepContext.latency``: compress sits below build and profile, so the callers above both
(the CLI, pipelines) pass :func:`engine_latency` in.

>>> from edgekit.compress import StepContext
>>> ctx = StepContext(target="cpu", latency=engine_latency)
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TypedDict

from edgekit.build import build_engine
from edgekit.profiling import ProfileConfig, profile_engine
from edgekit.runtimes.base import BuildOptions
from edgekit.sources.handle import ModelHandle
from edgekit.targets import TargetLike

LATENCY_SECONDS = 1.0  # timed seconds per model


class Latency(TypedDict):
    p50_ms: float
    p90_ms: float
    via: str  # how it was timed


def engine_latency(handle: ModelHandle, target: TargetLike, *, duration_s: float | None = None,
                   threads: int = 1) -> Latency:
    """p50/p90 latency (ms) at batch 1 of ``handle``'s ONNX Runtime engine for ``target``,
    through ``build_engine`` + ``profile_engine`` (the same method as ``edgekit profile``)."""
    seconds = LATENCY_SECONDS if duration_s is None else duration_s
    with tempfile.TemporaryDirectory(prefix="edgekit-latency-") as tmp:
        engine = build_engine(handle, target, Path(tmp) / "engine", BuildOptions(threads=threads, runtime="onnxruntime"))
        prof = profile_engine(engine, ProfileConfig(warmup_ms=100, duration_s=seconds, iterations=30,
                                                    threads=threads, node_profile=False))
        return {"p50_ms": float(prof.latency_ms.p50), "p90_ms": float(prof.latency_ms.p90),
                "via": "build_engine + profile_engine"}
