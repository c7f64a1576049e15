"""What each INT8 technique reads: one small frozen config per technique, in a module that imports no
PyTorch, NumPy or ONNX. ``Int8Config`` (``config.py``) stays the step's user-facing config (the
command line's flags, recipes, the manifest's record) and builds these (``Int8Config.calibration_config()``
and the like); each algorithm module receives its own config and nothing else.

One module for all of them: each is a few fields with the checks that go with them, and they share
the choices they check (``CALIB_METHODS``, ``ROUNDINGS``, ``PLACEMENTS``); seven files of ten lines
would scatter what reads best side by side. Error messages name the option as the user gives it
(``calib_samples``, ``qat_lr``), whichever config checks it.

>>> CalibrationConfig(method="minmax", samples=16).percentile
99.99
"""
from __future__ import annotations

from dataclasses import dataclass

from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import check_fields

ROUNDINGS = ("nearest", "gptq")
CALIB_METHODS = ("minmax", "percentile", "entropy", "mse")  # activation range choices (calibration.py)
MIN_CALIB_SAMPLES = 8
PLACEMENTS = ("auto", "linear", "all")  # where Q/DQ go in an ONNX graph (onnx_graph.py)


@dataclass(frozen=True)
class CalibrationConfig:
    """Activation ranges (``step.calibrate`` on the PyTorch path, ``onnx_graph`` on the ONNX one).

    method: None (the path's default: "mse" on the PyTorch path, by placement on the ONNX one) |
        "minmax" | "percentile" | "entropy" | "mse". percentile: for "percentile", in (50, 100].
    samples: how many calibration samples to read (at least ``MIN_CALIB_SAMPLES``).
    """

    method: str | None = None
    percentile: float = 99.99
    samples: int = 128

    def __post_init__(self) -> None:
        check_fields(self)
        if self.method is not None and self.method not in CALIB_METHODS:
            raise bad_choice("calibration method", self.method, CALIB_METHODS)
        if not (50.0 < float(self.percentile) <= 100.0):
            raise BadInputError(f"percentile must be in (50, 100], got {self.percentile}")
        if int(self.samples) < MIN_CALIB_SAMPLES:
            raise BadInputError(f"calib_samples must be at least {MIN_CALIB_SAMPLES}, got {self.samples}")


@dataclass(frozen=True)
class RoundingConfig:
    """The int8 weights once their scales are set: rounding "gptq" (``rounding.py``: against each
    layer's output error on calibration inputs) or "nearest"; bias_correction: correct each layer's
    output mean shift that weight quantization causes (``equalize.correct_bias``)."""

    rounding: str = "gptq"
    bias_correction: bool = True

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rounding not in ROUNDINGS:
            raise bad_choice("weight rounding", self.rounding, ROUNDINGS)


@dataclass(frozen=True)
class QatConfig:
    """Quantization-aware training (``qat.train_qat``): epochs, Adam's learning rate lr in (0, 1),
    batch_size, max_steps (per epoch; None: the whole training split), learnable_scales (activation
    scales trained with the weights)."""

    epochs: int = 1
    lr: float = 1e-4
    batch_size: int = 32
    max_steps: int | None = None
    learnable_scales: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if int(self.epochs) < 1:
            raise BadInputError(f"qat_epochs must be at least 1, got {self.epochs}")
        if not (0.0 < float(self.lr) < 1.0):
            raise BadInputError(f"qat_lr must be in (0, 1), got {self.lr}")
        if int(self.batch_size) < 1:
            raise BadInputError(f"qat_batch_size must be at least 1, got {self.batch_size}")
        if self.max_steps is not None and int(self.max_steps) < 1:
            raise BadInputError(f"qat_max_steps must be at least 1, got {self.max_steps}")


@dataclass(frozen=True)
class FallbackConfig:
    """The accuracy fallback (``sensitivity.fall_back``): max_accuracy_drop, the largest allowed drop
    in percentage points (0.5 = half a point); samples, how many held-out calib-split samples it
    measures on; candidates, how many of the lowest-SQNR activations the scan measures besides every
    layer's weights (None: all)."""

    max_accuracy_drop: float
    samples: int = 128
    candidates: int | None = 12

    def __post_init__(self) -> None:
        check_fields(self)
        if not (0.0 <= float(self.max_accuracy_drop) <= 100.0):
            raise BadInputError(f"max_accuracy_drop must be in [0, 100] percentage points (0.5 = half a point), "
                                f"got {self.max_accuracy_drop}")
        if int(self.samples) < 1:
            raise BadInputError(f"fallback_samples must be at least 1, got {self.samples}")
        if self.candidates is not None and int(self.candidates) < 1:
            raise BadInputError(f"fallback_candidates must be at least 1 (or None: all), got {self.candidates}")


@dataclass(frozen=True)
class OnnxGraphConfig:
    """INT8 of an ONNX graph (``onnx_graph.quantize_onnx_handle``): its calibration; placement, where
    Q/DQ go ("auto" | "linear" | "all"); keep_float, layers that stay float (names, a name's last
    parts, "ffn-down", "none"; empty: the model kind's default); eval_samples, how many samples the
    float comparison runs on (None: the split, or a causal LM's first windows)."""

    calibration: CalibrationConfig = CalibrationConfig()
    placement: str = "auto"
    keep_float: tuple[str, ...] = ()
    eval_samples: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.placement not in PLACEMENTS:
            raise bad_choice("INT8 placement", self.placement, PLACEMENTS)
        check_layer_names("keep_float", self.keep_float, "(or 'first' / 'last' / 'none')")
        object.__setattr__(self, "keep_float", tuple(self.keep_float))
        if self.eval_samples is not None and int(self.eval_samples) < 1:
            raise BadInputError(f"eval_samples must be at least 1, got {self.eval_samples}")


@dataclass(frozen=True)
class SmoothConfig:
    """alpha: how much of each channel's activation range moves into the weights, in [0, 1]."""

    alpha: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= float(self.alpha) <= 1.0:
            raise BadInputError(f"smoothing alpha must be a number in [0, 1] (0.5 balances activations and weights), "
                                f"got {self.alpha!r}")


def check_layer_names(name: str, value: tuple[str, ...], hint: str) -> None:
    """A list of non-empty layer names (a bare string is refused: it would read as its letters)."""
    if isinstance(value, str) or not all(isinstance(k, str) and k for k in value):
        raise BadInputError(f"{name} must be a list of layer names {hint}, got {value!r}")
