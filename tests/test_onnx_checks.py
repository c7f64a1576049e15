"""onnx_checks.py: the session options every graph check starts from, and their validation.
(``verify_onnx_runs`` and ``ort_failure`` on real graphs: tests/export/test_onnx_outputs.py;
``allocation_failures``: tests/test_limits.py.)"""
from __future__ import annotations

import pytest

from edgekit.errors import BadInputError
from edgekit.onnx_checks import LEVELS, optimization_level, session_options


def test_session_options_are_the_ones_every_graph_runs_with():
    import onnxruntime as ort

    so = session_options("basic", 2)
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert (so.intra_op_num_threads, so.inter_op_num_threads) == (2, 1)
    assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL and so.log_severity_level == 3
    assert session_options("all", None).intra_op_num_threads == 0  # ONNX Runtime picks
    assert [optimization_level(level) for level in ("disable", "all")] == [
        ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL]


def test_an_unknown_level_names_the_choices():
    with pytest.raises(BadInputError, match=r"^unknown optimization level 'max' \(choose from "):
        session_options("max", 1)
    assert LEVELS == ("disable", "basic", "extended", "layout", "all")


def test_the_engine_adds_to_the_same_options(tmp_path):
    from edgekit.runtimes.onnxruntime import session_options as engine_options

    so = engine_options("extended", 1, profile_prefix=str(tmp_path / "ort"))
    base = session_options("extended", 1)
    assert (so.graph_optimization_level, so.intra_op_num_threads, so.execution_mode) == (
        base.graph_optimization_level, base.intra_op_num_threads, base.execution_mode)
    assert so.enable_profiling and not base.enable_profiling
