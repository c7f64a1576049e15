"""Tiny GGUF files whose tokenizers cover what a real one does, written with the gguf package:
one-layer Llama weights (hidden 16) and a vocabulary of a few hundred tokens each.

* ``spm-prefix``: SentencePiece BPE as Llama 2 declares it (a space in front of the text,
  ``<s>`` added, byte fallback, a user-defined ``<|sep|>``).
* ``spm-gemma``: SentencePiece BPE as Gemma 3 declares it (no space in front, ``<bos>``
  added, newline and space runs as user-defined tokens, ``<start_of_turn>`` as a control token).
* ``bpe-smollm``: byte-level BPE with digits cut one by one (``tokenizer.ggml.pre = smollm``),
  no ``<bos>`` added.
* ``bpe-llama3``: byte-level BPE with Llama 3's expression, whole-word tokens taken before
  merges (``ignore_merges``), ``<|begin_of_text|>`` added by default.
* ``bpe-gpt2``, ``bpe-qwen2``, ``bpe-default``: the same vocabulary as ``bpe-smollm`` cut by
  GPT-2's, Qwen2's and llama.cpp's default expressions.

The scores of the SentencePiece vocabularies are minus a merge rank that grows with the piece's
length, as in real ones: ``▁Space`` scores far below ``▁Spa`` and ``ce`` together, so a Unigram
reading of the scores (as probabilities) cuts it in two where SentencePiece BPE merges it whole.
``tests/fixtures/gguf_tokens/`` holds the ids llama.cpp gives for these files (``record.py``).

>>> path = write_tiny_gguf(tmp_path / "t.gguf", "spm-gemma")  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

# byte-level BPE kinds -> their tokenizer.ggml.pre
BPE_PRE = {"bpe-smollm": "smollm", "bpe-llama3": "llama-bpe", "bpe-gpt2": "gpt-2", "bpe-qwen2": "qwen2",
           "bpe-default": "default"}
KINDS = ("spm-prefix", "spm-gemma", *BPE_PRE)
HIDDEN, FF, HEADS = 16, 32, 2

_WORDS = ("the", "The", "Space", "Calendar", "is", "updated", "monthly", "hello", "world", "Hello", "code",
          "line", "def", "return", "café", "naïve", "東京", "12", "34")


def _spm_pieces(prefix_words: bool) -> list[str]:
    """Normal pieces: single characters, then merges of growing length (scores by order)."""
    chars = sorted({c for w in _WORDS for c in w} | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
                                                       ".,:;!?'()[]{}=+-*#_/\\\"<>|") | {"▁"})
    pieces = list(chars)
    for w in _WORDS:  # every prefix of every word (with and without the space mark) becomes a piece
        for word in (("▁" + w, w) if prefix_words else (w, "▁" + w)):
            for k in range(2, len(word) + 1):
                if word[:k] not in pieces:
                    pieces.append(word[:k])
    for extra in ("▁▁", "▁▁▁▁", "ce", "pa", "▁S", "▁Sp", "▁Spa"):
        if extra not in pieces:
            pieces.append(extra)
    return pieces


def _byte_char(b: int) -> str:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    return chr(b) if b in keep else chr(256 + sum(1 for x in range(b) if x not in keep))


def tokenizer_fields(kind: str) -> dict[str, object]:
    """The tokenizer metadata of one tiny kind: tokens, types, scores, merges and flags."""
    if kind.startswith("spm"):
        gemma = kind == "spm-gemma"
        control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"] if gemma else \
            ["<unk>", "<s>", "</s>"]
        user = ["\n", "\n\n", "  ", "   ", "\t\t"] if gemma else ["<|sep|>"]
        normal = _spm_pieces(prefix_words=not gemma)
        tokens = control + user + [f"<0x{b:02X}>" for b in range(256)] + normal
        types = ([2 if t in ("<unk>",) else 3 for t in control] + [4] * len(user) + [6] * 256 + [1] * len(normal))
        # rank = 1000 x length^2 + order: shorter pieces merge first, every score distinct
        scores = [0.0] * (len(control) + len(user) + 256) + [-float(1000 * len(t) ** 2 + i) for i, t in enumerate(normal)]
        return {"model": "llama", "tokens": tokens, "types": types, "scores": scores, "merges": None,
                "bos": tokens.index("<bos>" if gemma else "<s>"), "eos": tokens.index("<eos>" if gemma else "</s>"),
                "unk": tokens.index("<unk>"), "add_bos": True, "add_space_prefix": not gemma, "pre": None}
    llama3 = kind == "bpe-llama3"
    control = ["<|begin_of_text|>", "<|end_of_text|>"] if llama3 else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = [_byte_char(b) for b in range(256)]
    merges: list[str] = []
    tokens = control + byte_tokens
    for w in _WORDS:
        for word in ("".join(_byte_char(b) for b in (" " + w).encode()), "".join(_byte_char(b) for b in w.encode())):
            for k in range(2, len(word) + 1):
                if word[:k] not in tokens:
                    merges.append(f"{word[:k - 1]} {word[k - 1]}")
                    tokens.append(word[:k])
    if llama3:  # a word no merge reaches: ignore_merges takes it whole
        tokens.append("Ġzzz")
    return {"model": "gpt2", "tokens": tokens, "types": [3] * len(control) + [1] * (len(tokens) - len(control)),
            "scores": None, "merges": merges, "bos": 0, "eos": 1, "unk": None,
            "add_bos": None if llama3 else False, "add_space_prefix": None, "pre": BPE_PRE[kind]}


def write_tiny_gguf(path: Path, kind: str, seed: int = 0) -> Path:
    """A one-layer Llama GGUF with the ``kind`` tokenizer (``KINDS``)."""
    import gguf

    f = tokenizer_fields(kind)
    tokens = list(f["tokens"])
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(str(f["model"]))
    if f["pre"]:
        w.add_tokenizer_pre(str(f["pre"]))
    w.add_token_list(tokens)
    w.add_token_types(list(f["types"]))
    if f["scores"] is not None:
        w.add_token_scores(list(f["scores"]))
    if f["merges"] is not None:
        w.add_token_merges(list(f["merges"]))
    w.add_bos_token_id(int(f["bos"]))
    w.add_eos_token_id(int(f["eos"]))
    if f["unk"] is not None:
        w.add_unk_token_id(int(f["unk"]))
    if f["add_bos"] is not None:
        w.add_add_bos_token(bool(f["add_bos"]))
    if f["add_space_prefix"] is not None:
        w.add_add_space_prefix(bool(f["add_space_prefix"]))
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, HIDDEN), "blk.0.attn_norm.weight": (HIDDEN,),
              "blk.0.ffn_norm.weight": (HIDDEN,), "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_k.weight": (HIDDEN, HIDDEN), "blk.0.attn_v.weight": (HIDDEN, HIDDEN),
              "blk.0.attn_output.weight": (HIDDEN, HIDDEN), "blk.0.ffn_gate.weight": (FF, HIDDEN),
              "blk.0.ffn_up.weight": (FF, HIDDEN), "blk.0.ffn_down.weight": (HIDDEN, FF),
              "output_norm.weight": (HIDDEN,), "output.weight": (vocab, HIDDEN)}
    for name, shape in shapes.items():
        w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
