"""Plain data from files (YAML, JSON) checked against the dataclasses that declare it.

A dataclass is the schema of its section, declared once: its field names are the known
keys, its annotations the types. ``from_mapping(cls, data, loc)`` checks a mapping read
from a file (known keys, types, finite numbers) and builds the dataclass, whose
``__post_init__`` checks ranges. ``check_fields(self)``, called first in a config's
``__post_init__``, checks the types of a dataclass built in code. Every error is a
``BadInputError`` whose one line names the path of the bad key and what is valid::

    stage 'backbone' export.opst: unknown option (known: atol, batch, dynamic_batch, ...)
    stage 'backbone' int8.calib_samples: must be an integer, got 'many'

Field metadata refines a field:
  * ``{"schema": Cls}``: the value is kept as a plain mapping but must follow ``Cls``
    (``{"schema": Cls, "each": True}``: a mapping of names to such mappings);
  * ``{"internal": True}``: set in code only, never from a file;
  * ``{"program": "how to name it instead"}``: the value names a program edgekit runs. Data
    never names a program (a recipe would run whatever it says while it is only meant to be
    read): such a key in a file is refused with that hint; code and the command line set it;
  * ``{"from_data": check}``: a value read from a file is also passed to ``check(value)``,
    which raises ``BadInputError`` (ssh options from a recipe: an allow-list).

``read_yaml`` and ``read_json`` read untrusted files: bounded in size and nesting, YAML
without aliases, anchors or tags (a 400-byte alias bomb expands to gigabytes), duplicate
keys refused; every failure is one line naming the file.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import numbers
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, Union

from edgekit.errors import BadInputError


def _is_bool(value: Any) -> bool:
    """A Python or numpy bool. numpy is not imported for this (the command line's option checks run
    without it): a value can only be a numpy bool if numpy is loaded already."""
    np = sys.modules.get("numpy")
    return isinstance(value, bool) or (np is not None and isinstance(value, np.bool_))


T = TypeVar("T")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")

MAX_DEPTH = 32  # nesting of mappings and lists in a YAML file
YAML_MAX_BYTES = 1 << 20  # recipes and target files are hand-written: 1 MiB is plenty
JSON_MAX_BYTES = 64 << 20  # profiles and manifests are written by edgekit


class FieldError(BadInputError):
    """A value of one field is wrong; ``loc`` is where, ``problem`` what."""

    def __init__(self, loc: Loc | str, problem: str) -> None:
        self.loc = loc if isinstance(loc, Loc) else Loc("", loc)
        self.problem = problem
        where = str(self.loc)
        message = f"{where}: {problem}" if where else problem
        super().__init__(" ".join(message.splitlines()))  # one line, whatever the file held

    def __reduce__(self) -> tuple[Any, ...]:  # survives a process pool (sweeps)
        return (type(self), (self.loc, self.problem))


@dataclass(frozen=True)
class Loc:
    """Where a value sits: a context (``stage 'backbone'``, ``profile x.json``) and a key
    path inside it (``export.opst``, ``nodes[3].time_ms``)."""

    context: str = ""
    key: str = ""

    def __truediv__(self, name: str) -> Loc:
        name = name if _PLAIN_KEY.fullmatch(name) else repr(name)  # a key from a file may hold anything
        return Loc(self.context, f"{self.key}.{name}" if self.key else name)

    def at(self, index: int) -> Loc:
        return Loc(self.context, f"{self.key}[{index}]")

    def __str__(self) -> str:
        return " ".join(p for p in (self.context, self.key) if p)


def show(value: object, limit: int = 60) -> str:
    """A value for a message: its repr, cut to ``limit`` characters."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # a deeply nested value, a huge int
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (``from __future__ import annotations``
    makes them strings)."""
    return typing.get_type_hints(cls)


def describe(tp: Any) -> str:
    """``int | None`` -> 'an integer or null', for messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a finite number"
    if tp is str:
        return "a string"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list of {_plural(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} {_plural(args[0])}" if len(set(args)) == 1 else "a list"
    if origin is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict:
        return f"a mapping of names to {_plural(args[1])}" if args and args[1] is not Any else "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    words = {int: "integers", float: "numbers", str: "strings", bool: "booleans", Any: "values"}
    if tp in words:
        return words[tp]
    text = describe(tp)
    return text[2:] + "s" if text.startswith("a ") else text


def check_value(value: Any, tp: Any, loc: Loc) -> Any:
    """``value`` checked against the annotation ``tp``; lists become tuples where the
    annotation says tuple, mappings become dataclasses where it names one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise FieldError(loc, f"must be {describe(tp)}, got null")
        for a in args:
            if a is type(None):
                continue
            try:
                return check_value(value, a, loc)
            except FieldError as e:
                if len([x for x in args if x is not type(None)]) == 1 or e.loc != loc:
                    raise  # one alternative, or the error is inside a nested value: keep its detail
        raise FieldError(loc, f"must be {describe(tp)}, got {show(value)}")
    if tp is type(None):
        if value is not None:
            raise FieldError(loc, f"must be null, got {show(value)}")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise FieldError(loc, f"must be true or false, got {show(value)}")
        return value
    if tp is int:  # numbers.Integral takes numpy integers too; bool is not a count
        if _is_bool(value) or not isinstance(value, numbers.Integral):
            raise FieldError(loc, f"must be an integer, got {show(value)}")
        return value
    if tp is float:
        if _is_bool(value) or not isinstance(value, numbers.Real):
            raise FieldError(loc, f"must be a finite number, got {show(value)}")
        if not math.isfinite(value):
            raise FieldError(loc, f"must be a finite number, got {show(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise FieldError(loc, f"must be a string, got {show(value)} (quote it)" if isinstance(
                value, (int, float)) and not isinstance(value, bool) else f"must be a string, got {show(value)}")
        return value
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] is str and isinstance(value, str):
                return value  # a comma-separated or single name; the config splits it
            if not isinstance(value, (list, tuple)):
                raise FieldError(loc, f"must be {describe(tp)}, got {show(value)}")
            return tuple(check_value(v, args[0], loc.at(i)) for i, v in enumerate(value))
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise FieldError(loc, f"must be {describe(tp)}, got {show(value)}")
        return tuple(check_value(v, a, loc.at(i)) for i, (v, a) in enumerate(zip(value, args)))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise FieldError(loc, f"must be {describe(tp)}, got {show(value)}")
        item = args[0] if args else Any
        return [check_value(v, item, loc.at(i)) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise FieldError(loc, f"must be {describe(tp)}, got {show(value)}")
        key_tp, val_tp = args if args else (Any, Any)
        out = {}
        for k, v in value.items():
            if key_tp is str and not isinstance(k, str):
                raise FieldError(loc, f"keys must be strings, got {show(k)}")
            out[k] = check_value(v, val_tp, loc / str(k))
        return out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value  # built in code: its own __post_init__ checked it
        return from_mapping(tp, value, loc, noun="field")
    raise TypeError(f"edgekit.schema cannot check annotation {tp!r} at {loc}")  # a bug in a declaration


def known_keys(cls: type) -> list[str]:
    """The keys a file may set: every init field not marked internal."""
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]


def unknown_key(loc: Loc, key: str, known: list[str], noun: str = "option") -> FieldError:
    """``stage 'b' export.opst: unknown option (known: ...; did you mean 'opset'?)``."""
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return FieldError(loc / key, f"unknown {noun} (known: {', '.join(sorted(known))}{hint})")


def check_keys(cls: type, data: object, loc: Loc, *, noun: str = "option", extra: tuple[str, ...] = (),
               internal: bool = False) -> Mapping[str, Any]:
    """``data`` is a mapping whose keys are strings and fields of ``cls`` (or ``extra``);
    fields marked internal only when ``internal`` (data built in code, not read)."""
    if not isinstance(data, Mapping):
        raise FieldError(loc, f"must be a mapping of {noun}s, got {show(data)}")
    known = known_keys(cls) + list(extra)
    if internal:
        known += [f.name for f in dataclasses.fields(cls) if f.init and f.metadata.get("internal")]
    programs = {} if internal else {f.name: f.metadata["program"] for f in dataclasses.fields(cls)
                                    if f.metadata.get("program")}
    for key in data:
        if not isinstance(key, str):
            raise FieldError(loc, f"keys must be strings, got {show(key)}")
        if key in programs:
            raise FieldError(loc / key, f"names a program to run, which a file may not (data never names a "
                                        f"program): {programs[key]}")
        if key not in known:
            raise unknown_key(loc, key, known, noun)
    return data


def check_entries(cls: type, data: Mapping[str, Any], loc: Loc, *, skip: tuple[str, ...] = (),
                  internal: bool = False) -> dict[str, Any]:
    """Each present field of ``cls`` checked against its annotation (or its metadata schema);
    values read from a file (not ``internal``) also against their ``from_data`` check."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = type_hints(cls)
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in skip or key not in fields:
            continue
        schema = fields[key].metadata.get("schema")
        if schema is None:
            out[key] = check_value(value, hints[key], loc / key)
        elif value is None and type(None) in typing.get_args(hints[key]):
            out[key] = None
        elif fields[key].metadata.get("each"):
            if not isinstance(value, Mapping):
                raise FieldError(loc / key, f"must be a mapping of names to option mappings, got {show(value)}")
            out[key] = {}
            for name, sub in value.items():
                if not isinstance(name, str):
                    raise FieldError(loc / key, f"keys must be strings, got {show(name)}")
                from_mapping(schema, sub, loc / key / name, internal=internal)
                out[key][name] = dict(sub)
        else:
            from_mapping(schema, value, loc / key, internal=internal)
            out[key] = dict(value)
        check = None if internal else fields[key].metadata.get("from_data")
        if check is not None and out[key] is not None:
            try:
                check(out[key])
            except FieldError as e:
                raise FieldError(Loc(loc.context, ".".join(k for k in ((loc / key).key, e.loc.key) if k)),
                                 e.problem) from None
            except BadInputError as e:
                raise FieldError(loc / key, str(e)) from None
    return out


def from_mapping(cls: type[T], data: object, loc: Loc, *, noun: str = "option", internal: bool = False) -> T:
    """Build ``cls`` from a mapping read from a file: known keys, checked types, then the
    dataclass's own range checks. Errors name ``loc`` and the bad key. ``internal``: the
    mapping was built in code and may set fields marked internal."""
    mapping = check_keys(cls, data, loc, noun=noun, internal=internal)
    values = check_entries(cls, mapping, loc, internal=internal)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in values  # type: ignore[arg-type]
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise FieldError(loc, f"missing required {noun}(s) {', '.join(missing)}")
    try:
        return cls(**values)
    except FieldError as e:
        raise FieldError(Loc(loc.context, ".".join(k for k in (loc.key, e.loc.key) if k)), e.problem) from None
    except BadInputError as e:
        if not str(loc):
            raise
        raise FieldError(loc, str(e)) from None


def check_fields(obj: object) -> None:
    """Check every field of a dataclass instance against its annotation (types, finite
    numbers); configs call this first in ``__post_init__`` so nonsense types never reach
    their range checks. Raises ``FieldError`` naming the field."""
    cls: type = type(obj)
    hints = type_hints(cls)
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        schema = f.metadata.get("schema")
        if schema is not None and isinstance(value, Mapping):
            if f.metadata.get("each"):
                for name, sub in value.items():
                    from_mapping(schema, sub, Loc("", f.name) / str(name), internal=True)
            else:
                from_mapping(schema, value, Loc("", f.name), internal=True)
            continue
        check_value(value, hints[f.name], Loc("", f.name))


# ----------------------------------------------------------------------------- reading files


def read_bytes(path: str | os.PathLike[str], what: str, max_bytes: int) -> bytes:
    """A file's bytes, refused beyond ``max_bytes``; OS errors as one line."""
    p = Path(path)
    try:
        if not p.is_file():
            raise BadInputError(f"{what} {str(p)!r} does not exist" if not p.exists()
                                else f"{what} {str(p)!r} is not a file")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise BadInputError(f"cannot read {what} {str(p)!r}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise BadInputError(f"{what} {str(p)!r} is larger than {max_bytes >> 10} KiB; refusing to read it")
    return data


def _yaml_loader() -> type:
    import yaml

    plain_tags = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map")}

    class Loader(yaml.SafeLoader):
        """SafeLoader without aliases, anchors, merge keys, tags beyond JSON's types or
        timestamps (dates stay strings), with bounded nesting and no duplicate keys."""

        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent):
                raise BadInputError(f"line {line}: YAML aliases (*{event.anchor}) are not allowed")
            if getattr(event, "anchor", None) is not None:
                raise BadInputError(f"line {line}: YAML anchors (&{event.anchor}) are not allowed")
            tag = getattr(event, "tag", None)
            if tag is not None and tag not in plain_tags and tag != "!":
                raise BadInputError(f"line {line}: YAML tag {tag!r} is not allowed (plain values, lists and "
                                    "mappings only)")
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    raise BadInputError(f"line {line}: nested deeper than {MAX_DEPTH} levels")
                try:
                    return super().compose_node(parent, index)
                finally:
                    self.depth -= 1
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise BadInputError(f"line {key_node.start_mark.line + 1}: YAML merge keys (<<) are not allowed")
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    raise BadInputError(f"line {key_node.start_mark.line + 1}: a mapping key must be a plain "
                                        "value") from None
                if duplicate:
                    raise BadInputError(f"line {key_node.start_mark.line + 1}: duplicate key {show(key)}")
            return super().construct_mapping(node, deep=deep)

    # Dates stay strings: a timestamp would be a datetime no schema takes (and '2001-13-14' a ValueError).
    Loader.yaml_implicit_resolvers = {
        ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    return Loader


_LOADER: type | None = None


def parse_yaml(text: str, what: str) -> Any:
    """Plain data (mappings, lists, strings, numbers, booleans, null) from YAML text."""
    import yaml

    global _LOADER
    if _LOADER is None:
        _LOADER = _yaml_loader()
    try:
        return yaml.load(text, Loader=_LOADER)  # noqa: S506 - a SafeLoader subclass
    except BadInputError as e:
        raise BadInputError(f"{what}: {e}") from None
    except yaml.YAMLError as e:
        raise BadInputError(f"{what} is not valid YAML: {' '.join(str(e).split())}") from None
    except (ValueError, RecursionError) as e:  # '!!int x', a 5000-digit integer
        raise BadInputError(f"{what} holds a value YAML cannot convert: {' '.join(str(e).split())[:200]}") from None


def read_yaml(path: str | os.PathLike[str], what: str, max_bytes: int = YAML_MAX_BYTES) -> Any:
    """Plain data from a YAML file (see ``parse_yaml``), at most ``max_bytes``."""
    data = read_bytes(path, what, max_bytes)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInputError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    return parse_yaml(text, f"{what} {str(path)!r}")


def read_json(path: str | os.PathLike[str], what: str, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """Data from a JSON file, at most ``max_bytes``; every failure one line naming the file."""
    data = read_bytes(path, what, max_bytes)
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{what} {str(path)!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except UnicodeDecodeError as e:
        raise BadInputError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except RecursionError:
        raise BadInputError(f"{what} {str(path)!r} is nested too deeply") from None
    except ValueError as e:  # a huge integer literal
        raise BadInputError(f"{what} {str(path)!r} holds a value JSON cannot convert: {str(e)[:200]}") from None
