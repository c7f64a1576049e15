"""TensorRT's Q/DQ flavour: converting uint8/asymmetric Q/DQ (ONNX Runtime's U8S8) into signed
symmetric int8 placed where TensorRT fuses it, or refusing with the reason."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.runtimes.tensorrt.qdq import QdqRefusal, convert_to_tensorrt, symmetric_per_channel

S_IN, Z_IN = 0.02, 128  # input range [-2.56, 2.54]
S_ACT = 0.01  # ReLU output, uint8 zero point 0: range [0, 2.55]


def _u8s8_graph(weights_uint8: bool = False) -> onnx.ModelProto:
    """x -> Q/DQ(u8) -> Conv(W: DQ int8 per channel or uint8 asymmetric, b: DQ int32) -> Relu -> Q/DQ(u8)
    -> Add(residual, with the input's DQ) -> Q/DQ(u8) -> Sigmoid -> out."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3
    inits = [numpy_helper.from_array(np.array(S_IN, np.float32), "s_in"),
             numpy_helper.from_array(np.array(Z_IN, np.uint8), "z_in"),
             numpy_helper.from_array(np.array(S_ACT, np.float32), "s_act"),
             numpy_helper.from_array(np.array(0, np.uint8), "z_act"),
             numpy_helper.from_array(np.array(0.03, np.float32), "s_add"),
             numpy_helper.from_array(np.array(100, np.uint8), "z_add")]
    if weights_uint8:  # asymmetric per-channel uint8 weights
        lo, hi = w.reshape(4, -1).min(1), w.reshape(4, -1).max(1)
        ws = ((hi - lo) / 255).astype(np.float32)
        wz = np.round(-lo / ws).astype(np.uint8)
        wq = np.clip(np.round(w / ws[:, None, None, None]) + wz[:, None, None, None], 0, 255).astype(np.uint8)
    else:
        wq, ws = symmetric_per_channel(w, 0)
        wz = np.zeros(4, np.int8)
    inits += [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"), numpy_helper.from_array(wz, "wz"),
              numpy_helper.from_array(np.array([10, -20, 30, 0], np.int32), "bq"),
              numpy_helper.from_array((S_IN * ws).astype(np.float32), "bs")]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s_in", "z_in"], ["xd"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="dq_w", axis=0),
        helper.make_node("DequantizeLinear", ["bq", "bs"], ["b"], name="dq_b", axis=0),
        helper.make_node("Conv", ["xd", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s_act", "z_act"], ["rq"], name="q_act"),
        helper.make_node("DequantizeLinear", ["rq", "s_act", "z_act"], ["rd"], name="dq_act"),
        helper.make_node("Add", ["rd", "xd"], ["a"], name="residual"),
        helper.make_node("QuantizeLinear", ["a", "s_add", "z_add"], ["aq"], name="q_add"),
        helper.make_node("DequantizeLinear", ["aq", "s_add", "z_add"], ["ad"], name="dq_add"),
        helper.make_node("Sigmoid", ["ad"], ["out"], name="sigmoid"),
    ]
    graph = helper.make_graph(nodes, "u8s8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _consts(m: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}


def test_u8s8_graph_becomes_signed_symmetric_with_ranges_kept():
    m = _u8s8_graph()
    conv, report = convert_to_tensorrt(m)
    onnx.checker.check_model(conv)
    c = _consts(conv)
    qs = [n for n in conv.graph.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 2  # the pair in front of Sigmoid is gone: TensorRT would not fuse it
    for q in qs:
        assert c[q.input[2]].dtype == np.int8 and int(c[q.input[2]]) == 0
    by_tensor = {r.tensor: r for r in report.ranges}
    # the input's calibrated range [0.02 * (0 - 128), 0.02 * (255 - 128)] -> max(|lo|, |hi|) / 127
    assert (by_tensor["x"].lo, by_tensor["x"].hi) == pytest.approx((-2.56, 2.54))
    assert by_tensor["x"].scale_after == pytest.approx(2.56 / 127)
    assert by_tensor["r"].scale_after == pytest.approx(2.55 / 127)  # a one-sided range: one bit less resolution
    assert (report.activations_converted, report.biases_folded, report.pairs_dropped, report.weights_kept) == (3, 1, 1, 1)
    # the int32 bias became a float constant with the same values
    conv_node = next(n for n in conv.graph.node if n.op_type == "Conv")
    assert np.allclose(c[conv_node.input[2]], np.array([10, -20, 30, 0]) * S_IN * c["ws"])
    assert not any(n.op_type == "DequantizeLinear" and c.get(n.input[0], np.zeros(1)).dtype == np.int32
                   for n in conv.graph.node)
    # Q/DQ stays on the conv input, the conv weights and both residual-add inputs
    producers = {o: n for n in conv.graph.node for o in n.output}
    assert producers[conv_node.input[0]].op_type == producers[conv_node.input[1]].op_type == "DequantizeLinear"
    add = next(n for n in conv.graph.node if n.op_type == "Add")
    assert all(producers[i].op_type == "DequantizeLinear" for i in add.input)
    sigmoid = next(n for n in conv.graph.node if n.op_type == "Sigmoid")
    assert sigmoid.input[0] == add.output[0]  # reads the float sum
    # numerically: the same function within the quantization steps of the coarser symmetric grids
    x = np.random.default_rng(1).uniform(-2.5, 2.5, (1, 4, 8, 8)).astype(np.float32)
    assert np.abs(_run(conv, x) - _run(m, x)).max() < 0.03
    assert "3 activation Q/DQ made signed symmetric int8" in report.summary()


def test_asymmetric_uint8_weights_are_requantized_symmetric_per_channel():
    m = _u8s8_graph(weights_uint8=True)
    before = _consts(m)
    w_before = (before["wq"].astype(np.float32) - before["wz"][:, None, None, None]) * before["ws"][:, None, None, None]
    conv, report = convert_to_tensorrt(m)
    assert report.weights_requantized == 1
    dq_w = next(n for n in conv.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == "w")
    c = _consts(conv)
    q, s, z = c[dq_w.input[0]], c[dq_w.input[1]], c[dq_w.input[2]]
    assert q.dtype == np.int8 and s.shape == (4,) and not z.any() and np.abs(q).max() == 127
    assert next(a.i for a in dq_w.attribute if a.name == "axis") == 0
    w_after = q.astype(np.float32) * s[:, None, None, None]
    assert np.all(np.abs(w_after - w_before) <= s[:, None, None, None] / 2 + 1e-7)


def test_symmetric_int8_graph_is_kept_as_it_is():
    m = _u8s8_graph()
    once, _ = convert_to_tensorrt(m)
    twice, report = convert_to_tensorrt(once)
    assert not report.changed and report.activations_kept == 2
    assert report.summary() == "the graph's Q/DQ already has TensorRT's form (signed symmetric int8), kept as it is"


def _qlinear_graph() -> onnx.ModelProto:
    inits = [numpy_helper.from_array(np.array(v, t), n) for n, v, t in (
        ("s", 0.1, np.float32), ("z", 0, np.uint8), ("wq", np.ones((2, 2, 1, 1)), np.int8), ("ws", 0.1, np.float32),
        ("wz", 0, np.int8))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
             helper.make_node("QLinearConv", ["xq", "s", "z", "wq", "ws", "wz", "s", "z"], ["yq"], name="qconv"),
             helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["y"], name="dq")]
    g = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _per_channel_activation_graph() -> onnx.ModelProto:
    m = _u8s8_graph()
    for init in m.graph.initializer:
        if init.name == "s_in":
            init.CopyFrom(numpy_helper.from_array(np.full(4, S_IN, np.float32), "s_in"))
        if init.name == "z_in":
            init.CopyFrom(numpy_helper.from_array(np.full(4, Z_IN, np.uint8), "z_in"))
    return m


def _dynamic_scale_graph() -> onnx.ModelProto:
    m = _u8s8_graph()
    m.graph.node.insert(0, helper.make_node("ReduceMax", ["x"], ["s_dyn"], name="amax", keepdims=0))
    m.graph.node[1].input[1] = "s_dyn"
    return m


@pytest.mark.parametrize("make, message", [
    (_qlinear_graph, "the graph uses operator-style quantization (QLinearConv, e.g. node 'qconv'), which TensorRT "
                     "does not import; quantize to Q/DQ instead"),
    (_per_channel_activation_graph, "QuantizeLinear 'q_in' quantizes activation 'x' per channel; TensorRT quantizes "
                                    "activations per tensor"),
    (_dynamic_scale_graph, "QuantizeLinear 'q_in' computes its scale at run time (dynamic quantization)"),
])
def test_refusals_say_why(make, message):
    with pytest.raises(QdqRefusal) as e:
        convert_to_tensorrt(make())
    assert str(e.value).startswith(message) and e.value.exit_code == 2


def test_asymmetric_blocked_int4_weights_are_refused():
    codes = np.full((64, 4), 9, np.uint8)
    inits = [helper.make_tensor("wq", TensorProto.UINT4, [64, 4], codes.flatten().tolist()),
             numpy_helper.from_array(np.full((2, 4), 0.1, np.float32), "ws"),
             helper.make_tensor("wz", TensorProto.UINT4, [2, 4], [8] * 8)]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], name="dq4", axis=0, block_size=32),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "w4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    with pytest.raises(QdqRefusal, match="DequantizeLinear 'dq4' holds asymmetric 32-blocked 4-bit weights"):
        convert_to_tensorrt(m)


def test_cli_build_refuses_an_unconvertible_graph_and_writes_nothing(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from edgekit.cli import cli
    from edgekit.runtimes.tensorrt import device

    monkeypatch.setattr(device, "probe_local", lambda trtexec=None: device.DeviceInfo())
    monkeypatch.setattr(device, "import_tensorrt", lambda: None)
    path = tmp_path / "qlinear.onnx"
    onnx.save(_qlinear_graph(), str(path))
    res = CliRunner().invoke(cli, ["build", str(path), "--target", "jetson-agx-orin-64", "--precision", "int8",
                                   "-o", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert "error: the graph uses operator-style quantization (QLinearConv" in res.output
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["qlinear.onnx"]


def test_bundle_from_a_u8s8_file_builds_the_converted_graph_and_says_so(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from edgekit.artifact import read_manifest
    from edgekit.cli import cli
    from edgekit.runtimes.tensorrt import device

    monkeypatch.setattr(device, "probe_local", lambda trtexec=None: device.DeviceInfo())
    monkeypatch.setattr(device, "import_tensorrt", lambda: None)
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "u8s8.onnx"
    onnx.save(_u8s8_graph(), str(path))
    res = CliRunner().invoke(cli, ["build", str(path), "--target", "jetson-agx-orin-64", "--precision", "int8",
                                   "-o", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("INT8 converted to TensorRT's Q/DQ form: 3 activation Q/DQ made signed symmetric int8")
    assert "accuracy cost not measured: 'u8s8.onnx' arrived already quantized: its float model is not known" in lines[0]
    assert lines[-1] == (f"wrote a TensorRT build bundle for jetson-agx-orin-64: TensorRT is not installed here, "
                         f"nothing was built; run build.sh on the device (in {tmp_path / 'b'})")
    m = read_manifest(tmp_path / "b")
    assert m.kind == "bundle" and m.config["status"]["built"] is False and m.config["status"]["measured"] is False
    assert m.files["onnx_tensorrt"] == "onnx/model_tensorrt.onnx"
    assert "--onnx=onnx/model_tensorrt.onnx" in m.config["trtexec"]["argv"]
    acc = m.metrics["int8_for_tensorrt"]["accuracy"]
    assert acc["measured"] is False and acc["converted_vs_given"]["mean_cosine"] > 0.99
    built = onnx.load(str(Path(tmp_path / "b") / m.files["onnx_tensorrt"]))
    zps = {i.name: numpy_helper.to_array(i) for i in built.graph.initializer}
    assert all(zps[n.input[2]].dtype == np.int8 for n in built.graph.node if n.op_type == "QuantizeLinear")
    assert "**Status: nothing here was built or measured.**" in (tmp_path / "b" / "README.md").read_text()


# one of the longest real-model runs: with -m matrix, apart from CI (CI's 20 minutes)
@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1800)
def test_efficientnet_lite0_int8_for_orin_is_symmetric_passes_the_check_and_costs_little(tmp_path, monkeypatch):
    """The real path: `compress --bits 8` for the default (CPU, U8S8) target, then `build` for Orin."""
    from click.testing import CliRunner

    from edgekit.artifact import read_manifest
    from edgekit.cli import cli
    from edgekit.compress import StepContext, compress
    from edgekit.compress.int8.config import Int8Config
    from edgekit.runtimes.tensorrt import device
    from edgekit.runtimes.tensorrt.lint import lint_onnx

    pytest.importorskip("efficientnet_lite_pytorch")
    monkeypatch.setattr(device, "probe_local", lambda trtexec=None: device.DeviceInfo())
    monkeypatch.setattr(device, "import_tensorrt", lambda: None)
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    int8 = compress("efficientnet-lite0", [("int8", Int8Config(calib_samples=16, calib_method="minmax",
                                                       rounding="nearest", eval_samples=16))],
                    tmp_path / "int8", StepContext(progress=False))
    # this machine's scheme (7-bit weights where its int8 kernels sum in int16 pairs): the Orin bundle is made
    # from it on any x86 machine, its parity judged with Q/DQ in float as TensorRT computes them
    from edgekit.compress.int8.step import resolve_scheme

    assert read_manifest(int8).metrics["int8"]["scheme"] == resolve_scheme(Int8Config(), None)
    res = CliRunner().invoke(cli, ["build", str(int8), "--target", "jetson-agx-orin-64", "--precision", "int8",
                                   "-o", str(tmp_path / "orin")])
    assert res.exit_code == 0, res.output
    m = read_manifest(tmp_path / "orin")
    conv = m.metrics["int8_for_tensorrt"]
    assert conv["activations_converted"] == 60 and conv["biases_folded"] == 50 and conv["weights_kept"] == 50
    acc = conv["accuracy"]
    assert acc["measured"] is True and acc["samples"] == 64 and acc["reference"] == "the float model efficientnet-lite0"
    # the symmetric ranges cost little against the float model (64 calibration images)
    assert acc["converted"]["top5_agreement"] >= 0.9 and acc["converted"]["mean_kl"] < 0.2
    built = onnx.load(str(tmp_path / "orin" / m.files["onnx_tensorrt"]))
    c = _consts(built)
    qs = [n for n in built.graph.node if n.op_type == "QuantizeLinear"]
    assert len(qs) == 59 and all(c[q.input[2]].dtype == np.int8 and int(c[q.input[2]]) == 0 for q in qs)
    assert lint_onnx(tmp_path / "orin" / m.files["onnx_tensorrt"], "jetson-agx-orin-64").exit_code == 0
    # the graph as compressed for the CPU would not build on the Orin: uint8 and int32 DequantizeLinear
    given = lint_onnx(tmp_path / "orin" / m.files["onnx"], "jetson-agx-orin-64")
    assert given.exit_code == 1 and {f.check for f in given.errors} == {"qdq"}
    assert "cost against the float model efficientnet-lite0 on 64 samples" in res.output
