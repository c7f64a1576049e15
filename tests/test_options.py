"""edgekit/options.py: a flag declared once on a config field (type, default, help, bounds,
basic or advanced, old names), and the help's cache of them (so --help imports no config)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgekit.options import ConfigOption, config_options, config_values, help_options, option


@dataclass(frozen=True)
class Train:
    lr: float = field(default=1e-3, metadata=option("--lr", basic=True, help="Learning rate."))
    steps: int | None = field(default=None, metadata=option("--steps", deprecated=("--iters",), help="Steps."))
    lengths: tuple[int, ...] = field(default=(128, 512), metadata=option("--lengths", sep=",", help="Lengths."))
    shuffle: bool = field(default=True, metadata=option("--shuffle/--no-shuffle", help="Shuffle."))
    batch: int = field(default=1, metadata=option("--batch", bounds=(1, 64), commands=("train",), help="Batch."))
    seed: int = 0  # no flag


@dataclass(frozen=True)
class Eval:
    lr: float = field(default=1e-3, metadata=option("--lr"))  # the same flag: its help is Train's
    windows: int = field(default=8, metadata=option("--windows", basic=("eval",), help="Windows."))


def test_options_come_from_the_fields_with_their_defaults_and_shapes():
    opts = {o.dest: o for o in config_options([("train", Train), ("eval", Eval)], "train")}
    assert list(opts) == ["lr", "steps", "lengths", "shuffle", "batch", "windows"]
    assert (opts["lr"].type, opts["lr"].default, opts["lr"].help, opts["lr"].basic) == (float, 1e-3, "Learning rate.", True)
    assert {(c, f) for c, f, _ in opts["lr"].fields} == {("train", "lr"), ("eval", "lr")}
    assert opts["steps"].default is None and opts["steps"].deprecated == ("--iters",)
    assert (opts["lengths"].type, opts["lengths"].multiple, opts["lengths"].sep, opts["lengths"].default) == \
        (int, True, ",", (128, 512))
    assert opts["shuffle"].is_pair and opts["shuffle"].default is True
    assert opts["batch"].bounds == (1, 64)
    assert not opts["windows"].basic  # basic in `eval` only
    # a flag limited to other commands is not one of this command's
    assert "batch" not in {o.dest for o in config_options([("train", Train)], "eval")}
    assert {o.dest: o.basic for o in config_options([("eval", Eval)], "eval")}["windows"] is True


def test_values_set_only_the_given_fields():
    opts = config_options([("train", Train), ("eval", Eval)], "train")
    given = {"lr": 0.1, "steps": None, "lengths": (), "shuffle": False, "windows": 4}
    assert config_values(opts, given, "train") == {"lr": 0.1, "shuffle": False}
    assert config_values(opts, given, "eval") == {"lr": 0.1, "windows": 4}


def test_bad_declarations_are_refused():
    @dataclass(frozen=True)
    class OnlyOn:
        on: bool = field(default=False, metadata=option("--on"))

    @dataclass(frozen=True)
    class SepOnScalar:
        n: int = field(default=1, metadata=option("--n", sep=","))

    @dataclass(frozen=True)
    class Disagree:
        lr: float = field(default=1e-3, metadata=option("--lr", help="Another text."))

    with pytest.raises(TypeError, match=r"a bool field's flag is an '--on/--off' pair"):
        config_options([("x", OnlyOn)], "x")
    with pytest.raises(TypeError, match=r"sep splits a value into a tuple field"):
        config_options([("x", SepOnScalar)], "x")
    with pytest.raises(TypeError, match=r"the flag of train.lr, x.lr is declared differently"):
        config_options([("train", Train), ("x", Disagree)], "train")
    with pytest.raises(ValueError, match=r"option\(\) takes flag declarations"):
        option("--ok", deprecated=("old",))


def test_descriptions_round_trip_through_json():
    for o in config_options([("train", Train), ("eval", Eval)], "train"):
        back = ConfigOption.from_dict(json.loads(json.dumps(o.to_dict())))
        assert back.to_dict() == o.to_dict() and back.fields == ()
    with pytest.raises(ValueError, match="not an option description"):
        ConfigOption.from_dict({"dest": "x", "decls": [], "type": "int"})
    with pytest.raises(ValueError, match="not an option description"):
        ConfigOption.from_dict({**config_options([("train", Train)], "train")[0].to_dict(), "type": "object"})


def test_the_help_cache_is_written_once_and_regenerated_when_damaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path))
    calls: list[int] = []

    def generate() -> dict[str, list[ConfigOption]]:
        calls.append(1)
        return {"train": config_options([("train", Train)], "train")}

    first = help_options(generate)
    assert [o.dest for o in first["train"]] == ["lr", "steps", "lengths", "shuffle", "batch"]
    assert [o.to_dict() for o in help_options(generate)["train"]] == [o.to_dict() for o in first["train"]]
    assert len(calls) == 1  # the second read came from the cache
    (cached,) = (tmp_path / "cli").glob("options-*.json")
    cached.write_text('{"train": [{"dest": 1}]}')  # damaged: generated again, never trusted
    assert [o.dest for o in help_options(generate)["train"]][0] == "lr" and len(calls) == 2
    assert json.loads(cached.read_text())["train"][0]["dest"] == "lr"
    install = cached.name.split("-")[1]
    (tmp_path / "cli" / f"options-{install}-0123.json").write_text("{}")  # this install's earlier code: removed
    (tmp_path / "cli" / "options-00000000-0123.json").write_text("{}")  # another install's: kept
    cached.unlink()
    help_options(generate)
    assert sorted(p.name for p in (tmp_path / "cli").glob("options-*.json")) == ["options-00000000-0123.json",
                                                                                 cached.name]
