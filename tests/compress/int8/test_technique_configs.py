"""INT8's per-technique configs: each one's range checks (one line naming the bad value), and
``Int8Config``'s builders handing each technique exactly its own fields."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.technique_configs import (
    CalibrationConfig,
    FallbackConfig,
    OnnxGraphConfig,
    QatConfig,
    RoundingConfig,
    SmoothConfig,
)
from edgekit.errors import BadInputError


@pytest.mark.parametrize(("make", "message"), [
    (lambda: CalibrationConfig(method="max"), r"^unknown calibration method 'max' \(choose from 'entropy', 'minmax', 'mse', 'percentile'\)$"),
    (lambda: CalibrationConfig(percentile=50.0), r"^percentile must be in \(50, 100\], got 50.0$"),
    (lambda: CalibrationConfig(samples=7), r"^calib_samples must be at least 8, got 7$"),
    (lambda: RoundingConfig(rounding="adaround"), r"^unknown weight rounding 'adaround' \(choose from 'gptq', 'nearest'\)$"),
    (lambda: QatConfig(epochs=0), r"^qat_epochs must be at least 1, got 0$"),
    (lambda: QatConfig(lr=1.0), r"^qat_lr must be in \(0, 1\), got 1.0$"),
    (lambda: QatConfig(batch_size=0), r"^qat_batch_size must be at least 1, got 0$"),
    (lambda: QatConfig(max_steps=0), r"^qat_max_steps must be at least 1, got 0$"),
    (lambda: FallbackConfig(max_accuracy_drop=-0.5), r"^max_accuracy_drop must be in \[0, 100\] percentage points"),
    (lambda: FallbackConfig(max_accuracy_drop=0.5, samples=0), r"^fallback_samples must be at least 1, got 0$"),
    (lambda: FallbackConfig(max_accuracy_drop=0.5, candidates=0),
     r"^fallback_candidates must be at least 1 \(or None: all\), got 0$"),
    (lambda: OnnxGraphConfig(placement="conv"), r"^unknown INT8 placement 'conv' \(choose from 'all', 'auto', 'linear'\)$"),
    (lambda: OnnxGraphConfig(keep_float="first"),  # type: ignore[arg-type]
     r"^keep_float"),
    (lambda: OnnxGraphConfig(eval_samples=0), r"^eval_samples must be at least 1, got 0$"),
    (lambda: SmoothConfig(alpha=1.5), r"^smoothing alpha must be a number in \[0, 1\]"),
])
def test_each_technique_config_refuses_a_bad_value_in_one_line(make, message):
    with pytest.raises(BadInputError, match=message) as e:
        make()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("field", "bad", "message"), [
    ("calib_samples", 4, r"^calib_samples must be at least 8, got 4$"),
    ("qat_lr", 2.0, r"^qat_lr must be in \(0, 1\), got 2.0$"),
    ("fallback_samples", 0, r"^fallback_samples must be at least 1, got 0$"),  # checked with the fallback off
    ("placement", "conv", r"^unknown INT8 placement 'conv'"),
    ("rounding", "x", r"^unknown weight rounding 'x'"),
    ("smooth_alpha", 2.0, r"^smoothing alpha must be a number in \[0, 1\]"),
])
def test_the_step_config_refuses_what_its_techniques_refuse_with_the_same_line(field, bad, message):
    """A recipe's bad value stops at ``Int8Config``, whether or not the run would use the technique."""
    with pytest.raises(BadInputError, match=message) as e:
        Int8Config(**{field: bad})
    assert "\n" not in str(e.value)


def test_each_builder_hands_its_technique_exactly_its_own_fields():
    config = Int8Config(method="qat", calib_method="percentile", percentile=99.9, calib_samples=32,
                        max_accuracy_drop=0.5, fallback_samples=40, fallback_candidates=None, rounding="nearest",
                        bias_correction=False, qat_epochs=3, qat_lr=1e-3, qat_batch_size=8, qat_max_steps=5,
                        learnable_scales=True, placement="linear", keep_float=("lm_head",), eval_samples=9,
                        smooth_alpha=0.25)
    assert config.calibration_config() == CalibrationConfig(method="percentile", percentile=99.9, samples=32)
    assert config.rounding_config() == RoundingConfig(rounding="nearest", bias_correction=False)
    assert config.qat_config() == QatConfig(epochs=3, lr=1e-3, batch_size=8, max_steps=5, learnable_scales=True)
    assert config.fallback_config() == FallbackConfig(max_accuracy_drop=0.5, samples=40, candidates=None)
    assert config.onnx_graph_config() == OnnxGraphConfig(calibration=config.calibration_config(), placement="linear",
                                                         keep_float=("lm_head",), eval_samples=9)
    assert config.smooth_config() == SmoothConfig(alpha=0.25)
    # the techniques that are off build nothing
    assert Int8Config().fallback_config() is None and Int8Config().smooth_config() is None


def test_every_field_but_the_steps_own_reaches_one_technique():
    """A field added to Int8Config either reaches a technique config or is one of the step's own choices."""
    steps_own = {"method", "scheme", "per_channel", "keep_float", "equalize", "u8u8_layers", "eval_samples"}
    config = Int8Config(max_accuracy_drop=0.5, smooth_alpha=0.5)
    built = [config.calibration_config(), config.rounding_config(), config.qat_config(), config.fallback_config(),
             config.onnx_graph_config(), config.smooth_config()]
    reached = {"calib_method", "percentile", "calib_samples", "rounding", "bias_correction", "qat_epochs", "qat_lr",
               "qat_batch_size", "qat_max_steps", "learnable_scales", "max_accuracy_drop", "fallback_samples",
               "fallback_candidates", "placement", "smooth_alpha"}
    assert all(dataclasses.is_dataclass(b) for b in built)
    assert {f.name for f in dataclasses.fields(Int8Config)} == steps_own | reached
    assert len(steps_own | reached) == 22


def test_the_config_modules_are_light():
    code = ("import sys; from edgekit.compress.int8.config import Int8Config; "
            "c = Int8Config(max_accuracy_drop=0.5, smooth_alpha=0.5); "
            "[c.calibration_config(), c.rounding_config(), c.qat_config(), c.fallback_config(), "
            "c.onnx_graph_config(), c.smooth_config()]; "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"
