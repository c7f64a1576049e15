"""The error hierarchy. The CLI catches only these and prints one line.

Exit codes: 0 ok, 1 a check failed (budget, parity, accuracy), 2 bad input or a
missing capability.
"""
from __future__ import annotations

import errno
from collections.abc import Iterable


class EdgekitError(Exception):
    """Base of every error edgekit raises on purpose."""

    exit_code = 2


class BadInputError(EdgekitError, ValueError):
    """A user-supplied value is wrong. The message names the value and the valid choices."""

    exit_code = 2


class UnavailableError(EdgekitError):
    """A runtime, tool or device the request needs is not present here."""

    exit_code = 2


class CheckFailedError(EdgekitError):
    """A gate failed: latency budget, parity tolerance, accuracy threshold."""

    exit_code = 1


def choices(valid: Iterable[object]) -> str:
    """Format valid choices for an error message: ``'a', 'b', 'c'``."""
    return ", ".join(repr(str(v)) for v in valid)


def bad_choice(what: str, value: object, valid: Iterable[object]) -> BadInputError:
    """``unknown calibration method 'foo' (choose from 'minmax', 'mse')``."""
    return BadInputError(f"unknown {what} {str(value)!r} (choose from {choices(sorted(map(str, valid)))})")


def shown_path(path: object) -> str:
    """A path for a one-line message: as is, or quoted with escapes when it holds
    characters that would break the line (a newline in a folder name)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


# What an operating-system error means for the user, by errno (the default: "cannot access").
_OS_WHAT = {errno.ENOSPC: "cannot write", errno.EROFS: "cannot write", errno.EDQUOT: "cannot write",
            errno.EFBIG: "cannot write", errno.ENOTDIR: "cannot use", errno.EISDIR: "cannot use"}


def os_error_message(e: OSError) -> str:
    """One line for an OSError: ``cannot write out/model: No space left on device``.
    Names the path (both paths of a rename) and the system's reason, never a traceback."""
    what = getattr(e, "what", None) or _OS_WHAT.get(e.errno or 0, "cannot access")
    reason = e.strerror or str(e) or type(e).__name__
    paths = [shown_path(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{what} {' -> '.join(paths)}: {reason}" if paths else f"file system error: {reason}"
