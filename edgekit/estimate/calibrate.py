"""Calibrate the roofline estimate against measurements on a target edgekit can run.

Loop: for each model, build an engine where edgekit can measure (this CPU: an ONNX
Runtime engine at optimization level ``all``, as ``edgekit build`` makes it, 1 intra-op
thread by default; a
CUDA GPU: the PyTorch-native engine), time it (trtexec method) and profile its
nodes; estimate the *graph that ran* (ONNX Runtime's saved optimized graph, read with
``fuse=False`` so estimated and measured nodes match by name; the estimator knows ORT's
fused and blocked-layout ``com.microsoft.nchwc`` ops); then fit one
efficiency factor per op class (``conv``, ``depthwise-conv``, ``matmul``,
``elementwise``, ..., suffixed ``:int8``/``:int4`` for integer nodes) by non-negative
least squares on node times::

    measured_i ~= roofline_i(eff = 1) / eff[class_i] + overhead    (bounded least squares)

plus the gap between summed node times and end-to-end latency (executor overhead per
node). The factors are saved next to a user's target YAML (``<stem>.efficiency.json``)
or in ``<cache>/targets/<name>.efficiency.json`` for a built-in target, and
``estimate`` uses them from then on. The report gives the error before and after,
in total and per op class. Calibrated estimates are still estimates.

On a GPU the torch engine's kernels do not map to ONNX nodes, so there only the
end-to-end latency is fitted: one factor scaling every class.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions, read_manifest
from edgekit.build import build_engine, load_engine
from edgekit.errors import BadInputError, EdgekitError, UnavailableError
from edgekit.estimate.efficiency import calibration_path, load_calibration, roofs_for
from edgekit.estimate.graph import load_graph, strip_weights
from edgekit.estimate.probe import probed_target
from edgekit.estimate.roofline import ESTIMATE_NOTE, Estimate, NodeEstimate, estimate
from edgekit.loading import export_onnx, load_model
from edgekit.profiling import ProfileConfig, measure, profile_engine
from edgekit.runtimes.base import BuildOptions
from edgekit.sources.handle import bind_dims, random_inputs
from edgekit.sources.inputs import InputOptions
from edgekit.sources.models import load_onnx_file
from edgekit.targets import TargetLike, load_target


# --- the saved factors -----------------------------------------------------------------------------
def save_calibration(target: TargetLike, efficiency: dict[str, float], kernel_overhead_us: float,
                     meta: dict[str, Any]) -> Path:

    tgt = load_target(target)
    path = calibration_path(tgt)
    atomic_write_json(path, {
        "target": tgt.name, "kind": "efficiency-calibration",
        "note": "efficiency factors fitted to measurements on this machine; estimates made with them are "
                "still estimates",
        "efficiency": {k: round(v, 5) for k, v in sorted(efficiency.items())},
        "kernel_overhead_us": round(kernel_overhead_us, 3), **meta,
        "machine": machine_info(), "versions": package_versions(), "created": now_iso()})
    return path


# --- fitting ---------------------------------------------------------------------------------------
def fit_key(node: NodeEstimate, float_precision: str = "fp32") -> str:
    """The efficiency key a node is fitted under: its op class, suffixed with an integer
    precision (``:int8``), and ``@mem`` when the node is memory-bound (the bandwidth roof
    is fitted apart from the compute roof: a matmul's decode and prefill differ)."""
    key = f"{node.op_class}:{node.precision}" if node.precision in ("int8", "int4") else node.op_class
    return key + "@mem" if node.bound == "memory" else key


@dataclass
class Observation:
    """One measured time explained by roofline terms: key -> time at efficiency 1 (ms)."""

    terms: dict[str, float]
    measured_ms: float
    kernels: float = 1.0  # kernel launches in this observation (for the overhead column)


def fit_efficiency(observations: list[Observation], prior: dict[str, float], *, fit_overhead: bool = True,
                   min_nodes: int = 1, min_share: float = 0.0,
                   max_overhead_ms: float = 0.02) -> tuple[dict[str, float], float, list[str]]:
    """Non-negative least squares of measured times on roofline terms.

    Returns (efficiency per key, fitted overhead per kernel in ms, keys left at their
    prior). A key needs ``min_nodes`` observations and ``min_share`` of the summed
    roofline time to be fitted; others keep ``prior``.
    """
    from scipy.optimize import lsq_linear

    total_base = sum(sum(o.terms.values()) for o in observations) or 1.0
    count: dict[str, int] = {}
    mass: dict[str, float] = {}
    for o in observations:
        for k, v in o.terms.items():
            if v > 0:
                count[k] = count.get(k, 0) + 1
                mass[k] = mass.get(k, 0.0) + v
    keys = sorted(k for k in count if count[k] >= min_nodes and mass[k] / total_base >= min_share)
    kept = sorted(set(count) - set(keys))
    if not observations:
        return dict(prior), 0.0, kept
    # The overhead is only identifiable with several observations per unknown.
    fit_overhead = fit_overhead and len(observations) >= 2 * (len(keys) + 1)
    cols = len(keys) + (1 if fit_overhead else 0)
    a = np.zeros((len(observations), cols))
    b = np.zeros(len(observations))
    for i, o in enumerate(observations):
        fixed = 0.0
        for k, v in o.terms.items():
            if k in keys:
                a[i, keys.index(k)] = v
            else:  # not fitted: its time at the prior efficiency is taken as given
                fixed += v / max(_lookup(prior, k), 1e-6)
        if fit_overhead:
            a[i, -1] = o.kernels
        b[i] = o.measured_ms - fixed
        # Weight rows by 1/sqrt(roofline time): the fit then matches each class's summed time
        # (x = sum(measured) / sum(roofline) for a class alone) instead of chasing its largest node.
        scale = 1.0 / math.sqrt(max(sum(o.terms.values()), 1e-4))
        a[i] *= scale
        b[i] *= scale
    if not cols:
        return dict(prior), 0.0, kept
    # Bounded least squares: 1/eff in [1/50, 1/0.005]; overhead in [0, max_overhead_ms].
    lo = np.full(cols, 1.0 / 50.0)
    hi = np.full(cols, 1.0 / 0.005)
    if fit_overhead:
        lo[-1], hi[-1] = 0.0, max_overhead_ms
    x = lsq_linear(a, b, bounds=(lo, hi)).x
    eff = dict(prior)
    for j, k in enumerate(keys):
        if float(np.dot(a[:, j], b)) <= 0:  # measured times are all overhead: not identifiable, keep the prior
            kept.append(k)
            continue
        eff[k] = float(min(max(1.0 / x[j], 0.005), 50.0))
    overhead = float(x[-1]) if fit_overhead else 0.0
    return eff, overhead, sorted(set(kept))


def node_observations(est: Estimate, measured: dict[str, float], float_precision: str = "fp32") -> list[Observation]:
    """One observation per estimated node that was measured (matched by node name)."""
    obs = []
    for n in est.nodes:
        if n.status != "runs" or n.name not in measured or n.bound == "overhead":
            continue
        # roofline time of the binding roof at efficiency 1
        base = n.compute_ms * n.efficiency if n.bound == "compute" else n.memory_ms * n.memory_efficiency
        obs.append(Observation({fit_key(n, float_precision): base}, measured[n.name]))
    return obs


def overhead_from_small_nodes(est_nodes: list[NodeEstimate], measured: dict[str, float],
                              below_ms: float = 0.001) -> float | None:
    """Median measured time (ms) of nodes whose roofline time is under ``below_ms``: the
    per-kernel overhead as the runtime shows it (None without such nodes)."""
    small = [measured[n.name] for n in est_nodes if n.status == "runs" and n.name in measured
             and max(n.compute_ms * n.efficiency, n.memory_ms * n.memory_efficiency) < below_ms]
    return float(np.median(small)) if small else None


# --- measuring ---------------------------------------------------------------------------------------
@dataclass
class Measurement:
    """One graph measured on the target: end-to-end latency and per-node times."""

    model: str
    graph: Any  # the onnx.ModelProto (or path) that ran, for a fuse=False estimate; None on GPU
    source: Any  # what was measured (path or spec), for the user-facing estimate
    p50_ms: float
    nodes: dict[str, float]  # node name -> ms per inference
    node_ops: dict[str, str]  # node name -> op type
    runtime: str
    threads: int | None
    dims: dict[str, int]
    batch: int
    cv: float
    precision: str | None = None  # the engine's precision (GPU engines: fp32/fp16/bf16); None = the graph's


def _feeds_for(onnx_path: Path, batch: int, dims: dict[str, int]) -> dict[str, np.ndarray]:

    handle = load_onnx_file(onnx_path)
    feeds = random_inputs(handle.inputs, batch, **dims)
    for k, v in feeds.items():
        if "mask" in k.lower():
            feeds[k] = np.ones_like(v)
        elif "position" in k.lower() and v.ndim == 2:
            past = next((d for n, d in dims.items() if "past" in n), 0)
            feeds[k] = np.broadcast_to(np.arange(past, past + v.shape[1], dtype=v.dtype), v.shape).copy()
    return feeds


def measure_cpu(model_or_onnx: Any, target: TargetLike = "cpu", *, batch: int = 1, dims: dict[str, int] | None = None,
                threads: int | None = 1, duration_s: float = 2.0, iterations: int = 30,
                node_iterations: int = 10, optimization_level: str = "all", name: str | None = None) -> Measurement:
    """Build an ONNX Runtime engine of the graph on this CPU and time it (end to end and per node)."""
    import onnx


    dims = dict(dims or {})
    with tempfile.TemporaryDirectory(prefix="edgekit-calib-") as tmp:
        src = Path(str(model_or_onnx)) if isinstance(model_or_onnx, (str, os.PathLike)) else None
        if src is None or not str(src).endswith(".onnx"):
            proto, gname = load_graph(model_or_onnx)
            src = Path(tmp) / "model.onnx"
            onnx.save(proto, str(src))  # only for graphs without external data
        else:
            gname = src.stem
        feeds = _feeds_for(src, batch, dims)
        engine_dir = Path(tmp) / "engine"
        build_engine(str(src), target, engine_dir, BuildOptions(
            optimization_level=optimization_level, threads=threads, runtime="onnxruntime", batch=batch,
            extra={"feeds": feeds, "export": {"skip_parity": True}}))

        manifest = read_manifest(engine_dir)
        graph = strip_weights(onnx.load(str(manifest.path_of(engine_dir, "model")), load_external_data=False))
        engine = load_engine(engine_dir, threads=threads)
        try:
            cfg = ProfileConfig(warmup_ms=200, duration_s=duration_s, iterations=iterations, threads=threads,
                                batch=batch, node_iterations=node_iterations, top_k=1_000_000)
            result = measure(engine, feeds, cfg, engine_name=str(engine_dir), runtime="onnxruntime",
                             target=str(target), model=gname)
        finally:
            engine.close()
    return Measurement(model=name or gname, graph=graph, source=model_or_onnx, p50_ms=result.latency_ms.p50,
                       nodes={n.name: n.time_ms for n in result.nodes},
                       node_ops={n.name: n.op_type for n in result.nodes}, runtime="onnxruntime", threads=threads,
                       dims=dims, batch=batch, cv=result.latency_ms.cv)


# --- the calibration loop -------------------------------------------------------------------------
@dataclass
class CalibrationCase:
    """One model to measure: an ONNX file (or any model source), with its dynamic dims."""

    model: Any
    dims: dict[str, int] = field(default_factory=dict)
    name: str | None = None
    batch: int = 1


@dataclass
class CalibrationReport:
    target: str
    runtime: str
    threads: int | None
    models: list[dict[str, Any]]
    classes: list[dict[str, Any]]  # per op class over all models: measured, before, after (ms)
    efficiency_before: dict[str, float]
    efficiency_after: dict[str, float]
    overhead_us_before: float
    overhead_us_after: float
    fitted_keys: list[str]
    saved_to: str | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "calibration", "note": ESTIMATE_NOTE, **dataclasses.asdict(self)}

    def render(self) -> str:
        lines = [f"calibration of the roofline estimate on {self.target} ({self.runtime}, threads "
                 f"{self.threads or 'all'}); estimates remain estimates",
                 f"{'model':<28}{'measured':>10}{'before':>10}{'err':>8}{'after':>10}{'err':>8}"
                 f"{'user est':>10}{'err':>8}"]
        for m in self.models:
            lines.append(f"{m['model'][:27]:<28}{m['measured_ms']:>10.3f}{m['before_ms']:>10.3f}"
                         f"{m['error_before']:>+8.0%}{m['after_ms']:>10.3f}{m['error_after']:>+8.0%}"
                         + (f"{m['user_after_ms']:>10.3f}{m['user_error_after']:>+8.0%}"
                            if m.get("user_after_ms") is not None else ""))
        lines += ["", f"{'op class':<22}{'measured':>10}{'before':>10}{'err':>8}{'after':>10}{'err':>8}"
                      f"{'eff before':>11}{'eff after':>10}"]
        for c in self.classes:
            lines.append(f"{c['key']:<22}{c['measured_ms']:>10.3f}{c['before_ms']:>10.3f}{c['error_before']:>+8.0%}"
                         f"{c['after_ms']:>10.3f}{c['error_after']:>+8.0%}{c['eff_before']:>11.3f}"
                         f"{c['eff_after']:>10.3f}")
        lines.append(f"kernel overhead: {self.overhead_us_before:.2f} us -> {self.overhead_us_after:.2f} us per node")
        if self.saved_to:
            lines.append(f"saved to {self.saved_to} (used by later estimates of {self.target})")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _rel(est: float, meas: float) -> float:
    return (est - meas) / meas if meas > 0 else float("nan")


def calibrate(cases: list[Any], target: TargetLike = "cpu", *, threads: int | None = 1, duration_s: float = 2.0,
              iterations: int = 30, save: bool = True, user_estimates: bool = True,
              measurements: list[Measurement] | None = None) -> CalibrationReport:
    """Measure each case on ``target``, fit efficiency factors, save them, report errors.

    ``cases``: ONNX files / model sources, or ``CalibrationCase`` with dims. ``measurements``
    skips measuring (for tests and re-fits). ``user_estimates`` also reports the
    estimate of the original graph (``fuse=True``), what ``edgekit estimate`` prints.

    >>> report = calibrate(["model.onnx"], "cpu")  # doctest: +SKIP
    >>> print(report.render())  # doctest: +SKIP
    """

    tgt, _ = probed_target(load_target(target))  # the cpu target: this machine's measured figures
    cases = [c if isinstance(c, CalibrationCase) else CalibrationCase(c) for c in cases]
    if measurements is None:
        if tgt.kind == "cpu":
            measurements = [measure_cpu(c.model, tgt, batch=c.batch, dims=c.dims, threads=threads,
                                        duration_s=duration_s, iterations=iterations, name=c.name) for c in cases]
        else:
            measurements = [measure_gpu(c.model, tgt, batch=c.batch, dims=c.dims, name=c.name) for c in cases]
    if not measurements:
        raise BadInputError("calibration needs at least one model to measure")
    prior_roofs = roofs_for(tgt, calibrated=False)
    prior, prior_overhead_us = dict(prior_roofs.eff), prior_roofs.overhead_us
    runtime = measurements[0].runtime
    notes: list[str] = []
    before: list[Estimate] = []
    obs: list[Observation] = []
    gaps: list[tuple[float, int]] = []
    small_overheads: list[float] = []
    for m in measurements:
        if m.graph is None:  # GPU: end-to-end only
            e = estimate(m.source, tgt, m.precision, batch=m.batch, dims=m.dims, calibrated=False)
            terms: dict[str, float] = {}
            for n in e.nodes:
                if n.status == "runs":
                    terms["all"] = terms.get("all", 0.0) + max(n.compute_ms, n.memory_ms)  # at the priors
            kernels = sum(1 for n in e.nodes if n.status == "runs")
            obs.append(Observation(terms, m.p50_ms, kernels))
            before.append(e)
            continue
        e = estimate(m.graph, tgt, batch=m.batch, dims=m.dims, fuse=False, calibrated=False)
        e.model = m.model
        before.append(e)
        obs += node_observations(e, m.nodes)
        small_overheads += [m.nodes[n.name] for n in e.nodes if n.status == "runs" and n.name in m.nodes and
                            max(n.compute_ms * n.efficiency, n.memory_ms * n.memory_efficiency) < 0.001]
        matched = [n for n in e.nodes if n.status == "runs" and n.name in m.nodes]
        missing = [n for n in m.nodes if n not in {x.name for x in e.nodes}]
        if missing:
            notes.append(f"{m.model}: {len(missing)} measured nodes not in the graph (left out of the fit)")
        gaps.append((m.p50_ms - sum(m.nodes.values()), len(matched)))
    if measurements[0].graph is None:
        scale_eff, overhead_ms, kept = fit_efficiency(obs, {"all": 1.0}, fit_overhead=False, min_nodes=1)
        factor = scale_eff.get("all", 1.0)  # >1: the device is faster than the defaults say
        efficiency = {k: v * factor for k, v in prior.items()}
        overhead_us = prior_overhead_us
        notes.append("GPU calibration fits one factor on end-to-end latency (kernels do not map to ONNX nodes)")
    else:
        if len(small_overheads) >= 3:
            # The kernel overhead is what nodes with (almost) no work take; the classes are then
            # fitted on what is left of each node's time.
            overhead_ms = float(np.median(small_overheads))
            obs = [Observation(o.terms, o.measured_ms - overhead_ms, o.kernels) for o in obs]
            efficiency, _, kept = fit_efficiency(obs, prior, fit_overhead=False)
            how = f"median time of {len(small_overheads)} measured nodes with under 1 us of roofline work"
        else:
            efficiency, overhead_ms, kept = fit_efficiency(obs, prior)
            how = "fitted with the classes"
        n_nodes = sum(n for _, n in gaps) or 1
        gap_us = max(0.0, sum(g for g, _ in gaps) * 1e3 / n_nodes)
        overhead_us = overhead_ms * 1e3 + gap_us
        notes.append(f"per-node overhead = kernel overhead {overhead_ms * 1e3:.2f} us ({how}) + executor gap "
                     f"{gap_us:.2f} us (end-to-end minus summed node times, per node)")
    fitted = sorted(k for k in efficiency if k not in kept and (k not in prior or efficiency[k] != prior[k]))
    models: list[dict[str, Any]] = []
    class_rows: dict[str, dict[str, float]] = {}
    for m, e_before in zip(measurements, before, strict=False):
        if m.graph is None:
            e_after = estimate(m.source, tgt, m.precision, batch=m.batch, dims=m.dims, efficiency=efficiency,
                               kernel_overhead_us=overhead_us, calibrated=False)
        else:
            e_after = estimate(m.graph, tgt, batch=m.batch, dims=m.dims, fuse=False, efficiency=efficiency,
                               kernel_overhead_us=overhead_us, calibrated=False)
        row: dict[str, Any] = {"model": m.model, "measured_ms": m.p50_ms, "measured_cv": m.cv,
                               "summed_nodes_ms": sum(m.nodes.values()), "before_ms": e_before.total_ms,
                               "after_ms": e_after.total_ms, "error_before": _rel(e_before.total_ms, m.p50_ms),
                               "error_after": _rel(e_after.total_ms, m.p50_ms), "dims": m.dims, "batch": m.batch}
        if user_estimates and m.graph is not None:
            try:
                ub = estimate(m.source, tgt, batch=m.batch, dims=m.dims, calibrated=False)
                ua = estimate(m.source, tgt, batch=m.batch, dims=m.dims, efficiency=efficiency,
                              kernel_overhead_us=overhead_us, calibrated=False)
                row.update(user_before_ms=ub.total_ms, user_after_ms=ua.total_ms,
                           user_error_before=_rel(ub.total_ms, m.p50_ms), user_error_after=_rel(ua.total_ms, m.p50_ms))
            except (EdgekitError, OSError) as exc:  # the original graph may not load here; keep the report
                notes.append(f"{m.model}: no estimate of the original graph ({exc})")
        per: dict[str, dict[str, float]] = {}
        if m.graph is not None:
            after_by = {n.name: n for n in e_after.nodes}
            for n in e_before.nodes:
                if n.status != "runs" or n.name not in m.nodes:
                    continue
                key = fit_key(n)
                r = per.setdefault(key, {"measured_ms": 0.0, "before_ms": 0.0, "after_ms": 0.0, "nodes": 0})
                r["measured_ms"] += m.nodes[n.name]
                r["before_ms"] += n.time_ms
                r["after_ms"] += after_by[n.name].time_ms
                r["nodes"] += 1
        row["classes"] = {k: {**v, "error_before": _rel(v["before_ms"], v["measured_ms"]),
                              "error_after": _rel(v["after_ms"], v["measured_ms"])} for k, v in per.items()}
        for k, v in per.items():
            agg = class_rows.setdefault(k, {"measured_ms": 0.0, "before_ms": 0.0, "after_ms": 0.0, "nodes": 0})
            for f in ("measured_ms", "before_ms", "after_ms", "nodes"):
                agg[f] += v[f]
        models.append(row)
    classes = [{"key": k, **v, "error_before": _rel(v["before_ms"], v["measured_ms"]),
                "error_after": _rel(v["after_ms"], v["measured_ms"]),
                "eff_before": _lookup(prior, k), "eff_after": _lookup(efficiency, k)}
               for k, v in sorted(class_rows.items(), key=lambda kv: -kv[1]["measured_ms"])]
    saved = None
    if save:
        saved = str(save_calibration(tgt, {k: v for k, v in efficiency.items()}, overhead_us, {
            "runtime": runtime, "threads": measurements[0].threads, "fitted_keys": fitted,
            "fitted_on": [{"model": r["model"], "dims": r["dims"], "batch": r["batch"],
                           "measured_ms": r["measured_ms"], "error_before": r["error_before"],
                           "error_after": r["error_after"]} for r in models]}))
    if tgt.kind == "cpu" and measurements[0].threads:
        notes.append(f"measured with {measurements[0].threads} intra-op thread(s): calibrated cpu estimates "
                     "predict latency at that thread count")
    return CalibrationReport(target=tgt.name, runtime=runtime, threads=measurements[0].threads, models=models,
                             classes=classes, efficiency_before=prior, efficiency_after=efficiency,
                             overhead_us_before=prior_overhead_us, overhead_us_after=overhead_us,
                             fitted_keys=fitted, saved_to=saved, notes=notes)


def _lookup(eff: dict[str, float], key: str) -> float:
    """Efficiency of a fit key with the estimator's fallbacks (``conv:int8@mem`` -> ... -> ``conv``)."""
    base, mem = key.removesuffix("@mem"), key.endswith("@mem")
    cls = base.split(":")[0]
    for k in ([key, f"{cls}@mem"] if mem else []) + [base, cls, "other"]:
        if k in eff:
            return float(eff[k])
    return 0.3


def measure_gpu(model: Any, target: TargetLike, *, batch: int = 1, dims: dict[str, int] | None = None,
                name: str | None = None, precision: str = "fp32", duration_s: float = 2.0) -> Measurement:
    """Build the PyTorch-native engine on CUDA and time it (CUDA events). Needs a GPU."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        raise UnavailableError(f"torch is not installed ({e})") from None
    if not torch.cuda.is_available():
        raise UnavailableError("calibrating a GPU target needs a CUDA GPU here (torch.cuda.is_available() is False)")

    with tempfile.TemporaryDirectory(prefix="edgekit-calib-gpu-") as tmp:
        engine_dir = build_engine(model, target, Path(tmp) / "engine",
                                  BuildOptions(precision=precision, runtime="torch", batch=batch))
        prof = profile_engine(engine_dir, ProfileConfig(duration_s=duration_s, batch=batch, node_profile=False))
    return Measurement(model=name or str(model), graph=None, source=model, p50_ms=prof.latency_ms.p50, nodes={},
                       node_ops={}, runtime="torch", threads=None, dims=dict(dims or {}), batch=batch,
                       cv=prof.latency_ms.cv, precision=precision)


__all__ = ["CalibrationCase", "CalibrationReport", "Measurement", "Observation", "calibrate", "calibration_path",
           "fit_efficiency", "load_calibration", "measure_cpu", "measure_gpu", "node_observations",
           "save_calibration", "estimate_with_calibration"]


def estimate_with_calibration(model: Any, target: TargetLike, *, precision: str | None = None, batch: int = 1,
                              dims: dict[str, int] | None = None, calibrate: bool = False,
                              runtime: str | None = None, input_options: InputOptions | None = None,
                              timing: str = "gpu-compute") -> tuple[Estimate, CalibrationReport | None]:
    """What ``edgekit estimate`` does: optionally calibrate the target on this machine
    with ``model`` (only where edgekit can measure it), then estimate. ``input_options``
    (``--shapes``, or the shapes of an ``--inputs`` file) bind the batch and the named
    dynamic dimensions; explicit ``dims`` win. ``runtime``: whose fusions apply; ``timing``: what the
    total stands for (``roofline.TIMINGS``)."""

    tgt = load_target(target)
    if input_options:
        batch, bound = input_dims(model, input_options, batch)
        dims = {**bound, **(dims or {})}
    report = None
    if calibrate:
        if tgt.kind != "cpu":
            torch_ok = False
            try:
                import torch

                torch_ok = torch.cuda.is_available()
            except ImportError:
                pass
            if not torch_ok:
                raise UnavailableError(f"cannot calibrate target {tgt.name!r} here: it needs that device (a CUDA GPU "
                                       "for GPU targets); calibrate on the device, or estimate without --calibrate")
        with tempfile.TemporaryDirectory(prefix="edgekit-estimate-") as tmp:
            source = _as_onnx_file(model, Path(tmp))  # export once, for the measurement and the estimate
            report = _calibrate([CalibrationCase(source, dict(dims or {}), batch=batch)], tgt)
            return estimate(source, tgt, precision, batch, dims=dims, runtime=runtime, timing=timing), report
    return estimate(model, tgt, precision, batch, dims=dims, runtime=runtime, timing=timing), report


def input_dims(model: Any, input_options: InputOptions, batch: int) -> tuple[int, dict[str, int]]:
    """The batch and dynamic dimensions that ``--shapes`` (or an ``--inputs`` file) give
    for ``model``'s inputs, checked against them."""
    handle = load_model(model, input_options)
    shapes = dict(input_options.shapes)
    if input_options.inputs is not None:
        shapes = {k: tuple(v.shape) for k, v in handle.sample_inputs(batch).items()} | shapes
    return bind_dims(handle.inputs, shapes, batch)


def _as_onnx_file(model: Any, tmp: Path) -> Any:
    """An ONNX file or edgekit folder as it is; anything else exported once into ``tmp``."""
    if isinstance(model, (str, os.PathLike)):
        p = Path(str(model))
        if str(p).endswith(".onnx") or (p.is_dir() and (p / "manifest.json").is_file()):
            return model

    handle = load_model(model)
    if handle.onnx_path is not None:
        return str(handle.onnx_path)
    out = Path(export_onnx(handle, tmp / "onnx"))

    return str(read_manifest(out).path_of(out, "onnx"))


_calibrate = calibrate
