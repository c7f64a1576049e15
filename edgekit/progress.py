"""Rich progress bars that turn themselves off when not on a terminal or when asked."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress_enabled() -> bool:
    return os.environ.get("EDGEKIT_PROGRESS", "1") != "0" and sys.stderr.isatty()


def progress_bar(items: Iterable[T], description: str, total: int | None = None,
                 enabled: bool | None = None) -> Iterator[T]:
    """Iterate ``items`` with a rich progress bar on stderr (a no-op when not interactive)."""
    if enabled is None:
        enabled = progress_enabled()
    if not enabled:
        yield from items
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), transient=False) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
