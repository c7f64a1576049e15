"""A step's option is declared once, on its config field: ``edgekit compress`` flags and the
plan derive from the metadata (edgekit/compress/options.py), and a new step's flags appear
with its registry line alone."""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

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
         "--accept-quality-loss", "--max-ppl-ratio", "--max-size-mb", "--avg-bits", "-h", "--help"}


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
