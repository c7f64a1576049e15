"""Falcon in the fused decoder graph (``export/lm_falcon.py``): every head layout Falcon has (grouped
KV of the new decoder architecture with one or two norms, multi-query, classic multi-head, and the
sequential layer with biases) written by default and matching transformers on a prefill and decode
steps through the KV cache; 4-bit weights packed as MatMulNBits with the tied table stored once;
ALiBi refused in one line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from edgekit.compress import StepContext, compress, load_compressed, make_config
from edgekit.errors import BadInputError, CheckFailedError
from edgekit.export import lm_falcon
from edgekit.export.lm import export_causal_lm
from edgekit.export.lm_graph import supports_fused_graph
from edgekit.loading import load_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from lm_decode import decode_logits, reference_logits, rel_error, token_ids  # noqa: E402
from tiny_models import ROPE_SCALING, build, save_tiny  # noqa: E402

PROMPT, STEPS = 20, 6
FLOAT_REL = 1e-4  # fp32 graph against fp32 PyTorch (measured 5e-7)
PACKED_REL = 1e-3  # the packed model's dequantized weights, fp32 compute
# config overrides of the tiny Falcon (new decoder architecture, 4 query heads over 2 KV heads, two norms)
LAYOUTS = {
    "grouped-kv": {},
    "grouped-kv-one-norm": {"num_ln_in_parallel_attn": 1},
    "multi-query": {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None},
    "multi-head": {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 4},
    "sequential-with-bias": {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None,
                             "parallel_attn": False, "bias": True},
}
KV_HEADS = {"grouped-kv": 2, "grouped-kv-one-norm": 2, "multi-query": 1, "multi-head": 4, "sequential-with-bias": 1}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qkv_rows_read_the_heads_transformers_splits(layout):
    """The rows taken for q, k and v are the features ``FalconAttention._split_heads`` gives each head
    (fed the row indices themselves as the fused projection's output)."""
    model = build("falcon", **LAYOUTS[layout])
    cfg, attn = model.config, model.transformer.h[0].self_attention
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    width = attn.query_key_value.out_features
    q, k, v = attn._split_heads(torch.arange(width, dtype=torch.float32).reshape(1, 1, width))
    q_rows, k_rows, v_rows = lm_falcon.qkv_rows(cfg)
    kv = KV_HEADS[layout]
    assert lm_falcon.falcon_kv_heads(cfg) == kv
    assert sorted(torch.cat([q_rows, k_rows, v_rows]).tolist()) == list(range(width))  # every row once
    assert torch.equal(q.reshape(heads, head_dim), q_rows.float().reshape(heads, head_dim))
    # transformers repeats each KV head over its query group (or computes one per head); the graph keeps one
    group = heads // kv
    for got, rows in ((k, k_rows), (v, v_rows)):
        per_query = got.reshape(-1, head_dim)
        if per_query.shape[0] == heads:
            per_query = per_query[::group]
        assert torch.equal(per_query, rows.float().reshape(kv, head_dim))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_falcon_exports_the_fused_graph_and_matches_transformers(layout, tmp_path):
    h = load_model(str(save_tiny("falcon", tmp_path, vary_norms=True, **LAYOUTS[layout])))
    out = export_causal_lm(h, tmp_path / "onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    parity = manifest["metrics"]["parity"]
    assert manifest["config"]["graph"] == "fused" and parity["passed"]
    assert parity["max_rel_diff"] < FLOAT_REL and parity["argmax_agreement"] == 1.0
    assert parity["io_binding"]["kv_cache"] == "in place (shared buffer)"
    graph = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2 and ops.count("Gelu") == 2
    # the first norm has no residual to add; every later one adds it (one or two norms per layer, the final)
    two_norms = layout == "grouped-kv"
    sequential = layout == "sequential-with-bias"
    assert ops.count("LayerNormalization") == 1 + (2 if two_norms else 0)
    assert ops.count("SkipLayerNormalization") == (4 if sequential else 2)
    assert ops.count("Add") == (2 * 4 if sequential else 2)  # the biases of 4 float matmuls a layer; parallel sums
    past = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert past["past_key_values.0.key"][1] == KV_HEADS[layout]  # the grouped cache, not one per query head
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(h, ids)) < FLOAT_REL


def test_falcon_with_dynamic_rope_scaling_matches_past_its_threshold(tmp_path):
    """Falcon's rotary module is transformers' (``dynamic_rope_update``): the graph picks dynamic NTK's
    rotation from the positions, checked across the threshold and to the end of the declared context."""
    h = load_model(str(save_tiny("falcon", tmp_path, vary_norms=True, **ROPE_SCALING["dynamic"])))
    parity = json.loads((export_causal_lm(h, tmp_path / "onnx") / "manifest.json").read_text())["metrics"]["parity"]
    long = parity["long_context"]
    assert parity["passed"] and long["rope_type"] == "dynamic" and long["thresholds"] == [64]
    assert max(long["starts"]) + long["tokens_each"] == 256 and long["max_rel_diff"] < FLOAT_REL


def test_4bit_falcon_fused_graph_matches_the_packed_and_the_float_model(tmp_path):
    h = load_model(str(save_tiny("falcon", tmp_path, vary_norms=True)))
    cfg = make_config("weight-only", {"method": "rtn", "bits": 4, "group_size": 32, "eval_windows": 0})
    w4 = load_compressed(compress(h, [("weight-only", cfg)], tmp_path / "w4", StepContext(calib="lee-news", eval="wikipedia",
                                                                                   progress=False)))
    out = export_causal_lm(w4, tmp_path / "onnx", accuracy_level=None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["graph"] == "fused" and manifest["metrics"]["parity"]["passed"]
    assert manifest["metrics"]["parity_float"]["passed"]
    graph = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 2 * 4 + 1  # qkv, dense, h_to_4h, 4h_to_h per layer; the head
    assert "GatherBlockQuantized" in ops
    qkv = next(n for n in graph.node if n.name == "layers.0.attn.qkv_proj")
    assert {a.name: a.i for a in qkv.attribute}["N"] == (4 + 2 * 2) * 16  # 4 query heads, 2 keys, 2 values
    tables = [i.name for i in graph.initializer if i.dims and i.dims[0] == 260 and int(np.prod(i.dims)) * 2 >= 260 * 64]
    assert tables == ["lm_head.qweight"]  # the tied table once
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(w4, ids)) < PACKED_REL


def test_falcon_rows_in_the_wrong_layout_fail_parity_and_write_nothing(tmp_path, monkeypatch):
    """The parity check sees a head layout read wrongly (grouped KV read as multi-head q, k, v)."""
    h = load_model(str(save_tiny("falcon", tmp_path, vary_norms=True)))
    rows = lm_falcon.qkv_rows(build("falcon").config)
    swapped = (rows[0], rows[2], rows[1])  # keys and values exchanged
    monkeypatch.setattr(lm_falcon, "qkv_rows", lambda cfg: swapped)
    with pytest.raises(CheckFailedError, match="does not compute what the PyTorch model computes"):
        export_causal_lm(h, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_alibi_falcon_is_refused_in_one_line(tmp_path):
    model = build("falcon", alibi=True, new_decoder_architecture=False, multi_query=True, num_kv_heads=None)
    ok, why = supports_fused_graph(model)
    assert not ok and why.startswith("ALiBi position bias is not written")
    h = load_model(str(save_tiny("falcon", tmp_path, alibi=True, new_decoder_architecture=False, multi_query=True,
                                 num_kv_heads=None)))
    with pytest.raises(BadInputError, match="--graph fused is not available for .*: ALiBi position bias") as e:
        export_causal_lm(h, tmp_path / "onnx", graph="fused")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "onnx").exists()


def test_grouped_kv_falcon_through_the_traced_graph_is_refused_with_the_way_that_works(tmp_path):
    """optimum's Falcon configuration caches one KV head per query head: asked for the traced graph,
    the export says so and names the graph that writes the model."""
    h = load_model(str(save_tiny("falcon", tmp_path, vary_norms=True)))
    with pytest.raises(BadInputError, match=r"cannot export model type 'falcon' with the KV cache: the traced graph "
                                            r"was asked for \(the fused graph writes it: --graph auto or fused\), "
                                            r"and .*assumes as many KV heads as query heads") as e:
        export_causal_lm(h, tmp_path / "onnx", graph="traced")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "onnx").exists()
