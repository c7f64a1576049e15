"""LoRA / QLoRA options: ``LoraConfig``."""
from __future__ import annotations

import re
from dataclasses import dataclass

from edgekit.errors import BadInputError, bad_choice
from edgekit.schema import check_fields

QLORA_BASES = ("packed", "nf4")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA / QLoRA fine-tuning options (validated on construction).

    r, alpha, dropout: adapter rank, scale numerator (scale = alpha / r) and input dropout.
    targets: module names to adapt: a full name, a name suffix (``q_proj`` matches every
        ``...q_proj``) or a regular expression; empty = the defaults for the model kind.
    qlora: train over a frozen 4-bit base; qlora_base: "packed" (edgekit's int4 model) or
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

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ()
    qlora: bool = False
    qlora_base: str = "packed"
    steps: int | None = None
    epochs: int | None = None
    lr: float = 2e-4
    batch_size: int = 4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_steps: int = 0
    seqlen: int = 256
    train_samples: int | None = None
    eval_samples: int | None = 32
    merge: bool | None = None
    checkpoint_every: int = 50

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
