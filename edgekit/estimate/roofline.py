"""Latency estimates of a graph on a target, kernel by kernel. An estimate, never a measurement.

The graph (``graph.py``: shapes from ONNX Runtime's symbolic shape inference) is grouped
into the kernels the target's runtime runs (``fusion.py``); each kernel's work
(``cost.py``) meets the target's roofs (``efficiency.py``)::

    compute = sum over its nodes of ops / (rate * eff[class] * shape_factor)
              (rate: the peak at the node's precision; on CPUs its class's kernel rate)
    memory  = bytes it reads and writes from outside / (cache or DRAM bandwidth)
    time    = max(compute, memory) + kernel overhead

and the total carries a range from the validation errors of its target and operator mix
(``uncertainty.py``): ``low_ms``, ``high_ms`` and ``basis`` on the ``Estimate``.

>>> est = estimate("model.onnx", "jetson-agx-orin-64", precision="fp16")  # doctest: +SKIP
>>> print(est.render())  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.estimate.cost import OP_CLASSES, Precision, dot_k, node_cost, op_class, tensor_bits
from edgekit.estimate.efficiency import Roofs, roofs_for, shape_factor
from edgekit.estimate.fusion import DEFAULT_FUSION, FUSION_MODELS, FUSION_RUNTIMES, Fused, Kernel, fuse
from edgekit.estimate.graph import Graph, load_graph, read_graph, strip_weights
from edgekit.estimate.options import TIMINGS
from edgekit.estimate.probe import probed_target
from edgekit.estimate.uncertainty import estimate_range, op_mix
from edgekit.profiling import LatencyStats, ProfileResult
from edgekit.runtimes.base import NodeTiming
from edgekit.targets import PRECISIONS, Target, TargetLike, load_target

ESTIMATE_NOTE = "ESTIMATE (roofline model, not a measurement)"
FLOAT_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
# What ``total_ms`` stands for (``TIMINGS``, declared with estimate's options). gpu-compute: the
# engine's kernels alone, as trtexec's "GPU Compute Time" and MLPerf's device-resident harness time it; end-to-end: plus copying the graph's inputs
# in and outputs out through a Python predictor (the target's ``host_copy_gbs``), as Ultralytics'
# benchmark times it. Both are always estimated; the other is in the estimate beside it.
TIMING_TEXT = {"gpu-compute": "GPU compute (the kernels alone, as trtexec's GPU Compute Time)",
               "end-to-end": "end to end through a Python predictor (kernels plus host copies of the inputs and "
                             "outputs)"}
# A CPU engine's inputs and outputs already sit in host memory: both timings are the same run.
CPU_TIMING_TEXT = "one session.run on this CPU (inputs and outputs in host memory, nothing to copy)"

__all__ = ["ESTIMATE_NOTE", "OP_CLASSES", "Estimate", "NodeEstimate", "estimate", "load_graph", "op_class",
           "strip_weights"]


@dataclass
class NodeEstimate:
    """One node's share of the estimate. The head of a kernel carries the kernel's times;
    nodes fused into it carry their own work and zero time. Times in milliseconds."""

    name: str
    op_type: str
    op_class: str
    precision: str  # the node's compute precision ("int8", "fp16", ...), "int4" for 4-bit weights
    ops: float
    weight_bytes: float
    activation_bytes: float
    intensity: float  # ops / byte of its kernel
    crossover: float  # the target's peak / bandwidth for this precision, ops / byte
    bound: str  # "compute" | "memory" | "overhead"
    compute_ms: float
    memory_ms: float
    overhead_ms: float
    time_ms: float
    efficiency: float  # fraction of peak compute used (class factor x shape factor)
    memory_efficiency: float = 0.0
    stage: str = ""
    known: bool = True
    quantized: bool = False
    status: str = "runs"  # "runs" (heads a kernel) | "fused" | "folded" (constant) | "view"
    kernel: str = ""  # the fusion that made its kernel: single, epilogue, pointwise, layernorm, gelu, attention
    reformat_ms: float = 0.0  # INT8 engines: reformats of its inputs between INT8 and float (in time_ms)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bytes"] = self.bytes
        return d


@dataclass
class Estimate:
    """Estimate of one graph on one target. ``kind`` is always "estimate".

    ``total_ms`` is the point estimate; ``low_ms``..``high_ms`` the range of latency the
    validation errors of this target and operator mix allow, ``basis`` says which."""

    model: str
    target: str
    precision: str
    batch: int
    dims: dict[str, int]
    total_ms: float
    low_ms: float
    high_ms: float
    basis: str
    ops: float
    weight_bytes: float
    activation_bytes: float
    compute_ms: float
    memory_ms: float
    overhead_ms: float
    bound: str  # "compute" | "memory": which term dominates the total
    io_ms: float  # graph inputs and outputs copied between host and device (target's host_copy_gbs)
    crossover: dict[str, float]
    peak_tops: dict[str, float]
    memory_bandwidth_gbs: float
    nodes: list[NodeEstimate]
    kernels: int  # kernels the runtime launches
    fusions: dict[str, int]  # fusion pattern -> kernels
    runtime: str  # whose fusions were applied: tensorrt | onnxruntime | none
    op_mix: str  # conv | matmul | mixed
    op_types: list[dict[str, Any]]
    op_classes: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    unknown_ops: dict[str, int]
    efficiency: dict[str, float]
    calibration: str | None
    fuse: bool = True
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timing: str = "gpu-compute"  # what total_ms stands for (TIMINGS)
    timing_text: str = ""  # the same in words, for the target's kind
    gpu_compute_ms: float = 0.0  # the kernels alone
    end_to_end_ms: float = 0.0  # the kernels plus io_ms
    reformat_ms: float = 0.0  # INT8 engines: reformats between INT8 and float (in the kernels' time)
    reformats: int = 0
    kind: str = "estimate"
    source: str = "estimated"
    note: str = ESTIMATE_NOTE

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes

    def top(self, k: int = 10) -> list[NodeEstimate]:
        return sorted((n for n in self.nodes if n.status == "runs"), key=lambda n: -n.time_ms)[:k]

    def to_dict(self, all_nodes: bool = True) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "nodes"}
        d["bytes"] = self.bytes
        d["top_nodes"] = [n.to_dict() for n in self.top(15)]
        d["nodes"] = [n.to_dict() for n in self.nodes] if all_nodes else []
        return d

    def to_profile(self) -> ProfileResult:
        """The estimate as a ``ProfileResult`` (``source="estimated"``) so ``check`` and
        ``report`` can read it: every percentile is the point estimate; the range is in
        ``settings["estimate_range_ms"]``."""
        t = self.total_ms
        stats = LatencyStats(min=t, mean=t, p50=t, p90=t, p95=t, p99=t, max=t, std=0.0, cv=0.0, count=0)
        nodes = [NodeTiming(n.name, n.op_type, n.time_ms, n.time_ms / t if t else 0.0, n.precision, n.quantized)
                 for n in self.top(50)]
        return ProfileResult(engine="", runtime="estimate", target=self.target, model=self.model,
                             settings={"precision": self.precision, "batch": self.batch, "dims": self.dims,
                                       "estimate_range_ms": [self.low_ms, self.high_ms], "basis": self.basis,
                                       "timing": self.timing, "gpu_compute_ms": self.gpu_compute_ms,
                                       "end_to_end_ms": self.end_to_end_ms},
                             latency_ms=stats, throughput_per_s=1e3 * self.batch / t if t else 0.0, nodes=nodes,
                             op_types=self.op_types, total_nodes=self.kernels,
                             quantized_nodes=sum(1 for n in self.nodes if n.quantized and n.status == "runs"),
                             warnings=[ESTIMATE_NOTE, f"estimated range {self.low_ms:.3g}-{self.high_ms:.3g} ms "
                                       f"({self.basis})", *self.warnings],
                             source="estimated")

    def range_text(self) -> str:
        return f"{self.total_ms:.3f} ms (range {self.low_ms:.3f}-{self.high_ms:.3f} ms)"

    def render(self, top_k: int = 10) -> str:
        """A plain-text table for people."""
        other = "end-to-end" if self.timing == "gpu-compute" else "gpu-compute"
        other_ms = self.end_to_end_ms if self.timing == "gpu-compute" else self.gpu_compute_ms
        lines = [f"{ESTIMATE_NOTE}: {self.model} on {self.target}, precision {self.precision}, batch {self.batch}"
                 + (f", dims {self.dims}" if self.dims else ""),
                 f"estimated latency {self.range_text()}, {self.bound}-bound overall",
                 f"timing: {self.timing_text or TIMING_TEXT[self.timing]}"
                 + (f"; {other}: {other_ms:.3f} ms (--timing {other})" if self.io_ms else ""),
                 f"range basis: {self.basis}",
                 f"{self.kernels} kernels after {self.runtime} fusions ("
                 + ", ".join(f"{k} {v}" for k, v in sorted(self.fusions.items())) + f"); compute "
                 f"{self.compute_ms:.3f} ms, memory {self.memory_ms:.3f} ms, kernel overhead {self.overhead_ms:.3f} ms"
                 + (f", {self.reformats} INT8/float reformats {self.reformat_ms:.3f} ms" if self.reformats else "")
                 + (f", input/output copies {self.io_ms:.3f} ms"
                    + ("" if self.timing == "end-to-end" else " (not in the total)") if self.io_ms else ""),
                 f"work: {self.ops / 1e9:.3f} G ops, weights {self.weight_bytes / 1e6:.2f} MB, activations "
                 f"{self.activation_bytes / 1e6:.2f} MB; bandwidth {self.memory_bandwidth_gbs:g} GB/s",
                 f"efficiency: {'calibrated (' + self.calibration + ')' if self.calibration else 'target defaults'}",
                 "", f"{'op class':<16}{'kernels':>8}{'est ms':>10}{'share':>8}{'G ops':>9}{'MB':>9}  bound"]
        for r in self.op_classes:
            lines.append(f"{r['op_class']:<16}{r['count']:>8}{r['time_ms']:>10.3f}{r['share']:>8.1%}"
                         f"{r['ops'] / 1e9:>9.3f}{r['bytes'] / 1e6:>9.2f}  {r['bound']}")
        lines += ["", f"top {top_k} kernels (estimated):",
                  f"{'kernel head':<40}{'op':<14}{'fusion':<11}{'prec':<6}{'est ms':>9}{'eff':>6}  bound"]
        for n in self.top(top_k):
            lines.append(f"{n.name[:39]:<40}{n.op_type[:13]:<14}{n.kernel[:10]:<11}{n.precision:<6}"
                         f"{n.time_ms:>9.4f}{n.efficiency:>6.2f}  {n.bound}")
        if self.stages and len(self.stages) > 1:
            lines += ["", "stages (estimated):"]
            for s in self.stages[:12]:
                lines.append(f"  {s['stage'][:40]:<42}{s['time_ms']:>9.3f} ms {s['share']:>7.1%}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def fusion_runtime(target: Target, runtime: str | None, fuse_graph: bool) -> str:
    """Whose fusions apply: the given runtime, else the target's preferred one (runtimes
    without a fusion model of their own are read as ONNX Runtime)."""
    if not fuse_graph:
        return "none"
    rt = runtime or target.runtimes[0]
    if rt in FUSION_MODELS:
        return rt
    if runtime is not None and runtime not in target.runtimes:
        raise BadInputError(bad_choice("runtime", runtime, sorted({*FUSION_RUNTIMES, *target.runtimes})))
    return DEFAULT_FUSION


def _float_precision(tgt: Target, precision: str | None) -> str:
    if precision in (None, "int4"):
        if precision == "int4" and "fp16" in tgt.precisions and tgt.kind != "cpu":
            return "fp16"  # GPUs run weight-only int4 with fp16 activations
        return "fp32" if "fp32" in tgt.precisions or not tgt.precisions else \
            next((p for p in FLOAT_PRECISIONS if p in tgt.precisions), "fp32")
    if precision == "int8":
        return "fp16" if ("fp16" in tgt.precisions and tgt.kind != "cpu") else "fp32"
    return precision


def estimate(model_or_onnx: Any, target: TargetLike, precision: str | None = None, batch: int = 1, *,
             dims: dict[str, int] | None = None, fuse: bool = True, runtime: str | None = None,
             efficiency: dict[str, float] | None = None, kernel_overhead_us: float | None = None,
             calibrated: bool = True, timing: str = "gpu-compute", probe: bool = True) -> Estimate:
    """Latency estimate of a model on a target, per kernel and in total, with its range.

    ``model_or_onnx``: an ONNX file, an edgekit folder, a model spec, a ``ModelHandle``
    or an ``onnx.ModelProto``. ``precision``: the engine's precision (default: the
    graph's own, fp32 for float graphs); ``int8`` on a float graph assumes every layer
    runs INT8, ``int4`` assumes 4-bit weight-only MatMul/Gemm. ``dims`` binds named
    dynamic axes. ``runtime``: whose fusions to apply (default: the target's first
    runtime); ``fuse=False`` runs every node as written. ``efficiency`` overrides the
    target's factors; ``calibrated=False`` ignores a saved calibration. ``timing``: what
    ``total_ms`` stands for (``TIMINGS``: the kernels alone, or end to end with host copies);
    both are in the estimate. ``precision="tf32"`` runs float layers on TF32 tensor cores (what
    TensorRT's "FP32" engines do on Ampere unless built with --noTF32); ``fp32`` is FP32 on
    CUDA cores, what edgekit's TensorRT bundle builds for fp32. The ``cpu`` target is this
    machine as its probe measured it (``estimate.probe``: measured now if none is cached;
    ``probe=False`` keeps the YAML's generic figures where none is cached).

    >>> est = estimate("model.onnx", "cpu")  # doctest: +SKIP
    >>> est.total_ms, est.low_ms, est.high_ms, est.basis  # doctest: +SKIP
    """
    tgt = load_target(target)
    probe_warning = None
    if probe:
        tgt, probe_warning = probed_target(tgt)
    if batch < 1:
        raise BadInputError(f"batch must be >= 1, got {batch}")
    if timing not in TIMINGS:
        raise bad_choice("timing", timing, TIMINGS)
    if precision is not None:
        if precision not in PRECISIONS:
            raise BadInputError(bad_choice("precision", precision, PRECISIONS))
        tgt.require_precision(precision)
    rt = fusion_runtime(tgt, runtime, fuse)
    graph, fused = _graph_and_kernels(model_or_onnx, batch, dims, rt, blocked=tgt.kind == "cpu")
    roofs = roofs_for(tgt, calibrated=calibrated)
    if efficiency:
        roofs = dataclasses.replace(roofs, eff={**roofs.eff, **efficiency},
                                    host_copy_gbs=float(efficiency.get("host_copy_gbs", roofs.host_copy_gbs)))
    if kernel_overhead_us is not None:
        roofs = dataclasses.replace(roofs, overhead_us=kernel_overhead_us)
    prec = Precision(_float_precision(tgt, precision), {"int8": "int8", "int4": "int4"}.get(precision or "", "native"))
    nodes = estimate_kernels(graph, fused, roofs, prec)
    est = _assemble(graph, fused, nodes, tgt, roofs, rt, precision, prec, batch, _io_ms(graph, roofs, prec), timing)
    if precision == "fp32" and tgt.kind != "cpu" and "tf32" in tgt.precisions:
        tf32 = estimate_kernels(graph, fused, roofs, Precision("tf32", "native"))
        tf32_ms = sum(n.time_ms for n in tf32 if n.status == "runs") + (est.io_ms if timing == "end-to-end" else 0.0)
        est.notes.append(f"fp32 is FP32 on CUDA cores, what edgekit's TensorRT bundle builds (trtexec --noTF32); "
                         f"published TensorRT \"FP32\" results usually ran TF32 (TensorRT's default on Ampere and "
                         f"newer): compare those with --precision tf32 ({tf32_ms:.3f} ms here)")
    if tgt.kind == "cpu":
        est.notes.append(cpu_note(tgt))
        if probe_warning:
            est.warnings.append(probe_warning)
    return est


def cpu_note(tgt: Target) -> str:
    """What a CPU estimate stands for: one thread, on which figures."""
    figures = (f"this machine's figures measured by its probe ({tgt.probe})" if tgt.probe else
               "the target's datasheet-derived figures (kernel rates = peaks x estimate.efficiency.KERNEL_REACH)"
               if not tgt.kernel_rates else "the target's kernel rates")
    return (f"CPU estimate for one intra-op thread (as `build --threads 1` runs and calibration measures), from "
            f"{figures}")


def _io_ms(graph: Graph, roofs: Roofs, prec: Precision) -> float:
    """Copying the graph's inputs in and outputs out, where the target counts it."""
    if not roofs.host_copy_gbs:
        return 0.0
    consumed = {t.name: t for n in graph.nodes for t in n.inputs if t is not None and not t.const}
    produced = {t.name for n in graph.nodes for t in n.outputs if t is not None}
    inputs = [t for name, t in consumed.items() if name not in produced]
    outputs = [t for n in graph.nodes for t in n.outputs if t is not None and t.name in graph.outputs]
    total = sum(t.stored_bytes for t in inputs) + sum(t.stored_bytes for t in outputs)
    return total / (roofs.host_copy_gbs * 1e9) * 1e3


_MEMO: dict[tuple[Any, ...], tuple[Graph, Fused]] = {}  # ONNX file, size, mtime, batch, dims, runtime -> read


def _graph_and_kernels(model_or_onnx: Any, batch: int, dims: dict[str, int] | None, rt: str,
                       blocked: bool = False) -> tuple[Graph, Fused]:
    """The shape-inferred graph and its kernels; an ONNX file's are kept for the next
    estimate of the same file and settings (sweeps over targets and efficiency fits)."""
    key = None
    if isinstance(model_or_onnx, (str, os.PathLike)) and str(model_or_onnx).endswith(".onnx"):
        p = Path(model_or_onnx)
        if p.is_file():
            st = p.stat()
            key = (str(p.resolve()), st.st_size, st.st_mtime_ns, batch, tuple(sorted((dims or {}).items())), rt,
                   blocked)
            if key in _MEMO:
                return _MEMO[key]
    graph = read_graph(model_or_onnx, batch, dims)
    out = (graph, fuse(graph, rt, blocked_layout=blocked))
    if key is not None:
        while len(_MEMO) >= 32:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = out
    return out


def estimate_kernels(graph: Graph, fused: Fused, roofs: Roofs, prec: Precision) -> list[NodeEstimate]:
    """One ``NodeEstimate`` per node: kernel heads carry their kernel's time."""
    if prec.mode == "int8" and roofs.kind != "cpu":
        return _implicit_int8_kernels(graph, fused, roofs, prec)
    costs = _costs(graph, fused, prec)
    total_weights = sum(c.weight_bytes for i, c in costs.items() if fused.status.get(i) in ("runs", "fused"))
    cache_bytes = roofs.cache_mb * 1e6
    weights_cached = cache_bytes > 0 and total_weights <= cache_bytes
    dram = roofs.dram_gbs * 1e9
    cache = roofs.cache_gbs * 1e9
    out: dict[int, NodeEstimate] = {}
    for k in fused.kernels:
        out.update(_kernel_estimate(k, graph, costs, roofs, dram, cache, cache_bytes, weights_cached))
    for n in graph.nodes:
        if n.index not in out:
            c = costs[n.index]
            out[n.index] = NodeEstimate(n.name, n.op, c.op_class, c.precision, 0.0, 0.0, 0.0, 0.0, 0.0, "overhead",
                                        0.0, 0.0, 0.0, 0.0, 0.0, stage=n.stage, known=c.known,
                                        status=fused.status.get(n.index, "view"))
    return [out[n.index] for n in graph.nodes]


# What an INT8 engine keeps in float whatever it costs: normalizations, softmax, unknown ops.
_FLOAT_ONLY = ("normalization", "other")


def _implicit_int8_kernels(graph: Graph, fused: Fused, roofs: Roofs, prec: Precision) -> list[NodeEstimate]:
    """TensorRT's INT8 build of a float graph (calibrated, no Q/DQ): each kernel runs in INT8 or
    in the float precision, and where a tensor crosses between the two a reformat kernel reads
    and writes it. TensorRT picks the formats that make the whole engine fastest, reformats
    included; here: start from each kernel's faster precision on its own (a 3-channel stem, or a
    layer whose channels fill INT8's 32-wide tensor-core steps poorly, stays float), then flip
    kernels while that lowers the total with the reformats. Normalizations, softmax and unknown
    ops stay float. Each kernel's reformats are charged to it (``reformat_ms``)."""
    q_costs = _costs(graph, fused, prec)
    f_costs = _costs(graph, fused, Precision(prec.float_precision, "native"))
    total_weights = sum(c.weight_bytes for i, c in f_costs.items() if fused.status.get(i) in ("runs", "fused"))
    cache_bytes = roofs.cache_mb * 1e6
    weights_cached = cache_bytes > 0 and total_weights <= cache_bytes
    dram, cache = roofs.dram_gbs * 1e9, roofs.cache_gbs * 1e9
    owner = {n.index: i for i, k in enumerate(fused.kernels) for n in k.nodes}
    est: dict[str, list[dict[int, NodeEstimate]]] = {"int8": [], "float": []}
    for k in fused.kernels:
        est["int8"].append(_kernel_estimate(k, graph, q_costs, roofs, dram, cache, cache_bytes, weights_cached))
        est["float"].append(_kernel_estimate(k, graph, f_costs, roofs, dram, cache, cache_bytes, weights_cached))
    n_k = len(fused.kernels)
    time = {p: [est[p][i][k.head.index].time_ms for i, k in enumerate(fused.kernels)] for p in est}
    fixed = [est["float"][i][k.head.index].op_class in _FLOAT_ONLY for i, k in enumerate(fused.kernels)]
    # edges: (producer kernel or None for a graph input, consumer kernel or None for a graph output, ms to reformat)
    edges: list[tuple[int | None, int | None, float]] = []
    for i, k in enumerate(fused.kernels):
        for t, j in _kernel_inputs(k, graph, owner):
            edges.append((j, i, _reformat_ms(t, roofs)))
        for n in k.nodes:
            edges += [(i, None, _reformat_ms(t, roofs)) for t in n.outputs if t is not None and t.name in graph.outputs]
    touching: list[list[tuple[int | None, int | None, float]]] = [[] for _ in range(n_k)]
    for e in edges:
        for end in (e[0], e[1]):
            if end is not None:
                touching[end].append(e)
    pick = ["float" if fixed[i] or time["float"][i] <= time["int8"][i] else "int8" for i in range(n_k)]

    def side(x: int | None) -> str:
        return "float" if x is None else pick[x]

    def local(i: int) -> float:
        return time[pick[i]][i] + sum(ms for a, b, ms in touching[i] if side(a) != side(b))

    for _ in range(20):  # flip while it lowers the total (each pass visits every kernel once)
        changed = False
        for i in range(n_k):
            if fixed[i]:
                continue
            before = local(i)
            pick[i] = "int8" if pick[i] == "float" else "float"
            if local(i) < before - 1e-12:
                changed = True
            else:
                pick[i] = "int8" if pick[i] == "float" else "float"
        if not changed:
            break
    out: dict[int, NodeEstimate] = {}
    for i, k in enumerate(fused.kernels):
        chosen = est[pick[i]][i]
        extra = sum(ms for a, b, ms in edges if b == i and side(a) != side(b)) + \
            sum(ms for a, b, ms in edges if a == i and b is None and side(a) != "float")
        if extra:
            head = chosen[k.head.index]
            head.reformat_ms = extra
            head.time_ms += extra
        out.update(chosen)
    for n in graph.nodes:
        if n.index not in out:
            c = f_costs[n.index]
            out[n.index] = NodeEstimate(n.name, n.op, c.op_class, c.precision, 0.0, 0.0, 0.0, 0.0, 0.0, "overhead",
                                        0.0, 0.0, 0.0, 0.0, 0.0, stage=n.stage, known=c.known,
                                        status=fused.status.get(n.index, "view"))
    return [out[n.index] for n in graph.nodes]


def _kernel_inputs(k: Kernel, graph: Graph, owner: dict[int, int]) -> list[tuple[Any, int | None]]:
    """The activations a kernel reads from outside, each with the kernel that wrote it (looking
    through views; None for a graph input)."""
    inside = {n.index for n in k.nodes}
    seen: dict[str, int | None] = {}
    for n in k.nodes:
        for t in n.inputs:
            if t is None or t.const or t.name in seen or _made_inside(t.name, graph, inside):
                continue
            name, hops = t.name, 0
            p = graph.producer.get(name)
            while p is not None and p.index not in owner and hops < 64:  # a view: look through it
                ins = [x for x in p.inputs if x is not None and not x.const]
                p = graph.producer.get(ins[0].name) if ins else None
                hops += 1
            seen[t.name] = owner.get(p.index) if p is not None else None
    tensors = {t.name: t for n in k.nodes for t in n.inputs if t is not None}
    return [(tensors[name], j) for name, j in seen.items()]


def _reformat_ms(t: Any, roofs: Roofs) -> float:
    """A reformat kernel between INT8 and float: it reads the tensor in one precision (1 or 2 bytes
    an element) and writes it in the other, plus a kernel launch."""
    if not t.numel:
        return 0.0
    return (t.numel * 3.0 / (roofs.dram_gbs * 1e9 * roofs.memory_eff("data-movement", "int8"))
            + roofs.overhead_us * 1e-6) * 1e3


_COSTS: dict[tuple[int, int, Precision], tuple[Graph, Fused, dict[int, Any]]] = {}


def _costs(graph: Graph, fused: Fused, prec: Precision) -> dict[int, Any]:
    """Each node's cost (independent of the target's roofs, so kept for the next estimate
    of the same read graph)."""
    key = (id(graph), id(fused), prec)
    hit = _COSTS.get(key)
    if hit is not None and hit[0] is graph and hit[1] is fused:
        return hit[2]
    bits = tensor_bits(graph)
    for n in graph.nodes:  # a DequantizeLinear that runs (as written) writes its float output
        if n.op == "DequantizeLinear" and fused.status.get(n.index) == "runs":
            for t in n.outputs:
                if t is not None:
                    bits.pop(t.name, None)
    costs = {n.index: node_cost(n, bits, prec) for n in graph.nodes}
    while len(_COSTS) >= 32:
        _COSTS.pop(next(iter(_COSTS)))
    _COSTS[key] = (graph, fused, costs)
    return costs


def _kernel_estimate(k: Kernel, graph: Graph, costs: dict[int, Any], roofs: Roofs, dram: float, cache: float,
                     cache_bytes: float, weights_cached: bool) -> dict[int, NodeEstimate]:
    inside = {n.index for n in k.nodes}
    produced = {t.name for n in k.nodes for t in n.outputs if t is not None}
    reads: dict[str, float] = {}
    writes: dict[str, float] = {}
    for n in k.nodes:
        c = costs[n.index]
        for name, b in c.input_bytes.items():
            if k.keeps_intermediates or not _made_inside(name, graph, inside):
                reads[name] = b
        for name, b in c.output_bytes.items():
            if k.keeps_intermediates or _read_outside(name, graph, inside) or name in graph.outputs:
                writes[name] = b
    del produced
    weight = sum(costs[n.index].weight_bytes for n in k.nodes)
    ops = sum(costs[n.index].ops for n in k.nodes)
    head = costs[k.head.index]
    cls = "attention" if k.pattern == "attention" else head.op_class
    mem_eff = roofs.memory_eff(cls, head.precision)
    dram, cache = dram * mem_eff, cache * mem_eff
    memory_s = weight / (cache if weights_cached else dram)
    for b in [*reads.values(), *writes.values()]:
        memory_s += b / (cache if 0 < b <= cache_bytes / 2 else dram)
    compute_s = 0.0
    head_eff = 0.0
    for n in k.nodes:
        c = costs[n.index]
        if not c.ops:
            continue
        eff = roofs.class_eff(c.op_class, c.precision) * shape_factor(
            roofs, c.gemm, c.op_class == "depthwise-conv", c.precision, c.channels,
            dot_k(n) if c.precision == "int8" and roofs.kind == "cpu" else None)
        if n is k.head:
            head_eff = eff
        taps = c.gemm[3] if c.gemm and c.op_class == "depthwise-conv" else None  # depthwise: K = kh x kw
        compute_s += c.ops / (roofs.rate(c.op_class, c.precision, taps) * eff)
    if k.pattern == "attention":  # a fused attention kernel runs at the attention factor as a whole
        eff = roofs.class_eff("attention", head.precision)
        compute_s = ops / (roofs.peak(head.precision) * eff)
        head_eff = eff
    launches = 1 + k.reorder_in + k.reorder_out
    if k.reorder_in:  # layout copies of the blocked convolution: read and write its input / output again
        memory_s += 2 * sum(reads.values()) / dram
    if k.reorder_out:
        memory_s += 2 * sum(writes.values()) / dram
    overhead_s = roofs.overhead_us * 1e-6 * launches
    if head.gemm is not None and head.op_class in ("conv", "matmul") and roofs.eff.get("gemm_tail_us"):
        # a tensor-core product's pipeline fill and last partial wave: a fixed time beyond its throughput
        compute_s += float(roofs.eff["gemm_tail_us"]) * 1e-6
    time_s = max(compute_s, memory_s) + overhead_s
    act = sum(reads.values()) + sum(writes.values())
    bytes_ = act + weight
    crossover = roofs.peak(head.precision) / (roofs.dram_gbs * 1e9) if roofs.dram_gbs else 0.0
    bound = "overhead" if max(compute_s, memory_s) < overhead_s and not ops else \
        ("compute" if compute_s >= memory_s else "memory")
    out = {k.head.index: NodeEstimate(
        k.head.name, k.head.op, cls, head.precision, ops, weight, act, ops / bytes_ if bytes_ else 0.0, crossover,
        bound, compute_s * 1e3, memory_s * 1e3, overhead_s * 1e3, time_s * 1e3, head_eff,
        memory_efficiency=mem_eff, stage=k.head.stage,
        known=all(costs[n.index].known for n in k.nodes), quantized=head.precision in ("int8", "int4"),
        status="runs", kernel=k.pattern)}
    for n in k.nodes[1:]:
        c = costs[n.index]
        out[n.index] = NodeEstimate(n.name, n.op, c.op_class, c.precision, c.ops, c.weight_bytes, 0.0, 0.0, 0.0,
                                    "fused", 0.0, 0.0, 0.0, 0.0, 0.0, stage=n.stage, known=c.known,
                                    quantized=c.precision in ("int8", "int4"), status="fused", kernel=k.pattern)
    return out


def _made_inside(name: str, graph: Graph, inside: set[int]) -> bool:
    """Is a tensor produced inside the kernel (looking through views)?"""
    seen = 0
    while seen < 64:
        p = graph.producer.get(name)
        if p is None:
            return False
        if p.index in inside:
            return True
        ins = [t for t in p.inputs if t is not None and not t.const]
        if p.op not in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "DequantizeLinear", "Transpose",
                        "Concat", "Split", "Slice", "Cast") or len(ins) != 1:
            return False
        name = ins[0].name
        seen += 1
    return False


def _read_outside(name: str, graph: Graph, inside: set[int]) -> bool:
    todo, seen = [name], set()
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in graph.outputs:
            return True
        for c in graph.consumers.get(t, []):
            if c.index in inside:
                continue
            if c.op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"):
                todo += [o.name for o in c.outputs if o is not None]
            else:
                return True
    return False


def _graph_precision(nodes: list[NodeEstimate]) -> str | None:
    precs = {n.precision for n in nodes if n.status == "runs" and n.op_class in ("conv", "depthwise-conv", "matmul")}
    if "int4" in precs:
        return "int4"
    if "int8" in precs:
        return "int8"
    return None


def _group(nodes: list[NodeEstimate], key: str, total: float) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for n in nodes:
        if n.status != "runs":
            continue
        k = getattr(n, key) or "(graph)"
        g = groups.setdefault(k, {key: k, "count": 0, "time_ms": 0.0, "ops": 0.0, "bytes": 0.0,
                                  "weight_bytes": 0.0, "compute_ms": 0.0, "memory_ms": 0.0})
        g["count"] += 1
        g["time_ms"] += n.time_ms
        g["ops"] += n.ops
        g["bytes"] += n.bytes
        g["weight_bytes"] += n.weight_bytes
        g["compute_ms"] += n.compute_ms
        g["memory_ms"] += n.memory_ms
    out = sorted(groups.values(), key=lambda g: -g["time_ms"])
    for g in out:
        g["share"] = g["time_ms"] / total if total else 0.0
        g["bound"] = "compute" if g["compute_ms"] >= g["memory_ms"] else "memory"
        g["intensity"] = g["ops"] / g["bytes"] if g["bytes"] else 0.0
    return out


def _assemble(graph: Graph, fused: Fused, nodes: list[NodeEstimate], tgt: Target, roofs: Roofs, rt: str,
              precision: str | None, prec: Precision, batch: int, io_ms: float = 0.0,
              timing: str = "gpu-compute") -> Estimate:
    warnings = list(graph.warnings)
    notes: list[str] = []
    graph_precision = _graph_precision(nodes)
    if graph_precision and precision in (None, graph_precision):
        label = graph_precision
    elif graph_precision and precision in FLOAT_PRECISIONS:
        label = f"{graph_precision}+{precision}"  # a quantized graph whose float parts run in `precision`
    else:
        label = precision or prec.float_precision
    if precision == "int8" and graph_precision != "int8":
        notes.append("precision int8 on a float graph: every Conv/MatMul/Gemm is assumed to run INT8 with INT8 "
                     "activations (an upper bound on what INT8 buys)")
    if precision == "int4":
        notes.append("precision int4 on this graph: MatMul/Gemm weights are read as 4-bit (weight-only), compute "
                     f"and activations in {prec.float_precision}")
    unknown = Counter(n.op_type for n in nodes if not n.known and n.status == "runs")
    if unknown:
        warnings.append(f"{sum(unknown.values())} nodes of ops the estimator does not know were estimated as "
                        "memory-bound (bytes in and out only): "
                        + ", ".join(f"{op} x{c}" for op, c in sorted(unknown.items())))
    runs = [n for n in nodes if n.status == "runs"]
    kernels_ms = sum(n.time_ms for n in runs)
    total = kernels_ms + (io_ms if timing == "end-to-end" else 0.0)
    compute = sum(n.compute_ms for n in runs)
    memory = sum(n.memory_ms for n in runs)
    classes = _group(nodes, "op_class", total)
    mix = op_mix({c["op_class"]: c["time_ms"] for c in classes})
    cpu_kind = tgt.int8_kernel.name if tgt.int8_kernel is not None else None
    rng = estimate_range(total, tgt.name, tgt.kind, mix, cpu_kind=cpu_kind)
    dram = tgt.memory_bandwidth_gbs * 1e9
    crossover = {p: roofs.peak(p) / dram for p in tgt.precisions if dram > 0}
    return Estimate(
        model=graph.name, target=tgt.name, precision=label, batch=batch, dims=dict(graph.dims), total_ms=total,
        low_ms=rng.low_ms, high_ms=rng.high_ms, basis=rng.basis,
        ops=sum(n.ops for n in nodes if n.status in ("runs", "fused") and n.status == "runs"),
        weight_bytes=sum(n.weight_bytes for n in runs),
        activation_bytes=sum(n.activation_bytes for n in runs), compute_ms=compute, memory_ms=memory,
        overhead_ms=sum(n.overhead_ms for n in runs), io_ms=io_ms, bound="compute" if compute >= memory else "memory",
        crossover=crossover, peak_tops=dict(tgt.peak_tops), memory_bandwidth_gbs=tgt.memory_bandwidth_gbs,
        nodes=nodes, kernels=len(fused.kernels), fusions=dict(fused.counts), runtime=rt, op_mix=mix,
        op_types=_group(nodes, "op_type", total), op_classes=classes, stages=_group(nodes, "stage", total),
        unknown_ops=dict(unknown), efficiency=dict(roofs.eff), calibration=roofs.calibration, fuse=FUSION_MODELS[rt].fuses,
        warnings=warnings, notes=notes, timing=timing,
        timing_text=CPU_TIMING_TEXT if tgt.kind == "cpu" and not io_ms else TIMING_TEXT[timing],
        gpu_compute_ms=kernels_ms, end_to_end_ms=kernels_ms + io_ms,
        reformat_ms=sum(n.reformat_ms for n in runs), reformats=sum(1 for n in runs if n.reformat_ms))
