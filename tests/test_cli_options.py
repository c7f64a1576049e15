"""A step's option is declared once, on its config field: ``edgekit compress`` flags and the
plan derive from the metadata (edgekit/compress/options.py), and a new step's flags appear
with its registry line alone."""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from edgekit.cli import cli
from edgekit.compress import STEPS, Step, StepContext, config_to_dict
from edgekit.compress.options import option
from edgekit.compress.plan import compress_options, plan_steps
from edgekit.errors import BadInputError
from edgekit.sources.handle import ModelHandle, StepRecord

# `edgekit compress --help-all` (the flags users know: those of before the options were generated,
# with --alpha renamed --distill-alpha and --train --data), plus what came since: --precision (the
# half step), --json and --help-all
FLAGS = {"-o", "--out", "--bits", "--method", "--calib", "--calib-method", "--calib-samples", "--target",
         "--max-accuracy-drop", "--placement", "--keep-float", "--rounding", "--group-size", "--sym", "--asym",
         "--act-order", "--no-act-order", "--gptaq-alpha", "--refit", "--no-refit", "--seqlen", "--device", "--prune",
         "--importance", "--global", "--uniform", "--round-to", "--ignore", "--iterative-steps", "--distill",
         "--epochs", "--temperature", "--distill-alpha", "--data", "--seed", "--shapes", "--inputs", "--preprocess",
         "--accept-quality-loss", "--max-ppl-ratio", "--max-size-mb", "--avg-bits", "--smooth-alpha", "-h", "--help"}


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
                 "ptq | qat (8-bit), gptq | awq | awq-gptq | rtn (weight-only).", "Distillation / QAT epochs."):
        assert line in text


def test_shared_flags_set_every_step_that_has_the_field():
    fields = {o.dest: {(s, f) for s, f, _ in o.fields} for o in compress_options()}
    assert fields["calib_samples"] == {("int8", "calib_samples"), ("int4", "calib_samples")}
    assert fields["seqlen"] == {("distill", "seqlen"), ("int4", "seqlen")}
    assert fields["epochs"] == {("distill", "epochs"), ("int8", "qat_epochs")}
    assert plan_steps(bits=4, calib_samples=16, seqlen=64) == [
        ("int4", {"method": "gptq", "bits": 4, "calib_samples": 16, "seqlen": 64})]
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
    with pytest.raises(BadInputError, match=r"^unknown method 'fp8' \(choose from ptq, qat, gptq, awq, awq-gptq, rtn\)$"):
        plan_steps(bits=8, method="fp8")
    with pytest.raises(TypeError, match=r"unknown flags \['group'\]"):
        plan_steps(group=64)
    assert plan_steps() == []
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and r.stderr == "error: no compression step given (use --bits, --prune, --precision or a recipe)\n"
    assert not (tmp_path / "o").exists()


# --- a new step: its module, one registry line, nothing else ---

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
    with pytest.raises(TypeError, match=r"^the flag of distill.seqlen, int4.seqlen, clash.seqlen is declared "
                                        r"differently .*help texts \['Another text.', 'Token window"):
        compress_options()

    @dataclass(frozen=True)
    class OnOff:
        on: bool = field(default=False, metadata=option("--on"))

    monkeypatch.setitem(globals(), "STEP_ONOFF", dataclasses.replace(STEP, config=OnOff))
    monkeypatch.setitem(STEPS, "clash", f"{__name__}:STEP_ONOFF")
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
                                     ("profile", "--batch", "--prompt-lengths")):
        short = CliRunner().invoke(cli, [command, "--help"], terminal_width=200)
        full = CliRunner().invoke(cli, [command, "--help-all"], terminal_width=200)
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
print("HEAVY", heavy)
"""


def test_help_of_every_command_imports_no_torch(tmp_path: Path):
    """The first --help of an install fills the help cache (importing the configs once); every
    --help after it, of any command, reads the options from there."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "EDGEKIT_CACHE": str(tmp_path)}
    commands = [list(path) for path, _ in _commands(cli)]
    first = subprocess.run([sys.executable, "-m", "edgekit.cli", "distill", "--help"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0 and "--teacher" in first.stdout
    r = subprocess.run([sys.executable, "-c", LIGHT.format(commands=commands)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--gptaq-alpha" not in r.stdout and "--bits" in r.stdout  # compress's help came from the cache
    assert r.stdout.strip().splitlines()[-1] == "HEAVY []"
    # "-h" as a value is no help: the command parses again with the options that know their config fields
    bad = subprocess.run([sys.executable, "-m", "edgekit.cli", "distill", "S", "--teacher", "T", "--data", "-h",
                          "--distill-alpha", "2", "-o", str(tmp_path / "o")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and bad.stderr == "error: alpha (weight of the soft loss) must be in [0, 1], got 2.0\n"
