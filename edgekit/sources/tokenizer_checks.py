"""Checks that a Hugging Face model's tokenizer is the one its files mean.

* **Files that disagree.** A folder may carry a tokenizer twice: ``tokenizer.json`` (what
  transformers loads) and the SentencePiece model it was converted from, ``tokenizer.model``.
  ``check_tokenizer_files`` runs ``gguf_tokenizer.CHECK_STRINGS`` through the loaded tokenizer
  and through the SentencePiece model's pieces, scores and types as llama.cpp runs a
  SentencePiece BPE vocabulary (``gguf_tokenizer.LlamaCppReference``), and raises
  ``CheckFailedError`` naming the first string that differs and both id sequences. A
  ``tokenizer.model`` the reference cannot run exactly (a Unigram model, a normalizer other
  than ``identity``) is reported as not checked, in a warning.
* **Token density.** ``token_density`` is tokens per character of a text;
  ``check_token_density`` warns when it is far from the norm of the model's family on English
  prose (``FAMILY_DENSITY``): the sign of a tokenizer that is not the model's (Gemma-3 through
  transformers' GGUF conversion: 2.1x llama.cpp's tokens on that text) or of text unlike English prose.

>>> check_tokenizer_files(tokenizer, Path("llama-2-7b"))  # doctest: +SKIP
>>> token_density(tokenizer, lee_news_text)  # doctest: +SKIP
0.226
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError
from edgekit.sources.gguf_tokenizer import GGUFVocab, check_tokenizer
from edgekit.sources.weights import first_line

log = logging.getLogger(__name__)

MAX_SENTENCEPIECE_BYTES = 64 * 2**20  # a 256k-piece model is ~4 MB
SPM_BPE = 2  # TrainerSpec.ModelType BPE (1 is Unigram)

# Tokens per character on English prose: the first DENSITY_SAMPLE_CHARS characters of gensim's Lee
# news text (the calibration split of causal LMs), by config.model_type, measured with each family's
# own tokenizer (2026-11-27): SmolLM2-135M's byte-level BPE (49,152 tokens) 0.214 for "llama";
# Gemma-3-270m's SentencePiece BPE (262,144 tokens, as llama.cpp tokenizes it) 0.207 for the Gemma
# family (transformers' GGUF conversion of the same vocabulary: 0.436). Other families get
# DEFAULT_DENSITY, between the two measured vocabularies.
FAMILY_DENSITY: dict[str, float] = {"llama": 0.214, "gemma": 0.207, "gemma2": 0.207, "gemma3": 0.207,
                                    "gemma3_text": 0.207}
DEFAULT_DENSITY = 0.21
DENSITY_TOLERANCE = 1.3  # a density beyond norm x 1.3 or below norm / 1.3 is reported
DENSITY_SAMPLE_CHARS = 20_000


def read_sentencepiece(path: Path) -> tuple[GGUFVocab | None, str]:
    """A ``tokenizer.model`` as the vocabulary llama.cpp would convert it to (pieces, scores,
    types, ``add_dummy_prefix``), parsed as protobuf (nothing in it runs); (None, why) where
    llama.cpp's SentencePiece BPE algorithm would not reproduce SentencePiece on it."""
    from transformers.convert_slow_tokenizer import import_protobuf

    size = path.stat().st_size
    if size > MAX_SENTENCEPIECE_BYTES:
        raise BadInputError(f"{path} is {size / 2**20:.0f} MiB; at most {MAX_SENTENCEPIECE_BYTES // 2**20} MiB is read")
    proto = import_protobuf().ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as e:  # google.protobuf.message.DecodeError and friends
        raise BadInputError(f"{path} is not a SentencePiece model: {first_line(e)}") from None
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if not proto.pieces:
        raise BadInputError(f"{path} is not a SentencePiece model: it holds no pieces")
    if trainer.model_type != SPM_BPE:
        return None, f"a SentencePiece model of type {trainer.model_type} (edgekit checks BPE models, type {SPM_BPE})"
    if (norm.name or "identity") != "identity" or norm.precompiled_charsmap or norm.remove_extra_whitespaces:
        return None, (f"its normalizer ({norm.name or 'custom'}, remove_extra_whitespaces="
                      f"{norm.remove_extra_whitespaces}) is not the identity the reference runs")
    if trainer.treat_whitespace_as_suffix or not norm.escape_whitespaces:
        return None, "its whitespace handling (suffix or not escaped) is not SentencePiece's default"
    tokens = [p.piece for p in proto.pieces]
    if len(set(tokens)) != len(tokens):
        raise BadInputError(f"{path} declares a piece twice")
    n = len(tokens)

    def piece_id(value: int) -> int | None:
        return int(value) if 0 <= value < n else None

    vocab = GGUFVocab(
        model="llama", pre="default", tokens=tuple(tokens), types=np.array([p.type for p in proto.pieces], np.int32),
        scores=np.array([p.score for p in proto.pieces], np.float32), merges=(),
        bos_id=piece_id(trainer.bos_id), eos_id=piece_id(trainer.eos_id), unk_id=piece_id(trainer.unk_id),
        pad_id=piece_id(trainer.pad_id), add_bos=False, add_eos=False, add_space_prefix=bool(norm.add_dummy_prefix))
    return vocab, ""


def check_tokenizer_files(tokenizer: Any, folder: Path) -> None:
    """Where ``folder`` holds both ``tokenizer.json`` and ``tokenizer.model``, the loaded
    ``tokenizer`` must tokenize ``CHECK_STRINGS`` (no special tokens added: the SentencePiece
    model does not say which) as the SentencePiece model does; ``CheckFailedError`` otherwise."""
    model = folder / "tokenizer.model"
    if not ((folder / "tokenizer.json").is_file() and model.is_file()):
        return
    vocab, why = read_sentencepiece(model)
    if vocab is None:
        log.warning("%s: tokenizer.json not checked against tokenizer.model: %s", folder, why)
        return
    check_tokenizer(tokenizer, vocab, f"{folder}: tokenizer.json", add_special=False,
                    reference_name="tokenizer.model (SentencePiece BPE) gives")


def token_density(tokenizer: Any, text: str, chars: int = DENSITY_SAMPLE_CHARS) -> float:
    """Tokens per character of the first ``chars`` characters of ``text`` (no special tokens)."""
    sample = text[:chars]
    if not sample:
        return 0.0
    return len(tokenizer(sample, add_special_tokens=False)["input_ids"]) / len(sample)


def check_token_density(tokenizer: Any, family: str, text: str, where: str) -> float:
    """``token_density`` of ``text``; a warning when it is beyond ``DENSITY_TOLERANCE`` of the
    family's norm. Returns the density."""
    density = token_density(tokenizer, text)
    norm = FAMILY_DENSITY.get(family, DEFAULT_DENSITY)
    if density and not norm / DENSITY_TOLERANCE <= density <= norm * DENSITY_TOLERANCE:
        log.warning("%s: %.3f tokens per character on %s, %.2fx the norm of %s tokenizers on English prose (%.3f): "
                    "a tokenizer that is not the model's own, or text unlike English prose",
                    where, density, "this text", density / norm, family or "subword", norm)
    return density
