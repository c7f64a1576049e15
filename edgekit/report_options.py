"""What ``edgekit report`` is asked besides where to write: ``ReportOptions``, whose fields
declare its flags (``edgekit.options``); ``report.render_report`` takes the same values as
keywords. Light (no torch or ONNX): the command line reads it to build its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.errors import BadInputError
from edgekit.options import option
from edgekit.schema import check_fields


@dataclass(frozen=True)
class ReportOptions:
    """What a report of profiles shows.

    budget_ms: add a budget verdict for each profile (None: none).
    percentile: where ``budget_ms`` is read (min, mean, p50 ... p99, max).
    top_k: nodes in each profile's table.
    """

    budget_ms: float | None = field(default=None, metadata=option(
        "--budget-ms", basic=True, help="Add a budget verdict for each profile."))
    percentile: str = field(default="p99", metadata=option(
        "--percentile", basic=True, metavar="min|mean|p50|p90|p95|p99|max",
        help="The percentile --budget-ms is checked at."))
    top_k: int = field(default=10, metadata=option("--top-k", help="Nodes in each profile's table."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.top_k < 1:
            raise BadInputError(f"--top-k must be at least 1, got {self.top_k}")
