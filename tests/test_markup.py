"""Hostile names into every writer: Markdown (report, run summary, sweep, TensorRT bundle
README), JUnit, HTML and the command line's tables. Node names with ``<script>`` and
``<img onerror>`` went raw into `edgekit report`'s Markdown and a ``|`` broke its table;
each writer now shows every name as the text it is."""
from __future__ import annotations

import io
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from edgekit.markup import md, md_code, xml_attr, xml_text
from edgekit.pipelines.results import RunResult, StageResult, SweepRow, junit_xml, markdown_summary
from edgekit.profiling import LatencyStats, ProfileResult
from edgekit.runtimes.base import NodeTiming, Provenance

HOSTILE = [
    "<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "conv|relu", "a\nb|c", "[click](javascript:alert(1))",
    "![x](http://evil/x.png)", "**bold** _it_ ~~gone~~", "`code` ``x``", "&lt;not an entity&gt;", "[/]", "[bold red]",
    "x\x00y\x1bz\x08", "]]><!--", "\\|escaped", "## heading", "> quote", "```\nfence\n```", "cost $\\frac{",
]


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells, split on the pipes that are not escaped."""
    assert line.startswith("|") and line.endswith("|"), line
    return re.split(r"(?<!\\)\|", line[1:-1])


def check_markdown(text: str) -> None:
    """No raw HTML from the names, and every table row has its header's number of cells."""
    lowered = text.lower()
    assert "<script" not in lowered and "<img" not in lowered and "<!--" not in lowered, text
    header: int | None = None
    for line in text.splitlines():
        if line.startswith("|"):
            n = len(_cells(line))
            header = n if header is None else header
            assert n == header, (line, header)
        else:
            header = None
        assert not re.search(r"(?<!\\)\[[^\]]*\]\(", line), line  # no live link or image


def hostile_profile(name: str) -> ProfileResult:
    nodes = [NodeTiming(name=f"n{i}", op_type=h, time_ms=1.0, share=0.1, precision=h, module=h)
             for i, h in enumerate(HOSTILE)]
    # a device's records (GPU name, TensorRT version) reach the provenance line as they were written
    return ProfileResult(engine=name, runtime="tensorrt", target="cpu", model=name, settings={"note": name},
                         latency_ms=LatencyStats.from_samples([1.0, 2.0, 3.0]), throughput_per_s=1.0,
                         nodes=nodes, warnings=list(HOSTILE), source="device",
                         machine={"board": name, "jetpack": HOSTILE[2], "power_mode": HOSTILE[0]},
                         provenance=Provenance("verified", checks=[{"check": h, "result": "match", "recorded": h,
                                                                    "expected": h, "from": h} for h in HOSTILE]))


@pytest.mark.parametrize("name", HOSTILE)
def test_md_keeps_the_text_and_drops_the_markup(name: str) -> None:
    out = md(name)
    assert "\n" not in out and "<" not in out and ">" not in out
    assert not re.search(r"(?<!\\)[|`*\[\]~]", out), out
    check_markdown(f"| {out} |")


def test_code_blocks_cannot_be_closed_from_inside() -> None:
    lines = md_code("a ``` b ```` c", "bash")
    assert lines[0] == "`````bash" and lines[-1] == "`````"


def test_xml_round_trips_every_name() -> None:
    for name in HOSTILE:
        doc = f"<r a={xml_attr(name)}>{xml_text(name)}</r>"
        el = ET.fromstring(doc)
        clean = re.sub("[\x00-\x08\x0b\x0c\x0e-\x1f]", "\ufffd", name)
        assert el.get("a") == clean and el.text == clean.replace("\r", "\n")


def test_report_markdown_escapes_node_names(tmp_path: Path) -> None:
    from edgekit.report import render_report

    folder = tmp_path / "run|<b>"
    folder.mkdir()
    hostile_profile("<img src=x onerror=alert(1)>|m").save(folder / "profile.json")
    md_path = render_report(folder)
    text = md_path.read_text()
    check_markdown(text)
    for name in ("conv\\|relu", "&lt;script&gt;alert(1)&lt;/script&gt;", "\\[click\\](javascript:alert(1))"):
        assert name in text
    assert "Provenance: verified: " in text and "Measured on the device: " in text


def _run_result() -> RunResult:
    stages = [StageResult(stage=h, target=h, kind="model", source="measured", latency_ms=1.0, p50_ms=1.0, p99_ms=1.0,
                          budget_ms=0.5, passed=False, warnings=[h],
                          gates=[{"stage": h, "metric": h, "value": 0.5, "min": 0.9, "passed": False}])
              for h in HOSTILE]
    targets = {h: {"budget_ms": 1.0, "passed": True, "total_ms": 0.5, "margin_ms": 0.5, "method": h}
               for h in HOSTILE}
    return RunResult(recipe={"name": "<script>x</script>"}, run_dir="r", percentile="p99", seed=0, targets=targets,
                     passed=False, versions={"torch": "<b>", "onnxruntime": "|"}, seconds=1.0, stages=stages)


def test_run_summary_markdown_escapes_every_name() -> None:
    text = markdown_summary(_run_result())
    check_markdown(text)
    assert text.count("**PASS**") == len(HOSTILE)  # the verdict stays bold, the names do not


def test_junit_parses_and_keeps_every_name() -> None:
    root = ET.fromstring(junit_xml(_run_result()))
    names = [tc.get("name") for tc in root.iter("testcase")]
    assert "<script>alert(1)</script>.<script>alert(1)</script>.budget" in names
    assert len(names) == 3 * len(HOSTILE)  # target budgets, stage budgets, gates
    messages = [f.get("message") for f in root.iter("failure")]
    assert any("<img src=x onerror=alert(1)>" in (m or "") for m in messages)


def test_html_escapes_every_name(tmp_path: Path) -> None:
    from edgekit.pipelines.html import render_run_html

    text = render_run_html(_run_result(), tmp_path / "report.html").read_text()
    assert "<script" not in text.lower() and "<img src=x" not in text and "&lt;script&gt;" in text


def test_sweep_markdown_escapes_parameters(tmp_path: Path) -> None:
    from edgekit.pipelines.sweep import write_sweep_outputs

    rows = [SweepRow(params={"prune.ratio": h}, run_dir="r", passed=True, metric=h, value=0.9, higher_is_better=True,
                     size_mb=1.0, latency_ms={"cpu": 1.0}) for h in HOSTILE]
    write_sweep_outputs(rows, tmp_path, {"prune.ratio": HOSTILE}, "<script>r</script>.yaml")
    check_markdown((tmp_path / "sweep.md").read_text())
    assert "<script" not in (tmp_path / "sweep.html").read_text().lower()


def test_tensorrt_bundle_readme_escapes_names() -> None:
    from edgekit.runtimes.tensorrt.bundle import bundle_readme
    from edgekit.runtimes.tensorrt.settings import TrtSettings, trtexec_argv
    from edgekit.targets import load_target

    settings = TrtSettings("fp16", shapes={h: {"min": [1], "opt": [1], "max": [1]} for h in HOSTILE})
    argv = trtexec_argv(settings, onnx="onnx/<img src=x onerror=alert(1)>```.onnx")
    text = bundle_readme(argv, load_target("jetson-agx-orin-64"), settings, "onnx/<script>x</script>|.onnx",
                         list(HOSTILE), {"summary": "<b>s</b>", "reason": "|r"}, list(HOSTILE))
    outside = re.sub(r"(?ms)^(`{3,})bash$.*?^\1$", "", text)  # the command, in a code block it cannot close
    check_markdown(outside)
    assert outside.count("```") == 0 or "`````" not in outside


def test_command_line_tables_show_markup_as_text() -> None:
    """rich reads ``[/]`` and ``[bold]`` in a cell as markup (a node named ``[/]`` failed to
    render); the tables show names as written."""
    from rich.console import Console

    from edgekit import cli

    buf = io.StringIO()
    Console(file=buf, width=400).print(cli._table("[bold]t[/]", ["[/]"], [[h.replace("\n", " ")] for h in HOSTILE]))
    out = buf.getvalue()
    assert "[/]" in out and "[bold red]" in out and "[bold]t[/]" in out
    buf = io.StringIO()
    real = cli._console
    try:
        cli._console = lambda: Console(file=buf, width=400)  # type: ignore[assignment]
        cli._print_profile(hostile_profile("[/]"), 20)
    finally:
        cli._console = real  # type: ignore[assignment]
    assert "[link=javascript" not in buf.getvalue() and "[bold red]" in buf.getvalue()
