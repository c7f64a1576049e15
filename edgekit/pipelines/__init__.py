"""Pipelines: multi-stage recipes, per-stage budgets, cached runs, sweeps and reports."""
from edgekit.pipelines.recipe import Recipe, StageSpec, load_recipe, parse_recipe

__all__ = ["Recipe", "StageSpec", "load_recipe", "parse_recipe"]
