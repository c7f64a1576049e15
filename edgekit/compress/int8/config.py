"""The options of the "int8" step (INT8 post-training quantization and QAT), in a module that
imports no PyTorch or ONNX: the command line builds ``edgekit compress``'s flags from
``Int8Config`` (and recipes are checked against it) without loading the step.

``Int8Config`` is what the user gives; each technique reads its own small config
(``technique_configs.py``), which ``Int8Config`` builds: ``calibration_config()``,
``rounding_config()``, ``qat_config()``, ``fallback_config()``, ``onnx_graph_config()``,
``smooth_config()``. The step's own choices (method, scheme, keep_float, equalize, u8u8_layers,
eval_samples) stay here and ``step.py`` reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from edgekit.compress.int8.technique_configs import (
    CalibrationConfig,
    FallbackConfig,
    OnnxGraphConfig,
    QatConfig,
    RoundingConfig,
    SmoothConfig,
    check_layer_names,
)
from edgekit.compress.options import option
from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import check_fields

QAT_METHODS = ("ptq", "qat")
# PyTorch-path defaults, measured (benchmarks/RESULTS.md, issue 3): on EfficientNet-Lite0 mse
# ranges beat percentile 99.99 (84.6% vs 82.4% top-1 agreement), and GPTQ rounding cut the
# held-out calibration KL 3x at the same engine speed; on the Fashion-MNIST CNN all are within 0.1 pt
TORCH_CALIB_METHOD = "mse"
SCHEMES = ("u8s8", "u8s8p", "u8s7", "s8s8", "trt")  # the Q/DQ forms (qdq.py)
# A causal LM's own defaults, chosen on validation windows (SmolLM2-135M; benchmarks/RESULTS.md, issue 31): 32
# calibration windows, not all 90 of the split (each 512-token window is a forward pass of the float graph, 4-6 CPU
# s; 16 and 32 scored alike, 1.076x and 1.073x the float perplexity; 90 was not measured), and SmoothQuant at alpha
# 0.5 (with the FFN down projections in float, 1.073x fell to 1.037x, 1.049x at 0.8; with them in INT8 1.145x, so they
# stay float). Other models: 128 samples, no smoothing.
DEFAULT_CALIB_SAMPLES = 128
LM_CALIB_WINDOWS = 32
LM_SMOOTH_ALPHA = 0.5


@dataclass(frozen=True)
class Int8Config:
    """INT8 settings (the CLI's flags map onto these names).

    method: "ptq" | "qat".
    calib_method: None (from the path: "mse" for the PyTorch path (TORCH_CALIB_METHOD); "mse" when the ONNX graph
        is quantized with the "linear" placement: a transformer's outlier channels need their
        full range, percentile/entropy clip them) | "minmax" | "percentile" | "entropy" | "mse";
        percentile: for "percentile".
    calib_samples: how many calibration samples to read; None: the model kind's default, resolved when the
        step runs and recorded as the number used (``for_model``): 128 (DEFAULT_CALIB_SAMPLES), for a
        causal LM 32 token windows (LM_CALIB_WINDOWS).
    scheme: None (from the target) | "u8s8" | "u8s8p" | "u8s7" | "s8s8" | "trt" (docs/int8.md).
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
        conv), "last" (the last one, e.g. the classifier) or "none" (nothing). Not given: under scheme
        "u8s8p" an image stem (the first layer, a convolution over at most 4 channels, and the depthwise
        convolution that alone reads it: faster on those CPUs' float kernels, and the first activations carry
        the most INT8 error; ``step.STEM_FLOAT_SCHEMES``), else nothing. Quantized from an ONNX graph
        (a causal LM, an ONNX file): also a layer path's last parts ("lm_head", "down_proj"), "ffn-down" (the
        feed-forward down projections: a causal LM's default, ``onnx_graph.LM_KEEP_FLOAT``).
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
    u8u8_layers: schemes "u8s8p" and "u8s7" only (x86 without VNNI): layers whose weights keep all 8 bits,
        stored as uint8 with zero point 128 so ONNX Runtime runs them on its exact u8 x u8 kernels instead of
        pair-safe or 7-bit weights on the u8 x s8 ones (``qdq.promote_u8u8``): layer names or "first"; none by default (on
        EfficientNet-Lite0 the scan's most sensitive layers lowered the validation KL but not the
        agreement: benchmarks/RESULTS.md, issue 26). The fallback (``max_accuracy_drop``) promotes
        sensitive layers so before it floats any. Ignored under the other schemes (their weights have 8 bits).
    smooth_alpha: SmoothQuant activation smoothing for causal LMs (``smooth.py``), folded into the
        float model before its graph is quantized: in (0, 1]; 0 turns it off (alpha 0 would move every
        weight range into the activations, the opposite of its aim); None: the model kind's default,
        resolved when the step runs (``for_model``): 0.5 (LM_SMOOTH_ALPHA) for a causal LM with its
        PyTorch weights, off for every other model. Given for any other model, it is refused.
    """

    method: str = field(default="ptq", metadata=option("--method"))
    calib_method: str | None = field(
        default=None, metadata=option("--calib-method", help="INT8: minmax | percentile | entropy | mse."))
    percentile: float = 99.99
    calib_samples: int | None = field(default=None, metadata=option(
        "--calib-samples", help="Calibration samples (INT8) or token windows (weight-only)."))
    scheme: str | None = None
    per_channel: bool = True
    max_accuracy_drop: float | None = field(default=None, metadata=option(
        "--max-accuracy-drop", help="INT8: keep the most sensitive layers in float until the accuracy "
        "drop is within this many percentage points (e.g. 0.5)."))
    rounding: str = field(default="gptq", metadata=option(
        "--rounding", help="INT8 weights: gptq (default: output-error-aware rounding) | nearest."))
    keep_float: tuple[str, ...] = field(default=(), metadata=option(
        "--keep-float", help="INT8: a layer whose weights stay float: first | last | none | a layer name; from an "
        "ONNX graph also a name's last parts (lm_head) or ffn-down (a causal LM's default); without VNNI an image "
        "stem's default (repeatable)."))
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
        "(default 0.5: outlier range split evenly between activations and weights; 0: off)."))

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if self.method not in QAT_METHODS:
            raise bad_choice("quantization method", self.method, QAT_METHODS)
        if self.scheme is not None and self.scheme not in SCHEMES:
            raise bad_choice("quantization scheme", self.scheme, SCHEMES)
        check_layer_names("keep_float", self.keep_float, "(or 'first' / 'last' / 'none')")
        object.__setattr__(self, "keep_float", tuple(self.keep_float))
        check_layer_names("u8u8_layers", self.u8u8_layers, "(or 'first')")
        object.__setattr__(self, "u8u8_layers", tuple(self.u8u8_layers))
        # every technique's range checks, whether or not this run uses it: a recipe's bad value stops
        # before any work (the fallback's sizes are checked at a zero drop when it is off)
        self.onnx_graph_config()  # the calibration, placement and eval_samples
        self.rounding_config()
        self.qat_config()
        FallbackConfig(self.max_accuracy_drop or 0.0, self.fallback_samples, self.fallback_candidates)
        self.smooth_config()
        if not self.per_channel:
            raise BadInputError("per_channel=False is not supported: per-tensor int8 weights lose too much "
                                "accuracy on depthwise convolutions (use per_channel=True)")

    def calibration_config(self) -> CalibrationConfig:
        """What range calibration reads.

        >>> Int8Config(calib_method="minmax", calib_samples=16).calibration_config()
        CalibrationConfig(method='minmax', percentile=99.99, samples=16)
        """
        samples = DEFAULT_CALIB_SAMPLES if self.calib_samples is None else self.calib_samples
        return CalibrationConfig(method=self.calib_method, percentile=self.percentile, samples=samples)

    def for_model(self, model_kind: str, smoothable: bool) -> Int8Config:
        """This config with the defaults of a model of ``model_kind`` where a field was not given: the number of
        calibration samples, and smoothing for a causal LM whose PyTorch weights it can fold into (``smoothable``).

        >>> lm = Int8Config().for_model("causal-lm", smoothable=True)
        >>> lm.calib_samples, lm.smooth_alpha, Int8Config().for_model("image", smoothable=False).calib_samples
        (32, 0.5, 128)
        >>> Int8Config(calib_samples=90, smooth_alpha=0).for_model("causal-lm", smoothable=True).smooth_config() is None
        True
        """
        calib = self.calib_samples
        if calib is None:
            calib = LM_CALIB_WINDOWS if model_kind == "causal-lm" else DEFAULT_CALIB_SAMPLES
        alpha = self.smooth_alpha
        if alpha is None and model_kind == "causal-lm" and smoothable:
            alpha = LM_SMOOTH_ALPHA
        return replace(self, calib_samples=calib, smooth_alpha=alpha)

    def rounding_config(self) -> RoundingConfig:
        """What the weight rounding and bias correction read."""
        return RoundingConfig(rounding=self.rounding, bias_correction=self.bias_correction)

    def qat_config(self) -> QatConfig:
        """What quantization-aware training reads (built whatever ``method``; used under "qat")."""
        return QatConfig(epochs=self.qat_epochs, lr=self.qat_lr, batch_size=self.qat_batch_size,
                         max_steps=self.qat_max_steps, learnable_scales=self.learnable_scales)

    def fallback_config(self) -> FallbackConfig | None:
        """What the accuracy fallback reads; None without ``max_accuracy_drop`` (no fallback)."""
        if self.max_accuracy_drop is None:
            return None
        return FallbackConfig(max_accuracy_drop=self.max_accuracy_drop, samples=self.fallback_samples,
                              candidates=self.fallback_candidates)

    def onnx_graph_config(self) -> OnnxGraphConfig:
        """What quantizing an ONNX graph reads (ONNX-only models, models torch.fx cannot trace)."""
        return OnnxGraphConfig(calibration=self.calibration_config(), placement=self.placement,
                               keep_float=self.keep_float, eval_samples=self.eval_samples)

    def smooth_config(self) -> SmoothConfig | None:
        """What SmoothQuant reads; None when smoothing is off (``smooth_alpha`` 0, or None before ``for_model``)."""
        return None if not self.smooth_alpha else SmoothConfig(self.smooth_alpha)
