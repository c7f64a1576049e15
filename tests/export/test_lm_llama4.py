"""Llama 4 text in the fused decoder graph (``export/lm_llama4.py``): rotary on interleaved pairs before
the L2 norm of q and k, NoPE layers with temperature tuning, chunked attention, the sigmoid-scaled
mixture of experts with its shared expert beside a dense layer, attention biases; matching
transformers through prefills and decode steps that cross chunk boundaries and start far into the
context, and the 4-bit model as compress stored it. A declared context too long for rotary tables
gets its rows computed per forward (any fixed rotary, Llama's too)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from edgekit.compress import StepContext, compress, load_compressed, make_config
from edgekit.errors import BadInputError
from edgekit.export import lm_graph
from edgekit.export.lm import _hf_model, export_causal_lm, lm_session, onnx_logits, torch_logits
from edgekit.loading import load_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from lm_decode import decode_logits, reference_logits, rel_error, token_ids  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

FLOAT_REL = 1e-4  # fp32 graph against fp32 PyTorch (measured 1e-6)
# layer 0: rotary + L2 q/k norm, chunks of 8 cache places, mixture of experts (4 experts, top-1, a shared
# expert); layer 1: NoPE with the query temperature (floor_scale 4: it changes every 4 positions), full
# attention, a dense MLP; biases on q/k/v/o
EVERYTHING = {"no_rope_layers": [1, 0], "layer_types": ["chunked_attention", "full_attention"],
              "attention_chunk_size": 8, "floor_scale": 4, "attn_scale": 0.5, "moe_layers": [0],
              "attention_bias": True}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


def _ops(path: Path) -> list:
    return list(onnx.load(str(path)).graph.node)


def test_float_llama4_matches_transformers_across_chunks_and_far_into_the_context(tmp_path):
    h = load_model(str(save_tiny("llama4", tmp_path, **EVERYTHING)))
    out = export_causal_lm(h, tmp_path / "onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["graph"] == "fused" and manifest["metrics"]["parity"]["passed"]
    nodes = _ops(out / "model.onnx")
    rotary = [n for n in nodes if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 2 and all(helper.get_attribute_value(a) == 1 for n in rotary for a in n.attribute
                                    if a.name == "interleaved")  # q and k of the one rope layer
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    assert [len([i for i in n.input if i]) for n in gqa] == [8, 7]  # the chunk bias on layer 0 only
    assert all(helper.get_attribute_value(a) == 0 for n in gqa for a in n.attribute if a.name == "do_rotary")
    assert not [n for n in nodes if n.op_type in ("MoE", "QMoE")]  # input-scaled experts: standard ops
    sess, hf = lm_session(out / "model.onnx"), _hf_model(h.module)
    ids = np.random.default_rng(0).integers(0, 256, (2, 28)).astype(np.int64)
    # a prefill of 5 tokens then decode steps through 4 chunks; a prefill of 20 placed at position 30
    for prompt, start in ((5, 0), (20, 30)):
        want = torch_logits(hf, ids, prompt, start)
        assert rel_error(onnx_logits(sess, ids, prompt, True, start), want) < FLOAT_REL


def test_4bit_llama4_exports_its_packed_linears_and_float_experts(tmp_path):
    """RTN W4 g32: attention, shared expert and dense MLP in MatMulNBits; the 3-d experts and the
    router float; exact against the compressed model with fp32 compute."""
    cfg = make_config("weight-only", {"method": "rtn", "bits": 4, "group_size": 32, "eval_windows": 0})
    ctx = StepContext(calib="lee-news", eval="wikipedia", train="lee-news", progress=False)
    w4 = load_compressed(compress(load_model(str(save_tiny("llama4", tmp_path, **EVERYTHING))), [("weight-only", cfg)],
                                  tmp_path / "w4", ctx))
    out = export_causal_lm(w4, tmp_path / "onnx", accuracy_level=0)
    inits = {t.name: t for t in onnx.load(str(out / "model.onnx")).graph.initializer}
    assert list(inits["layers.0.moe.experts.gate_up_proj"].dims) == [4, 64, 2 * _hf_model(w4.module).config.intermediate_size]
    assert inits["layers.0.moe.router.weight"].data_type == onnx.TensorProto.FLOAT
    assert "layers.0.moe.shared_expert.gate_up_proj.qweight" in inits and "layers.1.mlp.down_proj.qweight" in inits
    ids = token_ids(24)
    assert rel_error(decode_logits(out / "model.onnx", ids, 12), reference_logits(w4, ids)) < FLOAT_REL


@pytest.mark.parametrize("family", ["llama", "llama4"])
def test_a_context_too_long_for_tables_gets_its_rotary_rows_per_forward(family, tmp_path, monkeypatch):
    monkeypatch.setattr(lm_graph, "MAX_FIXED_ROTARY_POSITIONS", 64)  # the tiny configs declare 128-256
    h = load_model(str(save_tiny(family, tmp_path)))
    out = export_causal_lm(h, tmp_path / "onnx")
    assert json.loads((out / "manifest.json").read_text())["metrics"]["parity"]["passed"]
    model = onnx.load(str(out / "model.onnx"))
    assert not [t for t in model.graph.initializer if t.name.startswith("rotary.positions")]
    assert {"rotary/range", "rotary/cos_pad"} <= {n.name for n in model.graph.node}
    ids = token_ids(20)
    assert rel_error(decode_logits(out / "model.onnx", ids, 8), reference_logits(h, ids)) < FLOAT_REL


def test_llama4_with_another_activation_is_refused_with_the_reason(tmp_path):
    with pytest.raises(BadInputError, match=r"cannot export model type 'llama4_text' with the KV cache: "
                                            r"activation 'gelu' is not SiLU") as e:
        export_causal_lm(load_model(str(save_tiny("llama4", tmp_path, hidden_act="gelu"))), tmp_path / "onnx")
    assert "\n" not in str(e.value) and not (tmp_path / "onnx").exists()
