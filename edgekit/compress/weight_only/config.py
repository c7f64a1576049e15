"""The options of the weight-only step (GPTQ, AWQ, AWQ+GPTQ or RTN to packed 2- to 8-bit codes),
in a module that imports no PyTorch: the command line builds ``edgekit compress``'s flags from
``WeightOnlyConfig`` (and recipes are checked against it) without loading the step, which
lives in ``step.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgekit.compress.options import option
from edgekit.compress.weight_only.awq_config import AwqConfig
from edgekit.compress.weight_only.gptq_config import GptqConfig, check_gptq
from edgekit.compress.weight_only.grid_config import check_bits, check_group_size
from edgekit.compress.weight_only.rtn_config import RtnConfig
from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import check_fields

METHODS = ("gptq-plus", "gptq", "awq", "awq-gptq", "rtn")  # the first is the default
# What each GPTQ method sets where the user leaves an option unset (None). "gptq" is the paper's algorithm
# (Frantar et al., 2022: the input Hessian of every linear, min-max grids, columns in order, no refit);
# "gptq-plus" adds what measured better on SmolLM2 (RESULTS.md, "How the GPTQ default got there":
# W4 g128 test perplexity 25.73 against the paper's 33.76); AWQ+GPTQ's GPTQ is gptq-plus.
GPTQ_METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "gptq-plus": {"act_order": True, "mse_grid": None, "refit": True, "gptaq_alpha": 0.25,
                  "value_hessian": "attention"},
    "gptq": {"act_order": False, "mse_grid": False, "refit": False, "gptaq_alpha": 0.0, "value_hessian": "input"},
}
GPTQ_METHODS = (*GPTQ_METHOD_DEFAULTS, "awq-gptq")  # the methods that run GPTQ
HEAD_CHOICES = ("int8", "int4", "none")
DEVICES = ("cpu", "cuda")
HIGH_BITS = 8  # what mixed precision keeps the most sensitive groups at (mixed.py)


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Options of the ``weight-only`` step (the CLI's ``compress --bits``).

    method: "gptq-plus" (default: GPTQ with the improvements below) | "gptq" (the paper's GPTQ,
    Frantar et al., 2022: the input Hessian ``X Xᵀ`` of every linear, a min-max grid per group,
    columns in order, no refit, no GPTAQ) | "awq" | "awq-gptq" (AWQ's scales, then gptq-plus on
    the scaled weights) | "rtn". On SmolLM2-135M W4 g128 (32 windows, test split) the paper's
    GPTQ measured 33.76 perplexity, worse than RTN's 29.98, and gptq-plus 25.73 (RESULTS.md). bits: 2, 3, 4 or 8. group_size: input columns per
    scale/zero point, a power of two >= 16, or -1 for one per output channel; a last,
    shorter group is allowed when it does not divide a layer's width (SmolLM2's 576 at 128).
    sym: symmetric grid (zero point 2**(bits-1)). act_order / mse_grid / refit / gptaq_alpha /
    value_hessian: GPTQ's options, each None = the method's own setting (``GPTQ_METHOD_DEFAULTS``:
    the paper's for "gptq", on for "gptq-plus"); a value given wins for either method.
    act_order: columns by decreasing Hessian diagonal; with groups it uses static groups, so the
    packed layout and the engine speed are unchanged (gptq-plus: on; measured better on SmolLM2).
    static_groups / damp / block_size: the reference's options. mse_grid: fit each group's grid by
    an Lp-error search over range shrink ratios instead of min-max (gptq-plus: on with groups,
    SmolLM2 W4 g128 27.29 -> 27.09; off per channel, where clipping a whole row's outliers
    measured far worse, W4 per-channel 29.19 -> 34.97). refit: once GPTQ fixed the codes,
    re-solve each row's group scales by least squares under the layer's Hessian (gptq-plus:
    on; 27.09 -> 26.57). gptaq_alpha: GPTAQ's asymmetric calibration (Li et al., 2025): each
    layer is solved to reproduce the *float* model's output from its (quantized-upstream)
    inputs, moved ``alpha`` of the way from the paper's target; costs one more forward of each
    block on the float model's activations, whose group inputs are kept while the block is
    solved (gptq-plus: 0.25, as in GPTAQ; 27.09 -> 26.24, with refit 26.22; 0: the paper's).
    true_sequential: each linear group sees inputs from the already-quantized groups of
    its block (the block walk always works so: ``False`` is refused, not ignored).
    value_hessian: GPTQ's Hessian for attention value projections (Llama family):
    "attention" (gptq-plus) from the attention-mixed inputs ``P X`` of each key/value head,
    i.e. the error measured where the values are used; "input" from the layer's inputs
    ``X`` as in the paper. Measured on SmolLM2 (W4 g128): the paper's Hessian weights every
    token alike, so GPTQ moves the value error onto the attention-sink token's massive
    channels, which nearly every query reads: perplexity worse than RTN; see RESULTS.md.
    value_query_stride: the attention-mixed Hessian from every n-th query's row of ``P X`` (default 2:
    SmolLM2-135M W4 validation perplexity 33.72 against 34.20 from every query, within the noise of
    the choice of windows, at 29% less GPTQ CPU time; 1: every query). calib_samples / seqlen: calibration windows (seqlen None: the model's): the
    text's first non-overlapping windows, topped up, when it holds fewer, with windows at
    random offsets (seeded; the GPTQ reference samples all its windows so). Default 32 windows,
    chosen on validation perplexity (SmolLM2-135M W4: 34.20 against 34.34 with 128, while two
    disjoint sets of 32 differ by 0.90); 64 or 128 give a result less dependent on the text.
    awq_grid / awq_clip: AWQ's scale-exponent grid points and clipping search.
    head: the LM head and tied embedding: "int8" (default; 4 bits there cost ~6 PPL on
    SmolLM2), "int4" or "none" (kept float). device: where the solver runs.
    eval_windows: for a causal LM, perplexity before and after on this many windows of the
    eval split (the model's default eval text, e.g. Wikipedia; 0: skip), in the step metrics,
    when the step is applied on its own (``compress`` measures against the float model itself).
    """

    method: str = field(default=METHODS[0], metadata=option(
        "--method", basic=True, help="ptq | qat (8-bit); gptq-plus (default) | gptq (the paper's) | awq | "
        "awq-gptq | rtn (weight-only)."))
    bits: int = field(
        default=4, metadata=option("--bits", basic=True, show_default=False,
                                     help="8: INT8 (ptq/qat); 2, 3, 4, 8 weight-only (gptq/awq/rtn)."))
    group_size: int = field(
        default=128, metadata=option("--group-size", basic=True, help="Weight-only: group size (-1 = per channel)."))
    sym: bool = field(default=False, metadata=option("--sym/--asym", help="Weight-only: symmetric or asymmetric grid."))
    act_order: bool | None = field(default=None, metadata=option(
        "--act-order/--no-act-order", help="GPTQ: quantize columns by decreasing Hessian diagonal (gptq-plus: on, "
        "gptq: off; static groups keep the packed layout)."))
    static_groups: bool = False
    damp: float = 0.01
    block_size: int = 128
    mse_grid: bool | None = None
    refit: bool | None = field(default=None, metadata=option(
        "--refit/--no-refit", help="GPTQ: re-solve the group scales by least squares once the codes are "
        "fixed (gptq-plus: on, gptq: off)."))
    gptaq_alpha: float | None = field(default=None, metadata=option(
        "--gptaq-alpha", help="GPTQ: how far each layer matches the float model's output instead of its "
        "own on quantized inputs (GPTAQ's alpha, 0-1; gptq-plus: 0.25, gptq: 0)."))
    true_sequential: bool = True
    value_hessian: str | None = None
    # every 2nd query: validation perplexity 33.72 against 34.20 with all, 29% less GPTQ CPU (RESULTS.md, issue 30)
    value_query_stride: int = 2
    gptaq_windows: int | None = None
    # 32 windows: SmolLM2-135M W4's validation perplexity within the noise of the choice of windows of 128's,
    # at a quarter of GPTQ's time (RESULTS.md, issue 30 item 1)
    calib_samples: int = field(default=32, metadata=option("--calib-samples"))
    seqlen: int | None = field(default=512, metadata=option(
        "--seqlen", help="Token window for language models: calibration (GPTQ/AWQ) and distillation."))
    awq_grid: int = 20
    awq_clip: bool = True
    head: str = "int8"
    device: str = field(default="cpu", metadata=option("--device", help="cpu | cuda (GPTQ/AWQ)."))
    eval_windows: int = 8
    max_size_mb: float | None = field(default=None, metadata=option(
        "--max-size-mb", help="Weight-only: mixed precision within this model size (MB, packed): the groups of "
        "linears whose rounding costs the loss most keep 8 bits."))
    avg_bits: float | None = field(default=None, metadata=option(
        "--avg-bits", help="Weight-only: mixed precision at this average of stored bits per weight over the "
        "block linears (scales and zero points included; 4-bit g128 is about 4.3)."))
    sensitivity_windows: int = 8

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if self.method not in METHODS:
            raise bad_choice("weight-only method", self.method, METHODS)
        check_bits(self.bits)
        check_group_size(self.group_size)
        # GPTQ's options are checked whatever the method (a recipe's typo stops before any work)
        gptq = self.gptq_options()
        check_gptq(self.damp, gptq["gptaq_alpha"], self.block_size, gptq["value_hessian"], self.value_query_stride)
        if not self.true_sequential:  # a setting that would change nothing must not look as if it did
            raise BadInputError("true_sequential=False is not supported: each group of a block is quantized on "
                                "the outputs of the groups before it (true_sequential=True, the only walk)")
        if self.calib_samples < 1:
            raise BadInputError(f"calib_samples must be at least 1, got {self.calib_samples!r}")
        if self.seqlen is not None and self.seqlen < 2:
            raise BadInputError(f"seqlen must be at least 2, got {self.seqlen!r}")
        if self.awq_grid < 1:
            raise BadInputError(f"awq_grid must be at least 1, got {self.awq_grid!r}")
        if self.head not in HEAD_CHOICES:
            raise bad_choice("head quantization", self.head, HEAD_CHOICES)
        if self.device not in DEVICES:
            raise bad_choice("device", self.device, DEVICES)
        if not isinstance(self.eval_windows, int) or self.eval_windows < 0:
            raise BadInputError(f"eval_windows must be a whole number >= 0, got {self.eval_windows!r}")
        if self.max_size_mb is not None and self.avg_bits is not None:
            raise BadInputError("give one size budget: --max-size-mb or --avg-bits, not both")
        if self.max_size_mb is not None and not self.max_size_mb > 0:
            raise BadInputError(f"max_size_mb must be positive, got {self.max_size_mb!r}")
        if self.avg_bits is not None and not self.bits < self.avg_bits <= 2 * HIGH_BITS:
            raise BadInputError(f"avg_bits must be above the low bit width ({self.bits}) and at most {2 * HIGH_BITS}, "
                                f"got {self.avg_bits!r}")
        if self.mixed and self.bits >= HIGH_BITS:
            raise BadInputError(f"mixed precision keeps some layers at {HIGH_BITS} bits; --bits must be lower, "
                                f"got {self.bits}")
        if self.gptaq_windows is not None and self.gptaq_windows < 1:
            raise BadInputError(f"gptaq_windows must be at least 1, got {self.gptaq_windows!r}")
        if self.sensitivity_windows < 1:
            raise BadInputError(f"sensitivity_windows must be at least 1, got {self.sensitivity_windows!r}")

    @property
    def mixed(self) -> bool:
        """Whether a size budget asks for mixed precision."""
        return self.max_size_mb is not None or self.avg_bits is not None

    @property
    def grid_search(self) -> bool:
        """Whether GPTQ searches each group's range (``mse_grid``, resolved for the method and group size)."""
        mse_grid = self.gptq_options()["mse_grid"]
        return self.group_size != -1 if mse_grid is None else bool(mse_grid)

    def gptq_options(self) -> dict[str, Any]:
        """GPTQ's method-dependent options: each given value, else the method's own setting
        (``GPTQ_METHOD_DEFAULTS``; AWQ+GPTQ and the methods without GPTQ: gptq-plus's).

        >>> WeightOnlyConfig(method="gptq", refit=True).gptq_options()["refit"]
        True
        """
        defaults = GPTQ_METHOD_DEFAULTS.get(self.method, GPTQ_METHOD_DEFAULTS["gptq-plus"])
        return {k: default if getattr(self, k) is None else getattr(self, k) for k, default in defaults.items()}

    def method_config(self) -> MethodConfig:
        """The config of ``method`` alone: what its algorithm reads (the grid and its own options),
        the rest (calibration, device, head, budgets, evaluation) staying with the step.

        >>> WeightOnlyConfig(method="rtn", bits=3).method_config()
        RtnConfig(bits=3, group_size=128, sym=False)
        """
        grid: dict[str, Any] = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym}
        if self.method == "rtn":
            return RtnConfig(**grid)
        gptq = GptqConfig(**grid, **self.gptq_options(), static_groups=self.static_groups, damp=self.damp,
                          block_size=self.block_size, value_query_stride=self.value_query_stride)
        if self.method in GPTQ_METHOD_DEFAULTS:
            return gptq
        return AwqConfig(**grid, awq_grid=self.awq_grid, awq_clip=self.awq_clip,
                         then_gptq=gptq if self.method == "awq-gptq" else None)


MethodConfig = RtnConfig | GptqConfig | AwqConfig  # one per METHODS entry ("awq-gptq": AwqConfig.then_gptq)
