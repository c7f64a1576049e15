"""Surgery that keeps the model's semantics (issue 18): a tiny Gemma-3 built offline from
transformers' Gemma3TextConfig (scaled embedding, (1 + w) RMSNorms, pre_feedforward_layernorm,
tied head) through every weight-only method, the quality gate of ``compress``, family
descriptions and the tokenizer's special prefix on every window."""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from edgekit.compress import StepContext, compress
from edgekit.compress.families import FAMILIES, embedding_scale, family_of, norm_offset
from edgekit.compress.quality import QualityBounds, check_quality
from edgekit.compress.weight_only.config import WeightOnlyConfig
from edgekit.compress.weight_only.packing import QuantEmbedding
from edgekit.compress.weight_only.step import apply, check_replacement
from edgekit.errors import BadInputError, CheckFailedError
from edgekit.sources.handle import InputSpec, ModelHandle

ROOT = Path(__file__).resolve().parents[3]
SOURCE = "tests.compress.weight_only.test_surgery:tiny_gemma"
VOCAB, RUN, WINDOW = 128, 16, 32


def _runs(n: int, seed: int) -> np.ndarray:
    """Windows of runs of one token: a model that predicts "the same token again" is nearly perfect."""
    rng = np.random.default_rng(seed)
    return np.repeat(rng.integers(0, VOCAB, size=(n, WINDOW // RUN)), RUN, axis=1).astype(np.int64)


def tiny_gemma() -> ModelHandle:
    """A 2-block Gemma-3 (GQA, tied embeddings, embedding scale sqrt(64) = 8) with seeded random
    weights shaped so that it predicts the current token: its float perplexity on runs is ~1.5,
    and anything that shrinks the embedding against the blocks' normalized outputs ruins it."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from edgekit.sources.hf import CausalLMWrapper

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                           sliding_window=16, tie_word_embeddings=True, use_cache=False)
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.25)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1)  # (1 + w) norms away from 1, so a fold that forgets the 1 shows
    module = CausalLMWrapper(model).eval()

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        ids = _runs(max(batch, 1), 7)[:, : sequence or WINDOW]
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    seq = {0: "batch", 1: "sequence"}
    return ModelHandle(name="tiny-gemma3", source=SOURCE, kind="causal-lm", module=module,
                       inputs=[InputSpec("input_ids", ("batch", "sequence"), "int64"),
                               InputSpec("attention_mask", ("batch", "sequence"), "int64")],
                       outputs=["logits"], make_inputs=make_inputs, default_calib=None,
                       dynamic_axes={"input_ids": seq, "attention_mask": seq, "logits": seq})


@pytest.fixture()
def calib(tmp_path, monkeypatch) -> str:
    monkeypatch.syspath_prepend(str(ROOT))
    ids = _runs(64, 1)  # a .npz's calib split is its first quarter
    path = tmp_path / "calib.npz"
    np.savez(path, input_ids=ids, attention_mask=np.ones_like(ids))
    return str(path)


def _ppl(handle: ModelHandle, ids: np.ndarray) -> float:
    t = torch.from_numpy(ids)
    with torch.no_grad():
        logits = handle.module(t, torch.ones_like(t))
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    return float(torch.exp(-lp.gather(-1, t[:, 1:, None]).mean()))


def test_family_description_read_from_the_model():
    h = tiny_gemma()
    fam = family_of(h.module)
    assert fam.name == "gemma2/3" and fam.norm_offset == 1.0
    pair = fam.pair_for("mlp.gate_proj")
    assert pair is not None and pair.producer == "pre_feedforward_layernorm"  # not post_attention_layernorm
    layer = h.module.model.model.layers[0]
    assert norm_offset(layer.pre_feedforward_layernorm, fam) == 1.0
    assert embedding_scale(h.module.model.model.embed_tokens) == pytest.approx(8.0, rel=1e-5)
    llama = next(f for f in FAMILIES if f.name == "llama")
    with pytest.raises(BadInputError, match="does not compute x_hat"):  # a Llama description does not fit Gemma's norm
        norm_offset(layer.input_layernorm, llama)
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64))
    assert not family_of(bert).known


@pytest.mark.parametrize("method", ["rtn", "awq", "gptq-plus"])
def test_every_method_keeps_gemma_semantics(method, calib):
    ids = _runs(8, 5)
    float_ppl = _ppl(tiny_gemma(), ids)
    assert float_ppl < 2.0
    h = apply(tiny_gemma(), WeightOnlyConfig(method=method, bits=8, group_size=32, seqlen=WINDOW, calib_samples=8),
              StepContext(calib=calib, progress=False))
    emb = h.module.model.model.embed_tokens
    assert isinstance(emb, QuantEmbedding) and emb.scale == pytest.approx(8.0)
    assert _ppl(h, ids) / float_ppl < 1.05  # 8 bits: near-lossless when the surgery keeps the semantics
    h4 = apply(tiny_gemma(), WeightOnlyConfig(method=method, bits=4, group_size=32, seqlen=WINDOW, calib_samples=8),
               StepContext(calib=calib, progress=False))
    assert _ppl(h4, ids) / float_ppl < 1.5


def test_awq_fold_respects_one_plus_w(calib):
    """AWQ's scale search must fold 1/s into (1 + w): the block computes the same function
    before quantization (checked by applying the folds with an exact 16-bit grid)."""
    ids = _runs(4, 9)
    ref = tiny_gemma()
    want = ref.module(torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.long))
    h = apply(tiny_gemma(), WeightOnlyConfig(method="awq", bits=8, group_size=32, seqlen=WINDOW, calib_samples=8,
                                             awq_clip=False, head="none"), StepContext(calib=calib, progress=False))
    got = h.module(torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.long))
    rel = float((got - want).norm() / want.norm())
    assert rel < 0.05


def test_replacement_that_changes_the_forward_is_refused():
    h = tiny_gemma()
    emb = h.module.model.model.embed_tokens
    wrong = QuantEmbedding(emb.num_embeddings, emb.embedding_dim, 8, 32, scale=1.0)  # the scale dropped
    from edgekit.compress.weight_only.rtn import rtn_quantize

    wrong.set_quantized(*rtn_quantize(emb.weight.detach(), 8, 32, False))
    with pytest.raises(CheckFailedError, match="packing 'embed' would change what the model computes"):
        check_replacement("embed", emb, wrong)
    right = QuantEmbedding(emb.num_embeddings, emb.embedding_dim, 8, 32, scale=embedding_scale(emb))
    right.set_quantized(*rtn_quantize(emb.weight.detach(), 8, 32, False))
    check_replacement("embed", emb, right)


def _break_surgery(monkeypatch) -> None:
    """A deliberately broken surgery: the packed embedding forgets Gemma's scale, and the on-the-spot
    check that would catch it is switched off, so only the quality gate stands in the way."""
    wo = importlib.import_module("edgekit.compress.weight_only.step")

    monkeypatch.setattr(wo, "embedding_scale", lambda emb: 1.0)
    monkeypatch.setattr(wo, "check_replacement", lambda *a, **k: None)


def test_quality_gate_stops_a_broken_surgery(calib, tmp_path, monkeypatch):
    cfg = WeightOnlyConfig(method="rtn", bits=4, group_size=32)
    good = compress(tiny_gemma(), [("weight-only", cfg)], tmp_path / "good", StepContext(calib=calib, progress=False))
    import json

    q = json.loads((good / "manifest.json").read_text())["metrics"]["quality"]
    assert q["passed"] and q["perplexity_ratio"] < 1.5 and q["cosine"] > 0.9 and q["agreement"] > 0.9
    assert q["data"] == f"{calib} (eval split, 8 samples)"  # held out: the calibration source's eval split
    _break_surgery(monkeypatch)
    with pytest.raises(CheckFailedError, match=r"far from the float model.*perplexity .* is .*x the float model"):
        compress(tiny_gemma(), [("weight-only", cfg)], tmp_path / "bad", StepContext(calib=calib, progress=False))
    assert not (tmp_path / "bad").exists()
    out = compress(tiny_gemma(), [("weight-only", cfg)], tmp_path / "kept",
                   StepContext(calib=calib, progress=False, accept_quality_loss=True))
    assert json.loads((out / "manifest.json").read_text())["metrics"]["quality"]["passed"] is False


def test_cli_compress_exits_1_on_a_broken_surgery(calib, tmp_path, monkeypatch):
    from edgekit.cli import cli

    _break_surgery(monkeypatch)
    args = ["compress", SOURCE, "-o", str(tmp_path / "w4"), "--bits", "4", "--method", "rtn", "--group-size", "32"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1, res.output
    assert "far from the float model" in res.output and "--accept-quality-loss" in res.output
    assert not (tmp_path / "w4").exists()
    res = CliRunner().invoke(cli, args + ["--accept-quality-loss"])
    assert res.exit_code == 0, res.output


def test_quality_bounds():
    assert check_quality({"perplexity_ratio": 1.2, "perplexity": 12, "perplexity_float": 10, "cosine": 0.99,
                          "agreement": 0.9}, QualityBounds(max_ppl_ratio=1.5)) == []
    broken = check_quality({"perplexity_ratio": 3.0, "perplexity": 30, "perplexity_float": 10, "cosine": 0.2,
                            "agreement": 0.1}, QualityBounds(max_ppl_ratio=1.5, min_cosine=0.5))
    assert len(broken) == 2 and "3x the float model's 10 (bound 1.5x)" in broken[0]
    with pytest.raises(BadInputError, match="max perplexity ratio must be >= 1, got 0.5"):
        QualityBounds(max_ppl_ratio=0.5)


def test_windows_start_with_the_tokenizers_special_prefix():
    from edgekit.sources.data import random_token_windows, token_windows, window_prefix

    class Tok:  # a Gemma-like tokenizer: <bos> = 2 in front of every text
        def __call__(self, text, add_special_tokens=True):
            ids = [10 + (ord(c) % 50) for c in text]
            return {"input_ids": ([2] if add_special_tokens else []) + ids}

    tok = Tok()
    assert window_prefix(tok) == (2,)
    w = token_windows(tok, "abcdefghij" * 20, 8, prefix=(2,))
    assert w.shape[1] == 8 and (w[:, 0] == 2).all() and (w[:, 1:] != 2).all()
    r = random_token_windows(tok, "abcdefghij" * 20, 8, 5, prefix=(2,))
    assert r.shape == (5, 8) and (r[:, 0] == 2).all()
    with pytest.raises(BadInputError, match="seqlen must be at least 2"):
        token_windows(tok, "abc", 1, prefix=(2,))


def test_export_parity_against_the_float_model(tmp_path, monkeypatch):
    """The KV-cache export keeps the scale (its traced stand-in of the packed embedding is scaled)
    and is checked against the float model; a graph that drops it stops the export (it no longer
    computes what the packed model computes)."""
    import json

    from edgekit.compress.weight_only.packing import ScaledEmbedding
    from edgekit.export.lm import export_causal_lm

    monkeypatch.syspath_prepend(str(ROOT))
    h = apply(tiny_gemma(), WeightOnlyConfig(method="rtn", bits=8, group_size=32), StepContext(progress=False))
    out = export_causal_lm(h, tmp_path / "onnx", graph="traced", accuracy_level=None)
    pf = json.loads((out / "manifest.json").read_text())["metrics"]["parity_float"]
    assert pf["passed"] and pf["relative_error"] <= pf["tolerance"] and pf["argmax_agreement"] > 0.9
    monkeypatch.setattr(ScaledEmbedding, "forward", lambda self, ids: torch.nn.Embedding.forward(self, ids))
    with pytest.raises(CheckFailedError, match="the exported graph of tiny-gemma3 does not compute what the PyTorch "
                                               "model computes: a 16-token prefill and a decode step differ by"):
        export_causal_lm(h, tmp_path / "broken", graph="traced", accuracy_level=None)
    assert not (tmp_path / "broken").exists()


def test_fold_into_a_one_plus_w_norm_is_exact():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from edgekit.compress.weight_only.awq import fold_scales

    torch.manual_seed(3)
    norm = Gemma3RMSNorm(16)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    lin = torch.nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = lin(norm(x))
        s = torch.rand(16) + 0.5
        fold_scales(norm, s, offset=1.0)
        lin.weight.mul_(s)
        torch.testing.assert_close(lin(norm(x)), want, rtol=1e-5, atol=1e-5)
        fold_scales(norm, torch.full((16,), 2.0), offset=0.0)  # the Llama rule on a Gemma norm: not the same function
        assert not torch.allclose(lin(norm(x)) * 2, want, rtol=1e-2, atol=1e-2)
