"""Per-operator work: arithmetic ops, the GEMM shape of convolutions and matrix products,
and the bytes each tensor takes at the precision the engine runs it in.

A multiply-accumulate is 2 ops. Weights count at the precision they are stored or run in
(4 bits for MatMulNBits / int4 DequantizeLinear, 1 byte for int8), activations at the
activation precision; Q/DQ pairs make the tensors between them 8-bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from edgekit.estimate.graph import ELEM_BITS, FLOAT_ELEMS, Graph, Node, Tensor

OP_CLASSES = ("conv", "depthwise-conv", "matmul", "attention", "elementwise", "normalization",
              "reduction", "data-movement", "other")
CONV_OPS = {"Conv", "FusedConv", "ConvInteger", "QLinearConv", "ConvTranspose", "NhwcFusedConv", "NhwcConv"}
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
# Metadata only: no data moves in any engine.
VIEW_OPS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Dropout", "Shape", "Size", "Constant",
            "EyeLike", "Optional", "OptionalGetElement"}
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
ACT_BYTES = {"fp32": 4.0, "tf32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0}


@dataclass(frozen=True)
class Precision:
    """How the engine runs the graph: float activations in ``float_precision``; ``mode``
    "native" (as the graph says), "int8" (every conv/matmul INT8, activations 8-bit) or
    "int4" (4-bit weight-only matrix products)."""

    float_precision: str = "fp32"
    mode: str = "native"


@dataclass
class NodeCost:
    ops: float
    weight_bytes: float
    input_bytes: dict[str, float]  # non-constant input tensor -> bytes read
    output_bytes: dict[str, float]  # output tensor -> bytes written
    op_class: str
    precision: str  # "int8", "int4", "fp16", ...
    known: bool
    gemm: tuple[float, float, float, float] | None = None  # (batch, M, N, K) of a conv or matrix product
    channels: float | None = None  # a convolution's input channels per group (K = channels x kernel area)

    @property
    def activation_bytes(self) -> float:
        return sum(self.input_bytes.values()) + sum(self.output_bytes.values())


def op_class(node: Node | str) -> str:
    """The efficiency class of an op (a node, or an op type: convolutions then count as
    ``conv``): conv, depthwise-conv, matmul, attention, elementwise, normalization,
    reduction, data-movement or other (unknown ops)."""
    op = node if isinstance(node, str) else node.op
    if op in CONV_OPS:
        return "depthwise-conv" if not isinstance(node, str) and is_depthwise(node) else "conv"
    if op in MATMUL_OPS:
        return "matmul"
    if op in ATTENTION_OPS:
        return "attention"
    if op in ELEMENTWISE_OPS:
        return "elementwise"
    if op in NORMALIZATION_OPS:
        return "normalization"
    if op in REDUCTION_OPS or op in POOL_OPS:
        return "reduction"
    if op in DATA_OPS or op in VIEW_OPS:
        return "data-movement"
    return "other"


def _conv_weight(node: Node) -> Tensor | None:
    wi = 3 if node.op == "QLinearConv" else 1
    return node.inputs[wi] if len(node.inputs) > wi else None


def is_depthwise(node: Node) -> bool:
    if int(node.attr("group", 1) or 1) <= 1:
        return False
    w = _conv_weight(node)
    return w is not None and w.shape is not None and len(w.shape) > 1 and w.shape[1] == 1


def dot_k(node: Node) -> tuple[float, int] | None:
    """(K, taps) of a convolution or matrix product as integer dot-product kernels see it (u8 x s8
    summed four at a time: x86 vpmaddubsw/vpdpbusd, Arm sdot): a convolution's input channels per
    group padded to a multiple of 4, times its taps (kernel positions; above 1 its input goes
    through an im2col); a matrix product's K padded to 4, one tap. None for other nodes."""
    if node.op in CONV_OPS:
        w = _conv_weight(node)
        if w is None or w.shape is None or len(w.shape) < 2:
            return None
        taps = math.prod(w.shape[2:])
        return float(math.ceil(w.shape[1] / 4) * 4 * taps), taps
    if node.op in MATMUL_OPS and node.inputs and node.inputs[0] is not None and node.inputs[0].shape:
        k = node.inputs[0].shape[-1]
        return (float(math.ceil(k / 4) * 4), 1) if isinstance(k, int) else None
    return None


def tensor_bits(graph: Graph) -> dict[str, float]:
    """Bits per element each tensor is read at, where that differs from its element type:
    the outputs of DequantizeLinear read the quantized tensor (engines fuse the DQ into the
    consumer), and so do views and casts of constant quantized weights."""
    bits: dict[str, float] = {}
    for node in graph.nodes:
        if not node.inputs or node.inputs[0] is None:
            continue
        src = node.inputs[0]
        src_bits = bits.get(src.name, ELEM_BITS.get(src.elem, 32))
        if node.op == "DequantizeLinear" or (src.const and node.op in VIEW_OPS | {"Transpose", "Cast"}):
            extra = 0.0  # scales and zero points of a constant weight, spread over its elements
            if node.op == "DequantizeLinear" and src.const and src.numel:
                extra = sum(t.stored_bytes * 8 for t in node.inputs[1:] if t is not None) / src.numel
            for t in node.outputs:
                if t is not None:
                    bits[t.name] = min(src_bits + extra, ELEM_BITS.get(t.elem, 32))
    return bits


def _bytes(t: Tensor, bits: dict[str, float], prec: Precision, weight: bool = False) -> float:
    b = bits.get(t.name)
    if b is None:
        if t.elem in FLOAT_ELEMS:
            if prec.mode == "int8":
                b = 8.0
            else:
                b = 8.0 * ACT_BYTES.get(prec.float_precision, 4.0)
                if t.elem == 10 or t.elem == 16:  # a float16 graph stays 16-bit
                    b = min(b, 16.0)
        else:
            b = float(ELEM_BITS.get(t.elem, 32))
    elif prec.mode == "int8":
        b = min(b, 8.0)
    return t.numel * b / 8.0


def node_cost(node: Node, bits: dict[str, float], prec: Precision) -> NodeCost:
    """Ops, weight bytes, activation bytes and GEMM shape of one node."""
    cls = op_class(node)
    ops, gemm, known = _ops(node)
    weight = 0.0
    ins: dict[str, float] = {}
    for i, t in enumerate(node.inputs):
        if t is None:
            continue
        if t.const and i == 0 and node.op in ("Gather", "GatherElements", "GatherND", "GatherBlockQuantized"):
            out = node.outputs[0] if node.outputs else None  # a table lookup reads only the rows it returns
            weight += _bytes(out, bits, prec) if out is not None else 0.0
        elif t.const:
            b = _bytes(t, bits, prec, weight=True)
            if prec.mode == "int4" and cls == "matmul" and i == 1:
                b = t.numel * 0.5
            weight += b
        else:
            ins[t.name] = _bytes(t, bits, prec)
    outs = {t.name: _bytes(t, bits, prec) for t in node.outputs if t is not None}
    w = _conv_weight(node) if node.op in CONV_OPS else None
    channels = float(w.shape[1]) if w is not None and w.shape is not None and len(w.shape) > 1 and \
        node.op != "ConvTranspose" else None
    return NodeCost(ops, weight, ins, outs, cls, _precision(node, bits, prec, cls), known, gemm, channels)


def _precision(node: Node, bits: dict[str, float], prec: Precision, cls: str) -> str:
    if node.op == "MatMulNBits" or (prec.mode == "int4" and cls == "matmul"):
        return "int4"
    if prec.mode == "int8" and cls in ("conv", "depthwise-conv", "matmul", "attention"):
        return "int8"
    if node.op.startswith("QLinear") or node.op in ("ConvInteger", "MatMulInteger", "MatMulIntegerToFloat",
                                                    "DynamicQuantizeMatMul", "QGemm"):
        return "int8"
    if cls in ("conv", "depthwise-conv", "matmul") and len(node.inputs) > 1:
        a, w = node.inputs[0], node.inputs[1]
        a_bits = bits.get(a.name, ELEM_BITS.get(a.elem, 32)) if a is not None else 32
        w_bits = bits.get(w.name, ELEM_BITS.get(w.elem, 32)) if w is not None else 32
        if a_bits < 16 and w_bits < 16:  # 8-bit codes (plus their scales)
            return "int8"
        if w_bits < 8:
            return "int4"
    return prec.float_precision


def _ops(node: Node) -> tuple[float, tuple[float, float, float, float] | None, bool]:
    """(arithmetic ops, (batch, M, N, K) for convs and matrix products, known op)."""
    op = node.op
    out = node.outputs[0] if node.outputs and node.outputs[0] is not None else None
    out_n = out.numel if out is not None else 0.0

    def shp(i: int) -> tuple[int, ...] | None:
        t = node.inputs[i] if i < len(node.inputs) else None
        return t.shape if t is not None else None

    if op in CONV_OPS:
        w = _conv_weight(node)
        x = shp(0)
        if w is None or w.shape is None or out is None or out.shape is None or x is None:
            return 0.0, None, True
        g = int(node.attr("group", 1) or 1)
        if op == "ConvTranspose":  # each input position scatters a (Cout/g x k) patch
            k_in = x[1] // g if len(x) > 1 else 1
            macs = math.prod(x) * math.prod(w.shape[1:])
            m = float(math.prod(x)) / max(x[1], 1)
            return 2.0 * macs, (float(g), m, float(math.prod(w.shape[1:])), float(k_in)), True
        k = float(math.prod(w.shape[1:]))  # Cin/g * kh * kw
        n_out = float(out.shape[1]) if len(out.shape) > 1 else 1.0
        m = out_n / max(n_out, 1.0)
        return 2.0 * out_n * k, (float(g), m, n_out / g, k), True
    if op in MATMUL_OPS:
        a = shp(0)
        if op == "MatMulNBits":
            k = float(node.attr("K", a[-1] if a else 0))
            n = float(node.attr("N", 0))
            m = float(math.prod(a[:-1])) if a else 1.0
            return 2.0 * m * k * n, (1.0, m, n, k), True
        if a is None or out is None or out.shape is None or not out.shape:
            return 0.0, None, True
        trans_a = bool(node.attr("transA", 0))
        k = float(a[-2] if (trans_a and len(a) >= 2) else a[-1])
        n = float(out.shape[-1])
        b = node.inputs[1] if len(node.inputs) > 1 else None
        if b is not None and not b.const and len(out.shape) >= 3:  # batched product of two activations
            batch = float(math.prod(out.shape[:-2]))
            m = float(out.shape[-2])
        else:
            batch, m = 1.0, out_n / max(n, 1.0)
        return 2.0 * out_n * k, (batch, m, n, k), True
    if op in ATTENTION_OPS:
        q = shp(0)
        if q is None or out is None or out.shape is None:
            return 0.0, None, True
        s_kv = q[1] if len(q) >= 2 else 1
        for i in (1, 3):  # key, past_key
            kk = shp(i)
            if kk is not None and len(kk) >= 3:
                s_kv = max(s_kv, kk[-2] if len(kk) == 4 else kk[1])
        hidden = out.shape[-1] if out.shape else 1
        return 4.0 * math.prod(q[:2]) * s_kv * hidden, None, True
    if op in ELEMENTWISE_OPS:
        return ELEMENTWISE_OPS[op] * out_n, None, True
    if op in NORMALIZATION_OPS:
        return NORMALIZATION_OPS[op] * out_n, None, True
    if op in POOL_OPS:
        return out_n * math.prod(node.attr("kernel_shape") or [1]), None, True
    if op in REDUCTION_OPS:
        x = shp(0)
        return (float(math.prod(x)) if x else out_n), None, True
    if op in ("Resize", "Upsample"):
        return 4.0 * out_n, None, True
    if op in DATA_OPS or op in VIEW_OPS:
        return 0.0, None, True
    return 0.0, None, False
