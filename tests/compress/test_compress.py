"""compress/__init__.py: what the registry tells the layers around it about each step."""
from __future__ import annotations

import pytest

from edgekit.compress import (
    DISTILL_STEP,
    INT8_STEP,
    LORA_STEP,
    PRUNE_STEP,
    QUANTIZING_STEPS,
    STEPS,
    WEIGHT_ONLY_STEP,
    get_step,
    quantized_precision,
)
from edgekit.errors import BadInputError
from edgekit.sources.handle import StepRecord


@pytest.mark.parametrize("name, config, precision", [
    ("int8", {"method": "ptq"}, "int8"),
    ("int4", {"bits": 4}, "int4"),
    ("int4", {"bits": 3}, "int4"),
    ("int4", {"bits": 8}, "int8"),  # 8-bit packed codes compute as int8
    ("int4", {}, "int4"),  # a record without bits: the step's default width
    ("prune", {"ratio": 0.5}, None),
    ("distill", {}, None),
    ("lora", {}, None),
    ("half", {}, None),
])
def test_each_step_says_what_it_quantizes_to(name, config, precision):
    assert get_step(name).quantizes_to(config) == precision


def test_every_registered_step_is_covered():
    assert set(STEPS) == {"prune", "distill", "lora", "int8", "int4", "half"}


def test_the_last_quantizing_step_decides():
    records = [StepRecord("prune", {"ratio": 0.3}), StepRecord("int4", {"bits": 4}), StepRecord("lora", {})]
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
