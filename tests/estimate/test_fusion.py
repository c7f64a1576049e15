"""Kernels, shapes, ranges and the validation split of the estimator, on tiny hand-made graphs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.estimate import estimate, fuse, read_graph
from edgekit.estimate.efficiency import roofs_for, shape_factor
from edgekit.estimate.uncertainty import VALIDATION_FILE, estimate_range, op_mix
from edgekit.targets import load_target

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed_host_probe) -> None:
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    seed_host_probe()  # this machine's probe, measured once per session, not once per test


def _w(name: str, *shape: int) -> object:
    return numpy_helper.from_array(np.random.default_rng(0).standard_normal(shape).astype(np.float32), name)


def _model(nodes, inputs, outputs, inits, opset=17):
    return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, initializer=inits),
                             opset_imports=[helper.make_opsetid("", opset)])


def _resblock():
    """Conv-BN-Relu-Conv-BN + residual Add - Relu, then SiLU (Sigmoid, Mul) and a GlobalAveragePool."""
    bn = [numpy_helper.from_array(np.ones(8, np.float32), f"bn{i}") for i in range(4)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "bn0", "bn1", "bn2", "bn3"], ["b1"], name="bn1"),
             helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c2", "bn0", "bn1", "bn2", "bn3"], ["b2"], name="bn2"),
             helper.make_node("Add", ["b2", "x"], ["a"], name="residual"),
             helper.make_node("Relu", ["a"], ["r2"], name="relu2"),
             helper.make_node("Sigmoid", ["r2"], ["s"], name="sig"),
             helper.make_node("Mul", ["r2", "s"], ["m"], name="silu"),
             helper.make_node("GlobalAveragePool", ["m"], ["y"], name="gap")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 16, 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 1, 1])],
                  [_w("w1", 8, 8, 3, 3), _w("w2", 8, 8, 3, 3), *bn])


def _attention(seq: int = 32, d: int = 64):
    """A transformer block's attention core and layer norm written out as plain ops."""
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("Transpose", ["k"], ["kt"], name="kt", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Div", ["s", "scale"], ["sd"], name="scale"),
             helper.make_node("Softmax", ["sd"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"], name="av"),
             helper.make_node("Add", ["o", "x"], ["h"], name="residual"),
             helper.make_node("ReduceMean", ["h"], ["mu"], name="mean", axes=[-1]),
             helper.make_node("Sub", ["h", "mu"], ["dx"], name="sub"),
             helper.make_node("Mul", ["dx", "dx"], ["sq"], name="sq"),
             helper.make_node("ReduceMean", ["sq"], ["var"], name="var", axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="eps"),
             helper.make_node("Sqrt", ["ve"], ["sd2"], name="sqrt"),
             helper.make_node("Div", ["dx", "sd2"], ["y"], name="norm")]
    inits = [_w("wq", d, d), _w("wk", d, d), _w("wv", d, d), numpy_helper.from_array(np.array(8.0, np.float32), "scale"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "eps")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


def test_shapes_come_from_symbolic_inference_with_dims_bound() -> None:
    g = read_graph(_attention(), batch=2, dims={"seq": 32})
    shapes = {t.name: t.shape for n in g.nodes for t in n.outputs if t is not None}
    assert g.dims == {"batch": 2, "seq": 32}
    assert shapes["s"] == (2, 32, 32) and shapes["y"] == (2, 32, 64) and shapes["var"] == (2, 32, 1)
    assert not g.warnings


def test_resblock_kernels_per_runtime() -> None:
    g = read_graph(_resblock())
    trt = fuse(g, "tensorrt")
    ort = fuse(g, "onnxruntime")
    none = fuse(g, "none")
    # TensorRT: conv1+bn+relu; conv2+bn+residual+relu+silu (one pointwise epilogue); the pool
    assert len(trt.kernels) == 3 and trt.counts == {"epilogue": 2, "single": 1}
    # ONNX Runtime: conv1+bn+relu; conv2+bn+residual+relu; SiLU as one kernel; the pool
    assert len(ort.kernels) == 4 and ort.counts == {"epilogue": 2, "silu": 1, "single": 1}
    assert len(none.kernels) == 10
    assert {n.name: ort.status[n.index] for n in g.nodes}["residual"] == "fused"


def test_attention_and_layernorm_fuse() -> None:
    g = read_graph(_attention(), dims={"seq": 32})
    trt = fuse(g, "tensorrt")
    assert trt.counts.get("attention") == 1 and trt.counts.get("layernorm") == 1
    att = next(k for k in trt.kernels if k.pattern == "attention")
    assert {n.name for n in att.nodes} == {"qk", "scale", "softmax", "av"} and not att.keeps_intermediates
    ort = fuse(g, "onnxruntime")
    assert ort.counts.get("attention") == 1 and ort.counts.get("layernorm") == 1
    assert next(k for k in ort.kernels if k.pattern == "attention").keeps_intermediates
    # TensorRT keeps the 32x32 scores on chip: its attention kernel moves fewer bytes
    t = estimate(_attention(), "jetson-agx-orin-64", "fp16", dims={"seq": 32}, runtime="tensorrt")
    o = estimate(_attention(), "jetson-agx-orin-64", "fp16", dims={"seq": 32}, runtime="onnxruntime")
    head_t = next(n for n in t.nodes if n.kernel == "attention" and n.status == "runs")
    head_o = next(n for n in o.nodes if n.kernel == "attention" and n.status == "runs")
    assert head_t.activation_bytes < head_o.activation_bytes
    assert t.kernels < o.kernels


def test_fewer_kernels_mean_less_overhead() -> None:
    fused = estimate(_resblock(), "jetson-agx-orin-64", "fp16")
    raw = estimate(_resblock(), "jetson-agx-orin-64", "fp16", fuse=False)
    assert fused.runtime == "tensorrt" and raw.runtime == "none"
    overhead = load_target("jetson-agx-orin-64").kernel_overhead_us * 1e-3  # ms per kernel
    assert fused.overhead_ms == pytest.approx(3 * overhead) and raw.overhead_ms == pytest.approx(10 * overhead)
    assert fused.total_ms < raw.total_ms


def test_shape_factor_penalises_thin_products_on_gpus() -> None:
    orin = roofs_for("jetson-agx-orin-64", calibrated=False)
    assert shape_factor(orin, (1.0, 4096.0, 256.0, 1024.0)) == pytest.approx(1024 / 1056 * 256 / 256, rel=1e-6)
    thin = shape_factor(orin, (1.0, 4096.0, 8.0, 1024.0))  # 8 output channels fill a quarter of a 32-wide tile
    assert thin == pytest.approx(0.25 * 1024 / 1056, rel=1e-6)
    # 16 SMs: 17 tiles take two waves, the second with one busy SM
    assert shape_factor(orin, (1.0, 16.0, 17 * 32.0, 4096.0)) == pytest.approx(17 / 32 * 4096 / 4128, rel=1e-6)


def test_cache_roof_speeds_up_a_model_that_fits(tmp_path: Path) -> None:
    base = ("name: b\ndescription: b\nkind: gpu\nruntimes: [tensorrt]\nprecisions: [fp16]\npeak_tops: {fp16: 100}\n"
            "memory_bandwidth_gbs: 100\nkernel_overhead_us: 0\n")
    (tmp_path / "nocache.yaml").write_text(base)
    (tmp_path / "cache.yaml").write_text(base.replace("name: b", "name: c") + "cache_mb: 4\ncache_bandwidth_gbs: 1000\n")
    slow = estimate(_resblock(), tmp_path / "nocache.yaml", "fp16")
    fast = estimate(_resblock(), tmp_path / "cache.yaml", "fp16")
    assert fast.memory_ms == pytest.approx(slow.memory_ms / 10, rel=1e-6)


def test_range_contains_the_estimate_and_says_its_basis() -> None:
    for target, precision in (("cpu", None), ("jetson-agx-orin-64", "fp16"), ("jetson-orin-nx-16", "fp16"), ("l4", "fp16")):
        est = estimate(_resblock(), target, precision)
        assert est.low_ms < est.total_ms < est.high_ms
        assert est.low_ms <= est.total_ms / 1.15 + 1e-12 and est.high_ms >= est.total_ms / 0.85 - 1e-12
        assert est.basis and est.to_dict()["low_ms"] == est.low_ms
        assert "range" in est.render() and est.to_profile().settings["estimate_range_ms"] == [est.low_ms, est.high_ms]
    validation = {"t": {"kind": "gpu", "basis": "b", "cases": [
        {"case": "a", "mix": "conv", "error": -0.2}, {"case": "b", "mix": "conv", "error": 0.1},
        {"case": "c", "mix": "conv", "error": 0.0}, {"case": "d", "mix": "matmul", "error": 0.5}]}}
    r = estimate_range(1.0, "t", "gpu", "conv", validation)
    assert r.cases == 3 and r.low_ms == pytest.approx(1 / 1.15) and r.high_ms == pytest.approx(1 / (1 - 0.25))
    other = estimate_range(1.0, "u", "gpu", "conv", validation)  # borrowed from the kind, wider
    assert "borrowed" in other.basis and other.high_ms > r.high_ms and other.low_ms < r.low_ms
    assert op_mix({"conv": 7.0, "elementwise": 3.0}) == "conv" and op_mix({"matmul": 1, "conv": 1}) == "mixed"


def test_validation_cases_are_held_out_families() -> None:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_estimate_cpu import FIT_FAMILIES, HELD_OUT_FAMILIES
    from bench_estimate_published import rows

    assert not set(FIT_FAMILIES) & set(HELD_OUT_FAMILIES)
    data = json.loads(VALIDATION_FILE.read_text())["targets"]
    fit_prefixes = ("efficientnet", "centerface", "smollm2")
    assert data["cpu"]["cases"] and not any(c["case"].startswith(fit_prefixes) for c in data["cpu"]["cases"])
    published = rows()
    fitted = {(r["case"], r["target"]) for r in published if r["split"] == "fit"}
    assert len(fitted) == 4 and {t for _, t in fitted} == {"jetson-agx-orin-64"}
    for target in ("jetson-agx-orin-64", "jetson-orin-nx-16"):  # every validated case is a published row not fitted
        held = {(c["case"], target) for c in data[target]["cases"]}
        assert held and not held & fitted
        assert held <= {(r["case"], r["target"]) for r in published}


def test_cli_prints_the_range_and_writes_the_fields(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from edgekit.cli import cli

    model = tmp_path / "m.onnx"
    model.write_bytes(_resblock().SerializeToString())
    out = tmp_path / "e.json"
    r = CliRunner().invoke(cli, ["estimate", str(model), "--target", "jetson-agx-orin-64", "--precision", "fp16",
                                 "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "ESTIMATE" in r.output and "(range " in r.output and "range basis:" in r.output
    assert "3 kernels after tensorrt fusions" in r.output
    data = json.loads(out.read_text())
    assert data["low_ms"] < data["total_ms"] < data["high_ms"] and data["basis"] and data["kind"] == "estimate"
    bad = CliRunner().invoke(cli, ["estimate", str(model), "--target", "cpu", "--runtime", "tvm"])
    assert bad.exit_code == 2 and "tvm" in bad.output
