"""The ONNX side of INT8's Q/DQ (edgekit/compress/int8/qdq_onnx.py), on small hand-built graphs:
what ``rewrite_qdq`` stores, and that the rewritten graph computes what the fake-quant graph did."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgekit.compress.int8 import pairs
from edgekit.compress.int8.qdq_onnx import U8_WEIGHT_ZERO_POINT, WEIGHT_7BIT, rewrite_qdq

RNG = np.random.default_rng(0)
X_SCALE, X_ZP = np.float32(0.02), np.uint8(128)


def _fake_quant_conv(weight: np.ndarray, *, pad: bool = False, bias: bool = True) -> onnx.ModelProto:
    """x -> Q/DQ (uint8, per tensor) [-> Pad zeros -> Q/DQ on the same grid] -> Conv(DQ(Q(float W)), float bias):
    what exporting a fake-quant PyTorch conv gives."""
    out_c = weight.shape[0]
    w_scale = (np.abs(weight).reshape(out_c, -1).max(1) / 127).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(w_scale, "w_scale"),
             numpy_helper.from_array(np.zeros(out_c, np.int8), "w_zp"),
             numpy_helper.from_array(X_SCALE, "x_scale"), numpy_helper.from_array(X_ZP, "x_zp"),
             numpy_helper.from_array(RNG.normal(size=out_c).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"])]
    conv_in = "xd"
    if pad:
        nodes += [helper.make_node("Pad", ["xd", "pads"], ["xp"], mode="constant"),
                  helper.make_node("QuantizeLinear", ["xp", "x_scale", "x_zp"], ["xpq"]),
                  helper.make_node("DequantizeLinear", ["xpq", "x_scale", "x_zp"], ["xpd"])]
        conv_in = "xpd"
    nodes += [helper.make_node("QuantizeLinear", ["w", "w_scale", "w_zp"], ["wq"], axis=0),
              helper.make_node("DequantizeLinear", ["wq", "w_scale", "w_zp"], ["wd"], axis=0),
              helper.make_node("Conv", [conv_in, "wd"] + (["b"] if bias else []), ["y"])]
    graph = helper.make_graph(nodes, "fake_quant_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight.shape[1], 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # Q/DQ computed as written
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def test_weights_become_int8_initializers_and_biases_int32_and_the_graph_computes_the_same():
    weight = RNG.normal(size=(6, 4, 3, 3)).astype(np.float32)
    x = RNG.uniform(-2, 2, size=(1, 4, 8, 8)).astype(np.float32)
    model = _fake_quant_conv(weight)
    want = _run(model, x)
    rewrite_qdq(model)
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") == 1  # the activation's only: the weight's Q is folded into its codes
    inits = _initializers(model)
    codes = inits["wq_int"]
    assert codes.dtype == np.int8 and codes.shape == weight.shape and int(np.abs(codes).max()) == 127
    bias = inits["b_int32"]
    assert bias.dtype == np.int32 and bias.shape == (6,)
    np.testing.assert_allclose(inits["b_scale"], X_SCALE * inits["w_scale"], rtol=1e-6)
    assert "w" not in inits and "b" not in inits  # float weight and bias no longer stored
    got = _run(model, x)
    # the same weights; the bias moved onto its int32 grid by at most half a step (x_scale * w_scale / 2)
    np.testing.assert_allclose(got, want, atol=float(inits["b_scale"].max()) / 2 + 1e-5)


def test_a_zero_pad_on_the_quantized_grid_is_folded_into_the_conv():
    weight = RNG.normal(size=(3, 2, 3, 3)).astype(np.float32)
    x = RNG.uniform(-2, 2, size=(1, 2, 8, 8)).astype(np.float32)
    model = _fake_quant_conv(weight, pad=True, bias=False)
    want = _run(model, x)
    rewrite_qdq(model)
    assert "Pad" not in [n.op_type for n in model.graph.node]
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert conv.input[0] == "xd" and list(next(a.ints for a in conv.attribute if a.name == "pads")) == [1, 1, 1, 1]
    np.testing.assert_allclose(_run(model, x), want, atol=1e-5)  # zero is exact on the grid


def test_exact_8_bit_weights_are_stored_as_uint8_only_when_promoted():
    """Under "u8s7" (and "u8s8p") a layer promoted to exact 8-bit weights has pairs of codes beyond 128: stored as uint8 with zero
    point 128 (ONNX Runtime's u8 x u8 kernels), the same values. Without promotions (the VNNI scheme "u8s8")
    8-bit codes stay int8; a count that disagrees with what left the grid is an internal error, never a
    silently different graph."""
    weight = RNG.normal(size=(6, 4, 3, 3)).astype(np.float32)  # scaled to 127: beyond the 7-bit grid
    x = RNG.uniform(-2, 2, size=(1, 4, 8, 8)).astype(np.float32)
    want = _run(_fake_quant_conv(weight, bias=False), x)

    promoted = rewrite_qdq(_fake_quant_conv(weight, bias=False), u8_weights=1)
    inits = _initializers(promoted)
    codes, zp = inits["wq_int"], inits["wq_zp_u8"]
    assert codes.dtype == np.uint8 and zp.dtype == np.uint8 and bool((zp == U8_WEIGHT_ZERO_POINT).all())
    signed = codes.astype(np.int16) - U8_WEIGHT_ZERO_POINT
    assert int(signed.min()) < WEIGHT_7BIT[0] or int(signed.max()) > WEIGHT_7BIT[1]
    np.testing.assert_allclose(_run(promoted, x), want, atol=1e-5)

    plain = _initializers(rewrite_qdq(_fake_quant_conv(weight, bias=False)))
    assert plain["wq_int"].dtype == np.int8 and np.array_equal(plain["wq_int"].astype(np.int16), signed)
    # fewer than promoted is allowed (a promoted layer whose pairs stay within the bound is exact as int8),
    # more is an internal error
    assert _initializers(rewrite_qdq(_fake_quant_conv(weight, bias=False), u8_weights=2))["wq_int"].dtype == np.uint8
    pair_safe = RNG.integers(-64, 65, size=weight.shape).astype(np.float32)  # every pair within 128 ...
    pair_safe[:, 0, 0, 0], pair_safe[:, 1, 0, 0] = 127, 0  # ... with 8-bit codes (channels 0 and 1 pair up)
    assert pairs.violations(pair_safe) == 0 and pairs.violations(signed) > 0
    kept = _initializers(rewrite_qdq(_fake_quant_conv(pair_safe.astype(np.float32), bias=False), u8_weights=1))
    assert kept["wq_int"].dtype == np.int8  # pair-safe 8-bit codes: int8, run on the u8 x s8 kernels


def test_a_transposed_weight_is_stored_transposed_with_its_axis_moved():
    """DQ(int8 weight, axis 0) -> Transpose (a linear layer's ``W^T`` before MatMul) becomes one DQ of the
    transposed codes with the axis moved: the same integers, only stored the other way round."""
    w = RNG.normal(size=(3, 4)).astype(np.float32)  # (out, in), as nn.Linear holds it
    sw = (np.abs(w).max(1) / 64).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(sw, "sw"),
             numpy_helper.from_array(np.zeros(3, np.int8), "zw"),
             numpy_helper.from_array(X_SCALE, "sx"), numpy_helper.from_array(X_ZP, "zx")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "sx", "zx"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "sx", "zx"], ["xd"]),
             helper.make_node("QuantizeLinear", ["w", "sw", "zw"], ["wq"], axis=0),
             helper.make_node("DequantizeLinear", ["wq", "sw", "zw"], ["wd"], axis=0),
             helper.make_node("Transpose", ["wd"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["xd", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = RNG.uniform(-2, 2, size=(2, 4)).astype(np.float32)
    before = _run(model, x)
    rewrite_qdq(model)
    assert "Transpose" not in [n.op_type for n in model.graph.node]
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "wt")
    codes = _initializers(model)[dq.input[0]]
    assert codes.shape == (4, 3) and np.array_equal(codes.T, np.round(w / sw[:, None]).astype(np.int8))
    assert next(a.i for a in dq.attribute if a.name == "axis") == 1
    assert np.array_equal(_run(model, x), before)
