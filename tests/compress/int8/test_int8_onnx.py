"""Preparing an external float graph for INT8 (int8/onnx_graph.py): a converter's decomposed batch norm
(Conv -> Sub -> Mul -> Add) folded into the Conv, exactly, so the Conv is what gets quantized."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgekit.compress.int8.onnx_graph import fold_conv_affine

RNG = np.random.default_rng(0)


def _graph(residual_reads_conv: bool = False) -> onnx.ModelProto:
    c = 6
    inits = [numpy_helper.from_array(RNG.standard_normal((c, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(RNG.standard_normal(c).astype(np.float32), "b"),
             numpy_helper.from_array(RNG.standard_normal((1, c, 1, 1)).astype(np.float32), "mean"),
             numpy_helper.from_array(RNG.uniform(0.5, 2, (1, c, 1, 1)).astype(np.float32), "scale"),
             numpy_helper.from_array(RNG.standard_normal((c, 1, 1)).astype(np.float32), "shift"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    n = helper.make_node
    nodes = [n("Conv", ["x", "w", "b"], ["y0"], pads=[1, 1, 1, 1]), n("Sub", ["y0", "mean"], ["y1"]),
             n("Mul", ["y1", "scale"], ["y2"]), n("Add", ["y2", "shift"], ["y3"]), n("Div", ["y3", "two"], ["y4"]),
             n("Relu", ["y4"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, c, 8, 8])]
    if residual_reads_conv:  # the Conv's output is read twice: nothing may be folded into it
        nodes.append(n("Identity", ["y0"], ["raw"]))
        outputs.append(helper.make_tensor_value_info("raw", TensorProto.FLOAT, [2, c, 8, 8]))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
                          outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(m: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_decomposed_batch_norm_folds_into_the_conv():
    m = _graph()
    x = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)
    before = _run(m, x)[0]
    assert fold_conv_affine(m) == 4
    assert [nd.op_type for nd in m.graph.node] == ["Conv", "Relu"]
    onnx.checker.check_model(m)
    np.testing.assert_allclose(_run(m, x)[0], before, rtol=1e-5, atol=1e-5)


def test_a_conv_output_read_twice_is_left_alone():
    m = _graph(residual_reads_conv=True)
    assert fold_conv_affine(m) == 0 and len(m.graph.node) == 7


def test_stored_weights_sharing_one_zero_point_each_get_their_own_uint8_zero_point():
    """Two stored 8-bit weights read through one shared zero-point tensor (as a dynamo export writes
    it): both are kept as the same integers in uint8 around 128, each with a zero point of its own,
    and the graph computes what it computed."""
    from edgekit.compress.int8.onnx_graph import fit_weights_to_kernels

    rng = np.random.default_rng(0)
    nodes, inits = [], [numpy_helper.from_array(np.zeros(4, np.int8), "zp")]
    for k in ("a", "b"):
        q = rng.integers(-127, 128, size=(4, 4)).astype(np.int8)
        q[0, 0] = 127  # beyond the 7-bit grid: the kernels without VNNI would overflow
        inits += [numpy_helper.from_array(q, f"W{k}"), numpy_helper.from_array(np.full(4, 0.01, np.float32), f"s{k}")]
        nodes.append(helper.make_node("DequantizeLinear", [f"W{k}", f"s{k}", "zp"], [f"W{k}_f"], axis=1))
    nodes += [helper.make_node("MatMul", ["x", "Wa_f"], ["h"]), helper.make_node("MatMul", ["h", "Wb_f"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits,
                          # the int8 types an exporter records: stale once the weights are uint8
                          value_info=[helper.make_tensor_value_info("Wa", TensorProto.INT8, [4, 4]),
                                      helper.make_tensor_value_info("zp", TensorProto.INT8, [4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    before = _run(m, x)[0]
    counts = fit_weights_to_kernels(m, "u8s7", {"Wa", "Wb"})
    onnx.checker.check_model(m, full_check=True)  # names unique, types consistent
    assert counts == {"to_grid": 0, "stored_as_uint8": 2}
    got = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    zps = [n.input[2] for n in m.graph.node if n.op_type == "DequantizeLinear"]
    assert len(set(zps)) == 2 and all(got[z].dtype == np.uint8 and got[z].tolist() == [128] * 4 for z in zps)
    assert got["Wa"].dtype == got["Wb"].dtype == np.uint8
    np.testing.assert_allclose(_run(m, x)[0], before, rtol=1e-6, atol=1e-6)
