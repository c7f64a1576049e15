"""What GPTQ reads (``gptq.py``: ``gptq_visit``, ``solve_group``), beside the grid. Light (no
PyTorch); ``WeightOnlyConfig`` documents each option and builds this from its own fields.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgekit.compress.weight_only.grid_config import GridConfig
from edgekit.errors import BadInputError, bad_choice

VALUE_HESSIANS = ("attention", "input")


@dataclass(frozen=True)
class GptqConfig(GridConfig):
    """act_order / static_groups / damp / block_size: the reference's options. mse_grid: fit
    each group's range by an error search (None: with groups, not per channel). refit: re-solve
    the group scales once the codes are fixed. gptaq_alpha: how far each layer matches the float
    model's output (GPTAQ; 0: the paper's GPTQ). value_hessian / value_query_stride: the Hessian
    of attention value projections ("attention": from ``P X``; "input": the paper's ``X``).

    >>> GptqConfig(group_size=-1).grid_search, GptqConfig().grid_search
    (False, True)
    """

    act_order: bool = True
    static_groups: bool = False
    damp: float = 0.01
    block_size: int = 128
    mse_grid: bool | None = None
    refit: bool = True
    gptaq_alpha: float = 0.25
    value_hessian: str = "attention"
    value_query_stride: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gptq(self.damp, self.gptaq_alpha, self.block_size, self.value_hessian, self.value_query_stride)

    @property
    def grid_search(self) -> bool:
        """Whether each group's range is searched (``mse_grid``, resolved for the group size)."""
        return self.group_size != -1 if self.mse_grid is None else self.mse_grid


def check_gptq(damp: float, gptaq_alpha: float, block_size: int, value_hessian: str, value_query_stride: int) -> None:
    """GPTQ's range checks (``WeightOnlyConfig`` makes them too, for every method it is given)."""
    if not 0 <= damp < 1:
        raise BadInputError(f"damp must be in [0, 1), got {damp!r}")
    if not 0 <= gptaq_alpha <= 1:
        raise BadInputError(f"gptaq_alpha must be in [0, 1], got {gptaq_alpha!r}")
    if block_size < 1:
        raise BadInputError(f"block_size must be positive, got {block_size!r}")
    if value_hessian not in VALUE_HESSIANS:
        raise bad_choice("value-projection Hessian", value_hessian, VALUE_HESSIANS)
    if value_query_stride < 1:
        raise BadInputError(f"value_query_stride must be at least 1, got {value_query_stride!r}")
