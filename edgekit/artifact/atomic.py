"""Atomic outputs: files and folders written so that nothing half-written is ever left, and
nothing edgekit did not write is replaced.

Every step (compress, export, build, profile, run) writes one folder holding its
files and a ``manifest.json``: what kind of artifact it is, the inputs and their
hashes, the step's config, the package versions and the metrics. A later step takes
the folder as its input, so a run can be reproduced, cached and resumed from
manifests alone.

Writes are atomic: a file is written to a temporary sibling and renamed; a folder is
staged as a temporary sibling and renamed into place only when the step succeeded,
so an interrupted or failed step never leaves a half-written output.

Outputs never destroy what edgekit did not write: an existing output folder is replaced
only when it is empty or an edgekit output folder holding nothing but what its manifest
lists (a file a user added to it stops the replacement), and never when it is, holds or
lies inside the working directory or the command's input. Outputs are regular files and
folders only: a FIFO, a device or a mount point is refused before any work. New files and
folders get the permissions the umask gives.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from edgekit import interrupts
from edgekit.artifact.files import make_parents, os_error_at, remove_empty
from edgekit.artifact.locks import dir_lock, folder_lock, lock_holder
from edgekit.artifact.manifest import (
    MANIFEST,
    SCHEMA_VERSION,
    Manifest,
    machine_info,
    now_iso,
    package_versions,
    read_manifest,
)
from edgekit.errors import BadInputError, shown_path
from edgekit.limits import require_disk
from edgekit.paths import staging_journal_path

_open_stages = 0  # staged_dir blocks open in this process


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, protect: Iterable[object] | None = None) -> Path:
    """Write ``data`` to ``path`` through a temporary sibling and a rename: readers see
    the old file or the new one, never part of either. A file that exists keeps its
    permissions; a new one gets the umask's. ``path`` may not be a folder.

    protect: for a file the user named (``--json``, ``-o``), the command's inputs: then
    ``path`` also may not be one of them or a file an edgekit folder's manifest records."""
    path = check_output_file(path, protect) if protect is not None else _plain_output_file(path)
    state: dict[str, Any] = {"tmp": None, "created": [], "done": False}

    def discard() -> None:
        if state["tmp"] is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(state["tmp"])
            state["tmp"] = None
        if not state["done"]:
            remove_empty(state["created"])
            state["created"] = []

    try:
        with interrupts.deferred():
            state["created"] = make_parents(path.parent)
            fd, state["tmp"] = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _file_mode(path))
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        interrupts.raise_if_seen()
        with interrupts.deferred():
            os.replace(state["tmp"], path)
            state["tmp"], state["done"] = None, True
    except OSError as e:
        if e.filename is not None and e.filename != state["tmp"]:
            raise
        raise os_error_at(e, "cannot write", path) from None
    finally:
        _settle(discard)
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str, *, protect: Iterable[object] | None = None) -> Path:
    return atomic_write_bytes(path, text.encode(), protect=protect)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, protect: Iterable[object] | None = None) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n",
                             protect=protect)


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    try:  # numpy scalars and arrays
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike[str], protect: Iterable[object] = (),
               own_entry: Callable[[Path], bool] | None = None, expected_bytes: float = 0) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` only if the block succeeds.

    ``out`` is checked first (``check_output_dir``): it must be new, empty or an edgekit
    output folder holding only what its manifest lists, and may not be, hold or lie inside
    the working directory or an input named in ``protect`` (paths or specs; those that are
    not existing paths are ignored); ``expected_bytes`` must fit on its file system.
    The old ``out`` is replaced only after the new one is complete; its manifest records
    every entry the new folder holds (``contents``). On any exception, KeyboardInterrupt
    included, and when a SIGINT, SIGTERM or SIGHUP was seen during the block, ``out`` is
    left as it was and nothing is left beside it: interrupts are held back while the
    folders are swapped and cleaned up. A process killed outright leaves its staging
    folder recorded in the staging journal, and the next edgekit command removes it
    (``recover_abandoned_outputs``). own_entry: how a cache recognises its own entries
    (which carry no manifest) so they may be replaced too.
    """
    global _open_stages
    given = Path(out)
    final = check_output_dir(given, protect, own_entry, expected_bytes=expected_bytes)
    _recover_debris(final)
    stage = _Stage(final)
    _open_stages += 1
    try:
        with interrupts.deferred():
            stage.begin()
        try:
            yield stage.path
        except OSError as e:
            raise _in_output(e, stage.path, given) from None
        apply_umask(stage.path)  # libraries that write through temporary files leave 0600 behind
        _record_contents(stage.path)
        interrupts.raise_if_seen()  # a SIGINT that the block's libraries swallowed: do not commit
        with interrupts.deferred(), dir_lock(final.parent):
            check_output_dir(given, protect, own_entry)  # again: the folder may have changed meanwhile
            stage.commit()
            if _open_stages == 1:  # not a folder inside another staged output
                interrupts.note_written(given)
    finally:
        _open_stages -= 1
        _settle(stage.finish)


class _Stage:
    """The staging folder of one ``staged_dir``; every step is idempotent, so a cleanup
    cut short by a second interrupt is simply run again."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.tmp: Path | None = None
        self.old: Path | None = None
        self.created: list[Path] = []
        self.committed = False
        self.journal: Path | None = None

    @property
    def path(self) -> Path:
        if self.tmp is None:
            raise RuntimeError("the staging folder is gone")  # an invariant, not user input
        return self.tmp

    def begin(self) -> None:
        self.created = make_parents(self.final.parent)
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.{os.getpid()}-", suffix=".partial",
                                             dir=self.final.parent))
        except OSError as e:
            raise os_error_at(e, "cannot create a folder in", self.final.parent) from None
        os.chmod(self.tmp, 0o777 & ~umask())  # mkdtemp makes it 0700
        self.journal = _journal_add(self.final)

    def commit(self) -> None:
        if os.path.lexists(self.final):
            old = self.final.parent / f".{self.final.name}.{os.getpid()}-{secrets.token_hex(4)}.old"
            os.rename(self.final, old)
            self.old = old
        os.rename(self.path, self.final)
        self.tmp, self.committed = None, True

    def finish(self) -> None:
        if self.old is not None and os.path.lexists(self.old):
            if not self.committed and not os.path.lexists(self.final):
                os.rename(self.old, self.final)  # the swap failed half-way: put the old output back
            else:
                shutil.rmtree(self.old, ignore_errors=True)
        self.old = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if not self.committed:
            remove_empty(self.created)
            self.created = []
        if self.journal is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.journal)
            self.journal = None


def _record_contents(folder: Path) -> None:
    """Write the folder's entries into its manifest (``contents``), the record that lets a
    later command replace the folder knowing that nothing in it is someone else's."""
    if not (folder / MANIFEST).is_file():
        return  # a cache entry without a manifest (its own_entry rule applies)
    manifest = read_manifest(folder)
    manifest.contents, manifest.schema = sorted(os.listdir(folder)), SCHEMA_VERSION
    atomic_write_json(folder / MANIFEST, manifest.to_dict())


def _journal_add(final: Path) -> Path | None:
    """Record that this process stages ``final`` (best effort: without a writable cache the
    staging folder is still removed by this process, or by the next write to ``final``)."""
    try:
        journal = staging_journal_path()
        journal.mkdir(parents=True, exist_ok=True)
        entry = journal / f"{os.getpid()}-{secrets.token_hex(6)}.json"
        with open(entry, "x") as f:
            json.dump({"pid": os.getpid(), "output": str(final)}, f)
        return entry
    except OSError:
        return None


def recover_abandoned_outputs() -> list[str]:
    """Remove the staging folders of processes that died without cleaning up (SIGKILL,
    power loss), as recorded in the staging journal, and put back an output whose swap
    they cut; returns the outputs recovered. Entries of live processes are left alone."""
    recovered: list[str] = []
    try:
        entries = sorted(staging_journal_path().iterdir())
    except OSError:
        return recovered
    for entry in entries:
        m = re.fullmatch(r"(\d+)-[0-9a-f]+\.json", entry.name)
        if m is None or _alive(int(m[1])):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            output = Path(json.loads(entry.read_text())["output"])
            _recover_debris(output)
            recovered.append(str(output))
        with contextlib.suppress(OSError):
            os.unlink(entry)
    return recovered


def _settle(step: Callable[[], None]) -> None:
    """Run a cleanup step with SIGINT held back; a SIGINT that slipped in before the hold
    began runs the (idempotent) step again, then propagates."""
    interrupted = False
    for _ in range(100):
        try:
            with interrupts.deferred():
                step()
            break
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        raise KeyboardInterrupt


def _recover_debris(final: Path) -> None:
    """Staging debris of ``final`` left by a process that was killed outright (SIGKILL,
    power loss): put an old output back if the swap was cut, remove the rest. Only names
    that ``staged_dir`` makes, and only of processes that are gone."""
    pattern = re.compile(rf"\.{re.escape(final.name)}\.(\d+)-[a-z0-9_]+\.(partial|old)")
    try:
        names = os.listdir(final.parent)
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or _alive(int(m[1])):
            continue
        debris = final.parent / name
        with contextlib.suppress(OSError):
            if m[2] == "old" and not os.path.lexists(final):
                os.rename(debris, final)
            else:
                shutil.rmtree(debris)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the permissions the umask gives new files
    (executables stay executable), whatever the writing library chose."""
    mask = umask()
    for dirpath, _subdirs, filenames in os.walk(folder):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, (0o777 if st.st_mode & stat.S_IXUSR else 0o666) & ~mask)


def _file_mode(path: Path) -> int:
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)  # replacing a file keeps its permissions
    return 0o666 & ~umask()


def _in_output(e: OSError, staging: Path, given: Path) -> OSError:
    """An OSError from a staged block, naming the output (``given``/...) instead of the
    temporary staging folder; errors about other paths (an input) are kept as they are."""
    if e.filename is None:
        return os_error_at(e, "cannot write", given)
    for name in (e.filename2, e.filename):  # a copy's destination is filename2
        if name is None:
            continue
        try:
            rel = Path(os.fsdecode(name)).relative_to(staging)
        except (ValueError, TypeError):
            continue
        return os_error_at(e, "cannot write", given / rel if rel.parts else given)
    return e


def copy_tree(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy folder ``src`` to ``dst`` (new, or merged into), regular files and folders only;
    the first OSError is raised as it is (``shutil.copytree`` gathers them into one
    ``shutil.Error`` whose message is a list), so a full disk reads as one line."""
    src, dst = Path(src), Path(dst)
    os.makedirs(dst, exist_ok=True)
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        target = dst / entry.name
        if entry.is_dir(follow_symlinks=False):
            copy_tree(entry.path, target)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, target)
            shutil.copymode(entry.path, target)


def _existing_paths(candidates: Iterable[object]) -> list[tuple[str, Path]]:
    """(as given, real path) for the candidates that are existing files or folders."""
    out = []
    for c in candidates:
        if isinstance(c, (str, os.PathLike)) and os.fspath(c) and os.path.exists(c):
            out.append((os.fspath(c), Path(os.path.realpath(c))))
    return out


def _check_location(given: Path, real: Path, protect: Iterable[object], what: str) -> None:
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd:
        raise BadInputError(f"{what} {str(given)!r} is the working directory; choose a new folder")
    if real in cwd.parents:
        raise BadInputError(f"{what} {str(given)!r} contains the working directory {shown_path(cwd)}; "
                            "choose a new folder")
    for name, p in _existing_paths(protect):
        if real == p:
            raise BadInputError(f"{what} {str(given)!r} is the input {name!r}; choose another output")
        if real in p.parents:
            raise BadInputError(f"{what} {str(given)!r} contains the input {name!r}; choose another output")
        if p.is_dir() and p in real.parents:
            raise BadInputError(f"{what} {str(given)!r} is inside the input folder {name!r}; choose another output")
    p = real.parent
    while not os.path.lexists(p):
        p = p.parent
    if not p.is_dir():
        raise BadInputError(f"cannot write {str(given)!r}: {shown_path(p)} is a file, not a folder")


def check_output_dir(out: str | os.PathLike[str], protect: Iterable[object] = (),
                     own_entry: Callable[[Path], bool] | None = None, expected_bytes: float = 0) -> Path:
    """The real path of output folder ``out`` if edgekit may write it, else BadInputError.

    Refused: a symbolic link; the working directory, a folder holding it; an input in
    ``protect`` (paths or specs), a folder holding one, a folder inside an input folder;
    a path whose parent is a file; an existing file, FIFO, device or socket; a mount point
    (an output is replaced by renaming, which a mount point refuses: the build would fail
    at its end); an existing folder that is neither empty nor an edgekit output folder
    holding only what its manifest lists (no flag overrides this: edgekit never deletes
    what it did not write); an edgekit folder another edgekit process is working in; a
    file system without ``expected_bytes`` free."""
    given = Path(out)
    if not os.fspath(out):
        raise BadInputError("the output folder is an empty path")
    if os.path.islink(given):
        raise BadInputError(f"output {str(given)!r} is a symbolic link; give the folder it points to")
    real = Path(os.path.realpath(given))
    _check_location(given, real, protect, "output folder")
    if os.path.lexists(real):
        kind = _file_kind(real)
        if kind != "folder":
            raise BadInputError(f"output {str(given)!r} is a {kind}, not a folder; choose a new folder")
        if os.path.ismount(real):
            raise BadInputError(f"output folder {str(given)!r} is a mount point, which edgekit cannot replace "
                                "(it renames a finished output into place); give a folder inside it")
        why = None if own_entry is not None and own_entry(real) else not_replaceable(real)
        if why:
            raise BadInputError(f"output folder {str(given)!r} already exists and {why}; edgekit replaces only "
                                "its own output folders or empty ones: choose a new folder or remove it yourself")
    if expected_bytes:
        require_disk(real, expected_bytes, "the output")
    return real


# Hidden names edgekit itself leaves in a folder it works in: the lock of a run or sweep
# folder, and the temporary siblings of atomic writes and staged folders.
_OWN_HIDDEN = re.compile(r"\.edgekit\.lock|\..+\.[a-z0-9_]{8}\.tmp|\..+\.\d+-[a-z0-9_]+\.(partial|old)")


def own_hidden_entry(name: str) -> bool:
    """Whether ``name`` is a hidden entry edgekit itself leaves in a folder it writes in."""
    return _OWN_HIDDEN.fullmatch(name) is not None


def not_replaceable(folder: Path) -> str | None:
    """Why edgekit may not replace an existing ``folder`` (None when it may): it must be
    empty, or an edgekit output folder every entry of which its manifest lists."""
    try:
        entries = os.listdir(folder)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if not entries:
        return None
    if MANIFEST not in entries:
        return f"is not an edgekit output folder (no {MANIFEST})"
    try:
        manifest = read_manifest(folder)
    except BadInputError as e:
        return f"is not an edgekit output folder ({e})"
    except OSError as e:
        return f"is not an edgekit output folder ({MANIFEST} cannot be read: {e.strerror})"
    listed = {MANIFEST, *manifest.contents, *(Path(rel).parts[0] for rel in manifest.files.values())}
    foreign = sorted(e for e in entries if e not in listed and not own_hidden_entry(e))
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        return (f"holds {shown_path(foreign[0])!r}{more}, which its {MANIFEST} does not list (edgekit did not "
                "write it)")
    holder = lock_holder(folder)
    if holder is not None:
        return f"is in use by another edgekit process (PID {holder})"
    if not os.access(folder, os.W_OK):
        return "is read-only"
    return None


def _file_kind(path: str | os.PathLike[str]) -> str:
    """``file``, ``folder``, ``FIFO``, ``socket``, ``character device``, ``block device``
    (what ``path`` is, following links) or ``missing``."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "missing"
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _plain_output_file(path: str | os.PathLike[str]) -> Path:
    """An output file is a regular file or a new name: a FIFO (nothing may read it: the
    command would block), a device, a socket, or a name under /dev, /proc or /sys is
    refused before any work, like a folder."""
    given = Path(path)
    if not os.fspath(path):
        raise BadInputError("the output file is an empty path")
    real = Path(os.path.realpath(given))
    kind = _file_kind(real)
    if real.is_dir():
        raise BadInputError(f"output file {str(given)!r} is a folder; give a file name")
    system = str(real).startswith(("/dev/", "/proc/", "/sys/"))
    if kind not in ("file", "missing") or system:
        raise BadInputError(f"output file {str(given)!r} is {'a system path' if system else 'a ' + kind}, "
                            "not a regular file; give the name of a regular file")
    p = real.parent
    while not os.path.lexists(p):
        p = p.parent
    if not p.is_dir():
        raise BadInputError(f"cannot write {str(given)!r}: {shown_path(p)} is a file, not a folder")
    return real


def check_output_file(path: str | os.PathLike[str], protect: Iterable[object] = ()) -> Path:
    """The real path of output file ``path`` if edgekit may write it, else BadInputError.
    Overwriting the file the user named is fine; a folder, an input in ``protect`` or a
    file recorded in an edgekit output folder's manifest is refused. A symbolic link is
    followed (the file it points to is written)."""
    given = Path(path)
    real = _plain_output_file(path)
    for name, p in _existing_paths(protect):
        if real == p:
            raise BadInputError(f"output file {str(given)!r} is the input {name!r}; choose another output")
    if real.exists() and _recorded_in_folder(real):
        raise BadInputError(f"output file {str(given)!r} belongs to the edgekit output folder "
                            f"{str(real.parent)!r}; choose another file")
    return real


def _recorded_in_folder(path: Path) -> bool:
    """Whether ``path`` is the manifest or a file recorded in it, of an edgekit folder."""
    if not (path.parent / MANIFEST).is_file():
        return False
    try:
        m = read_manifest(path.parent)
    except (BadInputError, OSError):
        return False
    return path.name == MANIFEST or path.name in {f for f in m.files.values() if "/" not in f}


# Folders that runs and sweeps wrote before they carried a manifest: file -> keys it holds.
_LEGACY_RECORDS = {"run": ("results.json", ("recipe", "stages")), "sweep": ("sweep.json", ("grid", "rows"))}


def _folder_kind(folder: Path) -> str | None:
    """The edgekit kind of an existing folder (its manifest's, or a run or sweep folder
    recognised by its results), None when it is not edgekit's."""
    if (folder / MANIFEST).is_file():
        try:
            return read_manifest(folder).kind
        except (BadInputError, OSError):
            return None
    for kind, (name, keys) in _LEGACY_RECORDS.items():
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((folder / name).read_text())
            if isinstance(data, dict) and all(k in data for k in keys):
                return kind
    return None


def work_folder(out: str | os.PathLike[str]) -> Path:
    """Where a long command keeps checkpoints between attempts: ``<out>.work`` beside
    the output. BadInputError when something other than a folder has that name."""
    work = Path(f"{os.fspath(out)}.work")
    if os.path.lexists(work) and (os.path.islink(work) or not work.is_dir()):
        raise BadInputError(f"checkpoint folder {str(work)!r} exists and is not a folder; "
                            "move it away or choose another output")
    return work


def claim_work_folder(out: str | os.PathLike[str], kind: str, *, wait: bool = False,
                      protect: Iterable[object] = (), hint: str = "") -> contextlib.AbstractContextManager[Path]:
    """Lock and return folder ``out`` that a process fills in place (a run or sweep
    folder). It must be new, empty or an edgekit folder of this ``kind``; a new one gets a
    manifest at once, so that an interrupted first run is still recognised as edgekit's."""
    return _claim(out, kind, wait, tuple(protect), hint)


def check_work_folder(out: str | os.PathLike[str], kind: str, protect: Iterable[object] = ()) -> Path:
    """The real path of folder ``out`` if a process may fill it in place as a ``kind`` folder
    (``claim_work_folder``): new, empty (and writable) or an edgekit folder of that kind;
    not a link, a file, the working directory or an input; else BadInputError.
    ``edgekit run --dry-run`` checks its run folder with this, as the run does."""
    given = Path(out)
    if not os.fspath(out):
        raise BadInputError(f"the {kind} folder is an empty path")
    if os.path.islink(given):
        raise BadInputError(f"output {str(given)!r} is a symbolic link; give the folder it points to")
    real = Path(os.path.realpath(given))
    _check_location(given, real, protect, f"{kind} folder")
    kind_here = _file_kind(real)
    if kind_here not in ("folder", "missing"):
        raise BadInputError(f"output {str(given)!r} is a {kind_here}, not a folder; choose a new folder")
    if real.is_dir() and os.listdir(real):
        found = _folder_kind(real)
        if found != kind:
            what = f"an edgekit {found} folder" if found else f"not an edgekit {kind} folder (no {MANIFEST})"
            raise BadInputError(f"output folder {str(given)!r} already exists and is {what}; edgekit works only in "
                                f"its own {kind} folders or empty ones: choose a new folder or remove it yourself")
    elif real.is_dir() and not os.access(real, os.W_OK):
        raise BadInputError(f"output folder {str(given)!r} is read-only; choose another folder")
    return real


@contextlib.contextmanager
def _claim(out: str | os.PathLike[str], kind: str, wait: bool, protect: tuple[object, ...], hint: str) -> Iterator[Path]:
    real = check_work_folder(out, kind, protect)
    make_parents(real)
    with folder_lock(real, wait=wait, hint=hint):
        if not (real / MANIFEST).is_file():
            write_manifest(real, Manifest(kind=kind))
        yield real


def write_manifest(folder: str | os.PathLike[str], manifest: Manifest) -> Path:
    if not manifest.created:
        manifest.created = now_iso()
    if not manifest.versions:
        manifest.versions = package_versions()
    if not manifest.machine:
        manifest.machine = machine_info()
    return atomic_write_json(Path(folder) / MANIFEST, manifest.to_dict())
