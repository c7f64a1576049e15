"""What an INT8 graph computes on another CPU's integer kernels, run on this one.

ONNX Runtime fuses a Q/DQ graph into integer operators (``QLinearConv``, ``QGemm``,
``QLinearMatMul``, ``MatMulIntegerToFloat``, ``MatMulInteger``) and runs them on the CPU's
integer kernels, which differ by ISA (``targets.cpu_isa``): with VNNI, AMX or on arm64 the
u8 x s8 products are summed in int32 (exact); on x86 without VNNI, MLAS sums each pair of
adjacent products along the reduction axis in a saturating int16 (``vpmaddubsw``) before
adding the pairs in int32. This module rewrites the graph ONNX Runtime fused (its own
choice of which nodes run integer kernels, saved at the "extended" level) so that each such
node computes exactly what a given kernel family computes, in float arithmetic that is
exact for these integer ranges, and runs it here:

* ``"int16-pairs"``: the products ``x_u8 * w_s8`` of the raw codes (activation zero point
  included, padding with the zero-point code), summed in pairs of adjacent reduction
  indices, each pair clipped to [-32768, 32767], then summed; the zero-point correction
  ``- x_zp * sum(w)`` and the bias are exact, as MLAS applies them. The reduction order is
  MLAS's: for a convolution im2col in (kh, kw, c) order per group (checked against ONNX
  Runtime on an AVX2 CPU by ``tests/test_onnx_int8_kernels.py``), for a matmul the K axis.
* ``"int32"``: the same without the clip (what VNNI, AMX and arm64 kernels compute).

Nodes with uint8 weights (any zero point; edgekit stores a layer's exact 8-bit weights so under schemes
"u8s8p" and "u8s7", ``qdq.promote_u8u8``) run MLAS's u8 x u8 kernels, which widen both operands to int16 before
``vpmaddwd`` (int32 pair sums, exact on every CPU): under both semantics they are left as they are and
run on this machine's kernels, exact here too. So are depthwise convolutions (32-bit sums everywhere).

``float_qdq_session`` is the third semantics: Q/DQ computed in float, not fused (TensorRT's
explicit quantization is defined so, and it is what a GPU target's INT8 graph is judged on).

``session_for(path, kernel)`` picks: this machine's own session when ``kernel`` is this
machine's kind, else the rewritten graph.

The 4-bit weight-only graphs (``MatMulNBits`` with ``accuracy_level`` 4, edgekit's export default)
compute in int8 too: ``matmulnbits_int8`` is what they compute, exactly. Each row of the activations
is rounded to int8 per block of ``block_size`` along K (symmetric, scale ``max|a| / 127``), multiplied
by the weights' 4-bit codes less their zero points, summed in integers and scaled. No sum can saturate
there on any ISA: a pair of products is at most 2 x 127 x 15 = 3,810, far inside int16; so the only
loss of int8 compute is the activations' rounding, the same on AVX2, VNNI, AMX and arm64 kernels
(``tests/test_onnx_int8_kernels.py`` checks ONNX Runtime against this on whatever CPU runs it).

>>> sess = session_for("model.onnx", "int16-pairs")  # doctest: +SKIP
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import UnavailableError
from edgekit.targets import Target
from edgekit.targets.cpu_isa import host_int8_kernel

SEMANTICS = ("int16-pairs", "int32", "float-qdq")  # what ``session_for`` can compute
INT16_MIN, INT16_MAX = -32768.0, 32767.0


def semantics_of(kernel_name: str) -> str:
    """The arithmetic of an int8 kernel family (``cpu_isa.Int8Kernel.name``) or of a scheme's
    target: "trt" (TensorRT) -> "float-qdq"."""
    if kernel_name == "trt":
        return "float-qdq"
    if kernel_name in SEMANTICS:
        return kernel_name
    if kernel_name in ("avx2", "avx512bw", "sse4.1"):
        return "int16-pairs"
    return "int32"


def host_semantics() -> str:
    return "int16-pairs" if host_int8_kernel().saturates else "int32"


def semantics_for_target(target: Target) -> str:
    """What an INT8 graph computes on ``target``: Q/DQ in float on GPU targets (TensorRT's explicit
    quantization; ONNX Runtime's GPU providers), else its CPU's integer kernels (this machine's when
    the target does not say its CPU)."""
    if target.has_gpu:
        return "float-qdq"
    kernel = target.int8_kernel
    return host_semantics() if kernel is None else semantics_of(kernel.name)


def describe_semantics(semantics: str | None) -> str:
    """How a graph was run, for reports: this machine's kernels, or which model of others'."""
    kernel = host_int8_kernel()
    if semantics is None or (semantics != "float-qdq" and semantics == host_semantics()):
        return f"ONNX Runtime on this machine ({kernel.name} integer kernels)"
    if semantics == "float-qdq":
        return "Q/DQ computed in float (TensorRT's semantics), on this machine"
    if semantics == "int16-pairs":
        return "integer kernels of x86 CPUs without VNNI (int16 pair sums), modelled on this machine"
    return "integer kernels with int32 sums (VNNI, AMX, arm64), modelled on this machine"


def matmulnbits_int8(a: np.ndarray, codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray,
                     block_size: int) -> np.ndarray:
    """What ``MatMulNBits`` computes with int8 compute (``accuracy_level`` 4) for activations ``a``
    (M, K) and weights of ``codes`` (N, K) integers with per-block ``zeros`` and ``scales`` (N, blocks):
    per block of ``block_size`` columns, ``a`` rounded to int8 (half to even) on the scale
    ``max|a| / 127`` of its own row and block, exact integer dot products with ``codes - zeros``,
    scaled by both scales and summed over blocks (float64: the reference, not the kernel's summation
    order). A block of zeros has scale 0 and contributes nothing."""
    m, k = a.shape
    out = np.zeros((m, codes.shape[0]), dtype=np.float64)
    for j, lo in enumerate(range(0, k, block_size)):
        block = a[:, lo:lo + block_size].astype(np.float32)
        scale = np.abs(block).max(axis=1, keepdims=True) / np.float32(127)
        q = np.rint(block / np.where(scale == 0, np.float32(1), scale)).clip(-127, 127).astype(np.int64)
        w = codes[:, lo:lo + block_size].astype(np.int64) - zeros[:, j:j + 1].astype(np.int64)
        out += (q @ w.T) * scale.astype(np.float64) * scales[:, j][None].astype(np.float64)
    return out


class NotModeled(UnavailableError):
    """A fused integer node this model of the kernels does not cover."""


def _ort() -> Any:
    import onnxruntime as ort

    return ort


def _options(level: str, threads: int | None) -> Any:
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    so.intra_op_num_threads = int(threads or 0)
    so.log_severity_level = 3
    return so


def float_qdq_session(path: str | os.PathLike[str], threads: int | None = None) -> Any:
    """Q/DQ computed in float: ONNX Runtime at the basic level, which does not fuse Q/DQ into
    integer operators."""
    return _ort().InferenceSession(str(path), _options("ORT_ENABLE_BASIC", threads), providers=["CPUExecutionProvider"])


def fused_graph(path: str | os.PathLike[str]) -> Any:
    """The graph as ONNX Runtime's CPU provider fuses it (the "extended" level: Q/DQ into integer
    operators, no layout changes), as an ``onnx.ModelProto``."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="edgekit-fused-") as tmp:
        so = _options("ORT_ENABLE_EXTENDED", 1)
        so.optimized_model_filepath = str(Path(tmp) / "fused.onnx")
        _ort().InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        return onnx.load(str(Path(tmp) / "fused.onnx"))


def session_for(path: str | os.PathLike[str], semantics: str, threads: int | None = None) -> Any:
    """A session computing what ``semantics`` ("int16-pairs", "int32", "float-qdq") computes.
    This machine's own kernels when they are of that kind."""
    if semantics not in SEMANTICS:
        raise ValueError(f"unknown kernel semantics {semantics!r}")
    if semantics == "float-qdq":
        return float_qdq_session(path, threads)
    if semantics == host_semantics():
        return _ort().InferenceSession(str(path), _options("ORT_ENABLE_ALL", threads), providers=["CPUExecutionProvider"])
    model, _ = emulate(fused_graph(path), saturate=semantics == "int16-pairs")
    return _ort().InferenceSession(model.SerializeToString(), _options("ORT_DISABLE_ALL", threads),
                                   providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------------------------------
# The rewrite


class _Graph:
    """The graph being rewritten: constants by name, unique names, and the node builders, written
    for the graph's own opset (``ReduceSum``/``Squeeze`` axes and ``Clip``/``Pad`` bounds moved
    from attributes to inputs in opsets 11 and 13)."""

    def __init__(self, model: Any) -> None:
        from onnx import numpy_helper

        self.model = model
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.inits = {i.name: i for i in model.graph.initializer}
        self.values = {name: numpy_helper.to_array(t) for name, t in self.inits.items()}
        self.names = {n.name for n in model.graph.node} | set(self.inits) | {
            o for n in model.graph.node for o in n.output}
        self.new_inits: list[Any] = []
        self.nodes: list[Any] = []
        self.counter = 0

    def const(self, name: str) -> np.ndarray:
        if name not in self.values:
            raise NotModeled(f"integer node input {name!r} is not a constant")
        return self.values[name]

    def unique(self, base: str) -> str:
        while True:
            self.counter += 1
            name = f"{base}__emul{self.counter}"
            if name not in self.names:
                self.names.add(name)
                return name

    def add(self, array: np.ndarray, base: str) -> str:
        from onnx import numpy_helper

        name = self.unique(base)
        self.new_inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], base: str, out: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        out = out or self.unique(f"{base}_{op.lower()}")
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.unique(f"{base}_{op}"), **attrs))
        return out

    def reduce_sum(self, x: str, axis: int, base: str) -> str:
        if self.opset >= 13:
            return self.node("ReduceSum", [x, self.add(np.array([axis], np.int64), base + "_axes")], base, keepdims=0)
        return self.node("ReduceSum", [x], base, axes=[axis], keepdims=0)

    def squeeze(self, x: str, axis: int, base: str) -> str:
        if self.opset >= 13:
            return self.node("Squeeze", [x, self.add(np.array([axis], np.int64), base + "_axes")], base)
        return self.node("Squeeze", [x], base, axes=[axis])

    def clip_int16(self, x: str, base: str) -> str:
        if self.opset >= 11:
            lo = self.add(np.array(INT16_MIN, np.float32), base + "_lo")
            hi = self.add(np.array(INT16_MAX, np.float32), base + "_hi")
            return self.node("Clip", [x, lo, hi], base)
        return self.node("Clip", [x], base, min=INT16_MIN, max=INT16_MAX)

    def pad(self, x: str, pads: list[int], value: float, base: str) -> str:
        if self.opset >= 11:
            return self.node("Pad", [x, self.add(np.array(pads, np.int64), base + "_pads"),
                                     self.add(np.array(value, np.float32), base + "_value")], base, mode="constant")
        return self.node("Pad", [x], base, mode="constant", pads=pads, value=value)

    def slice_last(self, x: str, start: int, end: int, base: str) -> str:
        """x[..., start:end] (opset 10 and later take the bounds as inputs)."""
        if self.opset >= 10:
            return self.node("Slice", [x, self.add(np.array([start], np.int64), base + "_starts"),
                                       self.add(np.array([end], np.int64), base + "_ends"),
                                       self.add(np.array([-1], np.int64), base + "_saxes")], base)
        return self.node("Slice", [x], base, starts=[start], ends=[end], axes=[-1])


def _attr(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _pair_sums(g: _Graph, products: str, axis: int, saturate: bool, base: str) -> str:
    """The pair sums laid out along ``axis`` of ``products``, clipped to int16 (``saturate``) and summed."""
    return g.reduce_sum(g.clip_int16(products, base) if saturate else products, axis, base)


def _conv_accumulate(g: _Graph, node: Any, x_codes: str, x_zp: float, w: np.ndarray, saturate: bool) -> str:
    """float tensor (N, Cout, H', W'): the window sums of x_code * w, pairs in MLAS's order."""
    base = node.name or node.output[0]
    if _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"", ""):
        raise NotModeled(f"{base}: auto_pad convolutions are not modelled")
    cout, cin_g = int(w.shape[0]), int(w.shape[1])
    kernel = [int(k) for k in w.shape[2:]]
    if len(kernel) != 2:
        raise NotModeled(f"{base}: only 2-d convolutions are modelled")
    kk = kernel[0] * kernel[1]
    groups = int(_attr(node, "group", 1))
    cout_g = cout // groups
    pads = [int(p) for p in _attr(node, "pads", [0, 0, 0, 0])]
    conv: dict[str, Any] = {"kernel_shape": kernel, "strides": [int(s) for s in _attr(node, "strides", [1, 1])],
            "dilations": [int(d) for d in _attr(node, "dilations", [1, 1])]}
    src = x_codes
    if any(pads):  # MLAS pads with the zero-point code
        src = g.pad(src, [0, 0, pads[0], pads[1], 0, 0, pads[2], pads[3]], x_zp, base)
    wf = w.astype(np.float32)
    if not saturate:  # exact int32 sums: one convolution on the codes
        return g.node("Conv", [src, g.add(wf, base + "_w")], base, group=groups, **conv)
    if cin_g % 2 == 0:
        # pairs (c, c+1) at one kernel tap: a grouped conv over each channel pair with one output per
        # (group, pair, out channel, tap); the pair sums are clipped, then summed over taps and pairs
        q = cin_g // 2
        wp = np.zeros((groups, q, cout_g, kk, 2, kk), np.float32)
        wg = wf.reshape(groups, cout_g, q, 2, kk)  # (g, o, q, 2, tap)
        for t in range(kk):
            wp[:, :, :, t, :, t] = wg[:, :, :, :, t].transpose(0, 2, 1, 3)
        raw = g.node("Conv", [src, g.add(wp.reshape(groups * q * cout_g * kk, 2, *kernel), base + "_wpairs")], base,
                     group=groups * q, **conv)
        six = g.node("Reshape", [raw, g.add(np.array([0, groups, q, cout_g, kk, -1], np.int64), base + "_s6")], base)
        clipped = g.clip_int16(six, base)
        acc = g.reduce_sum(g.reduce_sum(clipped, 4, base + "_taps"), 2, base + "_pairs")  # (N, g, cout_g, H'W')
    else:
        if groups != 1:
            raise NotModeled(f"{base}: grouped convolutions with an odd number of channels per group are not modelled")
        # pairs run across taps in (kh, kw, c) order: one output channel per (out channel, pair)
        order = [(i, j, c) for i in range(kernel[0]) for j in range(kernel[1]) for c in range(cin_g)]
        p = (len(order) + 1) // 2
        wp = np.zeros((cout, p, cin_g, *kernel), np.float32)
        for k, (i, j, c) in enumerate(order):
            wp[:, k // 2, c, i, j] = wf[:, c, i, j]
        raw = g.node("Conv", [src, g.add(wp.reshape(cout * p, cin_g, *kernel), base + "_wpairs")], base, **conv)
        four = g.node("Reshape", [raw, g.add(np.array([0, cout, p, -1], np.int64), base + "_s4")], base)
        acc = _pair_sums(g, four, 2, True, base)  # (N, Cout, H'W')
    # back to (N, Cout, H', W'): the batch and spatial sizes of the pair convolution's output
    shape = g.node("Shape", [raw], base)
    if g.opset >= 10:
        n = g.node("Slice", [shape, g.add(np.array([0], np.int64), base + "_z"), g.add(np.array([1], np.int64), base + "_o")],
                   base)
        hw = g.node("Slice", [shape, g.add(np.array([2], np.int64), base + "_t"), g.add(np.array([4], np.int64), base + "_f")],
                    base)
    else:
        n = g.node("Slice", [shape], base, starts=[0], ends=[1])
        hw = g.node("Slice", [shape], base, starts=[2], ends=[4])
    out_shape = g.node("Concat", [n, g.add(np.array([cout], np.int64), base + "_cout"), hw], base, axis=0)
    return g.node("Reshape", [acc, out_shape], base)


def _matmul_accumulate(g: _Graph, base: str, a_codes: str, b: np.ndarray, saturate: bool) -> str:
    """float tensor (..., M, N): the sums over K of a_code * b, pairs of adjacent K clipped (MLAS's order)."""
    bf = b.astype(np.float32)
    if not saturate:
        return g.node("MatMul", [a_codes, g.add(bf, base + "_b")], base)
    k, n = int(bf.shape[0]), int(bf.shape[1])
    lone = None
    src = a_codes
    if k % 2:  # an odd K ends with a lone product (MLAS pads K with a zero): exact on its own
        lone = g.node("MatMul", [g.slice_last(a_codes, k - 1, k, base + "_last"), g.add(bf[k - 1:], base + "_blast")],
                      base)
        src = g.slice_last(a_codes, 0, k - 1, base + "_even")
        bf, k = bf[:k - 1], k - 1
    p = k // 2
    # a (..., M, K) -> (..., M, P, 1, 2); b (K, N) -> (P, 2, N); their product (..., M, P, 1, N) holds the pair sums
    lead = g.node("Shape", [src], base)
    if g.opset >= 10:
        lead = g.node("Slice", [lead, g.add(np.array([0], np.int64), base + "_z"),
                                g.add(np.array([-1], np.int64), base + "_m1")], base)
    else:
        lead = g.node("Slice", [lead], base, starts=[0], ends=[-1])
    a_shape = g.node("Concat", [lead, g.add(np.array([p, 1, 2], np.int64), base + "_p12")], base, axis=0)
    a5 = g.node("Reshape", [src, a_shape], base)
    pairs = g.node("MatMul", [a5, g.add(bf.reshape(p, 2, n), base + "_bpairs")], base)
    acc = _pair_sums(g, g.squeeze(pairs, -2, base), -2, True, base)
    return acc if lone is None else g.node("Add", [acc, lone], base)


# where a fused integer op's output zero point sits (it sets the output's element type)
_OUTPUT_ZP = {"QuantizeLinear": 2, "QLinearConv": 7, "QLinearMatMul": 7, "QGemm": 8, "QLinearAdd": 7, "QLinearMul": 7,
              "QLinearAveragePool": 4, "QLinearGlobalAveragePool": 4, "QLinearLeakyRelu": 4, "QLinearSigmoid": 4,
              "QLinearSoftmax": 4, "QLinearConcat": 1, "QLinearReduceMean": 4, "QLinearWhere": 8}


def _element_types(model: Any, g: _Graph) -> dict[str, int]:
    """Tensor name -> ONNX element type, for the inputs of integer nodes: declared types, constants,
    the output zero point of quantizing ops (uint8 when absent), else the first input's type (the
    data-movement ops between them: MaxPool, Reshape, Transpose, ...)."""
    from onnx import TensorProto, helper

    elem = {vi.name: vi.type.tensor_type.elem_type for vi in
            list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    for name, arr in g.values.items():
        elem[name] = helper.np_dtype_to_tensor_dtype(arr.dtype)
    for n in model.graph.node:  # graph order: producers first
        if not n.output or n.output[0] in elem:
            continue
        k = _OUTPUT_ZP.get(n.op_type)
        if k is not None:
            zp = n.input[k] if len(n.input) > k and n.input[k] else None
            elem[n.output[0]] = elem.get(zp, TensorProto.UINT8) if zp else TensorProto.UINT8
        elif n.op_type in ("DynamicQuantizeLinear",):
            elem[n.output[0]] = TensorProto.UINT8
        elif n.input and n.input[0] in elem and n.op_type not in ("DequantizeLinear", "Cast", "Shape"):
            elem[n.output[0]] = elem[n.input[0]]
    return elem


def emulate(model: Any, saturate: bool = True) -> tuple[Any, int]:
    """Rewrite a fused graph (``fused_graph``) so every u8 x s8 integer node computes as the int16-pair
    kernels do (``saturate``) or with exact int32 sums. Returns (model, nodes rewritten). Raises
    ``NotModeled`` for a fused integer node it cannot model (never a silent pass-through)."""
    import copy

    from onnx import TensorProto

    model = copy.deepcopy(model)
    g = _Graph(model)
    elem = _element_types(model, g)
    out_nodes: list[Any] = []
    rewritten = 0

    def scalar(name: str) -> float:
        return float(np.asarray(g.const(name)).reshape(-1)[0])

    def is_u8(name: str) -> bool:
        if name not in elem:
            raise NotModeled(f"the element type of {name!r} is not known")
        return elem[name] == TensorProto.UINT8

    for node in model.graph.node:
        op = node.op_type
        base = node.name or node.output[0]
        g.nodes = []
        if op == "QLinearConv":
            x, xs, xz, w, ws, wz, ys, yz = list(node.input[:8])
            bias = node.input[8] if len(node.input) > 8 and node.input[8] else None
            wv = g.const(w)
            depthwise = wv.shape[1] == 1 and int(_attr(node, "group", 1)) > 1
            if not is_u8(x) or wv.dtype != np.int8 or depthwise:
                # exact on every CPU: u8 x u8 (uint8 weights: int16 operands, int32 pair sums), s8
                # activations, depthwise kernels
                out_nodes.append(node)
                continue
            if np.any(np.asarray(g.const(wz)) != 0):
                raise NotModeled(f"{base}: weights with a zero point are not modelled")
            x_zp = scalar(xz)
            codes = g.node("Cast", [x], base, to=TensorProto.FLOAT)
            acc = _conv_accumulate(g, node, codes, x_zp, wv, saturate)
            corr = -x_zp * wv.reshape(wv.shape[0], -1).astype(np.float64).sum(1)
            if bias is not None:
                corr = corr + g.const(bias).astype(np.float64)
            acc = g.node("Add", [acc, g.add(corr.astype(np.float32).reshape(1, -1, 1, 1), base + "_corr")], base)
            scale = scalar(xs) * np.asarray(g.const(ws), np.float64).reshape(-1)
            real = g.node("Mul", [acc, g.add(scale.astype(np.float32).reshape(1, -1, 1, 1), base + "_scale")], base)
            g.node("QuantizeLinear", [real, ys, yz], base, out=node.output[0])
        elif op in ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat", "MatMulInteger"):
            c = y_s = y_z = None
            a_s = b_s = a_z = b_z = ""
            alpha = 1.0
            if op == "QGemm":
                a, a_s, a_z, b, b_s, b_z = list(node.input[:6])
                c = node.input[6] if len(node.input) > 6 and node.input[6] else None
                y_s = node.input[7] if len(node.input) > 7 and node.input[7] else None
                y_z = node.input[8] if len(node.input) > 8 and node.input[8] else None
                if _attr(node, "transA", 0):
                    raise NotModeled(f"{base}: QGemm with transA is not modelled")
                bv = g.const(b).T if _attr(node, "transB", 0) else g.const(b)
                alpha = float(_attr(node, "alpha", 1.0))
            elif op == "QLinearMatMul":
                a, a_s, a_z, b, b_s, b_z, y_s, y_z = list(node.input[:8])
                bv = g.const(b)
            elif op == "MatMulIntegerToFloat":
                a, b, a_s, b_s = list(node.input[:4])
                a_z = node.input[4] if len(node.input) > 4 else ""
                b_z = node.input[5] if len(node.input) > 5 else ""
                c = node.input[6] if len(node.input) > 6 and node.input[6] else None
                bv = g.const(b)
            else:  # MatMulInteger: int32 out
                a, b = node.input[0], node.input[1]
                a_z = node.input[2] if len(node.input) > 2 else ""
                b_z = node.input[3] if len(node.input) > 3 else ""
                bv = g.const(b)
            if not is_u8(a) or bv.dtype != np.int8 or bv.ndim != 2:
                out_nodes.append(node)
                continue
            if g.opset < 11:
                raise NotModeled(f"{base}: integer matmuls in graphs below opset 11 are not modelled")
            if b_z and np.any(np.asarray(g.const(b_z)) != 0):
                raise NotModeled(f"{base}: weights with a zero point are not modelled")
            a_zp = scalar(a_z) if a_z else 0.0
            codes = g.node("Cast", [a], base, to=TensorProto.FLOAT)
            acc = _matmul_accumulate(g, base, codes, bv, saturate)
            acc = g.node("Add", [acc, g.add((-a_zp * bv.astype(np.float64).sum(0)).astype(np.float32), base + "_corr")],
                         base)
            if op == "MatMulInteger":
                g.node("Cast", [acc], base, out=node.output[0], to=TensorProto.INT32)
            else:
                scale = alpha * scalar(a_s) * np.asarray(g.const(b_s), np.float64).reshape(-1)
                real = g.node("Mul", [acc, g.add(scale.astype(np.float32), base + "_scale")], base)
                if c is not None:
                    cv = g.const(c)
                    bias = cv.astype(np.float64) * (scale if cv.dtype == np.int32 else 1.0)
                    real = g.node("Add", [real, g.add(bias.astype(np.float32), base + "_bias")], base)
                if y_s is not None:
                    g.node("QuantizeLinear", [real, y_s] + ([y_z] if y_z else []), base, out=node.output[0])
                else:
                    g.node("Identity", [real], base, out=node.output[0])
        elif op in ("ConvInteger", "DynamicQuantizeMatMul", "QAttention", "DynamicQuantizeLSTM"):
            raise NotModeled(f"{base}: {op} is not modelled")
        else:
            out_nodes.append(node)
            continue
        out_nodes += g.nodes
        rewritten += 1
    del model.graph.node[:]
    model.graph.node.extend(out_nodes)
    model.graph.initializer.extend(g.new_inits)
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]  # the integer nodes' own weights are gone
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    del model.graph.value_info[:]  # rewritten outputs' shapes: inferred again by ONNX Runtime
    return model, rewritten
