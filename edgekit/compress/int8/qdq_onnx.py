"""The ONNX side of INT8's Q/DQ: an exported fake-quant graph (``qdq.py``'s PyTorch model, exported)
made into the graph the engines fuse. ``rewrite_qdq`` stores weights as int8 initializers behind
DequantizeLinear (uint8 for exact 8-bit weights under schemes "u8s7" and "u8s8p"), biases as int32 on the
``input_scale * weight_scale`` grid, folds weight transposes into the initializers and zero pads into
the convolutions. NumPy and ONNX only (ONNX imported where used).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from edgekit.compress.int8 import pairs

if TYPE_CHECKING:  # imported where used: exporting is the only path that needs onnx
    import onnx

# x86 CPUs without VNNI multiply uint8 activations (up to 255) by int8 weights and add each pair of
# adjacent products in a saturating int16 (vpmaddubsw): 8-bit weights reach 255 * 254 = 64,770 > 32,767.
# The 7-bit grid (ONNX Runtime's reduce_range, symmetric) keeps every pair within it: 255 * (64 + 64) = 32,640.
WEIGHT_7BIT = (-64, 64)
# The pair-safe grid (scheme "u8s8p", ``pairs``) keeps 8-bit codes but every same-sign pair within 128.
# Under either, a layer whose weights cost too much accuracy can keep all 8 bits: its codes are
# stored as uint8 with this zero point (code + 128), so ONNX Runtime runs it on its u8 x u8 kernels,
# which widen both operands to int16 before the multiply-add (vpmaddwd): exact on every x86 CPU,
# about 1.3-1.45x the u8 x s8 kernel's time for that layer, still integer.
U8_WEIGHT_ZERO_POINT = 128


def rewrite_qdq(model: onnx.ModelProto, u8_weights: int = 0) -> onnx.ModelProto:
    """Make an exported fake-quant graph deployable: int8 weights behind DequantizeLinear,
    int32 biases, weight transposes folded. Returns the same ModelProto, changed.

    ``u8_weights``: how many layers have exact 8-bit weights under schemes "u8s7" and "u8s8p"
    (``promote_u8u8``). Those are the only convolution / matmul weights (depthwise ones aside) with a
    same-sign pair of codes beyond ``pairs.PAIR_BOUND``; they are stored as uint8 with zero point
    ``U8_WEIGHT_ZERO_POINT`` (the same values), so ONNX Runtime runs them on its exact u8 x u8 kernels
    (one whose pairs happen to stay within the bound is exact as int8 and stays so). More such weights
    than ``u8_weights`` is an internal error."""
    import onnx
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consts: dict[str, np.ndarray] = {}
    for n in g.node:  # Constant nodes hold scalars (scales, zero points)
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)

    def value(name: str) -> np.ndarray | None:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        return consts.get(name)

    producers = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def add_init(arr: np.ndarray, name: str) -> str:
        t = numpy_helper.from_array(arr, name)
        g.initializer.append(t)
        inits[name] = t
        return name

    remove: list[onnx.NodeProto] = []
    stored_u8 = 0
    # 1. Q(const float weight) -> DQ  ==>  const int8 -> DQ (uint8 for exact 8-bit weights under "u8s7")
    for q in list(g.node):
        if q.op_type != "QuantizeLinear":
            continue
        w = value(q.input[0])
        if w is None or w.dtype.kind != "f":
            continue
        scale = value(q.input[1])
        zp = value(q.input[2]) if len(q.input) > 2 else np.zeros((), np.uint8)
        if scale is None or zp is None:
            continue
        axis = next((a.i for a in q.attribute if a.name == "axis"), 1)
        if scale.ndim == 1 and scale.size > 1:
            shape = [1] * w.ndim
            shape[axis] = -1
            s, z = scale.reshape(shape), zp.astype(np.int64).reshape(shape)
        else:
            s, z = scale, zp.astype(np.int64)
        info = np.iinfo(zp.dtype)
        qw = np.clip(np.round(w / s) + z, info.min, info.max).astype(zp.dtype)
        if u8_weights and _wide_int8_weight(qw, zp, axis, consumers.get(q.output[0], []), consumers):
            qw = (qw.astype(np.int16) + U8_WEIGHT_ZERO_POINT).astype(np.uint8)
            zp_u8 = add_init(np.full(zp.shape, U8_WEIGHT_ZERO_POINT, np.uint8), q.output[0] + "_zp_u8")
            for c in consumers.get(q.output[0], []):
                if c.op_type == "DequantizeLinear" and len(c.input) > 2:
                    c.input[2] = zp_u8
            stored_u8 += 1
        qname = add_init(qw, q.output[0] + "_int")
        for c in consumers.get(q.output[0], []):
            for k, inp in enumerate(c.input):
                if inp == q.output[0]:
                    c.input[k] = qname
        remove.append(q)
    for n in remove:
        g.node.remove(n)
    if stored_u8 > u8_weights:  # internal invariant: only the layers the fake-quant model promoted can overflow
        raise RuntimeError(f"{u8_weights} layers have exact 8-bit weights but {stored_u8} weights have pairs of "
                           f"codes beyond {pairs.PAIR_BOUND}")
    producers = {o: n for n in g.node for o in n.output}
    consumers = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    # 2. DQ(int8 const, axis) -> Transpose  ==>  DQ(transposed const, new axis)
    for t in list(g.node):
        if t.op_type != "Transpose":
            continue
        dq = producers.get(t.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue
        if len(consumers.get(dq.output[0], [])) != 1:
            continue
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
        qw = numpy_helper.to_array(inits[dq.input[0]])
        perm = perm or list(range(qw.ndim))[::-1]
        new = add_init(np.ascontiguousarray(qw.transpose(perm)), dq.input[0] + "_t")
        dq.input[0] = new
        axis = next((a for a in dq.attribute if a.name == "axis"), None)
        if axis is not None:
            axis.i = perm.index(axis.i if axis.i >= 0 else axis.i + qw.ndim)
        dq.output[0] = t.output[0]
        g.node.remove(t)
    producers = {o: n for n in g.node for o in n.output}

    # 3. float bias of Conv / Gemm (and MatMul + Add) -> int32 bias behind DQ
    for n in list(g.node):
        if n.op_type in ("Conv", "Gemm") and len(n.input) > 2 and n.input[2]:
            bias_in, x_in, w_in = n.input[2], n.input[0], n.input[1]
            set_input = (n, 2)
        else:
            continue
        b = value(bias_in)
        xdq, wdq = producers.get(x_in), producers.get(w_in)
        if b is None or xdq is None or wdq is None or xdq.op_type != "DequantizeLinear" or wdq.op_type != "DequantizeLinear":
            continue
        sx, sw = value(xdq.input[1]), value(wdq.input[1])
        if sx is None or sw is None:
            continue
        sb = (np.float32(sx) * sw.astype(np.float32)).reshape(-1).astype(np.float32)
        if sb.size == 1 and b.size > 1:
            sb = np.full(b.shape, sb[0], np.float32)
        qb = np.clip(np.round(b / sb), -2**31, 2**31 - 1).astype(np.int32)
        qb_name = add_init(qb, bias_in + "_int32")
        sb_name = add_init(sb, bias_in + "_scale")
        dq_out = bias_in + "_dq"
        node = onnx.helper.make_node("DequantizeLinear", [qb_name, sb_name], [dq_out], axis=0,
                                     name=bias_in + "_DequantizeLinear")
        g.node.insert(list(g.node).index(n), node)
        set_input[0].input[set_input[1]] = dq_out

    # 4. DQ(a) -> Pad(zeros) -> Q(same grid) -> DQ -> Conv  ==>  DQ(a) -> Conv(pads += ...)
    #    (zero is exactly representable, so padding the quantized tensor with its zero point is
    #    the same; ONNX Runtime then runs QLinearConv straight on the tensor, no float Pad)
    _fold_pads(g, value)

    # 5. drop initializers nobody reads any more
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return model


def _wide_int8_weight(qw: np.ndarray, zp: np.ndarray, axis: int, dqs: list[onnx.NodeProto],
                      consumers: dict[str, list[onnx.NodeProto]]) -> bool:
    """Whether int8 weight codes ``qw`` (output channels on ``axis``, behind the DequantizeLinear nodes
    ``dqs``) have a pair of codes that can overflow in a convolution or matmul whose u8 x s8 kernel sums
    pairs in int16 (every one but depthwise)."""
    if qw.dtype != np.int8 or np.any(zp != 0) or qw.ndim < 2 or pairs.violations(np.moveaxis(qw, axis, 0)) == 0:
        return False
    for dq in dqs:
        for c in consumers.get(dq.output[0], []):
            if c.op_type == "Conv":
                group = next((a.i for a in c.attribute if a.name == "group"), 1)
                if not (group > 1 and qw.ndim > 2 and qw.shape[1] == 1):
                    return True
            elif c.op_type in ("Gemm", "MatMul", "Transpose"):
                return True
    return False


def _fold_pads(g: onnx.GraphProto, value: Callable[[str], np.ndarray | None]) -> int:
    import onnx

    producers = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def only(t: str) -> bool:
        return len(consumers.get(t, [])) == 1

    def same(a: str, b: str) -> bool:
        va, vb = value(a), value(b)
        return va is not None and vb is not None and va.shape == vb.shape and bool(np.all(va == vb))

    folded = 0
    for conv in list(g.node):
        if conv.op_type != "Conv":
            continue
        dq_c = producers.get(conv.input[0])
        q_b = producers.get(dq_c.input[0]) if dq_c is not None and dq_c.op_type == "DequantizeLinear" else None
        pad = producers.get(q_b.input[0]) if q_b is not None and q_b.op_type == "QuantizeLinear" else None
        if pad is None or pad.op_type != "Pad":
            continue
        dq_a = producers.get(pad.input[0])
        if (q_b is None or dq_c is None or dq_a is None or dq_a.op_type != "DequantizeLinear"
                or len(q_b.input) < 3 or len(dq_a.input) < 3):
            continue
        if not (same(q_b.input[1], dq_a.input[1]) and same(q_b.input[2], dq_a.input[2])):
            continue
        if not (only(pad.output[0]) and only(q_b.output[0]) and only(dq_c.output[0])):
            continue
        mode = next((a.s.decode() for a in pad.attribute if a.name == "mode"), "constant")
        if mode != "constant" or (len(pad.input) > 3 and pad.input[3]):
            continue
        if len(pad.input) > 2 and pad.input[2]:
            cval = value(pad.input[2])
            if cval is None or np.any(cval != 0):
                continue
        pads_value = value(pad.input[1])
        if pads_value is None:
            continue
        pads = [int(p) for p in pads_value.reshape(-1)]
        r = len(pads) // 2
        begin, end = pads[:r], pads[r:]
        if r < 3 or any(begin[:2]) or any(end[:2]) or min(pads) < 0:
            continue
        attr = next((a for a in conv.attribute if a.name == "pads"), None)
        auto = next((a for a in conv.attribute if a.name == "auto_pad"), None)
        if auto is not None and auto.s not in (b"NOTSET", b""):
            continue
        k = r - 2
        old = list(attr.ints) if attr is not None else [0] * (2 * k)
        new = [old[i] + begin[2 + i] for i in range(k)] + [old[k + i] + end[2 + i] for i in range(k)]
        if attr is not None:
            conv.attribute.remove(attr)
        conv.attribute.append(onnx.helper.make_attribute("pads", new))
        conv.input[0] = dq_a.output[0]
        for n in (dq_c, q_b, pad):
            g.node.remove(n)
        folded += 1
    return folded
