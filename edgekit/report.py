"""``edgekit report DIR``: a Markdown (and JSON) report of what a run folder holds.

It walks the folder for edgekit artifacts (``manifest.json``) and profiles
(``profile.json`` or any ``*.json`` that is a ProfileResult), and renders: the model,
the compression chain, the target, the latency table, the top-k nodes with their
precision, the share of time in float nodes, and the budget verdict (from a saved
``check.json`` or from ``budget_ms`` given here).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.artifact import (
    MANIFEST,
    Manifest,
    atomic_write_json,
    atomic_write_text,
    check_output_file,
    read_manifest,
)
from edgekit.check import check_budget
from edgekit.compress import canonical_step
from edgekit.errors import BadInputError, EdgekitError
from edgekit.markup import md
from edgekit.pipelines.html import render_run_html
from edgekit.pipelines.results import RunResult, StageResult, markdown_summary, source_label
from edgekit.profiling import ProfileResult
from edgekit.schema import read_json


@dataclass
class ReportData:
    folder: Path
    artifacts: list[tuple[Path, Manifest]] = field(default_factory=list)
    profiles: list[tuple[Path, ProfileResult]] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)


def collect(folder: str | os.PathLike[str]) -> ReportData:
    root = Path(folder)
    if not root.exists():
        raise BadInputError(f"report folder {str(root)!r} does not exist")
    if root.is_file():
        paths = [root]
        root = root.parent
    else:
        paths = sorted(p for p in root.rglob("*.json") if not any(part.startswith(".") for part in p.relative_to(root).parts))
    data = ReportData(folder=root)
    for p in paths:
        if p.name == MANIFEST:
            try:
                data.artifacts.append((p.parent, read_manifest(p.parent)))
            except EdgekitError:
                continue
            continue
        try:
            obj = read_json(p, "JSON file")  # bounded: a folder may hold anything
        except EdgekitError:
            continue
        if isinstance(obj, dict) and "latency_ms" in obj and "runtime" in obj:
            try:
                data.profiles.append((p, ProfileResult.from_dict(obj, f"profile {str(p)!r}")))
            except (KeyError, TypeError):
                continue
        elif isinstance(obj, dict) and "budget_ms" in obj and "passed" in obj:
            data.verdicts.append(obj)
    if not data.artifacts and not data.profiles:
        raise BadInputError(f"{root} holds no edgekit outputs (no manifest.json and no profile JSON)")
    return data


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def render_markdown(data: ReportData, budget_ms: float | None = None, percentile: str = "p99",
                    top_k: int = 10) -> tuple[str, dict[str, Any]]:
    lines = [f"# edgekit report: {md(data.folder)}", ""]
    summary: dict[str, Any] = {"folder": str(data.folder), "artifacts": [], "profiles": [], "verdicts": []}
    if data.artifacts:
        lines += ["## Artifacts", "", "| folder | kind | model | target | steps | key metrics |", "|---|---|---|---|---|---|"]
        for folder, m in data.artifacts:
            # a folder written by an earlier version shows its steps under their current names
            names = [canonical_step(s["name"], where="manifest", warn=False) for s in m.steps]
            steps = " → ".join(names) or "-"
            metrics = _short_metrics(m.metrics)
            name = m.model.get("name") or m.source or "-"
            lines.append(f"| {md(_rel(folder, data.folder))} | {md(m.kind)} | {md(name)} | {md(m.target or '-')} "
                         f"| {md(steps)} | {md(metrics)} |")
            summary["artifacts"].append({"folder": str(folder), "kind": m.kind, "model": name, "target": m.target,
                                         "steps": names, "metrics": m.metrics})
        lines.append("")
        for folder, m in data.artifacts:  # what a runtime did not do (a bundle: nothing built or measured)
            status = m.config.get("status") or {}
            if status.get("built") is False:
                lines += [f"> {md(_rel(folder, data.folder))}: {md(status.get('summary'))}", ""]
    for path, prof in data.profiles:
        s = prof.latency_ms
        source = md(source_label(prof.source, prof.provenance.status if prof.provenance else None))
        lines += [f"## Latency: {md(prof.model or '-')} on {md(prof.target or '-')} ({md(prof.runtime)}, {source})", "",
                  f"Profile {md(_rel(path, data.folder))}; settings: "
                  + md(", ".join(f"{k}={v}" for k, v in prof.settings.items())), "",
                  "| min | mean | p50 | p90 | p95 | p99 | max | std | CV | throughput | source |",
                  "|---|---|---|---|---|---|---|---|---|---|---|",
                  f"| {_fmt(s.min)} | {_fmt(s.mean)} | {_fmt(s.p50)} | {_fmt(s.p90)} | {_fmt(s.p95)} | {_fmt(s.p99)} "
                  f"| {_fmt(s.max)} | {_fmt(s.std)} | {s.cv:.1%} | {prof.throughput_per_s:.1f}/s | {source} |",
                  "", f"All times in ms over {s.count} timed inferences." if prof.source != "estimated" else
                  "Every number in this table is an ESTIMATE (roofline model), not a measurement."]
        if prof.provenance is not None:
            lines.append(f"Provenance: {md(prof.provenance.summary())}.")
        if prof.source == "device":
            mc = prof.machine
            clocks_locked: Any = mc.get("clocks_locked")  # True, False or not recorded
            lines.append(md(f"Measured on the device: {mc.get('board') or mc.get('gpu') or 'unknown'}, JetPack "
                            f"{mc.get('jetpack') or 'not recorded'}, TensorRT "
                            f"{mc.get('tensorrt_version') or 'not recorded'}, power mode "
                            f"{mc.get('power_mode') or 'not recorded'}, clocks "
                            + {True: "locked", False: "not locked"}.get(clocks_locked, "not recorded") + "."))
        if prof.model_size_mb is not None or prof.peak_memory_mb is not None:
            lines.append(f"Model size {_fmt(prof.model_size_mb, 2)} MB; peak memory {_fmt(prof.peak_memory_mb, 1)} MB.")
        if prof.float_share is not None:
            lines.append(f"Quantized nodes: {prof.quantized_nodes} of {prof.total_nodes}; "
                         f"share of node time in float nodes: {prof.float_share:.1%}.")
        for w in prof.warnings:
            lines.append(f"> warning: {md(w)}")
        lines.append("")
        if prof.nodes:
            lines += [f"### Top {min(top_k, len(prof.nodes))} nodes", "",
                      "| node (module path, else ONNX name) | op type | ms | share | precision |", "|---|---|---|---|---|"]
            for n in prof.nodes[:top_k]:
                lines.append(f"| {md(n.label)} | {md(n.op_type)} | {n.time_ms:.4f} | {n.share:.1%} | {md(n.precision)} |")
            lines.append("")
        if prof.op_types:
            lines += ["### By op type", "", "| op type | count | ms | share | quantized |", "|---|---|---|---|---|"]
            for t in prof.op_types[:top_k]:
                lines.append(f"| {md(t['op_type'])} | {md(t['count'])} | {t['time_ms']:.4f} | {t['share']:.1%} "
                             f"| {md(t['quantized'])} |")
            lines.append("")
        entry = {"path": str(path), "model": prof.model, "target": prof.target, "runtime": prof.runtime,
                 "latency_ms": s.__dict__, "float_share": prof.float_share, "source": prof.source,
                 "provenance": prof.provenance.status if prof.provenance else None}
        summary["profiles"].append(entry)
        if budget_ms is not None:
            v = check_budget(prof, budget_ms, percentile)
            data.verdicts.append({**v.to_dict(), "message": v.message()})
    if data.verdicts:
        lines += ["## Budget verdict", ""]
        for verdict in data.verdicts:
            msg = verdict.get("message") or (f"{'PASS' if verdict['passed'] else 'FAIL'}: {verdict['percentile']} "
                                             f"{verdict['latency_ms']:.3f} ms vs {verdict['budget_ms']} ms")
            lines.append(f"- **{'PASS' if verdict['passed'] else 'FAIL'}** {md(msg.split(': ', 1)[-1])}")
        lines.append("")
        summary["verdicts"] = data.verdicts
    return "\n".join(lines) + "\n", summary


def _short_metrics(metrics: dict[str, Any], limit: int = 4) -> str:
    flat = []
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            flat.append(f"{k}={v:.4g}")
        elif isinstance(v, dict) and "max_abs_error" in v:
            flat.append(f"{k}: max abs err {v['max_abs_error']:.2e}")
        if len(flat) >= limit:
            break
    return ", ".join(flat) or "-"


def _rel(p: Path, root: Path) -> str:
    try:
        return str(p.relative_to(root)) or "."
    except ValueError:
        return str(p)


def render_report(folder: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                  budget_ms: float | None = None, percentile: str = "p99", top_k: int = 10) -> Path:
    """Write ``report.md`` and ``report.json`` for a run folder; returns the Markdown path.

    >>> render_report("out/demo", budget_ms=33)  # doctest: +SKIP
    PosixPath('out/demo/report.md')
    """
    run = Path(folder) / "results.json"
    if run.is_file():  # a pipeline run folder: its summary, and the HTML report with plots
        given = [flag for flag, used in (("--budget-ms", budget_ms is not None), ("--percentile", percentile != "p99"),
                                         ("--top-k", top_k != 10)) if used]
        if given:  # the run's own recipe holds its budgets: an option that would change nothing is refused
            raise BadInputError(f"{', '.join(given)} apply to the report of an engine folder; {str(folder)!r} is a "
                                "pipeline run, whose budgets and percentiles come from its recipe (leave them out)")
        return _render_run(Path(folder), out)
    data = collect(folder)
    md, summary = render_markdown(data, budget_ms=budget_ms, percentile=percentile, top_k=top_k)
    out_md = Path(out) if out else data.folder / "report.md"
    check_report_outputs(out_md, (".json",), folder, named=out is not None)
    atomic_write_text(out_md, md, protect=(folder,))
    atomic_write_json(out_md.with_suffix(".json"), summary, protect=(folder,))
    return out_md


def check_report_outputs(out_md: Path, siblings: tuple[str, ...], folder: str | os.PathLike[str],
                         named: bool = True) -> None:
    """Before anything is written: the Markdown file the user named (``--markdown``) may be replaced;
    the default one (``named`` False) and the ``.json`` / ``.html`` siblings only when they
    are edgekit reports, so a report never overwrites a file it did not write."""
    check_output_file(out_md, (folder,))
    for path in ([] if named else [out_md]) + [out_md.with_suffix(suffix) for suffix in siblings]:
        check_output_file(path, (folder,))
        if path.is_file() and not _is_report_file(path):
            what = f"the report {out_md} also writes {path}, which" if path != out_md else f"{path}"
            raise BadInputError(f"{what} exists and is not an edgekit report; choose another --markdown FILE "
                                "(edgekit replaces only the reports it wrote)")


def _is_report_file(path: Path) -> bool:
    """Whether ``path`` is a report edgekit wrote (read bounded: it may be anything)."""
    if path.suffix in (".md", ".html"):
        try:
            with open(path, "rb") as f:  # a regular file (checked by the caller): its first bytes say
                head = f.read(4096)
        except OSError:
            return False
        text = head.decode("utf-8", errors="replace")
        if path.suffix == ".md":
            return text.startswith(("# edgekit report: ", "# edgekit run: "))
        return text.startswith("<!doctype html>") and "<title>edgekit " in text[:2000]
    try:
        data = read_json(path, "report")
    except EdgekitError:
        return False
    return isinstance(data, dict) and ({"folder", "artifacts", "profiles"} <= set(data)
                                       or {"recipe", "stages", "run_dir"} <= set(data))


def _render_run(folder: Path, out: str | os.PathLike[str] | None) -> Path:
    data = read_json(folder / "results.json", "run results")
    data["stages"] = [StageResult(**s) for s in data["stages"]]
    result = RunResult(**data)
    out_md = Path(out) if out else folder / "report.md"
    check_report_outputs(out_md, (".json", ".html"), folder, named=out is not None)
    atomic_write_text(out_md, markdown_summary(result), protect=(folder,))
    atomic_write_json(out_md.with_suffix(".json"), result.to_dict(), protect=(folder,))
    render_run_html(result, out_md.with_suffix(".html"))
    return out_md
