"""Roofline estimates (issue 8): the math on tiny hand-made ONNX graphs with known FLOPs and
bytes, crossover labelling, unknown ops, precisions, Q/DQ and 4-bit weights, and the
calibration fit on synthetic measurements. A hand-made target (peak 1 TFLOPS fp32,
100 GB/s, crossover 10 ops/byte) keeps the numbers checkable by hand."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.errors import BadInputError
from edgekit.estimate import ESTIMATE_NOTE, estimate, fit_efficiency, op_class
from edgekit.estimate.calibrate import (
    CalibrationCase,
    Measurement,
    Observation,
    calibrate,
    calibration_path,
    load_calibration,
    measure_cpu,
)

ONE = {c: 1.0 for c in ("conv", "depthwise-conv", "matmul", "attention", "elementwise", "normalization",
                        "reduction", "data-movement", "other", "memory")}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed_host_probe) -> None:
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    seed_host_probe()  # this machine's probe, measured once per session, not once per test


@pytest.fixture
def board(tmp_path: Path) -> Path:
    """A user target: 1 TFLOPS fp32, 2 fp16, 4 int8 TOPS, 100 GB/s, no kernel overhead."""
    p = tmp_path / "board.yaml"
    p.write_text("name: board\ndescription: test board\nkind: gpu\nruntimes: [onnxruntime]\n"
                 "precisions: [fp32, fp16, int8, int4]\npeak_tops: {fp32: 1.0, fp16: 2.0, int8: 4.0}\n"
                 "memory_bandwidth_gbs: 100\nkernel_overhead_us: 0\n")
    return p


def _model(nodes, inputs, outputs, inits, opset=21, domains=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    ops = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    return helper.make_model(graph, opset_imports=ops)


def _rand(*shape, dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _matmul(m: int = 64, k: int = 128, n: int = 256):
    w = numpy_helper.from_array(_rand(k, n), "w")
    return _model([helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")],
                  [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", m, k])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])


def _node(est, name):
    return next(n for n in est.nodes if n.name == name)


def test_matmul_ops_bytes_and_compute_bound(board: Path) -> None:
    est = estimate(_matmul(), board, batch=2, efficiency=ONE)
    n = _node(est, "mm")
    assert n.ops == 2 * 2 * 64 * 128 * 256
    assert n.weight_bytes == 128 * 256 * 4
    assert n.activation_bytes == (2 * 64 * 128 + 2 * 64 * 256) * 4
    assert n.crossover == pytest.approx(10.0)  # 1e12 / 100e9
    assert n.intensity == pytest.approx(n.ops / (n.weight_bytes + n.activation_bytes))
    assert n.intensity > 10 and n.bound == "compute"
    # shape factor: M=128, N=256 fill 16x32 tiles; K=128 against a 32-deep pipeline: 128 / 160
    assert n.efficiency == pytest.approx(0.8)
    assert n.time_ms == pytest.approx(n.ops / (1e12 * 0.8) * 1e3)
    assert est.total_ms == pytest.approx(n.time_ms) and est.bound == "compute"
    assert est.kind == "estimate" and est.to_dict()["kind"] == "estimate"
    assert ESTIMATE_NOTE in est.render() and "ESTIMATE" in est.render()
    prof = est.to_profile()  # check/report read estimates like profiles, marked as estimated
    assert prof.source == "estimated" and prof.latency_ms.p99 == est.total_ms and ESTIMATE_NOTE in prof.warnings


def test_single_row_matmul_is_memory_bound_and_efficiency_scales(board: Path) -> None:
    est = estimate(_matmul(m=1), board, efficiency=ONE)
    n = _node(est, "mm")
    assert n.bound == "memory" and n.intensity < 10
    assert n.time_ms == pytest.approx((n.weight_bytes + n.activation_bytes) / 100e9 * 1e3)
    half = estimate(_matmul(m=1), board, efficiency={**ONE, "memory": 0.5})
    assert _node(half, "mm").time_ms == pytest.approx(2 * n.time_ms)


def test_precision_fp16_halves_bytes_and_doubles_peak(board: Path) -> None:
    fp32 = _node(estimate(_matmul(), board, efficiency=ONE), "mm")
    fp16 = _node(estimate(_matmul(), board, "fp16", efficiency=ONE), "mm")
    assert fp16.weight_bytes == fp32.weight_bytes / 2 and fp16.activation_bytes == fp32.activation_bytes / 2
    assert fp16.compute_ms == pytest.approx(fp32.compute_ms / 2)
    assert fp16.crossover == pytest.approx(20.0)


def test_precision_the_target_lacks_and_unknown_precision(board: Path) -> None:
    with pytest.raises(BadInputError, match=r"does not support precision 'bf16'.*fp32, fp16, int8, int4"):
        estimate(_matmul(), board, "bf16")
    with pytest.raises(BadInputError, match=r"unknown precision 'fp64'"):
        estimate(_matmul(), board, "fp64")


def test_conv_groups_depthwise_and_padding(board: Path) -> None:
    dw = numpy_helper.from_array(_rand(8, 1, 3, 3), "dw")
    pw = numpy_helper.from_array(_rand(16, 8, 3, 3), "pw")
    m = _model([helper.make_node("Conv", ["x", "dw"], ["h"], name="dwconv", group=8, pads=[1, 1, 1, 1]),
                helper.make_node("Conv", ["h", "pw"], ["y"], name="conv", pads=[1, 1, 1, 1], strides=[2, 2])],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 16, 16])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [dw, pw])
    est = estimate(m, board, efficiency=ONE)
    d, c = _node(est, "dwconv"), _node(est, "conv")
    assert d.op_class == "depthwise-conv" and c.op_class == "conv"
    assert d.ops == 2 * 8 * 16 * 16 * 9  # one input channel per group
    assert c.ops == 2 * (16 * 8 * 8) * 8 * 9  # stride 2: 8x8 outputs
    assert d.activation_bytes == (8 * 16 * 16 * 2) * 4 and d.weight_bytes == 8 * 9 * 4
    assert d.bound == "memory"
    times = [r["time_ms"] for r in est.op_classes]
    assert times == sorted(times, reverse=True) and sum(times) == pytest.approx(est.total_ms)


def test_matmulnbits_counts_4bit_weights(board: Path) -> None:
    k, n, block = 256, 128, 128
    blocks = k // block
    b = numpy_helper.from_array(np.zeros((n, blocks, block // 2), np.uint8), "b")
    scales = numpy_helper.from_array(np.ones(n * blocks, np.float32), "scales")
    m = _model([helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], name="q4", domain="com.microsoft",
                                 K=k, N=n, bits=4, block_size=block)],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 1, k])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [b, scales], domains=["com.microsoft"])
    est = estimate(m, board, efficiency=ONE)
    q = _node(est, "q4")
    assert q.op_class == "matmul" and q.precision == "int4" and q.quantized and q.known
    assert q.ops == 2 * k * n
    assert q.weight_bytes == n * k / 2 + n * blocks * 4
    assert q.activation_bytes == (k + n) * 4  # output shape from edgekit's MatMulNBits rule
    fp32 = _node(estimate(_matmul(m=1, k=k, n=n), board, efficiency=ONE), "mm")
    assert fp32.weight_bytes / q.weight_bytes > 7  # 4-bit codes + fp32 scales per 128


def test_int4_blocked_dequantizelinear_folds_into_the_matmul(board: Path) -> None:
    k, n = 256, 64
    w = helper.make_tensor("w_q", TensorProto.INT4, [k, n], np.zeros(k * n, np.int8).tolist())
    s = numpy_helper.from_array(np.ones((k // 128, n), np.float32), "w_s")
    m = _model([helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["w"], name="dq", axis=0, block_size=128),
                helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 1, k])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, s])
    est = estimate(m, board, efficiency=ONE)
    assert _node(est, "dq").status == "folded"
    mm = _node(est, "mm")
    assert mm.weight_bytes == pytest.approx(k * n / 2 + (k // 128) * n * 4)
    assert mm.precision == "int4" and mm.quantized
    assert est.precision == "int4"
    # a runtime's graph (fuse=False): the DQ runs, reading int4 and writing fp32
    raw = estimate(m, board, efficiency=ONE, fuse=False)
    assert _node(raw, "dq").status == "runs" and _node(raw, "dq").activation_bytes == k * n * 4


def test_qdq_conv_runs_int8_with_int8_activations(board: Path) -> None:
    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.int8), "w_q")
    ws = numpy_helper.from_array(np.ones(4, np.float32), "w_s")
    s = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    z = numpy_helper.from_array(np.array(128, np.uint8), "z")
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_in"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_in"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s"], ["wd"], name="dq_w", axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q_out"),
             helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq_out")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, ws, s, z])
    est = estimate(m, board, efficiency=ONE)
    conv = _node(est, "conv")
    assert conv.precision == "int8" and conv.quantized
    assert conv.activation_bytes == 3 * 8 * 8 * 1 + 4 * 8 * 8 * 1  # reads and writes uint8
    # int8 codes + per-channel scales, and the output quantizer's scale and zero point (fused)
    assert conv.weight_bytes == pytest.approx(4 * 27 * 1 + 4 * 4 + 4 + 1)
    assert conv.crossover == pytest.approx(40.0)  # int8 peak 4 TOPS / 100 GB/s
    status = {n.name: n.status for n in est.nodes}
    assert status == {"q_in": "runs", "dq_in": "view", "dq_w": "folded", "conv": "runs", "relu": "fused",
                      "q_out": "fused", "dq_out": "runs"}
    assert est.precision == "int8"


def test_epilogue_fused_only_for_engines(board: Path) -> None:
    m = _model([helper.make_node("MatMul", ["a", "w"], ["h"], name="mm"),
                helper.make_node("Relu", ["h"], ["y"], name="relu")],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 32])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
               [numpy_helper.from_array(_rand(32, 32), "w")])
    assert _node(estimate(m, board), "relu").status == "fused"
    raw = estimate(m, board, fuse=False)
    assert _node(raw, "relu").status == "runs" and _node(raw, "relu").ops == 32


def test_unknown_op_is_counted_memory_bound_and_warned(board: Path) -> None:
    m = _model([helper.make_node("Relu", ["x"], ["h"], name="relu"),
                helper.make_node("Frobnicate", ["h"], ["y"], name="frob", domain="my.ops")],
               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1000])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [], domains=["my.ops"])
    est = estimate(m, board, efficiency=ONE)
    f = _node(est, "frob")
    assert not f.known and f.op_class == "other" and f.bound == "memory" and f.ops == 0
    assert f.activation_bytes == 2 * 1000 * 4  # output assumed shaped like the input
    assert est.unknown_ops == {"Frobnicate": 1}
    assert any("Frobnicate x1" in w and "memory-bound" in w for w in est.warnings)
    assert "warning:" in est.render()


def test_dynamic_dims_bound_and_reported(board: Path) -> None:
    w = numpy_helper.from_array(_rand(16, 16), "w")
    m = _model([helper.make_node("MatMul", ["a", "w"], ["y"], name="mm")],
               [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "sequence", 16])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    est = estimate(m, board, batch=3, dims={"sequence": 5})
    assert est.dims == {"batch": 3, "sequence": 5}
    assert _node(est, "mm").ops == 2 * 3 * 5 * 16 * 16
    est1 = estimate(m, board)
    assert any("'sequence'" in w and "set to 1" in w for w in est1.warnings)


def test_op_classes() -> None:
    assert op_class("MatMulNBits") == "matmul" and op_class("QLinearConv") == "conv"
    assert op_class("Softmax") == "normalization" and op_class("GlobalAveragePool") == "reduction"
    assert op_class("Transpose") == "data-movement" and op_class("Add") == "elementwise"
    assert op_class("NoSuchOp") == "other"


def test_fit_recovers_known_efficiencies() -> None:
    rng = np.random.default_rng(1)
    true = {"conv": 0.25, "matmul": 0.6, "elementwise": 2.0}
    obs = []
    for _ in range(60):
        key = ["conv", "matmul", "elementwise"][rng.integers(3)]
        base = float(rng.uniform(0.01, 2.0))
        obs.append(Observation({key: base}, base / true[key] + 0.004))
    eff, overhead, kept = fit_efficiency(obs, {"conv": 0.5, "matmul": 0.5, "elementwise": 0.5, "other": 0.3})
    for k, v in true.items():
        assert eff[k] == pytest.approx(v, rel=0.01)
    assert overhead == pytest.approx(0.004, rel=0.05)
    assert eff["other"] == 0.3 and kept == []


def test_calibration_on_synthetic_measurements_saves_and_is_used(board: Path) -> None:
    # measured = roofline at 0.2 of the bandwidth for a memory-bound matmul: the fit must find 0.2
    # (under the memory-roof key "matmul@mem") and the error vanish
    model = _matmul(m=1)
    before = estimate(model, board, fuse=False, calibrated=False)
    node = _node(before, "mm")
    base = node.memory_ms * node.memory_efficiency  # the bandwidth roof at efficiency 1
    meas = Measurement(model="mm", graph=model, source=model, p50_ms=base / 0.2, nodes={"mm": base / 0.2},
                       node_ops={"mm": "MatMul"}, runtime="onnxruntime", threads=1, dims={}, batch=1, cv=0.0)
    report = calibrate([], board, measurements=[meas])
    assert report.efficiency_after["matmul@mem"] == pytest.approx(0.2, rel=0.02)
    assert report.efficiency_after["matmul"] == 0.6  # the compute roof keeps its prior
    assert abs(report.models[0]["error_after"]) < 0.02 and report.models[0]["error_before"] < -0.5
    assert report.classes[0]["key"] == "matmul@mem"
    assert Path(report.saved_to) == calibration_path(board) == board.with_name("board.efficiency.json")
    saved = load_calibration(board)
    assert saved is not None and saved["efficiency"]["matmul@mem"] == pytest.approx(0.2, rel=0.02)
    after = estimate(model, board)
    assert after.calibration == str(board.with_name("board.efficiency.json"))
    assert _node(after, "mm").memory_efficiency == pytest.approx(0.2, rel=0.02)
    assert after.total_ms == pytest.approx(4 * estimate(model, board, calibrated=False).total_ms, rel=0.03)  # 0.8 -> 0.2
    assert "calibrated" in after.render()
    assert json.loads(Path(report.saved_to).read_text())["target"] == "board"


def test_builtin_target_calibration_lives_in_the_cache(tmp_path: Path) -> None:
    assert calibration_path("cpu") == tmp_path / "cache" / "targets" / "cpu.efficiency.json"


def test_real_calibration_loop_on_this_cpu(tiny_onnx: Path) -> None:
    """The whole loop with ONNX Runtime on the tiny graph: build, time, node profile, fit, save."""
    m = measure_cpu(tiny_onnx, "cpu", duration_s=0.1, iterations=10, node_iterations=3)
    assert m.p50_ms > 0 and m.nodes
    report = calibrate([CalibrationCase(tiny_onnx)], "cpu", measurements=[m])
    assert report.models[0]["measured_ms"] == m.p50_ms
    assert math.isfinite(report.models[0]["error_after"]) and report.saved_to
    assert "calibration" in report.render() and load_calibration("cpu") is not None
    assert estimate(tiny_onnx, "cpu").calibration is not None


def test_cli_estimate_table_json_and_bad_precision(tiny_onnx: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from edgekit.cli import cli

    out = tmp_path / "est.json"
    r = CliRunner().invoke(cli, ["estimate", str(tiny_onnx), "--target", "cpu", "--json", str(out)],
                           standalone_mode=False)
    assert "ESTIMATE" in r.output and "top 10 kernels" in r.output and "range" in r.output
    data = json.loads(out.read_text())
    assert data["kind"] == "estimate" and data["note"] == ESTIMATE_NOTE and data["total_ms"] > 0
    assert {n["name"] for n in data["nodes"]} >= {"conv", "fc"}
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "edgekit.cli", "estimate", str(tiny_onnx), "--target", "cpu",
                        "--precision", "fp16"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("error: target 'cpu' does not support precision 'fp16'")


def test_shape_arithmetic_is_folded_so_shapes_propagate(board: Path) -> None:
    """Exporters compute Pad's pads from Shape and ConstantOfShape; onnx's inference alone stops there."""
    n2 = numpy_helper.from_array(np.array([2], np.int64), "n2")
    w = numpy_helper.from_array(_rand(4, 3, 3, 3), "w")
    nodes = [helper.make_node("ConstantOfShape", ["n2"], ["zeros"], name="zeros",
                              value=numpy_helper.from_array(np.array([0], np.int64))),
             helper.make_node("ConstantOfShape", ["n2"], ["ones"], name="ones",
                              value=numpy_helper.from_array(np.array([1], np.int64))),
             helper.make_node("Concat", ["zeros", "ones", "zeros", "ones"], ["pads"], name="pads", axis=0),
             helper.make_node("Pad", ["x", "pads"], ["xp"], name="pad"),
             helper.make_node("Cast", ["xp"], ["xc"], name="noop_cast", to=TensorProto.FLOAT),
             helper.make_node("Conv", ["xc", "w"], ["y"], name="conv")]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [n2, w])
    est = estimate(m, board, efficiency=ONE)
    assert _node(est, "conv").ops == 2 * 4 * 8 * 8 * 27  # (8+2-3+1)^2 outputs: the pads were known
    assert _node(est, "noop_cast").status == "view" and _node(est, "zeros").status == "folded"


def test_cli_calibrate_on_this_cpu_and_refused_for_a_device_not_here(tiny_onnx: Path) -> None:
    from click.testing import CliRunner

    from edgekit.cli import cli

    r = CliRunner().invoke(cli, ["estimate", str(tiny_onnx), "--target", "cpu", "--calibrate"],
                           standalone_mode=False)
    assert r.exception is None, r.output
    assert "calibration of the roofline estimate on cpu" in r.output and "efficiency: calibrated" in r.output
    from edgekit.errors import UnavailableError
    from edgekit.estimate.calibrate import estimate_with_calibration

    with pytest.raises(UnavailableError, match="cannot calibrate target 'jetson-agx-orin-64' here"):
        estimate_with_calibration(tiny_onnx, "jetson-agx-orin-64", calibrate=True)


def test_gpu_style_calibration_fits_one_factor_end_to_end(board: Path) -> None:
    """Torch-engine measurements have no ONNX node times: one factor over all classes."""
    model = _matmul()
    est = estimate(model, board, "fp16", calibrated=False)
    meas = Measurement(model="mm", graph=None, source=model, p50_ms=2 * est.total_ms, nodes={}, node_ops={},
                       runtime="torch", threads=None, dims={}, batch=1, cv=0.0, precision="fp16")
    report = calibrate([], board, measurements=[meas], save=False)
    assert report.efficiency_after["matmul"] == pytest.approx(0.3, rel=0.01)  # 0.6 halved
    assert abs(report.models[0]["error_after"]) < 0.01


# --- precision and timing conventions on a GPU (issue 27) -----------------------------------------------

def _convs(stem_channels: int = 3, width: int = 64, depth: int = 3) -> object:
    """A stem convolution on `stem_channels` channels, then `depth` wide 3x3 convolutions with ReLUs."""
    inits = [numpy_helper.from_array(_rand(width, stem_channels, 3, 3), "w0")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0")]
    for i in range(1, depth + 1):
        inits.append(numpy_helper.from_array(_rand(width, width, 3, 3), f"w{i}"))
        nodes += [helper.make_node("Conv", [f"r{i - 1}", f"w{i}"], [f"c{i}"], name=f"body{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}" if i < depth else "y"], name=f"relu{i}")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, stem_channels, 112, 112])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width, 112, 112])], inits)


def test_int8_channel_alignment_and_tensorrts_per_layer_choice() -> None:
    """An INT8 engine of a float graph: the 3-channel stem (padded to INT8's 32-wide steps) stays
    FP16, the 64-channel body runs INT8, and the tensors crossing between float and INT8 (into the
    body, out of the engine) cost reformats."""
    from edgekit.estimate.efficiency import roofs_for, shape_factor

    roofs = roofs_for("jetson-agx-orin-64", calibrated=False)
    gemm = (1.0, 12544.0, 64.0, 144.0)
    assert shape_factor(roofs, gemm, precision="int8", channels=16) == pytest.approx(
        shape_factor(roofs, gemm, precision="int8", channels=32) / 2)  # 16 channels fill half of a 32-wide step
    assert shape_factor(roofs, gemm, precision="fp16", channels=16) == shape_factor(roofs, gemm, precision="fp16",
                                                                                   channels=32)
    cpu = roofs_for("cpu", calibrated=False)  # the CPU's estimate is untouched by tensor-core alignment
    assert shape_factor(cpu, gemm, precision="int8", channels=3) == shape_factor(cpu, gemm, precision="int8",
                                                                                channels=32)
    est = estimate(_convs(), "jetson-agx-orin-64", "int8", runtime="tensorrt", calibrated=False)
    assert [_node(est, n).precision for n in ("stem", "body1", "body2", "body3")] == ["fp16", "int8", "int8", "int8"]
    assert est.reformats == 2 and _node(est, "body1").reformat_ms > 0 and _node(est, "body3").reformat_ms > 0
    assert est.reformat_ms == pytest.approx(_node(est, "body1").reformat_ms + _node(est, "body3").reformat_ms)
    fp16 = estimate(_convs(), "jetson-agx-orin-64", "fp16", runtime="tensorrt", calibrated=False)
    assert est.total_ms < fp16.total_ms  # INT8 still pays where the body is large enough
    # one body convolution alone does not win back its two reformats: TensorRT would keep it in FP16 too
    one = estimate(_convs(depth=1), "jetson-agx-orin-64", "int8", runtime="tensorrt", calibrated=False)
    assert _node(one, "body1").precision == "fp16" and one.reformats == 0


def test_timing_conventions_and_tf32() -> None:
    model = _convs(stem_channels=32)
    gpu = estimate(model, "jetson-agx-orin-64", "fp16", runtime="tensorrt", calibrated=False)
    e2e = estimate(model, "jetson-agx-orin-64", "fp16", runtime="tensorrt", calibrated=False, timing="end-to-end")
    from edgekit.estimate.efficiency import roofs_for

    # the host copies of the input (32x112x112 floats) and output (64x112x112) at the target's host_copy_gbs
    rate = roofs_for("jetson-agx-orin-64", calibrated=False).host_copy_gbs
    assert gpu.io_ms == e2e.io_ms == pytest.approx((32 + 64) * 112 * 112 * 4 / (rate * 1e9) * 1e3)
    assert gpu.total_ms == pytest.approx(gpu.gpu_compute_ms) and e2e.total_ms == pytest.approx(e2e.end_to_end_ms)
    assert e2e.total_ms == pytest.approx(gpu.total_ms + gpu.io_ms)
    assert "timing: GPU compute (the kernels alone, as trtexec's GPU Compute Time)" in gpu.render()
    assert f"end-to-end: {gpu.end_to_end_ms:.3f} ms (--timing end-to-end)" in gpu.render()
    assert e2e.to_profile().settings["timing"] == "end-to-end"
    with pytest.raises(BadInputError, match="unknown timing 'wall'"):
        estimate(model, "jetson-agx-orin-64", "fp16", timing="wall")
    # fp32 is what the bundle builds (--noTF32); the note gives the TF32 figure published FP32 results match
    fp32 = estimate(model, "jetson-agx-orin-64", "fp32", runtime="tensorrt", calibrated=False)
    tf32 = estimate(model, "jetson-agx-orin-64", "tf32", runtime="tensorrt", calibrated=False)
    assert tf32.total_ms < fp32.total_ms
    (note,) = [n for n in fp32.notes if "TF32" in n]
    assert note.endswith(f"compare those with --precision tf32 ({tf32.total_ms:.3f} ms here)")
    # a CPU target copies nothing: both conventions agree
    cpu = estimate(model, "cpu", calibrated=False)
    assert cpu.io_ms == 0 and cpu.total_ms == cpu.end_to_end_ms == cpu.gpu_compute_ms


def _kv_attention(heads: int = 4, dim: int = 16) -> object:
    """One attention step over a KV cache, named as optimum exports it: past_key (batch, heads,
    past_sequence_length, dim) concatenated with this step's keys; the mask spans
    `past_sequence_length + sequence_length`."""
    d = heads * dim
    wq, wk = numpy_helper.from_array(_rand(d, d), "wq"), numpy_helper.from_array(_rand(d, d), "wk")
    shape = numpy_helper.from_array(np.array([1, -1, heads, dim], np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["h", "wq"], ["q0"], name="q_proj"),
             helper.make_node("MatMul", ["h", "wk"], ["k0"], name="k_proj"),
             helper.make_node("Reshape", ["q0", "shape"], ["q1"], name="q_heads"),
             helper.make_node("Reshape", ["k0", "shape"], ["k1"], name="k_heads"),
             helper.make_node("Transpose", ["q1"], ["q"], name="q_t", perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["k1"], ["k"], name="k_t", perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["past_key"], ["pk"], name="past_t", perm=[0, 1, 3, 2]),
             helper.make_node("Concat", ["pk", "k"], ["kall"], name="cache", axis=3),
             helper.make_node("MatMul", ["q", "kall"], ["s"], name="scores"),
             helper.make_node("Add", ["s", "mask"], ["sm"], name="masked"),
             helper.make_node("Softmax", ["sm"], ["y"], name="softmax", axis=-1)]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch_size", "sequence_length", d]),
              helper.make_tensor_value_info("past_key", TensorProto.FLOAT,
                                            ["batch_size", heads, "past_sequence_length", dim]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT,
                                            ["batch_size", 1, 1, "past_sequence_length + sequence_length"])]
    # an output of unknown rank is not valid ONNX (the checker build, estimate and lint share refuses it)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch_size", heads, "sequence_length",
                                                                  "past_sequence_length + sequence_length"])
    return _model(nodes, inputs, [out], [wq, wk, shape], opset=17)


def test_kv_cache_prefill_is_estimable(tmp_path: Path) -> None:
    """A KV-cache graph's prefill: past_sequence_length=0 and 128 new tokens (the mask's axis, named
    as their sum, follows); one decode step after 128 tokens for comparison."""
    model = _kv_attention()
    prefill = estimate(model, "jetson-agx-orin-64", "fp16", runtime="tensorrt", calibrated=False,
                       dims={"past_sequence_length": 0, "sequence_length": 128})
    decode = estimate(model, "jetson-agx-orin-64", "fp16", runtime="tensorrt", calibrated=False,
                      dims={"past_sequence_length": 128, "sequence_length": 1})
    assert prefill.dims["past_sequence_length + sequence_length"] == 128 and not prefill.warnings
    assert decode.dims["past_sequence_length + sequence_length"] == 129
    # the prefill projects 128 tokens, the decode step one: 128x the projection work
    assert _node(prefill, "q_proj").ops == 128 * _node(decode, "q_proj").ops == 128 * 2 * 64 * 64
    from click.testing import CliRunner

    from edgekit.cli import cli

    path = tmp_path / "kv.onnx"
    path.write_bytes(model.SerializeToString())
    res = CliRunner().invoke(cli, ["estimate", str(path), "--target", "jetson-agx-orin-64", "--precision", "fp16",
                                   "--axis", "past_sequence_length=0", "--axis", "sequence_length=128", "--json", "-"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["dims"]["past_sequence_length"] == 0
    res = CliRunner().invoke(cli, ["estimate", str(path), "--target", "jetson-agx-orin-64", "--axis",
                                   "past_sequence_length=-1"])
    assert res.exit_code == 2 and "--axis 'past_sequence_length=-1' must be NAME=SIZE with a whole number" in res.output
