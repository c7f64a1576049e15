"""Filesystem helpers of the artifact modules: an ``OSError`` that names the path the user gave,
folders created with their missing parents (and removed again when a step fails), and edgekit's
cache folder."""
from __future__ import annotations

import os
from pathlib import Path

from edgekit.paths import cache_path


def cache_dir() -> Path:
    """Where edgekit caches derived files (a float copy of a GGUF model, trained
    benchmark weights, timing caches): ``$EDGEKIT_CACHE`` or ``~/.cache/edgekit``."""
    path = cache_path()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error_at(e, "cannot use the cache folder ($EDGEKIT_CACHE)", path) from None
    return path


def os_error_at(e: OSError, what: str, path: str | os.PathLike[str]) -> OSError:
    """``e`` again, naming ``path`` (the output the user gave, not a temporary name)."""
    err = type(e)(e.errno, e.strerror or str(e), str(path))
    err.what = what  # type: ignore[attr-defined]  # read by the CLI's one-line message
    return err


def make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return the ones created (outermost first)."""
    missing: list[Path] = []
    p = folder
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    created: list[Path] = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as e:
            remove_empty(created)
            raise os_error_at(e, "cannot create folder", d) from None
        created.append(d)
    return created


def remove_empty(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            break
