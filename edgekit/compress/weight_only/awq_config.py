"""What AWQ reads (``awq.py``: ``awq_visit``), beside the grid; with GPTQ's config for AWQ+GPTQ.
Light (no PyTorch); ``WeightOnlyConfig`` builds this from its own fields.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgekit.compress.weight_only.gptq_config import GptqConfig
from edgekit.compress.weight_only.grid_config import GridConfig
from edgekit.errors import BadInputError


@dataclass(frozen=True)
class AwqConfig(GridConfig):
    """awq_grid: points of the scale-exponent search. awq_clip: search each group's clipping
    range (plain AWQ). then_gptq: AWQ+GPTQ, GPTQ (with this config, its own grid) instead of clip
    search and rounding on the scaled weights; None: plain AWQ.

    >>> AwqConfig(awq_grid=10).then_gptq is None
    True
    """

    awq_grid: int = 20
    awq_clip: bool = True
    then_gptq: GptqConfig | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.awq_grid < 1:
            raise BadInputError(f"awq_grid must be at least 1, got {self.awq_grid!r}")
