"""What round-to-nearest reads: the grid alone (``rtn.py`` rounds each group to it)."""
from __future__ import annotations

from dataclasses import dataclass

from edgekit.compress.weight_only.grid_config import GridConfig


@dataclass(frozen=True)
class RtnConfig(GridConfig):
    """Round-to-nearest onto the grid (``GridConfig``): no calibration, no option of its own.

    >>> RtnConfig(bits=3, group_size=32).bits
    3
    """
