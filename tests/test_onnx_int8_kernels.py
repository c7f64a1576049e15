"""The numerical model of other CPUs' integer kernels (onnx_int8_kernels.py): the rewritten graph
computes what a plain NumPy model of the kernels computes (int16 pair sums in MLAS's reduction order,
or exact int32 sums), on any machine; on a CPU whose own kernels sum in int16 pairs (x86 without
VNNI) it equals ONNX Runtime's own result."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.onnx_int8_kernels import NotModeled, emulate, fused_graph, matmulnbits_int8, session_for
from edgekit.targets.cpu_isa import host_int8_kernel

HOST_PAIRS = host_int8_kernel().saturates
RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, inits, opset=13):
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m


def _qlinearconv(cin: int, cout: int, k: int, x_zp: int, stride: int = 1, group: int = 1, size: int = 7):
    """One QLinearConv: u8 input, s8 per-channel weights spanning the int8 range, an int32 bias."""
    w = RNG.integers(-127, 128, size=(cout, cin // group, k, k)).astype(np.int8)
    ref_scale = 255.0 * 127 * cin * k * k / group / 40.0  # a wide enough output grid: few outputs clip
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "xs"),
             numpy_helper.from_array(np.array(x_zp, np.uint8), "xz"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.full(cout, 0.02, np.float32), "ws"),
             numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
             numpy_helper.from_array(np.array(ref_scale * 0.05 * 0.02 / 127, np.float32), "ys"),
             numpy_helper.from_array(np.array(128, np.uint8), "yz"),
             numpy_helper.from_array(RNG.integers(-5000, 5000, size=cout).astype(np.int32), "b")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            kernel_shape=[k, k], pads=[k // 2] * 4, strides=[stride, stride], group=group)
    m = _model([node], [helper.make_tensor_value_info("x", TensorProto.UINT8, [2, cin, size, size])],
               [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    return m, w, inits


def _numpy_conv(x: np.ndarray, w: np.ndarray, x_zp: int, k: int, stride: int, group: int, saturate: bool) -> np.ndarray:
    """Window sums of x_code * w with MLAS's order: im2col (kh, kw, c) per group, adjacent pairs clipped
    to int16 when ``saturate``, padding with the zero-point code; minus x_zp * sum(w)."""
    n, cin, h, _ = x.shape
    cout, cin_g = w.shape[:2]
    p = k // 2
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (p, p), (p, p)), constant_values=x_zp)
    out_h = (h + 2 * p - k) // stride + 1
    out = np.zeros((n, cout, out_h, out_h), np.int64)
    for g in range(group):
        wg = w[g * cout // group:(g + 1) * cout // group].astype(np.int64)  # (o, c, kh, kw)
        wk = wg.transpose(0, 2, 3, 1).reshape(len(wg), -1)  # (o, K) in (kh, kw, c) order
        for i in range(out_h):
            for j in range(out_h):
                patch = xp[:, g * cin_g:(g + 1) * cin_g, i * stride:i * stride + k, j * stride:j * stride + k]
                cols = patch.transpose(0, 2, 3, 1).reshape(n, -1)  # (n, K)
                prod = cols[:, None, :] * wk[None]  # (n, o, K)
                if prod.shape[-1] % 2:
                    prod = np.concatenate([prod, np.zeros((*prod.shape[:-1], 1), np.int64)], -1)
                pairs = prod.reshape(*prod.shape[:-1], -1, 2).sum(-1)
                if saturate:
                    pairs = np.clip(pairs, -32768, 32767)
                out[:, g * len(wg):(g + 1) * len(wg), i, j] = pairs.sum(-1)
    return out - x_zp * w.reshape(cout, -1).astype(np.int64).sum(1)[None, :, None, None]


def _requantize(acc: np.ndarray, inits: list) -> np.ndarray:
    v = {t.name: numpy_helper.to_array(t) for t in inits}
    real = (acc + v["b"][None, :, None, None]) * (float(v["xs"]) * v["ws"][None, :, None, None])
    return np.clip(np.rint(real / float(v["ys"])) + 128, 0, 255)


@pytest.mark.parametrize("cin,cout,k,x_zp,stride,group", [
    (3, 8, 3, 0, 1, 1),    # an RGB stem: odd channels, pairs run across kernel taps
    (3, 8, 3, 131, 2, 1),  # strided, a mid zero point (padding with it)
    (16, 12, 1, 0, 1, 1),  # pointwise: pairs of channels
    (17, 6, 1, 9, 1, 1),   # odd channels, pointwise
    (8, 8, 3, 40, 1, 1),
    (8, 8, 3, 7, 1, 2),    # grouped, 4 channels per group
])
def test_conv_model_matches_numpy(cin, cout, k, x_zp, stride, group, tmp_path):
    m, w, inits = _qlinearconv(cin, cout, k, x_zp, stride, group)
    path = tmp_path / "conv.onnx"
    path.write_bytes(m.SerializeToString())
    x = RNG.integers(0, 256, size=(2, cin, 7, 7)).astype(np.uint8)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for saturate in (True, False):
        rewritten, count = emulate(fused_graph(path), saturate=saturate)
        assert count == 1
        got = ort.InferenceSession(rewritten.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0].astype(np.int64)
        want = _requantize(_numpy_conv(x, w, x_zp, k, stride, group, saturate), inits)
        assert np.abs(got - want).max() <= 1  # one output step: float rounding at a .5 boundary
    exact = _requantize(_numpy_conv(x, w, x_zp, k, stride, group, False), inits)
    pairs = _requantize(_numpy_conv(x, w, x_zp, k, stride, group, True), inits)
    assert np.abs(pairs - exact).max() > 5  # full-range int8 weights do overflow the pair sums here
    if HOST_PAIRS:  # this CPU's own kernels are the int16-pair kind: the model is them
        host = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        assert np.abs(host.astype(np.int64) - pairs).max() <= 1


def test_uint8_weights_are_exact_where_the_same_int8_weights_saturate(tmp_path):
    """The same 8-bit weight codes stored as uint8 with zero point 128 (a layer promoted to exact 8-bit
    weights under scheme "u8s7"): the model leaves the node to the host's u8 x u8 kernels, which compute
    the exact sums on every CPU; stored as int8, the int16 pair sums of x86 without VNNI saturate."""
    m, w, inits = _qlinearconv(16, 12, 1, 0)  # pointwise, weights over the whole int8 range
    x = RNG.integers(160, 256, size=(2, 16, 7, 7)).astype(np.uint8)  # high codes: pairs beyond int16
    exact = _requantize(_numpy_conv(x, w, 0, 1, 1, 1, False), inits)
    saturated = _requantize(_numpy_conv(x, w, 0, 1, 1, 1, True), inits)
    assert np.abs(saturated - exact).max() > 5
    for t in m.graph.initializer:
        if t.name == "w":
            t.CopyFrom(numpy_helper.from_array((w.astype(np.int16) + 128).astype(np.uint8), "w"))
        elif t.name == "wz":
            t.CopyFrom(numpy_helper.from_array(np.full(12, 128, np.uint8), "wz"))
    path = tmp_path / "conv_u8.onnx"
    path.write_bytes(m.SerializeToString())
    for saturate in (True, False):
        _, count = emulate(fused_graph(path), saturate=saturate)
        assert count == 0  # not rewritten: the host's u8 x u8 kernels are the model
    for semantics in ("int16-pairs", "int32"):
        got = session_for(path, semantics).run(None, {"x": x})[0].astype(np.int64)
        assert np.abs(got - exact).max() <= 1  # one output step: float rounding at a .5 boundary


def test_depthwise_convolutions_are_left_to_the_host():
    """Depthwise convolutions run kernels that sum in 32 bits on every x86 CPU: not rewritten."""
    m, _, _ = _qlinearconv(8, 8, 3, 0, group=8)
    _, count = emulate(m)
    assert count == 0


@pytest.mark.parametrize("op", ["MatMulInteger", "QLinearMatMul", "MatMulIntegerToFloat"])
@pytest.mark.parametrize("k", [64, 33])
def test_matmul_model_matches_numpy(op, k, tmp_path):
    b = RNG.integers(-127, 128, size=(k, 12)).astype(np.int8)
    a = RNG.integers(150, 256, size=(2, 5, k)).astype(np.uint8)
    a_zp = 17
    if op == "MatMulInteger":
        inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array(a_zp, np.uint8), "az")]
        node = helper.make_node(op, ["a", "b", "az"], ["y"])
        out_type = TensorProto.INT32
    elif op == "QLinearMatMul":
        inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array(0.1, np.float32), "as"),
                 numpy_helper.from_array(np.array(a_zp, np.uint8), "az"),
                 numpy_helper.from_array(np.array(0.01, np.float32), "bs"),
                 numpy_helper.from_array(np.array(0, np.int8), "bz"),
                 numpy_helper.from_array(np.array(0.001 * 255 * 127 * k / 40, np.float32), "ys"),
                 numpy_helper.from_array(np.array(128, np.uint8), "yz")]
        node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
        out_type = TensorProto.UINT8
    else:
        inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(np.array(0.1, np.float32), "as"),
                 numpy_helper.from_array(np.full(12, 0.01, np.float32), "bs"),
                 numpy_helper.from_array(np.array(a_zp, np.uint8), "az")]
        node = helper.make_node(op, ["a", "b", "as", "bs", "az"], ["y"], domain="com.microsoft")
        out_type = TensorProto.FLOAT
    m = _model([node], [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 5, k])],
               [helper.make_tensor_value_info("y", out_type, None)], inits)
    path = tmp_path / "mm.onnx"
    path.write_bytes(m.SerializeToString())
    prod = a.astype(np.int64)[..., :, None] * b.astype(np.int64)[None, None]  # (2, 5, K, N)
    if k % 2:
        prod = np.concatenate([prod, np.zeros((2, 5, 1, 12), np.int64)], 2)
    pair = prod.reshape(2, 5, -1, 2, 12).sum(3)
    corr = a_zp * b.astype(np.int64).sum(0)
    for saturate in (True, False):
        acc = (np.clip(pair, -32768, 32767) if saturate else pair).sum(2) - corr
        if op == "MatMulInteger":
            want = acc.astype(np.float64)
        elif op == "QLinearMatMul":
            want = np.clip(np.rint(acc * 0.1 * 0.01 / (0.001 * 255 * 127 * k / 40)) + 128, 0, 255)
        else:
            want = acc * 0.1 * 0.01
        rewritten, count = emulate(fused_graph(path), saturate=saturate)
        assert count == 1
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        got = ort.InferenceSession(rewritten.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            None, {"a": a})[0].astype(np.float64)
        tol = 1.0 if op == "QLinearMatMul" else 1e-3 * np.abs(want).max()
        assert np.abs(got - want).max() <= tol, (op, saturate)
        if saturate and HOST_PAIRS:
            host = session_for(path, "int16-pairs").run(None, {"a": a})[0].astype(np.float64)
            assert np.abs(host - want).max() <= tol


def test_a_fused_op_it_cannot_model_is_an_error():
    w = RNG.integers(0, 255, size=(4, 3, 3, 3)).astype(np.uint8)
    node = helper.make_node("ConvInteger", ["x", "w"], ["y"], kernel_shape=[3, 3])
    m = _model([node], [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 8, 8])],
               [helper.make_tensor_value_info("y", TensorProto.INT32, None)], [numpy_helper.from_array(w, "w")])
    with pytest.raises(NotModeled, match="ConvInteger is not modelled"):
        emulate(m)


def _matmulnbits(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, block: int, level: int):
    """One MatMulNBits node (4 bits; codes (N, K), K padded to whole blocks with zero codes; two codes a
    byte, the low nibble first; zero points two a byte) and an ONNX Runtime session of it, one thread."""
    n, k = codes.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.uint8)
    padded[:, :k] = codes
    packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).reshape(n, blocks, block // 2)
    zp = np.zeros((n, -(-blocks // 2)), np.uint8)
    for j in range(blocks):
        zp[:, j // 2] |= zeros[:, j] << (4 * (j % 2))
    node = helper.make_node("MatMulNBits", ["a", "b", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=block, accuracy_level=level)
    m = _model([node], [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
               [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales.reshape(-1), "s"),
                numpy_helper.from_array(zp.reshape(-1), "z")], opset=17)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k,block", [(576, 128), (1536, 128), (576, 32)])
def test_matmulnbits_int8_compute_is_exact_integer_arithmetic_on_this_cpu(k, block):
    """4-bit MatMulNBits with int8 compute (accuracy level 4, the export's default) computes on this
    machine's kernels what ``matmulnbits_int8`` computes exactly, whatever the ISA: its only loss is the
    activations' rounding to int8 per block, not a saturating sum. Activations with outlier channels
    (as a residual stream has), and the largest pair sums there can be (every activation code +-127,
    every weight code 15 above its zero point)."""
    n = 64
    blocks = -(-k // block)
    codes = RNG.integers(0, 16, size=(n, k)).astype(np.uint8)
    zeros = RNG.integers(0, 16, size=(n, blocks)).astype(np.uint8)
    scales = (RNG.random((n, blocks)) * 0.02 + 0.005).astype(np.float32)
    a = RNG.standard_normal((16, k)).astype(np.float32)
    a[:, [3, 77, 300]] *= 40.0
    exact = a.astype(np.float64) @ ((codes.astype(np.float64) - np.repeat(zeros, block, 1)[:, :k])
                                    * np.repeat(scales, block, 1)[:, :k]).T
    y = _matmulnbits(codes, zeros, scales, block, level=4).run(None, {"a": a})[0]
    model = matmulnbits_int8(a, codes, zeros, scales, block)
    assert np.abs(y - model).max() <= 1e-5 * np.abs(model).max()
    assert 1e-3 < np.abs(y - exact).max() / np.abs(exact).max() < 0.1  # int8 compute is really int8: it rounds
    y0 = _matmulnbits(codes, zeros, scales, block, level=0).run(None, {"a": a})[0]
    assert np.abs(y0 - exact).max() <= 1e-5 * np.abs(exact).max()  # fp32 compute: the dequantized weights
    sign = np.where(RNG.random((4, blocks)) < 0.5, -1.0, 1.0).astype(np.float32)
    worst = (3.0 * sign).repeat(block, 1)[:, :k]  # one sign a block: every activation code +-127
    codes_w, zeros_w = np.full((n, k), 15, np.uint8), np.zeros((n, blocks), np.uint8)  # every weight code - zero = 15
    y = _matmulnbits(codes_w, zeros_w, scales, block, level=4).run(None, {"a": worst})[0]
    model = matmulnbits_int8(worst, codes_w, zeros_w, scales, block)
    assert np.abs(model).max() > 0
    assert np.abs(y - model).max() <= 1e-5 * np.abs(model).max()
