"""The options of the "int8" step (INT8 post-training quantization and QAT), in a module that
imports no PyTorch or ONNX: the command line builds ``edgekit compress``'s flags from
``Int8Config`` (and recipes are checked against it) without loading the step.

The choices the config validates against live here too, and the modules that do the work
(``step.py``, ``qdq.py``, ``calibration.py``, ``onnx_graph.py``, ``smooth.py``) import them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.compress.options import option
from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import check_fields

QAT_METHODS = ("ptq", "qat")
ROUNDINGS = ("nearest", "gptq")
# PyTorch-path defaults, measured (benchmarks/RESULTS.md, issue 3): on EfficientNet-Lite0 mse
# ranges beat percentile 99.99 (84.6% vs 82.4% top-1 agreement), and GPTQ rounding cut the
# held-out calibration KL 3x at the same engine speed; on the Fashion-MNIST CNN all are within 0.1 pt
TORCH_CALIB_METHOD = "mse"
SCHEMES = ("u8s8", "u8s7", "s8s8", "trt")  # the Q/DQ forms (qdq.py)
CALIB_METHODS = ("minmax", "percentile", "entropy", "mse")  # activation range choices (calibration.py)
MIN_CALIB_SAMPLES = 8
PLACEMENTS = ("auto", "linear", "all")  # where Q/DQ go in an ONNX graph (onnx_graph.py)


@dataclass(frozen=True)
class SmoothConfig:
    """alpha: how much of each channel's activation range moves into the weights, in [0, 1]."""

    alpha: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= float(self.alpha) <= 1.0:
            raise BadInputError(f"smoothing alpha must be a number in [0, 1] (0.5 balances activations and weights), "
                                f"got {self.alpha!r}")


@dataclass(frozen=True)
class Int8Config:
    """INT8 settings (the CLI's flags map onto these names).

    method: "ptq" | "qat".
    calib_method: None (from the path: "mse" for the PyTorch path (TORCH_CALIB_METHOD); "mse" when the ONNX graph
        is quantized with the "linear" placement: a transformer's outlier channels need their
        full range, percentile/entropy clip them) | "minmax" | "percentile" | "entropy" | "mse";
        percentile: for "percentile".
    calib_samples: how many calibration samples to read.
    scheme: None (from the target) | "u8s8" | "s8s8" | "trt".
    per_channel: per-output-channel weight scales (per-tensor when False).
    max_accuracy_drop: None, or the largest allowed drop of the model's metric in
        percentage points (0.5 = half a point): accuracy for classifiers with labels, else
        top-1 agreement with FP32, else mean cosine x 100; the most sensitive layers and
        activations stay in float until the drop is within it. Measured on calibration-split
        samples held out of range calibration (never on the evaluation split).
    rounding: "gptq" (default; ``rounding.py``: each layer's weights rounded column by column
        against its output error on 32 calibration inputs; same grid, same engine speed) or
        "nearest" (plain round-to-nearest on the int8 grid).
    keep_float: layers whose weights stay float from the start (not quantized, no bias
        correction): layer names, or "first" (the first quantizable layer, e.g. a CNN's stem
        conv) and "last" (the last one, e.g. the classifier). Quantized from an ONNX graph (a causal LM,
        an ONNX file): also a layer path's last parts ("lm_head", "down_proj"), "ffn-down" (the
        feed-forward down projections: a causal LM's default, ``onnx_graph.LM_KEEP_FLOAT``) or "none".
    fallback_samples: how many calib-split samples after the first ``calib_samples`` the
        fallback measures on (fewer if the split is smaller; the calibration samples
        themselves when none are left).
    fallback_candidates: how many of the lowest-SQNR activations the sensitivity scan
        measures besides every layer's weights (one pass of 32 samples each; None: all).
    equalize: cross-layer equalization before calibration (exact across ReLU only).
    bias_correction: correct each layer's output mean shift after weight quantization.
    qat_epochs, qat_lr, qat_batch_size, qat_max_steps, learnable_scales: QAT.
    eval_samples: evaluation samples for the metrics (None: the whole eval split; for a causal LM
        its first ``quality.EVAL_WINDOWS`` windows (8), compared token by token one window at a time).
    placement: where Q/DQ go when the model is quantized from its ONNX graph (ONNX-only
        models, and models torch.fx cannot trace, e.g. Hugging Face BERT): "auto" ("all" if
        the graph has a Conv, else "linear") | "linear" (only the inputs of MatMul/Gemm
        with a weight: transformers) | "all" (every op ONNX Runtime can quantize).
    u8u8_layers: scheme "u8s7" only (x86 without VNNI): layers whose weights keep all 8 bits, stored as
        uint8 with zero point 128 so ONNX Runtime runs them on its exact u8 x u8 kernels instead of 7-bit
        weights on the u8 x s8 ones (``qdq.promote_u8u8``): layer names or "first"; none by default (on
        EfficientNet-Lite0 the scan's most sensitive layers lowered the validation KL but not the
        agreement: benchmarks/RESULTS.md, issue 26). The fallback (``max_accuracy_drop``) promotes
        sensitive layers so before it floats any. Ignored under the other schemes (their weights have 8 bits).
    smooth_alpha: SmoothQuant activation smoothing for causal LMs (``smooth.py``), folded into the
        float model before its graph is quantized: in [0, 1], or None (off). Ignored for other models.
    """

    method: str = field(default="ptq", metadata=option("--method"))
    calib_method: str | None = field(
        default=None, metadata=option("--calib-method", help="INT8: minmax | percentile | entropy | mse."))
    percentile: float = 99.99
    calib_samples: int = field(default=128, metadata=option(
        "--calib-samples", help="Calibration samples (INT8) or token windows (weight-only)."))
    scheme: str | None = None
    per_channel: bool = True
    max_accuracy_drop: float | None = field(default=None, metadata=option(
        "--max-accuracy-drop", help="INT8: keep the most sensitive layers in float until the accuracy "
        "drop is within this many percentage points (e.g. 0.5)."))
    rounding: str = field(default="gptq", metadata=option(
        "--rounding", help="INT8 weights: gptq (default: output-error-aware rounding) | nearest."))
    keep_float: tuple[str, ...] = field(default=(), metadata=option(
        "--keep-float", help="INT8: a layer whose weights stay float: first | last | a layer name; from an ONNX "
        "graph also a name's last parts (lm_head), ffn-down (a causal LM's default) or none (repeatable; costs speed)."))
    fallback_samples: int = 128
    fallback_candidates: int | None = 12
    equalize: bool = True
    bias_correction: bool = True
    qat_epochs: int = field(default=1, metadata=option("--epochs", when={"method": ("qat",)}))
    qat_lr: float = 1e-4
    qat_batch_size: int = 32
    qat_max_steps: int | None = None
    learnable_scales: bool = False
    eval_samples: int | None = None
    placement: str = field(default="auto", metadata=option(
        "--placement", help="INT8 via the ONNX graph: auto | linear (weight MatMul/Gemm inputs only: "
        "transformers) | all."))
    u8u8_layers: tuple[str, ...] = ()
    smooth_alpha: float | None = field(default=None, metadata=option(
        "--smooth-alpha", help="INT8 of a causal LM: SmoothQuant activation smoothing, its strength in [0, 1] "
        "(0.5: outlier range split evenly between activations and weights); off unless given."))

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if self.method not in QAT_METHODS:
            raise bad_choice("quantization method", self.method, QAT_METHODS)
        if self.calib_method is not None and self.calib_method not in CALIB_METHODS:
            raise bad_choice("calibration method", self.calib_method, CALIB_METHODS)
        if not (50.0 < float(self.percentile) <= 100.0):
            raise BadInputError(f"percentile must be in (50, 100], got {self.percentile}")
        if int(self.calib_samples) < MIN_CALIB_SAMPLES:
            raise BadInputError(f"calib_samples must be at least {MIN_CALIB_SAMPLES}, got {self.calib_samples}")
        if self.scheme is not None and self.scheme not in SCHEMES:
            raise bad_choice("quantization scheme", self.scheme, SCHEMES)
        if self.max_accuracy_drop is not None and not (0.0 <= float(self.max_accuracy_drop) <= 100.0):
            raise BadInputError(f"max_accuracy_drop must be in [0, 100] percentage points (0.5 = half a point), "
                                f"got {self.max_accuracy_drop}")
        if self.rounding not in ROUNDINGS:
            raise bad_choice("weight rounding", self.rounding, ROUNDINGS)
        if isinstance(self.keep_float, str) or not all(isinstance(k, str) and k for k in self.keep_float):
            raise BadInputError(f"keep_float must be a list of layer names (or 'first' / 'last'), got {self.keep_float!r}")
        object.__setattr__(self, "keep_float", tuple(self.keep_float))
        if int(self.fallback_samples) < 1:
            raise BadInputError(f"fallback_samples must be at least 1, got {self.fallback_samples}")
        if self.fallback_candidates is not None and int(self.fallback_candidates) < 1:
            raise BadInputError(f"fallback_candidates must be at least 1 (or None: all), got {self.fallback_candidates}")
        if int(self.qat_epochs) < 1:
            raise BadInputError(f"qat_epochs must be at least 1, got {self.qat_epochs}")
        if not (0.0 < float(self.qat_lr) < 1.0):
            raise BadInputError(f"qat_lr must be in (0, 1), got {self.qat_lr}")
        if int(self.qat_batch_size) < 1:
            raise BadInputError(f"qat_batch_size must be at least 1, got {self.qat_batch_size}")
        if self.qat_max_steps is not None and int(self.qat_max_steps) < 1:
            raise BadInputError(f"qat_max_steps must be at least 1, got {self.qat_max_steps}")
        if self.eval_samples is not None and int(self.eval_samples) < 1:
            raise BadInputError(f"eval_samples must be at least 1, got {self.eval_samples}")
        if self.placement not in PLACEMENTS:
            raise bad_choice("INT8 placement", self.placement, PLACEMENTS)
        if isinstance(self.u8u8_layers, str) or not all(isinstance(k, str) and k for k in self.u8u8_layers):
            raise BadInputError(f"u8u8_layers must be a list of layer names (or 'first'), got {self.u8u8_layers!r}")
        object.__setattr__(self, "u8u8_layers", tuple(self.u8u8_layers))
        if self.smooth_alpha is not None:
            SmoothConfig(self.smooth_alpha)  # range check, one line
        if not self.per_channel:
            raise BadInputError("per_channel=False is not supported: per-tensor int8 weights lose too much "
                                "accuracy on depthwise convolutions (use per_channel=True)")
