"""The error hierarchy. The CLI catches only these and prints one line.

Exit codes: 0 ok, 1 a check failed (budget, parity, accuracy), 2 bad input or a
missing capability.
"""
from __future__ import annotations

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
