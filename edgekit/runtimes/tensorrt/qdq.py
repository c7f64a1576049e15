"""TensorRT's Q/DQ flavour: convert an ONNX graph's explicit quantization into the form
TensorRT builds, or refuse with the reason.

TensorRT's explicit quantization (developer guide, "Working with Quantized Types")
takes signed INT8 with a zero point of 0 on both activations and weights, quantizes
activations per tensor and weights per output channel, and fuses a DequantizeLinear
into the convolution or matrix multiply that consumes it (and into residual additions).
Graphs quantized for ONNX Runtime on x86 (U8S8: uint8 activations with zero points,
int8 weights, int32 bias DequantizeLinear, Q/DQ around every quantizable op) violate
the first and last of these.

``convert_to_tensorrt(model)`` rewrites such a graph:

- activations: the calibrated range that a uint8 (or asymmetric int8) scale ``s`` and
  zero point ``z`` encode, ``[lo, hi] = [s (q_min - z), s (q_max - z)]``, becomes the
  symmetric scale ``s' = max(|lo|, |hi|) / 127`` with an int8 zero point of 0 (the
  range is kept; a one-sided range loses one bit of resolution);
- weights: asymmetric or unsigned integer weights are dequantized and re-quantized
  signed, symmetric, per output channel (``s_c = max|w_c| / 127``);
- biases held as int32 DequantizeLinear (which TensorRT does not import) are folded to
  float constants;
- placement: a Q/DQ pair stays only where TensorRT fuses it, on the inputs of
  Conv/ConvTranspose/MatMul/Gemm and of additions of two activations (residual adds);
  other consumers read the float tensor.

It refuses (``QdqRefusal``, with the reason and what to do) operator-style quantized
ops (QLinearConv, ConvInteger, ...), dynamic quantization, Q/DQ whose parameters are
computed at run time, per-channel activation quantization and asymmetric 4-bit weights.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from edgekit.errors import BadInputError

# Ops whose inputs TensorRT quantizes (its Q/DQ fusion points), and the weight input's
# output-channel axis for per-channel weights.
FUSED_CONSUMERS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Add")
# Quantized operators of ONNX's operator-oriented form: TensorRT imports none of them.
QOPERATOR_OPS = ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear",
                 "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool", "QLinearSigmoid", "QLinearLeakyRelu",
                 "QLinearConcat", "QLinearAveragePool", "MatMulNBits", "QGemm", "QAttention")
_INT_RANGE = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127), TensorProto.UINT4: (0, 15),
              TensorProto.INT4: (-8, 7), TensorProto.UINT16: (0, 65535), TensorProto.INT16: (-32768, 32767)}
_NP_TYPE = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8,
            np.dtype(np.uint16): TensorProto.UINT16, np.dtype(np.int16): TensorProto.INT16,
            np.dtype(np.int32): TensorProto.INT32}


class QdqRefusal(BadInputError):
    """The graph's quantization cannot be expressed the way TensorRT takes it."""


@dataclass
class ActivationRange:
    tensor: str  # the quantized tensor
    lo: float
    hi: float
    scale_before: float
    zero_point_before: int
    dtype_before: str
    scale_after: float  # max(|lo|, |hi|) / 127, zero point 0, int8


@dataclass
class QdqConversion:
    """What ``convert_to_tensorrt`` changed (all counts are nodes or tensors of the graph)."""

    activations_converted: int = 0  # Q/DQ pairs made signed symmetric (were uint8 or had zero points)
    activations_kept: int = 0  # already signed symmetric
    weights_requantized: int = 0  # asymmetric/unsigned weights made signed symmetric per channel
    weights_kept: int = 0
    biases_folded: int = 0  # int32 DequantizeLinear folded to float
    pairs_dropped: int = 0  # Q/DQ pairs where TensorRT would not fuse them
    consumers_rewired: int = 0  # consumers that now read the float tensor
    ranges: list[ActivationRange] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.activations_converted or self.weights_requantized or self.biases_folded
                    or self.pairs_dropped or self.consumers_rewired)

    def summary(self) -> str:
        if not self.changed:
            return "the graph's Q/DQ already has TensorRT's form (signed symmetric int8), kept as it is"
        return (f"{self.activations_converted} activation Q/DQ made signed symmetric int8 (ranges kept), "
                f"{self.weights_requantized} weights re-quantized symmetric per channel, {self.biases_folded} int32 "
                f"biases folded to float, {self.pairs_dropped} Q/DQ pairs TensorRT would not fuse removed")

    def to_dict(self) -> dict[str, Any]:
        return {"activations_converted": self.activations_converted, "activations_kept": self.activations_kept,
                "weights_requantized": self.weights_requantized, "weights_kept": self.weights_kept,
                "biases_folded": self.biases_folded, "pairs_dropped": self.pairs_dropped,
                "consumers_rewired": self.consumers_rewired, "summary": self.summary(),
                "ranges": [r.__dict__ for r in self.ranges]}


class _Graph:
    """Constant values (initializers and Constant nodes), producers and consumers."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.g = graph
        self.values: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        for n in graph.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self._names = {i.name for i in graph.initializer} | {o for n in graph.node for o in n.output}

    def const(self, name: str) -> np.ndarray | None:
        return self.values.get(name)

    def add_initializer(self, base: str, value: np.ndarray) -> str:
        name, k = base, 0
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        self.g.initializer.append(numpy_helper.from_array(value, name))
        self.values[name] = value
        return name


def _zero_point(g: _Graph, node: onnx.NodeProto) -> np.ndarray:
    """A Q/DQ node's zero point (absent: uint8 0, the ONNX default)."""
    if len(node.input) > 2 and node.input[2]:
        zp = g.const(node.input[2])
        if zp is None:
            raise QdqRefusal(f"{node.op_type} {node.name!r} computes its zero point at run time; TensorRT needs "
                             "constant Q/DQ parameters (re-export with static quantization)")
        return zp
    return np.zeros((), np.uint8)


def _scale(g: _Graph, node: onnx.NodeProto) -> np.ndarray:
    s = g.const(node.input[1])
    if s is None:
        raise QdqRefusal(f"{node.op_type} {node.name!r} computes its scale at run time (dynamic quantization); "
                         "TensorRT needs constant scales: quantize statically (`edgekit compress --bits 8`)")
    return s.astype(np.float32)


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def _dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, axis: int) -> np.ndarray:
    x = q.astype(np.float32) - zp.astype(np.float32) if zp.size == 1 else q.astype(np.float32)
    if scale.size == 1:
        return x * scale.reshape(())
    shape = [1] * q.ndim
    shape[axis % q.ndim] = -1
    if zp.size > 1:
        x = x - zp.astype(np.float32).reshape(shape)
    return x * scale.reshape(shape)


def _weight_axis(consumer: onnx.NodeProto, index: int, ndim: int) -> int | None:
    """The output-channel axis of a weight consumed at input ``index`` (None: not a weight)."""
    if consumer.op_type == "Conv" and index == 1:
        return 0
    if consumer.op_type == "ConvTranspose" and index == 1:
        return 1
    if consumer.op_type == "Gemm" and index == 1:
        return 0 if _attr(consumer, "transB", 0) else 1
    if consumer.op_type == "MatMul" and index == 1 and ndim >= 2:
        return ndim - 1
    return None


def symmetric_per_channel(w: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Signed symmetric int8 weights: (q in [-127, 127], scale per channel of ``axis``, or per tensor)."""
    if axis is None:
        amax = np.array(float(np.abs(w).max()), np.float32)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    amax = np.abs(moved).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    return np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8), scale


def _refuse_unsupported(graph: onnx.GraphProto) -> None:
    qops = sorted({n.op_type for n in graph.node if n.op_type in QOPERATOR_OPS})
    if qops:
        first = next(n for n in graph.node if n.op_type in QOPERATOR_OPS)
        raise QdqRefusal(f"the graph uses operator-style quantization ({', '.join(qops)}, e.g. node {first.name!r}), "
                         "which TensorRT does not import; quantize to Q/DQ instead (`edgekit compress --bits 8` "
                         "exports QuantizeLinear/DequantizeLinear)")


def convert_to_tensorrt(model: onnx.ModelProto) -> tuple[onnx.ModelProto, QdqConversion]:
    """A copy of ``model`` in TensorRT's Q/DQ flavour and what changed (see the module doc).

    >>> converted, report = convert_to_tensorrt(onnx.load("int8/model.onnx"))  # doctest: +SKIP
    >>> report.summary()  # doctest: +SKIP
    '60 activation Q/DQ made signed symmetric int8 (ranges kept), ...'
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    _refuse_unsupported(graph)
    g = _Graph(graph)
    report = QdqConversion()

    def set_input(node: onnx.NodeProto, index: int, name: str) -> None:
        while len(node.input) <= index:
            node.input.append("")
        node.input[index] = name

    for q in [n for n in graph.node if n.op_type == "QuantizeLinear"]:
        _convert_activation(g, q, report, set_input)
    for dq in [n for n in graph.node if n.op_type == "DequantizeLinear"]:
        if g.const(dq.input[0]) is not None:
            _convert_constant_dq(g, dq, report, set_input)
    _place_for_tensorrt(g, report)
    _drop_dead_nodes(graph)
    return out, report


def _convert_activation(g: _Graph, q: onnx.NodeProto, report: QdqConversion, set_input: Any) -> None:
    scale = _scale(g, q)
    zp = _zero_point(g, q)
    if scale.size != 1:
        raise QdqRefusal(f"QuantizeLinear {q.name!r} quantizes activation {q.input[0]!r} per channel; TensorRT "
                         "quantizes activations per tensor (re-quantize with per-tensor activations)")
    ztype = _NP_TYPE.get(zp.dtype)
    if ztype not in (TensorProto.UINT8, TensorProto.INT8):
        raise QdqRefusal(f"QuantizeLinear {q.name!r} quantizes to {zp.dtype}; TensorRT's explicit quantization "
                         "takes int8 (or fp8) activations")
    dqs = [c for c in g.consumers[q.output[0]] if c.op_type == "DequantizeLinear"]
    others = [c for c in g.consumers[q.output[0]] if c.op_type != "DequantizeLinear"]
    if others or q.output[0] in g.outputs:
        raise QdqRefusal(f"QuantizeLinear {q.name!r} feeds {others[0].op_type if others else 'a graph output'} "
                         "directly (integer tensors between ops); TensorRT takes Q/DQ pairs only")
    for dq in dqs:
        if not (np.allclose(_scale(g, dq), scale) and np.array_equal(_zero_point(g, dq), zp)):
            raise QdqRefusal(f"QuantizeLinear {q.name!r} and DequantizeLinear {dq.name!r} disagree on scale or "
                             "zero point; the pair does not describe one range")
    s, z = float(scale.reshape(())), int(zp.reshape(()))
    if ztype == TensorProto.INT8 and z == 0:
        report.activations_kept += 1
        return
    qmin, qmax = _INT_RANGE[ztype]
    lo, hi = s * (qmin - z), s * (qmax - z)
    new_scale = max(abs(lo), abs(hi)) / 127.0
    report.ranges.append(ActivationRange(q.input[0], lo, hi, s, z, str(zp.dtype), new_scale))
    s_name = g.add_initializer(f"{q.input[0]}_trt_scale", np.array(new_scale, np.float32))
    z_name = g.add_initializer(f"{q.input[0]}_trt_zero_point", np.zeros((), np.int8))
    for node in (q, *dqs):
        set_input(node, 1, s_name)
        set_input(node, 2, z_name)
    for vi in g.g.value_info:  # the quantized tensor is int8 now
        if vi.name == q.output[0]:
            vi.type.tensor_type.elem_type = TensorProto.INT8
    report.activations_converted += 1


def _convert_constant_dq(g: _Graph, dq: onnx.NodeProto, report: QdqConversion, set_input: Any) -> None:
    q = g.const(dq.input[0])
    assert q is not None
    scale = _scale(g, dq)
    zp = _zero_point(g, dq) if len(dq.input) > 2 and dq.input[2] else np.zeros((), q.dtype)
    block = _attr(dq, "block_size", 0)
    if block:
        if q.dtype.kind == "u" or (zp.size and zp.any()):
            raise QdqRefusal(f"DequantizeLinear {dq.name!r} holds asymmetric {block}-blocked 4-bit weights; "
                             "TensorRT takes signed symmetric int4 blocks (zero point 0): re-quantize the weights "
                             "symmetric")
        report.weights_kept += 1
        return
    axis = _attr(dq, "axis", 1)
    if q.dtype == np.int32:  # a bias: TensorRT imports no int32 DequantizeLinear
        value = _dequantize(q, scale, zp, axis)
        _replace_output_with_constant(g, dq, value, f"{dq.output[0]}_float")
        report.biases_folded += 1
        return
    if q.dtype == np.int8 and not zp.any():
        report.weights_kept += 1
        return
    if q.dtype not in (np.uint8, np.int8):
        raise QdqRefusal(f"DequantizeLinear {dq.name!r} holds {q.dtype} weights; TensorRT takes int8, int4 or fp8")
    w = _dequantize(q, scale, zp, axis)
    consumers = g.consumers[dq.output[0]]
    axes = {_weight_axis(c, list(c.input).index(dq.output[0]), w.ndim) for c in consumers}
    channel_axis = axes.pop() if len(axes) == 1 else None
    wq, ws = symmetric_per_channel(w, channel_axis)
    for vi in g.g.value_info:
        if vi.name == dq.input[0]:
            vi.type.tensor_type.elem_type = TensorProto.INT8
    set_input(dq, 0, g.add_initializer(f"{dq.input[0]}_trt", wq))
    set_input(dq, 1, g.add_initializer(f"{dq.input[0]}_trt_scale", ws if channel_axis is not None else ws.reshape(())))
    set_input(dq, 2, g.add_initializer(f"{dq.input[0]}_trt_zero_point", np.zeros(ws.shape if channel_axis is not None
                                                                                   else (), np.int8)))
    for a in list(dq.attribute):
        if a.name == "axis":
            dq.attribute.remove(a)
    if channel_axis is not None:
        dq.attribute.append(onnx.helper.make_attribute("axis", channel_axis))
    report.weights_requantized += 1


def _replace_output_with_constant(g: _Graph, node: onnx.NodeProto, value: np.ndarray, base: str) -> None:
    name = g.add_initializer(base, value.astype(np.float32))
    for c in g.consumers[node.output[0]]:
        for i, inp in enumerate(c.input):
            if inp == node.output[0]:
                c.input[i] = name
    g.consumers[name] = g.consumers.pop(node.output[0], [])
    if node.output[0] in g.outputs:
        raise QdqRefusal(f"DequantizeLinear {node.name!r} writes a graph output; fold it before building")
    node.ClearField("output")  # dead now; removed with the other dead nodes


def _is_activation(g: _Graph, name: str) -> bool:
    """A tensor computed at run time (not a constant, nor a DequantizeLinear of one)."""
    if g.const(name) is not None:
        return False
    p = g.producer.get(name)
    return not (p is not None and p.op_type == "DequantizeLinear" and g.const(p.input[0]) is not None)


def _fused(g: _Graph, consumer: onnx.NodeProto) -> bool:
    if consumer.op_type == "Add":  # a residual add: both inputs computed at run time
        return all(_is_activation(g, i) for i in consumer.input)
    return consumer.op_type in FUSED_CONSUMERS


def _place_for_tensorrt(g: _Graph, report: QdqConversion) -> None:
    """Keep activation Q/DQ only where TensorRT fuses it; other consumers read the float tensor."""
    for q in [n for n in g.g.node if n.op_type == "QuantizeLinear" and n.output]:
        x = q.input[0]
        dqs = [c for c in g.consumers[q.output[0]] if c.op_type == "DequantizeLinear"]
        kept_pair = False
        for dq in dqs:
            if not dq.output or dq.output[0] in g.outputs:
                kept_pair = kept_pair or bool(dq.output)
                continue
            for c in list(g.consumers[dq.output[0]]):
                if _fused(g, c):
                    kept_pair = True
                    continue
                for i, inp in enumerate(c.input):
                    if inp == dq.output[0]:
                        c.input[i] = x
                g.consumers[dq.output[0]].remove(c)
                g.consumers[x].append(c)
                report.consumers_rewired += 1
            if not g.consumers[dq.output[0]]:
                dq.ClearField("output")
        if not kept_pair:
            q.ClearField("output")
            report.pairs_dropped += 1


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes whose outputs nobody reads (repeatedly), and initializers nobody reads."""
    while True:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if not any(o and o in used for o in n.output)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
