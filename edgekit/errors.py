"""The error hierarchy. The CLI catches only these and prints one line.

Exit codes: 0 ok, 1 a check failed (budget, parity, accuracy), 2 bad input or a
missing capability.
"""
from __future__ import annotations

import errno
import os
import re
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


_OS_CODE = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]")


def os_error_from(e: BaseException, path: object) -> BaseException:
    """A library's own error that wraps an operating-system error (safetensors: ``I/O error:
    No space left on device (os error 28)``) as the OSError it is, naming ``path``, so it
    reads as one line like any other; ``e`` itself when it carries no OS error code."""
    if isinstance(e, OSError):
        return e
    m = _OS_CODE.search(str(e))
    if m is None:
        return e
    code = int(m[1] or m[2])
    return OSError(code, os.strerror(code), str(path))


def os_error_message(e: OSError) -> str:
    """One line for an OSError: ``cannot write out/model: No space left on device``.
    Names the path (both paths of a rename) and the system's reason, never a traceback.
    ``shutil.Error`` (a list of failed copies as its argument) is told by its first failure."""
    if e.args and isinstance(e.args[0], list) and e.args[0] and isinstance(e.args[0][0], tuple):
        src, dst, why = (list(e.args[0][0]) + ["", "", ""])[:3]
        reason = _OS_CODE.sub("", str(why)).split(":")[0].strip() or "copy failed"
        return f"cannot write {shown_path(dst)}: {reason}"
    what = getattr(e, "what", None) or _OS_WHAT.get(e.errno or 0, "cannot access")
    reason = e.strerror or str(e) or type(e).__name__
    paths = [shown_path(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{what} {' -> '.join(paths)}: {reason}" if paths else f"file system error: {reason}"
