"""ONNX Runtime's kernel rates at one thread (estimate/ort_rates.py): every rate is timed on the
operator the rest of edgekit makes ORT run (sgemm, NCHWc convolutions, MatMulIntegerToFloat and
QLinearConv for the int8 step's Q/DQ forms), and the per-node overhead is positive."""
from __future__ import annotations

import numpy as np
import pytest

from edgekit.estimate.ort_rates import CHAIN, _conv_int8, _matmul_int8, _session, measure_kernel_rates, node_overhead_us
from edgekit.targets.host_probe import RATE_KEYS


def test_each_rate_times_the_kernel_real_graphs_run() -> None:
    rates = measure_kernel_rates(seven_bit=True, measure_s=0.02)
    assert [r.key for r in rates] == list(RATE_KEYS)
    by = {r.key: r for r in rates}
    assert all(0.0005 < r.tops < 50 and r.runs >= 5 for r in rates), rates
    assert by["matmul:int8"].kernel.startswith("MatMulIntegerToFloat ") and "7-bit weights" in by["matmul:int8"].kernel
    assert by["conv:int8"].kernel.startswith("QLinearConv ") and by["depthwise-conv:int8"].kernel.startswith("QLinearConv")
    assert by["matmul:fp32"].kernel.startswith("MatMul ") and by["conv:fp32"].kernel.startswith("Conv ")
    # a dense 3x3 convolution does far more work per byte than a depthwise one: it runs faster
    assert by["conv:fp32"].tops > by["depthwise-conv:fp32"].tops


@pytest.mark.parametrize("seven_bit", [True, False])
def test_int8_forms_fuse_into_integer_kernels_with_the_weight_grid_asked(seven_bit: bool) -> None:
    from onnx import load_from_string, numpy_helper

    model, feeds, ops = _conv_int8(np.random.default_rng(0), 16, 8, 1, seven_bit)
    _, graph_ops = _session(model)
    assert graph_ops.count("QLinearConv") == CHAIN and "Conv" not in graph_ops  # no layer left in float
    weights = [numpy_helper.to_array(i) for i in load_from_string(model).graph.initializer if i.name.startswith("wq")]
    top = max(int(np.abs(w.astype(np.int32)).max()) for w in weights)
    assert (top <= 64) if seven_bit else (top > 64)
    assert ops == 2.0 * 16 * 16 * 9 * 8 * 8 * CHAIN
    model, _, _ = _matmul_int8(np.random.default_rng(0), 8, 32, seven_bit)
    assert _session(model)[1].count("MatMulIntegerToFloat") == CHAIN


def test_node_overhead_is_positive_and_small() -> None:
    assert 0.0 < node_overhead_us(runs=60) < 100.0
