"""Self-contained HTML reports (plots embedded as PNG data URIs) and sweep plots."""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from edgekit.artifact import atomic_write_bytes, atomic_write_text

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem;color:#1b1f24;max-width:1200px}
h1{font-size:1.6rem} h2{font-size:1.25rem;margin-top:2rem} table{border-collapse:collapse;margin:.5rem 0}
th,td{border:1px solid #d0d7de;padding:.3rem .6rem;text-align:right} th{background:#f6f8fa}
td:first-child,th:first-child{text-align:left} .pass{color:#1a7f37;font-weight:600} .fail{color:#cf222e;font-weight:600}
img{max-width:100%;border:1px solid #d0d7de;margin:.5rem 0} .note{color:#57606a}
"""


def _figure() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _figure().close(fig)
    return buf.getvalue()


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" class="plot" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(columns: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in r:
            cls = ' class="pass"' if c == "PASS" else ' class="fail"' if c == "FAIL" else ""
            cells.append(f"<td{cls}>{html.escape(str(c))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def stage_bar_png(result: Any, target: str) -> bytes:
    """Stacked per-stage latency bar (critical path) against the budget line."""
    plt = _figure()
    stages = [r for r in result.stages if r.target == target]
    t = result.targets[target]
    fig, ax = plt.subplots(figsize=(8, 2.2 + 0.1 * len(stages)))
    colors = plt.cm.tab10.colors
    for i, r in enumerate(stages):
        ax.barh([0], [r.latency_ms], left=[r.start_ms], color=colors[i % 10], edgecolor="white",
                label=f"{r.stage} {r.latency_ms:.2f} ms")
    if t.get("budget_ms"):
        ax.axvline(t["budget_ms"], color="#cf222e", linestyle="--", linewidth=2, label=f"budget {t['budget_ms']:g} ms")
    ax.set_yticks([])
    ax.set_xlabel(f"ms ({result.percentile}{', estimate' if t.get('estimated') else ''})")
    ax.set_title(f"{target}: total {t['total_ms']:.2f} ms")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=min(4, len(stages) + 1), fontsize=8, frameon=False)
    return _png(fig)


def latency_distribution_png(result: Any, target: str) -> bytes:
    """Per stage: p50 (bar) with whiskers to p99 (the tail the budget gates on)."""
    plt = _figure()
    stages = [r for r in result.stages if r.target == target]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(stages)))
    names = [r.stage for r in stages]
    p50 = [r.p50_ms for r in stages]
    tail = [max(r.p99_ms - r.p50_ms, 0.0) for r in stages]
    ax.barh(names, p50, xerr=[[0] * len(stages), tail], color="#54aeff", capsize=4)
    for r in stages:
        if r.budget_ms is not None:
            ax.plot([r.budget_ms], [r.stage], marker="|", markersize=18, color="#cf222e")
    ax.invert_yaxis()
    ax.set_xlabel("ms: bar p50, whisker p99, red tick stage budget")
    return _png(fig)


def render_run_html(result: Any, path: Path) -> Path:
    from edgekit.pipelines.run import STAGE_COLUMNS, stage_table
    from edgekit.profiling import ProfileResult

    parts = [f"<h1>edgekit run: {html.escape(str(result.recipe['name']))}</h1>",
             f"<p class=\"{'pass' if result.passed else 'fail'}\">{'PASS' if result.passed else 'FAIL'}</p>",
             f"<p class=note>latency at {result.percentile}; seed {result.seed}; {result.seconds:.1f} s; "
             f"torch {html.escape(result.versions.get('torch', '?'))}, onnxruntime "
             f"{html.escape(result.versions.get('onnxruntime', '?'))}</p>",
             "<h2>Stages</h2>", _table(STAGE_COLUMNS, stage_table(result))]
    for target, t in result.targets.items():
        verdict = "" if t["budget_ms"] is None else (
            f" against {t['budget_ms']:g} ms: <span class=\"{'pass' if t['passed'] else 'fail'}\">"
            f"{'PASS' if t['passed'] else 'FAIL'}</span> (margin {t['margin_ms']:+.3f} ms)")
        parts += [f"<h2>{html.escape(target)}</h2>",
                  f"<p>total {t['total_ms']:.3f} ms{' (estimate)' if t['estimated'] else ''}{verdict}</p>",
                  _img(stage_bar_png(result, target), f"per-stage latency on {target}"),
                  _img(latency_distribution_png(result, target), f"latency distribution on {target}")]
        for r in result.stages:
            if r.target != target:
                continue
            prof_path = _profile_path(r)
            if prof_path is None:
                continue
            prof = ProfileResult.load(prof_path)
            if prof.nodes:
                parts.append(f"<h3>{html.escape(r.stage)}: top nodes</h3>")
                parts.append(_table(["node", "op", "ms", "share", "precision"],
                                    [[n.name, n.op_type, f"{n.time_ms:.4f}", f"{n.share:.1%}", n.precision]
                                     for n in prof.nodes[:10]]))
    sweep = Path(result.run_dir) / "sweep.json"
    if sweep.exists():
        parts.append('<p>See <a href="sweep.html">the sweep</a>.</p>')
    return _write_html(path, f"edgekit run {result.recipe['name']}", parts)


def _profile_path(r: Any) -> Path | None:
    for key in ("profile", "estimate"):
        folder = r.artifacts.get(key)
        if folder and (Path(folder) / "profile.json").exists():
            return Path(folder) / "profile.json"
    if r.profile and Path(str(r.profile)).is_dir():
        p = Path(str(r.profile)) / "profile.json"
        return p if p.exists() else None
    return None


def sweep_plots(rows: list[Any], out: Path) -> dict[str, Path]:
    """PNG files: metric vs latency (per target) and metric vs size, Pareto points marked."""
    plt = _figure()
    plots: dict[str, Path] = {}
    rows = [r for r in rows if r.value is not None]
    if not rows:
        return plots
    metric = rows[0].metric or "metric"
    targets = sorted({t for r in rows for t in r.latency_ms})
    for t in targets:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        _scatter(ax, [(r.latency_ms.get(t), r) for r in rows], f"latency on {t} (ms)", metric)
        ax.set_title(f"{metric} vs latency ({t})")
        plots[f"latency-{t}"] = atomic_write_bytes(out / f"pareto-latency-{t}.png", _png(fig))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    _scatter(ax, [(r.size_mb, r) for r in rows], "model size (MB)", metric)
    ax.set_title(f"{metric} vs size")
    plots["size"] = atomic_write_bytes(out / "pareto-size.png", _png(fig))
    return plots


def _scatter(ax: Any, points: list[tuple[float | None, Any]], xlabel: str, ylabel: str) -> None:
    pts = [(x, r) for x, r in points if x is not None]
    ax.scatter([x for x, r in pts if not r.pareto], [r.value for x, r in pts if not r.pareto], color="#8c959f",
               label="dominated")
    front = sorted([(x, r) for x, r in pts if r.pareto], key=lambda p: p[0])
    ax.plot([x for x, _ in front], [r.value for _, r in front], "o-", color="#0969da", label="Pareto frontier")
    for x, r in pts:
        ax.annotate(", ".join(f"{v}" for v in r.params.values()), (x, r.value), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def render_sweep_html(rows: list[Any], path: Path, plots: dict[str, Path], recipe: str) -> Path:
    from edgekit.pipelines.sweep import SWEEP_COLUMNS, sweep_table

    parts = [f"<h1>edgekit sweep: {html.escape(recipe)}</h1>",
             "<p class=note>Pareto frontier (*): configurations no other one beats on metric, latency and size "
             "at once. Latency is measured where edgekit can run the target, estimated (roofline) elsewhere.</p>",
             _table(SWEEP_COLUMNS, sweep_table(rows))]
    for name, p in plots.items():
        parts.append(_img(Path(p).read_bytes(), name))
    return _write_html(path, f"edgekit sweep {recipe}", parts)


def _write_html(path: Path, title: str, parts: list[str]) -> Path:
    doc = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")
    atomic_write_text(path, doc)
    return Path(path)
