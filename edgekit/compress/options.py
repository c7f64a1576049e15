"""A step's command-line options, declared once: on the fields of its config dataclass
(``edgekit.options``, where every command's options are declared the same way).

A field becomes a flag of ``edgekit compress`` through its metadata::

    group_size: int = field(default=128, metadata=option("--group-size", help="Weight-only: group size."))

A flag the user does not give stays unset, so the config keeps its own default. Recipes name
the same fields (``{"weight-only": {"group_size": 64}}``), so an option has one declaration.

A flag that several steps declare (``--calib-samples``, ``--epochs``, ``--seqlen``) sets the
field in each step of the chain that has it; one of those fields carries the help text.
``selects=True`` marks the flag that puts its step in the chain (``--prune RATIO``): given,
the step runs with that value. A field whose flag names other ``commands`` (``edgekit
distill``'s ``--lr``) is no flag of ``compress``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from edgekit.compress import STEPS, config_class
from edgekit.options import OPTION, ConfigOption, Flag, config_options, config_values, field_flags, option
from edgekit.schema import check_fields

COMMAND = "compress"

StepOption = ConfigOption  # one option of `edgekit compress` and the step fields it sets
step_values = config_values

__all__ = ["COMMAND", "OPTION", "CompressOptions", "Flag", "StepOption", "compress_options", "field_flags", "option",
           "step_options", "step_values"]


@dataclass(frozen=True)
class CompressOptions:
    """What ``edgekit compress`` is asked besides the steps' own fields: the choices no single
    step owns (``compress_from_flags`` takes them as keywords).

    distill: after pruning, distill the pruned model from its unpruned self (adds the distill step).
    accept_quality_loss: write the model even when its quality is beyond the sanity bound.
    max_ppl_ratio: the quality gate's perplexity bound against the float model (None: the chain's).
    """

    distill: bool = field(default=False, metadata=option(
        "--distill/--no-distill", basic=True, help="After pruning, distill from the unpruned model."))
    accept_quality_loss: bool = field(default=False, metadata=option(
        "--accept-quality-loss/--no-accept-quality-loss",
        help="Write the model even when its quality against the float model is beyond the sanity bound (default: "
             "exit 1, nothing written)."))
    max_ppl_ratio: float | None = field(default=None, metadata=option(
        "--max-ppl-ratio",
        help="Quality gate: the compressed model's perplexity may be at most this many times the float model's "
             "(default 1.5 at 4 bits, 1.1 at 8 bits)."))

    def __post_init__(self) -> None:
        check_fields(self)


def step_options(steps: Iterable[tuple[str, type]]) -> list[StepOption]:
    """The ``edgekit compress`` options that the configs of ``steps`` (name, config class)
    declare, in that order (each where the field with its help text is), one per flag however
    many steps share it.

    >>> from edgekit.compress.prune import PruneConfig
    >>> [o.dest for o in step_options([("prune", PruneConfig)])][:2]
    ['prune', 'importance']
    """
    return config_options(steps, COMMAND)


def compress_options() -> list[StepOption]:
    """The options of the registered steps' configs: the step flags of ``edgekit compress``,
    from the configs' light modules (``STEP_CONFIGS``: no step, and no torch, is imported)."""
    return step_options((name, config_class(name)) for name in STEPS)
