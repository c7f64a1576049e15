"""profile_engine: the trtexec method on an engine folder, the result's fields and JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekit.build import build_engine
from edgekit.errors import BadInputError
from edgekit.profiling import ProfileConfig, ProfileResult, profile_engine

QUICK = ProfileConfig(warmup_ms=10, duration_s=0.05, iterations=20, threads=1, node_iterations=3, top_k=100)


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, tiny_onnx) -> Path:
    return build_engine(tiny_onnx, "cpu", tmp_path_factory.mktemp("prof") / "engine")


def test_profile_fields(engine_dir, tmp_path):
    out_json = tmp_path / "sub" / "profile.json"
    r = profile_engine(engine_dir, QUICK, out_json=out_json)
    s = r.latency_ms
    assert s.count >= QUICK.iterations
    assert 0 < s.min <= s.p50 <= s.p90 <= s.p95 <= s.p99 <= s.max
    assert s.std >= 0 and s.cv == pytest.approx(s.std / s.mean)
    assert r.throughput_per_s == pytest.approx(1e3 / s.mean)
    assert r.runtime == "onnxruntime" and r.target == "cpu" and r.model == "tiny"
    assert r.total_nodes == len(r.nodes) >= 3
    assert sum(n.share for n in r.nodes) == pytest.approx(1.0)
    assert sum(t["share"] for t in r.op_types) == pytest.approx(1.0)
    assert r.float_share == pytest.approx(1.0) and r.quantized_nodes == 0
    assert r.peak_memory_mb > 0 and r.model_size_mb > 0
    assert r.settings["threads"] == 1 and r.settings["warmup_ms"] == 10 and r.settings["iterations"] == 20
    assert r.settings["engine_settings"]["intra_op_num_threads"] == 1
    assert r.settings["input_shapes"] == {"input": [1, 3, 16, 16]}
    assert r.machine["cores"] >= 1
    # the CV warning follows trtexec's 2.5% threshold
    assert (s.cv > 0.025) == any("coefficient of variation" in w for w in r.warnings)
    saved = ProfileResult.load(out_json)
    assert saved.latency_ms.p99 == s.p99 and len(saved.nodes) == len(r.nodes)
    assert json.loads(out_json.read_text())["runtime"] == "onnxruntime"


def test_profile_batch_and_no_nodes(engine_dir):
    cfg = ProfileConfig(warmup_ms=0, duration_s=0, iterations=5, batch=4, node_profile=False)
    r = profile_engine(engine_dir, cfg)
    assert r.settings["input_shapes"] == {"input": [4, 3, 16, 16]} and r.settings["batch"] == 4
    assert r.nodes == [] and r.float_share is None
    assert r.throughput_per_s == pytest.approx(4e3 / r.latency_ms.mean)


def test_profile_bad_inputs(engine_dir, tmp_path, tiny_onnx):
    from edgekit.export.onnx import export_onnx

    with pytest.raises(BadInputError, match="not an edgekit output folder"):
        profile_engine(tmp_path)
    onnx_dir = export_onnx(tiny_onnx, tmp_path / "onnx")
    with pytest.raises(BadInputError, match=r"holds a 'onnx' artifact; profile takes an engine folder"):
        profile_engine(onnx_dir)
    with pytest.raises(BadInputError, match=r"threads must be >= 1, got 0"):
        ProfileConfig(threads=0)


@pytest.mark.slow
def test_efficientnet_lite0_export_build_profile(tmp_path):
    from edgekit.artifact import read_manifest
    from edgekit.export.onnx import export_onnx

    pytest.importorskip("efficientnet_lite_pytorch")
    onnx_dir = export_onnx("efficientnet-lite0", tmp_path / "onnx")
    parity = read_manifest(onnx_dir).metrics["parity"]
    assert parity["passed"] and parity["max_abs_error"] < 1e-3
    engine = build_engine(onnx_dir, "cpu", tmp_path / "engine")
    assert read_manifest(engine).model["name"] == "efficientnet-lite0"
    r = profile_engine(engine, ProfileConfig(warmup_ms=0, duration_s=0, iterations=3, threads=1, node_iterations=1),
                       out_json=tmp_path / "p.json")
    assert r.latency_ms.count >= 3 and r.total_nodes >= 40  # 49 convolutions after fusion
    assert r.op_types[0]["op_type"] == "Conv" and r.op_types[0]["share"] > 0.5
    assert r.model_size_mb > 10  # 4.65M float32 parameters
