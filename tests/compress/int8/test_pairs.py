"""The pair-safe weight grid (compress/int8/pairs.py, scheme "u8s8p"): which products the x86 kernels without
VNNI pair, the scale at which round-to-nearest never overflows their int16 pair sums, GPTQ on that grid,
and engines that compute exactly what int32 sums would, on every machine (through the numerical model of
those kernels) and on this one's own kernels (ONNX Runtime, OpenVINO)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from edgekit.compress.int8 import pairs
from edgekit.compress.int8.rounding import gptq_round, output_error
from edgekit.onnx_int8_kernels import session_for
from edgekit.targets.cpu_isa import host_int8_kernel

RNG = np.random.default_rng(0)


def test_pairings_follow_each_runtimes_reduction_order():
    # a matmul / linear layer: adjacent K, the odd one alone
    assert pairs.pairings((5, 7)).tolist() == [[0, 1], [2, 3], [4, 5], [6, -1]]
    # a 1x1 convolution: adjacent input channels
    assert pairs.pairings((8, 4, 1, 1)).tolist() == [[0, 1], [2, 3]]
    # an even channel count: MLAS's (kh, kw, c) pairs are oneDNN's channel pairs at each tap; row index c * 4 + tap
    assert sorted(map(tuple, pairs.pairings((1, 2, 2, 2)).tolist())) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # RGB input (3 channels, 2 taps): MLAS's (t0c0, t0c1), (t0c2, t1c0), (t1c1, t1c2) and oneDNN's
    # (t0c0, t0c1), (t0c2, -), (t1c0, t1c1), (t1c2, -); row index c * 2 + tap; the shared pair once
    got = sorted(map(tuple, pairs.pairings((1, 3, 2, 1)).tolist()))
    assert got == sorted([(0, 2), (4, 1), (3, 5), (4, -1), (1, 3), (5, -1)])
    assert pairs.partners((1, 3, 2, 1)) == [[], [], [0], [1], [1], [3]]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), cin=st.integers(1, 9), k=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_round_to_nearest_on_the_safe_scale_never_overflows(rows, cin, k, seed):
    w = np.random.default_rng(seed).standard_normal((rows, cin, k, k)) * np.random.default_rng(seed + 1).uniform(
        0.01, 10, (rows, 1, 1, 1))
    scale = pairs.safe_scale(w)
    codes = np.round(w / scale.reshape(-1, 1, 1, 1))
    assert pairs.violations(codes) == 0 and np.abs(codes).max() <= 127
    amax = np.abs(w).reshape(rows, -1).max(1)
    # between the 8-bit grid's scale and the 7-bit grid's (64 codes on the largest |w|)
    assert np.all(scale >= amax / 127 * (1 - 1e-12)) and np.all(scale <= amax / 63.75 * (1 + 1e-12))


def test_the_safe_scale_is_finer_than_7_bits_on_real_sized_layers():
    w = RNG.standard_normal((64, 96, 1, 1))
    bits = np.log2((np.abs(w).reshape(64, -1).max(1) / 64) / pairs.safe_scale(w))
    assert 0.3 < bits.mean() < 1.0  # of the 1 bit that 8-bit weights would add


def test_trim_puts_overflowing_pairs_on_the_bound_nearest_their_values():
    codes = np.array([[100, 60, -90, -70, 127, -127, 5, 3]], np.float64)
    ratios = codes + np.array([[0.3, -0.2, 0, 0, 0, 0, 0, 0]])
    out = pairs.trim(codes, ratios)
    # (100, 60) -> a + b = 128 nearest (100.3, 59.8): a = round((100.3 - 59.8 + 128) / 2) = 84
    assert out.tolist() == [[84, 44, -74, -54, 127, -127, 5, 3]]
    assert pairs.violations(out) == 0 and pairs.violations(codes) == 2
    rgb = np.full((2, 3, 3, 3), 100.0)  # every code in two pairs (MLAS's and oneDNN's)
    assert pairs.violations(pairs.trim(rgb)) == 0


def test_gptq_on_the_pair_safe_grid_keeps_every_pair_and_beats_round_to_nearest():
    torch.manual_seed(0)
    rows, cin = 16, 24
    W = torch.randn(rows, cin, 3, 3)
    X = torch.randn(512, cin * 9) @ torch.randn(cin * 9, cin * 9) * 0.3  # correlated inputs, GPTQ's case
    H = 2 * X.t() @ X / len(X)
    scale = torch.from_numpy(pairs.safe_scale(W.numpy())).float()
    W2 = W.reshape(rows, -1)
    Q = gptq_round(W2, scale, H, pair_partners=pairs.partners(tuple(W.shape)))
    codes = (Q / scale[:, None]).round().reshape(W.shape).numpy()
    assert pairs.violations(codes) == 0 and np.abs(codes).max() <= 128
    rtn = torch.round(W2 / scale[:, None]) * scale[:, None]
    assert output_error(W2, Q, H) < 0.7 * output_error(W2, rtn, H)
    unbounded = gptq_round(W2, scale, H)  # the same solve without the pairs: some overflow
    assert pairs.violations((unbounded / scale[:, None]).round().reshape(W.shape).numpy()) > 0


def _qlinearconv(w: np.ndarray, size: int = 6) -> object:
    """One QLinearConv, uint8 input (zero point 0), the given int8 weights, a wide output grid."""
    cout, cin, k, _ = w.shape
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "xs"), numpy_helper.from_array(np.array(0, np.uint8), "xz"),
             numpy_helper.from_array(w.astype(np.int8), "w"), numpy_helper.from_array(np.ones(cout, np.float32), "ws"),
             numpy_helper.from_array(np.zeros(cout, np.int8), "wz"),
             numpy_helper.from_array(np.array(4 * 255 * 128 * cin * k * k / 255, np.float32), "ys"),
             numpy_helper.from_array(np.array(128, np.uint8), "yz")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"],
                            kernel_shape=[k, k], pads=[k // 2] * 4)
    m = helper.make_model(helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "x", TensorProto.UINT8, [1, cin, size, size])], [helper.make_tensor_value_info("y", TensorProto.UINT8, None)],
        inits), opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("shape", [(8, 16, 1, 1), (8, 3, 3, 3), (8, 6, 3, 3)])
def test_pair_safe_weights_compute_what_int32_sums_compute_on_the_saturating_kernels(tmp_path, shape):
    """Weights from ``trim`` of full 8-bit codes, every activation code 255 (the worst case): the numerical
    model of the int16-pair kernels gives what exact int32 sums give (on any machine), as does this
    machine's ONNX Runtime; the untrimmed codes saturate in the model."""
    import onnx

    full = np.random.default_rng(1).integers(60, 128, size=shape) * np.random.default_rng(2).choice([-1, 1], size=shape)
    safe = pairs.trim(full.astype(np.float64)).astype(np.int8)
    x = np.full((1, shape[1], 6, 6), 255, np.uint8)
    out = {}
    for name, w in (("full", full), ("safe", safe)):
        path = tmp_path / f"{name}.onnx"
        onnx.save(_qlinearconv(w), str(path))
        out[name] = {s: session_for(path, s).run(None, {"x": x})[0].astype(np.int32) for s in ("int16-pairs", "int32")}
        import onnxruntime as ort

        out[name]["host"] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(out["safe"]["int16-pairs"], out["safe"]["int32"])
    assert np.array_equal(out["safe"]["host"], out["safe"]["int32"])
    assert not np.array_equal(out["full"]["int16-pairs"], out["full"]["int32"])


@pytest.mark.skipif(not host_int8_kernel().saturates, reason="only x86 CPUs without VNNI pair their products in int16")
def test_each_runtime_pairs_the_products_of_an_rgb_convolution_as_said(tmp_path):
    """The pairings ``pairs.pairings`` assumes, measured on this CPU's own kernels: one 3x3 convolution over 3
    channels, codes 100 on one pair only. ONNX Runtime (MLAS) saturates on a pair across two taps,
    OpenVINO (oneDNN) on two channels at one tap, and each computes the other's pair exactly."""
    import onnx
    import onnxruntime as ort

    ov = pytest.importorskip("openvino")
    x = np.full((1, 3, 6, 6), 255, np.uint8)
    saturates = {}
    for label, (a, b) in {"across taps": ((0, 2, 0, 0), (0, 0, 0, 1)), "one tap": ((0, 0, 0, 1), (0, 1, 0, 1))}.items():
        w = np.zeros((1, 3, 3, 3), np.int8)
        w[a], w[b] = 100, 100  # (c, kh, kw): t0c2 + t1c0 is MLAS's pair; t1c0 + t1c1 is oneDNN's
        path = tmp_path / f"{label}.onnx"
        onnx.save(_qlinearconv(w), str(path))
        exact = session_for(path, "int32").run(None, {"x": x})[0]
        got_ort = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        # OpenVINO reads the Q/DQ form; the same integers through DequantizeLinear -> Conv -> QuantizeLinear
        got_ov = ov.Core().compile_model(str(_as_qdq(path, tmp_path)), "CPU")(x.astype(np.float32))[0]
        saturates[label] = (not np.array_equal(got_ort, exact), not np.allclose(got_ov, _qdq_exact(w, x), rtol=1e-3))
    assert saturates == {"across taps": (True, False), "one tap": (False, True)}


def _as_qdq(path, tmp_path):
    """The QLinearConv of ``_qlinearconv`` as float input -> Q -> DQ -> Conv(DQ(w)) (float output)."""
    import onnx

    m = onnx.load(str(path))
    inits = {i.name: i for i in m.graph.initializer}
    nodes = [helper.make_node("QuantizeLinear", ["xf", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["y"], kernel_shape=[3, 3], pads=[1] * 4)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("xf", TensorProto.FLOAT, [1, 3, 6, 6])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [inits[k] for k in ("xs", "xz", "w", "ws", "wz")])
    out = tmp_path / (path.stem + "_qdq.onnx")
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(out))
    return out


def _qdq_exact(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return torch.nn.functional.conv2d(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w.astype(np.float64)),
                                      padding=1).numpy()


def test_an_onnx_file_quantized_from_its_graph_gets_pair_safe_weights_and_fuses(tiny_onnx, tmp_path):
    """Scheme "u8s8p" on an ONNX file (placement "all": ONNX Runtime's quantizer writes 8-bit weights): the
    weights are re-rounded onto the pair-safe grid from the file's floats, the int32 bias follows the new
    scales so ONNX Runtime still fuses an integer QLinearConv, and on the int16-pair kernels the graph
    computes what int32 sums compute, on any machine."""
    import onnx

    from edgekit.compress.int8.onnx_graph import quantize_onnx_file
    from edgekit.onnx_int8_kernels import fused_graph
    from edgekit.sources.data import Samples

    x = np.random.default_rng(3).standard_normal((32, 3, 16, 16)).astype(np.float32)
    dst = tmp_path / "q.onnx"
    info = quantize_onnx_file(tiny_onnx, dst, Samples("s", "calib", {"input": x}), ["input"], None, 99.99, "u8s8p",
                              placement="all")
    assert info["weights_fitted_to_kernels"] == {"to_grid": 2}
    g = onnx.load(str(dst)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    weights = [inits[n.input[0]] for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
               and inits[n.input[0]].dtype == np.int8 and inits[n.input[0]].ndim >= 2]
    conv = next(w for w in weights if w.ndim == 4)  # (4, 3, 3, 3): RGB input, both pairings kept
    assert pairs.violations(conv) == 0 and np.abs(conv).max() > 64
    assert "QLinearConv" in [n.op_type for n in fused_graph(dst).graph.node]
    feed = {"input": x[:8]}
    exact = session_for(dst, "int32").run(None, feed)[0]
    np.testing.assert_array_equal(session_for(dst, "int16-pairs").run(None, feed)[0], exact)
    import onnxruntime as ort

    ref = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    assert np.linalg.norm(exact - ref) / np.linalg.norm(ref) < 0.05
