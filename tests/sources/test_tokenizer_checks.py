"""A Hugging Face folder whose tokenizer files disagree (tokenizer.json against tokenizer.model)
is refused; a tokenizer far from its family's tokens per character is reported."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from tiny_gguf import write_tiny_gguf

from edgekit.errors import CheckFailedError
from edgekit.sources.gguf_tokenizer import GGUFVocab, build_tokenizer, read_gguf_vocab, save_tokenizer
from edgekit.sources.tokenizer_checks import (
    DEFAULT_DENSITY,
    check_token_density,
    check_tokenizer_files,
    read_sentencepiece,
    token_density,
)


def write_sentencepiece(path: Path, vocab: GGUFVocab, model_type: int = 2, normalizer: str = "identity") -> Path:
    """``vocab`` as a SentencePiece ``tokenizer.model`` (what llama.cpp's converter reads back)."""
    from transformers.convert_slow_tokenizer import import_protobuf

    proto = import_protobuf().ModelProto()
    for token, score, kind in zip(vocab.tokens, vocab.scores, vocab.types):
        piece = proto.pieces.add()
        piece.piece, piece.score, piece.type = token, float(score), int(kind)
    proto.trainer_spec.model_type = model_type
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id = vocab.unk_id or 0, vocab.bos_id or 1
    proto.trainer_spec.eos_id, proto.trainer_spec.pad_id = vocab.eos_id or 2, -1
    proto.trainer_spec.byte_fallback = True
    proto.normalizer_spec.name = normalizer
    proto.normalizer_spec.add_dummy_prefix = vocab.add_space_prefix
    proto.normalizer_spec.escape_whitespaces = True
    proto.normalizer_spec.remove_extra_whitespaces = False
    path.write_bytes(proto.SerializeToString())
    return path


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, GGUFVocab]:
    folder = tmp_path_factory.mktemp("vocab")
    return {k: read_gguf_vocab(write_tiny_gguf(folder / f"{k}.gguf", k)) for k in ("spm-prefix", "spm-gemma")}


def _folder(tmp_path: Path, model_vocab: GGUFVocab, json_vocab: GGUFVocab, **spm: object) -> tuple[Path, object]:
    from transformers import AutoTokenizer

    save_tokenizer(json_vocab, build_tokenizer(json_vocab), tmp_path)
    write_sentencepiece(tmp_path / "tokenizer.model", model_vocab, **spm)
    return tmp_path, AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", ["spm-prefix", "spm-gemma"])
def test_tokenizer_files_that_agree_pass(vocabs, tmp_path, kind):
    model, _ = read_sentencepiece(write_sentencepiece(tmp_path / "m.model", vocabs[kind]))
    assert model is not None and model.tokens == vocabs[kind].tokens
    assert model.add_space_prefix == vocabs[kind].add_space_prefix and not model.add_bos
    folder, tok = _folder(tmp_path, vocabs[kind], vocabs[kind])
    check_tokenizer_files(tok, folder)


def test_tokenizer_files_that_disagree_are_refused(vocabs, tmp_path):
    """A tokenizer.json converted with the wrong space handling (no leading space where the
    SentencePiece model adds one), as a careless conversion would write it."""
    import dataclasses

    wrong = dataclasses.replace(vocabs["spm-prefix"], add_space_prefix=False)
    folder, tok = _folder(tmp_path, vocabs["spm-prefix"], wrong)
    with pytest.raises(CheckFailedError) as info:
        check_tokenizer_files(tok, folder)
    msg = str(info.value)
    assert msg.startswith(f"{folder}: tokenizer.json: the tokenizer (SentencePiece BPE, 500 tokens) gives [")
    assert "for 'The Space Calendar is updated monthly', tokenizer.model (SentencePiece BPE) gives [" in msg
    assert "\n" not in msg


def test_a_sentencepiece_model_the_reference_cannot_run_is_reported_not_checked(vocabs, tmp_path, caplog):
    import dataclasses

    wrong = dataclasses.replace(vocabs["spm-gemma"], add_space_prefix=True)
    for spm, why in (({"model_type": 1}, "a SentencePiece model of type 1 (edgekit checks BPE models, type 2)"),
                     ({"normalizer": "nmt_nfkc"}, "its normalizer (nmt_nfkc, remove_extra_whitespaces=False)")):
        folder, tok = _folder(tmp_path, vocabs["spm-gemma"], wrong, **spm)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="edgekit.sources.tokenizer_checks"):
            check_tokenizer_files(tok, folder)
        assert f"tokenizer.json not checked against tokenizer.model: {why}" in caplog.text


def test_hf_folder_with_disagreeing_tokenizer_files_does_not_load(vocabs, tmp_path):
    import dataclasses

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgekit.sources.models import load_model

    vocab = vocabs["spm-prefix"]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab.tokens), hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)).save_pretrained(
        tmp_path)
    _folder(tmp_path, vocab, vocab)
    assert load_model(str(tmp_path)).kind == "causal-lm"
    _folder(tmp_path, vocab, dataclasses.replace(vocab, add_space_prefix=False))
    with pytest.raises(CheckFailedError, match="tokenizer.model \\(SentencePiece BPE\\) gives"):
        load_model(str(tmp_path))


class _Fixed:
    """A stand-in tokenizer giving one token per ``chars`` characters."""

    def __init__(self, chars: float) -> None:
        self.chars = chars

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [0] * int(len(text) / self.chars)}


def test_token_density_far_from_the_family_norm_is_a_warning(caplog):
    text = "The Federal Government says it is not concerned by a decision to move the dollar. " * 300
    assert token_density(_Fixed(4.0), text) == pytest.approx(0.25, abs=1e-3)
    with caplog.at_level(logging.WARNING, logger="edgekit.sources.tokenizer_checks"):
        assert check_token_density(_Fixed(4.5), "gemma3_text", text, "m") == pytest.approx(0.222, abs=1e-3)
        assert check_token_density(_Fixed(6.0), "llama", text, "m") == pytest.approx(0.167, abs=1e-3)
        assert caplog.text == ""
        density = check_token_density(_Fixed(2.3), "gemma3_text", text, "gemma on data source 'lee-news'")
    assert density == pytest.approx(0.435, abs=1e-3)
    assert ("gemma on data source 'lee-news': 0.435 tokens per character on this text, 2.10x the norm of gemma3_text "
            "tokenizers on English prose (0.207)") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgekit.sources.tokenizer_checks"):
        check_token_density(_Fixed(1.0), "unknown-family", text, "m")
    assert f"the norm of unknown-family tokenizers on English prose ({DEFAULT_DENSITY:.3f})" in caplog.text
    assert np.isclose(token_density(_Fixed(4.0), ""), 0.0)
