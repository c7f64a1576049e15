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
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edgekit.artifact import Manifest, atomic_write_json, check_output_file, machine_info, now_iso
from edgekit.build import load_engine, load_engine_inputs
from edgekit.errors import BadInputError, EdgekitError
from edgekit.profiling_options import MAX_DURATION_S as MAX_DURATION_S
from edgekit.profiling_options import MAX_ITERATIONS as MAX_ITERATIONS
from edgekit.profiling_options import MAX_REPEATS as MAX_REPEATS
from edgekit.profiling_options import MAX_WARMUP_MS as MAX_WARMUP_MS
from edgekit.profiling_options import NOISE_CV as NOISE_CV
from edgekit.profiling_options import ProfileConfig as ProfileConfig
from edgekit.progress import progress_enabled
from edgekit.runtimes import RUNTIMES, get_runtime
from edgekit.runtimes.base import (
    Engine,
    NodeTiming,
    NoResultsYet,
    Provenance,
    RecordedRun,
    check_feeds,
    read_folder_manifest,
)
from edgekit.schema import FieldError, Loc, check_fields, from_mapping, read_json
from edgekit.sources.inputs import InputOptions
from edgekit.sources.onnx_file import node_labels
from edgekit.targets import Target, load_target
from edgekit.targets.cpu_isa import cpu_features, host_int8_kernel

PERCENTILES = ("p50", "p90", "p95", "p99")
STAT_KEYS = ("min", "mean", "p50", "p90", "p95", "p99", "max")
ORDERED_STATS = ("min", "p50", "p90", "p95", "p99", "max")
PROFILE_SOURCES = ("measured", "device", "trtexec", "estimated")
PROFILE_MAX_BYTES = 64 << 20
# trtexec warns above this coefficient of variation of GPU compute time.
CV_WARNING = 0.025
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

    def __post_init__(self) -> None:
        check_fields(self)
        for name in (*STAT_KEYS, "std", "cv", "count"):
            value = getattr(self, name)
            if value < 0:
                raise FieldError(name, f"must be >= 0, got {value!r}")
        for lo, hi in zip(ORDERED_STATS, ORDERED_STATS[1:]):
            a, b = getattr(self, lo), getattr(self, hi)
            if a > b + _slack(b):
                raise FieldError("", f"{lo} {a!r} > {hi} {b!r}: latencies must be ordered "
                                     f"{' <= '.join(ORDERED_STATS)}")
        if not self.min - _slack(self.min) <= self.mean <= self.max + _slack(self.max):
            raise FieldError("mean", f"{self.mean!r} lies outside [min, max] = [{self.min!r}, {self.max!r}]")

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


def _slack(x: float) -> float:
    """Rounding room for order checks (statistics written with a few digits)."""
    return 1e-9 * abs(x) + 1e-12


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
    source: str = "measured"  # "measured" here | "device" (results from the target) | "trtexec" | "estimated"
    created: str = ""
    generation: dict[str, Any] | None = None  # causal LMs: time to first token, decode tokens/s (profiling_lm)
    noisy: bool = False  # the coefficient of variation stayed above settings["noise_cv"] on every attempt
    attempts: int = 1  # timing attempts (repeated while noisy)
    # the engine's check against the model it came from (the engine manifest's ``metrics.quality``):
    # {"status": "verified" | "unverified" | "as-given", ...}; None when the engine does not say
    quality: dict[str, Any] | None = None
    # recorded results (trtexec on the device): whether they come from the device and engine they
    # claim (edgekit.runtimes.base.Provenance); None for a measurement made here
    provenance: Provenance | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.source not in PROFILE_SOURCES:
            raise FieldError("source", f"unknown source {self.source!r} (choose from {', '.join(PROFILE_SOURCES)})")
        if self.latency_ms.count < 1 and self.source != "estimated":
            raise FieldError("latency_ms.count", f"a {self.source} profile needs at least 1 timed run, got "
                                                 f"{self.latency_ms.count}")
        for name in ("throughput_per_s", "quantized_nodes", "total_nodes", "peak_memory_mb", "model_size_mb"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise FieldError(name, f"must be >= 0, got {value!r}")
        if self.float_share is not None and not 0 <= self.float_share <= 1 + _slack(1):
            raise FieldError("float_share", f"must be a share in [0, 1], got {self.float_share!r}")
        if self.quantized_nodes > self.total_nodes:
            raise FieldError("quantized_nodes", f"{self.quantized_nodes} exceeds total_nodes {self.total_nodes}")
        for i, n in enumerate(self.nodes):
            if n.time_ms < 0:
                raise FieldError(f"nodes[{i}].time_ms", f"must be >= 0, got {n.time_ms!r}")
            if not 0 <= n.share <= 1 + _slack(1):
                raise FieldError(f"nodes[{i}].share", f"must be a share in [0, 1], got {n.share!r}")
            if n.calls < 1:
                raise FieldError(f"nodes[{i}].calls", f"must be >= 1, got {n.calls!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: object, where: str = "profile") -> ProfileResult:
        """A profile from its JSON form: every field's type checked (finite, non-negative
        numbers; ordered percentiles), unknown fields refused; errors name ``where`` and the
        field."""
        return from_mapping(cls, d, Loc(where), noun="field")

    def save(self, path: str | os.PathLike[str], *, protect: Iterable[object] | None = None) -> Path:
        """Write the JSON atomically; ``protect``: see ``atomic_write_bytes``."""
        return atomic_write_json(path, self.to_dict(), protect=protect)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProfileResult:
        """Read and validate a profile JSON (at most 64 MiB); any problem is one line naming
        the file, the field and the value."""
        p = Path(path)
        return cls.from_dict(read_json(p, "profile", PROFILE_MAX_BYTES), f"profile {str(p)!r}")


def time_engine(engine: Engine, feeds: dict[str, np.ndarray], config: ProfileConfig,
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
    # the share of float time among nodes whose precision is known; None when no node's is
    # (trtexec results without layer info): unknown is never counted as float
    known = [n for n in nodes if n.precision != "unknown"]
    known_total = sum(n.time_ms for n in known)
    float_share = (sum(n.time_ms for n in known if not n.quantized) / known_total if known_total else
                   (1.0 - sum(1 for n in known if n.quantized) / len(known)) if known else None)
    quantized = sum(1 for n in nodes if n.quantized)
    ordered = sorted(nodes, key=lambda n: -n.time_ms)
    return (ordered[:top_k] if top_k else ordered), op_types, float_share, quantized


def peak_rss_mb() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    except (ImportError, OSError):  # pragma: no cover - non-Unix
        return None


def measure(engine: Engine, feeds: dict[str, np.ndarray], config: ProfileConfig, *, engine_name: str,
            runtime: str, target: str | None, model: str | None, model_size_mb: float | None = None,
            progress: Any = None) -> ProfileResult:
    """Profile a loaded engine (any object with ``timed_run`` and ``node_profile``): the
    timing loop, then a separate per-node run, summarized into a ``ProfileResult``.
    ``profile_engine`` loads an engine folder and calls this; pipelines call it for
    in-process stages (Python callables) so every stage is timed the same way."""
    samples, cvs = repeat_while_noisy(lambda: time_engine(engine, feeds, config, progress=progress),
                                      lambda s: LatencyStats.from_samples(s).cv, config)
    stats = LatencyStats.from_samples(samples)
    warnings: list[str] = []
    noisy = stats.cv > config.noise_cv
    if noisy:
        warnings.append(noise_message(stats.cv, config.noise_cv, len(cvs)))
    elif stats.cv > CV_WARNING:
        warnings.append(f"coefficient of variation {stats.cv:.1%} exceeds {CV_WARNING:.1%} "
                        "(trtexec's threshold): the machine may be busy or clocks unstable")
    nodes: list[NodeTiming] = []
    if config.node_profile:
        nodes = list(engine.node_profile(feeds, config.node_iterations) or [])
    total_nodes = len(nodes)
    top, op_types, float_share, quantized = summarize_nodes(nodes, config.top_k)
    batch = config.batch
    return ProfileResult(
        engine=engine_name, runtime=runtime, target=target, model=model,
        settings={"warmup_ms": config.warmup_ms, "duration_s": config.duration_s, "iterations": config.iterations,
                  "threads": config.threads, "batch": batch, "node_iterations": config.node_iterations,
                  "noise_cv": config.noise_cv, "attempt_cvs": [round(c, 4) for c in cvs]},
        latency_ms=stats, throughput_per_s=1e3 * batch / stats.mean if stats.mean > 0 else 0.0,
        nodes=top, op_types=op_types, float_share=float_share, quantized_nodes=quantized, total_nodes=total_nodes,
        peak_memory_mb=peak_rss_mb(), model_size_mb=model_size_mb, machine=machine_info(), warnings=warnings,
        created=now_iso(), noisy=noisy, attempts=len(cvs))


T = TypeVar("T")


def repeat_while_noisy(attempt: Callable[[], T], cv_of: Callable[[T], float], config: ProfileConfig) -> tuple[T, list[float]]:
    """Run ``attempt`` (a whole timing loop) and repeat it while its coefficient of variation
    is above ``config.noise_cv``, at most ``config.max_repeats`` more times; the attempt
    with the lowest coefficient of variation, and every attempt's."""
    best = attempt()
    cvs = [cv_of(best)]
    while cvs[-1] > config.noise_cv and len(cvs) <= config.max_repeats:
        again = attempt()
        cvs.append(cv_of(again))
        if cvs[-1] < min(cvs[:-1]):
            best = again
    return best, cvs


def noise_message(cv: float, threshold: float, attempts: int) -> str:
    """The warning a noisy measurement carries."""
    return (f"noisy: coefficient of variation {cv:.1%} above {threshold:.0%} after {attempts} attempt(s); "
            "a verdict on it is uncertain (a busy machine, unstable clocks, or inputs whose cost varies)")


def label_nodes(nodes: list[NodeTiming], labels: dict[str, str]) -> None:
    """Set each node's ``module`` from ``labels`` (ORT may prefix or suffix fused node names)."""
    import re

    for n in nodes:
        base = re.sub(r"(_token_\d+|_nchwc)+$", "", n.name.replace("fused ", ""))
        for key in (n.name, base, f"output:{base}"):
            if key in labels:
                n.module = labels[key]
                break


def profile_from_recorded(run: RecordedRun, top_k: int | None = None) -> ProfileResult:
    """The ProfileResult of timings a runtime's own tool recorded (trtexec on the device):
    the same statistics, node summary and warnings as a local measurement."""
    stats = LatencyStats.from_samples(run.latency_ms)
    total_nodes = len(run.nodes)
    top, op_types, float_share, quantized = summarize_nodes(list(run.nodes), top_k)
    throughput = run.throughput_per_s if run.throughput_per_s is not None else (
        1e3 / stats.mean if stats.mean > 0 else 0.0)
    return ProfileResult(engine=run.engine, runtime=run.runtime, target=run.target,
                         model=run.model, settings=dict(run.settings), latency_ms=stats, throughput_per_s=throughput,
                         nodes=top, op_types=op_types, float_share=float_share, quantized_nodes=quantized,
                         total_nodes=total_nodes, machine=dict(run.machine), warnings=list(run.warnings),
                         source=run.source, created=now_iso(), provenance=run.provenance)


def device_measurement(folder: str | os.PathLike[str], top_k: int | None = 15) -> ProfileResult | None:
    """The device's own measurement in ``folder`` (a bundle whose script ran on the device, or
    its results folder), or None when there is none. Pipelines prefer it over an estimate."""
    folder = Path(folder)
    try:
        manifest = read_folder_manifest(folder)
    except BadInputError:
        return None
    if manifest.config.get("runtime") not in RUNTIMES:
        return None
    try:
        recorded = get_runtime(manifest.config["runtime"]).recorded_run(folder, manifest)
    except NoResultsYet:  # a bundle whose script has not run yet; results of another device are an error
        return None
    if recorded is None or recorded.source != "device":
        return None
    return profile_from_recorded(recorded, top_k)


def profile_exports(folder: str | os.PathLike[str], onnx_path: str | os.PathLike[str], target: str,
                    runtime: str = "tensorrt", shapes: dict[str, tuple[int, ...]] | None = None,
                    top_k: int | None = 15, out_json: str | os.PathLike[str] | None = None) -> ProfileResult:
    """A runtime tool's exports made by hand (trtexec's ``--exportTimes``, ``--exportProfile``,
    ``--exportLayerInfo`` and log, under any names) as a device profile, checked against the ONNX
    graph the engine was built from and the target it claims (``provenance``): a mismatch is
    bad input naming both sides. ``shapes``: the input shapes the engine was timed with, where
    the ONNX leaves them dynamic.

    >>> profile_exports("exports/", "model.onnx", "jetson-agx-orin-64")  # doctest: +SKIP
    """
    folder, onnx_file = Path(folder), Path(onnx_path)
    if not folder.is_dir():
        raise BadInputError(f"trtexec exports folder {str(folder)!r} does not exist")
    if not onnx_file.is_file():
        raise BadInputError(f"ONNX file {str(onnx_file)!r} does not exist (give the graph the engine was built from)")
    tgt = load_target(target)
    if out_json is not None:
        check_output_file(out_json, (folder, onnx_file))
    profile = {name: {"min": list(d), "opt": list(d), "max": list(d)} for name, d in (shapes or {}).items()}
    manifest = Manifest(kind="engine", config={"runtime": runtime, "imported": True, "onnx": str(onnx_file.resolve()),
                                               "target_spec": str(target), "settings": {"shapes": profile}},
                        target=tgt.name, model={"name": onnx_file.stem})
    recorded = get_runtime(runtime).recorded_run(folder, manifest)
    if recorded is None:
        raise BadInputError(f"{folder} holds no {runtime} timing export (for trtexec: the JSON list of --exportTimes "
                            "records, with computeMs and latencyMs)")
    result = profile_from_recorded(recorded, top_k)
    if out_json is not None:
        result.save(out_json, protect=(folder, onnx_file))
    return result


def profile_engine(engine_dir: str | os.PathLike[str], config: ProfileConfig | None = None,
                   out_json: str | os.PathLike[str] | None = None,
                   input_options: InputOptions | None = None) -> ProfileResult:
    """Profile an engine folder with the trtexec method; the same for every runtime.

    Loads the engine (threads from ``config``), feeds it the real inputs stored at build
    time (``inputs.npz``, at ``config.batch``), times it (``time_engine``), then profiles
    nodes in a separate run. Records the settings, peak memory (RSS) and model size;
    warns when the coefficient of variation exceeds 2.5%. Writes ``out_json`` atomically.
    ``input_options``: time other inputs (``--inputs FILE.npz``) or shapes (``--shapes``).

    >>> result = profile_engine("out/engine", ProfileConfig(duration_s=1))  # doctest: +SKIP
    >>> result.latency_ms.p99  # doctest: +SKIP
    """
    config = config or ProfileConfig()
    engine_dir = Path(engine_dir)
    if out_json is not None:
        check_output_file(out_json, (engine_dir,))  # before the measurement
    try:
        manifest = read_folder_manifest(engine_dir)  # an engine, a bundle, or a device results folder
    except BadInputError as e:
        if engine_dir.is_dir() and any(engine_dir.glob("*.json")):
            raise BadInputError(f"{e}; trtexec exports made by hand are read with `edgekit profile --trtexec "
                                f"{engine_dir} --onnx MODEL.onnx --target TARGET`") from None
        raise
    if manifest.kind in ("engine", "bundle") and manifest.config.get("runtime") in RUNTIMES:
        # Timings the runtime's own tool recorded (on the device): summarized, not re-measured.
        recorded = get_runtime(manifest.config["runtime"]).recorded_run(engine_dir, manifest)
        if recorded is not None:
            if input_options:
                raise BadInputError(f"{engine_dir} holds timings recorded on the device; --shapes and --inputs "
                                    "apply to engines timed here (give them to `edgekit build` instead)")
            result = profile_from_recorded(recorded, config.top_k)
            if out_json is not None:
                result.save(out_json, protect=(engine_dir,))
            return result
    if manifest.kind != "engine":
        raise BadInputError(f"{engine_dir} holds a {manifest.kind!r} artifact; profile takes an engine folder "
                            "(build one with `edgekit build`)")
    rss_before = _current_rss_mb()
    t0 = time.perf_counter()
    engine = load_engine(engine_dir, threads=config.threads)
    load_s = time.perf_counter() - t0
    try:
        feeds = load_engine_inputs(engine_dir, batch=config.batch, input_options=input_options)
        if input_options:  # the batch the given inputs or shapes hold (for throughput)
            batch = feed_batch(feeds, manifest.model.get("inputs", []))
            config = dataclasses.replace(config, batch=batch or config.batch)
        check_feeds(engine.inputs, feeds)
        with _timing_progress(config) as progress:
            result = measure(engine, feeds, config, engine_name=str(engine_dir), runtime=manifest.config.get(
                "runtime", engine.runtime), target=manifest.target,
                model=manifest.model.get("name"), model_size_mb=_engine_size_mb(engine_dir, manifest),
                progress=progress)
        # The exported graph keeps the exporter's metadata; a runtime's optimized copy drops it.
        # (an engine folder without the exported graph keeps its labels in node_labels.json).
        onnx_path = (engine_dir / manifest.files["onnx"]) if "onnx" in manifest.files else engine.path
        if result.nodes and "node_labels" in manifest.files:
            label_nodes(result.nodes, read_json(manifest.path_of(engine_dir, "node_labels"), "node labels", 64 << 20))
        elif result.nodes and onnx_path is not None and str(onnx_path).endswith(".onnx") and Path(onnx_path).is_file():
            label_nodes(result.nodes, node_labels(onnx_path))
        rss_after = _current_rss_mb()
    finally:
        engine.close()
    result.settings.update({
        "method": "trtexec: warm-up by time, then >= iterations and >= duration; separate node-profiling run",
        "cv_warning_threshold": CV_WARNING, "precision": manifest.config.get("precision"),
        "engine_settings": engine.settings,
        "load_seconds": round(load_s, 3),
        "input_shapes": {k: list(v.shape) for k, v in feeds.items()},
        "rss_delta_mb": round(rss_after - rss_before, 1) if rss_after and rss_before else None,
    })
    quality = manifest.metrics.get("quality")
    if isinstance(quality, dict):
        result.quality = dict(quality)
        if quality.get("status") == "unverified":
            result.warnings.append(f"quality: unverified: {quality.get('reason', 'parity was skipped')}")
    target = _target_or_none(manifest.target)
    if target is not None and target.kind == "cpu" and not target.is_this_machine:
        theirs = f"{target.arch}, {target.int8_kernel.name}" if target.int8_kernel else "a CPU it does not describe"
        result.warnings.append(f"timed on this machine ({cpu_features()[0]}, {host_int8_kernel().name} integer kernels), "
                               f"not on target {target.name!r} ({theirs}): the latency is this machine's")
    if out_json is not None:
        result.save(out_json, protect=(engine_dir,))
    return result


def _target_or_none(name: str | None) -> Target | None:
    """The engine's target, when it still loads (a user's target file may have moved)."""
    if not name:
        return None
    try:
        return load_target(name)
    except EdgekitError:
        return None


def feed_batch(feeds: dict[str, np.ndarray], specs: list[dict[str, Any]]) -> int | None:
    """The batch of feeds: axis 0 of an input whose first dimension is the batch axis."""
    for s in specs:
        shape = s.get("shape") if isinstance(s, dict) else None
        if shape and shape[0] == "batch" and s.get("name") in feeds and feeds[s["name"]].ndim:
            return int(feeds[s["name"]].shape[0])
    return None


def _engine_size_mb(engine_dir: Path, manifest: Any) -> float | None:
    """Size of what the runtime loads: the engine model file(s), not the kept ONNX source or inputs."""
    roles = [r for r in manifest.files if r.startswith("model")] or [r for r in manifest.files if r != "inputs"]
    total = 0
    for role in roles:
        p = engine_dir / manifest.files[role]
        if p.is_file():
            total += p.stat().st_size
            data = p.with_name(p.name + ".data")
            if data.is_file() and not any(engine_dir / manifest.files[r] == data for r in roles):
                total += data.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return round(total / 2**20, 3) if total else None


def _current_rss_mb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


class _timing_progress:
    """A rich progress bar over the timed iterations (a no-op off a terminal); updated every
    16 samples so drawing it never shows up in the latencies."""

    def __init__(self, config: ProfileConfig) -> None:
        self.config = config
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Any:
        if not progress_enabled():
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]timing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            transient=True)
        self.bar.start()
        self.task = self.bar.add_task("timing", total=self.config.iterations)

        def update(n: int) -> None:
            if n % 16 == 0:
                self.bar.update(self.task, completed=n, total=max(n, self.config.iterations))

        return update

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()
