"""A step's option is declared once, on its config field: ``edgekit compress`` flags and the
plan derive from the metadata (edgekit/compress/options.py), and a new step's flags appear
with its registry line alone."""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import types
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from edgekit.cli import GeneratedOption, cli
from edgekit.compress import STEP_CONFIGS, STEPS, Step, StepContext, config_to_dict
from edgekit.compress.options import compress_options, option
from edgekit.compress.plan import plan_steps
from edgekit.errors import BadInputError
from edgekit.sources.handle import ModelHandle, StepRecord

# `edgekit compress --help-all` (the flags users know: those of before the options were generated,
# with --alpha renamed --distill-alpha and --train --data), plus what came since: --precision (the
# half step), --json, --help-all and the off side of the paired flags (--no-distill, --no-accept-quality-loss)
FLAGS = {"-o", "--out", "--bits", "--method", "--calib", "--calib-method", "--calib-samples", "--target",
         "--max-accuracy-drop", "--placement", "--keep-float", "--rounding", "--group-size", "--sym", "--asym",
         "--act-order", "--no-act-order", "--gptaq-alpha", "--refit", "--no-refit", "--seqlen", "--device", "--prune",
         "--importance", "--global", "--uniform", "--round-to", "--ignore", "--iterative-steps", "--distill",
         "--epochs", "--temperature", "--distill-alpha", "--data", "--seed", "--shapes", "--inputs", "--preprocess",
         "--accept-quality-loss", "--no-accept-quality-loss", "--no-distill", "--max-ppl-ratio", "--max-size-mb", "--avg-bits", "--smooth-alpha", "-h", "--help"}


def _help() -> str:
    r = CliRunner().invoke(cli, ["compress", "--help-all"], terminal_width=200)
    assert r.exit_code == 0
    return r.output


def test_compress_keeps_its_flags_and_help_texts():
    text = _help()
    shown = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", text.split("Options:")[1]))
    assert shown - {"--precision", "--json", "--help-all"} == FLAGS
    for line in ("--bits INTEGER", "8: INT8 (ptq/qat); 2, 3, 4, 8 weight-only (gptq/awq/rtn).",
                 "--sym / --asym", "--global / --uniform", "--keep-float TEXT",
                 "ptq | qat (8-bit); gptq-plus (default) | gptq (the paper's) | awq | awq-gptq | rtn (weight-only).",
                 "Distillation / QAT epochs."):
        assert line in text


def test_shared_flags_set_every_step_that_has_the_field():
    fields = {o.dest: {(s, f) for s, f, _ in o.fields} for o in compress_options()}
    assert fields["calib_samples"] == {("int8", "calib_samples"), ("weight-only", "calib_samples")}
    assert fields["seqlen"] == {("distill", "seqlen"), ("weight-only", "seqlen")}
    assert fields["epochs"] == {("distill", "epochs"), ("int8", "qat_epochs")}
    assert plan_steps(bits=4, calib_samples=16, seqlen=64) == [
        ("weight-only", {"method": "gptq-plus", "bits": 4, "calib_samples": 16, "seqlen": 64})]
    assert plan_steps(bits=8, method="qat", epochs=2, calib_samples=16) == [
        ("int8", {"method": "qat", "qat_epochs": 2, "calib_samples": 16})]
    # --epochs is QAT's only with --method qat (Int8Config.qat_epochs declares when={"method": ("qat",)})
    assert plan_steps(prune=0.3, distill=True, bits=8, epochs=5) == [
        ("prune", {"ratio": 0.3}), ("distill", {"epochs": 5}), ("int8", {"method": "ptq"})]
    # flags by their names (--global: "global"); unset ones (None, ()) leave the config's default
    assert plan_steps(prune=0.2, ignore=("fc",), round_to=None, keep_float=(), **{"global": True}) == [
        ("prune", {"ratio": 0.2, "global_pruning": True, "ignore": ("fc",)})]


def test_plan_rules_and_messages(tmp_path: Path):
    with pytest.raises(BadInputError, match=r"^--distill recovers a pruned model: give --prune RATIO too"):
        plan_steps(distill=True)
    with pytest.raises(BadInputError, match=r"^--method awq needs --bits \(choose from 2, 3, 4, 8\)$"):
        plan_steps(method="awq")
    with pytest.raises(BadInputError, match=r"^--method qat quantizes weights and activations to 8 bits; got --bits 4"):
        plan_steps(bits=4, method="qat")
    with pytest.raises(BadInputError, match=r"^unknown method 'fp8' \(choose from ptq, qat, gptq-plus, gptq, awq, awq-gptq, rtn\)$"):
        plan_steps(bits=8, method="fp8")
    with pytest.raises(TypeError, match=r"unknown flags \['group'\]"):
        plan_steps(group=64)
    assert plan_steps() == []
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.stderr == "error: no compression step given (use --bits, --prune, --precision or a recipe)\n"
    assert not (tmp_path / "o").exists()


# --- a new step: its module, its registry lines (the step and its config), nothing else ---

@dataclass(frozen=True)
class ScaleConfig:
    factor: float = field(default=1.0, metadata=option("--scale-by", selects=True, help="Test: scale the weights."))
    calib_samples: int = field(default=4, metadata=option("--calib-samples"))


def _scale(handle: ModelHandle, config: ScaleConfig, ctx: StepContext) -> ModelHandle:
    assert handle.module is not None
    with torch.no_grad():
        for p in handle.module.parameters():
            p.mul_(config.factor)
    handle.steps.append(StepRecord("scale", config_to_dict(config), {}))
    return handle


STEP = Step("scale", ScaleConfig, _scale, "multiply every weight (a test step)")


def test_a_new_step_gets_its_flags_and_plan_from_its_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setitem(STEPS, "scale", f"{__name__}:STEP")
    monkeypatch.setitem(STEP_CONFIGS, "scale", f"{__name__}:ScaleConfig")
    assert "--scale-by FLOAT" in _help() and "Test: scale the weights." in _help()
    assert plan_steps(scale_by=2.0, calib_samples=8) == [("scale", {"factor": 2.0, "calib_samples": 8})]
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "--scale-by", "0.5",
                                 "-o", str(tmp_path / "s"), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["steps"] == ["scale"]
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["config"]["steps"] == [{"name": "scale", "config": {"factor": 0.5, "calib_samples": 4}}]


def test_declarations_must_agree(monkeypatch: pytest.MonkeyPatch):
    @dataclass(frozen=True)
    class Clash:
        seqlen: int = field(default=1, metadata=option("--seqlen", help="Another text."))

    monkeypatch.setitem(globals(), "STEP_CLASH", dataclasses.replace(STEP, config=Clash))
    monkeypatch.setitem(STEPS, "clash", f"{__name__}:STEP_CLASH")
    monkeypatch.setitem(STEP_CONFIGS, "clash", f"{__name__}:Clash")
    monkeypatch.setitem(globals(), "Clash", Clash)
    with pytest.raises(TypeError, match=r"^the flag of distill.seqlen, weight-only.seqlen, clash.seqlen is declared "
                                        r"differently .*help texts \['Another text.', 'Token window"):
        compress_options()

    @dataclass(frozen=True)
    class OnOff:
        on: bool = field(default=False, metadata=option("--on"))

    monkeypatch.setitem(globals(), "STEP_ONOFF", dataclasses.replace(STEP, config=OnOff))
    monkeypatch.setitem(STEPS, "clash", f"{__name__}:STEP_ONOFF")
    monkeypatch.setitem(STEP_CONFIGS, "clash", f"{__name__}:OnOff")
    monkeypatch.setitem(globals(), "OnOff", OnOff)
    with pytest.raises(TypeError, match=r"a bool field's flag is an '--on/--off' pair"):
        compress_options()
    with pytest.raises(ValueError, match=r"option\(\) takes flag declarations"):
        option("group-size")


# --- every command: options with help, --help and --help-all, old names, a light --help ---

def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    out = []
    for name, cmd in group.commands.items():
        out.append(((*prefix, name), cmd))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, (*prefix, name))
    return out


def test_every_option_of_every_command_has_help():
    missing = []
    for path, cmd in _commands(cli):
        ctx = click.Context(cmd, info_name=path[-1])
        for p in cmd.get_params(ctx):
            if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip():
                missing.append(f"{' '.join(path)} {p.opts[0]}")
    assert missing == []


def test_help_shows_the_common_options_and_help_all_every_one():
    for command, basic, advanced in (("compress", "--bits", "--gptaq-alpha"), ("distill", "--temperature", "--patience"),
                                     ("finetune", "--lora-r", "--weight-decay"), ("build", "--precision", "--dla-core"),
                                     ("profile", "--batch", "--prompt-lengths"), ("export", "--kv-cache", "--weight-format"),
                                     ("estimate", "--axis", "--timing"), ("lint", "--axis", "--dla-core"),
                                     ("sweep", "--grid", "--address"), ("check", "--budget-ms", "--max-jitter"),
                                     ("run", "--remeasure", "--cache"),
                                     ("report", "--budget-ms", "--top-k"),
                                     (["remote", "build"], "--host", "--ssh-option")):
        path = command if isinstance(command, list) else [command]
        short = CliRunner().invoke(cli, [*path, "--help"], terminal_width=200)
        full = CliRunner().invoke(cli, [*path, "--help-all"], terminal_width=200)
        assert short.exit_code == 0 and full.exit_code == 0
        assert basic in short.output and advanced not in short.output and advanced in full.output
        hidden = int(re.search(r"(\d+) more options: --help-all shows every one", short.output).group(1))
        assert hidden == full.output.count("\n  -") - short.output.count("\n  -")
    compress = CliRunner().invoke(cli, ["compress", "--help-all"], terminal_width=200).output
    assert "[default: 128]" in compress.split("--group-size")[1].split("\n  -")[0]  # the config's default, shown
    assert "[default" not in compress.split("--bits INTEGER")[1].split("\n  -")[0]  # without --bits nothing quantizes
    assert "[default" not in compress.split("--prune FLOAT")[1].split("\n  -")[0]  # a selecting flag has none


class _Called(Exception):
    pass


def _capture(monkeypatch: pytest.MonkeyPatch, module: str, name: str) -> list[tuple[tuple, dict]]:
    calls: list[tuple[tuple, dict]] = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        raise _Called

    monkeypatch.setattr(importlib.import_module(module), name, record)  # (`edgekit.compress` is also a function)
    return calls


@pytest.mark.parametrize("old, new, api", [
    (["compress", "M", "--train", "D", "--prune", "0.5", "-o", "O"],
     ["compress", "M", "--data", "D", "--prune", "0.5", "-o", "O"], ("edgekit.compress.plan", "compress_from_flags")),
    (["compress", "M", "--half", "bf16", "-o", "O"], ["compress", "M", "--precision", "bf16", "-o", "O"],
     ("edgekit.compress.plan", "compress_from_flags")),
    (["compress", "M", "--prune", "0.5", "--distill", "--alpha", "0.5", "-o", "O"],
     ["compress", "M", "--prune", "0.5", "--distill", "--distill-alpha", "0.5", "-o", "O"],
     ("edgekit.compress.plan", "compress_from_flags")),
    (["distill", "--teacher", "T", "--student", "S", "--eval", "E", "--limit", "9", "--alpha", "0.2", "-o", "O"],
     ["distill", "S", "--teacher", "T", "--eval-data", "E", "--train-samples", "9", "--distill-alpha", "0.2", "-o", "O"],
     ("edgekit.compress.distill", "distill")),
    (["build", "M.onnx", "-o", "O", "--remote", "me@orin", "--runtime", "tensorrt"],
     ["build", "M.onnx", "-o", "O", "--host", "me@orin", "--runtime", "tensorrt"], ("edgekit.build", "build_engine")),
    (["estimate", "M.onnx", "--target", "cpu", "--dim", "sequence_length=64"],
     ["estimate", "M.onnx", "--target", "cpu", "--axis", "sequence_length=64"],
     ("edgekit.estimate.calibrate", "estimate_with_calibration")),
    (["lint", "M.onnx", "--target", "jetson-agx-orin-64", "--dim", "seq=1:256"],
     ["lint", "M.onnx", "--target", "jetson-agx-orin-64", "--axis", "seq=1:256"],
     ("edgekit.runtimes.tensorrt.lint", "lint_model")),
])
def test_old_names_warn_once_and_reach_the_api_as_the_new(monkeypatch: pytest.MonkeyPatch, old, new, api):
    calls = _capture(monkeypatch, *api)
    r_old, r_new = CliRunner().invoke(cli, old), CliRunner().invoke(cli, new)
    assert isinstance(r_old.exception, _Called) and isinstance(r_new.exception, _Called), (r_old.output, r_new.output)
    assert calls[0] == calls[1]  # the same arguments and config reach the API function
    renamed = [a for a in old if a.startswith("--") and a not in new]
    warnings = [line for line in r_old.stderr.splitlines() if line.startswith("warning: ")]
    assert r_new.stderr == "" and len(warnings) == len(renamed)
    assert {line.split()[1] for line in warnings} == set(renamed)
    assert all(" is deprecated and goes away in the next release; use " in line for line in warnings)


def test_report_markdown_file_was_o(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """`report -o FILE` (a file, where -o is a folder everywhere else) is now `--markdown FILE`."""
    calls = _capture(monkeypatch, "edgekit.report", "render_report")
    md = str(tmp_path / "r.md")
    runs = [CliRunner().invoke(cli, ["report", "RUN", *flag]) for flag in (["-o", md], ["--out", md], ["--markdown", md])]
    assert all(isinstance(r.exception, _Called) for r in runs), [r.output for r in runs]
    assert calls[0] == calls[1] == calls[2] == (("RUN", md), {"budget_ms": None, "percentile": "p99", "top_k": 10})
    assert [r.stderr for r in runs] == ["warning: -o/--out is deprecated and goes away in the next release; use "
                                        "--markdown\n"] * 2 + [""]
    r = CliRunner().invoke(cli, ["report", "RUN", "--budget-ms", "33", "--percentile", "p50", "--top-k", "3"])
    assert isinstance(r.exception, _Called) and calls[3] == (("RUN", None), {"budget_ms": 33.0, "percentile": "p50",
                                                                             "top_k": 3})
    r = CliRunner().invoke(cli, ["report", "RUN", "-o", md, "--markdown", md])
    assert r.exit_code == 2 and r.stderr == "error: -o/--out is the old name of --markdown; give --markdown alone\n"


def test_generated_commands_reach_the_api_with_the_configs_of_before(monkeypatch: pytest.MonkeyPatch):
    """export, estimate, lint and sweep: flags left out keep the config's default (what the
    hand-written options passed before); given ones set their field."""
    from edgekit.export.config import ExportConfig

    calls = _capture(monkeypatch, "edgekit.loading", "export_onnx")
    for args in (["export", "M", "-o", "O"],
                 ["export", "M", "-o", "O", "--opset", "17", "--legacy", "--atol", "0.01", "--no-parity"]):
        assert isinstance(CliRunner().invoke(cli, args).exception, _Called)
    assert calls[0][0][2] == ExportConfig() and calls[0][0][2].dynamo and not calls[0][0][2].skip_parity
    assert calls[1][0][2] == ExportConfig(opset=17, dynamo=False, atol=0.01, skip_parity=True)

    calls = _capture(monkeypatch, "edgekit.estimate.calibrate", "estimate_with_calibration")
    for args in (["estimate", "M", "--target", "cpu"],
                 ["estimate", "M", "--target", "cpu", "--precision", "fp16", "--batch", "2", "--axis", "s=0",
                  "--calibrate", "--timing", "end-to-end", "--runtime", "none"]):
        assert isinstance(CliRunner().invoke(cli, args).exception, _Called)
    assert calls[0][1] == {"precision": None, "batch": 1, "dims": {}, "calibrate": False, "runtime": None,
                           "input_options": None, "timing": "gpu-compute"}
    assert calls[1][1] == {"precision": "fp16", "batch": 2, "dims": {"s": 0}, "calibrate": True, "runtime": "none",
                           "input_options": None, "timing": "end-to-end"}

    calls = _capture(monkeypatch, "edgekit.runtimes.tensorrt.lint", "lint_model")
    assert isinstance(CliRunner().invoke(cli, ["lint", "M", "--target", "T", "--tensorrt", "8.5", "--dla-core", "0",
                                               "--precision", "int8"]).exception, _Called)
    assert calls[0][1] == {"tensorrt_version": "8.5", "dla_core": 0, "precision": "int8", "shapes": None, "dims": None}

    calls = _capture(monkeypatch, "edgekit.pipelines.sweep", "run_sweep")
    for args in (["sweep", "R.yaml"], ["sweep", "R.yaml", "--grid", "weight-only.bits=4,8", "--list", "weight-only.sym=true",
                                       "--max-points", "9", "--force", "--executor", "process", "--jobs", "1"]):
        assert isinstance(CliRunner().invoke(cli, args).exception, _Called)
    common = {k: v for k, v in calls[0][1].items() if k != "announce"}
    assert calls[0][0][1] == [] and common == {"combos": None, "jobs": 1, "executor": "local", "address": None,
                                                "force": False, "max_points": 256}
    assert calls[1][0][1] == ["weight-only.bits=4,8"] and calls[1][1]["combos"] == [{"weight-only.sym": True}]
    assert (calls[1][1]["max_points"], calls[1][1]["force"], calls[1][1]["executor"]) == (9, True, "process")

    calls = _capture(monkeypatch, "edgekit.check", "check_budget")
    for args in (["check", "P.json", "--budget-ms", "33"],
                 ["check", "P.json", "--budget-ms", "33", "--percentile", "p50", "--max-jitter", "1.2",
                  "--require-verified"]):
        assert isinstance(CliRunner().invoke(cli, args).exception, _Called)
    assert calls == [(("P.json", 33.0, "p99", None), {"require_verified": False}),
                     (("P.json", 33.0, "p50", 1.2), {"require_verified": True})]

    calls = _capture(monkeypatch, "edgekit.pipelines.run", "run_recipe")
    monkeypatch.setattr(importlib.import_module("edgekit.pipelines.recipe"), "load_recipe",
                        lambda path: types.SimpleNamespace(name="r"))
    for args in (["run", "R.yaml"], ["run", "R.yaml", "--force", "--remeasure", "--wait", "--cache", "C"]):
        assert isinstance(CliRunner().invoke(cli, args).exception, _Called)
    assert [c[1] for c in calls] == [{"cache_dir": None, "force": False, "wait": False, "remeasure": False},
                                     {"cache_dir": "C", "force": True, "wait": True, "remeasure": True}]

    from edgekit.ssh import RemoteHost

    calls = _capture(monkeypatch, "edgekit.remote", "remote_build")
    for args in (["--host", "me@orin"], ["--host", "me@orin", "--port", "2222", "-i", "K", "--ssh-option",
                                         "Compression=yes", "--remote-edgekit", "/opt/ek", "--timeout", "60"]):
        r = CliRunner().invoke(cli, ["remote", "build", "M.onnx", "--target", "T", "-o", "O", "--threads", "2", *args])
        assert isinstance(r.exception, _Called), r.output
    # what the hand-written options built before: every timeout the one --timeout, 3600 s by default
    before = [RemoteHost.from_options("me@orin", {"ssh_port": None, "ssh_identity": None, "ssh_options": [],
                                                  "remote_edgekit": None, "build_timeout": 3600.0,
                                                  "remote_timeout": 3600.0}),
              RemoteHost.from_options("me@orin", {"ssh_port": 2222, "ssh_identity": "K",
                                                  "ssh_options": ["Compression=yes"], "remote_edgekit": "/opt/ek",
                                                  "build_timeout": 60.0, "remote_timeout": 60.0})]
    assert [c[0] for c in calls] == [("M.onnx", "T", "O", h) for h in before]
    assert calls[0][1] == {"precision": None, "runtime": None, "threads": 2}
    r = CliRunner().invoke(cli, ["remote", "profile", "E"])
    assert r.exit_code == 2 and r.stderr == "error: give the device: --host USER@HOST[:PORT]\n"


def test_kv_cache_export_keeps_its_own_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(importlib.import_module("edgekit.loading"), "load_model",
                        lambda spec: types.SimpleNamespace(kind="causal-lm", name=spec))
    calls = _capture(monkeypatch, "edgekit.export.lm", "export_causal_lm")
    for args in (["--kv-cache"], ["--kv-cache", "--opset", "18", "--atol", "0.01", "--no-parity", "--graph", "traced",
                                  "--accuracy-level", "0", "--weight-format", "qdq"]):
        r = CliRunner().invoke(cli, ["export", "lm", "-o", str(tmp_path / "o"), *args])
        assert isinstance(r.exception, _Called), r.output
    assert calls[0][1] == {"opset": 21, "parity": True, "graph": "auto", "block_size": None, "fmt": "matmulnbits"}
    assert calls[1][1] == {"opset": 18, "parity": False, "graph": "traced", "block_size": None, "fmt": "qdq",
                           "atol": 0.01, "accuracy_level": 0}
    for args, message in ((["--graph", "fused"], "--graph, --block-size and --weight-format apply to the KV-cache"),
                          (["--accuracy-level", "4"], "--accuracy-level applies to the KV-cache export"),
                          (["--kv-cache", "--legacy"], "--dynamo/--legacy choose the exporter of a PyTorch model"),
                          (["--kv-cache", "--opset", "9"], "opset 9 is not supported (choose 13 to 23)")):
        r = CliRunner().invoke(cli, ["export", "lm", "-o", str(tmp_path / "o"), *args])
        assert r.exit_code == 2 and r.stderr.startswith(f"error: {message}"), r.output
    assert not (tmp_path / "o").exists()


def test_an_old_and_a_new_name_together_are_refused():
    r = CliRunner().invoke(cli, ["compress", "M", "--half", "bf16", "--precision", "fp16", "-o", "O"])
    assert r.exit_code == 2 and r.stderr == "error: --half is the old name of --precision; give --precision alone\n"
    r = CliRunner().invoke(cli, ["distill", "S", "--student", "S2", "--teacher", "T", "-o", "O"])
    assert r.exit_code == 2 and "--student is the old name of MODEL (the first argument)" in r.stderr


def test_comma_lists_are_checked_as_they_parse(tmp_path: Path):
    r = CliRunner().invoke(cli, ["profile", str(tmp_path), "--contexts", "8,,x"])
    assert r.exit_code == 2 and r.stderr == "error: --contexts takes comma-separated whole numbers, got '8,,x'\n"


LIGHT = """
import sys
from edgekit.cli import cli
for args in {commands!r}:
    try:
        cli.main([*args, "--help"], standalone_mode=False)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "onnx", "onnxruntime", "transformers") if m in sys.modules)
from edgekit.cli import GENERATED
configs = sorted(m for modules, _ in GENERATED.values() for m in modules if m in sys.modules)
print("CONFIGS", configs)
print("HEAVY", heavy)
"""


def test_help_of_every_command_imports_no_torch(tmp_path: Path):
    """The first --help of compress fills the help cache (importing the steps' configs once); every
    --help after it, of any command, imports no torch (compress's options come from there)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "EDGEKIT_CACHE": str(tmp_path)}
    commands = [list(path) for path, _ in _commands(cli)]
    first = subprocess.run([sys.executable, "-m", "edgekit.cli", "compress", "--help"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0 and "--bits" in first.stdout
    r = subprocess.run([sys.executable, "-c", LIGHT.format(commands=commands)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--gptaq-alpha" not in r.stdout and "--bits" in r.stdout  # compress's help came from the cache
    assert r.stdout.strip().splitlines()[-2:] == ["CONFIGS []", "HEAVY []"]  # with a cache, no config module either
    # "-h" as a value is no help: the command parses again with the options that know their config fields
    bad = subprocess.run([sys.executable, "-m", "edgekit.cli", "distill", "S", "--teacher", "T", "--data", "-h",
                          "--distill-alpha", "2", "-o", str(tmp_path / "o")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr == "error: alpha (weight of the soft loss) must be in [0, 1], got 2.0\n"


# the options several commands share (edgekit/cli_options.py): the same flag, type, default and
# help wherever they appear; -o, --json and --target say what the command writes or targets
SHARED_SAME = ("--data", "--eval-data", "--calib", "--seed", "--teacher", "--shapes", "--inputs", "--preprocess")
SHARED_PREFIX = {"-o": "Output folder: ", "--json": "Write ", "--target": "Target name or YAML file"}


def test_shared_options_read_alike_in_every_command():
    seen: dict[str, set[tuple]] = {}
    for path, cmd in _commands(cli):
        ctx = click.Context(cmd, info_name=path[-1])
        for p in cmd.get_params(ctx):
            # a config's own field of the same name (distill's --seed: DistillConfig.seed; profile's
            # --target: ProfileOptions') is that config's
            if not isinstance(p, click.Option) or p.hidden or isinstance(p, GeneratedOption):
                continue
            flag = next((d for d in p.opts if d in (*SHARED_SAME, *SHARED_PREFIX)), None)
            if flag is None:
                continue
            help_text = p.help or ""
            if flag in SHARED_PREFIX:
                assert help_text.startswith(SHARED_PREFIX[flag]), (path, flag, help_text)
                help_text = SHARED_PREFIX[flag]
            default = None if flag == "--target" else p.default  # build's is cpu, the others' none
            seen.setdefault(flag, set()).add((tuple(p.opts), p.type.name, p.metavar, default, help_text))
    assert set(seen) == {*SHARED_SAME, *SHARED_PREFIX}
    assert {flag: kinds for flag, kinds in seen.items() if len(kinds) > 1} == {}


def test_options_of_their_own_classes_reach_the_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    calls = _capture(monkeypatch, "edgekit.compress.plan", "compress_from_flags")
    for args in ([], ["--prune", "0.5", "--distill", "--accept-quality-loss", "--max-ppl-ratio", "1.2"]):
        assert isinstance(CliRunner().invoke(cli, ["compress", "M", "-o", "O", *args]).exception, _Called)
    assert [{k: c[1][k] for k in ("distill", "accept_quality_loss", "max_ppl_ratio", "train", "seed")} for c in calls] \
        == [{"distill": False, "accept_quality_loss": False, "max_ppl_ratio": None, "train": None, "seed": 0},
            {"distill": True, "accept_quality_loss": True, "max_ppl_ratio": 1.2, "train": None, "seed": 0}]
    given = [{k: v for k, v in c[0][2].items() if v not in (None, ())} for c in calls]
    assert given == [{}, {"prune": 0.5}] and "distill" not in calls[1][0][2]  # the steps' flags alone

    calls = _capture(monkeypatch, "edgekit.finetune", "finetune")
    for args in ([], ["--requant", "weight-only", "--bits", "3", "--fresh", "--seed", "5"]):
        assert isinstance(CliRunner().invoke(cli, ["finetune", "M", "-o", "O", *args]).exception, _Called)
    assert [{k: c[1][k] for k in ("requant", "requant_config", "resume", "seed")} for c in calls] == [
        {"requant": None, "requant_config": {}, "resume": True, "seed": 0},
        {"requant": "weight-only", "requant_config": {"bits": 3}, "resume": False, "seed": 5}]
    r = CliRunner().invoke(cli, ["finetune", "M", "-o", str(tmp_path / "o"), "--bits", "3"])
    assert r.exit_code == 2 and r.stderr == "error: --bits set the weight-only re-quantization: give --requant weight-only\n"
    # the step's old name: accepted (the warning line is tests/compress/test_compress.py's), the new one in --help
    assert isinstance(CliRunner().invoke(cli, ["finetune", "M", "-o", "O", "--requant", "int4"]).exception, _Called)
    assert calls[-1][1]["requant"] == "weight-only"
    assert "--requant [weight-only|int8]" in CliRunner().invoke(cli, ["finetune", "--help-all"]).output
    r = CliRunner().invoke(cli, ["finetune", "M", "-o", "O", "--requant", "int5"])
    assert r.exit_code == 2 and "'int5' is not one of 'weight-only', 'int8'" in r.output

    # remote build checks the build fields before it connects
    calls = _capture(monkeypatch, "edgekit.remote", "remote_build")
    r = CliRunner().invoke(cli, ["remote", "build", "M.onnx", "--target", "T", "-o", "O", "--host", "me@orin",
                                 "--runtime", "nope"])
    assert r.exit_code == 2 and r.stderr.startswith("error: unknown runtime 'nope'") and calls == []
    calls = _capture(monkeypatch, "edgekit.remote", "remote_profile")
    for args in ([], ["--duration-s", "2", "--iterations", "50"]):
        r = CliRunner().invoke(cli, ["remote", "profile", "E", "--host", "me@orin", *args])
        assert isinstance(r.exception, _Called), r.output
    assert [c[1]["extra_args"] for c in calls] == [[], ["--duration-s", "2.0", "--iterations", "50"]]
    r = CliRunner().invoke(cli, ["remote", "profile", "E", "--host", "me@orin", "--iterations", "0"])
    assert r.exit_code == 2 and r.stderr == "error: iterations must be >= 1, got 0\n"

    r = CliRunner().invoke(cli, ["profile", "E", "--target", "cpu"])
    assert r.exit_code == 2 and r.stderr == "error: --target applies with --trtexec (an engine folder records its target)\n"


LIGHT_ALONE = """
import os, sys
from edgekit.cli import cli
for args in {commands!r}:
    try:
        cli.main([*args, "--help"], standalone_mode=False)
    except SystemExit:
        pass
heavy = sorted(m for m in ("torch", "onnx", "onnxruntime", "transformers") if m in sys.modules)
print("HEAVY", heavy, "CACHED", sorted(os.listdir(os.environ["EDGEKIT_CACHE"])))
"""


@pytest.mark.parametrize("first", ["compress", "build"])
def test_help_without_the_cache_imports_no_torch(tmp_path: Path, first: str):
    """Without the help cache, --help of any command (compress's too: every step config lives in a
    light module) reads the configs and imports no torch or ONNX, and writes the cache once."""
    import subprocess
    import sys

    env = {**os.environ, "EDGEKIT_CACHE": str(tmp_path)}
    commands = sorted((list(path) for path, _ in _commands(cli)), key=lambda p: p != [first])
    r = subprocess.run([sys.executable, "-c", LIGHT_ALONE.format(commands=commands)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--trtexec" in r.stdout and "--dla-core" not in r.stdout and "--host" in r.stdout  # profile, build, remote
    assert "--bits" in r.stdout and "--smooth-alpha" not in r.stdout  # compress (basic flags only)
    heavy, cached = r.stdout.strip().splitlines()[-1].split(" CACHED ")
    assert heavy == "HEAVY []" and cached.startswith("['cli']")


def test_step_configs_import_no_torch():
    """Every step's config module, the compress options built from them and a recipe's configs
    load without torch or ONNX (the step modules themselves are not imported)."""
    import subprocess
    import sys

    from edgekit.compress import STEP_CONFIGS, STEPS

    code = ("import sys; from edgekit.compress import STEP_CONFIGS, STEPS, make_config; "
            "from edgekit.compress.options import compress_options; "
            "assert len(compress_options()) > 20; [make_config(n) for n in STEP_CONFIGS]; "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'transformers') if m in sys.modules), "
            "sorted(m for m in sys.modules if m in {s.split(':')[0] for s in STEPS.values()} "
            "and not hasattr(sys.modules[m], '__path__')))")  # a package's __init__ (lora's) is light
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[] []"
    assert set(STEP_CONFIGS) == set(STEPS)
