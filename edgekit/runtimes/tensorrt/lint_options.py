"""What ``edgekit lint`` is asked: ``LintOptions``, whose fields declare its flags
(``edgekit.options``); ``lint.lint_model`` takes the same values as keywords.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.errors import BadInputError
from edgekit.options import option
from edgekit.schema import check_fields


def parse_axis_ranges(axes: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """``("batch=1", "seq=1:256")`` -> ``{name: (min, max)}``; a malformed entry raises
    BadInputError naming it.

    >>> parse_axis_ranges(("batch=1", "seq=1:256"))
    {'batch': (1, 1), 'seq': (1, 256)}
    """
    ranges: dict[str, tuple[int, int]] = {}
    for a in axes:
        name, _, value = a.partition("=")
        lo, _, hi = value.partition(":")
        if not name or not lo.strip().isdigit() or (hi and not hi.strip().isdigit()) or int(lo) < 0 \
                or (hi and int(hi) < int(lo)) or int(hi or lo) < 1:
            raise BadInputError(f"--axis {a!r} must be NAME=SIZE or NAME=MIN:MAX with whole numbers, 0 <= MIN <= MAX, "
                                "MAX >= 1")
        ranges[name] = (int(lo), int(hi or lo))
    return ranges


@dataclass(frozen=True)
class LintOptions:
    """How to check a graph against a target's TensorRT.

    tensorrt_version: check against this TensorRT (None: the one the target's JetPack pins).
    dla_core: also list the layers that fall back from this DLA core.
    precision: the precision the engine will be built in (checked for the DLA).
    axes: the optimization profile of named dynamic axes, ``NAME=SIZE`` or ``NAME=MIN:MAX``.
    """

    tensorrt_version: str | None = field(default=None, metadata=option(
        "--tensorrt", basic=True, metavar="VERSION",
        help="Check against this TensorRT version (e.g. 8.5) instead of the one the target's JetPack pins."))
    dla_core: int | None = field(default=None, metadata=option(
        "--dla-core", help="Also list the layers that fall back from this DLA core."))
    precision: str | None = field(default=None, metadata=option(
        "--precision", basic=True, help="The precision the engine will be built in (checked for the DLA)."))
    axes: tuple[str, ...] = field(default=(), metadata=option(
        "--axis", basic=True, deprecated=("--dim",), metavar="NAME=SIZE|NAME=MIN:MAX",
        help="Size a named dynamic axis of every input for the profile: NAME=SIZE or NAME=MIN:MAX (repeatable); "
             "--shapes fixes whole inputs."))

    def __post_init__(self) -> None:
        check_fields(self)
        parse_axis_ranges(self.axes)

    def axis_ranges(self) -> dict[str, tuple[int, int]] | None:
        return parse_axis_ranges(self.axes) or None
