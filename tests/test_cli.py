"""The CLI's contract: one-line errors naming the bad value, exit code 2 for bad input, 1 for a
failed check, no traceback, and nothing half-written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgekit.cli import cli
from edgekit.profiling import LatencyStats, ProfileResult


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def one_line_error(result, exit_code: int = 2) -> str:
    assert result.exit_code == exit_code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def profile_json(tmp_path: Path) -> Path:
    stats = LatencyStats.from_samples([10.0] * 50 + [11.0] * 45 + [20.0] * 5)
    prof = ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={}, latency_ms=stats,
                         throughput_per_s=90.0)
    return prof.save(tmp_path / "profile.json")


def test_check_pass_and_fail_exit_codes(profile_json: Path, tmp_path: Path):
    ok = run("check", str(profile_json), "--budget-ms", "33", "--percentile", "p99", "--json", str(tmp_path / "v.json"))
    assert ok.exit_code == 0, ok.output
    assert ok.output.startswith("PASS: p99 ")
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["passed"] is True and verdict["budget_ms"] == 33
    miss = run("check", str(profile_json), "--budget-ms", "15", "--percentile", "p99")
    assert miss.exit_code == 1
    assert "missed by" in miss.output
    p50 = run("check", str(profile_json), "--budget-ms", "15", "--percentile", "p50")
    assert p50.exit_code == 0
    jitter = run("check", str(profile_json), "--budget-ms", "33", "--max-jitter", "1.2")
    assert jitter.exit_code == 1 and "jitter p99/p50" in jitter.output


@pytest.mark.parametrize("args, message", [
    (["check", "PROFILE", "--budget-ms", "-5"], "budget must be a positive number of milliseconds, got -5.0"),
    (["check", "PROFILE", "--budget-ms", "0"], "budget must be a positive number of milliseconds, got 0.0"),
    (["check", "PROFILE", "--budget-ms", "33", "--percentile", "p42"], "unknown percentile 'p42'"),
    (["check", "nowhere.json", "--budget-ms", "33"], "profile 'nowhere.json' does not exist"),
    (["export", "no-such-model", "-o", "OUT"], "unknown model 'no-such-model' (choose from"),
    (["export", "missing/model.onnx", "-o", "OUT"], "model file 'missing/model.onnx' does not exist"),
    (["build", "tiny.onnx", "--target", "nosuch-board", "-o", "OUT"], "unknown target 'nosuch-board' (choose from"),
    (["compress", "efficientnet-lite0", "--bits", "5", "-o", "OUT"], "unsupported bit width 5 (choose from 2, 3, 4, 8)"),
    (["compress", "efficientnet-lite0", "--bits", "4", "--method", "ptq", "-o", "OUT"], "--method ptq quantizes"),
    (["report", "nowhere"], "report folder 'nowhere' does not exist"),
])
def test_bad_input_is_one_line_exit_2(args, message, profile_json: Path, tmp_path: Path, tiny_onnx):
    args = [a.replace("PROFILE", str(profile_json)).replace("OUT", str(tmp_path / "out"))
            .replace("tiny.onnx", str(tiny_onnx)) for a in args]
    line = one_line_error(run(*args))
    assert message in line
    assert not (tmp_path / "out").exists()


def test_corrupt_and_truncated_onnx(tmp_path: Path, tiny_onnx):
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"this is not a protobuf" * 10)
    line = one_line_error(run("build", str(corrupt), "--target", "cpu", "-o", str(tmp_path / "e1")))
    assert "corrupt.onnx is not a valid ONNX model" in line
    truncated = tmp_path / "truncated.onnx"
    data = Path(tiny_onnx).read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    line = one_line_error(run("build", str(truncated), "--target", "cpu", "-o", str(tmp_path / "e2")))
    assert "truncated.onnx is not a valid ONNX model" in line
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e2").exists()


def test_unknown_option_is_one_line_exit_2():
    line = one_line_error(run("build", "x", "--bogus"))
    assert "No such option '--bogus'" in line


def test_real_process_has_no_traceback(tmp_path: Path):
    r = subprocess.run([sys.executable, "-m", "edgekit.cli", "export", "nope-model", "-o", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.startswith("error: unknown model 'nope-model' (choose from ")
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_zoo_lists_the_built_in_models():
    r = run("zoo")
    assert r.exit_code == 0
    for name in ("efficientnet-lite0 (default)", "smollm2-135m", "minilm-l6"):
        assert name in r.output
