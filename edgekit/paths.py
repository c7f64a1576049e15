"""Where edgekit keeps its own files outside the outputs a command is given (light: the
command line reads these paths before it imports anything else).

* ``cache_path()``: derived files, ``$EDGEKIT_CACHE`` or ``~/.cache/edgekit``;
* ``staging_journal_path()``: one small file per output being staged right now (its path
  and the writing process), so that the staging folder of a process that was killed
  outright (SIGKILL, power loss) is removed the next time any edgekit command starts.
"""
from __future__ import annotations

import os
from pathlib import Path


def cache_path() -> Path:
    """``$EDGEKIT_CACHE`` or ``~/.cache/edgekit`` (not created here)."""
    return Path(os.environ.get("EDGEKIT_CACHE") or Path.home() / ".cache" / "edgekit")


def staging_journal_path() -> Path:
    """The folder of the staging journal, inside the cache (not created here)."""
    return cache_path() / "staging"


def has_journal_entries() -> bool:
    """Whether any staged output is recorded (cheap: one directory listing)."""
    try:
        with os.scandir(staging_journal_path()) as entries:
            return any(True for _ in entries)
    except OSError:
        return False
