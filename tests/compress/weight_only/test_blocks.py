"""The block walk on mixture-of-experts decoders (issues 31 and 33): routers stay in float, each
expert's GPTQ/GPTAQ statistics come from the tokens the router sends it, and experts that see no
calibration token are rounded to nearest and reported."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from edgekit.compress.weight_only.blocks import expert_routers, quantizable_linears, row_positions
from edgekit.compress.weight_only.config import WeightOnlyConfig
from edgekit.compress.weight_only.rtn import rtn_quantize
from edgekit.compress.weight_only.step import quantize_module

TESTS = Path(__file__).resolve().parents[2]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tiny_models import build  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_row_positions_finds_gathered_rows_exactly():
    table = torch.randn(10, 4)
    idx = torch.tensor([7, 2, 2, 9])
    assert row_positions(table[idx], table).tolist() == [7, 2, 2, 9]
    assert row_positions(table[idx] + 1e-6, table) is None  # a changed row is not found
    assert row_positions(table[:0], table).numel() == 0


@pytest.mark.parametrize("family,routers", [
    ("mixtral", ["model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"]),
    ("qwen2-moe", ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]),
    ("llama4", ["model.layers.0.feed_forward.router", "model.layers.1.feed_forward.router"]),
    ("llama", []),
])
def test_routers_are_found_and_left_out_of_the_quantized_linears(family, routers):
    model = build(family)
    assert expert_routers(model) == routers
    _, _, linears = quantizable_linears(model)
    assert not set(routers) & set(linears)
    assert linears  # the attention and expert projections remain


@pytest.mark.parametrize("family", ["mixtral", "qwen2-moe"])
def test_gptq_with_gptaq_pairs_each_expert_with_its_own_tokens(family):
    """GPTQ with its defaults (GPTAQ alpha 0.25) on a top-2 mixture of experts, where the float and
    the partly quantized model route different tokens to each expert (the 14 vs 13 crash)."""
    model = build(family)
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    want = _logits(model, ids)
    config = WeightOnlyConfig(method="gptq-plus", bits=4, group_size=32, calib_samples=4, seqlen=24)
    assert config.method_config().gptaq_alpha > 0
    results, info = quantize_module(model, config, [ids])
    _, _, linears = quantizable_linears(model)
    assert set(results) == set(linears)
    experts = info["experts"]
    assert "without_calibration_tokens" not in experts  # 96 tokens, 4 experts, top-2: all see some
    # every routed row counted once per layer group; most were also routed to that expert in float
    assert experts["routed_rows"] >= 2 * 96 * 2 * 2  # 2 layers x 96 tokens x top-2 x (entry, down) groups
    assert 0.5 * experts["routed_rows"] < experts["routed_rows_paired"] <= experts["routed_rows"]
    got = _logits(model, ids)
    assert float((got - want).norm() / want.norm()) < 0.3


def test_experts_without_calibration_tokens_are_rounded_to_nearest_and_reported():
    """8 experts, top-1, 2 calibration tokens: at least 6 experts per layer see nothing. GPTQ would
    zero their weights (no Hessian: every input looks dead); they get RTN instead, and are named."""
    model = build("mixtral", num_local_experts=8, num_experts_per_tok=1)
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[65, 66]])
    config = WeightOnlyConfig(method="gptq-plus", bits=4, group_size=32, calib_samples=1, seqlen=2)
    results, info = quantize_module(model, config, [ids])
    unseen = info["experts"]["without_calibration_tokens"]
    assert len(unseen) >= 2 * 6 * 3  # 2 layers x >= 6 experts x (w1, w2, w3)
    for name in unseen:
        q, s, z = rtn_quantize(originals[name + ".weight"], 4, 32, False)
        assert torch.equal(results[name][0], q) and torch.equal(results[name][1], s)
        assert model.get_submodule(name).weight.abs().sum() > 0


def test_a_one_layer_model_walks_its_one_block():
    """A config with one layer: its one-element layer list is the block list (before, the whole
    model was walked as one block and the value Hessian's attention re-run got token ids)."""
    model = build("llama", num_hidden_layers=1)
    prefix, blocks, linears = quantizable_linears(model)
    assert prefix == "model.layers" and len(blocks) == 1 and len(linears) == 7
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    want = _logits(model, ids)
    results, _ = quantize_module(model, WeightOnlyConfig(method="gptq-plus", bits=4, group_size=32, seqlen=24), [ids])
    assert set(results) == set(linears)
    got = _logits(model, ids)
    assert float((got - want).norm() / want.norm()) < 0.3
