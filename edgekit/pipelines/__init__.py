"""Pipelines: multi-stage recipes, per-stage budgets, cached runs, sweeps and reports.

The names below are imported on first use: the command line reads ``sweep_options`` to build
its flags without PyTorch or ONNX.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgekit.pipelines.recipe import Recipe as Recipe
    from edgekit.pipelines.recipe import StageSpec as StageSpec
    from edgekit.pipelines.recipe import load_recipe as load_recipe
    from edgekit.pipelines.recipe import parse_recipe as parse_recipe

__all__ = ["Recipe", "StageSpec", "load_recipe", "parse_recipe"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("edgekit.pipelines.recipe"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
