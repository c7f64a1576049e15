"""A recipe never names a program, and --dry-run refuses what the run refuses.

Found: ``build: {extra: {trtexec: ./evil.sh}}`` ran ``evil.sh --help`` while the run probed
a Jetson target (exit 0; --dry-run did not), and ``ssh_options: ["ProxyCommand=touch
PWNED"]`` ran the ProxyCommand on this machine, after which the run passed its budget on
an estimate. Here every field of a recipe (derived from the schema dataclasses, so a new
field is covered the day it is added) takes executable-looking values: the validation
(what --dry-run runs) refuses with one line or accepts, and an accepted recipe then runs
for real with every process start recorded by an audit hook: no program named by the data
starts, nothing the data names is executed, and the marker ``PWNED`` never appears.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from edgekit.cli import cli
from edgekit.compress import STEPS, get_step
from edgekit.errors import EdgekitError
from edgekit.pipelines.recipe import Recipe, StageSpec, parse_recipe
from edgekit.pipelines.run import run_recipe
from edgekit.ssh import SSH_OPTIONS_FROM_DATA

# --- every process this test process starts, while armed -------------------------------------------------

_LAUNCHED: list[tuple[str, list[str]]] = []
_ARMED = [False]
_EVENTS = ("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _ARMED[0] and event in _EVENTS:
        if event == "os.system":
            _LAUNCHED.append(("sh", ["sh", "-c", str(args[0])]))
        elif event == "subprocess.Popen":
            argv = [str(a) for a in (args[1] if isinstance(args[1], (list, tuple)) else [args[1]])]
            _LAUNCHED.append((str(args[0] or argv[0]), argv))
        else:
            _LAUNCHED.append((str(args[0]), [str(a) for a in (args[1] or [])]))


sys.addaudithook(_audit)  # cannot be removed: it records only while a test arms it


@pytest.fixture
def launches() -> Iterator[list[tuple[str, list[str]]]]:
    _LAUNCHED.clear()
    _ARMED[0] = True
    try:
        yield _LAUNCHED
    finally:
        _ARMED[0] = False


# Programs edgekit itself may start while running these recipes: ssh (here the fake local
# transport), bash (the TensorRT probe), uname (platform.processor()) and ldconfig
# (ctypes.util.find_library, for glibc's malloc_trim).
ALLOWED_PROGRAMS = {"ssh", "bash", "uname", "ldconfig"}
# ssh options edgekit sets itself; any other -o must come from the recipe's allow-list.
OWN_SSH_OPTIONS = {"BatchMode", "ConnectTimeout", "ServerAliveInterval", "ServerAliveCountMax", "ControlMaster",
                   "ControlPath", "ControlPersist"}


def check_launches(launched: list[tuple[str, list[str]]], root: Path) -> None:
    """No program named by data started: each is one edgekit starts itself, none is the
    hostile script, no ssh option outside edgekit's own and the recipe allow-list, and
    nothing the data wrote ran (the marker file is absent)."""
    allowed_options = {o.lower() for o in OWN_SSH_OPTIONS | set(SSH_OPTIONS_FROM_DATA)}
    for exe, argv in launched:
        name = Path(exe).name
        assert name in ALLOWED_PROGRAMS, (exe, argv)
        assert not any("PWNED" in a or "evil" in a for a in argv[:1]), argv
        if name == "ssh":
            options = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-o"]
            assert all(o.split("=", 1)[0].split()[0].lower() in allowed_options for o in options), options
            assert not any("PWNED" in a for a in argv), argv
    assert not list(root.rglob("PWNED")), "a program named by the recipe ran"


# --- the recipe's fields, from the schema dataclasses -----------------------------------------------------

def _schema_paths(cls: type, prefix: tuple[Any, ...]) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, annotation) of every key ``cls`` (and the schemas nested in it) lets a file set."""
    hints = typing.get_type_hints(cls)
    paths: list[tuple[tuple[Any, ...], Any]] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.metadata.get("internal"):
            continue
        schema = f.metadata.get("schema")
        if schema is not None and f.metadata.get("each"):
            paths += _schema_paths(schema, (*prefix, f.name, "x"))
        elif schema is not None:
            paths.append(((*prefix, f.name), hints[f.name]))
            paths += _schema_paths(schema, (*prefix, f.name))
        else:
            paths.append(((*prefix, f.name), hints[f.name]))
    return paths


def recipe_paths() -> list[tuple[tuple[Any, ...], Any]]:
    """Every key a recipe may set (or that a file must not set), with its annotation: stages
    as ("stages", 0 | 1, ...), step options as ("stages", 1, "steps", STEP, FIELD)."""
    paths = [(p, t) for p, t in _schema_paths(Recipe, ()) if p[0] != "stages"] + [(("target",), str)]
    for p, t in _schema_paths(StageSpec, ()):
        if p[0] != "steps":
            paths.append((("stages", 0 if p[0] in ("callable", "inputs") else 1, *p), t))
    for name in STEPS:
        for p, t in _schema_paths(get_step(name).config, ()):
            paths.append((("stages", 1, "steps", name, p[0]), t))
    return paths


def _takes_text(annotation: Any) -> bool:
    """Whether a field's annotation accepts a string (where an executable-looking value can
    pass the types, so only the field's own rules stand between it and the run)."""
    return annotation is str or str in typing.get_args(annotation)


PATHS = [p for p, _ in recipe_paths()]
TEXT_PATHS = [p for p, t in recipe_paths() if _takes_text(t) and p[-1] not in ("trtexec", "remote_edgekit")]


def base_recipe() -> dict[str, Any]:
    return {"name": "base", "target": "jetson-agx-orin-64",
            "profile": {"warmup_ms": 1, "duration_s": 0.02, "iterations": 3, "node_profile": False},
            "stages": [{"name": "pre", "callable": "edgekit.pipelines.examples:scale",
                        "inputs": {"x": {"shape": [1, 16]}}},
                       {"name": "m", "model": "tiny.onnx", "build": {"precision": "fp16"}}]}


def with_value(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """``data`` with ``value`` at ``path`` (steps as a one-step list)."""
    if path[:1] == ("target",):
        data.pop("targets", None)
    if len(path) == 5 and path[2] == "steps":
        data["stages"][path[1]]["steps"] = [{path[3]: {path[4]: value}}]
        return data
    node: Any = data
    for key in path[:-1]:
        if isinstance(node, dict) and not isinstance(node.get(key, {}), (dict, list)):
            node[key] = {}
        node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    node[path[-1]] = value
    return data


def hostile_values(root: Path) -> list[Any]:
    evil = str(root / "evil.sh")
    words = [evil, "./evil.sh", "evil.sh", "sh -c 'touch PWNED'", "$(touch PWNED)", "`touch PWNED`",
             "x; touch PWNED", "| touch PWNED", "-oProxyCommand=touch PWNED", "ProxyCommand=touch PWNED",
             "LocalCommand=touch PWNED", "me@host -oProxyCommand=touch PWNED", "../../evil.sh", f"file://{evil}"]
    return words + [[w] for w in words[:4]] + [{"x": words[0]}]


def make_workdir(root: Path) -> Path:
    """The recipe's folder: the model, and the script the hostile values name (it writes the
    marker when run)."""
    evil = root / "evil.sh"
    evil.write_text(f"#!/bin/sh\ntouch {root}/PWNED\necho TensorRT v100300\n")
    evil.chmod(0o755)
    return root


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> Path:
    root = make_workdir(tmp_path_factory.mktemp("recipes"))
    shutil.copy(tiny_onnx, root / "tiny.onnx")
    return root


def validate(data: dict[str, Any], root: Path) -> Recipe | None:
    """What --dry-run runs: the recipe or None (refused in one line)."""
    try:
        return parse_recipe(data, str(root / "recipe.yaml"))
    except EdgekitError as e:
        assert "\n" not in str(e) and str(e), repr(e)
        return None


# --- the two cases as they were found -----------------------------------------------------------------------

def _cli(args: list[str], cwd: Path) -> Any:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(cli, args)
    finally:
        os.chdir(old)


@pytest.mark.parametrize("extra, message", [
    ({"trtexec": "./evil.sh"}, "stage 'm' build.extra.trtexec: names a program to run, which a file may not (data "
                               "never names a program): set $EDGEKIT_TRTEXEC or put trtexec on PATH"),
    ({"remote_edgekit": "./evil.sh"}, "stage 'm' build.extra.remote_edgekit: names a program to run, which a file may "
                                      "not (data never names a program): give --remote-edgekit to `edgekit remote` or "
                                      "set $EDGEKIT_REMOTE_EDGEKIT"),
    ({"remote": "me@device.invalid", "ssh_options": ["ProxyCommand=touch PWNED"]},
     "stage 'm' build.extra.ssh_options: ssh option 'ProxyCommand' may not come from a recipe"),
    ({"remote": "-oProxyCommand=touch PWNED"}, "stage 'm' build.extra.remote: bad remote '-oProxyCommand=touch PWNED'"),
])
def test_a_recipe_that_names_a_program_is_refused_by_the_dry_run_and_the_run(workdir: Path, launches: list,
                                                                            extra: dict[str, Any], message: str) -> None:
    data = base_recipe()
    data["stages"][1]["build"]["extra"] = extra
    (workdir / "trtx.yaml").write_text(yaml.safe_dump(data))
    for args in (["run", "trtx.yaml", "--dry-run"], ["run", "trtx.yaml", "-o", "run-trtx"]):
        r = _cli(args, workdir)
        assert r.exit_code == 2, r.output
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: trtx.yaml: {message}"), r.stderr
    assert not (workdir / "run-trtx").exists()
    check_launches(launches, workdir)


def test_a_failed_remote_build_is_an_error_not_a_pass_on_an_estimate(workdir: Path, launches: list,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With allowed ssh options and an unreachable device, the run passed its budget on an
    estimate with only a warning: a build the recipe sends to a device that fails is exit 2."""
    from conftest import install_local_ssh

    install_local_ssh(workdir, monkeypatch)  # the "device" is this machine, without TensorRT
    data = base_recipe()
    data["budget_ms"] = 30
    data["stages"][1]["build"]["extra"] = {"remote": "me@device", "ssh_options": ["ConnectTimeout=3"]}
    (workdir / "remote.yaml").write_text(yaml.safe_dump(data))
    r = _cli(["run", "remote.yaml", "-o", "run-remote"], workdir)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: me@device has no TensorRT: no trtexec on PATH or at /usr/src/tensorrt/bin/trtexec "
                     "(install JetPack / TensorRT there)"], r.stderr
    check_launches(launches, workdir)
    assert any(Path(exe).name == "ssh" for exe, _ in launches)


# --- every field, every executable-looking value --------------------------------------------------------------

@pytest.fixture
def targets_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each target file parsed once (a pure-Python YAML parse is most of a validation's time)."""
    import edgekit.pipelines.recipe as recipe_module
    from edgekit.targets import load_target

    monkeypatch.setattr(recipe_module, "load_target", functools.cache(load_target))


def test_every_field_refuses_or_keeps_an_executable_looking_value_as_data(workdir: Path,
                                                                          targets_read_once: None) -> None:
    """Each field of the schema, with executable-looking values, through the validation
    (--dry-run's): one line or a recipe; the fields that name programs are refused whatever
    the value; a build option the build would refuse is refused here already."""
    accepted: dict[tuple[Any, ...], int] = {}
    for path in PATHS:
        for value in hostile_values(workdir)[:4] + ["$(touch PWNED)"]:
            if validate(with_value(base_recipe(), path, value), workdir) is not None:
                accepted[path] = accepted.get(path, 0) + 1
    assert len(PATHS) > 150  # the schema was walked (recipe, stage, build, extras, every step's options)
    assert not {p for p in accepted if p[-1] in ("trtexec", "remote_edgekit", "ssh_options", "trt_path", "device",
                                                  "min_shapes", "opt_shapes", "max_shapes", "callable", "frames")}
    assert accepted.get(("stages", 1, "build", "extra", "remote")) == 1  # "evil.sh" is a host name, nothing else
    assert accepted[("description",)] == 5  # free text stays text


@st.composite
def hostile_recipes(draw: st.DrawFn, root: Path) -> dict[str, Any]:
    """The base recipe with executable-looking values in one or two fields that take text
    (the ones whose values can reach the run)."""
    data = base_recipe()
    for path in draw(st.lists(st.sampled_from(TEXT_PATHS), min_size=1, max_size=2, unique=True)):
        data = with_value(data, path, draw(st.sampled_from(hostile_values(root)[:10])))
    return data


_ROOT = Path(tempfile.mkdtemp(prefix="edgekit-test-recipes-"))  # hypothesis draws from it: made at collection
atexit.register(shutil.rmtree, _ROOT, True)


@settings(max_examples=4, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=hostile_recipes(_ROOT))
def test_hostile_recipes_never_start_a_program(data: dict[str, Any], tiny_onnx: Path, targets_read_once: None,
                                               monkeypatch: pytest.MonkeyPatch, launches: list) -> None:
    """A recipe with executable-looking values: refused in one line by the validation, or
    run for real (over the local SSH transport where it asks for a device): the run ends
    with a result or one line, and no program named by the data starts."""
    root = make_workdir(Path(tempfile.mkdtemp(dir=_ROOT)))
    shutil.copy(tiny_onnx, root / "tiny.onnx")
    from conftest import install_local_ssh

    install_local_ssh(root, monkeypatch)
    monkeypatch.setenv("EDGEKIT_CACHE", str(root / "cache"))
    monkeypatch.chdir(root)
    recipe = validate(data, root)
    assume(recipe is not None)  # refusals are one line (checked in validate); the runs are what is left to see
    assert recipe is not None
    try:
        run_recipe(recipe, root / "run", progress=False)
        event("run: completed")
    except (EdgekitError, OSError) as e:  # what the CLI prints as its one line
        assert "\n" not in str(e) and str(e), repr(e)
        event(f"run: {type(e).__name__}")
    check_launches(launches, root)
    shutil.rmtree(root, ignore_errors=True)
