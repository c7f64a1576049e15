"""The distillation step's config, ``DistillConfig``, whose flagged fields make the options of
``edgekit distill`` (and of ``edgekit compress --distill``). Light (no PyTorch): the command
line reads it to build its options; ``distill.py`` holds the losses, the training and the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from edgekit.compress.options import option
from edgekit.errors import BadInputError
from edgekit.schema import check_fields


@dataclass(frozen=True)
class DistillConfig:
    """temperature (``--temperature``), alpha: weight of the soft loss (``--distill-alpha``),
    epochs, lr, batch_size, feature_loss (``--feature-loss``) and its weight, seed,
    patience: epochs without validation improvement before stopping (None: never),
    max_steps: cap on optimizer steps, limit: at most this many training samples,
    val_fraction: share of the training samples held out for validation,
    seqlen: token window for text data, eval_limit: samples in the final evaluation,
    schedule: learning rate "cosine" (decays to 0 over the run) or "constant"."""

    # flags of `edgekit compress --distill` and `edgekit distill`; those naming commands=("distill",) only of the latter
    temperature: float = field(default=4.0, metadata=option(
        "--temperature", basic=("distill",), help="Distillation temperature."))
    alpha: float = field(default=0.7, metadata=option(
        "--distill-alpha", deprecated=("--alpha",), basic=("distill",), help="Distillation: weight of the soft loss."))
    epochs: int = field(default=3, metadata=option("--epochs", basic=("distill",), help="Distillation / QAT epochs."))
    lr: float = field(default=1e-3, metadata=option(
        "--lr", commands=("distill",), basic=True, help="Learning rate (cosine decay to 0 over the run)."))
    batch_size: int = field(default=64, metadata=option("--batch-size", commands=("distill",), help="Batch size."))
    feature_loss: bool = field(default=False, metadata=option(
        "--feature-loss/--no-feature-loss", commands=("distill",),
        help="Also match the features entering the output layer."))
    feature_weight: float = 1.0
    seed: int = field(default=0, metadata=option(
        "--seed", commands=("distill",), help="Seed of the shuffles and the validation split."))
    patience: int | None = field(default=2, metadata=option(
        "--patience", commands=("distill",), help="Early stop after N epochs without improvement."))
    max_steps: int | None = field(default=None, metadata=option(
        "--max-steps", commands=("distill",), help="Cap on optimizer steps."))
    limit: int | None = field(default=None, metadata=option(
        "--train-samples", commands=("distill",), deprecated=("--limit",),
        help="Use only this many training samples/windows."))
    val_fraction: float = 0.1
    seqlen: int = field(default=128, metadata=option(
        "--seqlen", help="Token window for language models: calibration (GPTQ/AWQ) and distillation."))
    eval_limit: int | None = 2000
    schedule: str = "cosine"

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise BadInputError(f"temperature must be > 0, got {self.temperature}")
        if not 0 <= self.alpha <= 1:
            raise BadInputError(f"alpha (weight of the soft loss) must be in [0, 1], got {self.alpha}")
        if self.epochs < 1:
            raise BadInputError(f"epochs must be >= 1, got {self.epochs}")
        if not self.lr > 0:
            raise BadInputError(f"learning rate must be > 0, got {self.lr}")
        if self.batch_size < 1:
            raise BadInputError(f"batch size must be >= 1, got {self.batch_size}")
        if self.patience is not None and self.patience < 1:
            raise BadInputError(f"patience must be >= 1 (or None), got {self.patience}")
        if self.max_steps is not None and self.max_steps < 1:
            raise BadInputError(f"max steps must be >= 1, got {self.max_steps}")
        if not 0 < self.val_fraction < 0.5:
            raise BadInputError(f"validation fraction must be in (0, 0.5), got {self.val_fraction}")
        if self.schedule not in ("constant", "cosine"):
            raise BadInputError(f"unknown learning-rate schedule {self.schedule!r} (choose from 'constant', 'cosine')")
        if self.seqlen < 2:
            raise BadInputError(f"seqlen must be >= 2, got {self.seqlen}")
