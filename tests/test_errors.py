"""The error hierarchy (errors.py): each kind's exit code, and the one-line messages built for a bad
choice and for an operating-system error (naming the path and the system's reason)."""
from __future__ import annotations

import errno
import shutil

from edgekit.errors import (
    BadInputError,
    CheckFailedError,
    EdgekitError,
    UnavailableError,
    bad_choice,
    os_error_from,
    os_error_message,
    shown_path,
)


def test_exit_codes():
    assert (BadInputError.exit_code, UnavailableError.exit_code, CheckFailedError.exit_code) == (2, 2, 1)
    assert issubclass(BadInputError, ValueError) and issubclass(CheckFailedError, EdgekitError)


def test_bad_choice_names_the_value_and_the_sorted_choices():
    e = bad_choice("calibration method", "foo", ["mse", "minmax", 8])
    assert isinstance(e, BadInputError)
    assert str(e) == "unknown calibration method 'foo' (choose from '8', 'minmax', 'mse')"


def test_shown_path_quotes_only_what_would_break_the_line():
    assert shown_path("out/model") == "out/model"
    assert shown_path("out/a\nb") == "'out/a\\nb'"


def test_os_error_from_a_library_message():
    wrapped = os_error_from(RuntimeError("I/O error: No space left on device (os error 28)"), "out/model")
    assert isinstance(wrapped, OSError) and wrapped.errno == errno.ENOSPC and wrapped.filename == "out/model"
    plain = RuntimeError("shape mismatch")
    assert os_error_from(plain, "out") is plain  # no OS error code: the error itself
    own = PermissionError(errno.EACCES, "Permission denied", "x")
    assert os_error_from(own, "y") is own


def test_os_error_message_is_one_line_naming_the_path():
    assert os_error_message(OSError(errno.ENOSPC, "No space left on device", "out/m")) == \
        "cannot write out/m: No space left on device"
    assert os_error_message(OSError(errno.EACCES, "Permission denied", "a", None, "b")) == \
        "cannot access a -> b: Permission denied"
    assert os_error_message(OSError(errno.EIO, "Input/output error")) == "file system error: Input/output error"
    failed_copy = shutil.Error([("src/w", "dst/w", "[Errno 28] No space left on device: 'dst/w'")])
    assert os_error_message(failed_copy) == "cannot write dst/w: No space left on device"
