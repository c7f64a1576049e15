"""What ``edgekit sweep`` is asked: ``SweepOptions``, whose fields declare its flags
(``edgekit.options``), and how a grid value is read. Light (no PyTorch or ONNX): the command
line reads it to build its options; ``sweep.run_sweep`` takes the same values as keywords.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.options import option
from edgekit.schema import check_fields

EXECUTORS = ("local", "process", "ray")
# Each point is a whole run (compress, export, build, profile): minutes. A grid beyond this many
# points is a typo unless --max-points says otherwise (it is validated point by point first).
DEFAULT_MAX_POINTS = 256


def parse_value(text: str) -> Any:
    """A grid value as the recipe would hold it: a bool, None, an int, a float, else the text.

    >>> [parse_value(v) for v in ("true", "none", "64", "0.5", "gptq")]
    [True, None, 64, 0.5, 'gptq']
    """
    t = text.strip()
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


@dataclass(frozen=True)
class SweepOptions:
    """Which points a sweep runs, and where.

    grid: ``STEP.FIELD=v1,v2`` entries; every combination runs.
    points: one combination each, ``k=v,k2=w`` (instead of a grid).
    jobs: parallel local processes (``executor="process"``).
    max_points: more points than this are refused before anything runs.
    executor: "local" (this process), "process" (local processes) or "ray".
    address: the Ray cluster's HOST:PORT.
    force: rebuild every cached step of every point.
    """

    grid: tuple[str, ...] = field(default=(), metadata=option(
        "--grid", basic=True, metavar="STEP.FIELD=V1,V2",
        help="STEP.FIELD=v1,v2 (repeatable); every combination runs."))
    points: tuple[str, ...] = field(default=(), metadata=option(
        "--list", basic=True, metavar="K=V,K2=V2",
        help="One combination 'k=v,k2=v2' (repeatable), instead of a grid."))
    jobs: int = field(default=1, metadata=option(
        "--jobs", basic=True, help="Parallel local processes (at most the cores)."))
    max_points: int = field(default=DEFAULT_MAX_POINTS, metadata=option(
        "--max-points", bounds=(1, 1_000_000), help="Refuse grids of more points than this."))
    executor: str = field(default="local", metadata=option(
        "--executor", basic=True, choices=EXECUTORS,
        help="Where the points run: this process, local processes (--jobs) or a Ray cluster."))
    address: str | None = field(default=None, metadata=option(
        "--address", metavar="HOST:PORT", help="Ray cluster HOST:PORT (with --executor ray)."))
    force: bool = field(default=False, metadata=option(
        "--force/--no-force", help="Rebuild every cached step of every point (as `edgekit run --force`)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.executor not in EXECUTORS:
            raise bad_choice("executor", self.executor, EXECUTORS)
        if self.max_points < 1:
            raise BadInputError(f"max_points must be >= 1, got {self.max_points}")
        self.combinations()  # each --list entry well formed

    def combinations(self) -> list[dict[str, Any]] | None:
        """The ``points`` as {key: value} (None: run the grid)."""
        if not self.points:
            return None
        combos = []
        for item in self.points:
            pairs = [p.split("=", 1) for p in item.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise BadInputError(f"--list {item!r} must look like 'step.field=v,other.field=w'")
            combos.append({k.strip(): parse_value(v) for k, v in pairs})
        return combos
