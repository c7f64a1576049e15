"""INT8's options (edgekit/compress/int8/config.py): the step's config and each technique's own small config."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from edgekit.compress.int8.config import (
    CalibrationConfig,
    FallbackConfig,
    Int8Config,
    QatConfig,
    RoundingConfig,
    SmoothConfig,
)
from edgekit.errors import BadInputError

# step field -> (technique config builder, its field): every technique reads only these
MAPPING = {
    "calib_method": ("calibration_config", "method"), "percentile": ("calibration_config", "percentile"),
    "calib_samples": ("calibration_config", "samples"),
    "rounding": ("rounding_config", "rounding"), "bias_correction": ("rounding_config", "bias_correction"),
    "max_accuracy_drop": ("fallback_config", "max_accuracy_drop"), "fallback_samples": ("fallback_config", "samples"),
    "fallback_candidates": ("fallback_config", "candidates"),
    "qat_epochs": ("qat_config", "epochs"), "qat_lr": ("qat_config", "lr"), "qat_batch_size": ("qat_config", "batch_size"),
    "qat_max_steps": ("qat_config", "max_steps"), "learnable_scales": ("qat_config", "learnable_scales"),
}


def test_each_technique_gets_its_own_fields_and_nothing_else():
    config = Int8Config(method="qat", calib_method="percentile", percentile=99.9, calib_samples=64, rounding="nearest",
                        bias_correction=False, max_accuracy_drop=0.5, fallback_samples=32, fallback_candidates=None,
                        qat_epochs=3, qat_lr=1e-3, qat_batch_size=8, qat_max_steps=10, learnable_scales=True)
    built = {name: getattr(config, name)() for name in {b for b, _ in MAPPING.values()}}
    for step_field, (builder, field) in MAPPING.items():
        assert getattr(built[builder], field) == getattr(config, step_field), step_field
    for builder, made in built.items():  # each has exactly the fields mapped onto it
        assert {f.name for f in dataclasses.fields(made)} == {f for b, f in MAPPING.values() if b == builder}
    # the defaults of the step are the techniques' defaults
    default = Int8Config()
    assert (default.calibration_config(), default.rounding_config(), default.fallback_config(), default.qat_config()) \
        == (CalibrationConfig(), RoundingConfig(), FallbackConfig(), QatConfig())


@pytest.mark.parametrize("make, message", [
    (lambda: CalibrationConfig(method="kl"), r"^unknown calibration method 'kl' \(choose from"),
    (lambda: CalibrationConfig(percentile=50), r"^percentile must be in \(50, 100\], got 50$"),
    (lambda: CalibrationConfig(samples=4), r"^calib_samples must be at least 8, got 4$"),
    (lambda: RoundingConfig(rounding="adaround"), r"^unknown weight rounding 'adaround' \(choose from 'gptq', 'nearest'\)$"),
    (lambda: FallbackConfig(max_accuracy_drop=101), r"^max_accuracy_drop must be in \[0, 100\] percentage points"),
    (lambda: FallbackConfig(candidates=0), r"^fallback_candidates must be at least 1 \(or None: all\), got 0$"),
    (lambda: QatConfig(lr=1.5), r"^qat_lr must be in \(0, 1\), got 1.5$"),
    (lambda: QatConfig(max_steps=0), r"^qat_max_steps must be at least 1, got 0$"),
    # the step config makes the same checks through them: one line naming its own option
    (lambda: Int8Config(qat_batch_size=0), r"^qat_batch_size must be at least 1, got 0$"),
    (lambda: Int8Config(fallback_samples=0), r"^fallback_samples must be at least 1, got 0$"),
    (lambda: Int8Config(smooth_alpha=2.0), r"^smoothing alpha must be a number in \[0, 1\]"),
])
def test_technique_configs_check_their_values(make, message):
    with pytest.raises(BadInputError, match=message):
        make()


def test_technique_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QatConfig().epochs = 2  # type: ignore[misc]
    assert SmoothConfig().alpha == 0.5


def test_the_config_module_is_light():
    code = ("import sys; from edgekit.compress.int8.config import Int8Config; c = Int8Config(); "
            "c.calibration_config(); c.rounding_config(); c.fallback_config(); c.qat_config(); "
            "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "[]\n"
