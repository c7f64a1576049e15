"""Everything edgekit reads is validated: profile JSONs (the CI gate never passes on
nonsense), manifests and target files; each problem is one line naming the file, the field
and the value, exit 2."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekit.artifact import SCHEMA_VERSION, Manifest, read_manifest
from edgekit.check import check_budget
from edgekit.errors import BadInputError
from edgekit.profiling import STAT_KEYS, LatencyStats, ProfileConfig, ProfileResult
from edgekit.runtimes.base import NodeTiming
from edgekit.schema import read_json
from edgekit.targets import load_target

STATS = {"min": 1.0, "mean": 2.0, "p50": 2.0, "p90": 3.0, "p95": 3.5, "p99": 4.0, "max": 5.0, "std": 0.5, "cv": 0.25,
         "count": 100}


def _profile(**over):
    d = {"engine": "e", "runtime": "onnxruntime", "target": "cpu", "model": "m", "settings": {},
         "latency_ms": dict(STATS), "throughput_per_s": 500.0}
    d.update(over)
    return d


def _cli(*args):
    from click.testing import CliRunner

    from edgekit.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_line_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in result.output, err
    return err


# ----------------------------------------------------------------------------- what was seen

def test_all_negative_latencies_no_longer_pass_the_gate(tmp_path):
    # Before: exit 0, "PASS: p99 -1.000 ms vs budget 33 ms".
    p = tmp_path / "neg.json"
    p.write_text(json.dumps(_profile(latency_ms={**{k: -1.0 for k in STAT_KEYS}, "std": 0.0, "cv": 0.0,
                                                 "count": 100})))
    err = _one_line_error(_cli("check", p, "--budget-ms", 33))
    assert err == f"error: profile {str(p)!r} latency_ms.min: must be >= 0, got -1.0"


def test_a_string_latency_is_one_line_not_a_traceback(tmp_path):
    p = tmp_path / "fast.json"
    p.write_text(json.dumps(_profile(latency_ms={**STATS, "p99": "fast"})))
    err = _one_line_error(_cli("check", p, "--budget-ms", 33))
    assert err == f"error: profile {str(p)!r} latency_ms.p99: must be a finite number, got 'fast'"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_latency_is_bad_input_not_a_failed_check(tmp_path, literal):
    # Before: NaN compared false with the budget and the gate said FAIL (exit 1).
    p = tmp_path / "nan.json"
    p.write_text(json.dumps(_profile()).replace('"p99": 4.0', f'"p99": {literal}'))
    err = _one_line_error(_cli("check", p, "--budget-ms", 33))
    assert err == f"error: profile {str(p)!r} latency_ms.p99: must be a finite number, got {float(literal)!r}"


# ----------------------------------------------------------------------------- profile fields

@pytest.mark.parametrize("over, message", [
    ({"latency_ms": {**STATS, "p90": 3.9, "p95": 3.8}}, "latency_ms: p90 3.9 > p95 3.8: latencies must be ordered "
                                                        "min <= p50 <= p90 <= p95 <= p99 <= max"),
    ({"latency_ms": {**STATS, "max": 3.0}}, "latency_ms: p99 4.0 > max 3.0"),
    ({"latency_ms": {**STATS, "mean": 9.0}}, "latency_ms.mean: 9.0 lies outside [min, max] = [1.0, 5.0]"),
    ({"latency_ms": {**STATS, "count": 0}}, "latency_ms.count: a measured profile needs at least 1 timed run, got 0"),
    ({"latency_ms": {**STATS, "count": 2.5}}, "latency_ms.count: must be an integer, got 2.5"),
    ({"latency_ms": {**STATS, "count": True}}, "latency_ms.count: must be an integer, got True"),
    ({"latency_ms": {**STATS, "cv": -0.1}}, "latency_ms.cv: must be >= 0, got -0.1"),
    ({"latency_ms": {k: v for k, v in STATS.items() if k != "p95"}}, "latency_ms: missing required field(s) p95"),
    ({"latency_ms": {**STATS, "p999": 6.0}}, "latency_ms.p999: unknown field (known: count, cv, max, mean, min, p50,"),
    ({"latency_ms": [1, 2, 3]}, "latency_ms: must be a mapping of fields, got [1, 2, 3]"),
    ({"throughput_per_s": -5}, "throughput_per_s: must be >= 0, got -5"),
    ({"source": "guessed"}, "source: unknown source 'guessed' (choose from measured, device, trtexec, estimated)"),
    ({"float_share": 1.5}, "float_share: must be a share in [0, 1], got 1.5"),
    ({"quantized_nodes": 5, "total_nodes": 3}, "quantized_nodes: 5 exceeds total_nodes 3"),
    ({"nodes": [{"name": "a", "op_type": "Conv", "time_ms": -1.0}]}, "nodes[0].time_ms: must be >= 0, got -1.0"),
    ({"nodes": [{"name": "a", "op_type": "Conv", "time_ms": "x"}]}, "nodes[0].time_ms: must be a finite number, got 'x'"),
    ({"nodes": [{"name": "a"}]}, "nodes[0]: missing required field(s) op_type, time_ms"),
    ({"warnings": "none"}, "warnings: must be a list of strings, got 'none'"),
    ({"target": 7}, "target: must be a string, got 7 (quote it)"),
    ({"settings": []}, "settings: must be a mapping, got []"),
    ({"latency": 3}, "latency: unknown field (known: attempts, created, engine, float_share, generation, latency_ms, machine, model,"),
])
def test_profile_fields_are_checked(tmp_path, over, message):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_profile(**over)))
    with pytest.raises(BadInputError) as e:
        ProfileResult.load(p)
    assert str(e.value).startswith(f"profile {str(p)!r} {message}"), str(e.value)


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "profile {p}: must be a mapping of fields, got [1, 2]"),
    ("{", "profile {p} is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ("[" * 100_000, "profile {p} is nested too deeply"),
    ('{"engine": ' + "9" * 5000 + "}", "profile {p} holds a value JSON cannot convert: Exceeds the limit"),
])
def test_malformed_profile_files(tmp_path, content, message):
    p = tmp_path / "p.json"
    p.write_text(content)
    with pytest.raises(BadInputError) as e:
        ProfileResult.load(p)
    assert str(e.value).startswith(message.format(p=repr(str(p))))


def test_profile_files_are_bounded_and_folders_are_not_files(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(_profile()))
    with pytest.raises(BadInputError, match=r"is larger than 0 KiB; refusing to read it"):
        read_json(p, "profile", max_bytes=100)
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(BadInputError, match=r"^profile '.*dir.json' is not a file$"):
        ProfileResult.load(tmp_path / "dir.json")


def test_valid_profiles_round_trip_and_estimates_may_have_no_runs(tmp_path):
    rng = np.random.default_rng(0)
    stats = LatencyStats.from_samples(rng.gamma(4.0, 1.0, 500))
    result = ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={"batch": 1},
                           latency_ms=stats, throughput_per_s=1e3 / stats.mean,
                           nodes=[NodeTiming("conv", "Conv", 0.5, 0.25, "int8", True)], quantized_nodes=1, total_nodes=2)
    result.save(tmp_path / "p.json")
    assert ProfileResult.load(tmp_path / "p.json") == result
    same = LatencyStats(**{**{k: 2.0 for k in STAT_KEYS}, "std": 0.0, "cv": 0.0, "count": 0})
    estimate = ProfileResult(engine="", runtime="estimate", target="cpu", model=None, settings={}, latency_ms=same,
                             throughput_per_s=500.0, source="estimated")
    estimate.save(tmp_path / "e.json")
    verdict = check_budget(tmp_path / "e.json", 3.0)
    assert verdict.passed and verdict.latency_ms == 2.0 and verdict.jitter == 1.0


def test_check_on_a_folder_with_a_bad_profile_is_exit_2(tmp_path):
    (tmp_path / "profile.json").write_text(json.dumps(_profile(latency_ms={**STATS, "min": -0.5})))
    err = _one_line_error(_cli("check", tmp_path, "--budget-ms", 10))
    assert err.endswith("latency_ms.min: must be >= 0, got -0.5")


def test_profile_config_bounds():
    with pytest.raises(BadInputError, match=r"warm-up must be 0 to 600000 ms, got 1000000000000.0"):
        ProfileConfig(warmup_ms=1e12)
    with pytest.raises(BadInputError, match=r"iterations \(200\) exceeds max_iterations \(100\)"):
        ProfileConfig(iterations=200, max_iterations=100)
    with pytest.raises(BadInputError, match=r"^duration_s: must be a finite number, got 'long'$"):
        ProfileConfig(duration_s="long")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- property: the gate's oracle

_SLACK = 1e-9  # the rounding room the validation allows in order checks (relative)
_ORDER = ("min", "p50", "p90", "p95", "p99", "max")
_JUNK = (st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10, 10**20) | st.text(max_size=4)
         | st.none() | st.booleans() | st.lists(st.integers(), max_size=2))


def _valid(stats: object) -> bool:
    """The documented rules, written out independently of the code."""
    if not isinstance(stats, dict) or set(stats) != set(STATS):
        return False
    for k, v in stats.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (k == "count" and not isinstance(v, int)):
            return False
        if not math.isfinite(v) or v < 0:
            return False
    if stats["count"] < 1:
        return False
    ordered = all(stats[a] <= stats[b] + _SLACK * abs(stats[b]) + 1e-12 for a, b in zip(_ORDER, _ORDER[1:]))
    lo, hi = stats["min"] * (1 - _SLACK) - 1e-12, stats["max"] * (1 + _SLACK) + 1e-12
    return ordered and lo <= stats["mean"] <= hi


@settings(max_examples=150, deadline=None)
@given(samples=st.lists(st.floats(0.01, 100.0), min_size=1, max_size=30),
       edits=st.lists(st.tuples(st.sampled_from([*STATS, "extra"]), st.sampled_from(["set", "delete"]), _JUNK),
                      max_size=2),
       budget=st.floats(0.01, 200.0), percentile=st.sampled_from(STAT_KEYS))
def test_check_exits_0_1_on_valid_profiles_and_2_on_anything_else(tmp_path_factory, samples, edits, budget,
                                                                    percentile):
    stats = LatencyStats.from_samples(samples).__dict__.copy()
    for key, op, value in edits:
        if op == "delete":
            stats.pop(key, None)
        else:
            stats[key] = value
    path = tmp_path_factory.mktemp("p") / "p.json"
    path.write_text(json.dumps(_profile(latency_ms=stats)))
    r = _cli("check", path, "--budget-ms", budget, "--percentile", percentile)
    if _valid(stats):
        assert r.exit_code == (0 if stats[percentile] <= budget else 1), (stats, r.output)
        assert r.stdout.startswith("PASS" if r.exit_code == 0 else "FAIL")
    else:
        _one_line_error(r)


# ----------------------------------------------------------------------------- manifests

def _manifest(tmp_path, **over):
    d = {"kind": "onnx", "files": {"onnx": "model.onnx"}, "schema": SCHEMA_VERSION}
    d.update(over)
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    return tmp_path / "manifest.json"


@pytest.mark.parametrize("over, message", [
    ({"files": {"onnx": 3}}, "files.onnx: must be a string, got 3"),
    ({"files": {"onnx": "/etc/passwd"}}, "files.onnx: must be a relative path inside the folder, got '/etc/passwd'"),
    ({"files": {"onnx": "../../x.onnx"}}, "files.onnx: must be a relative path inside the folder"),
    ({"files": ["model.onnx"]}, "files: must be a mapping of names to strings, got ['model.onnx']"),
    ({"metrics": "good"}, "metrics: must be a mapping, got 'good'"),
    ({"steps": [{"name": "int8"}, {"nom": "x"}]}, "steps[1]: must be {name: str, config: mapping, meta: mapping}"),
    ({"steps": {"int8": {}}}, "steps: must be a list of mappings, got {'int8': {}}"),
    ({"inputs": {"model": {"path": "m", "sha256": 5}}}, "inputs.model.sha256: must be a string, got 5"),
    ({"schema": SCHEMA_VERSION + 1}, f"schema: {SCHEMA_VERSION + 1} is not a manifest schema this edgekit reads"),
    ({"created": 20240101}, "created: must be a string, got 20240101 (quote it)"),
    ({"colour": "red"}, "colour: unknown field (known: config, contents, created, files, inputs, kind, machine, metrics,"),
])
def test_manifest_fields_are_checked(tmp_path, over, message):
    mf = _manifest(tmp_path, **over)
    with pytest.raises(BadInputError) as e:
        read_manifest(tmp_path)
    assert str(e.value).startswith(f"{mf} {message}"), str(e.value)


def test_a_valid_manifest_reads_back():
    m = Manifest(kind="model", files={"weights": "model.safetensors"}, source="fmnist-cnn",
                 steps=[{"name": "int8", "config": {"method": "ptq"}, "meta": {}}], inputs={"model": {"path": "p",
                                                                                                       "sha256": "0"}})
    assert Manifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m


# ----------------------------------------------------------------------------- target files

BOARD = {"name": "my-board", "description": "a custom carrier", "kind": "jetson", "runtimes": ["tensorrt"],
         "precisions": ["fp16", "int8"], "peak_tops": {"int8": 40.0}, "dla_cores": 1}


@pytest.mark.parametrize("over, message", [
    ({"kind": "fpga"}, "kind: unknown kind 'fpga' (choose from cpu, gpu, jetson)"),
    ({"runtimes": ["tensorrt", "tvm"]}, "runtimes[1]: unknown runtime 'tvm' (choose from onnxruntime, torch, tensorrt, openvino)"),
    ({"runtimes": []}, "runtimes: names no runtime"),
    ({"precisions": ["fp16", "fp4"]}, "precisions[1]: unknown precision 'fp4' (choose from fp32,"),
    ({"peak_tops": {"int8": -1}}, "peak_tops.int8: must be > 0 TOPS, got -1"),
    ({"peak_tops": {"int8": "lots"}}, "peak_tops.int8: must be a finite number, got 'lots'"),
    ({"peak_tops": {"int3": 5}}, "peak_tops.int3: unknown precision (choose from fp32,"),
    ({"memory_bandwidth_gbs": float("nan")}, "memory_bandwidth_gbs: must be a finite number, got nan"),
    ({"dla_cores": 1.5}, "dla_cores: must be an integer, got 1.5"),
    ({"cores": 0}, "cores: must be > 0, got 0"),
    ({"sm": "87"}, "sm: must look like 'sm_87', got '87'"),
    ({"tensorrt_versions": "about 10"}, "tensorrt_versions: bad version range 'about 10'"),
    ({"name": "../x"}, "name: '../x' must be letters, digits"),
    ({"path": "/tmp/x"}, "path: unknown key (known:"),
    ({"peak_tflops": 1}, "peak_tflops: unknown key (known:"),
])
def test_target_files_are_checked(tmp_path, over, message):
    p = tmp_path / "board.yaml"
    p.write_text(yaml.safe_dump({**BOARD, **over}))
    with pytest.raises(BadInputError) as e:
        load_target(str(p))
    assert str(e.value).startswith(f"target file {str(p)!r} {message}"), str(e.value)
    r = _cli("targets", "show", p)
    assert _one_line_error(r) == f"error: {e.value}"


def test_target_files_refuse_aliases_and_missing_keys(tmp_path):
    p = tmp_path / "board.yaml"
    p.write_text("name: &n my-board\ndescription: *n\n")
    with pytest.raises(BadInputError, match=r"^target file '.*board.yaml': line 1: YAML anchors \(&n\) are not allowed$"):
        load_target(str(p))
    p.write_text(yaml.safe_dump({"name": "b", "description": "", "kind": "cpu"}))
    with pytest.raises(BadInputError, match=r"board.yaml': missing required key\(s\) runtimes, precisions$"):
        load_target(str(p))
    p.write_text(yaml.safe_dump(BOARD))
    assert load_target(str(p)).runtimes == ("tensorrt",)
