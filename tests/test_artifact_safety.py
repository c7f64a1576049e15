"""Outputs never destroy what edgekit did not write: staged_dir, atomic writes, locks,
work folders, permissions, interrupts at every step of a commit."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import threading
import time
from pathlib import Path

import pytest

from edgekit import artifact, interrupts
from edgekit.artifact import (
    LOCK_FILE,
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    check_output_dir,
    check_output_file,
    claim_work_folder,
    file_lock,
    folder_lock,
    staged_dir,
    work_folder,
    write_manifest,
)
from edgekit.errors import BadInputError


def tree_hash(root: Path) -> str:
    """Names, types, contents and permissions of everything under ``root``."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(root)}|{stat.S_IFMT(st.st_mode)}|{stat.S_IMODE(st.st_mode):o}".encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def make_output(folder: Path, payload: str = "old") -> Path:
    """An edgekit output folder (what a previous run wrote)."""
    folder.mkdir(parents=True)
    (folder / "data.txt").write_text(payload)
    write_manifest(folder, Manifest(kind="onnx", files={"data": "data.txt"}))
    return folder


def write_new(tmp: Path, payload: str = "new") -> None:
    (tmp / "data.txt").write_text(payload)
    write_manifest(tmp, Manifest(kind="onnx", files={"data": "data.txt"}))


def siblings(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# --- what may be replaced ----------------------------------------------------------------------

def test_replaces_an_edgekit_output_folder(tmp_path: Path) -> None:
    out = make_output(tmp_path / "out")
    with staged_dir(out) as tmp:
        write_new(tmp)
    assert (out / "data.txt").read_text() == "new"
    assert siblings(tmp_path) == ["out"]


def test_replaces_an_empty_folder_and_creates_a_new_one(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for name in ("empty", "a/b/new"):
        with staged_dir(tmp_path / name) as tmp:
            write_new(tmp)
        assert (tmp_path / name / "data.txt").read_text() == "new"


@pytest.mark.parametrize("content", [
    {"notes.txt": "mine"},                                     # a user's folder
    {"manifest.json": "{not json"},                            # a manifest that does not parse
    {"manifest.json": json.dumps({"kind": "poetry"})},         # another tool's manifest
    {"manifest.json": json.dumps({"kind": "onnx", "evil": 1})},  # not edgekit's schema
])
def test_refuses_a_folder_edgekit_did_not_write(tmp_path: Path, content: dict[str, str]) -> None:
    out = tmp_path / "proj"
    out.mkdir()
    for name, text in content.items():
        (out / name).write_text(text)
    before = tree_hash(tmp_path)
    with pytest.raises(BadInputError, match=r"output folder '.*proj' already exists and is not an edgekit output "
                                             r"folder .*edgekit replaces only its own output folders or empty ones"):
        with staged_dir(out) as tmp:
            write_new(tmp)
    assert tree_hash(tmp_path) == before


def test_refuses_a_file(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(BadInputError, match=r"output '.*notes.txt' is a file, not a folder; choose a new folder"):
        with staged_dir(notes):
            pass
    assert siblings(tmp_path) == ["notes.txt"] and notes.read_text() == "mine"


def test_refuses_a_parent_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError, match=r"cannot write '.*notes.txt/a/b': .*notes.txt is a file, not a folder"):
        with staged_dir(tmp_path / "notes.txt" / "a" / "b"):
            pass


def test_refuses_a_symbolic_link(tmp_path: Path) -> None:
    make_output(tmp_path / "real")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(BadInputError, match=r"output '.*link' is a symbolic link"):
        with staged_dir(tmp_path / "link"):
            pass


def test_refuses_the_working_directory_and_above(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proj = make_output(tmp_path / "proj")  # even an edgekit folder, when it is where the user works
    monkeypatch.chdir(proj)
    before = tree_hash(tmp_path)
    for out, message in ((".", r"output folder '\.' is the working directory"),
                         (str(proj), r"output folder '.*proj' is the working directory"),
                         ("..", r"output folder '\.\.' contains the working directory"),
                         ("sub/../..", r"output folder 'sub/\.\./\.\.' contains the working directory")):
        with pytest.raises(BadInputError, match=message):
            with staged_dir(out):
                pass
    assert tree_hash(tmp_path) == before


def test_refuses_the_input_a_folder_holding_it_and_a_folder_inside_it(tmp_path: Path) -> None:
    model = make_output(tmp_path / "art" / "model")
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"onnx")
    cases = [(model, model, "is the input"), (tmp_path / "art", model, "contains the input"),
             (model / "sub", model, "is inside the input folder"), (onnx_file, onnx_file, "is the input")]
    for out, inp, message in cases:
        with pytest.raises(BadInputError, match=message):
            check_output_dir(out, protect=(str(inp), "fmnist-cnn", None))
    check_output_dir(tmp_path / "elsewhere", protect=(str(model), "pkg.mod:fn", None))  # specs that are not paths


def test_refuses_an_edgekit_folder_another_process_works_in(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with claim_work_folder(run, "run"):
        with pytest.raises(BadInputError, match=rf"is in use by another edgekit process \(PID {os.getpid()}\)"):
            check_output_dir(run)
    check_output_dir(run)  # free again


# --- nothing half-written, whatever happens ------------------------------------------------------

@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_a_failure_leaves_the_old_output_and_no_debris(tmp_path: Path, error: BaseException) -> None:
    out = make_output(tmp_path / "out")
    before = tree_hash(tmp_path)
    with pytest.raises(type(error)):
        with staged_dir(out) as tmp:
            write_new(tmp)
            raise error
    assert tree_hash(tmp_path) == before


def test_a_failure_removes_the_parents_it_created(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        with staged_dir(tmp_path / "a" / "b" / "out"):
            raise RuntimeError("boom")
    assert siblings(tmp_path) == []


def test_an_unnamed_os_error_names_the_output(tmp_path: Path) -> None:
    with pytest.raises(OSError) as info:
        with staged_dir(tmp_path / "out"):
            raise OSError(28, "No space left on device")
    assert info.value.filename == str(tmp_path / "out") and info.value.what == "cannot write"
    assert siblings(tmp_path) == []


def _signal_on_call(monkeypatch: pytest.MonkeyPatch, name: str, n: int) -> list[int]:
    """Send a real SIGINT to this process just before the ``n``-th call of ``os.<name>``."""
    real = getattr(os, name)
    calls = [0]

    def wrapped(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == n:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, wrapped)
    return calls


@pytest.mark.parametrize("cli_handler", [False, True])
@pytest.mark.parametrize("where", [("listdir", 1), ("open", 1), ("rename", 1), ("rename", 2), ("unlink", 1),
                                   ("rmdir", 1)])
@pytest.mark.usefixtures("python_sigint")
def test_sigint_at_any_step_of_the_swap_leaves_old_or_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          where: tuple[str, int], cli_handler: bool) -> None:
    """A real SIGINT during the commit: held back until the swap is done, so the folder
    is the old one or the new one (complete), and nothing is left beside it."""
    out = make_output(tmp_path / "out")
    old = tree_hash(out)
    if cli_handler:
        monkeypatch.setattr(interrupts, "_installed", True)
        monkeypatch.setattr(interrupts, "_running", True)
        monkeypatch.setattr(interrupts, "_seen", 0)
        previous = signal.signal(signal.SIGINT, interrupts._on_signal)
    try:
        with pytest.raises(KeyboardInterrupt):
            with staged_dir(out) as tmp:
                write_new(tmp)
                calls = _signal_on_call(monkeypatch, *where)
        monkeypatch.undo()
    finally:
        if cli_handler:
            signal.signal(signal.SIGINT, previous)
    assert calls[0] >= 1
    assert siblings(tmp_path) == ["out"]
    assert tree_hash(out) == old or (out / "data.txt").read_text() == "new"
    artifact.read_manifest(out)


def test_a_sigint_the_block_swallowed_still_stops_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library that catches the KeyboardInterrupt (some exporters do) cannot make the
    command commit: the CLI's handler counts every SIGINT."""
    out = make_output(tmp_path / "out")
    before = tree_hash(tmp_path)
    monkeypatch.setattr(interrupts, "_installed", True)
    monkeypatch.setattr(interrupts, "_running", True)
    monkeypatch.setattr(interrupts, "_seen", 0)
    previous = signal.signal(signal.SIGINT, interrupts._on_signal)
    try:
        with pytest.raises(KeyboardInterrupt):
            with staged_dir(out) as tmp:
                write_new(tmp)
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass  # swallowed
    finally:
        signal.signal(signal.SIGINT, previous)
    assert tree_hash(tmp_path) == before


def test_debris_of_a_killed_process_is_recovered(tmp_path: Path) -> None:
    """SIGKILL between the two renames of a swap: the next run puts the old output back
    and removes the rest (only names staged_dir makes, only of dead processes)."""
    dead = 2**22 + 12345  # above pid_max's default: no such process
    old = make_output(tmp_path / f".out.{dead}-abc123.old", "old")
    (tmp_path / f".out.{dead}-zz_9.partial").mkdir()
    (tmp_path / ".out.notes").write_text("not ours")
    (tmp_path / f".out.{os.getpid()}-live.partial").mkdir()  # a live process's staging: left alone
    with staged_dir(tmp_path / "out") as tmp:
        assert (tmp_path / "out" / "data.txt").read_text() == "old"  # recovered before the new one is made
        assert not old.exists()
        write_new(tmp)
    assert siblings(tmp_path) == [f".out.{os.getpid()}-live.partial", ".out.notes", "out"]


# --- permissions follow the umask -------------------------------------------------------------

@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_outputs_get_the_umask_permissions(tmp_path: Path, mask: int) -> None:
    old_mask = os.umask(mask)
    try:
        assert artifact.umask() == mask
        with staged_dir(tmp_path / "out") as tmp:
            write_new(tmp)
        atomic_write_json(tmp_path / "verdict.json", {"passed": True})
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "out" / MANIFEST_NAME).stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "verdict.json").stat().st_mode) == 0o666 & ~mask


MANIFEST_NAME = artifact.MANIFEST


def test_files_a_library_wrote_0600_get_the_umask_permissions(tmp_path: Path) -> None:
    """safetensors and others write through temporary files (0600); outputs follow the umask."""
    old_mask = os.umask(0o022)
    try:
        with staged_dir(tmp_path / "out") as tmp:
            write_new(tmp)
            (tmp / "sub").mkdir(mode=0o700)
            for name, mode in (("weights.safetensors", 0o600), ("sub/build.sh", 0o700)):
                (tmp / name).write_text("x")
                (tmp / name).chmod(mode)
    finally:
        os.umask(old_mask)
    modes = {p.relative_to(tmp_path / "out").as_posix(): stat.S_IMODE(p.stat().st_mode)
             for p in (tmp_path / "out").rglob("*")}
    assert modes == {"data.txt": 0o644, "manifest.json": 0o644, "sub": 0o755, "weights.safetensors": 0o644,
                     "sub/build.sh": 0o755}


def test_replacing_a_file_keeps_its_permissions(tmp_path: Path) -> None:
    path = tmp_path / "report.md"
    path.write_text("old")
    path.chmod(0o640)
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and stat.S_IMODE(path.stat().st_mode) == 0o640


# --- single-file outputs --------------------------------------------------------------------------

def test_single_file_outputs(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    art = make_output(tmp_path / "art")
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    before = tree_hash(tmp_path)
    with pytest.raises(BadInputError, match=r"output file '.*folder' is a folder; give a file name"):
        atomic_write_json(tmp_path / "folder", {})
    with pytest.raises(BadInputError, match=r"cannot write '.*notes.txt/v.json': .*notes.txt is a file, not a folder"):
        atomic_write_json(tmp_path / "notes.txt" / "v.json", {})
    with pytest.raises(BadInputError, match=r"output file '.*profile.json' is the input"):
        atomic_write_json(profile, {}, protect=(str(profile),))
    for name in ("manifest.json", "data.txt"):
        with pytest.raises(BadInputError, match=r"belongs to the edgekit output folder"):
            atomic_write_json(art / name, {}, protect=())
    assert tree_hash(tmp_path) == before
    atomic_write_json(tmp_path / "notes.txt", {"ok": 1}, protect=(str(profile),))  # the file the user named
    assert json.loads((tmp_path / "notes.txt").read_text()) == {"ok": 1}
    assert check_output_file(art / "report.md", protect=(str(art),)) == (art / "report.md").resolve()


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as info:
        atomic_write_bytes(tmp_path / "new" / "x.json", b"{}")
    assert info.value.filename == str((tmp_path / "new" / "x.json").resolve())
    assert siblings(tmp_path) == []


# --- work folders and locks -----------------------------------------------------------------------

def test_work_folder_must_be_a_folder(tmp_path: Path) -> None:
    (tmp_path / "out.work").write_text("mine")
    with pytest.raises(BadInputError, match=r"checkpoint folder '.*out.work' exists and is not a folder"):
        work_folder(tmp_path / "out")
    assert work_folder(tmp_path / "other") == tmp_path / "other.work"


def test_claim_work_folder(tmp_path: Path) -> None:
    with claim_work_folder(tmp_path / "runs" / "a", "run") as folder:
        assert artifact.read_manifest(folder).kind == "run"
        assert (folder / LOCK_FILE).read_text().strip() == str(os.getpid())
    user = tmp_path / "mine"
    user.mkdir()
    (user / "results.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match=r"output folder '.*mine' already exists and is not an edgekit run folder "
                                             r"\(no manifest.json\); edgekit works only in its own run folders"):
        with claim_work_folder(user, "run"):
            pass
    with pytest.raises(BadInputError, match=r"already exists and is an edgekit run folder"):
        with claim_work_folder(tmp_path / "runs" / "a", "sweep"):
            pass
    legacy = tmp_path / "legacy"  # a run folder written before runs carried a manifest
    legacy.mkdir()
    (legacy / "results.json").write_text(json.dumps({"recipe": {}, "stages": []}))
    with claim_work_folder(legacy, "run"):
        pass
    assert artifact.read_manifest(legacy).kind == "run"


def test_folder_lock_names_the_holder_or_waits(tmp_path: Path) -> None:
    tmp_path.joinpath("run").mkdir()
    with folder_lock(tmp_path / "run"):
        with pytest.raises(BadInputError, match=rf"'.*run' is in use by another edgekit process \(PID {os.getpid()}\); "
                                                 r"wait for it to finish, or choose another folder"):
            with folder_lock(tmp_path / "run"):
                pass
    order: list[str] = []
    held = threading.Event()

    def holder() -> None:
        with folder_lock(tmp_path / "run"):
            held.set()
            time.sleep(0.3)
            order.append("first done")

    t = threading.Thread(target=holder)
    t.start()
    held.wait()
    with folder_lock(tmp_path / "run", wait=True):
        order.append("second")
    t.join()
    assert order == ["first done", "second"]


def test_file_lock_makes_a_cached_entry_once(tmp_path: Path) -> None:
    built: list[int] = []
    entry = tmp_path / "cache" / "entry"

    def get() -> None:
        with file_lock(tmp_path / "cache" / ".locks" / "entry"):
            if not entry.exists():
                time.sleep(0.1)
                with staged_dir(entry) as tmp:
                    write_new(tmp)
                built.append(1)

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert built == [1] and (entry / "data.txt").read_text() == "new"


def test_engine_cache_stores_whole_entries_concurrently(tmp_path: Path) -> None:
    """Two builds storing the same engine used to share one `.partial` folder and delete
    each other's files; now each entry is whole, and only the cache's own entries are
    replaced."""
    from edgekit.runtimes.tensorrt.engine_cache import ENGINE_FILE, EngineCache, EngineKey

    cache = EngineCache(tmp_path / "cache")
    key = EngineKey("10.3", "Orin", "sm_87", "fp16")
    plans = []
    for i in range(4):
        plans.append(tmp_path / f"plan{i}")
        plans[-1].write_bytes(bytes([i]) * 100_000)
    errors: list[BaseException] = []

    def store(plan: Path) -> None:
        try:
            cache.store(key, {ENGINE_FILE: plan})
        except BaseException as e:  # collected: a thread's exception would not fail the test
            errors.append(e)

    threads = [threading.Thread(target=store, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    entry = cache.lookup(key)
    assert entry is not None and (entry / ENGINE_FILE).read_bytes() in {p.read_bytes() for p in plans}
    assert sorted(os.listdir(cache.root)) == [".locks", entry.name]


@pytest.mark.parametrize("kind", ["fifo", "socket", "/dev/null", "/proc/version"])
def test_special_files_are_refused_as_outputs(tmp_path: Path, kind: str) -> None:
    """`profile --json out.fifo` blocked forever when nothing read the FIFO, and `--json
    /dev/null` wrote into a device: an output is a regular file or a new name, nothing else
    (the device is never replaced by a regular file either)."""
    import socket

    path = tmp_path / kind if not kind.startswith("/") else Path(kind)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    before = os.stat(path).st_mode
    with pytest.raises(BadInputError, match=rf"output file '{path}' is a (FIFO|socket|system path), not a regular file"):
        atomic_write_json(path, {"ok": 1}, protect=())
    assert os.stat(path).st_mode == before
    assert siblings(tmp_path) == ([kind] if not kind.startswith("/") else [])


@pytest.mark.parametrize("error, message", [
    (PermissionError(13, "Permission denied", "/ci/out"), "cannot access /ci/out: Permission denied"),
    (OSError(28, "No space left on device", "/ci/out/model.onnx"), "cannot write /ci/out/model.onnx: No space left on device"),
    (OSError(30, "Read-only file system", "/mnt/ro/x"), "cannot write /mnt/ro/x: Read-only file system"),
    (NotADirectoryError(20, "Not a directory", "notes.txt/x"), "cannot use notes.txt/x: Not a directory"),
    (OSError(18, "Invalid cross-device link", "a", None, "b"), "cannot access a -> b: Invalid cross-device link"),
    (FileNotFoundError(2, "No such file or directory", "new\nline"), "cannot access 'new\\nline': No such file or directory"),
    (OSError(28, "No space left on device"), "file system error: No space left on device"),
])
def test_os_error_message_is_one_line(error: OSError, message: str) -> None:
    from edgekit.errors import os_error_message

    assert os_error_message(error) == message
