"""The integer grid every weight-only method rounds to (``GridConfig``), the base of the
per-method configs (``RtnConfig``, ``GptqConfig``, ``AwqConfig``), and its checks. Light (no
PyTorch): ``WeightOnlyConfig`` checks its own fields with the same functions.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgekit.errors import BadInputError
from edgekit.export.config import SUPPORTED_BITS
from edgekit.schema import check_fields


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise BadInputError(f"unsupported bit width {bits!r} (choose from {', '.join(map(str, SUPPORTED_BITS))})")


def check_group_size(group_size: int) -> None:
    gs = group_size
    if not (gs == -1 or (isinstance(gs, int) and gs >= 16 and gs & (gs - 1) == 0)):
        raise BadInputError(f"unsupported group size {gs!r} (choose -1 for per-channel, or a power of two "
                            "from 16: 16, 32, 64, 128, 256, ...)")


@dataclass(frozen=True)
class GridConfig:
    """bits: 2, 3, 4 or 8. group_size: input columns per scale and zero point (a power of two
    >= 16; -1: one per output channel). sym: symmetric grid (zero point ``2**(bits-1)``)."""

    bits: int = 4
    group_size: int = 128
    sym: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        check_bits(self.bits)
        check_group_size(self.group_size)
