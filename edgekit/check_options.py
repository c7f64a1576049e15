"""What ``edgekit check`` is asked: ``CheckOptions``, whose fields declare its flags
(``edgekit.options``). Light (no ONNX): the command line reads it to build its options;
``check.check_budget`` and ``profiling_lm.check_generation`` take the same values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.errors import BadInputError
from edgekit.options import option
from edgekit.schema import check_fields


@dataclass(frozen=True)
class CheckOptions:
    """The budgets a profile is checked against (None: not checked).

    budget_ms: latency budget (a causal LM: one decode step after a 128-token past).
    percentile: where ``budget_ms`` and ``max_ttft_ms`` are read (min, mean, p50 ... p99, max).
    max_jitter: the most p99/p50 may be.
    min_tokens_per_s: causal LMs: the least decode tokens/s (slowest measured context).
    max_ttft_ms: causal LMs: time-to-first-token budget at the longest measured prompt.
    require_verified: also fail when any field of the profile is unverified.
    """

    budget_ms: float | None = field(default=None, metadata=option(
        "--budget-ms", basic=True,
        help="Latency budget in milliseconds (for a causal LM: one decode step after a 128-token past)."))
    percentile: str = field(default="p99", metadata=option(
        "--percentile", basic=True, metavar="min|mean|p50|p90|p95|p99|max",
        help="The percentile --budget-ms and --max-ttft-ms are checked at."))
    max_jitter: float | None = field(default=None, metadata=option(
        "--max-jitter", help="Gate on p99/p50 (e.g. 1.2)."))
    min_tokens_per_s: float | None = field(default=None, metadata=option(
        "--min-tokens-per-s", help="Causal LMs: minimum decode tokens/s (median generation, slowest measured context)."))
    max_ttft_ms: float | None = field(default=None, metadata=option(
        "--max-ttft-ms",
        help="Causal LMs: time-to-first-token budget at the longest measured prompt (at --percentile)."))
    require_verified: bool = field(default=False, metadata=option(
        "--require-verified/--no-require-verified",
        help="Also fail (exit 1) when any field of the profile is unverified (device results whose provenance was "
             "not recorded, an engine built without parity, an estimate), listing the reasons."))

    def __post_init__(self) -> None:
        check_fields(self)

    def require_a_budget(self) -> None:
        """A check with nothing to check is bad input."""
        if self.budget_ms is None and self.min_tokens_per_s is None and self.max_ttft_ms is None \
                and not self.require_verified:
            raise BadInputError("give a budget: --budget-ms, --min-tokens-per-s or --max-ttft-ms "
                                "(or --require-verified)")
