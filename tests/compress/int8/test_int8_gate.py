"""A classifier's INT8 model far from its float model fails the int8 step (``calibration.check_agreement``),
whatever the engine-against-fake-quant check says: both can be the same broken graph."""
from __future__ import annotations

import pytest

from edgekit.compress.int8.calibration import MIN_AGREEMENT, agreement_floor, check_agreement
from edgekit.errors import CheckFailedError


def test_the_floor_is_min_agreement_less_two_standard_errors():
    assert agreement_floor(363) == pytest.approx(0.758, abs=1e-3)
    assert agreement_floor(32) == pytest.approx(0.659, abs=1e-3)
    assert agreement_floor(10**6) == pytest.approx(MIN_AGREEMENT, abs=1e-3)
    assert agreement_floor(0) < agreement_floor(24) < agreement_floor(363) < MIN_AGREEMENT


def test_a_classifier_below_the_floor_fails_with_one_line_naming_the_figures():
    metrics = {"top1_agreement": 0.526, "mean_kl": 0.5}
    with pytest.raises(CheckFailedError) as e:
        check_agreement(metrics, "agreement", 363, "the INT8 graph on ONNX Runtime", accept=False)
    msg = str(e.value)
    assert "\n" not in msg and "52.6% of 363" in msg and "75.8%" in msg and "--accept-quality-loss" in msg
    assert metrics["min_agreement"] == pytest.approx(0.7580, abs=1e-4)


def test_sound_labelled_accepted_or_non_classifier_models_pass():
    ok = {"top1_agreement": 0.92}
    check_agreement(ok, "accuracy", 363, "x", accept=False)
    assert ok["min_agreement"] == pytest.approx(0.758, abs=1e-3)
    low = {"top1_agreement": 0.3}
    check_agreement(low, "agreement", 363, "x", accept=True)  # --accept-quality-loss: reported, kept
    assert low["min_agreement"] == pytest.approx(0.758, abs=1e-3)
    for evaluator in (None, "cosine", "detection", "perplexity"):  # argmax of their outputs is no class
        other = {"top1_agreement": 0.1}
        check_agreement(other, evaluator, 363, "x", accept=False)
        assert "min_agreement" not in other
