"""Command-line options declared once: on the fields of the config dataclasses they set.

A field becomes a flag through its metadata::

    group_size: int = field(default=128, metadata=option("--group-size", help="Weight-only: group size."))

The flag's type comes from the field's annotation (``int``, ``float``, ``str``; ``X | None``
as ``X``; ``tuple[X, ...]`` as a repeatable flag, or one value split on ``sep``; a ``bool``
as an ``--on/--off`` pair). A flag the user does not give stays unset, so the config keeps
its own default, which the help shows. Recipes name the same fields, so an option has one
declaration: its type, default, help, choices and whether ``--help`` shows it (``basic``)
or only ``--help-all``.

A command is built from named configs (``[("options", BuildOptions), ("extra",
BuildExtras)]``); a flag that several of them declare (``--warmup-ms`` of a profile and of
its generation metrics) sets the field in each, and one of those fields carries the help
text. ``commands`` limits a flag to some of the commands built from its config (a
distillation field that ``edgekit distill`` offers but ``edgekit compress`` does not).
``deprecated`` names a flag's old names, still accepted for one release with a warning;
``old_choices`` a choice flag's old values (a renamed step), accepted and left to the config to map.

This module is light (no numpy, torch or ONNX): the command line reads the options' help from a
cache of these descriptions (``help_options``), so that ``--help`` imports no config module.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.paths import cache_path
from edgekit.version import __version__

OPTION = "edgekit.option"  # the metadata key of a field's flag
VALUE_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class Flag:
    """The flag of one config field. ``decls``: click's declarations (``"--bits"``,
    ``"--sym/--asym"``, a short ``"-b"``); ``when``: the field is set only when the config's
    other options have these values (``{"method": ("qat",)}``); ``selects``: giving the flag
    puts its step in a compress chain; ``commands``: the commands that offer it (empty:
    every command built from the config); ``basic``: shown by ``--help`` (else by
    ``--help-all`` only), in every command or in those named; ``deprecated``: old names that still work, with a warning;
    ``choices``: the valid values; ``sep``: a tuple field given as one value split on it
    (``--prompt-lengths 128,512``); ``show_default``: False where the field's default is not
    what leaving the flag out means (``--bits``: without it nothing is quantized); ``bounds``:
    (low, high) that the command line checks as it parses (the config checks again);
    ``old_choices``: old values the flag still takes besides ``choices``, not shown in the help:
    the config maps them to the current value, with a warning (``int4`` for ``weight-only``)."""

    decls: tuple[str, ...]
    help: str = ""
    selects: bool = False
    when: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    commands: tuple[str, ...] = ()
    basic: bool | tuple[str, ...] = False
    deprecated: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    sep: str = ""
    metavar: str = ""
    show_default: bool = True
    bounds: tuple[float, float] | None = None
    old_choices: tuple[str, ...] = ()


def option(*decls: str, help: str = "", selects: bool = False,  # noqa: A002 (click's name)
           when: Mapping[str, Sequence[Any]] | None = None, commands: Sequence[str] = (),
           basic: bool | Sequence[str] = False,
           deprecated: Sequence[str] = (), choices: Sequence[str] = (), sep: str = "",
           metavar: str = "", show_default: bool = True,
           bounds: tuple[float, float] | None = None, old_choices: Sequence[str] = ()) -> dict[str, Flag]:
    """Field metadata that makes the field a command-line flag.

    >>> option("--group-size", help="Weight-only: group size.")[OPTION].decls
    ('--group-size',)
    """
    if not decls or not all(d.startswith("-") for d in (*decls, *deprecated)):
        raise ValueError(f"option() takes flag declarations such as '--group-size', got {(*decls, *deprecated)!r}")
    return {OPTION: Flag(tuple(decls), help, selects, {k: tuple(v) for k, v in (when or {}).items()},
                         tuple(commands), basic if isinstance(basic, bool) else tuple(basic), tuple(deprecated), tuple(choices), sep, metavar, show_default, bounds,
                         tuple(old_choices))}


@dataclass(frozen=True)
class ConfigOption:
    """One command-line option and the config fields it sets: ``fields`` is ``(config name,
    field, Flag)`` for each. ``dest``: the name the parsed value goes by (from the long
    flag); ``type``: int, float, str or bool (an --on/--off pair); ``default``: the
    config's default, for the help (None: none to show)."""

    dest: str
    decls: tuple[str, ...]
    help: str
    type: type
    multiple: bool
    fields: tuple[tuple[str, str, Flag], ...]
    default: Any = None
    basic: bool = False
    deprecated: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    sep: str = ""
    metavar: str = ""
    bounds: tuple[float, float] | None = None
    old_choices: tuple[str, ...] = ()

    @property
    def is_pair(self) -> bool:  # an --on/--off pair of a bool field
        return self.type is bool

    def to_dict(self) -> dict[str, Any]:
        """What the help needs, as plain JSON (the fields and their flags stay behind)."""
        return {"dest": self.dest, "decls": list(self.decls), "help": self.help, "type": self.type.__name__,
                "multiple": self.multiple, "default": self.default, "basic": self.basic,
                "deprecated": list(self.deprecated), "choices": list(self.choices), "sep": self.sep,
                "metavar": self.metavar, "bounds": list(self.bounds) if self.bounds else None,
                "old_choices": list(self.old_choices)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ConfigOption:
        """The inverse of ``to_dict``; a malformed entry raises ValueError."""
        strings = ("dest", "help", "type", "sep", "metavar")
        lists = ("decls", "deprecated", "choices", "old_choices")
        if not (all(isinstance(d.get(k), str) for k in strings)
                and all(isinstance(d.get(k), list) and all(isinstance(s, str) for s in d[k]) for k in lists)
                and isinstance(d.get("multiple"), bool) and isinstance(d.get("basic"), bool)
                and d["type"] in VALUE_TYPES and d["decls"]
                and (d.get("default") is None or isinstance(d["default"], (bool, int, float, str, list)))
                and (d.get("bounds") is None or (isinstance(d["bounds"], list) and len(d["bounds"]) == 2
                                                 and all(isinstance(b, (int, float)) for b in d["bounds"])))):
            raise ValueError(f"not an option description: {d!r}")
        default = tuple(d["default"]) if isinstance(d["default"], list) else d["default"]
        return cls(d["dest"], tuple(d["decls"]), d["help"], VALUE_TYPES[d["type"]], d["multiple"], (), default,
                   d["basic"], tuple(d["deprecated"]), tuple(d["choices"]), d["sep"], d["metavar"],
                   (d["bounds"][0], d["bounds"][1]) if d.get("bounds") else None, tuple(d["old_choices"]))


def field_flags(config: type) -> list[tuple[str, Flag, Any]]:
    """The flagged fields of a config dataclass: (field name, Flag, resolved annotation)."""
    hints = typing.get_type_hints(config)  # resolves the string annotations of `from __future__ import annotations`
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


def _field_default(config: type, name: str) -> Any:
    """A field's default as the help shows it (None where it has none to show)."""
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    value = f.default
    if isinstance(value, tuple):
        return value if value and all(isinstance(v, (int, float, str)) for v in value) else None
    return value if isinstance(value, (bool, int, float, str)) else None


def config_options(configs: Iterable[tuple[str, type]], command: str) -> list[ConfigOption]:
    """The options of ``command`` that the ``configs`` (name, config class) declare, in that
    order (each where the field with its help text is), one per flag however many configs
    share it.

    >>> from edgekit.profiling import ProfileConfig
    >>> [o.dest for o in config_options([("profile", ProfileConfig)], "profile")][:2]
    ['warmup_ms', 'duration_s']
    """
    configs = list(configs)
    found: dict[str, list[tuple[str, str, Flag, type, bool, Any]]] = {}
    flagged: list[tuple[str, str]] = []
    for name, config in configs:
        for field_name, flag, tp in field_flags(config):
            if flag.commands and command not in flag.commands:
                continue
            where = f"{name}.{field_name} ({', '.join(flag.decls)})"
            kind, multiple = _flag_type(tp, where)
            if kind is bool and not any("/" in d for d in flag.decls):
                raise TypeError(f"{where}: a bool field's flag is an '--on/--off' pair, so that unset stays unset")
            if flag.sep and not multiple:
                raise TypeError(f"{where}: sep splits a value into a tuple field; this field is not one")
            if kind is bool and flag.deprecated:
                raise TypeError(f"{where}: an --on/--off pair has no deprecated names")
            # a flag that selects its step has no default: without it the step does not run
            default = _field_default(config, field_name) if flag.show_default and not flag.selects else None
            found.setdefault(_dest(flag.decls), []).append((name, field_name, flag, kind, multiple, default))
            flagged.append((name, field_name))
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
        flag = uses[first][2]
        defaults = {repr(u[5]) for u in uses}
        default = uses[first][5] if len(defaults) == 1 else None  # shared flags whose defaults differ show none
        options.append((uses[first], ConfigOption(
            dest, uses[0][2].decls, next(iter(helps), ""), kind, multiple, tuple((u[0], u[1], u[2]) for u in uses),
            default, any(_basic_in(u[2], command) for u in uses), flag.deprecated, flag.choices, flag.sep,
            flag.metavar, flag.bounds, flag.old_choices)))
    # each option where its help text is declared (configs in the order given, then field order)
    order = {key: i for i, key in enumerate(flagged)}
    return [o for u, o in sorted(options, key=lambda t: order[(t[0][0], t[0][1])])]


def _basic_in(flag: Flag, command: str) -> bool:
    return flag.basic if isinstance(flag.basic, bool) else command in flag.basic


def _dest(decls: Sequence[str]) -> str:
    longs = [d.split("/")[0] for d in decls if d.startswith("--")] or [decls[0].split("/")[0]]
    return longs[0].lstrip("-").replace("-", "_")


def config_values(options: Sequence[ConfigOption], values: Mapping[str, Any], config: str,
                  base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The fields of the config named ``config`` set by the given flag ``values`` (by
    ``dest``; None or an empty tuple: not given), added to ``base`` (what the caller set
    itself)."""
    out = dict(base or {})
    for conditional in (False, True):  # a field set "when" others have some value: after those
        for o in options:
            value = values.get(o.dest)
            if value is None or value == ():
                continue
            for name, field_name, flag in o.fields:
                if name == config and bool(flag.when) == conditional and \
                        all(out.get(k) in v for k, v in flag.when.items()):
                    out[field_name] = tuple(value) if o.multiple else value
    return out


# --- the help's cache: what --help shows, without importing the configs (torch, ONNX) ---

def options_fingerprint() -> str:
    """Changes whenever edgekit's code may have changed its options: the version and every
    source file's size and modification time (what Python's own bytecode cache trusts)."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        try:
            st = path.stat()
        except OSError:
            continue
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _install_key() -> str:
    """Which installed edgekit a cache belongs to (several may share one cache folder)."""
    return hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]


def _help_cache_file() -> Path:
    return cache_path() / "cli" / f"options-{_install_key()}-{options_fingerprint()}.json"


def cached_help_options() -> dict[str, list[ConfigOption]] | None:
    """Every generated command's options (command -> options) from the help cache of this
    edgekit's code; None when it is missing, stale or damaged."""
    try:
        doc = json.loads(_help_cache_file().read_text(encoding="utf-8"))
        if isinstance(doc, dict):
            return {str(k): [ConfigOption.from_dict(d) for d in v] for k, v in doc.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # missing, stale or damaged: generate it again
    return None


def help_options(generate: Callable[[], Mapping[str, Sequence[ConfigOption]]]) -> dict[str, list[ConfigOption]]:
    """Every generated command's options (command -> options) for its help: read from the
    cache of this edgekit's code, else ``generate``d (importing the configs, once) and cached.
    A cache that cannot be read or written only costs the import."""
    cached = cached_help_options()
    if cached is not None:
        return cached
    path = _help_cache_file()
    folder, install = path.parent, _install_key()
    options = {k: list(v) for k, v in generate().items()}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({k: [o.to_dict() for o in v] for k, v in options.items()}), encoding="utf-8")
        os.replace(tmp, path)
        for old in folder.glob(f"options-{install}-*.json"):  # this install's earlier code (not other installs')
            if old != path:
                old.unlink(missing_ok=True)
    except OSError:
        pass
    return options
