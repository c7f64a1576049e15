"""The OpenVINO runtime (CPU targets): build and parity with ONNX Runtime, Q/DQ INT8 graphs in
INT8 kernels, bf16 labels, the kernels recorded per engine and per node, ``--runtime best``,
and the messages for bad input (also where openvino is not installed). ONNX Runtime's side:
bf16 refused on the CPU, MLAS kernel labels."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from edgekit.artifact import read_manifest
from edgekit.build import build_engine, load_engine, load_engine_inputs
from edgekit.cli import cli
from edgekit.errors import BadInputError
from edgekit.runtimes.base import BuildOptions
from edgekit.runtimes.onnxruntime import kernel_label, parse_profile
from edgekit.targets import load_target

needs_openvino = pytest.mark.skipif(importlib.util.find_spec("openvino") is None,
                                    reason="openvino is not installed (pip install 'edgekit[openvino]')")


def _ort_outputs(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _qdq_model(tiny_onnx: Path, out: Path) -> Path:
    """ONNX Runtime's static QDQ quantization (U8S8, per-channel) of the tiny CNN: a Q/DQ graph
    like the ones edgekit writes, in milliseconds."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.items = iter([{"input": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.items, None)

    from edgekit.targets.cpu_isa import host_int8_kernel

    # 7-bit weights (ONNX Runtime's reduce_range) where this CPU's integer kernels sum in int16 pairs, as
    # ONNX Runtime advises there: 8-bit weights overflow those sums, in ONNX Runtime and OpenVINO alike
    quantize_static(str(tiny_onnx), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=host_int8_kernel().saturates, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return out


@pytest.fixture(scope="module")
def ov_engine(tmp_path_factory, tiny_onnx) -> Path:
    if importlib.util.find_spec("openvino") is None:
        pytest.skip("openvino is not installed")
    return build_engine(tiny_onnx, "cpu", tmp_path_factory.mktemp("ov") / "engine",
                        BuildOptions(runtime="openvino", threads=1))


def test_cpu_target_lists_openvino():
    assert load_target("cpu").runtimes == ("onnxruntime", "openvino", "torch")


@needs_openvino
def test_build_records_ir_parity_and_kernels(ov_engine):
    m = read_manifest(ov_engine)
    assert m.config["runtime"] == "openvino" and m.config["precision"] == "fp32"
    assert m.files["model"] == "model.xml" and (ov_engine / "model.xml").is_file() and (ov_engine / "model.bin").is_file()
    s = m.config["session"]
    assert s["inference_precision_hint"] == "f32" and s["inference_num_threads"] == 1 and s["num_streams"] == 1
    assert s["static_shapes"] == {"input": [1, 3, 16, 16]} and s["dynamic_dims"] == {"input": {"0": "batch"}}
    parity = m.metrics["engine_parity"]
    assert parity["passed"] is True and parity["worst_relative_error"] < 1e-3
    assert parity["outputs"]["logits"]["top1_match"] == 1.0
    k = m.metrics["kernels"]
    assert k["by_precision"] == {"fp32": sum(k["by_primitive"].values())}
    assert any("conv" in p for p in k["by_primitive"]) and isinstance(k["isa"], list)
    assert m.metrics["integer_nodes"] == 0 and m.metrics["model_size_mb"] > 0


@needs_openvino
def test_engine_matches_onnxruntime_at_any_batch(ov_engine, tiny_onnx):
    engine = load_engine(ov_engine, threads=1)
    try:
        assert engine.runtime == "openvino" and engine.outputs == ["logits"]
        assert engine.inputs[0].shape == ("batch", 3, 16, 16)
        for batch in (1, 3, 1):  # a new batch recompiles the static IR
            feeds = load_engine_inputs(ov_engine, batch=batch)
            got = engine.run(feeds)[0]
            assert got.shape == (batch, 5)
            np.testing.assert_allclose(got, _ort_outputs(tiny_onnx, feeds), rtol=1e-4, atol=1e-4)
        assert engine.timed_run(feeds) > 0
        with pytest.raises(BadInputError, match=r"input 'input' has shape \(1, 3, 15, 16\); the model expects "
                                                r"\('batch', 3, 16, 16\)"):
            engine.run({"input": np.zeros((1, 3, 15, 16), np.float32)})
        with pytest.raises(BadInputError, match=r"input 'input' has dtype float64; the model expects float32"):
            engine.run({"input": np.zeros((1, 3, 16, 16))})
    finally:
        engine.close()


@needs_openvino
def test_node_profile_names_kernels(ov_engine):
    engine = load_engine(ov_engine, threads=1)
    nodes = engine.node_profile(load_engine_inputs(ov_engine), iterations=3)
    engine.close()
    assert nodes and all(n.time_ms >= 0 and n.kernel for n in nodes)
    assert {n.precision for n in nodes} == {"fp32"} and not any(n.quantized for n in nodes)
    assert any(n.op_type == "Convolution" for n in nodes)


@needs_openvino
def test_qdq_int8_graph_runs_int8_kernels(tiny_onnx, tmp_path):
    q = _qdq_model(tiny_onnx, tmp_path / "q.onnx")
    out = build_engine(q, "cpu", tmp_path / "engine", BuildOptions(runtime="openvino", threads=1))
    m = read_manifest(out)
    assert m.config["precision"] == "int8" and m.config["session"]["inference_precision_hint"] == "f32"
    assert m.metrics["integer_nodes"] >= 1 and m.metrics["kernels"]["by_precision"]["int8"] >= 1
    assert m.metrics["engine_parity"]["passed"] is True
    assert m.metrics["engine_parity"]["worst_relative_error"] <= 0.1
    engine = load_engine(out, threads=1)
    feeds = load_engine_inputs(out)
    got = engine.run(feeds)[0]
    ref = _ort_outputs(q, feeds)
    assert np.abs(got - ref).max() <= 0.1 * np.abs(ref).max()
    nodes = engine.node_profile(feeds, iterations=2)
    engine.close()
    int8 = [n for n in nodes if n.quantized]
    assert int8 and all(n.precision == "int8" for n in int8)
    assert any(n.op_type == "Convolution" and n.kernel.lower().endswith("_i8") for n in int8)


@needs_openvino
def test_bf16_engine_labels_bf16(tiny_onnx, tmp_path):
    from edgekit.runtimes.openvino import _core

    if "BF16" not in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bf16")
    out = build_engine(tiny_onnx, "cpu", tmp_path / "engine", BuildOptions(runtime="openvino", precision="bf16",
                                                                        threads=1))
    m = read_manifest(out)
    assert m.config["precision"] == "bf16" and m.config["session"]["inference_precision_hint"] == "bf16"
    assert m.metrics["kernels"]["by_precision"].get("bf16", 0) >= 1
    assert 0 < m.metrics["engine_parity"]["worst_relative_error"] <= 0.1  # bf16 rounds, but stays close
    engine = load_engine(out, threads=1)
    nodes = engine.node_profile(load_engine_inputs(out), iterations=2)
    engine.close()
    conv = [n for n in nodes if n.op_type == "Convolution"]
    assert conv and all(n.precision == "bf16" and "bf16" in n.kernel.lower() for n in conv)


@needs_openvino
def test_best_times_each_runtime_and_keeps_the_fastest(tiny_onnx, tmp_path):
    out = build_engine(tiny_onnx, "cpu", tmp_path / "engine", BuildOptions(runtime="best", threads=1))
    m = read_manifest(out)
    cands = m.metrics["runtime_candidates"]
    timed = {k: v["p50_ms"] for k, v in cands.items() if "p50_ms" in v}
    assert set(timed) >= {"onnxruntime", "openvino"} and all(t > 0 for t in timed.values())
    assert all(v["iterations"] >= 15 for v in cands.values() if "p50_ms" in v)
    assert set(cands) == {"onnxruntime", "openvino", "torch"}  # torch builds from a module: an ONNX file is recorded
    choice = m.config["runtime_choice"]
    assert choice["requested"] == "best" and choice["chosen"] == min(timed, key=timed.get)
    assert m.config["runtime"] == choice["chosen"]
    engine = load_engine(out, threads=1)  # the chosen engine loads as any other
    assert engine.run(load_engine_inputs(out))[0].shape == (1, 5)
    engine.close()


@needs_openvino
def test_int8_on_a_float_graph_is_bad_input(tiny_onnx, tmp_path):
    with pytest.raises(BadInputError, match=r"^runtime 'openvino' builds int8 from a graph with Q/DQ nodes; this one "
                                            r"has none \(compress the model first: `edgekit compress MODEL --bits 8`\)$"):
        build_engine(tiny_onnx, "cpu", tmp_path / "engine", BuildOptions(runtime="openvino", precision="int8"))
    assert not (tmp_path / "engine").exists()


def test_precision_choices_are_named():
    from edgekit.runtimes.openvino import engine_precision

    with pytest.raises(BadInputError, match=r"runtime 'openvino' cannot build precision 'fp16' \(choose from fp32, "
                                            r"bf16, int8;"):
        engine_precision("fp16", {})
    assert engine_precision("fp32", {"QuantizeLinear": 2, "Conv": 1}) == "int8"
    assert engine_precision("bf16", {"Conv": 1}) == "bf16"


def test_runtime_openvino_without_openvino_is_one_line(tiny_onnx, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # `import openvino` raises ImportError
    r = CliRunner().invoke(cli, ["build", str(tiny_onnx), "--runtime", "openvino", "-o", str(tmp_path / "e")])
    assert r.exit_code == 2
    assert r.output == ("error: runtime 'openvino' is not available here: the openvino package is not installed: "
                        "pip install 'edgekit[openvino]' (OpenVINO 2026.4 from PyPI)\n")
    assert not (tmp_path / "e").exists()


def test_onnxruntime_refuses_bf16_on_the_cpu(tiny_onnx, tmp_path):
    r = CliRunner().invoke(cli, ["build", str(tiny_onnx), "--runtime", "onnxruntime", "--precision", "bf16",
                                 "-o", str(tmp_path / "e")])
    assert r.exit_code == 2
    assert r.output == ("error: ONNX Runtime's CPU execution provider cannot run precision 'bf16' (choose from fp32, "
                        "int8, int4; or --runtime openvino for bf16)\n")
    assert not (tmp_path / "e").exists()


def test_unknown_runtime_lists_best_and_openvino(tiny_onnx, tmp_path):
    r = CliRunner().invoke(cli, ["build", str(tiny_onnx), "--runtime", "fastest", "-o", str(tmp_path / "e")])
    assert r.exit_code == 2 and "unknown runtime 'fastest'" in r.output
    assert "'best'" in r.output and "'openvino'" in r.output and "'onnxruntime'" in r.output


def test_mlas_kernel_labels_follow_the_cpu_flags():
    cpu = "CPUExecutionProvider"
    assert kernel_label("QLinearConv", "int8", cpu, ("avx2", "avx512f", "avx512bw", "avx512_vnni")) == \
        "mlas-int8-u8s8/avx512-vnni"
    assert kernel_label("QLinearConv", "int8", cpu, ("avx512_vnni", "amx_int8")) == "mlas-int8-u8s8/amx"
    assert kernel_label("QLinearMatMul", "int8", cpu, ("avx2",)) == "mlas-int8-u8s8/avx2"
    assert kernel_label("Conv", "fp32", cpu, ("fma", "avx512f")) == "mlas-sgemm/avx512f"
    assert kernel_label("FusedConv", "fp32", cpu, ("fma",)) == "mlas-sgemm/fma3"
    assert kernel_label("MatMulNBits", "int4", cpu, ("avx512f", "avx512_vnni")) == "mlas-sqnbitgemm/avx512-vnni"
    assert kernel_label("Relu", "fp32", cpu, ("avx512f",)) == "ort-cpu"
    assert kernel_label("QLinearConv", "int8", cpu, ("amx_int8",), depthwise=True) == "mlas-int8-depthwise"
    assert kernel_label("Conv", "fp32", cpu, ("avx512f",), domain="com.microsoft.nchwc") == "mlas-nchwc/avx512f"
    assert kernel_label("Conv", "fp32", "CUDAExecutionProvider", ()) == "cuda"


def test_ort_profile_and_manifest_carry_kernels(tiny_onnx, tmp_path):
    ev = {"cat": "Node", "name": "conv_kernel_time", "dur": 100,
          "args": {"op_name": "QLinearConv", "provider": "CPUExecutionProvider",
                   "input_type_shape": [{"uint8_t": [1]}, {"int8_t": [2]}]}}
    (node,) = parse_profile([ev, ev], runs=2, skip_runs=1)
    assert node.precision == "int8" and node.kernel.startswith("mlas-int8-u8s8/")
    out = build_engine(tiny_onnx, "cpu", tmp_path / "engine", BuildOptions(runtime="onnxruntime"))
    k = read_manifest(out).metrics["kernels"]
    assert sum(k["by_kernel"].values()) == read_manifest(out).metrics["nodes"]
    assert any(label.startswith(("mlas-sgemm/", "mlas-nchwc/")) for label in k["by_kernel"])


def test_openvino_errors_are_one_line_without_source_locations():
    from edgekit.runtimes.openvino import _first_line

    e = RuntimeError("Exception from src/inference/src/cpp/core.cpp:84:\nCheck 'util::file_exists(path)' failed at "
                     "src/frontends/common/src/frontend.cpp:117:\nFrontEnd API failed with GeneralFailure:\n"
                     "onnx: Could not open the file: \"x.onnx\"\n\n")
    assert _first_line(e) == 'onnx: Could not open the file: "x.onnx"'
    e = RuntimeError("Exception from src/inference/src/cpp/core.cpp:84:\nException from src/inference/src/"
                     "model_reader.cpp:148:\nUnable to read the model: \"g.onnx\" Please check the format.\n")
    assert _first_line(e) == 'Unable to read the model: "g.onnx" Please check the format.'
    assert _first_line(RuntimeError("")) == "RuntimeError"


def test_best_needs_a_target_timed_here(tiny_onnx, tmp_path):
    r = CliRunner().invoke(cli, ["build", str(tiny_onnx), "--target", "l4", "--runtime", "best", "-o", str(tmp_path / "e")])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert r.output.startswith("error: --runtime best builds and times each runtime on this machine; no runtime of "
                               "target 'l4' can be (")
    assert not (tmp_path / "e").exists()


@needs_openvino
def test_dynamic_sequence_length_recompiles_for_new_shapes(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    emb = numpy_helper.from_array(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32), "emb")
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["h"], name="gather"),
             helper.make_node("ReduceMean", ["h"], ["pooled"], name="pool", axes=[1], keepdims=0)]
    graph = helper.make_graph(nodes, "text", [helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                                           ["batch", "sequence"])],
                              [helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["batch", 8])], [emb])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "text.onnx"
    onnx.save_model(model, str(path))
    out = build_engine(path, "cpu", tmp_path / "engine", BuildOptions(runtime="openvino", threads=1))
    s = read_manifest(out).config["session"]
    assert s["dynamic_dims"] == {"input_ids": {"0": "batch", "1": "sequence"}}
    engine = load_engine(out, threads=1)
    assert engine.inputs[0].shape == ("batch", "sequence")
    for shape in ((1, 5), (2, 9), (1, 5)):
        ids = np.random.default_rng(1).integers(0, 50, shape)
        np.testing.assert_allclose(engine.run({"input_ids": ids})[0], _ort_outputs(path, {"input_ids": ids}),
                                   rtol=1e-5, atol=1e-6)
    engine.close()
