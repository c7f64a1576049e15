"""What ``edgekit finetune`` is asked besides the LoRA training itself (``LoraConfig``):
``FinetuneOptions``, whose fields declare its flags (``edgekit.options``);
``finetune.finetune`` takes the same values as keywords. Light (no PyTorch or ONNX): the
command line reads it to build its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgekit.compress import INT8_STEP, STEP_ALIASES, WEIGHT_ONLY_STEP, canonical_step
from edgekit.errors import BadInputError
from edgekit.options import option
from edgekit.schema import check_fields

REQUANT_STEPS = (WEIGHT_ONLY_STEP, INT8_STEP)  # the compress steps that re-quantize a merged model
OLD_REQUANT_STEPS = tuple(old for old, new in STEP_ALIASES.items() if new in REQUANT_STEPS)  # still taken, warned


@dataclass(frozen=True)
class FinetuneOptions:
    """Re-quantization after the merge, and resuming.

    requant: the compress step that re-quantizes the merged float model (None: keep it float).
    bits / method / group_size: that step's fields (``bits`` and ``group_size``: weight-only only).
    resume: continue from the checkpoint in ``OUT.work`` when it matches this run.
    """

    requant: str | None = field(default=None, metadata=option(
        "--requant", choices=REQUANT_STEPS, old_choices=OLD_REQUANT_STEPS,
        help="Re-quantize the merged float model with this compress step."))
    bits: int | None = field(default=None, metadata=option(
        "--bits", help=f"--requant {WEIGHT_ONLY_STEP}: bit width (default 4)."))
    method: str | None = field(default=None, metadata=option(
        "--method", help=f"--requant {WEIGHT_ONLY_STEP}: gptq-plus | gptq | awq | awq-gptq | rtn; --requant {INT8_STEP}: ptq."))
    group_size: int | None = field(default=None, metadata=option(
        "--group-size", help=f"--requant {WEIGHT_ONLY_STEP}: group size."))
    resume: bool = field(default=True, metadata=option(
        "--resume/--fresh", help="Continue from OUT.work's checkpoint if it matches (--fresh: start over)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.requant is not None:  # an old step name ("int4"): the current one, with a warning
            object.__setattr__(self, "requant", canonical_step(self.requant, where="--requant"))
        if self.requant is not None and self.requant not in REQUANT_STEPS:
            raise BadInputError(f"unknown re-quantization step {self.requant!r} (choose from "
                                f"{', '.join(REQUANT_STEPS)})")
        weight_only = [f"--{n.replace('_', '-')}" for n in ("bits", "group_size") if getattr(self, n) is not None]
        if weight_only and self.requant != WEIGHT_ONLY_STEP:
            raise BadInputError(f"{' and '.join(weight_only)} set the weight-only re-quantization: give --requant "
                                f"{WEIGHT_ONLY_STEP}")
        if self.method is not None and self.requant is None:
            raise BadInputError(f"--method chooses the re-quantization's method: give --requant "
                                f"({' or '.join(REQUANT_STEPS)})")

    def requant_config(self) -> dict[str, Any]:
        """The re-quantization step's fields that were given (the others keep the step's defaults)."""
        given = {"bits": self.bits, "method": self.method, "group_size": self.group_size}
        return {k: v for k, v in given.items() if v is not None}
