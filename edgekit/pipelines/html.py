"""Self-contained HTML reports (plots embedded as PNG data URIs) and sweep plots."""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from edgekit.artifact import atomic_write_bytes, atomic_write_text
from edgekit.pipelines.frames import load_frames
from edgekit.pipelines.results import (
    STAGE_COLUMNS,
    SWEEP_COLUMNS,
    RunResult,
    StageResult,
    SweepRow,
    source_label,
    stage_table,
    sweep_table,
    target_measurement,
)
from edgekit.profiling import ProfileResult

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


def stage_bar_png(result: RunResult, target: str) -> bytes:
    """Where a frame's time goes: each stage as a bar from its start to its end (measured
    frames: the mean over the frames, so parallel stages overlap; estimates: the critical
    path of the stage estimates), the end-to-end figure and the budget as lines."""
    plt = _figure()
    stages = [r for r in result.stages if r.target == target]
    t = result.targets[target]
    measured = t.get("method") == "measured frames"
    fig, ax = plt.subplots(figsize=(8, 2.2 + 0.1 * len(stages)))
    colors = plt.cm.tab10.colors
    for i, r in enumerate(stages):
        width = r.end_ms - r.start_ms if measured else r.latency_ms
        label = (f"{r.stage} mean {width:.2f} ms ({result.percentile} {r.latency_ms:.2f})" if measured
                 else f"{r.stage} {r.latency_ms:.2f} ms")
        lane = [0.0] if not r.parallel_with else [-0.45]
        ax.barh(lane, [width], left=[r.start_ms], height=0.8 if not r.parallel_with else 0.4,
                color=colors[i % 10], edgecolor="white", label=label)
    ax.axvline(t["total_ms"], color="#1b1f24", linewidth=1.5,
               label=f"frame {result.percentile} {t['total_ms']:.2f} ms" + ("" if measured else " (estimate)"))
    if t.get("budget_ms"):
        ax.axvline(t["budget_ms"], color="#cf222e", linestyle="--", linewidth=2, label=f"budget {t['budget_ms']:g} ms")
    ax.set_yticks([])
    ax.set_xlabel("ms into the frame (mean over the measured frames)" if measured else
                  f"ms ({result.percentile}, estimate: sum of stages along the critical path"
                  + (f", range {t['range_ms'][0]:.2f}-{t['range_ms'][1]:.2f} ms)" if t.get("range_ms") else ")"))
    ax.set_title(f"{target}: frame {result.percentile} {t['total_ms']:.2f} ms"
                 + (f", mean {t['mean_ms']:.2f} ms" if measured and t.get("mean_ms") else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=min(3, len(stages) + 2), fontsize=8, frameon=False)
    return _png(fig)


def latency_distribution_png(result: RunResult, target: str) -> bytes:
    """The measured distribution: per stage and for the whole frame, a box (quartiles, median)
    with whiskers to p1 and p99 and the frames beyond them as points, from the same frames;
    the budgets as red ticks. A target that was estimated has no distribution: its p50 and
    p99 per stage are drawn as a bar and a whisker, and the plot says so."""
    plt = _figure()
    stages = [r for r in result.stages if r.target == target]
    t = result.targets[target]
    frames_dir = t.get("frames_dir")
    fig, ax = plt.subplots(figsize=(8, 0.9 + 0.5 * (len(stages) + 1)))
    if frames_dir and (Path(frames_dir) / "frames.json").is_file():
        m = load_frames(Path(frames_dir) / "frames.json")
        names = [r.stage for r in stages] + ["frame (end to end)"]
        data = [m.stage_ms[r.stage] for r in stages] + [m.total_ms]
        ax.boxplot(data, vert=False, whis=(1, 99), widths=0.6, patch_artist=True,
                   boxprops={"facecolor": "#b6e3ff", "edgecolor": "#0969da"},
                   medianprops={"color": "#0969da", "linewidth": 2},
                   flierprops={"marker": ".", "markersize": 3, "markeredgecolor": "#57606a"})
        ax.set_yticks(range(1, len(names) + 1), names)
        for k, r in enumerate(stages):
            if r.budget_ms is not None:
                ax.plot([r.budget_ms], [k + 1], marker="|", markersize=18, color="#cf222e")
        if t.get("budget_ms"):
            ax.plot([t["budget_ms"]], [len(names)], marker="|", markersize=18, color="#cf222e")
        ax.set_xscale("log")
        ax.set_xlabel(f"ms per frame over {len(m.total_ms)} frames (log): box quartiles, whiskers p1-p99, "
                      "red tick budget")
    else:
        names = [r.stage for r in stages]
        p50 = [r.p50_ms for r in stages]
        tail = [max(r.p99_ms - r.p50_ms, 0.0) for r in stages]
        ax.barh(names, p50, xerr=[[0] * len(stages), tail], color="#54aeff", capsize=4)
        for r in stages:
            if r.budget_ms is not None:
                ax.plot([r.budget_ms], [r.stage], marker="|", markersize=18, color="#cf222e")
        ax.set_xlabel("ms: bar p50, whisker p99, red tick stage budget (estimates: no distribution)")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3, which="both")
    return _png(fig)


def render_run_html(result: RunResult, path: Path) -> Path:
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
        noisy = " <b>noisy measurement: the verdict is uncertain</b>" if t.get("noisy") else ""
        parts += [f"<h2>{html.escape(target)}</h2>",
                  f"<p>{html.escape(target_measurement(t, result.percentile))}{verdict}{noisy}</p>",
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
                parts.append(f"<p class=note>{html.escape(r.stage)} alone "
                             f"({html.escape(source_label(prof.source, prof.provenance.status if prof.provenance else None))}"
                             f"): p50 {prof.latency_ms.p50:.3f} ms, "
                             f"p99 {prof.latency_ms.p99:.3f} ms, cv {prof.latency_ms.cv:.1%}"
                             f"{' (noisy)' if prof.noisy else ''}</p>")
                parts.append(_table(["node (module path, else ONNX name)", "op", "ms", "share", "precision"],
                                    [[n.label, n.op_type, f"{n.time_ms:.4f}", f"{n.share:.1%}", n.precision]
                                     for n in prof.nodes[:10]]))
    sweep = Path(result.run_dir) / "sweep.json"
    if sweep.exists():
        parts.append('<p>See <a href="sweep.html">the sweep</a>.</p>')
    return _write_html(path, f"edgekit run {result.recipe['name']}", parts)


def _profile_path(r: StageResult) -> Path | None:
    for key in ("profile", "estimate"):
        folder = r.artifacts.get(key)
        if folder and (Path(folder) / "profile.json").exists():
            return Path(folder) / "profile.json"
    if r.profile and Path(str(r.profile)).is_dir():
        p = Path(str(r.profile)) / "profile.json"
        return p if p.exists() else None
    return None


def pareto_2d(points: list[tuple[float, float]], higher_is_better: bool) -> list[bool]:
    """Which (cost, quality) points no other point beats in both: lower cost, and higher
    quality (``higher_is_better``) or lower. The Pareto set of one 2-D plot, in its own two
    dimensions.

    >>> pareto_2d([(1, 0.90), (2, 0.92), (3, 0.89), (4, 0.95)], True)
    [True, True, False, True]
    """
    def q(v: float) -> float:
        return -v if higher_is_better else v

    out = []
    for i, (x, y) in enumerate(points):
        dominated = any(x2 <= x and q(y2) <= q(y) and (x2 < x or q(y2) < q(y))
                        for j, (x2, y2) in enumerate(points) if j != i)
        out.append(not dominated)
    return out


def sweep_plots(rows: list[SweepRow], out: Path, budget_ms: float | None = None, percentile: str = "p99"
                ) -> dict[str, Path]:
    """PNG files: metric vs latency (per target) and metric vs size, each with the Pareto
    set of its own two dimensions joined, every point labelled with its parameters; latency
    plots carry the end-to-end budget line and p50-p99 error bars."""
    plt = _figure()
    plots: dict[str, Path] = {}
    rows = [r for r in rows if r.value is not None]
    if not rows:
        return plots
    metric = rows[0].metric or "metric"
    targets = sorted({t for r in rows for t in r.latency_ms})
    for t in targets:
        fig, ax = plt.subplots(figsize=(7, 4.6))
        pts = [(r.latency_ms.get(t), r) for r in rows]
        _scatter(ax, pts, f"end-to-end latency on {t} (ms, {percentile}; bars p50-p99)", metric)
        bars = [(x, r) for x, r in pts if x is not None and t in r.p50_ms and t in r.p99_ms]
        if bars:
            ax.errorbar([x for x, _ in bars], [r.value for _, r in bars],
                        xerr=[[max(x - r.p50_ms[t], 0.0) for x, r in bars],
                              [max(r.p99_ms[t] - x, 0.0) for x, r in bars]],
                        fmt="none", ecolor="#8c959f", elinewidth=1, capsize=3, zorder=1)
        if budget_ms is not None:
            ax.axvline(budget_ms, color="#cf222e", linestyle="--", linewidth=1.5, label=f"budget {budget_ms:g} ms")
            ax.legend(fontsize=8)
        ax.set_title(f"{metric} vs latency ({t})")
        plots[f"latency-{t}"] = atomic_write_bytes(out / f"pareto-latency-{t}.png", _png(fig))
    fig, ax = plt.subplots(figsize=(7, 4.6))
    _scatter(ax, [(r.size_mb, r) for r in rows], "model size (MB)", metric)
    ax.set_title(f"{metric} vs size")
    plots["size"] = atomic_write_bytes(out / "pareto-size.png", _png(fig))
    return plots


def _scatter(ax: Any, points: list[tuple[float | None, SweepRow]], xlabel: str, ylabel: str) -> None:
    pts = [(x, r.value, r) for x, r in points if x is not None and r.value is not None]
    front_mask = pareto_2d([(x, y) for x, y, _ in pts], pts[0][2].higher_is_better) if pts else []
    ax.scatter([x for (x, _, _), f in zip(pts, front_mask) if not f], [y for (_, y, _), f in zip(pts, front_mask)
                                                                       if not f], color="#8c959f", label="dominated", zorder=2)
    front = sorted([(x, y) for (x, y, _), f in zip(pts, front_mask) if f], key=lambda p: p[0])
    ax.plot([x for x, _ in front], [y for _, y in front], "o-", color="#0969da",
            label="Pareto set (these two axes)", zorder=3)
    for x, y, r in pts:
        ax.annotate(", ".join(f"{k}={v}" for k, v in r.params.items()), (x, y), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def render_sweep_html(rows: list[SweepRow], path: Path, plots: dict[str, Path], recipe: str) -> Path:
    parts = [f"<h1>edgekit sweep: {html.escape(recipe)}</h1>",
             "<p class=note>Table: Pareto set (*) in metric, latency and size together. Each plot joins the Pareto "
             "set of its own two axes. Latency is the measured end-to-end frame latency where edgekit can run the "
             "target (error bars p50-p99), a sum of stage estimates (roofline) elsewhere.</p>",
             _table(SWEEP_COLUMNS, sweep_table(rows))]
    for name, p in plots.items():
        parts.append(_img(Path(p).read_bytes(), name))
    return _write_html(path, f"edgekit sweep {recipe}", parts)


def _write_html(path: Path, title: str, parts: list[str]) -> Path:
    doc = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
           f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")
    atomic_write_text(path, doc)
    return Path(path)
