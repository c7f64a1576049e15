"""Progress for long work: rich bars on a terminal, plain timed lines in logs, off when asked.

On a terminal, a rich bar. Elsewhere (CI logs, pipes, nohup) one line per phase and, while
work goes on, a line at least every 30 s with the elapsed time and an estimate of what
remains, printed by a heartbeat thread, so a step that blocks for minutes inside a
library still talks. ``--quiet`` (``set_verbosity(-1)`` or ``EDGEKIT_PROGRESS=0``) shows
nothing; ``--verbose`` (``set_verbosity(1)``) adds library log messages.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")
_VERBOSITY = 0  # -1 quiet, 0 normal, 1 verbose
MIN_PHASE_S = 1.0  # in a log, a phase that ends sooner gets no line of its own


def set_verbosity(level: int) -> None:
    """-1: no progress (``--quiet``); 0: progress; 1: progress and debug logging (``--verbose``)."""
    global _VERBOSITY
    _VERBOSITY = max(-1, min(1, int(level)))
    if _VERBOSITY > 0:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def verbosity() -> int:
    return _VERBOSITY


def _quiet() -> bool:
    return _VERBOSITY < 0 or os.environ.get("EDGEKIT_PROGRESS", "1") == "0"


def progress_enabled() -> bool:
    """A rich bar is wanted: progress on and stderr a terminal."""
    return not _quiet() and sys.stderr.isatty()


def rich_progress(*extra_columns: Any, console: Any = None) -> Any:
    """edgekit's rich progress display: description, bar, done/total, ``extra_columns``, elapsed, remaining
    (on ``console``, a ``rich.console.Console``; None: rich's default)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def progress_bar(items: Iterable[T], description: str, total: int | None = None,
                 enabled: bool | None = None) -> Iterator[T]:
    """Iterate ``items`` with ``StepProgress``: a rich bar on a terminal, timed lines in a log."""
    if enabled is False or _quiet():
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with StepProgress(description, total=total) as p:
        for i, item in enumerate(items):
            yield item
            p.update(i + 1)


def format_seconds(seconds: float) -> str:
    """``h:mm:ss`` (as rich's time columns show it)."""
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class StepProgress:
    """Progress of a long loop of steps (training): a rich bar with a status field on a
    terminal; elsewhere (CI logs, pipes, nohup) a plain line on stderr at least every
    ``interval`` seconds with the steps done, the status, the elapsed and the remaining
    time. ``enabled=False`` (or ``EDGEKIT_PROGRESS=0`` when ``enabled`` is None) shows nothing.

    ``done`` is where the loop starts (a resumed run); the remaining time is estimated
    from the steps taken since then. ``phase(name)`` starts a named phase (one line in a
    log). In a log a heartbeat thread writes the line every ``interval`` seconds even when
    no step ends (a long blocking step); ``heartbeat=False`` turns it off.

    >>> import io
    >>> out = io.StringIO()
    >>> with StepProgress("train", total=4, enabled=True, interval=0.0, stream=out) as p:
    ...     p.update(2, "loss 0.5")
    >>> out.getvalue().splitlines()[0].split(", elapsed")[0]
    'train: step 2/4 (50%), loss 0.5'
    """

    def __init__(self, description: str, total: int | None, *, done: int = 0, enabled: bool | None = None,
                 interval: float = 30.0, stream: TextIO | None = None, heartbeat: bool = True,
                 min_phase_s: float | None = None) -> None:
        self.description, self.total, self.interval = description, total, interval
        self.min_phase_s = MIN_PHASE_S if min_phase_s is None else min_phase_s
        self._phase: str | None = None
        self._phase_started = 0.0
        self.stream = stream if stream is not None else sys.stderr
        if enabled is False or (enabled is None and _quiet()):
            self.mode = "off"
        else:
            self.mode = "bar" if self.stream.isatty() else "lines"
        self.heartbeat = heartbeat
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_done = self.done = done
        self.status = ""
        self._started = self._last_line = time.monotonic()
        self._lines = 0
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> StepProgress:
        self._started = self._last_line = time.monotonic()
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import TextColumn

            self._bar = rich_progress(TextColumn("{task.fields[status]}"), console=Console(file=self.stream))
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total, completed=self.done, status="")
        elif self.mode == "lines" and self.heartbeat and self.interval > 0:
            self._thread = threading.Thread(target=self._beat, name=f"progress {self.description}", daemon=True)
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0)):
            if time.monotonic() - self._last_line >= self.interval:
                self._line()

    def phase(self, name: str) -> None:
        """A named phase starts: the status on the bar; in a log, the phase before it gets its
        line when it ends (``<phase> done in 12.3 s``, with the elapsed and remaining time) if
        it took at least ``min_phase_s``, so quick work and a bad input stay silent (an error
        is then the only line), and the heartbeat names the running phase meanwhile."""
        self._end_phase()
        self.status, self._phase, self._phase_started = name, name, time.monotonic()
        if self._bar is not None:
            self._bar.update(self._task, status=name)

    def _end_phase(self) -> None:
        if self.mode == "lines" and self._phase is not None:
            took = time.monotonic() - self._phase_started
            if took >= self.min_phase_s:
                self.status = f"{self._phase} done in {took:.1f} s"
                self._line()
        self._phase = None

    def update(self, done: int, status: str = "") -> None:
        """``done`` steps so far (of the whole run); ``status``: a short note (epoch, loss)."""
        self.done, self.status = done, status or (self._phase or "")
        if self._bar is not None:
            self._bar.update(self._task, completed=done, status=status)
        elif self.mode == "lines" and time.monotonic() - self._last_line >= self.interval:
            self._line()

    def note(self, message: str) -> None:
        """A line for the user (above the bar on a terminal), unless progress is off."""
        if self._bar is not None:
            self._bar.console.print(f"{self.description}: {message}", markup=False, highlight=False)
        elif self.mode == "lines":
            print(f"{self.description}: {message}", file=self.stream, flush=True)

    def _line(self) -> None:
        with self._lock:
            self._write_line()

    def _write_line(self) -> None:
        now = time.monotonic()
        elapsed = now - self._started
        steps = f"step {self.done}"
        remaining = "?"
        if self.total:
            steps += f"/{self.total} ({100 * self.done // self.total}%)"
            taken = self.done - self.start_done
            if taken > 0:
                remaining = format_seconds(elapsed / taken * max(self.total - self.done, 0))
        status = f", {self.status}" if self.status else ""
        print(f"{self.description}: {steps}{status}, elapsed {format_seconds(elapsed)}, remaining {remaining}",
              file=self.stream, flush=True)
        self._last_line, self._lines = now, self._lines + 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        failed = bool(exc) and exc[0] is not None
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
        elif self.mode == "lines" and not failed:  # an error is reported by its own line, alone
            had_phase = self._phase is not None
            self._end_phase()
            if self._lines and not had_phase:  # a closing line where earlier lines were written
                self._line()
