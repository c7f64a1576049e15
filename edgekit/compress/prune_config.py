"""The options of the "prune" step (structured pruning), in a module that imports neither
PyTorch nor the data sources: the command line builds ``edgekit compress``'s flags from
``PruneConfig`` without loading the step (``prune.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.compress.options import option
from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import check_fields

IMPORTANCES = ("auto", "l1", "l2", "taylor", "bn-scale")
SCOPES = ("auto", "channels", "mlp", "heads", "mlp+heads")


@dataclass(frozen=True)
class PruneConfig:
    """How much and what to prune.

    ratio: fraction of channels removed per prunable group (``--prune``), in (0, 1).
    importance: channel score (``--importance``): "l1"/"l2" weight magnitude, "taylor"
        (|weight x gradient| on calibration data), "bn-scale" (BatchNorm gamma); "auto":
        "taylor" for causal LMs (magnitude ranking wrecks them: SmolLM2 at 20% of MLP
        channels goes from perplexity 24 to 1e7 with "l1", to 52 with "taylor"), "l2" else.
    global_pruning: rank channels across layers (``--global``) instead of the same
        ratio in every layer (``--uniform``, the default).
    round_to: keep channel counts multiples of this (``--round-to 8``); None = exact.
    ignore: layer names (or glob patterns) whose output channels stay (``--ignore``).
    iterative_steps: reach ``ratio`` in K steps, re-scoring between them.
    scope: "auto" (every conv/linear channel for vision models; MLP channels for
        causal LMs), "channels", "mlp", "heads" or "mlp+heads" (causal LMs).
    head_ratio: fraction of attention heads removed when scope includes heads, and of
        each BERT-style encoder layer's heads (pruned whole, at least one kept) (None: ``ratio``).
    calib_batches: batches of calibration data for "taylor" importance.
    """

    ratio: float = field(
        default=0.5, metadata=option("--prune", selects=True, basic=True, help="Structured pruning ratio in (0, 1)."))
    importance: str = field(
        default="auto", metadata=option("--importance", help="Pruning: l1 | l2 | taylor | bn-scale."))
    global_pruning: bool = field(
        default=False, metadata=option("--global/--uniform", help="Pruning: global or per-layer ratio."))
    round_to: int | None = field(
        default=None, metadata=option("--round-to", help="Pruning: round channel counts to a multiple."))
    ignore: tuple[str, ...] = field(
        default=(), metadata=option("--ignore", help="Pruning: a layer to protect (repeatable)."))
    iterative_steps: int = field(default=1, metadata=option(
        "--iterative-steps", help="Pruning: reach the ratio in this many steps, re-scoring between them."))
    scope: str = "auto"
    head_ratio: float | None = None
    calib_batches: int = 4

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if isinstance(self.ignore, (list, str)):
            object.__setattr__(self, "ignore", (self.ignore,) if isinstance(self.ignore, str) else tuple(self.ignore))
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 < self.ratio < 1:
            raise BadInputError(f"pruning ratio must be in (0, 1), got {self.ratio}")
        if self.importance not in IMPORTANCES:
            raise bad_choice("importance", self.importance, IMPORTANCES)
        if self.scope not in SCOPES:
            raise bad_choice("pruning scope", self.scope, SCOPES)
        if self.round_to is not None and (not isinstance(self.round_to, int) or self.round_to < 1):
            raise BadInputError(f"round-to must be a positive integer, got {self.round_to}")
        if not isinstance(self.iterative_steps, int) or self.iterative_steps < 1:
            raise BadInputError(f"iterative steps must be >= 1, got {self.iterative_steps}")
        if self.head_ratio is not None and not 0 <= self.head_ratio < 1:
            raise BadInputError(f"head ratio must be in [0, 1), got {self.head_ratio}")
        if self.calib_batches < 1:
            raise BadInputError(f"calib batches must be >= 1, got {self.calib_batches}")
