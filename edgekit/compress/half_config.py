"""The options of the "half" step (weights stored as float16 or bfloat16), in a module that
imports no PyTorch: the command line builds ``edgekit compress``'s flags from ``HalfConfig``
without loading the step (``half.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.compress.options import option
from edgekit.errors import bad_choice
from edgekit.schema import check_fields

DTYPES = ("fp16", "bf16")  # float16, bfloat16


@dataclass(frozen=True)
class HalfConfig:
    """dtype: "fp16" (float16) or "bf16" (bfloat16), the storage of the cast layers' weights
    and biases."""

    dtype: str = field(default="fp16", metadata=option(
        "--precision", selects=True, basic=True, deprecated=("--half",),
        help="Store the weights of linear, conv and embedding layers as fp16 | bf16 (norms stay float32)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dtype not in DTYPES:
            raise bad_choice("half-precision type", self.dtype, DTYPES)
