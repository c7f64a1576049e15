"""A step's command-line options, declared once: on the fields of its config dataclass.

A field becomes a flag of ``edgekit compress`` through its metadata::

    group_size: int = field(default=128, metadata=option("--group-size", help="Weight-only: group size."))

The flag's type comes from the field's annotation (``int``, ``float``, ``str``; ``X | None``
as ``X``; ``tuple[str, ...]`` as a repeatable flag; a ``bool`` as an ``--on/--off`` pair). A
flag the user does not give stays unset, so the config keeps its own default. Recipes name
the same fields (``{"int4": {"group_size": 64}}``), so an option has one declaration.

A flag that several steps declare (``--calib-samples``, ``--epochs``, ``--seqlen``) sets the
field in each step of the chain that has it; one of those fields carries the help text.
``selects=True`` marks the flag that puts its step in the chain (``--prune RATIO``): given,
the step runs with that value.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgekit.schema import type_hints

OPTION = "edgekit.option"  # the metadata key of a field's flag


@dataclass(frozen=True)
class Flag:
    """The flag of one config field. ``decls``: click's declarations (``"--bits"``,
    ``"--sym/--asym"``, a short ``"-b"``); ``when``: the field is set only when the step's
    other options have these values (``{"method": ("qat",)}``)."""

    decls: tuple[str, ...]
    help: str = ""
    selects: bool = False
    when: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)


def option(*decls: str, help: str = "", selects: bool = False,  # noqa: A002 (click's name)
           when: Mapping[str, Sequence[Any]] | None = None) -> dict[str, Flag]:
    """Field metadata that makes the field a command-line flag.

    >>> option("--group-size", help="Weight-only: group size.")[OPTION].decls
    ('--group-size',)
    """
    if not decls or not all(d.startswith("-") for d in decls):
        raise ValueError(f"option() takes flag declarations such as '--group-size', got {decls!r}")
    return {OPTION: Flag(tuple(decls), help, selects, {k: tuple(v) for k, v in (when or {}).items()})}


@dataclass(frozen=True)
class StepOption:
    """One command-line option and the step fields it sets: ``fields`` is ``(step, field,
    Flag)`` for each. ``dest``: the name the parsed value goes by (from the long flag)."""

    dest: str
    decls: tuple[str, ...]
    help: str
    type: type
    multiple: bool
    fields: tuple[tuple[str, str, Flag], ...]

    @property
    def is_pair(self) -> bool:  # an --on/--off pair of a bool field
        return self.type is bool


def field_flags(config: type) -> list[tuple[str, Flag, Any]]:
    """The flagged fields of a config dataclass: (field name, Flag, resolved annotation)."""
    hints = type_hints(config)
    return [(f.name, f.metadata[OPTION], hints[f.name]) for f in dataclasses.fields(config) if OPTION in f.metadata]


def _flag_type(tp: Any, where: str) -> tuple[type, bool]:
    """(click value type, repeatable) for a field annotation."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1:
            return _flag_type(members[0], where)
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float, str):
            return args[0], True
    if tp in (bool, int, float, str):
        return tp, False
    raise TypeError(f"{where}: a flag needs an int, float, str, bool or tuple[X, ...] field, not {tp!r}")


def step_options(steps: Iterable[tuple[str, type]]) -> list[StepOption]:
    """The command-line options that the configs of ``steps`` (name, config class) declare, in
    that order (each where the field with its help text is), one per flag however many steps
    share it.

    >>> from edgekit.compress.prune import PruneConfig
    >>> [o.dest for o in step_options([("prune", PruneConfig)])][:2]
    ['prune', 'importance']
    """
    steps = list(steps)
    found: dict[str, list[tuple[str, str, Flag, type, bool]]] = {}
    for name, config in steps:
        for field_name, flag, tp in field_flags(config):
            where = f"{name}.{field_name} ({', '.join(flag.decls)})"
            kind, multiple = _flag_type(tp, where)
            if kind is bool and not any("/" in d for d in flag.decls):
                raise TypeError(f"{where}: a bool field's flag is an '--on/--off' pair, so that unset stays unset")
            found.setdefault(_dest(flag.decls), []).append((name, field_name, flag, kind, multiple))
    options = []
    for dest, uses in found.items():
        decls = {u[2].decls for u in uses}
        kinds = {(u[3], u[4]) for u in uses}
        helps = {u[2].help for u in uses if u[2].help}
        where = ", ".join(f"{u[0]}.{u[1]}" for u in uses)
        if len(decls) > 1 or len(kinds) > 1 or len(helps) > 1:
            raise TypeError(f"the flag of {where} is declared differently (flags {sorted(decls)}, types "
                            f"{sorted(str(k) for k in kinds)}, help texts {sorted(helps)}): declare it alike, "
                            "with the help text on one field")
        first = next((i for i, u in enumerate(uses) if u[2].help), 0)
        (kind, multiple), = kinds
        options.append((first, uses[first], StepOption(dest, uses[0][2].decls, next(iter(helps), ""), kind, multiple,
                                                       tuple((u[0], u[1], u[2]) for u in uses))))
    # each option where its help text is declared (registry order of steps, then field order)
    order = {(n, f): i for i, (n, f) in enumerate((n, f) for n, config in steps for f, _, _ in field_flags(config))}
    return [o for _, u, o in sorted(options, key=lambda t: order[(t[1][0], t[1][1])])]


def _dest(decls: Sequence[str]) -> str:
    longs = [d.split("/")[0] for d in decls if d.startswith("--")] or [decls[0].split("/")[0]]
    return longs[0].lstrip("-").replace("-", "_")


def step_values(options: Sequence[StepOption], values: Mapping[str, Any], step: str,
                base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config fields of ``step`` set by the given flag ``values`` (by ``dest``; None or
    an empty tuple: not given), added to ``base`` (what the plan set itself)."""
    out = dict(base or {})
    for conditional in (False, True):  # a field set "when" others have some value: after those
        for o in options:
            value = values.get(o.dest)
            if value is None or value == ():
                continue
            for name, field_name, flag in o.fields:
                if name == step and bool(flag.when) == conditional and \
                        all(out.get(k) in v for k, v in flag.when.items()):
                    out[field_name] = tuple(value) if o.multiple else value
    return out
