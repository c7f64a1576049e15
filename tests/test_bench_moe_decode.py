"""``benchmarks/bench_moe_decode.py``'s one-layer comparison: the routing written in standard ops
with every expert computed must compute what ONNX Runtime's routed MoE / QMoE node computes (the
benchmark times the two as the same layer), float and 4-bit."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "tests", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_moe_decode import HIDDEN, _layer_graphs  # noqa: E402


@pytest.mark.parametrize("bits", [None, 4])
def test_every_expert_routing_computes_the_routed_node(bits):
    graphs = _layer_graphs(bits, np.random.default_rng(0))
    assert set(graphs) == {"routed", "every expert"}
    x = np.random.default_rng(1).standard_normal((1, 1, HIDDEN)).astype(np.float32)
    outs = {n: ort.InferenceSession(g, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
            for n, g in graphs.items()}
    ref = outs["routed"]
    assert ref.shape == (1, 1, HIDDEN) and np.abs(ref).max() > 0
    assert np.abs(outs["every expert"] - ref).max() < 1e-5 * np.abs(ref).max()
