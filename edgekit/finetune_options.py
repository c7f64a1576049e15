"""What ``edgekit finetune`` is asked besides the LoRA training itself (``LoraConfig``):
``FinetuneOptions``, whose fields declare its flags (``edgekit.options``);
``finetune.finetune`` takes the same values as keywords. Light (no PyTorch or ONNX): the
command line reads it to build its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgekit.errors import BadInputError
from edgekit.options import option
from edgekit.schema import check_fields

# the steps that re-quantize a merged model (edgekit.compress's registry names them; checked
# against it by tests/test_finetune_options.py so that the two cannot drift)
REQUANT_STEPS = ("int4", "int8")


@dataclass(frozen=True)
class FinetuneOptions:
    """Re-quantization after the merge, and resuming.

    requant: the compress step that re-quantizes the merged float model (None: keep it float).
    bits / method / group_size: that step's fields (``bits`` and ``group_size``: the 4-bit step only).
    resume: continue from the checkpoint in ``OUT.work`` when it matches this run.
    """

    requant: str | None = field(default=None, metadata=option(
        "--requant", choices=REQUANT_STEPS, help="Re-quantize the merged float model with this compress step."))
    bits: int | None = field(default=None, metadata=option(
        "--bits", help="--requant int4: bit width (default 4)."))
    method: str | None = field(default=None, metadata=option(
        "--method", help="--requant int4: gptq | awq | rtn; --requant int8: ptq."))
    group_size: int | None = field(default=None, metadata=option(
        "--group-size", help="--requant int4: group size."))
    resume: bool = field(default=True, metadata=option(
        "--resume/--fresh", help="Continue from OUT.work's checkpoint if it matches (--fresh: start over)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.requant is not None and self.requant not in REQUANT_STEPS:
            raise BadInputError(f"unknown re-quantization step {self.requant!r} (choose from "
                                f"{', '.join(REQUANT_STEPS)})")
        four_bit = [f"--{n.replace('_', '-')}" for n in ("bits", "group_size") if getattr(self, n) is not None]
        if four_bit and self.requant != REQUANT_STEPS[0]:
            raise BadInputError(f"{' and '.join(four_bit)} set the 4-bit re-quantization: give --requant "
                                f"{REQUANT_STEPS[0]}")
        if self.method is not None and self.requant is None:
            raise BadInputError(f"--method chooses the re-quantization's method: give --requant "
                                f"({' or '.join(REQUANT_STEPS)})")

    def requant_config(self) -> dict[str, Any]:
        """The re-quantization step's fields that were given (the others keep the step's defaults)."""
        given = {"bits": self.bits, "method": self.method, "group_size": self.group_size}
        return {k: v for k, v in given.items() if v is not None}
