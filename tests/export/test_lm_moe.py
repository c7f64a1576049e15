"""Mixture-of-experts layers in the fused decoder graph (``export/lm_moe.py``): Mixtral and
Qwen2-MoE (with and without ``norm_topk_prob``, a dense layer among the sparse ones), float experts
in ``MoE`` and packed 4-bit experts in ``QMoE``, routers in float, matching transformers and the
compressed model through a prefill and decode steps on the KV cache; experts GPTQ never calibrated
exported like the others; 8-bit experts computed by MatMulNBits with the routing in standard ops;
mixed-width experts refused with the reason."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx
import pytest
import torch
from onnx import helper

from edgekit.compress import StepContext, compress, load_compressed, make_config
from edgekit.errors import BadInputError
from edgekit.export.lm import export_causal_lm
from edgekit.export.lm_graph import supports_fused_graph
from edgekit.export.lm_moe import moe_support
from edgekit.loading import load_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from lm_decode import decode_logits, reference_logits, rel_error, token_ids  # noqa: E402
from tiny_models import save_tiny  # noqa: E402

PROMPT, STEPS = 12, 4
FLOAT_REL = 1e-4  # fp32 graph against fp32 PyTorch
PACKED_REL = 1e-4  # the packed model's dequantized weights, fp32 compute (accuracy_level 0)
# (family, config overrides): Qwen2-MoE's default mixes the top-k softmax weights as they are; with
# norm_topk_prob they sum to one (Mixtral's way); mlp_only_layers makes layer 1 a dense MLP
CASES = [("mixtral", {}), ("qwen2-moe", {}), ("qwen2-moe", {"norm_topk_prob": True, "mlp_only_layers": [1]})]
IDS = ["mixtral", "qwen2-moe", "qwen2-moe-normalized-dense-layer"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


def _ctx() -> StepContext:
    return StepContext(calib="lee-news", eval="wikipedia", train="lee-news", progress=False)


def _moe_nodes(path: Path) -> list:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type in ("MoE", "QMoE")]


@pytest.mark.parametrize("family,config", CASES, ids=IDS)
def test_float_moe_exports_the_fused_graph_and_matches_transformers(family, config, tmp_path):
    h = load_model(str(save_tiny(family, tmp_path, **config)))
    out = export_causal_lm(h, tmp_path / "onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["graph"] == "fused" and manifest["metrics"]["parity"]["passed"]
    nodes = _moe_nodes(out / "model.onnx")
    assert [n.op_type for n in nodes] == ["MoE"] * (1 if config.get("mlp_only_layers") else 2)
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    normalized = family == "mixtral" or config.get("norm_topk_prob", False)
    assert attrs["k"] == 2 and attrs["normalize_routing_weights"] == int(normalized)
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(h, ids)) < FLOAT_REL


# in CI one family each for 4 and 8 bits (the other family with -m matrix): two minutes of CPU saved
@pytest.mark.parametrize("family,config", [CASES[0], pytest.param(*CASES[1], marks=(pytest.mark.slow, pytest.mark.matrix))],
                         ids=IDS[:2])
def test_4bit_experts_run_in_qmoe_and_match_the_compressed_model(family, config, tmp_path):
    """RTN W4 g32: each layer's experts in one QMoE (their codes as stored, block 32), the router
    a float MatMul; exact with fp32 compute, and the default int8 compute within its bound."""
    cfg = make_config("weight-only", {"method": "rtn", "bits": 4, "group_size": 32, "eval_windows": 0})
    w4 = load_compressed(compress(load_model(str(save_tiny(family, tmp_path, **config))), [("weight-only", cfg)],
                                  tmp_path / "w4", _ctx()))
    exact = export_causal_lm(w4, tmp_path / "fp32", accuracy_level=0)
    nodes = _moe_nodes(exact / "model.onnx")
    assert [n.op_type for n in nodes] == ["QMoE", "QMoE"]
    attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["expert_weight_bits"] == 4 and attrs["block_size"] == 32 and "accuracy_level" not in attrs
    inits = {t.name: t for t in onnx.load(str(exact / "model.onnx")).graph.initializer}
    router = inits["layers.0.moe.gate.weight"]
    assert router.data_type == onnx.TensorProto.FLOAT and list(router.dims) == [64, 4]  # (hidden, experts)
    assert list(inits["layers.0.moe.fc1.qweight"].dims) == [4, 2 * w4.module.model.config.intermediate_size
                                                             if family == "mixtral" else 2 * 64, 32]
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(exact / "model.onnx", ids, PROMPT), reference_logits(w4, ids)) < PACKED_REL
    shipped = export_causal_lm(w4, tmp_path / "int8-compute")  # accuracy_level 4: int8 activations
    metrics = json.loads((shipped / "manifest.json").read_text())["metrics"]
    assert metrics["parity"]["passed"] and metrics["parity_int8_compute"]["passed"]
    assert metrics["parity_float"]["passed"]


def test_experts_no_calibration_token_reached_export_like_the_others(tmp_path):
    """16 experts top-2 and one calibration window of 8 tokens: GPTQ reaches at most 16 of 32
    expert slots per layer, rounds the rest to nearest and names them; the graph packs them all."""
    folder = save_tiny("mixtral", tmp_path, num_local_experts=16)
    cfg = make_config("weight-only", {"method": "gptq-plus", "bits": 4, "group_size": 32, "seqlen": 8, "calib_samples": 1,
                               "eval_windows": 0})
    out = compress(load_model(str(folder)), [("weight-only", cfg)], tmp_path / "w4", _ctx())
    unseen = json.loads((out / "manifest.json").read_text())["metrics"]["weight-only"]["experts"]["without_calibration_tokens"]
    assert len(unseen) >= 2 * 8 * 3  # >= 8 experts x 3 linears, in each of the 2 layers
    w4 = load_compressed(out)
    onnx_dir = export_causal_lm(w4, tmp_path / "onnx", accuracy_level=0)
    fc1 = {t.name: t for t in onnx.load(str(onnx_dir / "model.onnx")).graph.initializer}["layers.0.moe.fc1.qweight"]
    assert fc1.dims[0] == 16
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(onnx_dir / "model.onnx", ids, PROMPT), reference_logits(w4, ids)) < PACKED_REL


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=(pytest.mark.slow, pytest.mark.matrix)), "qwen2-moe"])
def test_8bit_experts_are_computed_by_matmulnbits_and_match_the_compressed_model(family, tmp_path):
    """RTN W8: every expert computed and weighted by its scattered routing weight (QMoE's 8-bit CPU
    kernel has no fp32 compute to check it against): exact with fp32 compute."""
    cfg = make_config("weight-only", {"method": "rtn", "bits": 8, "group_size": 32, "eval_windows": 0})
    w8 = load_compressed(compress(load_model(str(save_tiny(family, tmp_path))), [("weight-only", cfg)], tmp_path / "w8",
                                  _ctx()))
    out = export_causal_lm(w8, tmp_path / "onnx", accuracy_level=0)
    graph = onnx.load(str(out / "model.onnx")).graph
    assert not _moe_nodes(out / "model.onnx")
    down = [n for n in graph.node if n.name == "layers.0.moe.experts.down_proj"]
    attrs = {a.name: helper.get_attribute_value(a) for a in down[0].attribute}
    inter = 128 if family == "mixtral" else 64
    assert down[0].op_type == "MatMulNBits" and attrs["bits"] == 8 and attrs["K"] == 4 * inter  # 4 experts stacked
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(w8, ids)) < PACKED_REL
    shipped = export_causal_lm(w8, tmp_path / "int8-compute")  # accuracy_level 4: int8 activations
    metrics = json.loads((shipped / "manifest.json").read_text())["metrics"]
    assert metrics["parity_int8_compute"]["passed"] and metrics["parity_float"]["passed"]


def test_mixed_width_experts_are_refused_with_the_reason(tmp_path):
    cfg = make_config("weight-only", {"method": "rtn", "bits": 8, "group_size": 32, "eval_windows": 0})
    w8 = load_compressed(compress(load_model(str(save_tiny("mixtral", tmp_path))), [("weight-only", cfg)], tmp_path / "w8",
                                  _ctx()))
    # one expert's down projection left in float among packed experts: one MoE node takes one width
    expert = w8.module.model.model.layers[0].block_sparse_moe.experts[2]
    dense = torch.nn.Linear(expert.w2.in_features, expert.w2.out_features, bias=False)
    dense.weight.data = expert.w2.dequantize()
    expert.w2 = dense
    ok, why = supports_fused_graph(w8.module.model)
    assert not ok and why == "the experts of layer 0 mix bit widths [8, None] (one MoE node takes one width)"
    assert moe_support(w8.module.model) == (ok, why)
    with pytest.raises(BadInputError, match=r"--graph fused is not available for .*: the experts of layer 0 mix") as e:
        export_causal_lm(w8, tmp_path / "onnx", graph="fused")
    assert "\n" not in str(e.value) and not (tmp_path / "onnx").exists()
