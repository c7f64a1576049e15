"""Long work talks (progress lines in logs, --quiet/--verbose) and node names a person can follow."""
from __future__ import annotations

import io
import time

import onnx
import pytest

from edgekit.progress import StepProgress
from edgekit.sources.onnx_file import onnx_node_label


def test_phases_are_lines_and_a_blocking_step_still_talks():
    out = io.StringIO()
    with StepProgress("compress", total=2, interval=0.2, stream=out, min_phase_s=0.1) as p:
        p.phase("int8 (1/2)")
        time.sleep(0.7)  # a step that blocks inside a library: the heartbeat writes lines anyway
        p.update(1)
        p.phase("prune (2/2)")  # quick: no line of its own
    lines = out.getvalue().splitlines()
    beats = [ln for ln in lines if ln.startswith("compress: step 0/2 (0%), int8 (1/2), elapsed 0:00:0")]
    assert len(beats) >= 2 and all(ln.endswith("remaining ?") for ln in beats)
    done = [ln for ln in lines if "int8 (1/2) done in 0." in ln]
    assert len(done) == 1 and done[0].startswith("compress: step 1/2 (50%), int8 (1/2) done in 0.")
    assert "remaining 0:00:0" in done[0] and not any("prune" in ln for ln in lines)


def test_a_failing_or_quick_step_prints_no_progress_line():
    out = io.StringIO()
    with pytest.raises(ValueError):
        with StepProgress("compress", total=1, interval=30, stream=out) as p:
            p.phase("int8 (1/1)")
            raise ValueError("bad calibration data")  # the CLI prints this as the one error line
    with StepProgress("compress", total=1, interval=30, stream=out) as p:
        p.phase("int8 (1/1)")
        p.update(1)
    assert out.getvalue() == ""


def test_quiet_silences_progress(monkeypatch):
    from edgekit import progress

    monkeypatch.setattr(progress, "_VERBOSITY", -1)
    out = io.StringIO()
    with StepProgress("x", total=1, interval=0.0, stream=out) as p:
        p.phase("a")
        p.update(1)
    assert out.getvalue() == ""
    assert list(progress.progress_bar(range(3), "y")) == [0, 1, 2]


def test_quiet_and_verbose_on_every_command(monkeypatch):
    from click.testing import CliRunner

    from edgekit import progress
    from edgekit.cli import cli

    monkeypatch.setattr(progress, "_VERBOSITY", 0)  # restored after the test: --quiet sets it for the process

    r = CliRunner().invoke(cli, ["--help"])
    assert "--quiet" in r.output and "--verbose" in r.output
    r = CliRunner().invoke(cli, ["--quiet", "--verbose", "zoo"])
    assert r.exit_code == 2 and "--quiet and --verbose contradict each other" in r.output
    r = CliRunner().invoke(cli, ["--quiet", "zoo"])
    assert r.exit_code == 0


def test_compress_in_a_ci_log_prints_progress_lines(tmp_path, monkeypatch):
    """`edgekit compress` with stderr not a terminal (a CI log): a line when each step ends
    (the tiny model's step is quick, so the one-second floor is lowered here)."""
    import numpy as np
    from click.testing import CliRunner

    from edgekit import progress
    from edgekit.cli import cli

    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(progress, "MIN_PHASE_S", 0.0)
    monkeypatch.setenv("EDGEKIT_PROGRESS", "1")
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((40, 16)).astype(np.float32))
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "-o", str(tmp_path / "q"),
                                 "--bits", "8", "--calib", str(tmp_path / "calib.npy"), "--calib-samples", "8"])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("compress: ")]
    assert len(lines) == 1
    assert lines[0].startswith("compress: step 1/1 (100%), int8 (1/1) done in ")
    assert "elapsed 0:00:" in lines[0] and lines[0].endswith("remaining 0:00:00")


def _node(**meta: str) -> onnx.NodeProto:
    n = onnx.helper.make_node("Conv", ["x", "w"], ["y"], name="node_conv2d")
    if meta:
        onnx.helper.set_metadata_props(n, meta)
    return n


@pytest.mark.parametrize("meta, label", [
    ({}, "node_conv2d"),
    ({"pkg.torch.onnx.name_scopes": "['', 'block', 'block.conv', 'conv2d']"}, "block.conv"),
    ({"pkg.torch.onnx.name_scopes": "['', 'relu']"}, "relu"),  # a functional op in the model's own forward
    ({"namespace": ": __main__.M/backbone: B/backbone.0: torch.nn.modules.conv.Conv2d/conv2d: aten.conv2d.default"},
     "backbone.0"),
    ({"pkg.torch.onnx.name_scopes": "__import__('os')"}, "node_conv2d"),  # not a literal list: ignored, never run
])
def test_node_label_is_the_module_path_the_exporter_recorded(meta, label):
    assert onnx_node_label(_node(**meta)) == label


def test_profile_names_nodes_by_module_path(tmp_path, tiny_cnn):
    pytest.importorskip("onnxruntime")
    from edgekit.build import build_engine
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.profiling import ProfileConfig, profile_engine
    from edgekit.targets import load_target

    export_onnx(tiny_cnn, tmp_path / "onnx", ExportConfig())
    build_engine(str(tmp_path / "onnx"), load_target("cpu"), tmp_path / "engine")
    prof = profile_engine(tmp_path / "engine", ProfileConfig(warmup_ms=0, duration_s=0, iterations=3, threads=1,
                                                             node_iterations=2, top_k=0))
    modules = {n.module for n in prof.nodes if n.module}
    assert modules, [n.name for n in prof.nodes]
    assert all(not m.startswith("node_") for m in modules)  # module paths, not ONNX node names
    assert all(n.label == (n.module or n.name) for n in prof.nodes)
