"""Device results are believed only from the device and engine they claim (``provenance.py``):
real trtexec exports of NVIDIA's TensorRT Engine Explorer (fixtures/trtexec/real, see its README)
put into bundles they do not belong to are refused naming both sides; missing records leave a
profile ``unverified`` with a warning, which ``check --require-verified`` fails; trtexec exports
made by hand come in with ``profile --trtexec DIR --onnx MODEL --target T``.

The ONNX graphs here stand in for the ones the engines were built from (Engine Explorer keeps
only the exports): they carry the engines' inputs and the ONNX names of their layers. Nothing
here ran TensorRT."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from edgekit.cli import cli
from edgekit.errors import BadInputError
from edgekit.runtimes.base import BuildOptions
from edgekit.runtimes.tensorrt import device as trtdev
from edgekit.runtimes.tensorrt.device import DeviceInfo
from edgekit.runtimes.tensorrt.provenance import find_exports, layer_names, overlap, read_record

REAL = Path(__file__).parents[2] / "fixtures" / "trtexec" / "real"
RTX_QAT = REAL / "resnet50-tf-rtx3090-qat"
A100_FP32 = REAL / "resnet18-a100-fp32"
# what build.sh's probe writes on a desktop with an RTX 3090 and TensorRT 8.2.3 (written here: Engine
# Explorer's files do not record the TensorRT version)
RTX_DEVICE_TXT = ("gpu=NVIDIA GeForce RTX 3090\ncompute_cap=8.6\nboard=\ntrtexec=/usr/src/tensorrt/bin/trtexec\n"
                  "trtexec_banner=TensorRT v8203\npy_tensorrt=\n")
RTX_TARGET = """name: rtx-3090
description: a desktop RTX 3090 (TensorRT 8.2), for bringing in Engine Explorer's exports
kind: gpu
runtimes: [tensorrt]
precisions: [fp32, tf32, fp16, int8]
sm: sm_86
peak_tops: {fp16: 71.0, int8: 142.0, fp32: 35.6}
memory_bandwidth_gbs: 936.0
tensorrt_versions: ">=8.2,<8.3"
"""


@pytest.fixture
def no_tensorrt(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)


def _graph(path: Path, inp: str, dims: list, names: list[str]) -> Path:
    """A valid ONNX graph with input ``inp`` and one Identity node per name."""
    nodes, x = [], inp
    for i, name in enumerate(names):
        nodes.append(helper.make_node("Identity", [x], [f"t{i}"], name=name))
        x = f"t{i}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(inp, TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, dims)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _effnet_like(path: Path) -> Path:
    """EfficientNet-Lite0's input and stem (batch 1, NCHW): what a bundle for it is built from."""
    w = numpy_helper.from_array(np.ones((32, 3, 3, 3), np.float32), "stem.weight")
    nodes = [helper.make_node("Conv", ["input", "stem.weight"], ["s"], name="/stem/Conv", strides=[2, 2], pads=[1] * 4),
             helper.make_node("Clip", ["s"], ["y"], name="/stem/Relu6")]
    g = helper.make_graph(nodes, "efficientnet-lite0", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                                    [1, 3, 224, 224])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, 112, 112])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _rtx_onnx(path: Path) -> Path:
    """The RTX 3090 ResNet-50 engine's input (NHWC, batch 32) and the ONNX names of its layers."""
    rec = read_record(find_exports(RTX_QAT))
    names = list(dict.fromkeys(p for layer in rec.profiled for p in layer_names(layer, {})))
    return _graph(path, "input_1", [32, 224, 224, 3], names)


def _copy_results(src: Path, dst: Path, metadata: bool = True) -> Path:
    """An Engine Explorer set under the names a bundle's build.sh gives trtexec's exports (with
    its metadata, which records the device, unless ``metadata`` is False)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        role = {"timing": "trtexec_times.json", "profile": "trtexec_profile.json", "graph": "trtexec_layers.json"}.get(
            f.name.split(".")[-2])
        if role or metadata:
            shutil.copy(f, dst / (role or f.name))
    return dst


def _bundle(tmp_path: Path, onnx_path: Path, name: str = "bundle") -> Path:
    from edgekit.build import build_engine

    return build_engine(onnx_path, "jetson-agx-orin-64", tmp_path / name, BuildOptions("int8"))


def test_results_of_another_device_and_model_are_refused(tmp_path, no_tensorrt):
    """The RTX 3090 / TensorRT 8.2 ResNet-50 batch-32 NHWC results put into an EfficientNet-Lite0
    batch-1 bundle for the AGX Orin: refused, every mismatch named with both sides."""
    bundle = _bundle(tmp_path, _effnet_like(tmp_path / "efficientnet-lite0.onnx"))
    results = _copy_results(RTX_QAT, bundle / "results")
    (results / "device.txt").write_text(RTX_DEVICE_TXT)
    shutil.copy(bundle / "manifest.json", results / "bundle_manifest.json")
    runner = CliRunner()
    for args in (["profile", str(bundle)], ["profile", str(results), "--json", str(tmp_path / "p.json")],
                 ["check", str(bundle), "--budget-ms", "33"]):
        res = runner.invoke(cli, args)
        assert res.exit_code == 2 and res.output.startswith("error: refusing the results in "), res.output
        assert len(res.output.strip().splitlines()) == 1
        line = res.output
        assert "GPU: the results were measured on NVIDIA GeForce RTX 3090 (sm_86, device.txt" in line
        assert "jetson-agx-orin-64 is sm_87" in line
        assert "TensorRT: the results record TensorRT 8.2.3 (device.txt); jetson-agx-orin-64 takes >=10.3,<10.4" in line
        assert ("inputs: the engine's are input_1 32x224x224x3 (resnet-qat.onnx.engine.profile.metadata.json); "
                "onnx/model.onnx of efficientnet-lite0 for jetson-agx-orin-64 has input 1x3x224x224") in line
        assert "batch: the results timed batch 32" in line and "is built for batch 1" in line
        assert "layers: 0 of 63 profiled layers carry a node or tensor name of onnx/model.onnx" in line
    assert not (tmp_path / "p.json").exists()  # nothing half-written


def test_files_of_different_engines_or_machines_are_refused(tmp_path, no_tensorrt):
    # the RTX 3090 QAT profile beside the layer info of the A100 ResNet-18 FP32 engine
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in RTX_QAT.iterdir():
        shutil.copy(f, mixed / f.name)
    shutil.copy(A100_FP32 / "resnet.onnx.engine.graph.json", mixed / "layers.json")
    onnx_path = _rtx_onnx(tmp_path / "resnet50.onnx")
    target = tmp_path / "rtx-3090.yaml"
    target.write_text(RTX_TARGET)
    res = CliRunner().invoke(cli, ["profile", "--trtexec", str(mixed), "--onnx", str(onnx_path), "--target",
                                   str(target)])
    assert res.exit_code == 2
    assert ("the per-layer profile and the layer info come from different engines: 0 of 63 profiled layers are in "
            "the layer info") in res.output
    # a device.txt of the Orin beside a log section of the RTX 3090: the files disagree
    other = tmp_path / "other"
    shutil.copytree(RTX_QAT, other)
    (other / "device.txt").write_text("gpu=Orin\ncompute_cap=8.7\ntrtexec_banner=TensorRT v100300\n")
    res = CliRunner().invoke(cli, ["profile", "--trtexec", str(other), "--onnx", str(onnx_path), "--target",
                                   "jetson-agx-orin-64"])
    assert res.exit_code == 2 and ("the files of these results disagree: device.txt says sm_87, "
                                   "resnet-qat.onnx.engine.profile.metadata.json says sm_86") in res.output


def test_a_sparse_device_record_is_one_line(tmp_path, no_tensorrt):
    """A device's results as they came back, with a 2 GiB sparse device.txt (it costs the
    device nothing; it was read whole): one line, exit 2, nothing written."""
    onnx_path = _rtx_onnx(tmp_path / "resnet50.onnx")
    target = tmp_path / "rtx-3090.yaml"
    target.write_text(RTX_TARGET)
    results = tmp_path / "results"
    shutil.copytree(RTX_QAT, results)
    with open(results / "device.txt", "wb") as f:
        f.truncate(2 << 30)
    res = CliRunner().invoke(cli, ["profile", "--trtexec", str(results), "--onnx", str(onnx_path), "--target",
                                   str(target), "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
    assert f"device record {results / 'device.txt'} is 2 GiB; edgekit reads at most 1 MiB" in res.output
    assert not (tmp_path / "p.json").exists()


def test_trtexec_exports_made_by_hand(tmp_path, no_tensorrt):
    """Engine Explorer's RTX 3090 QAT set as a user would have it (its own file names, no layer info,
    no TensorRT version recorded): a device profile, unverified, with unknown precision."""
    onnx_path = _rtx_onnx(tmp_path / "resnet50.onnx")
    target = tmp_path / "rtx-3090.yaml"
    target.write_text(RTX_TARGET)
    runner = CliRunner()
    res = runner.invoke(cli, ["profile", "--trtexec", str(RTX_QAT), "--onnx", str(onnx_path), "--target", str(target),
                              "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    p = json.loads((tmp_path / "p.json").read_text())
    assert (p["source"], p["runtime"], p["target"], p["model"]) == ("device", "tensorrt", "rtx-3090", "resnet50")
    prov = p["provenance"]
    assert prov["status"] == "unverified"
    assert prov["reasons"] == ["the TensorRT version is not recorded (no trtexec banner in device.txt or the log, no "
                               "machine.txt package)"]
    assert {c["check"]: c["result"] for c in prov["checks"]} == {"gpu": "match", "tensorrt": "missing",
                                                                "inputs": "match", "batch": "match", "layers": "match"}
    assert p["warnings"][0].startswith("provenance unverified: the TensorRT version is not recorded")
    # no layer info: the precision of every layer is unknown, and no summary calls it float
    assert p["float_share"] is None and p["quantized_nodes"] == 0 and p["total_nodes"] == 63
    assert {n["precision"] for n in p["nodes"]} == {"unknown"}
    assert "quantized nodes: unknown (63 layers, none with a recorded precision: no layer info)" in res.output
    assert "provenance: UNVERIFIED: the TensorRT version is not recorded" in res.output
    # the warm-up of the metadata's "Duration: 3s (+ 200ms warm up)" is dropped, as trtexec did (TensorRT 8 keeps
    # it in --exportTimes): 87 of the first 100 records (the fixture's cut) fall in it
    assert p["settings"]["warmup_ms"] == 200.0 and p["settings"]["dropped_warmup_records"] == 87
    assert p["latency_ms"]["count"] == 13
    # --require-verified fails on it and lists why; without it the budget passes
    assert runner.invoke(cli, ["check", str(tmp_path / "p.json"), "--budget-ms", "33"]).exit_code == 0
    res = runner.invoke(cli, ["check", str(tmp_path / "p.json"), "--budget-ms", "33", "--require-verified"])
    assert res.exit_code == 1
    assert res.output.startswith("FAIL: p99 ")
    assert ("FAIL (--require-verified): provenance: unverified (the TensorRT version is not recorded (no trtexec banner "
            "in device.txt or the log, no machine.txt package))") in res.output
    alone = runner.invoke(cli, ["check", str(tmp_path / "p.json"), "--require-verified", "--json", "-"])
    assert alone.exit_code == 1 and json.loads(alone.output)["passed"] is False
    # with the device.txt the machine would have written, nothing is missing
    done = tmp_path / "exports"
    shutil.copytree(RTX_QAT, done)
    (done / "device.txt").write_text(RTX_DEVICE_TXT)
    res = runner.invoke(cli, ["profile", "--trtexec", str(done), "--onnx", str(onnx_path), "--target", str(target),
                              "--json", "-"])
    assert res.exit_code == 0 and json.loads(res.output)["provenance"]["status"] == "verified"
    # bad input: a folder without exports, options that do not go together, a bare folder of exports
    for args, message in ((["profile", "--trtexec", str(tmp_path), "--onnx", str(onnx_path), "--target", str(target)],
                           "holds no tensorrt timing export"),
                          (["profile", "--trtexec", str(RTX_QAT), "--onnx", str(onnx_path)],
                           "trtexec exports are read with --trtexec DIR --onnx MODEL.onnx --target TARGET"),
                          (["profile", str(RTX_QAT)], "trtexec exports made by hand are read with `edgekit profile "
                                                      f"--trtexec {RTX_QAT} --onnx MODEL.onnx --target TARGET`")):
        res = runner.invoke(cli, args)
        assert res.exit_code == 2 and res.output.startswith("error: ") and message in res.output, res.output


def test_missing_device_record_is_a_warning_in_the_json(tmp_path, no_tensorrt):
    """A results folder with the bundle's manifest but no device.txt: the console and the JSON say so."""
    from test_runtime import REAL_RESNET, onnx_of_engine

    bundle = _bundle(tmp_path, onnx_of_engine(Path(f"{REAL_RESNET}.graph.json"), tmp_path / "resnet18-qat.onnx"))
    results = _copy_results(REAL_RESNET.parent, bundle / "results", metadata=False)
    shutil.copy(bundle / "manifest.json", results / "bundle_manifest.json")
    runner = CliRunner()
    res = runner.invoke(cli, ["profile", str(results), "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["source"] == "device" and p["provenance"]["status"] == "unverified"
    assert p["provenance"]["reasons"] == [
        "the GPU and its SM are not recorded (no device.txt, trtexec log device section or Engine Explorer metadata)",
        "the TensorRT version is not recorded (no trtexec banner in device.txt or the log, no machine.txt package)"]
    assert p["warnings"][0].startswith("provenance unverified: the GPU and its SM are not recorded")
    assert "warning: provenance unverified" in res.output
    assert runner.invoke(cli, ["check", str(tmp_path / "p.json"), "--require-verified"]).exit_code == 1


def test_layer_name_overlap():
    names = {"Conv_0", "Relu_1", "MaxPool_2", "conv1.weight", "/m/Add", "x"}
    assert layer_names("Conv_0 + Relu_1", {}) == ["Conv_0", "Relu_1"]
    assert layer_names("PWN(PWN(Sigmoid_5), Mul_6)", {}) == ["Sigmoid_5", "Mul_6"]
    assert layer_names("Reformatting CopyNode for Input Tensor 0 to MaxPool_2", {}) == ["MaxPool_2"]
    assert layer_names("node_of_x", {}) == ["x"]
    assert layer_names("__myl_AddMulCast_0", {}) == []  # TensorRT's own name: nothing to compare ...
    assert layer_names("__myl_AddMulCast_0", {"__myl_AddMulCast_0": ["/m/Add"]}) == ["/m/Add"]  # ... unless its metadata
    assert overlap(["Conv_0 + Relu_1", "other", "__myl_x"], names, {}) == (1, 2, "other")


def test_check_require_verified_reads_every_unverified_field(tmp_path):
    """A generic gate: any field the profile marks unverified fails it, with the field's reasons."""
    from edgekit.check import check_verified, unverified_reasons
    from edgekit.profiling import LatencyStats, ProfileResult

    stats = LatencyStats.from_samples([1.0, 1.1, 1.2])
    measured = ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={}, latency_ms=stats,
                             throughput_per_s=900.0)
    assert check_verified(measured).passed and unverified_reasons(measured) == []
    d = measured.to_dict()
    d["provenance"] = {"status": "unverified", "checks": [], "reasons": ["no device.txt"]}
    assert unverified_reasons(ProfileResult.from_dict(d)) == ["provenance: unverified (no device.txt)"]
    from edgekit.check import check_budget

    v = check_budget(ProfileResult.from_dict(d), 33.0, require_verified=True)
    assert not v.passed and v.unverified == ("provenance: unverified (no device.txt)",)
    assert check_budget(ProfileResult.from_dict(d), 33.0).passed  # without the flag: a warning in the message
    assert "warning: provenance: unverified (no device.txt)" in check_budget(ProfileResult.from_dict(d), 33.0).message()
    est = ProfileResult(engine="", runtime="estimate", target="cpu", model="m", settings={},
                        latency_ms=LatencyStats(1, 1, 1, 1, 1, 1, 1, 0, 0, 0), throughput_per_s=1.0, source="estimated")
    v = check_verified(est)
    assert not v.passed and v.message() == ("FAIL (--require-verified): latency: an estimate (roofline model), not a "
                                            "measurement")
    with pytest.raises(BadInputError, match="unknown provenance 'trusted'"):
        ProfileResult.from_dict({**d, "provenance": {"status": "trusted"}})
