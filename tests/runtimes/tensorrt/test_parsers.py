"""Parsers of trtexec's --exportTimes / --exportProfile / --exportLayerInfo JSON, its log and
TensorRT Engine Explorer's metadata.

tests/fixtures/trtexec/real/ holds files written by real TensorRT runs (NVIDIA's TensorRT Engine
Explorer: ResNet-18 QAT on an A100, MobileNetV2 QAT on a TITAN RTX; origin and licence in its
README); the per-layer precision report is asserted on them. The files at the top of
tests/fixtures/trtexec/ are hand-written in the documented format (a small INT8 CNN, and a DLA
engine with a GPU fallback, for which no real export is public).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from edgekit.errors import BadInputError
from edgekit.profiling import ProfileResult, profile_from_recorded
from edgekit.runtimes.tensorrt import parsers as tp

FIX = Path(__file__).parents[2] / "fixtures" / "trtexec"


@pytest.mark.parametrize("fmt,want", [
    ("Thirty-two wide channel vectorized row major Int8 format", "int8"),
    ("Row major linear FP32", "fp32"),
    ("Channel major FP16 format where channel % 8 == 0", "fp16"),
    ("Row major linear BFloat16 format", "bf16"),
    ("Row major linear FP8 format", "fp8"),
    ("Row major linear UInt8 format", "uint8"),
    ("Half", "fp16"), ("Float", "fp32"), ("Int8", "int8"), ("Row major linear Int32", "int32"),
    ("", "unknown"), (None, "unknown"),
])
def test_dtype_of(fmt, want):
    assert tp.dtype_of(fmt) == want


def test_read_times_trt10():
    trace = tp.read_times(FIX / "int8_times.json")
    assert len(trace.latency_ms) == 60 and trace.dropped_warmup == 0
    # latency = h2d + compute + d2h
    assert trace.latency_ms[0] == pytest.approx(0.442)
    assert trace.compute_ms[37] == pytest.approx(0.917)
    assert trace.walltime_ms > sum(trace.latency_ms)  # gaps between inferences
    assert trace.throughput_per_s == pytest.approx(60 / trace.walltime_ms * 1e3)


def test_read_times_trt8_drops_warmup_like_trtexec():
    all_recs = tp.read_times(FIX / "trt8_times_with_warmup.json")
    assert len(all_recs.latency_ms) == 10
    trace = tp.read_times(FIX / "trt8_times_with_warmup.json", warmup_ms=200.0)
    assert trace.dropped_warmup == 4 and len(trace.compute_ms) == 6
    assert max(trace.compute_ms) == pytest.approx(1.02)


def test_read_profile_and_layers():
    count, layers = tp.read_profile(FIX / "int8_profile.json")
    assert count == 120 and len(layers) == 8
    assert layers[3].name == "conv3.weight + Conv_15" and layers[3].average_ms == pytest.approx(0.12)
    assert layers[3].median_ms == pytest.approx(0.118)
    info = {li.name: li for li in tp.read_layer_info(FIX / "int8_layers.json")}
    assert len(info) == 7
    conv1 = info["conv1.weight + QuantizeLinear_3 + Conv_5 + PWN(Relu_6)"]
    assert (conv1.op_type, conv1.precision, conv1.quantized) == ("Convolution", "int8", True)
    conv3 = info["conv3.weight + Conv_15"]
    assert (conv3.precision, conv3.quantized) == ("fp16", False)
    q = info["QuantizeLinear_0"]
    assert (q.op_type, q.precision, q.quantized) == ("Reformat", "fp32", False)
    dq = info["DequantizeLinear_24"]  # int8 in, fp32 out: a Q/DQ reformat, not int8 compute
    assert dq.quantized is False
    assert info["fc.weight + QuantizeLinear_20 + MatMul_22"].quantized is True


def test_profile_from_trtexec_int8():
    r = profile_from_recorded(tp.recorded_run_from_trtexec(
        times=FIX / "int8_times.json", profile=FIX / "int8_profile.json", layers=FIX / "int8_layers.json", engine="e",
        target="h100-sxm", model="tiny"))
    assert r.source == "trtexec" and r.runtime == "tensorrt"
    lat = np.array([x["latencyMs"] for x in json.loads((FIX / "int8_times.json").read_text())])
    assert r.latency_ms.count == 60
    assert r.latency_ms.p50 == pytest.approx(float(np.percentile(lat, 50)))
    assert r.latency_ms.max == pytest.approx(0.947)
    assert r.settings["gpu_compute_ms"]["p50"] == pytest.approx(r.latency_ms.p50 - 0.03)
    assert r.settings["profiled_iterations"] == 120
    # 3 of 8 timed layers compute in int8: conv1, conv2, fc
    assert (r.quantized_nodes, r.total_nodes) == (3, 8)
    by_name = {n.name: n for n in r.nodes}
    assert by_name["conv3.weight + Conv_15"].precision == "fp16"
    assert by_name["Reformatting CopyNode for Input Tensor 0 to GlobalAveragePool_16"].op_type == "Reformat"
    # float share over the layers of known precision: the reformat (0.02 ms) is not in the layer info, so its
    # precision is unknown and counts neither as float nor as int8: 1 - (0.08 + 0.06 + 0.05) / 0.38
    assert by_name["Reformatting CopyNode for Input Tensor 0 to GlobalAveragePool_16"].precision == "unknown"
    assert r.float_share == pytest.approx(1 - 0.19 / 0.38)
    assert r.nodes[0].name == "conv3.weight + Conv_15"  # sorted by time
    assert sum(n.share for n in r.nodes) == pytest.approx(1.0)
    # the slow inference pushes the CV of GPU compute above trtexec's 2.5 % threshold
    assert any("coefficient of variation" in w for w in r.warnings)
    # and it round-trips through edgekit's profile JSON like any other runtime's result
    again = ProfileResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert again.latency_ms.p99 == r.latency_ms.p99 and again.nodes[0].precision == "fp16"


def test_profile_compute_metric():
    r = profile_from_recorded(tp.recorded_run_from_trtexec(times=FIX / "int8_times.json", metric="compute"))
    assert r.latency_ms.min == pytest.approx(0.412) and r.nodes == []
    with pytest.raises(BadInputError, match="unknown trtexec metric 'gpu'"):
        tp.recorded_run_from_trtexec(times=FIX / "int8_times.json", metric="gpu")


def test_dla_fallback_reported():
    r = tp.recorded_run_from_trtexec(times=FIX / "int8_times.json", profile=FIX / "dla_profile.json",
                                     layers=FIX / "dla_layers.json")
    assert any("1 layers run on the GPU, not the DLA: softmax" in w for w in r.warnings)


def test_profile_from_folder(tmp_path):
    import shutil

    (tmp_path / "results").mkdir()
    shutil.copy(FIX / "int8_times.json", tmp_path / "results" / tp.TIMES_JSON)
    shutil.copy(FIX / "int8_profile.json", tmp_path / "results" / tp.PROFILE_JSON)
    shutil.copy(FIX / "int8_layers.json", tmp_path / "results" / tp.LAYERS_JSON)
    r = profile_from_recorded(tp.recorded_run_from_folder(tmp_path))
    assert r.quantized_nodes == 3 and r.latency_ms.count == 60
    with pytest.raises(BadInputError, match="has no trtexec results"):
        tp.recorded_run_from_folder(tmp_path / "results" / "nothing")


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(BadInputError, match="is not valid JSON"):
        tp.read_times(bad)
    bad.write_text(json.dumps([{"name": "x"}]))
    with pytest.raises(BadInputError, match="not a trtexec --exportTimes file"):
        tp.read_times(bad)
    with pytest.raises(BadInputError, match="not a trtexec --exportProfile file"):
        tp.read_profile(bad)
    bad.write_text(json.dumps({"Layers": ["conv1", "relu1"]}))
    with pytest.raises(BadInputError, match="profilingVerbosity=detailed"):
        tp.read_layer_info(bad)
    with pytest.raises(BadInputError, match="does not exist"):
        tp.read_profile(tmp_path / "missing.json")


def _results(tmp_path: Path) -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for src, name in (("int8_times.json", tp.TIMES_JSON), ("int8_profile.json", tp.PROFILE_JSON),
                      ("int8_layers.json", tp.LAYERS_JSON)):
        (folder / name).write_bytes((FIX / src).read_bytes())
    return folder


@pytest.mark.parametrize("name, size, message", [
    (tp.TIMES_JSON, 300 << 20, "trtexec --exportTimes file .*times.json is 300 MiB; edgekit reads at most 256 MiB"),
    (tp.LOG_FILE, 300 << 20, "trtexec log .*trtexec.log is 300 MiB; edgekit reads at most 256 MiB"),
    ("device.txt", 2 << 20, "device record .*device.txt is 2 MiB; edgekit reads at most 1 MiB"),
    ("machine.txt", 2 << 20, "machine record .*machine.txt is 2 MiB; edgekit reads at most 1 MiB"),
])
def test_a_devices_results_are_read_within_bounds(tmp_path, name, size, message):
    """A results folder comes from a device: a sparse file there costs it nothing, and was read
    whole. Each file is refused past its maximum before it is read (the command line's one
    line: test_provenance)."""
    from edgekit.runtimes.tensorrt.provenance import exports_of, read_record
    from edgekit.runtimes.tensorrt.results import read_machine_state

    folder = _results(tmp_path)
    with open(folder / name, "wb") as f:
        f.truncate(size)  # sparse: nothing on disk
    readers = {tp.TIMES_JSON: lambda: tp.recorded_run_from_folder(folder),
               tp.LOG_FILE: lambda: tp.recorded_run_from_folder(folder),
               "device.txt": lambda: read_machine_state(folder), "machine.txt": lambda: read_machine_state(folder)}
    with pytest.raises(BadInputError, match=message):
        readers[name]()
    if name.endswith(".txt"):
        with pytest.raises(BadInputError, match=message):
            read_record(exports_of(folder))


def test_special_files_in_a_results_folder_are_never_opened(tmp_path):
    """FIFOs under the names of trtexec's log and the device records, and one a sniffed role
    would open (``*.log``): profile reads the regular files and never blocks."""
    from edgekit.runtimes.tensorrt.provenance import exports_of, read_record
    from edgekit.runtimes.tensorrt.results import read_machine_state

    folder = _results(tmp_path)
    for name in (tp.LOG_FILE, "device.txt", "machine.txt", "other.log", "t.json"):
        os.mkfifo(folder / name)
    found = exports_of(folder)
    assert set(found) == {"times", "profile", "layers"}
    r = profile_from_recorded(tp.recorded_run_from_folder(folder, found=found))
    assert r.latency_ms.count == 60
    assert read_machine_state(folder)[0] == {"measured_on": "device"} and not read_record(found).gpu


# --- real trtexec exports (NVIDIA's TensorRT Engine Explorer; see fixtures/trtexec/README.md) ---

REAL = FIX / "real"
RESNET = REAL / "resnet-qat-a100" / "resnet-qat.onnx.engine"
MOBILENET = REAL / "mobilenet-v2-residuals-qat-titanrtx" / "mobilenet_v2_residuals.qat.onnx.engine"


def test_real_layer_info_and_profile_resnet_qat_a100():
    info = {li.name: li for li in tp.read_layer_info(f"{RESNET}.graph.json")}
    count, layers = tp.read_profile(f"{RESNET}.profile.json")
    assert len(info) == 37 and count == 1 and len(layers) == 37
    conv = info["layer1.0.conv2.weight + QuantizeLinear_32 + Conv_34 + Add_36 + Relu_37"]
    assert (conv.op_type, conv.layer_type, conv.precision, conv.quantized, conv.role) == (
        "Convolution", "CaskConvolution", "int8", True, "compute")
    q = info["QuantizeLinear_2"]  # fp32 input -> int8: a Q/DQ reformat, not int8 compute
    assert (q.origin, q.precision, q.quantized, q.role) == ("QDQ", "fp32", False, "reformat")
    pool = info["MaxPool_12"]  # conv1 writes fp32, so the max-pool runs in fp32
    assert (pool.op_type, pool.precision, pool.quantized) == ("Pooling", "fp32", False)
    assert layers[1].name == "conv1.weight + QuantizeLinear_7 + Conv_9" and layers[1].average_ms == pytest.approx(0.201728)


def test_real_precision_report_resnet_qat_a100():
    run = tp.recorded_run_from_trtexec(times=f"{RESNET}.timing.json", profile=f"{RESNET}.profile.json",
                                       layers=f"{RESNET}.graph.json", warmup_ms=200)
    r = profile_from_recorded(run)
    # 21 convolutions (conv + Q + add + relu fused) compute in int8; 2 pooling layers fell back
    assert (r.quantized_nodes, r.total_nodes) == (21, 37)
    rows = {(row["precision"], row["role"]): row for row in run.settings["precision_breakdown"]["rows"]}
    assert rows[("int8", "compute")]["layers"] == 21
    assert rows[("int8", "compute")]["time_ms"] == pytest.approx(0.710656, abs=1e-6)
    assert rows[("fp16", "reformat")]["layers"] == 10 and rows[("fp32", "reformat")]["layers"] == 2
    assert rows[("int8", "noop")]["time_ms"] == 0.0
    fallbacks = run.settings["precision_breakdown"]["fallbacks"]
    assert [(f["name"], f["precision"]) for f in fallbacks] == [("MaxPool_12", "fp32"), ("GlobalAveragePool_246", "fp16")]
    assert fallbacks[0]["time_ms"] == pytest.approx(0.095232)
    assert r.float_share == pytest.approx(1 - 0.710656 / 1.095680, abs=1e-6)
    assert any(w.startswith("2 compute layers of this quantized engine run in float: MaxPool_12 (fp32, 0.095 ms)")
               for w in r.warnings)
    # TensorRT 8 keeps the warm-up in --exportTimes: 222 of the first 400 records start before 200 ms
    assert run.settings["dropped_warmup_records"] == 222 and r.latency_ms.count == 178
    assert r.latency_ms.p50 == pytest.approx(0.88269, abs=1e-6) and r.latency_ms.max == pytest.approx(0.884735)
    # batch 32 at 0.88 ms: the summary trtexec printed for the whole run (metadata) agrees
    meta = json.loads(Path(f"{RESNET}.profile.metadata.json").read_text())["performance_summary"]
    assert meta["GPU Compute Time"][3] == pytest.approx(r.latency_ms.p50, rel=0.01)


def test_real_precision_report_mobilenet_v2_titan_rtx():
    run = tp.recorded_run_from_trtexec(times=f"{MOBILENET}.timing.json", profile=f"{MOBILENET}.profile.json",
                                       layers=f"{MOBILENET}.graph.json", warmup_ms=200)
    r = profile_from_recorded(run)
    assert run.settings["profiled_iterations"] == 8657
    assert (r.quantized_nodes, r.total_nodes) == (53, 58)
    assert [f["name"] for f in run.settings["precision_breakdown"]["fallbacks"]] == ["GlobalAveragePool_747"]
    assert r.float_share == pytest.approx(0.049437, abs=1e-6)
    assert run.settings["dropped_warmup_records"] == 0 and r.latency_ms.count == 400
    assert r.latency_ms.p50 == pytest.approx(0.346527, abs=1e-6)
    # one slow inference (0.598 ms) pushes the CV of GPU compute time over trtexec's 2.5 %
    assert r.latency_ms.max == pytest.approx(0.598404)
    assert any(w.startswith("GPU compute time varies: coefficient of variation 4.8%") for w in r.warnings)


def trtexec_log_from_metadata(build_meta: Path, profile_meta: Path, device: dict | None = None,
                              banner: str | None = None) -> str:
    """A trtexec log in trtexec's own line format (samples/common/sampleReporting.cpp and
    sampleOptions.cpp), RECONSTRUCTED from the values Engine Explorer kept of a real run's log.
    ``device``: the "Device Information" section to write instead of the recorded one (a fake
    device's own), ``banner``: trtexec's first line (``TensorRT v100300``)."""
    stamp = "[06/03/2022-10:00:00] [I] "
    b, p = json.loads(build_meta.read_text()), json.loads(profile_meta.read_text())
    lines = [f"&&&& RUNNING TensorRT.trtexec [{banner}] # trtexec"] if banner else []
    lines += [f"{stamp}=== Build Options ==="] + [f"{stamp}{k}: {v}" for k, v in b["build_options"].items()]
    info = device if device is not None else p["device_information"]
    lines += [f"{stamp}=== Device Information ==="] + [f"{stamp}{k}: {v}" for k, v in info.items()]
    lines += [f"{stamp}", f"{stamp}=== Performance summary ===", f"{stamp}Throughput: {p['performance_summary']['Throughput']} qps"]
    for key in ("Latency", "Enqueue Time", "H2D Latency", "GPU Compute Time", "D2H Latency"):
        v = p["performance_summary"][key]
        pct = ", ".join(f"percentile({q}%) = {x} ms" for q, x in zip((90, 95, 99)[-(len(v) - 4):], v[4:]))
        lines.append(f"{stamp}{key}: min = {v[0]} ms, max = {v[1]} ms, mean = {v[2]} ms, median = {v[3]} ms, {pct}")
    lines.append(f"{stamp}Total Host Walltime: {p['performance_summary']['Total Host Walltime']} s")
    return "\n".join(lines + ["&&&& PASSED TensorRT.trtexec"]) + "\n"


def test_real_build_and_profile_metadata():
    build = tp.read_trex_metadata(f"{RESNET}.build.metadata.json")
    assert build["build_options"]["Precision"] == "FP32+FP16+INT8"
    prof = tp.read_trex_metadata(f"{RESNET}.profile.metadata.json")
    assert prof["device_information"]["Selected Device"] == "NVIDIA A100 80GB PCIe"
    assert prof["device_information"]["Compute Capability"] == 8.0
    # TensorRT 8.2 printed min, max, mean, median and the 99th percentile ...
    assert prof["performance_summary"]["GPU Compute Time"] == {"min": 0.878601, "max": 0.889893, "mean": 0.882274,
                                                              "median": 0.882568, "p99": 0.884766}
    # ... later releases the 90th and 95th too
    mob = tp.read_trex_metadata(f"{MOBILENET}.profile.metadata.json")["performance_summary"]["Latency"]
    assert (mob["p90"], mob["p95"], mob["p99"]) == (0.26123, 0.278473, 0.38501)
    with pytest.raises(BadInputError, match="is not Engine Explorer metadata"):
        tp.read_trex_metadata(f"{RESNET}.profile.json")


def test_trtexec_log_sections(tmp_path):
    log = tmp_path / "trtexec.log"
    log.write_text(trtexec_log_from_metadata(Path(f"{RESNET}.build.metadata.json"), Path(f"{MOBILENET}.profile.metadata.json")))
    sections = tp.read_trtexec_log(log)
    assert sections["build_options"]["Precision"] == "FP32+FP16+INT8"
    assert sections["device_information"]["Selected Device"] == "NVIDIA TITAN RTX"
    perf = sections["performance_summary"]
    assert perf["Throughput"] == pytest.approx(float(json.loads(Path(f"{MOBILENET}.profile.metadata.json").read_text())
                                                     ["performance_summary"]["Throughput"]))
    assert perf["Latency"] == {"min": 0.255981, "max": 0.901474, "mean": 0.263917, "median": 0.25824, "p90": 0.26123,
                               "p95": 0.278473, "p99": 0.38501}


# Engine Explorer's eight example sets that carry trtexec's own summary (fixtures/trtexec/real/README.md)
SETS = {"resnet50-tf-rtx3090-fp32": ("resnet.onnx.engine", 103), "resnet50-tf-rtx3090-qat": ("resnet-qat.onnx.engine", 63),
        "resnet50-tf-rtx3090-fp16": ("resnet.onnx.engine", 86), "resnet18-a100-fp32": ("resnet.onnx.engine", 32),
        "resnet18-a100-fp16": ("resnet.onnx.engine", 36), "resnet-qat-a100": ("resnet-qat.onnx.engine", 37),
        "resnet18-a100-qat-residual": ("resnet-qat-residual.onnx.engine", 26),
        "resnet18-a100-qat-residual-qgap": ("resnet-qat-residual-qgap.onnx.engine", 24)}


@pytest.mark.parametrize("name", sorted(SETS))
def test_engine_explorer_sets_per_layer_times_to_the_last_digit(name):
    """Each layer's time and share, as trtexec wrote them (its percentage has 6 significant digits)."""
    stem, layers = SETS[name]
    base = REAL / name / stem
    count, times = tp.read_profile(f"{base}.profile.json")
    raw = json.loads(Path(f"{base}.profile.json").read_text())[1:]
    assert len(times) == len(raw) == layers
    assert [t.average_ms for t in times] == [r["averageMs"] for r in raw]  # exactly
    nodes = tp.nodes_from_trtexec(times, None)
    from edgekit.profiling import summarize_nodes

    summarize_nodes(nodes)
    total = sum(r["averageMs"] for r in raw)
    for n, r in zip(nodes, raw):
        assert n.share == pytest.approx(r["averageMs"] / total) and n.share * 100 == pytest.approx(r["percentage"],
                                                                                                    rel=1e-5, abs=1e-4)
    meta = tp.read_trex_metadata(f"{base}.profile.metadata.json")
    assert meta["device_information"]["Compute Capability"] in (8.0, 8.6)


def test_whole_timing_file_gives_trtexecs_own_summary():
    """The one set whose --exportTimes is kept whole (RTX 3090 FP32, TensorRT 8): min, max, median to
    the last digit and mean to the 6 digits trtexec printed, after dropping its 200 ms warm-up; p99
    differs by definition (trtexec takes a sample, edgekit interpolates)."""
    base = REAL / "resnet50-tf-rtx3090-fp32" / "resnet.onnx.engine"
    r = profile_from_recorded(tp.recorded_run_from_trtexec(times=f"{base}.timing.json", warmup_ms=200))
    trtexec = tp.read_trex_metadata(f"{base}.profile.metadata.json")["performance_summary"]["GPU Compute Time"]
    s = r.latency_ms
    assert (s.min, s.max, s.p50) == (trtexec["min"], trtexec["max"], trtexec["median"]) == (12.0986, 12.7928, 12.1682)
    assert round(s.mean, 4) == trtexec["mean"] == 12.1952
    assert s.count == 248 and trtexec["p99"] == 12.7775 and s.p99 == pytest.approx(12.699997, abs=1e-6)

