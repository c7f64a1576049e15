"""Mixed precision under a size budget: sensitivities, allocation and the weight-only step (issue 30)."""
from __future__ import annotations

import pytest
import torch

from edgekit.compress import StepContext
from edgekit.compress.weight_only.config import WeightOnlyConfig
from edgekit.compress.weight_only.mixed import Unit, allocate, layer_bytes, make_units
from edgekit.compress.weight_only.packing import QuantLinear
from edgekit.compress.weight_only.step import apply, packed_bytes
from edgekit.errors import BadInputError
from tests.compress.weight_only.test_weight_only import _held_out, _logits, calib, tiny_llama  # noqa: F401  (calib: a fixture)


def test_layer_bytes_are_what_the_packed_layer_stores():
    for rows, cols, bits, group in ((24, 96, 4, 32), (8, 80, 8, 32), (5, 64, 3, -1), (7, 576, 4, 128)):
        layer = QuantLinear(cols, rows, bits, group, bias=True)
        assert layer_bytes(rows, cols, bits, group, bias=True) == packed_bytes(layer), (rows, cols, bits, group)


def test_allocate_spends_the_budget_on_the_costliest_bytes_first():
    units = [Unit(("a",), 100, 60, 110, 1.0), Unit(("b",), 100, 60, 110, 5.0), Unit(("c",), 400, 240, 440, 8.0),
             Unit(("d",), 100, 60, 110, 0.0)]
    # per extra byte: b 0.1, c 0.04, a 0.02; d costs nothing at the low width and never moves up
    assert allocate(units, budget=470) == [False, True, False, False]  # all low: 420 bytes
    assert allocate(units, budget=700) == [False, True, True, False]
    assert allocate(units, budget=10_000) == [True, True, True, False]
    with pytest.raises(BadInputError, match=r"the size budget \(0.00 MB\) is below the model at the lowest bit width"):
        allocate(units, budget=419, fixed=1)


def test_config_checks_the_budget():
    with pytest.raises(BadInputError, match="give one size budget: --max-size-mb or --avg-bits, not both"):
        WeightOnlyConfig(max_size_mb=50, avg_bits=5)
    with pytest.raises(BadInputError, match=r"avg_bits must be above the low bit width \(4\) and at most 16, got 3.5"):
        WeightOnlyConfig(avg_bits=3.5)
    with pytest.raises(BadInputError, match="--bits must be lower, got 8"):
        WeightOnlyConfig(bits=8, avg_bits=9)
    with pytest.raises(BadInputError, match="max_size_mb must be positive, got -1"):
        WeightOnlyConfig(max_size_mb=-1)


# CI: the calibrated methods (RTN under a budget: the next test; its cell here with -m matrix)
@pytest.mark.parametrize("method", [pytest.param("rtn", marks=pytest.mark.matrix), "gptq-plus", "awq-gptq"])
def test_avg_bits_keeps_the_costliest_groups_at_8_bits_within_the_budget(method, calib):  # noqa: F811
    """The step picks whole groups (q/k/v, o, gate/up, down), records the choice, stays within the
    average, and its logits are closer to the float model's than with every group at the low width."""
    ref = tiny_llama()
    x = _held_out()
    want = _logits(ref, x)
    errs, metas = {}, {}
    for avg in (None, 5.5):
        cfg = WeightOnlyConfig(method=method, bits=3, group_size=32, seqlen=32, head="none", eval_windows=0,
                               avg_bits=avg, sensitivity_windows=4)
        h = apply(tiny_llama(), cfg, StepContext(calib=calib, progress=False))
        errs[avg] = float(((_logits(h, x) - want) ** 2).mean())
        metas[avg] = h.steps[-1].meta
    mixed = metas[5.5]["mixed"]
    layers = metas[5.5]["layers"]
    assert 0 < mixed["high_units"] < mixed["units_total"] == 8 and mixed["avg_bits"] <= 5.5
    for unit in mixed["units"]:  # a group shares one width, the one its layers were packed at
        assert {layers[n]["bits"] for n in unit["names"]} == {unit["bits"]} and unit["sensitivity"] > 0
    chosen = [u for u in mixed["units"] if u["bits"] == 8]
    skipped = [u for u in mixed["units"] if u["bits"] == 3]
    assert min(u["sensitivity"] / (u["high_bytes"] - u["low_bytes"]) for u in chosen) >= \
        max(u["sensitivity"] / (u["high_bytes"] - u["low_bytes"]) for u in skipped) or \
        sum(u["high_bytes"] - u["low_bytes"] for u in skipped) > 0
    assert errs[5.5] < errs[None], errs
    for name, layer in h.module.named_modules():  # an 8-bit group's codes use the 8-bit grid, not the low one
        if isinstance(layer, QuantLinear) and name in layers and layers[name]["bits"] == 8:
            assert int(layer.codes().max()) - int(layer.codes().min()) > 2 ** 3, name
    units = make_units(tiny_llama().module, [u["names"] for u in mixed["units"]], 3, 32)
    assert [u.low_bytes for u in units] == [u["low_bytes"] for u in mixed["units"]]


def test_max_size_mb_bounds_the_packed_model(calib):  # noqa: F811
    cfg = dict(method="rtn", bits=3, group_size=32, seqlen=32, eval_windows=0, sensitivity_windows=2)
    low = apply(tiny_llama(), WeightOnlyConfig(**cfg), StepContext(calib=calib, progress=False))
    budget = (packed_bytes(low.module) + 6000) / 1e6
    h = apply(tiny_llama(), WeightOnlyConfig(**cfg, max_size_mb=budget), StepContext(calib=calib, progress=False))
    meta = h.steps[-1].meta
    assert meta["packed_bytes"] <= budget * 1e6 and meta["packed_bytes"] == meta["mixed"]["predicted_bytes"]
    assert meta["mixed"]["high_units"] >= 1
    with pytest.raises(BadInputError, match="below the smallest 3-bit model"):
        apply(tiny_llama(), WeightOnlyConfig(**cfg, max_size_mb=0.01), StepContext(calib=calib, progress=False))
    with torch.no_grad():
        assert torch.isfinite(_logits(h, _held_out())).all()
