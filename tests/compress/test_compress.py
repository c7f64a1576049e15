"""compress/__init__.py: what the registry tells the layers around it about each step."""
from __future__ import annotations

import pytest

from edgekit.compress import (
    DISTILL_STEP,
    INT8_STEP,
    LORA_STEP,
    PRUNE_STEP,
    QUANTIZING_STEPS,
    STEP_ALIASES,
    STEPS,
    WEIGHT_ONLY_STEP,
    canonical_step,
    get_step,
    make_config,
    quantized_precision,
)
from edgekit.errors import BadInputError
from edgekit.sources.handle import StepRecord


@pytest.mark.parametrize("name, config, precision", [
    ("int8", {"method": "ptq"}, "int8"),
    ("weight-only", {"bits": 4}, "int4"),
    ("weight-only", {"bits": 3}, "int4"),
    ("weight-only", {"bits": 8}, "int8"),  # 8-bit packed codes compute as int8
    ("weight-only", {}, "int4"),  # a record without bits: the step's default width
    ("prune", {"ratio": 0.5}, None),
    ("distill", {}, None),
    ("lora", {}, None),
    ("half", {}, None),
])
def test_each_step_says_what_it_quantizes_to(name, config, precision):
    assert get_step(name).quantizes_to(config) == precision


def test_every_registered_step_is_covered():
    assert set(STEPS) == {"prune", "distill", "lora", "int8", "weight-only", "half"}


def test_the_last_quantizing_step_decides():
    records = [StepRecord("prune", {"ratio": 0.3}), StepRecord("weight-only", {"bits": 4}), StepRecord("lora", {})]
    assert quantized_precision(records) == "int4"  # LoRA over packed weights keeps them packed
    assert quantized_precision([*records, StepRecord("int8", {})]) == "int8"
    assert quantized_precision(records[:1]) is None
    assert quantized_precision([]) is None


def test_prune_leaves_the_model_unchanged_at_ratio_zero():
    assert get_step("prune").unchanged_at == {"ratio": 0}
    assert all(get_step(n).unchanged_at == {} for n in STEPS if n != "prune")


def test_the_steps_named_by_role_do_what_their_role_says():
    """The layers around compress name a step by its role (INT8_STEP, LORA_STEP, ...): each is
    registered, and its declarations say what the role does."""
    from edgekit.compress.distill_config import DistillConfig
    from edgekit.compress.lora.config import LoraConfig
    from edgekit.compress.prune_config import PruneConfig

    assert get_step(INT8_STEP).quantizes_to({}) == "int8"
    assert [get_step(WEIGHT_ONLY_STEP).quantizes_to({"bits": b}) for b in (2, 4, 8)] == ["int4", "int4", "int8"]
    assert [n for n in STEPS if get_step(n).quantizes_to({}) is not None] == list(QUANTIZING_STEPS)
    assert (get_step(LORA_STEP).config, get_step(DISTILL_STEP).config, get_step(PRUNE_STEP).config) == \
        (LoraConfig, DistillConfig, PruneConfig)


def test_each_step_config_is_registered_in_its_light_module():
    """``STEP_CONFIGS`` (read by the command line without importing the steps) names each step's
    own config class; an unknown name is refused with the known ones."""
    from edgekit.compress import STEP_CONFIGS, config_class

    assert list(STEP_CONFIGS) == list(STEPS)
    for name in STEPS:
        assert config_class(name) is get_step(name).config, name
        assert get_step(name).config.__module__ == STEP_CONFIGS[name].split(":")[0]
    with pytest.raises(BadInputError, match="unknown compression step 'int3'"):
        config_class("int3")


@pytest.fixture()
def fresh_warnings(monkeypatch):
    """Each old name warns once per process: a test that counts the lines starts afresh."""
    import importlib

    monkeypatch.setattr(importlib.import_module("edgekit.compress"), "_warned_aliases", set())


def test_an_old_step_name_is_the_new_one_with_one_warning_line(fresh_warnings, caplog):
    assert STEP_ALIASES == {"int4": WEIGHT_ONLY_STEP} and WEIGHT_ONLY_STEP == "weight-only"
    with caplog.at_level("WARNING", logger="edgekit.compress"):
        assert canonical_step("weight-only", where="--requant") == "weight-only"
        assert caplog.records == []  # the current name: nothing said
        assert canonical_step("int4", where="stage 'llm' steps[0]") == "weight-only"
        assert canonical_step("int4", where="--requant") == "weight-only"  # said once per process
        assert canonical_step("int4", where="manifest", warn=False) == "weight-only"
        assert canonical_step("nosuch", where="x") == "nosuch"  # unknown: the registry's lookup names the valid ones
    assert [r.getMessage() for r in caplog.records] == [
        "stage 'llm' steps[0]: 'int4' is now 'weight-only'; the old name will be removed in a later release"]


def test_an_old_step_name_is_not_a_registry_key_but_resolves(fresh_warnings):
    assert "int4" not in STEPS
    assert get_step("int4") is get_step("weight-only")  # a manifest's record, silently
    assert make_config("int4", {"bits": 3}) == make_config("weight-only", {"bits": 3})
    with pytest.raises(BadInputError, match=r"unknown compression step 'int5' \(choose from .*'weight-only'"):
        get_step("int5")


def test_the_old_name_warns_in_a_fresh_process():
    """Outside pytest's log capture: the one line on stderr, nothing else, as a user sees it."""
    import subprocess
    import sys

    code = ("from edgekit.finetune_options import FinetuneOptions; "
            "print(FinetuneOptions(requant='int4', bits=3).requant)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout == "weight-only\n"
    assert r.stderr == "--requant: 'int4' is now 'weight-only'; the old name will be removed in a later release\n"
