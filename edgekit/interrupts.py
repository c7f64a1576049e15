"""Ctrl-C (SIGINT), SIGTERM and SIGHUP: exit 128 + the signal at any moment (130, 143, 129),
with one line and the outputs as they were, and sections that must not be cut in half.

The command line calls ``install()`` first thing. From then on each of these signals is
counted before it raises ``KeyboardInterrupt``, so one that a library swallows (some
exporters catch every exception and fall back to another path) is still seen:
``staged_dir`` refuses to commit an output once an interrupt was seen, and the CLI exits
with the first signal's status. A SIGTERM (``kill``, a CI job cancelled, a container
stopped) or a SIGHUP (the terminal closed) therefore cleans up exactly as Ctrl-C does.
``deferred()`` holds the signals back while output folders are swapped or cleaned up, so
an interrupt lands before or after such a step, never inside it. Without ``install()``
(the Python API) Python's own signal handling stays in place; ``deferred()`` still
protects the critical steps from SIGINT.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command stopped by Ctrl-C
# The signals that stop a command the way Ctrl-C does (SIGHUP where the system has it).
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
# What the one-line message says for each (SIGINT: "interrupted").
_WORDS = {getattr(signal, "SIGTERM", -1): "terminated (SIGTERM)", getattr(signal, "SIGHUP", -2): "hung up (SIGHUP)"}

_installed = False
_first: int | None = None  # the first of SIGNALS received since install(): it sets the exit status
_exiting = False  # the interrupt is being reported: further SIGINTs change nothing
_running = False  # False while the command line is still importing: nothing can have been written yet
_seen = 0  # SIGINTs, SIGTERMs and SIGHUPs received since install()
_defer_depth = 0
_pending = False
_written: list[str] = []  # outputs committed in this process (what an interrupt message must mention)


def install(*, starting: bool = False) -> None:
    """Route SIGINT through edgekit (the command line only; never at import of the API).

    starting: the program is still importing its modules; an interrupt then ends the
    process at once with exit 130 (nothing has been written), instead of a traceback.
    ``running()`` ends that phase."""
    global _installed, _running
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in SIGNALS:
        if signum != signal.SIGINT and signal.getsignal(signum) == signal.SIG_IGN:
            continue  # started under nohup (SIGHUP ignored) or the like: keep it so
        signal.signal(signum, _on_signal)
    _installed = True
    _running = not starting


def running() -> None:
    """The program's own work starts: from now on a SIGINT raises KeyboardInterrupt."""
    global _running
    _running = True


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _seen, _pending, _first
    _seen += 1
    if _first is None:
        _first = signum
    if _exiting:
        return
    if not _running:
        os.write(2, f"\nerror: {_WORDS.get(signum, 'interrupted')} during start-up; nothing was written\n".encode())
        os._exit(128 + signum)
    if _defer_depth:
        _pending = True
        return
    raise KeyboardInterrupt


def seen() -> bool:
    """Whether a SIGINT, SIGTERM or SIGHUP arrived since ``install()`` (always False without it)."""
    return _seen > 0


def exit_status() -> int:
    """The exit status of a stopped command: 128 + the first signal (130 for Ctrl-C)."""
    return 128 + _first if _first is not None else EXIT_INTERRUPTED


def is_interrupted_status(code: object) -> bool:
    """Whether ``code`` is the status ``exit_status`` gives for one of SIGNALS."""
    return isinstance(code, int) and code - 128 in SIGNALS


def raise_if_seen() -> None:
    """Raise KeyboardInterrupt when a SIGINT arrived, even one that a library swallowed."""
    if _seen:
        raise KeyboardInterrupt


def reraise(e: BaseException) -> None:
    """Raise KeyboardInterrupt when ``e`` was caused by one (a library wrapped it in its
    own error) or a SIGINT was seen: for ``except Exception`` blocks that fall back."""
    seen_ids = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen_ids:
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt
        seen_ids.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    raise_if_seen()


def note_written(path: str | os.PathLike[str]) -> None:
    _written.append(str(path))


def written() -> list[str]:
    return list(_written)


def interrupted_message() -> str:
    """What an interrupted command says: which outputs (if any) it had already completed."""
    word = _WORDS.get(_first or signal.SIGINT, "interrupted")
    if not _written:
        return f"{word}; outputs were left as they were before this command"
    shown = ", ".join(_written[-3:])
    more = f" and {len(_written) - 3} more" if len(_written) > 3 else ""
    return (f"{word}; outputs completed before the interrupt were kept ({shown}{more}), "
            "nothing half-written was left")


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT back for the duration of the block; a SIGINT that arrived meanwhile
    raises KeyboardInterrupt (or reaches the previous handler) when the block ends."""
    global _defer_depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield  # KeyboardInterrupt is only ever raised in the main thread
        return
    if _installed:
        _defer_depth += 1
        try:
            yield
        finally:
            _defer_depth -= 1
            if not _defer_depth and _pending:
                _pending = False
                raise KeyboardInterrupt
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous == signal.SIG_IGN:  # set outside Python (cannot restore) or ignored
        yield
        return
    hits: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if hits:
            signal.raise_signal(signal.SIGINT)  # delivered to the previous handler now


def exiting() -> None:
    """The command is stopping and reporting why: from now on a SIGINT (Ctrl-C pressed
    again) is only counted, so the one-line message and the exit code come out whole."""
    global _exiting
    _exiting = True


def exit_interrupted() -> None:
    """End the process with ``exit_status()`` (130 for Ctrl-C). Python would otherwise end
    it by re-raising SIGINT (no exit code) when a KeyboardInterrupt once passed through C
    code that runs Python (pybind11 modules do), even after it was handled."""
    exiting()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    atexit._run_exitfuncs()  # temporary folders, logging: what a normal exit would have done
    os._exit(exit_status())


def program_name_is(name: str) -> bool:
    """Whether this process was started as the program ``name`` (a console script)."""
    return bool(sys.argv) and Path(sys.argv[0]).name == name
