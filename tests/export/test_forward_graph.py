"""The fused decoder graph as one forward without a cache (``export_forward_graph``): what the INT8 step
calibrates for a causal LM the fused graph writes, in place of a dynamo trace. The same logits as
transformers for a dense, a mixture-of-experts and a Llama 4 decoder; inputs and outputs those of the
traced graph; None for a family without a fused graph."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from edgekit.export.lm import export_forward_graph
from edgekit.kv_cache import KV_CACHE_METADATA
from edgekit.loading import load_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from lm_decode import rel_error  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


@pytest.mark.parametrize("family", ["llama", "mixtral", "llama4"])
def test_forward_graph_computes_the_models_logits(family, tmp_path):
    h = load_model(str(save_tiny(family, tmp_path / "m")))
    out = export_forward_graph(h, tmp_path / "fwd")
    model = onnx.load(str(out / "model.onnx"))
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in model.graph.output] == ["logits"]
    assert KV_CACHE_METADATA not in {p.key for p in model.metadata_props}
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 256, (2, 20)).astype(np.int64)  # a batch of 2: the empty pasts follow it
    got = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    with torch.no_grad():
        want = h.module(torch.from_numpy(ids), torch.ones_like(torch.from_numpy(ids))).float().numpy()
    assert rel_error(got, want) < 1e-5  # measured 3.5e-7 to 6.1e-7


def test_a_family_without_a_fused_graph_gets_none(tmp_path):
    h = load_model(str(save_tiny("gpt2", tmp_path / "m")))
    assert export_forward_graph(h, tmp_path / "fwd") is None
    assert not (tmp_path / "fwd").exists()


def test_int8_of_a_fused_family_quantizes_that_graph_and_keeps_its_down_projections_float(tmp_path):
    """``compress --bits 8`` of a tiny Llama: the fused graph without its cache is what gets calibrated
    (no dynamo trace), its ``ffn-down`` layers found by shape among the fused matmuls, within the gate."""
    import json

    from edgekit.compress import StepContext, compress, make_config

    h = load_model(str(save_tiny("llama", tmp_path / "m")))
    out = compress(h, [("int8", make_config("int8", {"calib_samples": 16}))], tmp_path / "int8",
                   StepContext(calib="lee-news", eval="wikipedia", progress=False))
    manifest = json.loads((out / "manifest.json").read_text())
    meta = manifest["steps"][-1]["meta"]
    assert meta["from"].startswith("the fused decoder graph")
    assert meta["float_layers"] == ["layers.0.mlp.down_proj", "layers.1.mlp.down_proj"]
    quality = manifest["metrics"]["quality"]
    assert quality["passed"] and 0.9 < quality["perplexity_ratio"] < 1.1  # measured 0.995


def test_a_decoder_without_transformers_generate_gets_none():
    """MEGA and Open-Llama's wrappers have no ``generate``: no fused graph to write, the INT8 step traces them."""
    from types import SimpleNamespace

    assert export_forward_graph(SimpleNamespace(module=torch.nn.Linear(4, 4)), "unused") is None
