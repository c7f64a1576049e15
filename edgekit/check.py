"""The latency budget gate: ``edgekit check`` exits 0 when met, 1 when missed."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError
from edgekit.profiling import ProfileResult, normalize_percentile, profile_engine


@dataclass(frozen=True)
class BudgetVerdict:
    passed: bool
    percentile: str
    latency_ms: float
    budget_ms: float
    margin_ms: float  # budget - latency (negative when missed)
    jitter: float  # p99 / p50
    max_jitter: float | None
    jitter_passed: bool
    model: str | None
    target: str | None
    cv: float = 0.0  # coefficient of variation of the measurement
    noisy: bool = False  # the profile stayed above its noise threshold: the verdict is uncertain
    unverified: tuple[str, ...] = ()  # what the profile could not vouch for (unverified_reasons); fails with require_verified
    require_verified: bool = False

    def message(self) -> str:
        head = "PASS" if self.passed else "FAIL"
        lat = (f"{self.percentile} {self.latency_ms:.3f} ms vs budget {self.budget_ms:g} ms: "
               + (f"met with {self.margin_ms:.3f} ms to spare ({self.margin_ms / self.budget_ms:.1%})"
                  if self.margin_ms >= 0 else
                  f"missed by {-self.margin_ms:.3f} ms ({-self.margin_ms / self.budget_ms:.1%} over)"))
        parts = [f"{head}: {lat}"]
        if self.max_jitter is not None:
            parts.append(f"jitter p99/p50 {self.jitter:.3f} {'<=' if self.jitter_passed else '>'} {self.max_jitter:g}")
        parts.append(f"CV {self.cv:.1%}" + (" (noisy measurement: the verdict is uncertain)" if self.noisy else ""))
        if self.unverified:
            parts.append(("FAIL (--require-verified): " if self.require_verified else "warning: ")
                         + "; ".join(self.unverified))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class VerifiedVerdict:
    """``check --require-verified`` without a budget: whether every field of the profile is verified."""

    passed: bool
    unverified: tuple[str, ...]
    model: str | None
    target: str | None

    def message(self) -> str:
        if self.passed:
            return "PASS: verified (nothing in the profile is unverified)"
        return "FAIL (--require-verified): " + "; ".join(self.unverified)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def unverified_reasons(profile: ProfileResult) -> list[str]:
    """What a profile cannot vouch for: every top-level field that says ``unverified`` (a string,
    or a record with ``status: unverified`` and its ``reasons`` or ``reason``: device results whose
    ``provenance`` was not recorded, an engine whose ``quality`` was not checked against its model),
    and an estimate standing in for a measurement."""
    reasons = []
    for key, value in profile.to_dict().items():
        if value == "unverified":
            reasons.append(f"{key}: unverified")
        elif isinstance(value, dict) and value.get("status") == "unverified":
            why = value.get("reasons") or ([value["reason"]] if value.get("reason") else [])
            reasons.append(f"{key}: unverified" + (f" ({'; '.join(str(r) for r in why)})" if why else ""))
    if profile.source == "estimated":
        reasons.append("latency: an estimate (roofline model), not a measurement")
    return reasons


def check_verified(profile: str | os.PathLike[str] | ProfileResult) -> VerifiedVerdict:
    """Pass when nothing in the profile is unverified (``unverified_reasons``).

    >>> check_verified("out/profile.json").passed  # doctest: +SKIP
    True
    """
    result = load_profile(profile)
    reasons = tuple(unverified_reasons(result))
    return VerifiedVerdict(passed=not reasons, unverified=reasons, model=result.model, target=result.target)


def load_profile(source: str | os.PathLike[str] | ProfileResult) -> ProfileResult:
    """A profile JSON file, a folder holding ``profile.json``, or an engine folder (profiled now).
    A file is validated as it is read (``ProfileResult.load``): a CI gate never passes on nonsense."""
    if isinstance(source, ProfileResult):
        return source
    p = Path(source)
    if p.is_file():
        return ProfileResult.load(p)
    if p.is_dir():
        if (p / "profile.json").is_file():
            return ProfileResult.load(p / "profile.json")

        return profile_engine(p)
    raise BadInputError(f"profile {str(p)!r} does not exist (give a profile JSON or an engine folder)")


def check_budget(profile: str | os.PathLike[str] | ProfileResult, budget_ms: float, percentile: str = "p99",
                 max_jitter: float | None = None, require_verified: bool = False) -> BudgetVerdict:
    """Compare a profile's latency at ``percentile`` with ``budget_ms``. ``require_verified``: also fail
    when the profile cannot vouch for what it measured (``unverified_reasons``).

    >>> v = check_budget("out/profile.json", budget_ms=33, percentile="p99")  # doctest: +SKIP
    >>> v.passed  # doctest: +SKIP
    True
    """
    if isinstance(budget_ms, bool) or not isinstance(budget_ms, (int, float)) or not math.isfinite(budget_ms) \
            or budget_ms <= 0:
        raise BadInputError(f"budget must be a positive number of milliseconds, got {budget_ms!r}")
    if max_jitter is not None and (isinstance(max_jitter, bool) or not isinstance(max_jitter, (int, float))
                                   or not math.isfinite(max_jitter) or max_jitter < 1.0):
        raise BadInputError(f"max jitter is a p99/p50 ratio and must be >= 1, got {max_jitter!r}")
    key = normalize_percentile(percentile)
    result = load_profile(profile)  # validated: finite, non-negative, ordered percentiles
    latency = result.latency_ms.get(key)
    p50, p99 = result.latency_ms.p50, result.latency_ms.p99
    jitter = p99 / p50 if p50 > 0 else (1.0 if p99 == 0 else float("inf"))
    jitter_ok = max_jitter is None or jitter <= max_jitter
    met = latency <= budget_ms
    unverified = tuple(unverified_reasons(result))
    verified_ok = not (require_verified and unverified)
    return BudgetVerdict(passed=met and jitter_ok and verified_ok, percentile=key, latency_ms=latency,
                         budget_ms=float(budget_ms), margin_ms=float(budget_ms) - latency, jitter=jitter,
                         max_jitter=max_jitter, jitter_passed=jitter_ok, model=result.model, target=result.target,
                         cv=result.latency_ms.cv, noisy=result.noisy, unverified=unverified,
                         require_verified=require_verified)
