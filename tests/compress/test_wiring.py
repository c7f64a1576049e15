"""AWQ's fold pairs measured on the model (``compress/wiring.py``): the probe finds exactly the pairs of
the hand table that fold in each described family, and proves pairs for families with no table row."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from edgekit.compress.families import Family, family_of, linearize
from edgekit.compress.weight_only.blocks import find_blocks
from edgekit.compress.wiring import probe_family
from edgekit.errors import BadInputError

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tiny_models import DECODERS, build  # noqa: E402


def _probe(model: nn.Module) -> Family:
    prefix, blocks = find_blocks(model)
    return probe_family(model, blocks, prefix)


def _foldable(family: Family, block: nn.Module) -> set[tuple[str, tuple[str, ...]]]:
    """The table's pairs that fold in this model: a linear producer must be as wide as its consumers'
    input (``v_proj -> o_proj`` does not fold with grouped key/value heads)."""
    out = set()
    for p in family.scale_pairs:
        prod = block.get_submodule(p.producer)
        first = block.get_submodule(p.consumers[0])
        if prod.weight.dim() == 2 and prod.weight.shape[0] != first.weight.shape[1]:
            continue
        out.add((p.producer, p.consumers))
    return out


@pytest.mark.parametrize("family", list(DECODERS))
def test_probe_finds_the_hand_table_pairs(family, one_thread):
    model = build(family).eval()
    linearize(model)  # GPT-2's Conv1D layers as the linears the walk meets
    table = family_of(model)
    probed = _probe(model)
    block = find_blocks(model)[1][0]
    assert {(p.producer, p.consumers) for p in probed.scale_pairs} == _foldable(table, block)
    assert probed.norm_offset == table.norm_offset  # Gemma's x * (1 + w) found as such
    assert probed.name.endswith("(probed)")


def test_probe_proves_pairs_where_no_table_row_exists(one_thread):
    """OLMo-2 normalizes after attention and MLP (post-norm): no norm feeds a projection; up_proj feeds
    down_proj through act(gate) * up. Mixtral: each expert's w3 feeds its w2."""
    olmo = _probe(_olmo2())
    assert {(p.producer, p.consumers) for p in olmo.scale_pairs} == {("mlp.up_proj", ("mlp.down_proj",))}
    mixtral = build("mixtral").eval()
    experts = len(find_blocks(mixtral)[1][0].block_sparse_moe.experts)
    pairs = {(p.producer, p.consumers) for p in _probe(mixtral).scale_pairs}
    assert ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")) in pairs
    routed = {p for p in pairs if p[0].startswith("block_sparse_moe.experts.")}
    assert routed == {(f"block_sparse_moe.experts.{e}.w3", (f"block_sparse_moe.experts.{e}.w2",)) for e in range(experts)}
    # the router reads the MLP norm's output too: that norm does not fold into the experts alone
    assert not any(p[0] == "post_attention_layernorm" for p in pairs)


def _olmo2() -> nn.Module:
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    return Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def test_a_model_nothing_folds_into_is_refused_in_one_line(one_thread):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64)).eval()
    with pytest.raises(BadInputError, match="AWQ found no norm or linear in model type 'bert' whose output scales "
                                            "fold exactly") as e:
        _probe(bert)
    assert "\n" not in str(e.value)


def test_a_forward_that_fails_is_refused_with_its_reason(one_thread):
    model = build("llama").eval()

    def broken(*args, **kwargs):
        raise RuntimeError("needs pixel_values")

    model.forward = broken  # type: ignore[method-assign]
    with pytest.raises(BadInputError, match=r"AWQ cannot probe how model type 'llama' .* RuntimeError: needs "
                                            r"pixel_values\); use --method gptq-plus, gptq or rtn"):
        _probe(model)


def test_the_probe_leaves_the_weights_as_they_were(one_thread):
    model = build("gemma3").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _probe(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
