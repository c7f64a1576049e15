"""Latency profiling with the trtexec / MLPerf method, for every runtime.

Warm up for ``warmup_ms``; then time single inferences until both ``duration_s`` and
``iterations`` are reached; report min, mean, p50, p90, p95, p99, max, std, the
coefficient of variation and throughput; then, in a separate run, per-node times
(trtexec's ``--separateProfileRun``), so node profiling never inflates end-to-end
latency. The result is one ``ProfileResult``, the same for ONNX Runtime, the
PyTorch-native engine and TensorRT (parsed from trtexec's JSON).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError
from edgekit.runtimes.base import NodeTiming

PERCENTILES = ("p50", "p90", "p95", "p99")
STAT_KEYS = ("min", "mean", "p50", "p90", "p95", "p99", "max")
# trtexec warns above this coefficient of variation of GPU compute time.
CV_WARNING = 0.025


@dataclass(frozen=True)
class ProfileConfig:
    warmup_ms: float = 200.0
    duration_s: float = 3.0
    iterations: int = 100  # minimum number of timed inferences
    max_iterations: int = 100_000
    threads: int | None = None
    batch: int = 1
    node_profile: bool = True
    node_iterations: int = 20
    top_k: int = 15

    def __post_init__(self) -> None:
        if not (self.warmup_ms >= 0 and math.isfinite(self.warmup_ms)):
            raise BadInputError(f"warm-up must be >= 0 ms, got {self.warmup_ms}")
        if not (self.duration_s >= 0 and math.isfinite(self.duration_s)):
            raise BadInputError(f"duration must be >= 0 s, got {self.duration_s}")
        if self.iterations < 1:
            raise BadInputError(f"iterations must be >= 1, got {self.iterations}")
        if self.threads is not None and self.threads < 1:
            raise BadInputError(f"threads must be >= 1, got {self.threads}")
        if self.batch < 1:
            raise BadInputError(f"batch must be >= 1, got {self.batch}")


@dataclass
class LatencyStats:
    min: float
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float
    std: float
    cv: float  # std / mean
    count: int

    @classmethod
    def from_samples(cls, samples_ms: list[float] | np.ndarray) -> LatencyStats:
        a = np.asarray(samples_ms, dtype=np.float64)
        if a.size == 0:
            raise BadInputError("no latency samples")
        mean = float(a.mean())
        std = float(a.std(ddof=1)) if a.size > 1 else 0.0
        q = np.percentile(a, [50, 90, 95, 99])
        return cls(min=float(a.min()), mean=mean, p50=float(q[0]), p90=float(q[1]), p95=float(q[2]),
                   p99=float(q[3]), max=float(a.max()), std=std, cv=std / mean if mean > 0 else 0.0,
                   count=int(a.size))

    def get(self, percentile: str) -> float:
        key = normalize_percentile(percentile)
        return float(getattr(self, key))


def normalize_percentile(p: str) -> str:
    """'p99', '99', 'P99', 'median', 'mean', 'max' -> a LatencyStats field name."""
    s = str(p).strip().lower()
    aliases = {"median": "p50", "50": "p50", "90": "p90", "95": "p95", "99": "p99"}
    s = aliases.get(s, s)
    if s.startswith("p") is False and s not in STAT_KEYS:
        s = "p" + s
    if s not in STAT_KEYS:
        raise BadInputError(f"unknown percentile {p!r} (choose from {', '.join(STAT_KEYS)})")
    return s


@dataclass
class ProfileResult:
    """What ``edgekit profile`` writes as JSON and ``check`` and ``report`` read."""

    engine: str
    runtime: str
    target: str | None
    model: str | None
    settings: dict[str, Any]
    latency_ms: LatencyStats
    throughput_per_s: float
    nodes: list[NodeTiming] = field(default_factory=list)
    op_types: list[dict[str, Any]] = field(default_factory=list)
    float_share: float | None = None  # share of node time in non-quantized nodes
    quantized_nodes: int = 0
    total_nodes: int = 0
    peak_memory_mb: float | None = None
    model_size_mb: float | None = None
    machine: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    source: str = "measured"  # "measured" | "trtexec" | "estimated"
    created: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfileResult:
        d = dict(d)
        d["latency_ms"] = LatencyStats(**d["latency_ms"])
        d["nodes"] = [NodeTiming(**n) for n in d.get("nodes", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def save(self, path: str | os.PathLike[str]) -> Path:
        from edgekit.artifact import atomic_write_json

        return atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProfileResult:
        p = Path(path)
        if not p.is_file():
            raise BadInputError(f"profile file {str(p)!r} does not exist")
        try:
            data = json.loads(p.read_text())
            return cls.from_dict(data)
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise BadInputError(f"{p} is not an edgekit profile JSON ({type(e).__name__}: {e})") from None


def time_engine(engine: Any, feeds: dict[str, np.ndarray], config: ProfileConfig,
                progress: Any = None) -> list[float]:
    """The timing loop: warm-up by time, then at least ``iterations`` and ``duration_s``."""
    t_end = time.perf_counter() + config.warmup_ms / 1e3
    engine.timed_run(feeds)  # always at least one warm-up inference
    while time.perf_counter() < t_end:
        engine.timed_run(feeds)
    samples: list[float] = []
    t_stop = time.perf_counter() + config.duration_s
    while (len(samples) < config.iterations or time.perf_counter() < t_stop) and len(samples) < config.max_iterations:
        samples.append(engine.timed_run(feeds))
        if progress is not None:
            progress(len(samples))
    return samples


def summarize_nodes(nodes: list[NodeTiming], top_k: int | None = None) -> tuple[list[NodeTiming], list[dict[str, Any]], float | None, int]:
    """Shares, per-op-type totals, share of time in float nodes, count of quantized nodes."""
    total = sum(n.time_ms for n in nodes) or 1.0
    for n in nodes:
        n.share = n.time_ms / total
    by_type: dict[str, dict[str, Any]] = {}
    for n in nodes:
        t = by_type.setdefault(n.op_type, {"op_type": n.op_type, "time_ms": 0.0, "count": 0, "quantized": 0})
        t["time_ms"] += n.time_ms
        t["count"] += 1
        t["quantized"] += int(n.quantized)
    op_types = sorted(by_type.values(), key=lambda r: -r["time_ms"])
    for t in op_types:
        t["share"] = t["time_ms"] / total
    float_share = sum(n.time_ms for n in nodes if not n.quantized) / total if nodes else None
    quantized = sum(1 for n in nodes if n.quantized)
    ordered = sorted(nodes, key=lambda n: -n.time_ms)
    return (ordered[:top_k] if top_k else ordered), op_types, float_share, quantized


def peak_rss_mb() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except Exception:  # pragma: no cover - non-Unix
        return None
