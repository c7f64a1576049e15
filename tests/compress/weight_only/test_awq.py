"""AWQ search pieces on tiny layers (issue 4)."""
from __future__ import annotations

import torch
from torch import nn

from edgekit.compress.weight_only.awq import fold_scales, search_clip, search_scale
from edgekit.compress.weight_only.rtn import dequantize_groups, rtn_quantize


def _inputs_with_salient_channels(n=1024, cols=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, cols, generator=g)
    X[:, :4] *= 20.0  # a few salient channels, as in LLM activations
    return X


def test_scale_search_reduces_output_error_and_picks_nonzero_alpha():
    torch.manual_seed(0)
    W = torch.randn(32, 64) * 0.05
    X = _inputs_with_salient_channels()
    s, alpha, err = search_scale(W, X, X.abs().mean(0), bits=3, group_size=32, sym=False, grid=10)
    ref = X @ W.t()
    rtn = dequantize_groups(*rtn_quantize(W, 3, 32, False), 32)
    err_rtn = float(((X @ rtn.t() - ref) ** 2).mean() / (ref ** 2).mean())
    assert alpha > 0 and err < err_rtn
    assert s.shape == (64,) and torch.all(s > 0)


def test_clip_search_never_worse_than_no_clip():
    torch.manual_seed(1)
    W = torch.randn(16, 64)
    W[0, 3] = 12.0  # an outlier weight that clipping should tame
    X = torch.randn(512, 64)
    clip = search_clip(W, X, bits=4, group_size=32, sym=False, grid=20)
    assert clip.shape == (16, 2) and float(clip.min()) >= 0.5 and float(clip.max()) <= 1.0
    def out_err(c):
        Wq = dequantize_groups(*rtn_quantize(W, 4, 32, False, c), 32)
        return float(((X @ (Wq - W).t()) ** 2).mean())
    assert out_err(clip) <= out_err(None) + 1e-9
    assert float(clip[0, 0]) < 1.0


def test_fold_into_norm_and_linear_preserves_the_function():
    torch.manual_seed(2)
    norm_w = nn.Parameter(torch.rand(8) + 0.5)
    lin = nn.Linear(8, 4, bias=False)
    x = torch.randn(5, 8)
    ref = lin(x * norm_w)
    s = torch.rand(8) + 0.5

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = norm_w

    fold_scales(Norm(), s)
    lin.weight.data.mul_(s)
    torch.testing.assert_close(lin(x * norm_w), ref, rtol=1e-5, atol=1e-6)
    up = nn.Linear(8, 6)
    down = nn.Linear(6, 3)
    y = down(up(x))
    s6 = torch.rand(6) + 0.5
    fold_scales(up, s6)
    down.weight.data.mul_(s6)
    torch.testing.assert_close(down(up(x)), y, rtol=1e-5, atol=1e-5)


def test_family_descriptions_for_opt_and_gpt_neox_and_post_norm_opt_not_described():
    """OPT and GPT-NeoX are described (pre-norm: each norm feeds its own projections); OPT with
    post-norm layers (``do_layer_norm_before=False``, OPT-350m) is not: the description does not
    fit it, so AWQ measures its pairs instead (``wiring.py``), and no norm feeds q/k/v there."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM

    from edgekit.compress.families import family_of
    from edgekit.compress.weight_only.blocks import find_blocks
    from edgekit.compress.wiring import probe_family

    small = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    opt = OPTForCausalLM(OPTConfig(**small, ffn_dim=32, word_embed_proj_dim=16))
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(**small, intermediate_size=32))
    assert family_of(opt).pair_for("fc1").producer == "final_layer_norm"
    assert family_of(neox).pair_for("mlp.dense_h_to_4h").producer == "post_attention_layernorm"
    assert family_of(opt).known
    post = OPTForCausalLM(OPTConfig(**{**small, "num_hidden_layers": 2}, ffn_dim=32, word_embed_proj_dim=16,
                                    do_layer_norm_before=False)).eval()
    described = family_of(post)
    assert not described.known and described.name == "opt with do_layer_norm_before=False"
    probed = probe_family(post, *reversed(find_blocks(post)))
    assert probed.pair_for("self_attn.q_proj") is None and probed.pair_for("fc1") is None  # post-norm: no norm feeds them
    assert probed.pair_for("self_attn.out_proj").producer == "self_attn.v_proj"
