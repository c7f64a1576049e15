"""Text as the sources use it: the offline corpora (gensim's Wikipedia sample and Lee news
corpus), sentences, and text tokenized into fixed-length windows for causal LMs.

The data sets of ``sources.data`` (``wikipedia``, ``lee-news``), the layout pages of
``sources.detection_data`` (their paragraphs) and the Hugging Face wrappers of
``sources.hf`` (their ``prepare``) all take their text from here.
"""
from __future__ import annotations

import bz2
import functools
import importlib.util
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import atomic_write_json, cache_dir
from edgekit.errors import BadInputError


def package_dir(package: str) -> Path:
    """The folder of an installed package that ships a data set (found without importing it)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(f"the data set needs the Python package {package!r}, which is not installed")
    return Path(list(spec.submodule_search_locations)[0])


# --- corpora ----------------------------------------------------------------------------------

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


@functools.lru_cache(maxsize=1)
def wikipedia_articles() -> list[str]:
    """The gensim Wikipedia sample: redirects dropped, markup stripped, one string per
    article (cached on disk: parsing takes ~6 s)."""
    path = package_dir("gensim") / "test" / "test_data" / WIKI_FILE
    st = path.stat()
    cached = cache_dir() / "data" / f"wikipedia-{st.st_size}-{int(st.st_mtime)}.json"
    if cached.is_file():
        try:
            return list(json.loads(cached.read_text()))
        except (json.JSONDecodeError, OSError):
            pass
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    articles = []
    with bz2.open(path, "rb") as f:
        for _title, text, _pid in extract_pages(f):
            if text.lstrip().lower().startswith("#redirect"):
                continue
            body = filter_wiki(text).strip()
            if body:
                articles.append(body)
    atomic_write_json(cached, articles)
    return articles


@functools.lru_cache(maxsize=1)
def lee_news_documents() -> list[str]:
    """gensim's Lee news corpus: one news document a line (300 documents)."""
    path = package_dir("gensim") / "test" / "test_data" / "lee_background.cor"
    return [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]


# --- sentences and token windows --------------------------------------------------------------

def token_windows(tokenizer: Any, text: str, seqlen: int, *, bos_token_id: int | None = None,
                  limit: int | None = None, prefix: Sequence[int] = ()) -> np.ndarray:
    """Tokenize ``text`` once and cut it into non-overlapping windows: (n, seqlen) int64.
    With ``prefix`` (the special tokens the tokenizer puts in front of a text, e.g. ``<bos>``:
    ``window_prefix(tokenizer)``) every window starts with them, then ``seqlen - len(prefix)``
    text tokens; ``bos_token_id`` is the one-token prefix."""
    prefix = _prefix(prefix, bos_token_id, seqlen)
    step = seqlen - len(prefix)
    ids = _tokenize_prefix(tokenizer, text, None if limit is None else (limit + 1) * step)
    n = len(ids) // step
    if limit is not None:
        n = min(n, limit)
    windows = ids[: n * step].reshape(n, step)
    return _with_prefix(windows, prefix)


def random_token_windows(tokenizer: Any, text: str, seqlen: int, n: int, *, seed: int = 0,
                         bos_token_id: int | None = None, prefix: Sequence[int] = ()) -> np.ndarray:
    """``n`` windows of ``seqlen`` tokens at random offsets of ``text`` (they may overlap): the
    GPTQ reference's calibration sampling (``random.randint(0, len - seqlen - 1)`` per sample),
    for when a text holds fewer non-overlapping windows than wanted. (n, seqlen) int64; each
    window starts with ``prefix`` as in ``token_windows``."""
    prefix = _prefix(prefix, bos_token_id, seqlen)
    step = seqlen - len(prefix)
    ids = _tokenize_prefix(tokenizer, text, None)
    if len(ids) < step:
        raise BadInputError(f"the text holds {len(ids)} tokens, fewer than one {seqlen}-token window")
    starts = np.random.default_rng(seed).integers(0, len(ids) - step + 1, size=n)
    windows = np.stack([ids[s:s + step] for s in starts]) if n else np.zeros((0, step), np.int64)
    return _with_prefix(windows, prefix)


def window_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The special tokens ``tokenizer`` puts in front of every text it encodes (``<bos>`` for
    Llama 2 and Gemma; nothing for GPT-2-style tokenizers): what a model saw at the start of
    every training sequence, so every calibration and evaluation window starts with them."""
    text = "The quick brown fox"
    plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(int(t) for t in full[:start])
    return ()


def _prefix(prefix: Sequence[int], bos_token_id: int | None, seqlen: int) -> tuple[int, ...]:
    out = tuple(int(t) for t in prefix) or ((int(bos_token_id),) if bos_token_id is not None else ())
    if seqlen < len(out) + 1:
        raise BadInputError(f"seqlen must be at least {len(out) + 1} (the {len(out)} special tokens every window "
                            f"starts with, then text), got {seqlen}")
    if seqlen < 2:
        raise BadInputError(f"seqlen must be at least 2, got {seqlen}")
    return out


def _with_prefix(windows: np.ndarray, prefix: tuple[int, ...]) -> np.ndarray:
    if not prefix:
        return windows
    head = np.broadcast_to(np.asarray(prefix, dtype=np.int64), (windows.shape[0], len(prefix)))
    return np.concatenate([head, windows], axis=1)


def _tokenize_prefix(tokenizer: Any, text: str, min_tokens: int | None) -> np.ndarray:
    """Token ids of ``text``; with ``min_tokens``, of a prefix long enough to hold that
    many tokens (plus a margin, so the cut never touches them), found by doubling."""
    def tok(t: str) -> np.ndarray:
        return np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], dtype=np.int64)

    if min_tokens is not None:
        chars = max(4096, 6 * min_tokens)
        while chars < len(text):
            ids = tok(text[:chars])
            if len(ids) >= min_tokens + 64:
                return ids
            chars *= 2
    return tok(text)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def split_sentences(documents: list[str], min_words: int = 5) -> list[str]:
    """Sentences of the documents (split after . ! ? before a capital), short ones dropped."""
    out = []
    for doc in documents:
        for para in doc.splitlines():
            for s in _SENTENCE_END.split(para.strip()):
                s = s.strip()
                if len(s.split()) >= min_words:
                    out.append(s)
    return out
