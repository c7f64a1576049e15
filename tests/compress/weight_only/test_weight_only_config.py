"""compress/weight_only/config.py and the per-method configs it builds (grid_config.py,
rtn_config.py, gptq_config.py, awq_config.py): each method's algorithm receives its own fields."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from edgekit.compress.weight_only.awq_config import AwqConfig
from edgekit.compress.weight_only.config import METHODS, WeightOnlyConfig
from edgekit.compress.weight_only.gptq_config import GptqConfig
from edgekit.compress.weight_only.grid_config import GridConfig
from edgekit.compress.weight_only.rtn_config import RtnConfig
from edgekit.errors import BadInputError

GRID = {"bits", "group_size", "sym"}
GPTQ = GRID | {"act_order", "static_groups", "damp", "block_size", "mse_grid", "refit", "gptaq_alpha", "value_hessian",
               "value_query_stride"}


def _fields(config: object) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]


@pytest.mark.parametrize("method, kind, own", [
    ("rtn", RtnConfig, GRID),
    ("gptq-plus", GptqConfig, GPTQ),
    ("gptq", GptqConfig, GPTQ),
    ("awq", AwqConfig, GRID | {"awq_grid", "awq_clip", "then_gptq"}),
    ("awq-gptq", AwqConfig, GRID | {"awq_grid", "awq_clip", "then_gptq"}),
])
def test_each_method_gets_its_own_small_config(method, kind, own):
    config = WeightOnlyConfig(method=method, bits=3, group_size=32, sym=True, damp=0.05, gptaq_alpha=0.5,
                              awq_grid=10, mse_grid=False)
    made = config.method_config()
    assert type(made) is kind and isinstance(made, GridConfig) and _fields(made) == own
    assert (made.bits, made.group_size, made.sym) == (3, 32, True)
    for name in own - {"then_gptq"}:  # every field is the step config's value (or the method's setting of it)
        assert getattr(made, name) == config.gptq_options().get(name, getattr(config, name)), name
    assert len(own) < len(_fields(config)) / 2  # what the step keeps: calibration, device, head, budgets
    if isinstance(made, AwqConfig):
        gptq = made.then_gptq
        assert (gptq is not None) == (method == "awq-gptq")
        if gptq is not None:
            assert _fields(gptq) == GPTQ and (gptq.bits, gptq.damp, gptq.gptaq_alpha) == (3, 0.05, 0.5)


def test_every_method_is_covered_and_defaults_agree():
    assert {WeightOnlyConfig(method=m).method_config().__class__ for m in METHODS} == {RtnConfig, GptqConfig, AwqConfig}
    gptq, default = WeightOnlyConfig().method_config(), GptqConfig()
    assert gptq == default  # the step's defaults are the method's
    assert (GptqConfig(group_size=-1).grid_search, GptqConfig().grid_search, GptqConfig(mse_grid=False).grid_search) \
        == (False, True, False)
    assert WeightOnlyConfig(group_size=-1).grid_search == GptqConfig(group_size=-1).grid_search


def test_gptq_is_the_papers_algorithm_and_gptq_plus_the_default():
    assert WeightOnlyConfig().method == METHODS[0] == "gptq-plus"
    paper = WeightOnlyConfig(method="gptq").method_config()
    # Frantar et al.: the input Hessian of every linear, min-max grids, columns in order, no refit, no GPTAQ
    assert paper == GptqConfig(act_order=False, mse_grid=False, refit=False, gptaq_alpha=0.0, value_hessian="input")
    assert not paper.grid_search and not WeightOnlyConfig(method="gptq").grid_search
    assert (paper.damp, paper.block_size, paper.static_groups) == (0.01, 128, False)
    plus = WeightOnlyConfig(method="gptq-plus").method_config()
    assert isinstance(plus, GptqConfig)
    assert (plus.act_order, plus.grid_search, plus.refit, plus.gptaq_alpha, plus.value_hessian) == \
        (True, True, True, 0.25, "attention")
    assert WeightOnlyConfig(method="awq-gptq").method_config().then_gptq == plus  # AWQ+GPTQ's GPTQ: gptq-plus
    # a value the user gives wins for either method: the two names differ only in what is left unset
    given = {"act_order": True, "refit": False, "gptaq_alpha": 0.1, "value_hessian": "input", "mse_grid": True}
    made = {m: WeightOnlyConfig(method=m, **given).method_config() for m in ("gptq", "gptq-plus")}
    assert made["gptq"] == made["gptq-plus"]
    assert {k: getattr(made["gptq"], k) for k in given} == given
    with pytest.raises(BadInputError, match=r"^unknown value-projection Hessian 'output'"):
        WeightOnlyConfig(method="gptq", value_hessian="output")  # checked whatever the method


@pytest.mark.parametrize("make, message", [
    (lambda: RtnConfig(bits=5), r"^unsupported bit width 5 \(choose from 2, 3, 4, 8\)$"),
    (lambda: RtnConfig(group_size=48), r"^unsupported group size 48 \(choose -1 for per-channel"),
    (lambda: GptqConfig(damp=1.0), r"^damp must be in \[0, 1\), got 1.0$"),
    (lambda: GptqConfig(gptaq_alpha=-0.1), r"^gptaq_alpha must be in \[0, 1\], got -0.1$"),
    (lambda: GptqConfig(block_size=0), r"^block_size must be positive, got 0$"),
    (lambda: GptqConfig(value_hessian="output"), r"^unknown value-projection Hessian 'output'"),
    (lambda: GptqConfig(value_query_stride=0), r"^value_query_stride must be at least 1, got 0$"),
    (lambda: AwqConfig(awq_grid=0), r"^awq_grid must be at least 1, got 0$"),
    (lambda: AwqConfig(sym="yes"), r"sym"),  # types checked from the annotations
])
def test_method_configs_check_their_values(make, message):
    with pytest.raises(BadInputError, match=message):
        make()


def test_method_configs_are_frozen_and_replace_checks_again():
    config = GptqConfig(bits=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.bits = 8  # type: ignore[misc]
    assert dataclasses.replace(config, bits=8).bits == 8  # mixed precision's other bit width for a group
    with pytest.raises(BadInputError, match="unsupported bit width 6"):
        dataclasses.replace(config, bits=6)


def test_the_config_modules_are_light():
    code = ("import sys; from edgekit.compress.weight_only.config import WeightOnlyConfig; "
            "WeightOnlyConfig(method='awq-gptq').method_config(); "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"


def test_true_sequential_false_is_refused_not_ignored():
    """The block walk is always true-sequential: a recipe asking otherwise is told so, in one line."""
    with pytest.raises(BadInputError, match=r"^true_sequential=False is not supported: each group of a block") as e:
        WeightOnlyConfig(true_sequential=False)
    assert "\n" not in str(e.value)
    assert WeightOnlyConfig(true_sequential=True).true_sequential
