"""``--json`` on every command that prints a table: one JSON document on stdout and nothing
else there; and human tables show readable values, never a Python repr or raw JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from edgekit.cli import cli
from edgekit.profiling import LatencyStats, ProfileResult

MLP = "edgekit.pipelines.examples:tiny_mlp"
NO_TABLE = {"remote build"}  # one line: where the engine was fetched to


def run(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_document(result, exit_code: int = 0) -> object:
    """stdout is exactly one JSON document."""
    assert result.exit_code == exit_code, (result.output, result.exception)
    return json.loads(result.stdout)


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    out = []
    for name, cmd in group.commands.items():
        out.append((f"{prefix}{name}", cmd))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, f"{prefix}{name} ")
    return out


def test_every_table_command_has_json():
    # the group's own settings (-h): click caches each command's help option on first use
    ctx = click.Context(cli, **cli.context_settings)
    missing = [name for name, cmd in _commands(cli) if name not in NO_TABLE and name != "remote"
               and "--json" not in {o for p in cmd.get_params(ctx) for o in p.opts}]
    assert missing == []


@pytest.fixture
def profile_json(tmp_path: Path) -> Path:
    stats = LatencyStats.from_samples([10.0] * 50 + [11.0] * 45 + [20.0] * 5)
    prof = ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={}, latency_ms=stats,
                         throughput_per_s=90.0)
    return prof.save(tmp_path / "profile.json")


def test_zoo_and_targets(tmp_path: Path):
    models = one_document(run("zoo", "--json"))
    assert {"name", "default", "kind", "description", "package"} <= set(models[0])
    assert sum(m["default"] for m in models) == 1
    listed = one_document(run("targets", "--json"))
    assert one_document(run("targets", "list", "--json")) == listed
    assert "cpu" in {t["name"] for t in listed} and {"kind", "runtimes", "peak_tops"} <= set(listed[0])
    shown = one_document(run("targets", "show", "cpu", "--json"))
    assert shown["name"] == "cpu"
    human = run("targets", "show", "cpu")
    assert human.exit_code == 0
    assert "{" not in human.stdout and "[" not in human.stdout  # nested values as dotted rows, lists joined
    assert "runtimes" in human.stdout


def test_check_prints_the_verdict_or_writes_it(profile_json: Path, tmp_path: Path):
    verdict = one_document(run("check", profile_json, "--budget-ms", "15", "--json"), exit_code=1)
    assert verdict["passed"] is False and verdict["budget_ms"] == 15 and verdict["message"].startswith("FAIL")
    ok = run("check", profile_json, "--budget-ms", "33", "--json", tmp_path / "v.json")
    assert ok.exit_code == 0 and ok.stdout.startswith("PASS: p99 ")
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is True
    dash = one_document(run("check", profile_json, "--json", "-", "--budget-ms", "33"))
    assert dash["passed"] is True


def test_export_build_profile_estimate(tmp_path: Path, tiny_onnx: Path):
    exported = one_document(run("export", MLP, "-o", tmp_path / "x", "--json"))
    assert Path(exported["onnx"]).is_file() and "outputs" in exported["parity"]
    built = one_document(run("build", tmp_path / "x", "--target", "cpu", "-o", tmp_path / "e", "--json"))
    assert built["config"]["runtime"] == "onnxruntime" and built["target"] == "cpu"
    prof = one_document(run("profile", tmp_path / "e", "--duration-s", "0.05", "--iterations", "10", "--warmup-ms", "5",
                            "--no-nodes", "--json"))
    assert prof["runtime"] == "onnxruntime" and prof["latency_ms"]["p50"] > 0
    est = one_document(run("estimate", tiny_onnx, "--target", "cpu", "--json"))
    assert {"total_ms", "low_ms", "high_ms", "basis"} <= set(est) and est["calibration_report"] is None


def test_compress_metrics_are_readable_rows(tmp_path: Path):
    r = run("compress", MLP, "--precision", "fp16", "-o", tmp_path / "h")
    assert r.exit_code == 0, r.output
    assert "quality.cosine" in r.stdout and "half.weight_bytes_after" in r.stdout
    assert "{" not in r.stdout and '"' not in r.stdout  # no json.dumps of the nested quality dict
    doc = one_document(run("compress", MLP, "--precision", "fp16", "-o", tmp_path / "h", "--json"))
    assert doc["steps"] == ["half"] and doc["metrics"]["quality"]["passed"] is True


def test_run_dry_run_run_and_report(tmp_path: Path):
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "target": "cpu", "budget_ms": 1000, "percentile": "p99", "seed": 0,
        "profile": {"warmup_ms": 5, "duration_s": 0.05, "iterations": 10, "node_profile": False},
        "stages": [{"name": "mlp", "model": MLP, "budget_ms": 500}]}))
    plan = one_document(run("run", recipe, "--dry-run", "--json"))
    assert plan["recipe"] == "tiny" and plan["plan"][0]["stage"] == "mlp"
    result = one_document(run("run", recipe, "-o", tmp_path / "r", "--json"))
    assert result["passed"] is True and result["stages"][0]["stage"] == "mlp"
    report = one_document(run("report", tmp_path / "r", "--json"))
    assert isinstance(report, dict) and report


def test_a_real_process_prints_only_the_document(tmp_path: Path):
    """The exporter and ONNX Runtime print while they work (Python and native code): with --json
    that goes to stderr, and stdout is the document alone."""
    r = subprocess.run([sys.executable, "-m", "edgekit.cli", "export", MLP, "-o", str(tmp_path / "x"), "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["folder"] == str(tmp_path / "x")


def test_json_takes_a_file_on_every_command(tmp_path: Path):
    """`--json` is `--json [FILE]` everywhere: bare, the document on stdout; with FILE, the same
    document written there and the human output on stdout."""
    printed = one_document(run("zoo", "--json"))
    r = run("zoo", "--json", tmp_path / "zoo.json")
    assert r.exit_code == 0 and json.loads((tmp_path / "zoo.json").read_text()) == printed
    assert r.stdout.startswith(f"wrote {tmp_path / 'zoo.json'}\n") and "efficientnet-lite0 (default)" in r.stdout
    shown = run("targets", "show", "cpu", "--json", tmp_path / "cpu.json")
    assert shown.exit_code == 0 and json.loads((tmp_path / "cpu.json").read_text())["name"] == "cpu"
    r = run("targets", "--json", "list")
    assert r.exit_code == 2 and r.stderr == ("error: --json takes a FILE, not the command 'list': put it after the "
                                             "command (edgekit targets list ... --json)\n")
    assert not (tmp_path / "list").exists()
    assert run("zoo", "--json", tmp_path).exit_code == 2  # a folder is no output file
