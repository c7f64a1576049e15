"""runtimes/base.py: every engine checks its feeds in one place (``CheckedEngine``)."""
from __future__ import annotations

import numpy as np
import pytest

from edgekit.errors import BadInputError
from edgekit.runtimes.base import CheckedEngine, NodeTiming
from edgekit.sources.handle import InputSpec


class RecordingEngine(CheckedEngine):
    """The smallest engine: records what reaches the runtime's own code."""

    runtime = "recording"

    def __init__(self) -> None:
        self.inputs = [InputSpec("x", ("batch", 4), "float32")]
        self.outputs = ["y"]
        self.seen: list[str] = []

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.seen.append("run")
        return [feeds["x"] * 2]

    def profile_nodes(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        self.seen.append(f"profile {iterations}")
        return [NodeTiming(name="mul", op_type="Mul", time_ms=0.5)]

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        return 0.5


@pytest.mark.parametrize("feeds, message", [
    ({"x": np.ones((2, 4), np.float64)}, r"^input 'x' has dtype float64; the model expects float32$"),
    ({"x": np.ones((2, 5), np.float32)}, r"^input 'x' has shape \(2, 5\); the model expects \('batch', 4\)$"),
    ({"z": np.ones((2, 4), np.float32)}, r"^input names \['z'\] do not match the model's \['x'\] \(missing \['x'\]\) "
                                         r"\(unexpected \['z'\]\)$"),
])
def test_bad_feeds_never_reach_the_runtime(feeds, message):
    engine = RecordingEngine()
    with pytest.raises(BadInputError, match=message):
        engine.run(feeds)
    with pytest.raises(BadInputError, match=message):
        engine.node_profile(feeds, iterations=3)
    assert engine.seen == []


def test_good_feeds_are_checked_then_run():
    engine = RecordingEngine()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    (y,) = engine.run({"x": x})
    assert y.shape == (2, 4) and float(y[1, 3]) == 14.0
    assert [t.name for t in engine.node_profile({"x": x})] == ["mul"]
    assert engine.seen == ["run", "profile 20"]  # node_profile's default: 20 iterations


def test_runtime_engines_share_the_check():
    from edgekit.runtimes.onnxruntime import OrtEngine
    from edgekit.runtimes.openvino import OpenVinoEngine
    from edgekit.runtimes.torch_aot import TorchAotEngine

    for engine in (OrtEngine, OpenVinoEngine, TorchAotEngine):
        assert issubclass(engine, CheckedEngine)
        assert engine.run is CheckedEngine.run and engine.node_profile is CheckedEngine.node_profile, engine
