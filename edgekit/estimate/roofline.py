"""Roofline latency estimates per ONNX node for a target. An estimate, never a measurement.

For every node of the (shape-inferred) ONNX graph::

    ops   = FLOPs, or integer ops for int8/int4 nodes   (a multiply-accumulate is 2 ops)
    bytes = weights once, at the precision they are stored or run in (4 bits for
            MatMulNBits / int4 DequantizeLinear, 1 byte for int8), plus activations
            read and written, at the activation precision
    time  = max(ops / (peak[precision] * eff), bytes / (bandwidth * eff)) + kernel overhead

``eff`` is the fraction of peak a class of op reaches on the target (``conv``,
``depthwise-conv``, ``matmul``, ...; ``conv:int8`` for integer nodes; ``matmul@mem`` for
the bandwidth roof when fitted apart): defaults per target kind, the target YAML's
``efficiency``, then the factors fitted by ``edgekit estimate --calibrate`` (see
``calibrate.py``). A node is compute-bound when its arithmetic intensity (ops/byte)
is above the target's crossover, peak / bandwidth, for the node's precision.

Two readings of a graph:

* ``fuse=True`` (the default, for a model headed to an engine): constant sub-graphs are
  folded (so a DequantizeLinear of a constant int4 weight costs nothing and its
  consumer reads 4-bit weights), Q/DQ pairs on activations fuse into their neighbours
  (so a QDQ convolution reads and writes int8), and an activation, bias or batch-norm
  right after a Conv/MatMul/Gemm is fused into it, as TensorRT and ONNX Runtime do.
* ``fuse=False``, for a graph a runtime already optimized (ONNX Runtime's saved
  graph, used by calibration): every node runs as written.

>>> est = estimate("model.onnx", "jetson-agx-orin-64", precision="fp16")  # doctest: +SKIP
>>> print(est.render())  # doctest: +SKIP
"""
from __future__ import annotations

import ast
import dataclasses
import math
import os
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError

ESTIMATE_NOTE = "ESTIMATE (roofline model, not a measurement)"
FLOAT_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")
OP_CLASSES = ("conv", "depthwise-conv", "matmul", "attention", "elementwise", "normalization",
              "reduction", "data-movement", "other")

# Fraction of peak (compute and bandwidth) each op class reaches, before calibration.
# Generic a-priori figures for tuned kernels of each device kind, not fitted to any machine.
DEFAULT_EFFICIENCY: dict[str, dict[str, float]] = {
    "cpu": {"conv": 0.4, "depthwise-conv": 0.2, "matmul": 0.5, "attention": 0.3, "elementwise": 0.5,
            "normalization": 0.4, "reduction": 0.4, "data-movement": 0.5, "other": 0.3},
    "gpu": {"conv": 0.5, "depthwise-conv": 0.3, "matmul": 0.6, "attention": 0.4, "elementwise": 0.7,
            "normalization": 0.5, "reduction": 0.5, "data-movement": 0.6, "other": 0.3},
    "jetson": {"conv": 0.45, "depthwise-conv": 0.25, "matmul": 0.55, "attention": 0.35, "elementwise": 0.6,
               "normalization": 0.45, "reduction": 0.45, "data-movement": 0.5, "other": 0.3},
}

# --- op tables -------------------------------------------------------------------------------
CONV_OPS = {"Conv", "FusedConv", "ConvInteger", "QLinearConv", "ConvTranspose", "NhwcFusedConv"}
MATMUL_OPS = {"MatMul", "Gemm", "FusedMatMul", "MatMulNBits", "QLinearMatMul", "MatMulInteger",
              "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulFpQ4", "FusedGemm", "QGemm"}
ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                 "PackedMultiHeadAttention", "SparseAttention", "DecoderMaskedMultiHeadAttention"}
# op -> arithmetic ops per output element
ELEMENTWISE_OPS: dict[str, float] = {
    **dict.fromkeys(["Add", "Sub", "Mul", "Div", "Relu", "Neg", "Abs", "Max", "Min", "Mod", "Where", "Equal",
                     "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "Cast",
                     "CastLike", "Floor", "Ceil", "Round", "Sign", "Reciprocal", "IsNaN", "IsInf", "BitShift",
                     "PRelu", "LeakyRelu", "Clip", "Sum", "Mean", "BiasAdd", "QuantizeLinear",
                     "DequantizeLinear", "DynamicQuantizeLinear", "QLinearAdd", "QLinearMul",
                     "QLinearLeakyRelu", "ThresholdedRelu", "Shrink", "BitwiseAnd", "BitwiseOr",
                     "BitwiseNot", "BitwiseXor"], 1.0),
    **dict.fromkeys(["Sqrt", "Pow", "HardSigmoid", "HardSwish", "Selu", "Elu", "Celu", "Softplus",
                     "Softsign"], 4.0),
    **dict.fromkeys(["Exp", "Log", "Sigmoid", "Tanh", "Erf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan",
                     "Sinh", "Cosh", "Mish", "QLinearSigmoid", "QuickGelu"], 8.0),
    **dict.fromkeys(["Gelu", "FastGelu", "BiasGelu", "BiasFastGelu", "RotaryEmbedding"], 10.0),
}
NORMALIZATION_OPS: dict[str, float] = {
    "Softmax": 5.0, "LogSoftmax": 6.0, "LayerNormalization": 8.0, "SimplifiedLayerNormalization": 5.0,
    "SkipLayerNormalization": 9.0, "SkipSimplifiedLayerNormalization": 6.0, "RMSNormalization": 5.0,
    "BatchNormalization": 2.0, "InstanceNormalization": 8.0, "GroupNormalization": 8.0,
    "LpNormalization": 4.0, "MeanVarianceNormalization": 8.0, "EmbedLayerNormalization": 9.0,
}
REDUCTION_OPS = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                 "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "GlobalAveragePool", "GlobalMaxPool",
                 "QLinearGlobalAveragePool", "ArgMax", "ArgMin", "CumSum", "GlobalLpPool"}
POOL_OPS = {"MaxPool", "AveragePool", "LpPool", "QLinearAveragePool"}
DATA_OPS = {"Transpose", "Concat", "Slice", "Gather", "GatherElements", "GatherND", "Split", "Pad", "Expand",
            "Tile", "ScatterND", "ScatterElements", "Trilu", "Range", "DepthToSpace", "SpaceToDepth",
            "ReverseSequence", "OneHot", "NonZero", "TopK", "Resize", "Upsample", "QLinearConcat",
            "ConstantOfShape", "GatherBlockQuantized", "Col2Im", "CenterCropPad", "Compress",
            "ReorderInput", "ReorderOutput", "Memcpy", "MemcpyFromHost", "MemcpyToHost"}
# Metadata-only: no data moves in any engine.
VIEW_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout", "Shape", "Size", "Constant",
            "EyeLike", "Optional", "OptionalGetElement"}
# Fused into a preceding Conv/MatMul/Gemm by engines (with fuse=True).
EPILOGUE_OPS = {"Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Gelu", "FastGelu",
                "BatchNormalization", "Add", "Mul", "Sub", "Div", "PRelu", "Elu", "Selu"}
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}

_INT_TYPES = {"int8", "uint8", "int4", "uint4", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool"}
_ELEM_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 16: 16,
              17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4}
_ELEM_NAME = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
              10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16", 17: "float8",
              18: "float8", 19: "float8", 20: "float8", 21: "uint4", 22: "int4", 23: "float4"}
_FLOAT_ELEMS = {1, 10, 11, 16, 17, 18, 19, 20, 23}
_ACT_BYTES = {"fp32": 4.0, "tf32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}


# --- records ---------------------------------------------------------------------------------
@dataclass
class NodeEstimate:
    """One node's roofline estimate. Times are estimates in milliseconds."""

    name: str
    op_type: str
    op_class: str
    precision: str  # the node's compute precision ("int8", "fp16", ...), "int4" for 4-bit weights
    ops: float
    weight_bytes: float
    activation_bytes: float
    intensity: float  # ops / byte
    crossover: float  # the target's peak / bandwidth for this precision, ops / byte
    bound: str  # "compute" | "memory" | "overhead" (no work: only the kernel overhead)
    compute_ms: float
    memory_ms: float
    overhead_ms: float
    time_ms: float
    efficiency: float  # fraction of peak compute used for this node
    memory_efficiency: float = 0.0  # fraction of bandwidth used for this node
    stage: str = ""
    known: bool = True
    quantized: bool = False
    status: str = "runs"  # "runs" | "fused" (into a neighbour) | "folded" (constant) | "view"

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bytes"] = self.bytes
        return d


@dataclass
class Estimate:
    """Roofline estimate of one graph on one target. ``kind`` is always "estimate"."""

    model: str
    target: str
    precision: str
    batch: int
    dims: dict[str, int]
    total_ms: float
    ops: float
    weight_bytes: float
    activation_bytes: float
    compute_ms: float  # sum over nodes of their compute term
    memory_ms: float  # sum over nodes of their memory term
    overhead_ms: float
    bound: str  # "compute" | "memory": which term dominates the total
    crossover: dict[str, float]  # precision -> ops/byte
    peak_tops: dict[str, float]
    memory_bandwidth_gbs: float
    nodes: list[NodeEstimate]
    op_types: list[dict[str, Any]]
    op_classes: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    unknown_ops: dict[str, int]
    efficiency: dict[str, float]
    calibration: str | None  # the calibration file used, if any
    fuse: bool = True
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
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

    def to_profile(self) -> Any:
        """The estimate as a ``ProfileResult`` (``source="estimated"``) so ``check`` and
        ``report`` can read it; every percentile is the single estimated total."""
        from edgekit.profiling import LatencyStats, ProfileResult
        from edgekit.runtimes.base import NodeTiming

        t = self.total_ms
        stats = LatencyStats(min=t, mean=t, p50=t, p90=t, p95=t, p99=t, max=t, std=0.0, cv=0.0, count=0)
        nodes = [NodeTiming(n.name, n.op_type, n.time_ms, n.time_ms / t if t else 0.0, n.precision, n.quantized)
                 for n in self.top(50)]
        return ProfileResult(engine="", runtime="estimate", target=self.target, model=self.model,
                             settings={"precision": self.precision, "batch": self.batch, "dims": self.dims},
                             latency_ms=stats, throughput_per_s=1e3 * self.batch / t if t else 0.0, nodes=nodes,
                             op_types=self.op_types, total_nodes=sum(1 for n in self.nodes if n.status == "runs"),
                             quantized_nodes=sum(1 for n in self.nodes if n.quantized and n.status == "runs"),
                             warnings=[ESTIMATE_NOTE, *self.warnings], source="estimated")

    def render(self, top_k: int = 10) -> str:
        """A plain-text table for people."""
        lines = [f"{ESTIMATE_NOTE}: {self.model} on {self.target}, precision {self.precision}, batch {self.batch}"
                 + (f", dims {self.dims}" if self.dims else ""),
                 f"estimated latency {self.total_ms:.3f} ms ({self.bound}-bound overall): compute "
                 f"{self.compute_ms:.3f} ms, memory {self.memory_ms:.3f} ms, kernel overhead {self.overhead_ms:.3f} ms "
                 "(per node: max(compute, memory) + overhead)",
                 f"work: {self.ops / 1e9:.3f} G ops, weights {self.weight_bytes / 1e6:.2f} MB, activations "
                 f"{self.activation_bytes / 1e6:.2f} MB; bandwidth {self.memory_bandwidth_gbs:g} GB/s; crossover "
                 + ", ".join(f"{p} {c:.1f}" for p, c in self.crossover.items()) + " ops/byte",
                 f"efficiency: {'calibrated (' + self.calibration + ')' if self.calibration else 'defaults (not calibrated)'}",
                 "", f"{'op class':<16}{'nodes':>6}{'est ms':>10}{'share':>8}{'G ops':>9}{'MB':>9}  bound"]
        for r in self.op_classes:
            lines.append(f"{r['op_class']:<16}{r['count']:>6}{r['time_ms']:>10.3f}{r['share']:>8.1%}"
                         f"{r['ops'] / 1e9:>9.3f}{r['bytes'] / 1e6:>9.2f}  {r['bound']}")
        lines += ["", f"top {top_k} nodes (estimated):",
                  f"{'node':<44}{'op':<18}{'prec':<6}{'est ms':>9}{'ops/B':>9}  bound"]
        for n in self.top(top_k):
            lines.append(f"{n.name[:43]:<44}{n.op_type[:17]:<18}{n.precision:<6}{n.time_ms:>9.4f}"
                         f"{n.intensity:>9.1f}  {n.bound}")
        if self.stages and len(self.stages) > 1:
            lines += ["", "stages (estimated):"]
            for s in self.stages[:12]:
                lines.append(f"  {s['stage'][:40]:<42}{s['time_ms']:>9.3f} ms {s['share']:>7.1%}")
        for w in self.warnings:
            lines.append(f"warning: {w}")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)


# --- graph loading and shape inference ----------------------------------------------------------
def load_graph(model_or_onnx: Any, export_dir: str | os.PathLike[str] | None = None) -> tuple[Any, str]:
    """(onnx.ModelProto without external weight data, display name) from an ONNX file, an
    edgekit folder (onnx, engine or model artifact), a model spec or a ``ModelHandle``."""
    import onnx

    if isinstance(model_or_onnx, onnx.ModelProto):
        return model_or_onnx, model_or_onnx.graph.name or "model"
    text = str(model_or_onnx) if isinstance(model_or_onnx, (str, os.PathLike)) else None
    if text is not None:
        path = Path(text)
        if path.is_dir() and (path / "manifest.json").is_file():
            from edgekit.artifact import read_manifest

            m = read_manifest(path)
            for role in ("onnx", "model"):
                if role in m.files and str(m.files[role]).endswith(".onnx"):
                    return _load_onnx(path / m.files[role]), m.model.get("name") or path.name
        if text.endswith(".onnx"):
            name = path.stem
            if (path.parent / "manifest.json").is_file():  # a file inside an edgekit folder: its model's name
                try:
                    from edgekit.artifact import read_manifest

                    name = read_manifest(path.parent).model.get("name") or name
                except Exception:
                    pass
            return _load_onnx(path), name
    from edgekit.sources.models import load_model

    handle = load_model(model_or_onnx)
    if handle.onnx_path is not None:
        return _load_onnx(handle.onnx_path), handle.name
    from edgekit.export.onnx import export_onnx

    with tempfile.TemporaryDirectory(prefix="edgekit-estimate-") as tmp:
        out = export_onnx(handle, Path(export_dir or tmp) / "onnx")
        path = Path(out)
        if path.is_dir():
            from edgekit.artifact import read_manifest

            path = read_manifest(path).path_of(path, "onnx")
        return _load_onnx(path), handle.name


_GRAPH_CACHE: dict[tuple[str, int, int], Any] = {}  # (path, size, mtime) -> ModelProto; the last two


def _load_onnx(path: str | os.PathLike[str]) -> Any:
    import onnx

    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"ONNX file {str(p)!r} does not exist")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key in _GRAPH_CACHE:  # estimating one graph for many targets reads and parses it once
        return _GRAPH_CACHE[key]
    try:
        proto = onnx.load(str(p), load_external_data=False)
        while len(_GRAPH_CACHE) >= 2:
            _GRAPH_CACHE.pop(next(iter(_GRAPH_CACHE)))
        _GRAPH_CACHE[key] = proto
        return proto
    except Exception as e:
        raise BadInputError(f"{p} is not a valid ONNX model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


@dataclass
class _Tensor:
    shape: tuple[int, ...] | None
    elem: int  # onnx TensorProto elem type

    @property
    def numel(self) -> float:
        return float(math.prod(self.shape)) if self.shape is not None else 0.0


def _shape_of(type_proto: Any) -> tuple[tuple[int, ...] | None, int]:
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return None, tt.elem_type
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            return None, tt.elem_type
    return tuple(dims), tt.elem_type


def infer_shapes(model: Any, batch: int = 1, dims: dict[str, int] | None = None) -> tuple[Any, dict[str, _Tensor], dict[str, int], list[str]]:
    """Bind the dynamic input dims (axis 0 -> ``batch``; named dims from ``dims``; others
    1, reported) and run ONNX shape inference, with edgekit's own rules for the ONNX
    Runtime contrib ops onnx does not know (MatMulNBits, FusedConv, QLinearAdd, ...).
    Returns (inferred model, tensor table, bound dims, warnings)."""
    import onnx

    dims = dict(dims or {})
    # Large weights are not needed for shapes: copy the model without them (keep dims), so
    # the copy and every re-inference stay small; the caller's model is left as it was.
    stash: dict[int, bytes] = {}
    for i, init in enumerate(model.graph.initializer):
        if init.raw_data and len(init.raw_data) > 4096:
            stash[i] = init.raw_data
            init.ClearField("raw_data")
    m = onnx.ModelProto()
    try:
        m.CopyFrom(model)
    finally:
        for i, raw in stash.items():
            model.graph.initializer[i].raw_data = raw
    for i in stash:
        init = m.graph.initializer[i]
        init.data_location = onnx.TensorProto.EXTERNAL
        del init.external_data[:]
        init.external_data.add(key="location", value="__edgekit_dropped__")
    del m.graph.value_info[:]
    inits = {i.name for i in m.graph.initializer}
    bound: dict[str, int] = {}
    warnings: list[str] = []
    assumed: set[str] = set()
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        for ax, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                if ax == 0 and batch != 1 and d.dim_value == 1 and "batch" not in dims:
                    warnings.append(f"input {vi.name!r} has a static batch of 1; estimated at batch 1, not {batch}")
                continue
            name = d.dim_param or f"{vi.name}_dim{ax}"
            if name in dims:
                value = int(dims[name])
            elif ax == 0 or name.lower() in ("batch", "batch_size", "n"):
                value = batch
            else:
                value = 1
                assumed.add(name)
            d.ClearField("dim_param")
            d.dim_value = value
            bound[name] = value
    for o in m.graph.output:  # outputs get re-inferred; stale symbolic dims only confuse merging
        if o.type.tensor_type.HasField("shape"):
            o.type.tensor_type.ClearField("shape")
    if assumed:
        warnings.append(f"dynamic dims {sorted(assumed)} were set to 1; pass dims (CLI: --dim NAME=VALUE) to change")
    _fold_small_constants(m, {})
    table: dict[str, _Tensor] = {}
    failed = False
    for _ in range(16):
        try:
            m = onnx.shape_inference.infer_shapes(m, data_prop=True)
        except Exception as e:  # inference errors on exotic graphs: keep what we have
            if not failed:
                warnings.append(f"ONNX shape inference failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                                "shapes from edgekit's own rules only")
            failed = True
        table = _tensor_table(m)
        added = _infer_missing(m, table)
        folded = _fold_small_constants(m, table)  # shape arithmetic that needed inferred shapes
        if not added and not folded:
            break
    return m, table, bound, warnings


_FOLD_LIMIT = 1 << 16  # elements: shape arithmetic, pads, small constants; never weights


def _fold_small_constants(m: Any, table: dict[str, _Tensor]) -> int:
    """Evaluate small all-constant nodes (pads, shapes computed from constants) with
    onnx's reference implementation and replace them by Constant nodes of the same name,
    so shape inference sees their values (exporters compute e.g. Pad's pads this way)."""
    import onnx
    from onnx import helper, numpy_helper

    try:
        from onnx.reference import ReferenceEvaluator
    except ImportError:  # pragma: no cover - onnx < 1.13
        return 0
    values: dict[str, Any] = {}
    for init in m.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and math.prod(init.dims) <= _FOLD_LIMIT:
            try:
                values[init.name] = numpy_helper.to_array(init)
            except Exception:
                continue
    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 17)
    folded = 0
    new_nodes = []
    for node in m.graph.node:
        ins = [i for i in node.input if i]
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and ins and \
                table.get(ins[0]) is not None and table[ins[0]].shape is not None:
            import numpy as np

            shape = list(table[ins[0]].shape)
            if node.op_type == "Size":
                arr = np.array(math.prod(shape), dtype=np.int64)
            else:
                start, end = _attr(node, "start", 0), _attr(node, "end", None)
                arr = np.array(shape[start:end], dtype=np.int64)
            values[node.output[0]] = arr
            new_nodes.append(helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                              value=numpy_helper.from_array(arr, node.output[0])))
            folded += 1
            continue
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            tv = next((a.t for a in node.attribute if a.name == "value"), None)
            if tv is not None:
                if math.prod(tv.dims) <= _FOLD_LIMIT:
                    values[node.output[0]] = numpy_helper.to_array(tv)
                new_nodes.append(node)
                continue
            try:
                ref = ReferenceEvaluator(helper.make_model(helper.make_graph([node], "c", [], [
                    helper.make_tensor_value_info(node.output[0], onnx.TensorProto.UNDEFINED, None)]),
                    opset_imports=[helper.make_opsetid("", opset)]))
                v = ref.run(None, {})[0]
                if v.size <= _FOLD_LIMIT:
                    values[node.output[0]] = v
            except Exception:
                pass
            new_nodes.append(node)
            continue
        if (node.domain not in ("", "ai.onnx") or not ins or not all(i in values for i in ins)
                or node.op_type.startswith("Random") or node.op_type in ("If", "Loop", "Scan")):
            new_nodes.append(node)
            continue
        try:
            graph = helper.make_graph([node], "f", [helper.make_tensor_value_info(i, helper.np_dtype_to_tensor_dtype(
                values[i].dtype), values[i].shape) for i in dict.fromkeys(ins)],
                [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in node.output if o])
            ref = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))
            outs = ref.run(None, {i: values[i] for i in dict.fromkeys(ins)})
        except Exception:
            new_nodes.append(node)
            continue
        # Only shape-like results (integers, or a few values): folding a weight would lose
        # the precision it is stored in (a DequantizeLinear of int4 codes stays a node).
        if node.op_type in QDQ_OPS or any(getattr(o, "size", _FOLD_LIMIT + 1) > _FOLD_LIMIT or (
                getattr(o, "dtype", None) is not None and o.dtype.kind == "f" and o.size > 64) for o in outs):
            new_nodes.append(node)
            continue
        for name, v in zip([o for o in node.output if o], outs, strict=False):
            import numpy as np

            arr = np.asarray(v)
            values[name] = arr
            new_nodes.append(helper.make_node("Constant", [], [name], name=node.name if len(node.output) == 1
                                              else f"{node.name}:{name}", value=numpy_helper.from_array(arr, name)))
        folded += 1
    if folded:
        del m.graph.node[:]
        m.graph.node.extend(new_nodes)
    return folded


def _tensor_table(m: Any) -> dict[str, _Tensor]:
    table: dict[str, _Tensor] = {}
    for init in m.graph.initializer:
        table[init.name] = _Tensor(tuple(int(x) for x in init.dims), init.data_type)
    for vi in list(m.graph.input) + list(m.graph.value_info) + list(m.graph.output):
        if vi.name in table and table[vi.name].shape is not None:
            continue
        shape, elem = _shape_of(vi.type)
        if shape is not None or vi.name not in table:
            table[vi.name] = _Tensor(shape, elem)
    for node in m.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    table[node.output[0]] = _Tensor(tuple(int(x) for x in a.t.dims), a.t.data_type)
    return table


def _attr(node: Any, name: str, default: Any = None) -> Any:
    import onnx

    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(s) for s in shapes)
    out = []
    for i in range(n):
        vals = [s[len(s) - n + i] for s in shapes if len(s) - n + i >= 0]
        out.append(max(vals))
    return tuple(out)


def _conv_shape(node: Any, x: tuple[int, ...], w: tuple[int, ...]) -> tuple[int, ...] | None:
    spatial = len(x) - 2
    if spatial < 1 or len(w) != len(x):
        return None
    k = _attr(node, "kernel_shape") or list(w[2:])
    strides = _attr(node, "strides") or [1] * spatial
    dil = _attr(node, "dilations") or [1] * spatial
    pads = _attr(node, "pads") or [0] * (2 * spatial)
    auto = _attr(node, "auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    out = [x[0], w[0]]
    for i in range(spatial):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-x[2 + i] // strides[i]))
        else:
            eff_k = dil[i] * (k[i] - 1) + 1
            out.append((x[2 + i] + pads[i] + pads[i + spatial] - eff_k) // strides[i] + 1)
    return tuple(out)


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...], trans_a: bool = False, trans_b: bool = False) -> tuple[int, ...]:
    if trans_a and len(a) >= 2:
        a = (*a[:-2], a[-1], a[-2])
    if trans_b and len(b) >= 2:
        b = (*b[:-2], b[-1], b[-2])
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return (*b[:-2], b[-1])
    return (*_broadcast(a[:-2], b[:-2]), a[-2], b[-1])


def _contrib_shape(node: Any, ins: list[_Tensor | None]) -> list[tuple[tuple[int, ...], int]] | None:
    """Output (shape, elem) for the ops onnx's shape inference does not know."""
    def s(i: int) -> tuple[int, ...] | None:
        return ins[i].shape if i < len(ins) and ins[i] is not None else None

    def e(i: int) -> int:
        return ins[i].elem if i < len(ins) and ins[i] is not None else 1

    op = node.op_type
    if s(0) is None:
        return None
    if node.domain == "com.microsoft.nchwc":  # ONNX Runtime's blocked-layout CPU kernels (level "all")
        if op == "Conv" and s(1) is not None:
            shape = _conv_shape(node, s(0), s(1))
            return [(shape, e(0))] if shape else None
        if op == "ReorderOutput":
            x = s(0)
            ch = int(_attr(node, "channels", x[1]))
            if _attr(node, "channels_last", 0):
                return [((x[0], *x[2:], ch), e(0))]
            return [((x[0], ch, *x[2:]), e(0))]
        if op in ("MaxPool", "AveragePool"):
            k = _attr(node, "kernel_shape") or [1, 1]
            shape = _conv_shape(node, s(0), (s(0)[1], 1, *k))
            return [(shape, e(0))] if shape else None
        if op in ("GlobalAveragePool", "GlobalMaxPool"):
            return [((*s(0)[:2], *([1] * (len(s(0)) - 2))), e(0))]
        if op == "Upsample":
            scales = _attr(node, "scales") or [1] * (len(s(0)) - 2)
            return [((*s(0)[:2], *(d * int(f) for d, f in zip(s(0)[2:], scales, strict=False))), e(0))]
        return [(s(0), e(0))]  # ReorderInput and the rest keep the logical shape
    if op == "MatMulNBits":
        return [((*s(0)[:-1], int(_attr(node, "N"))), e(0))]
    if op in ("QLinearConv", "NhwcConv", "FusedConv") and _attr(node, "channels_last", 0) and len(s(0)) >= 3:
        wi = 3 if op == "QLinearConv" else 1
        if s(wi) is None:
            return None
        x = s(0)
        nchw = _conv_shape(node, (x[0], x[-1], *x[1:-1]), s(wi))  # ORT's NHWC kernels keep OIHW weights
        return [((nchw[0], *nchw[2:], nchw[1]), e(0))] if nchw else None
    if op == "QLinearConv" and s(3) is not None:
        shape = _conv_shape(node, s(0), s(3))
        return [(shape, e(0))] if shape else None
    if op in ("FusedConv", "NhwcFusedConv") and s(1) is not None:
        shape = _conv_shape(node, s(0), s(1))
        return [(shape, e(0))] if shape else None
    if op in ("FusedMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul") and s(1) is not None:
        shape = _matmul_shape(s(0), s(1), bool(_attr(node, "transA", 0)), bool(_attr(node, "transB", 0)))
        return [(shape, 1)]
    if op in ("QLinearAdd", "QLinearMul") and s(3) is not None:
        return [(_broadcast(s(0), s(3)), e(0))]
    if op == "QLinearGlobalAveragePool":
        x = s(0)
        if _attr(node, "channels_last", 0):
            return [((x[0], *([1] * (len(x) - 2)), x[-1]), e(0))]
        return [((x[0], x[1], *([1] * (len(x) - 2))), e(0))]
    if op == "DynamicQuantizeLinear":
        return [(s(0), 2), ((), 1), ((), 2)]
    if op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
        return [(s(0), e(0)), ((*s(0)[:-1], 1), 1), ((*s(0)[:-1], 1), 1), (s(0), e(0))][: len(node.output)]
    if op in ("SimplifiedLayerNormalization", "LayerNormalization"):
        return [(s(0), e(0)), ((*s(0)[:-1], 1), 1), ((*s(0)[:-1], 1), 1)][: len(node.output)]
    if _onnx_knows(node):
        return None  # standard ops: onnx's inference is authoritative (it fills them once inputs are known)
    if op in ("BiasGelu", "BiasAdd", "BiasFastGelu") and all(x is not None and x.shape is not None for x in ins if x):
        return [(_broadcast(*[x.shape for x in ins if x is not None]), e(0))]
    if op in ELEMENTWISE_OPS or op in ("QLinearSigmoid", "QLinearLeakyRelu", "RotaryEmbedding", "FastGelu", "Gelu",
                                       "QuickGelu", "QLinearSoftmax"):
        return [(s(0), e(0))] * len(node.output)
    if op in ("GroupQueryAttention", "MultiHeadAttention", "Attention") and len(s(0)) == 3:
        hidden = s(0)[2]
        nh = _attr(node, "num_heads")
        if op == "GroupQueryAttention" and nh and s(1) is not None and s(2) is not None:
            pass  # packed or separate qkv: output hidden = num_heads * head_size
        if op == "Attention" and s(1) is not None and len(s(1)) == 2:
            hidden = s(1)[1] // 3
        return [((*s(0)[:2], hidden), e(0))]
    return None


def _onnx_knows(node: Any) -> bool:
    import onnx

    try:
        return node.domain in ("", "ai.onnx") and onnx.defs.has(node.op_type, "")
    except Exception:  # pragma: no cover
        return False


def _small_values(m: Any) -> dict[str, Any]:
    """Values of small constants (initializers with data, Constant nodes): for data propagation."""
    from onnx import numpy_helper

    vals: dict[str, Any] = {}
    for init in m.graph.initializer:
        if init.raw_data or init.int64_data or init.int32_data or init.float_data:
            if math.prod(init.dims) <= _FOLD_LIMIT:
                vals[init.name] = init
    for node in m.graph.node:
        if node.op_type == "Constant":
            tv = next((a.t for a in node.attribute if a.name == "value"), None)
            if tv is not None and math.prod(tv.dims) <= _FOLD_LIMIT:
                t = numpy_helper.from_array(numpy_helper.to_array(tv), node.output[0])
                vals[node.output[0]] = t
    return vals


def _infer_node(node: Any, ins: list[_Tensor | None], opset: int, values: dict[str, Any]) -> list[tuple[tuple[int, ...], int]] | None:
    """One standard node's output shapes with onnx's own per-node inference."""
    import onnx
    from onnx import helper

    if not all(t is not None and t.shape is not None for t, name in zip(ins, node.input, strict=False) if name):
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, max_inclusive_version=opset, domain="")
        types = {name: helper.make_tensor_type_proto(t.elem, list(t.shape))
                 for t, name in zip(ins, node.input, strict=False) if name and t is not None}
        data = {name: values[name] for name in node.input if name in values}
        outs = onnx.shape_inference.infer_node_outputs(schema, node, types, data)
    except Exception:
        return None
    result = []
    for o in node.output:
        if not o or o not in outs:
            return None
        shape, elem = _shape_of(outs[o])
        if shape is None:
            return None
        result.append((shape, elem))
    return result


def _propagate_value(node: Any, ins: list[_Tensor | None], outs: list[tuple[tuple[int, ...], int]],
                     values: dict[str, Any], opset: int) -> None:
    """Values of shape arithmetic as the walk goes: Shape of a known shape, and small
    integer nodes whose inputs all have values (evaluated with onnx's reference)."""
    import numpy as np
    from onnx import helper, numpy_helper

    if node.op_type == "Shape" and ins and ins[0] is not None and ins[0].shape is not None:
        start, end = _attr(node, "start", 0), _attr(node, "end", None)
        values[node.output[0]] = numpy_helper.from_array(np.array(list(ins[0].shape)[start:end], np.int64),
                                                         node.output[0])
        return
    names = [i for i in node.input if i]
    if (not names or not all(i in values for i in names) or node.op_type in QDQ_OPS
            or any(math.prod(shape) > _FOLD_LIMIT or elem in _FLOAT_ELEMS for shape, elem in outs)):
        return
    try:
        from onnx.reference import ReferenceEvaluator

        arrays = {i: numpy_helper.to_array(values[i]) for i in dict.fromkeys(names)}
        graph = helper.make_graph([node], "v", [helper.make_tensor_value_info(i, values[i].data_type, a.shape)
                                                for i, a in arrays.items()],
                                  [helper.make_tensor_value_info(o, elem, list(shape))
                                   for o, (shape, elem) in zip(node.output, outs, strict=False)])
        got = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])).run(
            None, arrays)
    except Exception:
        return
    for o, v in zip(node.output, got, strict=False):
        values[o] = numpy_helper.from_array(np.asarray(v), o)


def _infer_missing(m: Any, table: dict[str, _Tensor]) -> int:
    """Walk the graph once in order, filling missing output shapes (contrib ops by edgekit's
    rules, standard ops by onnx's per-node inference, so one unknown op does not stall the
    rest), into ``m.graph.value_info``; return how many were added."""
    import onnx

    opset = next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 17)
    values = _small_values(m)
    added = 0
    for node in m.graph.node:
        if not node.output or all(table.get(o) is not None and table[o].shape is not None for o in node.output if o):
            continue
        ins = [table.get(i) if i else None for i in node.input]
        outs = _infer_node(node, ins, opset, values) if _onnx_knows(node) else _contrib_shape(node, ins)
        if not outs:
            continue
        _propagate_value(node, ins, outs, values, opset)
        for name, (shape, elem) in zip(node.output, outs, strict=False):
            if not name or shape is None or (table.get(name) is not None and table[name].shape is not None):
                continue
            vi = onnx.helper.make_tensor_value_info(name, elem, list(shape))
            m.graph.value_info.append(vi)
            table[name] = _Tensor(tuple(shape), elem)
            added += 1
    return added


# --- the estimate ---------------------------------------------------------------------------------
def _elem_bits(elem: int) -> int:
    return _ELEM_BITS.get(elem, 32)


def _precision_of_elem(elem: int) -> str:
    return {21: "int4", 22: "int4", 2: "int8", 3: "int8", 10: "fp16", 16: "bf16", 17: "fp8", 18: "fp8",
            19: "fp8", 20: "fp8"}.get(elem, "fp32")


def op_class(op_type: str, node: Any = None, table: dict[str, _Tensor] | None = None) -> str:
    """The efficiency class of an op: conv, depthwise-conv, matmul, attention, elementwise,
    normalization, reduction, data-movement or other (unknown ops)."""
    if op_type in CONV_OPS:
        if node is not None and table is not None and _is_depthwise(node, table):
            return "depthwise-conv"
        return "conv"
    if op_type in MATMUL_OPS:
        return "matmul"
    if op_type in ATTENTION_OPS:
        return "attention"
    if op_type in ELEMENTWISE_OPS:
        return "elementwise"
    if op_type in NORMALIZATION_OPS:
        return "normalization"
    if op_type in REDUCTION_OPS or op_type in POOL_OPS:
        return "reduction"
    if op_type in DATA_OPS or op_type in VIEW_OPS:
        return "data-movement"
    return "other"


def _conv_io(node: Any) -> tuple[int, int]:
    """(activation input index, weight input index) of a conv-like node."""
    return (0, 3) if node.op_type == "QLinearConv" else (0, 1)


def _is_depthwise(node: Any, table: dict[str, _Tensor]) -> bool:
    group = int(_attr(node, "group", 1) or 1)
    if group <= 1:
        return False
    xi, wi = _conv_io(node)
    w = table.get(node.input[wi]) if len(node.input) > wi else None
    return w is not None and w.shape is not None and len(w.shape) > 1 and w.shape[1] == 1


def _node_ops(node: Any, ins: list[_Tensor | None], outs: list[_Tensor | None]) -> tuple[float, bool]:
    """(arithmetic ops, known op) for one node."""
    op = node.op_type
    out = outs[0] if outs and outs[0] is not None else None
    out_n = out.numel if out is not None else 0.0

    def shp(i: int) -> tuple[int, ...] | None:
        return ins[i].shape if i < len(ins) and ins[i] is not None else None

    if op in CONV_OPS:
        xi, wi = _conv_io(node)
        w = shp(wi)
        if w is None or out is None:
            return 0.0, True
        if op == "ConvTranspose":
            x = shp(xi)
            return (2.0 * math.prod(x) * math.prod(w[1:]) if x else 0.0), True
        return 2.0 * out_n * math.prod(w[1:]), True  # MACs per output = C/g * prod(k)
    if op in MATMUL_OPS:
        if op == "MatMulNBits":
            a = shp(0)
            k = int(_attr(node, "K", a[-1] if a else 0))
            n = int(_attr(node, "N", 0))
            return (2.0 * (math.prod(a[:-1]) if a else 1) * k * n), True
        a_idx = 0
        a = shp(a_idx)
        if a is None or out is None:
            return 0.0, True
        trans_a = bool(_attr(node, "transA", 0))
        k = a[-2] if (trans_a and len(a) >= 2) else a[-1]
        return 2.0 * out_n * k, True
    if op in ATTENTION_OPS:
        q = shp(0)
        if q is None or out is None:
            return 0.0, True
        # scores and weighted sum: 2 matmuls of (S_q x S_kv x hidden); S_kv from key or past
        s_kv = q[1] if len(q) >= 2 else 1
        for i in (1, 3):  # key, past_key
            k = shp(i)
            if k is not None and len(k) >= 3:
                s_kv = max(s_kv, k[-2] if len(k) == 4 else k[1])
        hidden = out.shape[-1] if out.shape else 1
        return 4.0 * math.prod(q[:2]) * s_kv * hidden, True
    if op in ELEMENTWISE_OPS:
        return ELEMENTWISE_OPS[op] * out_n, True
    if op in NORMALIZATION_OPS:
        return NORMALIZATION_OPS[op] * out_n, True
    if op in POOL_OPS:
        k = _attr(node, "kernel_shape") or [1]
        return out_n * math.prod(k), True
    if op in REDUCTION_OPS:
        x = shp(0)
        return (float(math.prod(x)) if x else out_n), True
    if op in ("Resize", "Upsample"):
        return 4.0 * out_n, True
    if op in DATA_OPS or op in VIEW_OPS:
        return 0.0, True
    return 0.0, False


@dataclass
class _Ctx:
    float_precision: str  # precision of float activations and float compute
    mode: str  # "native" | "int8" (simulate full int8) | "int4" (simulate int4 weight-only matmuls)


def _act_bytes_per_elem(elem: int, ctx: _Ctx) -> float:
    if elem in _FLOAT_ELEMS:
        if ctx.mode == "int8":
            return 1.0
        return _ACT_BYTES.get(ctx.float_precision, 4.0)
    return _elem_bits(elem) / 8.0


def estimate(model_or_onnx: Any, target: Any, precision: str | None = None, batch: int = 1, *,
             dims: dict[str, int] | None = None, fuse: bool = True, efficiency: dict[str, float] | None = None,
             kernel_overhead_us: float | None = None, calibrated: bool = True) -> Estimate:
    """Roofline estimate of a model on a target, per node and in total.

    ``model_or_onnx``: an ONNX file, an edgekit folder, a model spec, a ``ModelHandle``
    or an ``onnx.ModelProto``. ``precision``: the engine's precision (default: the
    graph's own, fp32 for float graphs); ``int8`` on a float graph assumes every layer
    runs INT8, ``int4`` assumes 4-bit weight-only MatMul/Gemm. ``dims`` binds named
    dynamic axes (e.g. ``{"past_sequence_length": 128}``). ``efficiency`` overrides the
    fitted/default factors; ``calibrated=False`` ignores a saved calibration.

    >>> est = estimate("model.onnx", "cpu")  # doctest: +SKIP
    >>> est.total_ms, est.bound  # doctest: +SKIP
    """
    from edgekit.targets import PRECISIONS, load_target

    tgt = load_target(target)
    if batch < 1:
        raise BadInputError(f"batch must be >= 1, got {batch}")
    if precision is not None:
        if precision not in PRECISIONS:
            raise BadInputError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
        tgt.require_precision(precision)
    proto, name = load_graph(model_or_onnx)
    m, table, bound_dims, warnings = _inferred(proto, batch, dims)
    eff, cal_path, overhead_us = resolve_efficiency(tgt, calibrated=calibrated)
    if efficiency:
        eff.update(efficiency)
    if kernel_overhead_us is not None:
        overhead_us = kernel_overhead_us
    if precision in (None, "int4"):
        float_precision = "fp32" if "fp32" in tgt.precisions or not tgt.precisions else _first_float(tgt)
        if precision == "int4" and "fp16" in tgt.precisions and tgt.kind != "cpu":
            float_precision = "fp16"  # GPUs run weight-only int4 with fp16 activations
    elif precision == "int8":
        float_precision = "fp16" if ("fp16" in tgt.precisions and tgt.kind != "cpu") else "fp32"
    else:
        float_precision = precision
    ctx = _Ctx(float_precision, {"int8": "int8", "int4": "int4"}.get(precision or "", "native"))
    nodes, notes = _estimate_nodes(m, table, tgt, ctx, eff, overhead_us, fuse, warnings)
    graph_precision = _graph_precision(nodes)
    if graph_precision and precision in (None, graph_precision):
        label = graph_precision
    elif graph_precision and precision in FLOAT_PRECISIONS:
        label = f"{graph_precision}+{precision}"  # a quantized graph whose float parts run in `precision`
    else:
        label = precision or float_precision
    if precision == "int8" and graph_precision != "int8":
        notes.append("precision int8 on a float graph: every Conv/MatMul/Gemm is assumed to run INT8 with INT8 "
                     "activations (an upper bound on what INT8 buys)")
    if precision == "int4":
        notes.append("precision int4 on this graph: MatMul/Gemm weights are read as 4-bit (weight-only), compute "
                     f"and activations in {float_precision}")
    shapeless = Counter(node.op_type for node in m.graph.node
                        if any(o and (table.get(o) is None or table[o].shape is None) for o in node.output)
                        and node.op_type not in ("Constant",))
    if shapeless:
        warnings.append(f"{sum(shapeless.values())} nodes have outputs of unknown shape (their ops and bytes are "
                        "undercounted): " + ", ".join(f"{op} x{c}" for op, c in shapeless.most_common(8)))
    unknown = Counter(n.op_type for n in nodes if not n.known)
    if unknown:
        warnings.append(f"{sum(unknown.values())} nodes of ops the estimator does not know were estimated as "
                        f"memory-bound (bytes in and out only): "
                        + ", ".join(f"{op} x{c}" for op, c in sorted(unknown.items())))
    total = sum(n.time_ms for n in nodes)
    compute = sum(n.compute_ms for n in nodes)
    memory = sum(n.memory_ms for n in nodes)
    overhead = sum(n.overhead_ms for n in nodes)
    crossover = {p: _peak(tgt, p) / (tgt.memory_bandwidth_gbs * 1e9) for p in tgt.precisions
                 if _peak(tgt, p) > 0 and tgt.memory_bandwidth_gbs > 0}
    return Estimate(
        model=name, target=tgt.name, precision=label, batch=batch, dims=bound_dims, total_ms=total,
        ops=sum(n.ops for n in nodes), weight_bytes=sum(n.weight_bytes for n in nodes),
        activation_bytes=sum(n.activation_bytes for n in nodes), compute_ms=compute, memory_ms=memory,
        overhead_ms=overhead, bound="compute" if compute >= memory else "memory", crossover=crossover,
        peak_tops=dict(tgt.peak_tops), memory_bandwidth_gbs=tgt.memory_bandwidth_gbs, nodes=nodes,
        op_types=_group(nodes, "op_type", total), op_classes=_group(nodes, "op_class", total),
        stages=_group(nodes, "stage", total), unknown_ops=dict(unknown), efficiency=eff, calibration=cal_path,
        fuse=fuse, warnings=warnings, notes=notes)


_SHAPE_CACHE: dict[tuple[int, int, tuple[tuple[str, int], ...]], Any] = {}


def strip_weights(proto: Any, min_bytes: int = 4096) -> Any:
    """The graph without the data of its large initializers (dims and types kept): all the
    estimator needs, at a fraction of the memory."""
    import onnx

    for init in proto.graph.initializer:
        if init.raw_data and len(init.raw_data) > min_bytes:
            init.ClearField("raw_data")
            init.data_location = onnx.TensorProto.EXTERNAL
            del init.external_data[:]
            init.external_data.add(key="location", value="__edgekit_dropped__")
    return proto


def _inferred(proto: Any, batch: int, dims: dict[str, int] | None) -> tuple[Any, dict[str, _Tensor], dict[str, int], list[str]]:
    """``infer_shapes`` once per (graph object, batch, dims): the inferred copy is only read."""
    key = (id(proto), batch, tuple(sorted((dims or {}).items())))
    hit = _SHAPE_CACHE.get(key)
    if hit is None or hit[0] is not proto:
        m, table, bound, warnings = infer_shapes(proto, batch, dims)
        while len(_SHAPE_CACHE) >= 4:
            _SHAPE_CACHE.pop(next(iter(_SHAPE_CACHE)))
        hit = (proto, (m, table, bound, warnings))
        _SHAPE_CACHE[key] = hit
    m, table, bound, warnings = hit[1]
    return m, table, dict(bound), list(warnings)


def _first_float(tgt: Any) -> str:
    for p in FLOAT_PRECISIONS:
        if p in tgt.precisions:
            return p
    return "fp32"


def _peak(tgt: Any, precision: str) -> float:
    """Peak ops/s for a compute precision; tf32 falls back to fp16/2, a missing float to fp32."""
    p = tgt.peak_tops
    if precision in p and p[precision] > 0:
        return float(p[precision]) * 1e12
    if precision == "int4" and p.get("int8"):
        return float(p["int8"]) * 1e12
    if precision in ("bf16", "fp16") and (p.get("fp16") or p.get("bf16")):
        return float(p.get("fp16") or p.get("bf16")) * 1e12
    if precision == "tf32" and p.get("fp16"):
        return float(p["fp16"]) * 0.5e12
    return float(p.get("fp32") or max(p.values(), default=0.0)) * 1e12


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


def _stage(node: Any) -> str:
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [s for s in ast.literal_eval(p.value) if s]
            except (ValueError, SyntaxError):
                break
            if not scopes:
                return ""
            stage = scopes[0]
            if len(scopes) > 1 and scopes[1].isdigit():
                stage += "." + scopes[1]
            return stage
    if node.name.startswith("/"):
        parts = [x for x in node.name.split("/") if x]
        return parts[0] if len(parts) > 1 else ""
    return ""


def _estimate_nodes(m: Any, table: dict[str, _Tensor], tgt: Any, ctx: _Ctx, eff: dict[str, float],
                    overhead_us: float, fuse: bool, warnings: list[str]) -> tuple[list[NodeEstimate], list[str]]:
    graph = m.graph
    notes: list[str] = []
    consumers: dict[str, list[Any]] = defaultdict(list)
    producer: dict[str, Any] = {}
    for node in graph.node:
        for i in node.input:
            if i:
                consumers[i].append(node)
        for o in node.output:
            producer[o] = node
    graph_outputs = {o.name for o in graph.output}

    # Constant tensors: name -> (stored bytes per element, weight precision label).
    const: dict[str, tuple[float, str]] = {}
    for init in graph.initializer:
        const[init.name] = (_elem_bits(init.data_type) / 8.0, _precision_of_elem(init.data_type))
    status: dict[int, str] = {}
    alias_in: dict[str, str] = {}  # tensor read by a consumer -> the tensor actually read (fused DQ)
    alias_out: dict[str, str] = {}  # tensor written by a producer -> the tensor actually written (fused Q)
    for idx, node in enumerate(graph.node):
        ins = [i for i in node.input if i]
        if node.op_type == "Constant":
            for o in node.output:
                t = table.get(o)
                const[o] = ((_elem_bits(t.elem) / 8.0) if t else 4.0, _precision_of_elem(t.elem) if t else "fp32")
            status[idx] = "folded"
            continue
        if not fuse:
            continue
        if node.op_type in ("Shape", "Size") and ins and table.get(ins[0]) is not None and table[ins[0]].shape is not None:
            for o in node.output:
                const[o] = (8.0, "int64")
            status[idx] = "folded"
            continue
        if ins and all(i in const for i in ins):
            status[idx] = "folded"
            if node.op_type == "DequantizeLinear":
                per, prec = const[ins[0]]
                x = table.get(ins[0])
                if x is not None and x.numel:  # scales and zero points, spread over the weights
                    extra = sum(table[i].numel * _elem_bits(table[i].elem) / 8.0 for i in ins[1:]
                                if table.get(i) is not None and table[i].shape is not None)
                    per += extra / x.numel
                for o in node.output:
                    const[o] = (per, prec)  # the consumer reads the quantized weight
            elif node.op_type in VIEW_OPS or node.op_type == "Transpose":
                for o in node.output:
                    const[o] = const[ins[0]]
            else:
                for o in node.output:
                    t = table.get(o)
                    const[o] = ((_elem_bits(t.elem) / 8.0) if t else 4.0, _precision_of_elem(t.elem) if t else "fp32")
    if fuse:
        # Q/DQ on activations: a DQ whose consumers are all ordinary nodes is read through by
        # them (they read the int8 tensor); a Q right after an ordinary single-consumer node
        # is written through by it.
        for idx, node in enumerate(graph.node):
            if idx in status or node.op_type not in QDQ_OPS or not node.input or not node.output:
                continue
            x, y = node.input[0], node.output[0]
            if node.op_type == "DequantizeLinear":
                users = consumers.get(y, [])
                if users and y not in graph_outputs and all(u.op_type not in QDQ_OPS for u in users):
                    alias_in[y] = alias_in.get(x, x)
                    status[idx] = "fused"
            else:
                prod = producer.get(x)
                if (prod is not None and prod.op_type not in QDQ_OPS and len(consumers.get(x, [])) == 1
                        and x not in graph_outputs):
                    alias_out[x] = y
                    status[idx] = "fused"
        # Epilogues: activation / bias / batch-norm after Conv, MatMul or Gemm.
        anchor_ops = CONV_OPS | MATMUL_OPS
        fused_out: set[str] = set()
        epilogues: list[Any] = []
        for idx, node in enumerate(graph.node):
            if idx in status or not node.input:
                continue
            if node.op_type == "Cast" and _is_noop_cast(node, table):
                status[idx] = "view"  # a cast to the type it already has: engines drop it
                if node.input[0] in fused_out or (producer.get(node.input[0]) is not None and
                                                  producer[node.input[0]].op_type in anchor_ops):
                    fused_out.update(node.output)
                continue
            if node.op_type == "Transpose":
                users = consumers.get(node.output[0], [])
                if len(users) == 1 and users[0].op_type in CONV_OPS and node.input[0] not in const:
                    status[idx] = "fused"  # a layout change absorbed by the convolution's kernel choice
                    continue
            if node.op_type not in EPILOGUE_OPS and node.op_type != "Transpose":
                continue
            data_inputs = [i for i in node.input if i and i not in const]
            if len(data_inputs) != 1:
                continue
            src = data_inputs[0]
            prod = producer.get(src)
            if prod is None or len(consumers.get(src, [])) != 1 or src in graph_outputs:
                continue
            if prod.op_type in anchor_ops or src in fused_out:
                status[idx] = "fused"
                fused_out.update(node.output)
                epilogues.append(node)
        # The anchor writes what its last fused epilogue (or a fused Q after it) writes.
        for node in reversed(epilogues):
            if node.op_type == "Cast":
                continue
            src = next(i for i in node.input if i and i not in const)
            alias_out[src] = alias_out.get(node.output[0], node.output[0])

    nodes: list[NodeEstimate] = []
    bw = tgt.memory_bandwidth_gbs * 1e9
    for idx, node in enumerate(graph.node):
        cls = op_class(node.op_type, node, table)
        st = status.get(idx, "runs")
        if fuse and st == "runs" and node.op_type in VIEW_OPS:
            st = "view"
        ins = [table.get(i) if i else None for i in node.input]
        outs = [table.get(o) if o else None for o in node.output]
        if st != "runs":
            nodes.append(NodeEstimate(node.name or f"{node.op_type}_{idx}", node.op_type, cls, ctx.float_precision,
                                      0.0, 0.0, 0.0, 0.0, 0.0, "overhead", 0.0, 0.0, 0.0, 0.0, 0.0,
                                      stage=_stage(node), status=st))
            continue
        ops, known = _node_ops(node, ins, outs)
        if node.op_type in VIEW_OPS:  # metadata only (fuse=False: it runs, but moves nothing)
            nodes.append(NodeEstimate(node.name or f"{node.op_type}_{idx}", node.op_type, cls, ctx.float_precision,
                                      0.0, 0.0, 0.0, 0.0, 0.0, "overhead", 0.0, 0.0, overhead_us / 1e3,
                                      overhead_us / 1e3, _efficiency_for(eff, cls, ctx.float_precision),
                                      stage=_stage(node)))
            continue
        # Bytes: weights (constant inputs) at their stored/run precision, activations in and out.
        w_bytes = a_bytes = 0.0
        int_act = False
        weight_prec = None
        for pos, name in enumerate(node.input):
            if not name:
                continue
            t = table.get(name)
            if name in const:
                per, wprec = const[name]
                n_el = t.numel if t is not None else 0.0
                if node.op_type in ("Gather", "GatherElements", "GatherND", "GatherBlockQuantized") and pos == 0:
                    n_el = outs[0].numel if outs and outs[0] is not None else n_el  # reads only the rows it gathers
                stored_int = wprec in ("int4", "int8")  # an integer weight (or a folded DQ of one)
                if stored_int:
                    pass
                elif cls in ("conv", "depthwise-conv", "matmul") and t is not None and t.elem in _FLOAT_ELEMS:
                    if ctx.mode == "int8":
                        per, wprec = 1.0, "int8"
                    elif ctx.mode == "int4" and cls == "matmul" and n_el > 1024:
                        per, wprec = 0.5, "int4"
                    else:
                        per = _ACT_BYTES.get(ctx.float_precision, 4.0)
                elif t is not None and t.elem in _FLOAT_ELEMS:
                    per = _act_bytes_per_elem(t.elem, ctx)
                if n_el > 1024 and wprec in ("int4", "int8"):
                    weight_prec = wprec if weight_prec != "int4" else weight_prec
                w_bytes += n_el * per
                continue
            src = alias_in.get(name, name)
            ts = table.get(src)
            if ts is None or ts.shape is None:
                continue
            if ts.elem in (2, 3, 21, 22) and pos == 0:
                int_act = True
            a_bytes += ts.numel * _act_bytes_per_elem(ts.elem, ctx)
        out_numel = 0.0
        for name in node.output:
            if not name:
                continue
            real = alias_out.get(name, name)
            t = table.get(real) or table.get(name)
            if t is None or t.shape is None:
                # unknown output shape: assume like the first input
                t0 = ins[0] if ins and ins[0] is not None and ins[0].shape is not None else None
                if t0 is not None:
                    a_bytes += t0.numel * _act_bytes_per_elem(t0.elem, ctx)
                continue
            out_numel += t.numel
            a_bytes += t.numel * _act_bytes_per_elem(t.elem, ctx)
        prec = ctx.float_precision
        quantized = False
        if node.op_type in ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "MatMulIntegerToFloat",
                            "DynamicQuantizeMatMul", "QGemm"):
            prec, quantized = "int8", True
        elif node.op_type == "MatMulNBits":
            bits = int(_attr(node, "bits", 4))
            prec, quantized = ("int4" if bits == 4 else "int8"), True
            weight_prec = prec
        elif cls in ("conv", "depthwise-conv", "matmul") and (int_act or ctx.mode == "int8") and (
                weight_prec == "int8" or ctx.mode == "int8"):
            prec, quantized = "int8", True
        elif cls in ("conv", "depthwise-conv", "matmul") and weight_prec in ("int4", "int8"):
            prec, quantized = weight_prec, True  # weight-only: compute in float, weights read quantized
        elif node.op_type.startswith("QLinear") or (int_act and cls not in ("data-movement",)):
            prec, quantized = "int8", True
        elif ctx.mode == "int8":
            prec = "int8"
        # Compute peak: integer math for int8 nodes; weight-only int4/int8 computes in float
        # (except MatMulNBits with accuracy_level 4, which ONNX Runtime runs in int8).
        compute_prec = prec
        if prec == "int4" or (prec == "int8" and node.op_type == "MatMulNBits"):
            compute_prec = ctx.float_precision
            if node.op_type == "MatMulNBits" and int(_attr(node, "accuracy_level", 0) or 0) == 4 and "int8" in tgt.peak_tops:
                compute_prec = "int8"
        elif prec == "int8" and not cls.startswith(("conv", "depthwise", "matmul")):
            compute_prec = ctx.float_precision  # integer elementwise runs on vector units: no int8 peak
        if prec == "int8" and compute_prec == "int8" and "int8" not in tgt.peak_tops:
            compute_prec = ctx.float_precision
            if "no-int8" not in notes:
                warnings.append(f"target {tgt.name!r} has no int8 peak; int8 nodes estimated at {compute_prec}")
                notes.append("no-int8")
        peak = _peak(tgt, compute_prec)
        e = _efficiency_for(eff, cls, prec)
        em = _efficiency_for(eff, cls, prec, memory=True)
        compute_ms = ops / (peak * e) * 1e3 if peak > 0 and ops > 0 else 0.0
        total_bytes = w_bytes + a_bytes
        memory_ms = total_bytes / (bw * em) * 1e3 if bw > 0 else 0.0
        over_ms = overhead_us / 1e3
        intensity = ops / total_bytes if total_bytes else 0.0
        crossover = peak / bw if bw else 0.0
        if ops == 0 and total_bytes == 0:
            bound = "overhead"
        else:
            bound = "compute" if compute_ms > memory_ms else "memory"
        nodes.append(NodeEstimate(
            name=node.name or f"{node.op_type}_{idx}", op_type=node.op_type, op_class=cls, precision=prec,
            ops=ops, weight_bytes=w_bytes, activation_bytes=a_bytes, intensity=intensity, crossover=crossover,
            bound=bound, compute_ms=compute_ms, memory_ms=memory_ms, overhead_ms=over_ms,
            time_ms=max(compute_ms, memory_ms) + over_ms, efficiency=e, memory_efficiency=em, stage=_stage(node),
            known=known,
            quantized=quantized, status="runs"))
    notes = [n for n in notes if n != "no-int8"]
    return nodes, notes


def _is_noop_cast(node: Any, table: dict[str, _Tensor]) -> bool:
    src = table.get(node.input[0])
    return src is not None and int(_attr(node, "to", -1)) == src.elem


def _efficiency_for(eff: dict[str, float], cls: str, precision: str, memory: bool = False) -> float:
    """The fraction of peak for an op class (``conv``, ``conv:int8``); ``memory=True`` the
    fraction of bandwidth (``conv@mem``, fitted separately by calibration; else the same)."""
    keys = [f"{cls}:{precision}@mem", f"{cls}@mem"] if memory else []
    for key in (*keys, f"{cls}:{precision}", cls, "other"):
        if key in eff and eff[key] > 0:
            return float(eff[key])
    return 0.3


def resolve_efficiency(target: Any, calibrated: bool = True) -> tuple[dict[str, float], str | None, float]:
    """(efficiency per op class, calibration file used or None, kernel overhead in us):
    kind defaults, then the target YAML's ``efficiency``, then a saved calibration."""
    eff = dict(DEFAULT_EFFICIENCY.get(target.kind, DEFAULT_EFFICIENCY["gpu"]))
    eff.update({k: float(v) for k, v in (target.efficiency or {}).items()})
    overhead = float(target.kernel_overhead_us)
    path = None
    if calibrated:
        from edgekit.estimate.calibrate import load_calibration

        cal = load_calibration(target)
        if cal is not None:
            eff.update({k: float(v) for k, v in cal.get("efficiency", {}).items()})
            if cal.get("kernel_overhead_us") is not None:
                overhead = float(cal["kernel_overhead_us"])
            path = cal.get("path")
    return eff, path, overhead
