"""How sure an estimate is: a range from the errors measured when the estimator was
validated on models it was not tuned on, for the same target and operator mix.

``validation.json`` (next to this file, written from the benchmarks'
results) holds, per target, held-out cases: ``error = estimate / measured - 1`` and the
operator mix of the case (``conv``: convolutions dominate the estimated time, ``matmul``:
matrix products and attention, ``mixed``). An estimate's range is the measured latency
the validated errors allow::

    low  = estimate / (1 + worst over-estimate)     high = estimate / (1 + worst under-estimate)

taken over the cases of the same mix when there are at least three (else all of the
target's), widened by a quarter and never narrower than +-15%. A target without
validated cases borrows those of its kind, widened by half and at least +-35%, and says so.

CPU cases also say on which CPU kind they were measured (``cpu_kind``: the int8 kernel family,
``targets.cpu_isa.int8_kernel``: avx2, avx512-vnni, amx, arm-dotprod, ...; ``cpu_kinds`` names
the machines). A CPU estimate uses the cases of its own kind (this machine's for the ``cpu``
target, the named target's for ``cpu-avx2`` and the like); where its kind has none it uses the
others', widened as borrowed cases are, and its ``basis`` says which kinds were validated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VALIDATION_FILE = Path(__file__).with_name("validation.json")
MIN_SPREAD = 0.15  # the narrowest range, as a fraction either side
BORROWED_SPREAD = 0.35


@dataclass(frozen=True)
class Range:
    low_ms: float
    high_ms: float
    basis: str  # where the range comes from, for people
    cases: int  # validated cases it rests on


def op_mix(class_times: dict[str, float]) -> str:
    """``conv`` | ``matmul`` | ``mixed``: which class dominates the estimated time (> 60%)."""
    total = sum(class_times.values()) or 1.0
    conv = (class_times.get("conv", 0.0) + class_times.get("depthwise-conv", 0.0)) / total
    mm = (class_times.get("matmul", 0.0) + class_times.get("attention", 0.0)) / total
    if conv > 0.6:
        return "conv"
    if mm > 0.6:
        return "matmul"
    return "mixed"


def load_validation(path: Path = VALIDATION_FILE) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data.get("targets", {}) if isinstance(data, dict) else {}


def estimate_range(total_ms: float, target: str, kind: str, mix: str,
                   validation: dict[str, Any] | None = None, cpu_kind: str | None = None) -> Range:
    """The range of measured latency an estimate of ``total_ms`` stands for (``cpu_kind``: the CPU
    kind the estimate is for, for CPU targets)."""
    data = load_validation() if validation is None else validation
    entry = data.get(target)
    if entry is not None and entry.get("cases"):
        borrowed = False
        cases = entry["cases"]
        source = entry.get("basis", f"validated on {target}")
    else:
        borrowed = True
        cases = [c for e in data.values() if e.get("kind") == kind for c in e.get("cases", [])]
        source = f"no validated cases for {target}; borrowed from other {kind} targets"
    if cpu_kind is not None and cases:
        cases, borrowed, source = _cpu_kind_cases(cases, data, kind, cpu_kind, borrowed, source)
    same = [c for c in cases if c.get("mix") == mix]
    used = same if len(same) >= 3 else cases
    if not used:
        return Range(total_ms / (1 + BORROWED_SPREAD * 2), total_ms * (1 + BORROWED_SPREAD * 2),
                     f"no validated cases for {target} or its kind: a wide default range", 0)
    errors = [float(c["error"]) for c in used]
    widen, floor = (1.5, BORROWED_SPREAD) if borrowed else (1.25, MIN_SPREAD)
    over = max(max(errors) * widen, floor)  # estimate above measured by up to this much
    under = min(min(errors) * widen, -floor)  # estimate below measured by up to this much
    under = max(under, -0.9)
    mix_text = f"{mix}-dominated" if used is same else "all"
    basis = (f"{source}: {len(used)} {mix_text} held-out cases, errors {min(errors):+.0%} to {max(errors):+.0%}, "
             f"widened x{widen:g}")
    return Range(total_ms / (1 + over), total_ms / (1 + under), basis, len(used))


def _cpu_kind_cases(cases: list[dict[str, Any]], data: dict[str, Any], kind: str, cpu_kind: str, borrowed: bool,
                    source: str) -> tuple[list[dict[str, Any]], bool, str]:
    """The cases measured on ``cpu_kind`` where there are any (else all, then borrowed), and a
    basis naming the CPU kinds the errors were validated on."""
    names: dict[str, str] = {}
    for e in data.values():
        if e.get("kind") == kind:
            names.update(e.get("cpu_kinds", {}))
    kinds = sorted({str(c.get("cpu_kind", "unknown")) for c in cases})
    validated = ", ".join(f"{k} ({names[k]})" if k in names else k for k in kinds)
    mine = [c for c in cases if c.get("cpu_kind") == cpu_kind]
    if mine:
        return mine, borrowed, f"{source}; validated on CPU kind {cpu_kind}" + (
            f" ({names[cpu_kind]})" if cpu_kind in names else "")
    return cases, True, (f"{source}; not validated on CPU kind {cpu_kind}: errors measured on {validated}, "
                         "widened as borrowed")
