"""LoRA / QLoRA options: ``LoraConfig``."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.options import option
from edgekit.schema import check_fields

QLORA_BASES = ("packed", "nf4")


def _flag(*decls: str, **kwargs: Any) -> dict[str, Any]:
    """A flag of `edgekit finetune` only."""
    return option(*decls, commands=("finetune",), **kwargs)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA / QLoRA fine-tuning options (validated on construction).

    r, alpha, dropout: adapter rank, scale numerator (scale = alpha / r) and input dropout.
    targets: module names to adapt: a full name, a name suffix (``q_proj`` matches every
        ``...q_proj``) or a regular expression; empty = the defaults for the model kind.
    qlora: train over a frozen 4-bit base; qlora_base: "packed" (edgekit's weight-only model) or
        "nf4" (bitsandbytes, from a float model).
    steps / epochs: training length (steps wins; neither = 1 epoch). lr, batch_size,
        weight_decay, grad_clip, warmup_steps: AdamW with linear warm-up then cosine decay
        to 10% of lr.
    seqlen, train_samples, eval_samples: text window length and how many windows to use
        (None = all); eval_samples also bounds the validation split.
    merge: fold the adapters into the weights (None = the base's default: float and nf4
        merge, packed keeps them beside the 4-bit weights; see ``edgekit.compress.lora``).
    checkpoint_every: steps between checkpoints in the step's work folder (0: only at the
        end of an epoch and on Ctrl-C).
    """

    # flags of `edgekit finetune` (lora is also a compress step, which has no flags of its own)
    r: int = field(default=8, metadata=_flag("--lora-r", basic=True, help="Adapter rank."))
    alpha: float = field(default=16.0, metadata=_flag("--lora-alpha", help="Scale numerator (scale = alpha / r)."))
    dropout: float = field(default=0.05, metadata=_flag("--lora-dropout", help="Dropout on the adapters' input."))
    targets: tuple[str, ...] = field(default=(), metadata=_flag(
        "--targets", sep=",", metavar="NAME,...", help="Comma-separated module names, suffixes or regexes "
        "(default: q/k/v/o/gate/up/down for transformers, every Linear/Conv2d otherwise)."))
    qlora: bool = field(default=False, metadata=_flag(
        "--qlora/--no-qlora", basic=True, help="Train adapters over a frozen 4-bit base (the output of compress "
        "--bits 4)."))
    qlora_base: str = field(default="packed", metadata=_flag(
        "--qlora-base", choices=QLORA_BASES, help="packed: edgekit's weight-only model; nf4: bitsandbytes NF4 from a float "
        "model."))
    steps: int | None = field(default=None, metadata=_flag("--steps", help="Training steps (instead of --epochs)."))
    epochs: int | None = field(default=None, metadata=_flag(
        "--epochs", basic=True, help="Training epochs (default 1 when --steps is not given)."))
    lr: float = field(default=2e-4, metadata=_flag("--lr", basic=True, help="Peak learning rate (AdamW)."))
    batch_size: int = field(default=4, metadata=_flag("--batch-size", help="Batch size."))
    weight_decay: float = field(default=0.0, metadata=_flag("--weight-decay", help="AdamW weight decay."))
    grad_clip: float = field(default=1.0, metadata=_flag("--grad-clip", help="Gradient norm clip (0: none)."))
    warmup_steps: int = field(default=0, metadata=_flag("--warmup-steps", help="Linear warm-up steps."))
    seqlen: int = field(default=256, metadata=_flag("--seqlen", help="Token window for language models."))
    train_samples: int | None = field(default=None, metadata=_flag(
        "--train-samples", help="Use only this many training samples/windows."))
    eval_samples: int | None = field(default=32, metadata=_flag("--eval-samples", help="Validation samples/windows."))
    merge: bool | None = field(default=None, metadata=_flag(
        "--merge/--no-merge", help="Fold adapters into the weights (default: yes for float and nf4; no for a packed "
        "base, whose adapters export as MatMuls beside MatMulNBits)."))
    checkpoint_every: int = field(default=50, metadata=_flag(
        "--checkpoint-every", help="Steps between checkpoints (0: only at the end of an epoch and on Ctrl-C)."))

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t for t in re.split(r"[,\s]+", self.targets) if t))
        else:
            object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise BadInputError(f"LoRA rank must be a positive integer, got {self.r!r} (e.g. --lora-r 8)")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise BadInputError(f"LoRA alpha must be positive, got {self.alpha!r} (e.g. --lora-alpha 16)")
        if not 0.0 <= self.dropout < 1.0:
            raise BadInputError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.qlora_base not in QLORA_BASES:
            raise bad_choice("QLoRA base", self.qlora_base, QLORA_BASES)
        for name in ("steps", "epochs", "train_samples", "eval_samples"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise BadInputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.steps is not None and self.epochs is not None:
            raise BadInputError(f"give --steps ({self.steps}) or --epochs ({self.epochs}), not both")
        if not self.lr > 0:
            raise BadInputError(f"learning rate must be positive, got {self.lr!r} (e.g. --lr 2e-4)")
        for name in ("batch_size", "seqlen"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise BadInputError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.weight_decay < 0 or self.grad_clip < 0 or self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise BadInputError("weight_decay, grad_clip, warmup_steps and checkpoint_every must be >= 0")
        if self.qlora and self.qlora_base == "nf4" and self.merge is False:
            raise BadInputError("--qlora-base nf4 always merges into float weights (bitsandbytes layers do not "
                                "save or export); use --merge, or --qlora-base packed to keep a 4-bit base")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.r
