"""Locks between edgekit processes: ``folder_lock`` (``.edgekit.lock`` in a run or sweep folder,
recording the holder's PID: ``lock_holder``), ``file_lock`` (one entry of a shared cache) and
``dir_lock`` (a folder itself, while two outputs in it are swapped). Advisory ``fcntl.flock``
locks; where the platform or file system has none, work goes on unlocked."""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from edgekit.artifact.files import make_parents, os_error_at
from edgekit.errors import BadInputError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no advisory locks
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


LOCK_FILE = ".edgekit.lock"  # held by the process working in a run or sweep folder


@contextlib.contextmanager
def dir_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on a folder itself (no lock file), held while two outputs in it
    are swapped, so two processes writing the same output commit one after the other."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):  # file systems without flock: commit unlocked
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def lock_holder(folder: str | os.PathLike[str]) -> str | None:
    """The PID (as recorded) of the edgekit process holding ``folder``'s lock, else None."""
    path = Path(folder) / LOCK_FILE
    if fcntl is None or not path.is_file():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _recorded_pid(fd)
        except OSError:
            return None
        return None
    finally:
        os.close(fd)


def _recorded_pid(fd: int) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = os.pread(fd, 32, 0).decode().strip()
        if text.isdigit():
            return text
    return "unknown"


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike[str], *, wait: bool = False, hint: str = "") -> Iterator[None]:
    """Hold an exclusive advisory lock (fcntl) on an edgekit folder that a process works
    in place (a run or sweep folder), through ``LOCK_FILE`` inside it, which records the
    holder's PID. A second process gets BadInputError naming the folder and that PID, or
    with ``wait`` blocks until the first is done. The lock ends with the process, however
    it ends."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise os_error_at(e, "cannot write", path) from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _recorded_pid(fd)
                if not wait:
                    raise BadInputError(f"{str(folder)!r} is in use by another edgekit process (PID {holder}); "
                                        f"wait for it to finish{hint}, or choose another folder") from None
                log.warning("waiting for edgekit process %s, which is working in %s", holder, folder)
                fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created if missing), waiting for it: two
    processes that would derive the same cached entry make it once, one after the other."""
    path = Path(path)
    make_parents(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
