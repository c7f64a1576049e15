"""A step's command-line options, declared once: on the fields of its config dataclass
(``edgekit.options``, where every command's options are declared the same way).

A field becomes a flag of ``edgekit compress`` through its metadata::

    group_size: int = field(default=128, metadata=option("--group-size", help="Weight-only: group size."))

A flag the user does not give stays unset, so the config keeps its own default. Recipes name
the same fields (``{"int4": {"group_size": 64}}``), so an option has one declaration.

A flag that several steps declare (``--calib-samples``, ``--epochs``, ``--seqlen``) sets the
field in each step of the chain that has it; one of those fields carries the help text.
``selects=True`` marks the flag that puts its step in the chain (``--prune RATIO``): given,
the step runs with that value. A field whose flag names other ``commands`` (``edgekit
distill``'s ``--lr``) is no flag of ``compress``.
"""
from __future__ import annotations

from collections.abc import Iterable

from edgekit.options import OPTION, ConfigOption, Flag, config_options, config_values, field_flags, option

COMMAND = "compress"

StepOption = ConfigOption  # one option of `edgekit compress` and the step fields it sets
step_values = config_values

__all__ = ["COMMAND", "OPTION", "Flag", "StepOption", "field_flags", "option", "step_options", "step_values"]


def step_options(steps: Iterable[tuple[str, type]]) -> list[StepOption]:
    """The ``edgekit compress`` options that the configs of ``steps`` (name, config class)
    declare, in that order (each where the field with its help text is), one per flag however
    many steps share it.

    >>> from edgekit.compress.prune import PruneConfig
    >>> [o.dest for o in step_options([("prune", PruneConfig)])][:2]
    ['prune', 'importance']
    """
    return config_options(steps, COMMAND)
