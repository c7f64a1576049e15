"""The command line with the user's files: no data loss, OS errors as one line and exit 2,
Ctrl-C (a real SIGINT) at any moment is exit 130 with outputs as they were, one run per
run folder, permissions from the umask, and property-based tests over output paths."""
from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import json
import os
import re
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner, Result
from hypothesis import event, given, settings
from hypothesis import strategies as st

from edgekit.artifact import LOCK_FILE, Manifest, read_manifest, write_manifest
from edgekit.cli import cli
from edgekit.pipelines.recipe import parse_recipe
from edgekit.pipelines.run import run_recipe
from edgekit.profiling import LatencyStats, ProfileResult

REPO = Path(__file__).resolve().parents[1]
FAST_PROFILE = {"warmup_ms": 5, "duration_s": 0.05, "iterations": 10, "node_profile": False}


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(stderr: str, output: str = "") -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr + output
    return lines[0]


def tree_hash(root: Path, exclude: list[Path] = ()) -> str:  # type: ignore[assignment]
    """Names, types, contents and permissions of everything under ``root`` (but ``exclude``)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if any(p == x or x in p.parents for x in exclude):
            continue
        st_ = p.lstat()
        h.update(f"{p.relative_to(root)}|{stat.S_IFMT(st_.st_mode)}|{stat.S_IMODE(st_.st_mode):o}".encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def debris(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.endswith((".partial", ".old", ".tmp"))]


def make_output(folder: Path, payload: str = "old") -> Path:
    folder.mkdir(parents=True)
    (folder / "data.txt").write_text(payload)
    write_manifest(folder, Manifest(kind="onnx", files={"data": "data.txt"}))
    return folder


def subprocess_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(REPO), *(extra.pop("PYTHONPATH", "").split(os.pathsep))]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "EDGEKIT_PROGRESS": "0", **extra}


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project folder as the working directory."""
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "train.py").write_text("print('mine')\n")
    (proj / "notes.txt").write_text("my notes\n")
    monkeypatch.chdir(proj)
    return proj


@pytest.fixture
def profile_json(tmp_path: Path) -> Path:
    stats = LatencyStats.from_samples([10.0] * 95 + [12.0] * 5)
    prof = ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={}, latency_ms=stats,
                         throughput_per_s=90.0)
    return prof.save(tmp_path / "profile.json")


# --- what was seen: each case reproduced ----------------------------------------------------------

@pytest.mark.parametrize("out, message", [
    ("PWD", "error: output folder 'PWD' is the working directory; choose a new folder"),
    (".", "error: output folder '.' is the working directory; choose a new folder"),
    ("..", "error: output folder '..' contains the working directory PWD; choose a new folder"),
    ("notes.txt", "error: output 'notes.txt' is a file, not a folder; choose a new folder"),
    ("notes.txt/onnx", "error: cannot write 'notes.txt/onnx': PWD/notes.txt is a file, not a folder"),
    ("notes.txt/a\nb", "error: cannot write 'notes.txt/a\\nb': PWD/notes.txt is a file, not a folder"),
    ("src", "error: output folder 'src' already exists and is not an edgekit output folder (no manifest.json); "
            "edgekit replaces only its own output folders or empty ones: choose a new folder or remove it yourself"),
])
def test_export_never_touches_what_edgekit_did_not_write(proj: Path, out: str, message: str) -> None:
    """`cd proj && edgekit export fmnist-cnn -o "$PWD"` deleted the project with exit 0;
    `-o notes.txt` hid the file as .notes.txt.old-PID; `-o .` left a .partial folder."""
    before = tree_hash(proj.parent)
    r = run("export", "fmnist-cnn", "-o", out.replace("PWD", str(proj)))
    assert r.exit_code == 2, r.output
    assert one_line_error(r.stderr, r.output) == message.replace("PWD", str(proj))
    assert tree_hash(proj.parent) == before


def test_output_equal_to_above_or_inside_the_input_is_refused(tmp_path: Path, tiny_onnx: Path) -> None:
    first = tmp_path / "onnx"
    assert run("export", tiny_onnx, "-o", first).exit_code == 0
    before = tree_hash(tmp_path)
    for args, message in (
            (["export", first, "-o", first], f"output folder '{first}' is the input '{first}'"),
            (["build", first, "-o", first / "engine"], f"output folder '{first / 'engine'}' is inside the input folder"),
            (["export", first / "model.onnx", "-o", tmp_path], f"output folder '{tmp_path}' contains the input")):
        r = run(*args)
        assert r.exit_code == 2, r.output
        assert message in one_line_error(r.stderr, r.output)
    assert tree_hash(tmp_path) == before


def test_single_file_outputs_never_replace_a_folder_or_an_input(tmp_path: Path, profile_json: Path,
                                                                 tiny_onnx: Path) -> None:
    (tmp_path / "folder").mkdir()
    onnx_dir = tmp_path / "onnx"
    assert run("export", tiny_onnx, "-o", onnx_dir).exit_code == 0
    before = tree_hash(tmp_path)
    cases = [
        (["check", profile_json, "--budget-ms", "33", "--json", tmp_path / "folder"],
         f"error: output file '{tmp_path / 'folder'}' is a folder; give a file name"),
        (["check", profile_json, "--budget-ms", "33", "--json", profile_json],
         f"error: output file '{profile_json}' is the input '{profile_json}'; choose another output"),
        (["check", profile_json, "--budget-ms", "33", "--json", onnx_dir / "manifest.json"],
         f"error: output file '{onnx_dir / 'manifest.json'}' belongs to the edgekit output folder"),
        (["report", onnx_dir, "--markdown", tmp_path / "folder"],
         f"error: output file '{tmp_path / 'folder'}' is a folder; give a file name"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.exit_code == 2, r.output
        assert one_line_error(r.stderr, r.output).startswith(message)
    assert tree_hash(tmp_path) == before
    (tmp_path / "notes.json").write_text('{"mine": true}')  # report --markdown notes.md would also write notes.json
    r = run("report", onnx_dir, "--markdown", tmp_path / "notes.md")
    assert r.exit_code == 2
    assert "also writes" in one_line_error(r.stderr, r.output) and not (tmp_path / "notes.md").exists()
    assert json.loads((tmp_path / "notes.json").read_text()) == {"mine": True}


def test_outputs_follow_the_umask(tmp_path: Path, tiny_onnx: Path, profile_json: Path) -> None:
    """They were 0700/0600 whatever the umask: unreadable by the rest of a shared CI runner."""
    old = os.umask(0o022)
    try:
        assert run("export", tiny_onnx, "-o", tmp_path / "shared").exit_code == 0
        assert run("check", profile_json, "--budget-ms", "33", "--json", tmp_path / "v.json").exit_code == 0
        os.umask(0o077)
        assert run("export", tiny_onnx, "-o", tmp_path / "private").exit_code == 0
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes["shared"] == 0o755 and modes["shared/manifest.json"] == 0o644 and modes["v.json"] == 0o644
    assert modes["shared/model.onnx"] == 0o644
    assert modes["private"] == 0o700 and modes["private/manifest.json"] == 0o600


# --- OS errors: one line, exit 2, nothing left ---------------------------------------------------------

def _without_root_file_powers() -> None:
    """In the child, before exec: drop the capabilities that let root ignore file
    permissions, so a read-only folder is read-only for root too."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def edgekit(*args: object, cwd: Path, preexec: object = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-m", "edgekit.cli", *map(str, args)], cwd=cwd, env=subprocess_env(),
                              capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)  # type: ignore[arg-type]
    except subprocess.SubprocessError as e:
        if "preexec_fn" in str(e) or "Exception occurred in preexec_fn" in str(e):
            pytest.skip(f"cannot drop root's file capabilities here: {e}")
        raise


def test_read_only_folder_and_file_too_large_are_one_line(tmp_path: Path) -> None:
    """A read-only output folder gave an OSError traceback; so did a full disk (here: a
    file-size limit, EFBIG, which fails writes the same way)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    big = numpy_helper.from_array(np.ones((512, 512), np.float32), "w")  # 1 MiB of weights
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 512])], [big])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "big.onnx"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    preexec = _without_root_file_powers if os.geteuid() == 0 else None
    before = tree_hash(tmp_path)
    r = edgekit("export", "big.onnx", "-o", "ro/onnx", cwd=tmp_path, preexec=preexec)
    assert r.returncode == 2, r.stderr
    assert one_line_error(r.stderr) == f"error: cannot create a folder in {ro}: Permission denied"
    assert tree_hash(tmp_path) == before

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    r = edgekit("export", "big.onnx", "-o", "out/onnx", cwd=tmp_path, preexec=small_files)
    assert r.returncode == 2, r.stderr
    assert one_line_error(r.stderr) == "error: cannot write out/onnx/model.onnx: File too large"
    assert tree_hash(tmp_path) == before and not (tmp_path / "out").exists()


# --- Ctrl-C: a real SIGINT at chosen moments ----------------------------------------------------------

DRIVER = textwrap.dedent("""
    # Run `python -m edgekit.cli ARGS` and send this process a real SIGINT (or the signal named
    # by $EDGEKIT_TEST_SIGNAL: SIGTERM, SIGHUP, SIGKILL) at each moment in
    # WHEN ("+"-joined): "import:M" = just before module M is first imported; "rename" = just
    # before a staging folder is renamed into place; "copy" = just before a file is copied into
    # a staging folder; "rmtree" = just before a staging folder is removed; "echo" = just
    # before the CLI prints its error line. The first SIGINT writes
    # the output's parent folder listing to SNAPSHOT (to show that staging was under way).
    import json, os, shutil, signal, sys
    when, snapshot, watch, args = sys.argv[1].split("+"), sys.argv[2], sys.argv[3], sys.argv[4:]
    fired = []

    def fire(tag):
        if tag in when and tag not in fired:
            if not fired:
                with open(snapshot, "w") as f:
                    json.dump(sorted(os.listdir(watch)) if os.path.isdir(watch) else [], f)
            fired.append(tag)
            os.kill(os.getpid(), getattr(signal, os.environ.get("EDGEKIT_TEST_SIGNAL", "SIGINT")))

    class Hook:
        def find_spec(self, name, path=None, target=None):
            fire("import:" + name)
            return None

    sys.meta_path.insert(0, Hook())
    if "echo" in when:  # watch what the CLI prints
        import click
        real_echo = click.echo
        def echo(message=None, *a, **k):
            if str(message).startswith("error:"):
                fire("echo")
            return real_echo(message, *a, **k)
        click.echo = echo
    import atexit
    atexit.register(lambda: open(snapshot + ".fired", "w").write(json.dumps(fired)))
    real_rename, real_rmtree, real_copyfile = os.rename, shutil.rmtree, shutil.copyfile
    def rename(src, dst, *a, **k):
        if str(src).endswith(".partial"):
            fire("rename")
        return real_rename(src, dst, *a, **k)
    def rmtree(path, *a, **k):
        if str(path).endswith(".partial"):
            fire("rmtree")
        return real_rmtree(path, *a, **k)
    def copyfile(src, dst, *a, **k):
        if ".partial" in str(dst):
            fire("copy")
        return real_copyfile(src, dst, *a, **k)
    os.rename, shutil.rmtree, shutil.copyfile = rename, rmtree, copyfile
    sys.argv = ["-m", *args]  # what `python -m edgekit.cli` sees while the module is located
    import runpy
    runpy.run_module("edgekit.cli", run_name="__main__", alter_sys=True)
""")

MODELS = textwrap.dedent("""
    import os, signal
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self, swallow):
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.swallow = swallow

        def forward(self, x):
            if self.swallow:
                self.swallow = False
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    sum(range(1000))  # the KeyboardInterrupt is raised here
                except KeyboardInterrupt:
                    pass  # what a library that swallows Ctrl-C does
            return self.fc(x)

    def plain():
        torch.manual_seed(0)
        return Net(False), torch.randn(2, 8)

    def swallowing():
        torch.manual_seed(0)
        return Net(True), torch.randn(2, 8)
""")


@pytest.fixture(scope="module")
def interrupt_setup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("interrupt")
    (root / "safety_models.py").write_text(MODELS)
    (root / "driver.py").write_text(DRIVER)
    return root


KEPT = "interrupted; outputs were left as they were before this command"


@pytest.mark.parametrize("when, model, staging, message", [
    ("import:click", "safety_models:plain", False, "interrupted during start-up; nothing was written"),
    ("import:torch", "safety_models:plain", False, KEPT),
    ("import:onnxruntime", "safety_models:plain", True, KEPT),
    ("never", "safety_models:swallowing", False, KEPT),
    ("rename", "TINY_ONNX", True, "interrupted; outputs completed before the interrupt were kept (out/onnx), "
                                  "nothing half-written was left"),
    ("copy+rmtree+echo", "TINY_ONNX", True, KEPT),  # Ctrl-C pressed three times: mid-copy, mid-cleanup, mid-message
])
def test_sigint_at_any_moment_exits_130_and_leaves_outputs(tmp_path: Path, interrupt_setup: Path, tiny_onnx: Path,
                                                            when: str, model: str, staging: bool, message: str) -> None:
    """One Ctrl-C during start-up was swallowed and the command completed with exit 0.
    Here a real SIGINT arrives while the CLI loads, before the work, while the output is
    being staged (ONNX Runtime is first imported for the parity check), inside a model whose
    code swallows the KeyboardInterrupt, between the two renames that swap the old output
    for the new one, and three times in a row."""
    old = make_output(tmp_path / "out" / "onnx")
    before = tree_hash(tmp_path)
    snapshot = tmp_path.parent / f"{tmp_path.name}-snapshot.json"
    r = subprocess.run([sys.executable, str(interrupt_setup / "driver.py"), when, str(snapshot), str(old.parent),
                        "export", model.replace("TINY_ONNX", str(tiny_onnx)), "-o", "out/onnx", "--legacy"],
                       cwd=tmp_path, env=subprocess_env(PYTHONPATH=str(interrupt_setup)),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, r.stdout + r.stderr
    assert one_line_error(r.stderr) == f"error: {message}"
    assert debris(tmp_path) == []
    if when == "rename":  # the swap was under way: held back, it completed; the new output is whole
        assert read_manifest(old).kind == "onnx" and (old / "model.onnx").is_file()
        assert sorted(os.listdir(old.parent)) == ["onnx"]
    else:
        assert tree_hash(tmp_path) == before
    if staging:  # a staging folder stood beside the old output when the (first) SIGINT came
        assert any(name.endswith(".partial") for name in json.loads(snapshot.read_text()))
    if "+" in when:
        assert json.loads(Path(f"{snapshot}.fired").read_text()) == when.split("+")


# --- one run per run folder ---------------------------------------------------------------------------

def _callable_recipe(tmp_path: Path) -> Path:
    data = {"name": "tiny", "target": "cpu", "budget_ms": 1000, "seed": 0, "profile": FAST_PROFILE,
            "stages": [{"name": "pre", "callable": "edgekit.pipelines.examples:scale",
                        "inputs": {"x": {"shape": [1, 16]}}}]}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_second_run_on_a_run_folder_exits_2_naming_the_first(tmp_path: Path) -> None:
    recipe = _callable_recipe(tmp_path)
    run_dir = tmp_path / "runs" / "tiny"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom edgekit.artifact import claim_work_folder\n"
         "with claim_work_folder(sys.argv[1], 'run'):\n    print('held', flush=True)\n    sys.stdin.readline()\n",
         str(run_dir)], env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        r = run("run", recipe, "-o", run_dir)
        assert r.exit_code == 2, r.output
        assert one_line_error(r.stderr, r.output) == (
            f"error: '{run_dir.resolve()}' is in use by another edgekit process (PID {holder.pid}); wait for it to "
            "finish (edgekit run --wait waits for it), or choose another folder")
        assert sorted(os.listdir(run_dir)) == [LOCK_FILE, "manifest.json"]  # nothing of a run was written

        def release() -> None:
            threading.Event().wait(0.5)
            assert holder.stdin is not None
            holder.stdin.write("\n")
            holder.stdin.flush()

        t = threading.Thread(target=release)
        t.start()
        r = run("run", recipe, "-o", run_dir, "--wait")  # waits for the holder, then runs
        t.join()
        assert r.exit_code == 0, r.output
        assert json.loads((run_dir / "results.json").read_text())["passed"] is True
    finally:
        holder.kill()
        holder.wait()


def test_runs_sharing_a_cache_build_each_entry_once(tmp_path: Path) -> None:
    recipe = parse_recipe(yaml.safe_load(_callable_recipe(tmp_path).read_text()))
    results = []

    def one(name: str) -> None:
        results.append(run_recipe(recipe, tmp_path / name, cache_dir=tmp_path / "cache", progress=False))

    threads = [threading.Thread(target=one, args=(n,)) for n in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.stages[0].reused["frames"] for r in results) == [False, True, True]
    assert len([p for p in (tmp_path / "cache").iterdir() if p.name.startswith("frames-")]) == 1
    assert debris(tmp_path) == []


def test_a_run_folder_must_be_a_run_folder(proj: Path) -> None:
    recipe = _callable_recipe(proj.parent)
    before = tree_hash(proj.parent)
    for out, message in ((".", "error: run folder '.' is the working directory; choose a new folder"),
                         ("src", "error: output folder 'src' already exists and is not an edgekit run folder "
                                 "(no manifest.json); edgekit works only in its own run folders or empty ones")):
        r = run("run", recipe, "-o", out)
        assert r.exit_code == 2, r.output
        assert one_line_error(r.stderr, r.output).startswith(message)
    assert tree_hash(proj.parent) == before


# --- property-based: random trees, random output paths --------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c.json", "d.md"])


@st.composite
def trees(draw: st.DrawFn) -> list[tuple[str, str]]:
    """A random tree: (relative path, kind) with kind file | dir | edgekit | empty."""
    entries: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(1, 6))):
        parent = draw(st.sampled_from([""] + [p + "/" for p, k in entries if k in ("dir", "edgekit")]))
        name = draw(NAMES)
        if any(p == parent + name for p, _ in entries):
            continue
        entries.append((parent + name, draw(st.sampled_from(["file", "dir", "edgekit", "empty"]))))
    return entries


def build_tree(root: Path, entries: list[tuple[str, str]], read_only: set[str]) -> None:
    for rel, kind in entries:
        p = root / rel
        if kind == "file":
            p.write_text(f"user data {rel}")
        elif kind == "edgekit":
            p.mkdir()
            (p / "data.txt").write_text("old output")
            (p / "manifest.json").write_text(json.dumps(Manifest(kind="onnx", files={"data": "data.txt"}).to_dict()))
        else:
            p.mkdir()
            if kind == "dir":
                (p / "mine.txt").write_text("user data")
    for rel in read_only:
        (root / rel).chmod(0o555)


def _writable(p: Path) -> bool:
    return os.geteuid() == 0 or os.access(p, os.W_OK)


@settings(max_examples=50, deadline=None)
@given(entries=trees(), target=st.data(), command=st.sampled_from(["export", "build", "check", "report"]),
       read_only=st.booleans())
def test_any_output_path_is_safe(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path, entries: list,
                                 target: st.DataObject, command: str, read_only: bool) -> None:
    """Whatever the tree and the output path: exit 0 or 2; on 2 exactly one `error:` line,
    no traceback and nothing changed; on 0 nothing changed but the output itself, which
    is complete, and which was new, empty, an edgekit output folder (or, for a file output,
    a file). The cases that must be refused are refused."""
    work = tmp_path_factory.mktemp("prop")
    root = work / "tree"
    root.mkdir()
    folders = sorted(rel for rel, k in entries if k in ("dir", "empty", "edgekit"))
    ro = set(folders[:1]) if read_only else set()  # one read-only folder (root ignores the mode)
    build_tree(root, entries, ro)
    profile = ProfileResult(engine="e", runtime="onnxruntime", target="cpu", model="m", settings={},
                            latency_ms=LatencyStats.from_samples([1.0, 2.0, 3.0]), throughput_per_s=1.0)
    profile.save(work / "profile.json")
    out_rel = target.draw(st.sampled_from([rel for rel, _ in entries] + [rel + "/new" for rel, _ in entries]
                                          + ["new/deeper", ".", ".."]))
    out = root / out_rel
    kinds = dict(entries)
    folder_output = command in ("export", "build")
    args = {"export": ["export", tiny_onnx, "-o", out_rel],
            "build": ["build", tiny_onnx, "--target", "cpu", "-o", out_rel],
            "check": ["check", work / "profile.json", "--budget-ms", "10", "--json", out_rel],
            "report": ["report", work / "profile.json", "--markdown", out_rel]}[command]
    written = [out] + ([out.with_suffix(".json")] if command == "report" and Path(out_rel).name not in ("", ".", "..") else [])
    new_top = next((root / Path(*Path(out_rel).parts[:i + 1]) for i in range(len(Path(out_rel).parts))
                    if not os.path.lexists(root / Path(*Path(out_rel).parts[:i + 1]))), None)
    before, before_rest = tree_hash(work), tree_hash(work, exclude=[*written, *([new_top] if new_top else [])])
    old_cwd = os.getcwd()
    os.chdir(root)
    try:
        r = run(*args)
    finally:
        os.chdir(old_cwd)
        after, after_rest = tree_hash(work), tree_hash(work, exclude=[*written, *([new_top] if new_top else [])])
        for rel in ro:
            (root / rel).chmod(0o755)
    assert r.exit_code in (0, 2), (r.exit_code, r.output, r.exception)
    event(f"{command}: exit {r.exit_code}")
    existing = kinds.get(out_rel)
    parent_kind = kinds.get(str(Path(out_rel).parent))
    sibling = kinds.get(str(Path(out_rel).with_suffix(".json"))) if command == "report" and Path(out_rel).name not in ("", ".", "..") else None
    must_refuse = (out_rel in (".", "..")
                   or parent_kind == "file"
                   or (folder_output and existing in ("file", "dir"))
                   or (not folder_output and existing in ("dir", "empty", "edgekit"))
                   or (command == "report" and Path(out_rel).suffix != ".json"
                       and sibling in ("file", "dir", "empty", "edgekit")))
    if must_refuse:
        assert r.exit_code == 2, (out_rel, existing, r.output)
    if r.exit_code == 2:
        one_line_error(r.stderr, r.output)
        assert after == before
        return
    assert after_rest == before_rest  # nothing but the output changed
    assert _writable(out.parent)
    if folder_output:
        assert existing in (None, "empty", "edgekit")
        assert read_manifest(out).kind == ("onnx" if command == "export" else "engine")
    else:
        assert existing in (None, "file")
        assert out.read_text().strip()
    assert debris(work) == []


# --- the second round (a hostile recipe, device and disk): each case as it was found -------------------

@pytest.mark.parametrize("signame, code, word", [("SIGTERM", 143, "terminated (SIGTERM)"),
                                                  ("SIGHUP", 129, "hung up (SIGHUP)")])
@pytest.mark.parametrize("when", ["copy", "import:onnxruntime"])
def test_sigterm_and_sighup_stop_a_command_as_ctrl_c_does(tmp_path: Path, interrupt_setup: Path, tiny_onnx: Path,
                                                          signame: str, code: int, word: str, when: str) -> None:
    """SIGTERM had no handler: exit 143 with no message, and 5 of 8 interrupted builds left a
    hidden `.NAME.PID-*.partial` folder with a model copy until a later run into the same -o."""
    old = make_output(tmp_path / "out" / "onnx")
    before = tree_hash(tmp_path)
    snapshot = tmp_path.parent / f"{tmp_path.name}-snapshot.json"
    r = subprocess.run([sys.executable, str(interrupt_setup / "driver.py"), when, str(snapshot), str(old.parent),
                        "export", str(tiny_onnx), "-o", "out/onnx"],
                       cwd=tmp_path, env=subprocess_env(PYTHONPATH=str(interrupt_setup), EDGEKIT_TEST_SIGNAL=signame,
                                                        EDGEKIT_CACHE=str(tmp_path.parent / "cache")),
                       capture_output=True, text=True, timeout=300,
                       # a suite started under nohup ignores SIGHUP, the command inherits that and rightly
                       # keeps it ignored: the command under test starts with the default dispositions
                       preexec_fn=lambda: signal.signal(getattr(signal, signame), signal.SIG_DFL))
    assert r.returncode == code, r.stdout + r.stderr
    assert one_line_error(r.stderr) == f"error: {word}; outputs were left as they were before this command"
    assert debris(tmp_path) == [] and tree_hash(tmp_path) == before
    assert any(name.endswith(".partial") for name in json.loads(snapshot.read_text()))  # staging was under way


def test_staging_of_a_killed_process_is_removed_by_the_next_command(tmp_path: Path, interrupt_setup: Path,
                                                                     tiny_onnx: Path) -> None:
    """A process killed outright (SIGKILL: nothing of it runs) leaves its staging folder; the
    staging journal lets the next edgekit command, whatever it is, remove it."""
    cache = tmp_path / "cache"
    work = tmp_path / "w"
    work.mkdir()
    env = subprocess_env(PYTHONPATH=str(interrupt_setup), EDGEKIT_TEST_SIGNAL="SIGKILL", EDGEKIT_CACHE=str(cache))
    r = subprocess.run([sys.executable, str(interrupt_setup / "driver.py"), "copy", str(tmp_path / "snap.json"),
                        str(work / "out"), "export", str(tiny_onnx), "-o", "out/onnx"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == -9, r.stderr
    left = debris(work)
    assert len(left) == 1 and left[0].endswith(".partial") and len(os.listdir(cache / "staging")) == 1
    r = subprocess.run([sys.executable, "-m", "edgekit.cli", "targets"], cwd=tmp_path,
                       env=subprocess_env(EDGEKIT_CACHE=str(cache)), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert debris(work) == [] and os.listdir(cache / "staging") == []


def test_a_users_file_in_an_output_folder_stops_its_replacement(tmp_path: Path, tiny_onnx: Path) -> None:
    """`my_notes.txt` added to an engine folder was deleted by the next `build -o` into it:
    any folder with a readable manifest.json counted as replaceable."""
    out = tmp_path / "eng_prev"
    assert run("build", tiny_onnx, "--target", "cpu", "-o", out).exit_code == 0
    assert read_manifest(out).contents == ["inputs.npz", "manifest.json", "model.opt.onnx"]
    (out / "my_notes.txt").write_text("mine\n")
    before = tree_hash(tmp_path)
    r = run("build", tiny_onnx, "--target", "cpu", "-o", out)
    assert r.exit_code == 2, r.output
    assert one_line_error(r.stderr, r.output) == (
        f"error: output folder '{out}' already exists and holds 'my_notes.txt', which its manifest.json does not "
        "list (edgekit did not write it); edgekit replaces only its own output folders or empty ones: choose a new "
        "folder or remove it yourself")
    assert tree_hash(tmp_path) == before
    (out / "my_notes.txt").unlink()
    assert run("build", tiny_onnx, "--target", "cpu", "-o", out).exit_code == 0  # only edgekit's files: replaced


def test_an_older_manifest_lists_its_files(tmp_path: Path) -> None:
    """A folder an older edgekit wrote (no `contents`) is edgekit's when every entry is one of
    its `files` (or under one)."""
    from edgekit.artifact import not_replaceable

    folder = make_output(tmp_path / "old")
    assert not_replaceable(folder) is None
    (folder / "extra.bin").write_bytes(b"x")
    assert not_replaceable(folder) == ("holds 'extra.bin', which its manifest.json does not list (edgekit did not "
                                       "write it)")


def test_report_replaces_only_its_own_default_output(tmp_path: Path, tiny_onnx: Path) -> None:
    """`edgekit report proj2` overwrote the user's own proj2/report.md (its default output),
    while a user's report.json in the same place was refused."""
    proj = tmp_path / "proj2"
    assert run("export", tiny_onnx, "-o", proj).exit_code == 0
    (proj / "report.md").write_text("my own notes\n")
    before = tree_hash(tmp_path)
    r = run("report", proj)
    assert r.exit_code == 2, r.output
    assert one_line_error(r.stderr, r.output) == (
        f"error: {proj / 'report.md'} exists and is not an edgekit report; choose another --markdown FILE (edgekit "
        "replaces only the reports it wrote)")
    assert tree_hash(tmp_path) == before
    (proj / "report.md").unlink()
    assert run("report", proj).exit_code == 0 and run("report", proj).exit_code == 0  # its own: replaced
    assert (proj / "report.md").read_text().startswith("# edgekit report: ")
    named = tmp_path / "mine.md"
    named.write_text("the user names this file: it is replaced\n")
    assert run("report", proj, "--markdown", named).exit_code == 0 and named.read_text().startswith("# edgekit report")


@pytest.mark.parametrize("args", [["profile", "NO_ENGINE", "--json", "FIFO"], ["report", "NO_ENGINE", "--markdown", "FIFO"],
                                  ["check", "NO_ENGINE", "--budget-ms", "1", "--json", "FIFO"],
                                  ["estimate", "NO_ENGINE", "--target", "cpu", "--json", "FIFO"]])
def test_an_output_that_is_a_fifo_is_refused_before_any_work(tmp_path: Path, args: list[str]) -> None:
    """`profile --json out.fifo` and `report --markdown out.fifo` blocked forever when nothing read the
    FIFO. The engine here does not even exist: the output is refused first."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    r = run(*[str(fifo) if a == "FIFO" else str(tmp_path / "none") if a == "NO_ENGINE" else a for a in args])
    assert r.exit_code == 2, r.output
    assert one_line_error(r.stderr, r.output) == (f"error: output file '{fifo}' is a FIFO, not a regular file; give "
                                                  "the name of a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and os.listdir(tmp_path) == ["out.fifo"]


def test_an_empty_read_only_mount_point_is_refused_before_the_build(tmp_path: Path, tiny_onnx: Path) -> None:
    """An empty read-only mount point as -o failed only after the whole build (renaming a
    mount point is refused)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        r = run("build", tiny_onnx, "-o", mnt)
        assert r.exit_code == 2, r.output
        assert one_line_error(r.stderr, r.output) == (
            f"error: output folder '{mnt}' is a mount point, which edgekit cannot replace (it renames a finished "
            "output into place); give a folder inside it")
        assert sorted(os.listdir(tmp_path)) == ["mnt"]
    finally:
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True, timeout=30)


def test_dry_run_refuses_the_folders_the_run_refuses(tmp_path: Path, proj: Path) -> None:
    """`run -o /etc --dry-run` exited 0 though the real run refused; `--cache DIR` wrote 23
    entries beside a user's files in any folder."""
    recipe = _callable_recipe(tmp_path)
    before = tree_hash(proj)
    for extra, message in (
            (["-o", "src"], "error: output folder 'src' already exists and is not an edgekit run folder (no "
                            "manifest.json); edgekit works only in its own run folders or empty ones: choose a new "
                            "folder or remove it yourself"),
            (["-o", "runs/new", "--cache", "src"], "error: cache folder 'src' holds 'train.py', which is not a run "
                                                   "cache entry; give a new or empty folder, or an edgekit run cache")):
        dry, real = run("run", recipe, "--dry-run", *extra), run("run", recipe, *extra)
        assert dry.exit_code == real.exit_code == 2, (dry.output, real.output)
        assert one_line_error(dry.stderr, dry.output) == one_line_error(real.stderr, real.output) == message
    assert tree_hash(proj) == before and not (proj / "runs").exists()
    r = run("run", recipe, "-o", "runs/a", "--cache", "shared")  # a new cache folder: used, then reused
    assert r.exit_code == 0, r.output
    assert run("run", recipe, "-o", "runs/b", "--cache", "shared").exit_code == 0
    assert all(re.fullmatch(r"[a-z]+-[0-9a-f]{16}|\.locks", n) for n in os.listdir(proj / "shared"))


def test_a_full_disk_is_one_line_before_the_work(tmp_path: Path, tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch,
                                                tiny_mlp: object) -> None:
    """`compress fmnist-cnn --bits 8` onto a full 5 MB tmpfs failed after 150 s of work with a
    safetensors traceback ("No space left"); the build's disk-full line was a raw Python list.
    The free space is checked against the output's size before the work."""
    import edgekit.limits as limits

    real_usage = limits.shutil.disk_usage
    full = tmp_path / "full"
    full.mkdir()

    def usage(path: object) -> object:
        return type("U", (), {"free": 0})() if str(path).startswith(str(full)) else real_usage(path)  # type: ignore[arg-type]

    monkeypatch.setattr(limits.shutil, "disk_usage", usage)
    for args in (["export", tiny_onnx, "-o", full / "onnx"], ["build", tiny_onnx, "-o", full / "engine"]):
        r = run(*args)
        assert r.exit_code == 2, r.output
        assert re.fullmatch(rf"error: cannot write {re.escape(str(full))}/(onnx|engine): the output needs about "
                            rf"[0-9.]+ (B|KiB) and {re.escape(str(full))} has 0 B free; free some space or choose "
                            "another folder", one_line_error(r.stderr, r.output))
    from edgekit.compress import StepContext, compress
    from edgekit.errors import BadInputError

    calls: list[str] = []
    gate = importlib.import_module("edgekit.compress.quality")  # loaded on first use by the driver: load it here
    monkeypatch.setattr(gate, "measure_reference", lambda *a, **k: calls.append("work"))
    with pytest.raises(BadInputError, match=rf"^cannot write {re.escape(str(full))}/c: the output needs about "
                                            r"[0-9.]+ (B|KiB) and .* has 0 B free"):
        compress(tiny_mlp, [("half", {"dtype": "fp16"})], full / "c", StepContext(progress=False))
    assert calls == [] and os.listdir(full) == []  # refused before the reference run and the first step


def test_a_library_error_that_wraps_a_full_disk_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            tiny_mlp: object) -> None:
    """safetensors reports a full disk as its own error type ("I/O error: No space left on
    device (os error 28)"): it reads as the OS error it is, naming the output."""
    import safetensors.torch

    from edgekit.compress import StepContext, compress

    def full(*a: object, **k: object) -> None:
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_model", full)
    with pytest.raises(OSError) as e:
        compress(tiny_mlp, [("half", {"dtype": "fp16"})], tmp_path / "out", StepContext(progress=False))
    from edgekit.errors import os_error_message

    assert os_error_message(e.value) == f"cannot write {tmp_path / 'out' / 'model.safetensors'}: No space left on device"
    assert os.listdir(tmp_path) == []


def test_a_copy_that_fills_the_disk_is_one_line(tmp_path: Path) -> None:
    """The build copies an ONNX folder: a full disk there was `[('o6/model.onnx', ...)]`."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    big = numpy_helper.from_array(np.ones((512, 512), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 512])], [big])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp_path / "big.onnx"))
    assert edgekit("export", "big.onnx", "-o", "o6", cwd=tmp_path).returncode == 0
    before = tree_hash(tmp_path)

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    r = edgekit("build", "o6", "-o", "out/engine", cwd=tmp_path, preexec=small_files)
    assert r.returncode == 2, r.stderr
    assert one_line_error(r.stderr) == "error: cannot write out/engine/onnx/model.onnx: File too large"
    assert tree_hash(tmp_path) == before


def _graph_with(tmp_path: Path, name: str, **kind: object) -> Path:
    """A small ONNX file: `big_input` (10^12 elements declared), `outside` (external data
    pointing out of its folder) or `sparse` (a sparse_initializer, valid ONNX)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder = tmp_path / name
    folder.mkdir()
    if "big_input" in kind:
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1000000, 1000000])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1000000, 1000000])])
    elif "outside" in kind:
        w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
        w.data_location = TensorProto.EXTERNAL
        w.ClearField("raw_data")
        for key, value in (("location", "../secret.bin"), ("offset", "0"), ("length", "64")):
            w.external_data.add(key=key, value=value)
        (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [w])
    else:
        values = numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "w")
        sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([0, 5], np.int64), "i"), [4, 3])
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
                                  sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "model.onnx"
    onnx.save_model(model, str(path))
    return path


@pytest.mark.parametrize("kind, message", [
    ("big_input", "input 'x' declares shape (1000000, 1000000), 3.73e+03 GiB per sample (at most 2 GiB)"),
    ("outside", "tensor 'w' refers to external data '../secret.bin'; it must be a relative path inside the model's "
                "folder"),
])
def test_estimate_and_lint_read_models_as_build_does(tmp_path: Path, kind: str, message: str) -> None:
    """`estimate` and `lint` accepted a 10^12-element input and external data pointing outside
    the model's folder, which `build` refuses: all three use the same loader now."""
    path = _graph_with(tmp_path, "m", **{kind: True})
    lines = []
    for args in (["build", path, "-o", tmp_path / "e"], ["estimate", path, "--target", "jetson-agx-orin-64"],
                 ["lint", path, "--target", "jetson-agx-orin-64"]):
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        lines.append(one_line_error(r.stderr, r.output))
    assert lines == [f"error: {path}: {message}"] * 3


def test_estimate_reads_a_sparse_initializer(tmp_path: Path) -> None:
    """`estimate` on a valid ONNX file with a sparse_initializer gave a 47-line traceback
    ("Invalid model with cyclic graph"); build accepts the file, and so does estimate now."""
    path = _graph_with(tmp_path, "m", sparse=True)
    r = run("estimate", path, "--target", "cpu", "--json")
    assert r.exit_code == 0, r.output
    est = json.loads(r.stdout)
    assert est["total_ms"] > 0 and [n["op_type"] for n in est["nodes"]] == ["MatMul"]


def test_onnx_runtime_telemetry_is_off_and_nothing_is_written_outside(tmp_path: Path, tiny_onnx: Path) -> None:
    """ONNX Runtime's telemetry wrote a device id, OS, CPU and paths under ~/.cache/Microsoft/
    (and OpenVINO's a client id under ~/intel/); with a fresh HOME, builds and a profile write
    nothing there (nothing at all outside the outputs and $EDGEKIT_CACHE)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in subprocess_env(HOME=str(home), EDGEKIT_CACHE=str(home / "ekc")).items()
           if k != "ORT_DISABLE_TELEMETRY"}
    commands = [["build", str(tiny_onnx), "-o", "e"], ["profile", "e", "--duration-s", "0.05", "--iterations", "5",
                                                       "--warmup-ms", "1", "--json", "p.json"]]
    if importlib.util.find_spec("openvino") is not None:  # OpenVINO's telemetry writes ~/intel/ at its import
        commands.append(["build", str(tiny_onnx), "--runtime", "openvino", "-o", "e-ov"])
    for args in commands:
        r = subprocess.run([sys.executable, "-m", "edgekit.cli", *args], cwd=work, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    assert written == ["ekc", "ekc/staging"], written
    r = subprocess.run([sys.executable, "-c", "import os, edgekit; print(os.environ['ORT_DISABLE_TELEMETRY'])"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "1"
