"""What ``edgekit run`` is asked beyond its recipe: ``RunOptions``, whose fields declare its
flags (``edgekit.options``); ``run.run_recipe`` takes the same values as keywords (``dry_run``
stops before it: the command prints the plan instead). Light (no
PyTorch or ONNX): the command line reads it to build its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.options import option
from edgekit.schema import check_fields


@dataclass(frozen=True)
class RunOptions:
    """How a recipe runs.

    force: rebuild every cached step.
    remeasure: time the cached engines again (stage profiles and frames), rebuilding nothing.
    wait: when another edgekit run holds the run folder, wait for it (else exit 2).
    cache_dir: the shared cache folder (None: RUN_DIR/cache).
    dry_run: validate the recipe and print the resolved plan; run nothing.
    """

    force: bool = field(default=False, metadata=option(
        "--force/--no-force", basic=True, help="Rebuild every cached step."))
    remeasure: bool = field(default=False, metadata=option(
        "--remeasure/--no-remeasure", basic=True,
        help="Time the cached engines again (stage profiles and frames) without rebuilding anything."))
    wait: bool = field(default=False, metadata=option(
        "--wait/--no-wait",
        help="When another edgekit run is using the run folder, wait for it instead of exiting with status 2."))
    cache_dir: str | None = field(default=None, metadata=option(
        "--cache", metavar="DIR", help="Shared cache folder (default RUN_DIR/cache)."))
    dry_run: bool = field(default=False, metadata=option(
        "--dry-run/--no-dry-run", basic=True, help="Validate the recipe and print the resolved plan; run nothing."))

    def __post_init__(self) -> None:
        check_fields(self)
