"""Rich progress bars that turn themselves off when not on a terminal or when asked."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def progress_enabled() -> bool:
    return os.environ.get("EDGEKIT_PROGRESS", "1") != "0" and sys.stderr.isatty()


def rich_progress(*extra_columns: Any) -> Any:
    """edgekit's rich progress display: description, bar, done/total, ``extra_columns``, elapsed, remaining."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), *extra_columns,
                    TimeElapsedColumn(), TimeRemainingColumn())


def progress_bar(items: Iterable[T], description: str, total: int | None = None,
                 enabled: bool | None = None) -> Iterator[T]:
    """Iterate ``items`` with a rich progress bar on stderr (a no-op when not interactive)."""
    if enabled is None:
        enabled = progress_enabled()
    if not enabled:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with rich_progress() as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
