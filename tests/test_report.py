"""``edgekit report``: every latency says where it comes from (measured here, estimated, or recorded
on the device, with its provenance)."""
from __future__ import annotations

import json
from pathlib import Path

from edgekit.profiling import LatencyStats, ProfileResult
from edgekit.report import render_report
from edgekit.runtimes.base import Provenance


def _profile(source: str, provenance: Provenance | None = None, model: str = "m") -> ProfileResult:
    stats = LatencyStats.from_samples([2.0, 2.1, 2.2]) if source != "estimated" else \
        LatencyStats(2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0)
    return ProfileResult(engine="e", runtime={"device": "tensorrt", "estimated": "estimate"}.get(source, "onnxruntime"), target="jetson-agx-orin-64",
                         model=model, settings={}, latency_ms=stats, throughput_per_s=500.0, source=source,
                         provenance=provenance)


def test_each_latency_says_device_or_estimate_and_provenance(tmp_path: Path) -> None:
    _profile("measured", model="here").save(tmp_path / "here.json")
    _profile("estimated", model="guess").save(tmp_path / "guess.json")
    unverified = Provenance("unverified", reasons=["the TensorRT version is not recorded"])
    _profile("device", unverified, model="orin").save(tmp_path / "orin.json")
    out = render_report(tmp_path, tmp_path / "r.md")
    text = out.read_text()
    assert "## Latency: here on jetson-agx-orin-64 (onnxruntime, measured)" in text
    assert "## Latency: guess on jetson-agx-orin-64 (estimate, estimated)" in text
    assert "| 500.0/s | estimated |" in text
    assert "Every number in this table is an ESTIMATE (roofline model), not a measurement." in text
    assert "## Latency: orin on jetson-agx-orin-64 (tensorrt, device (UNVERIFIED))" in text
    assert "| 500.0/s | device (UNVERIFIED) |" in text
    assert "Provenance: UNVERIFIED: the TensorRT version is not recorded." in text
    summary = json.loads(out.with_suffix(".json").read_text())
    assert {(p["model"], p["source"], p["provenance"]) for p in summary["profiles"]} == {
        ("here", "measured", None), ("guess", "estimated", None), ("orin", "device", "unverified")}


def test_a_pipeline_run_folder_refuses_the_engine_report_options(tmp_path: Path) -> None:
    """A run's budgets come from its recipe: --budget-ms, --percentile and --top-k would change
    nothing there, so they are refused (before, silently ignored), and nothing is written."""
    import pytest

    from edgekit.errors import BadInputError

    (tmp_path / "results.json").write_text(json.dumps({"recipe": {}, "stages": []}))
    for kwargs, flags in (({"budget_ms": 33.0}, "--budget-ms"), ({"percentile": "p50", "top_k": 3},
                                                                  "--percentile, --top-k")):
        with pytest.raises(BadInputError, match=rf"^{flags} apply to the report of an engine folder; .* is a pipeline "
                                                r"run, whose budgets and percentiles come from its recipe"):
            render_report(tmp_path, **kwargs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
