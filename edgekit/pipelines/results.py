"""The records of a run and of a sweep, and how they read as tables: what ``run.py`` and
``sweep.py`` write (``results.json``, ``sweep.json``) and what the Markdown, HTML and
command-line views of them (``run.py``, ``html.py``, ``report.py``, the CLI) show.

Plain data only: this module imports nothing of edgekit's but the escapes of
``edgekit.markup`` (every name in the Markdown and the JUnit is escaped), so every view
of a run sits above it without importing the code that runs one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from edgekit.markup import md, xml_attr, xml_text


@dataclass
class StageResult:
    stage: str
    target: str
    kind: str  # "model" | "callable"
    source: str  # "measured" | "estimated"
    latency_ms: float  # at the recipe's percentile
    p50_ms: float
    p99_ms: float
    start_ms: float = 0.0
    end_ms: float = 0.0
    budget_ms: float | None = None
    passed: bool | None = None  # None when the stage has no budget
    share: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    gates: list[dict[str, Any]] = field(default_factory=list)  # accuracy thresholds
    artifacts: dict[str, str] = field(default_factory=dict)
    reused: dict[str, bool] = field(default_factory=dict)
    size_mb: float | None = None
    profile: str | None = None
    parallel_with: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    estimated_ms: float | None = None  # roofline estimate of the same graph on the target
    cv: float = 0.0  # coefficient of variation of the stage's times
    noisy: bool = False  # cv above the recipe's noise threshold: a verdict on it is uncertain
    range_ms: list[float] | None = None  # an estimate's range [low, high] (from its validation errors)
    provenance: str | None = None  # device results: "verified" | "unverified" (runtimes.base.Provenance)


@dataclass
class RunResult:
    recipe: dict[str, Any]
    run_dir: str
    percentile: str
    seed: int
    targets: dict[str, dict[str, Any]]
    passed: bool
    versions: dict[str, str]
    seconds: float
    stages: list[StageResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SweepRow:
    params: dict[str, Any]
    run_dir: str
    passed: bool
    metric: str | None
    value: float | None
    higher_is_better: bool
    size_mb: float | None
    latency_ms: dict[str, float]  # target -> end-to-end at the recipe's percentile (measured frames, or estimated)
    estimated_ms: dict[str, float] = field(default_factory=dict)  # target -> roofline estimate
    pareto: bool = False  # not dominated in metric, latency (first target) and size together
    seconds: float = 0.0
    p50_ms: dict[str, float] = field(default_factory=dict)  # target -> measured frame p50 (no entry: estimated)
    p99_ms: dict[str, float] = field(default_factory=dict)  # target -> measured frame p99
    cv: dict[str, float] = field(default_factory=dict)  # target -> frame coefficient of variation
    budget_ms: float | None = None
    percentile: str = "p99"


# ----- tables -----

def stage_table(result: RunResult) -> list[list[str]]:
    rows = []
    for r in result.stages:
        rows.append([r.target, r.stage, f"{r.latency_ms:.3f}", f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.cv:.1%}",
                     f"{r.share:.0%}", "-" if r.budget_ms is None else f"{r.budget_ms:g}",
                     "-" if r.budget_ms is None else f"{r.budget_ms - r.latency_ms:+.3f}",
                     _verdict(r.passed, r.noisy),
                     source_label(r.source, r.provenance) + (f" ({r.range_ms[0]:.3f}-{r.range_ms[1]:.3f})" if r.range_ms
                                                            else "")
                     + (" (reused)" if r.reused and all(r.reused.values()) else "")])
    return rows


STAGE_COLUMNS = ["target", "stage", "latency ms", "p50", "p99", "cv", "share", "budget", "margin", "verdict", "source"]


def source_label(source: str, provenance: str | None = None) -> str:
    """Where a number comes from, for tables: ``measured`` (here), ``estimated`` (roofline),
    ``device (verified)`` or ``device (UNVERIFIED)`` (results recorded on the device)."""
    if provenance:
        return f"{source} ({'verified' if provenance == 'verified' else 'UNVERIFIED'})"
    return source


def _verdict(passed: bool | None, noisy: bool) -> str:
    if passed is None:
        return "-"
    return ("PASS" if passed else "FAIL") + (" (noisy)" if noisy else "")


def target_measurement(t: dict[str, Any], percentile: str) -> str:
    """``frame p99 31.2 ms (measured over 300 frames; p50 27.0, cv 4.1%)`` or ``p99 40.1 ms
    (estimate (sum of stages))``."""
    if t.get("method") == "measured frames":
        noisy = f"; noisy after {t['attempts']} attempt(s)" if t.get("noisy") else ""
        return (f"frame {percentile} {t['total_ms']:.3f} ms (measured over {t['frames']} frames; p50 "
                f"{t['p50_ms']:.3f}, cv {t['cv']:.1%}; sum of stage {percentile}s {t['sum_of_stage_ms']:.3f}{noisy})")
    rng = t.get("range_ms")
    within = f", range {rng[0]:.3f}-{rng[1]:.3f} ms" if rng else ""
    return f"{percentile} {t['total_ms']:.3f} ms ({t.get('method', 'sum of stages')}{within})"


def target_verdict(t: dict[str, Any], markdown: bool = False, percentile: str = "p99") -> str:
    """``frame p99 13.839 ms (measured ...) against 33 ms: PASS, margin +19.161 ms`` for one target's summary;
    a verdict on a noisy measurement says so. ``markdown``: escaped, the verdict in bold."""
    what = md(target_measurement(t, percentile)) if markdown else target_measurement(t, percentile)
    if t["budget_ms"] is None:
        return f"{what} (no end-to-end budget)"
    verdict = "PASS" if t["passed"] else "FAIL"
    verdict = f"**{verdict}**" if markdown else verdict
    noisy = " (noisy measurement: the verdict is uncertain)" if t.get("noisy") else ""
    rng = t.get("range_ms")
    if rng and rng[0] <= t["budget_ms"] < rng[1]:
        noisy += " (the estimate's range crosses the budget: the verdict is uncertain)"
    return f"{what} against {t['budget_ms']:g} ms: {verdict}{noisy}, margin {t['margin_ms']:+.3f} ms"


SWEEP_COLUMNS = ["params", "metric", "value", "size MB", "latency ms", "cv", "estimated ms", "pareto", "pass"]


def sweep_table(rows: list[SweepRow]) -> list[list[str]]:
    out = []
    for r in rows:
        out.append([", ".join(f"{k}={v}" for k, v in r.params.items()), r.metric or "-",
                    "-" if r.value is None else f"{r.value:.4f}",
                    "-" if r.size_mb is None else f"{r.size_mb:.2f}",
                    "; ".join(f"{t} {v:.3f}" for t, v in r.latency_ms.items()),
                    "; ".join(f"{t} {v:.1%}" for t, v in r.cv.items()) or "-",
                    "; ".join(f"{t} {v:.3f}" for t, v in r.estimated_ms.items()) or "-",
                    "*" if r.pareto else "", "PASS" if r.passed else "FAIL"])
    return out


def markdown_summary(result: RunResult) -> str:
    lines = [f"# edgekit run: {md(result.recipe['name'])}", "",
             f"{'PASS' if result.passed else 'FAIL'}; latency at {result.percentile}; seed {result.seed}; "
             f"{result.seconds:.1f} s", ""]
    lines += ["| " + " | ".join(STAGE_COLUMNS) + " |", "|" + "---|" * len(STAGE_COLUMNS)]
    for row in stage_table(result):
        lines.append("| " + " | ".join(md(cell) for cell in row) + " |")
    lines.append("")
    for name, t in result.targets.items():
        lines.append(f"- **{md(name)}**: {target_verdict(t, markdown=True, percentile=result.percentile)}")
    gates = [g for r in result.stages for g in r.gates]
    if gates:
        lines += ["", "| stage | metric | value | threshold | verdict |", "|---|---|---|---|---|"]
        for g in gates:
            thr = f">= {g['min']}" if "min" in g else f"<= {g['max']}"
            lines.append(f"| {md(g['stage'])} | {md(g['metric'])} | {g['value']:.4f} | {md(thr)} "
                         f"| {'PASS' if g['passed'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def junit_xml(result: RunResult) -> str:
    cases = []
    for name, t in result.targets.items():
        if t["budget_ms"] is not None:
            ok = t["passed"]
            msg = f"{target_measurement(t, result.percentile)} vs budget {t['budget_ms']:g} ms" + (
                " (noisy measurement: the verdict is uncertain)" if t.get("noisy") else "")
            cases.append((f"{name}.total_budget", ok, msg, t["total_ms"] / 1e3))
    for r in result.stages:
        if r.budget_ms is not None:
            cases.append((f"{r.target}.{r.stage}.budget", r.passed,
                          f"{result.percentile} {r.latency_ms:.3f} ms vs budget {r.budget_ms:g} ms ({r.source}; "
                          f"cv {r.cv:.1%}{', noisy: the verdict is uncertain' if r.noisy else ''})",
                          r.latency_ms / 1e3))
        for g in r.gates:
            thr = f">= {g['min']}" if "min" in g else f"<= {g['max']}"
            cases.append((f"{r.target}.{r.stage}.{g['metric']}", g["passed"], f"{g['metric']} {g['value']:.4f} {thr}", 0.0))
    failures = sum(1 for c in cases if not c[1])
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name="edgekit" tests="{len(cases)}" failures="{failures}">',
           f'  <testsuite name={xml_attr("edgekit." + str(result.recipe["name"]))} tests="{len(cases)}" '
           f'failures="{failures}" time="{result.seconds:.3f}">']
    for name, ok, msg, secs in cases:
        out.append(f'    <testcase classname="edgekit" name={xml_attr(name)} time="{secs:.6f}">')
        if not ok:
            out.append(f"      <failure message={xml_attr(msg)}/>")
        else:
            out.append(f"      <system-out>{xml_text(msg)}</system-out>")
        out.append("    </testcase>")
    out += ["  </testsuite>", "</testsuites>"]
    return "\n".join(out) + "\n"

