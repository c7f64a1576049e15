"""The tokenizer a GGUF file carries: rebuilt from the file's own arrays and checked against
llama.cpp's algorithm on every load.

A GGUF file stores its tokenizer as metadata arrays (``tokenizer.ggml.tokens``, ``.scores``,
``.token_type``, ``.merges``) and names the algorithm that reads them in ``tokenizer.ggml.model``;
llama.cpp, the format's reference implementation, reads them so:

* ``llama``: SentencePiece's BPE. Spaces become ``▁`` (with one in front of the text where
  ``tokenizer.ggml.add_space_prefix`` says so); from single characters, the adjacent pair whose
  joined text is a token of the highest score is merged until no pair joins; a character the
  vocabulary lacks falls back to its UTF-8 bytes (``<0xE2>``). The scores are merge priorities
  (Gemma 3: minus each piece's rank), not probabilities.
* ``gpt2``: byte-level BPE. The text is cut by the regular expressions ``tokenizer.ggml.pre``
  names (``PRE_TOKENIZERS``), each piece's UTF-8 bytes are mapped to printable characters, and
  the listed merges apply in rank order.

In both, user-defined tokens (Gemma's newline, tab and space runs) and control tokens are cut
out of the text first, longest first, so they never merge with their neighbours; ``<bos>`` and
``<eos>`` are added where ``add_bos_token`` / ``add_eos_token`` (or the model's default) say.

``build_tokenizer`` makes that a Hugging Face ``tokenizers`` BPE tokenizer (a SentencePiece
vocabulary's scores become merges ranked by the score of the merged token). transformers' own
GGUF conversion reads the ``llama`` vocabulary of Gemma 2/3 as a Unigram model, taking the
scores for log-probabilities: it cuts "The Space Calendar is updated monthly" into 15 pieces
(``▁Sp ace ▁C al end ar ...``) where llama.cpp gives 6 (2.05x llama.cpp's tokens on the Wikipedia
evaluation text); and it put SmolLM2's ``<|im_start|>`` in front of every text, while that file
says ``add_bos_token = false``.

``LlamaCppReference`` is llama.cpp's algorithm (``llama-vocab.cpp``: the special-token partition,
the SPM and BPE sessions) in plain Python, for short strings; ``check_tokenizer`` runs
``CHECK_STRINGS`` through the built tokenizer and the reference and raises
``CheckFailedError`` naming the first string that differs and both id sequences.

>>> vocab = read_gguf_vocab("gemma-3-270m-Q4_K_M.gguf")  # doctest: +SKIP
>>> tok = build_tokenizer(vocab)  # doctest: +SKIP
>>> check_tokenizer(tok, vocab, "gemma-3-270m-Q4_K_M.gguf")  # doctest: +SKIP
>>> tok.encode("The Space Calendar is updated monthly").tokens  # doctest: +SKIP
['<bos>', 'The', '▁Space', '▁Calendar', '▁is', '▁updated', '▁monthly']
"""
from __future__ import annotations

import heapq
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError, CheckFailedError, choices
from edgekit.sources.weights import check_gguf, first_line

# token types of the GGUF format (llama.cpp's LLAMA_TOKEN_TYPE_*; SentencePiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                    "tokenizer.ggml.merges")
MODELS = ("gpt2", "llama")  # tokenizer.ggml.model values edgekit rebuilds

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How a ``gpt2`` vocabulary cuts text before BPE (llama.cpp's ``llm_tokenizer_bpe``): each
    expression in turn splits every piece so far, matches and the text between them alike;
    ``ignore_merges`` takes a piece that is a whole token as it is; ``add_bos`` is the default
    where the file does not say."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2_PRE = PreTokenizer((_GPT2,))
_DIGITS_PRE = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
# tokenizer.ggml.pre -> its cutting, as llama.cpp 0.3.36's llama-vocab.cpp declares them
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **{name: _GPT2_PRE for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4")},
    **{name: _DIGITS_PRE for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                                      "minerva")},
    **{name: _LLAMA3_PRE for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral")},
    "dbrx": PreTokenizer((_LLAMA3,)), "smaug-bpe": PreTokenizer((_LLAMA3,)),
    **{name: PreTokenizer((_QWEN2,)) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
}

# The strings every load checks: ASCII prose, punctuation and digits, accents, CJK, other
# scripts, code, whitespace runs, tabs, newlines, non-ASCII spaces, emoji, chat markup (the
# control tokens of Gemma and of ChatML), and the empty text (only the added <bos>).
CHECK_STRINGS = (
    "The Space Calendar is updated monthly",
    "Hello, world! It's 2026-11-27: 3.14159 + 42 = 45.14159 (about 1,234,567 items).",
    "café naïve résumé Zürich Ångström São Paulo Kraków",
    "東京は日本の首都です。北京欢迎你！서울은 한국의 수도입니다.",
    "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم",
    "def f(x):\n    return {'a': x ** 2}  # square\n\tpass",
    "a  b   c    d\t\te        f",
    "  leading and trailing  ",
    "line one\nline two\n\n\nline five\r\n",
    "zero\u200bwidth no\u00a0break ﬁ ligature",
    "emoji 😀🚀👍🏽 and symbols → ≤ ∑ € ©",
    "0123456789 00042 1e-5 0x1F 3rd 21st",
    "<start_of_turn>user\nHi<end_of_turn>\n<|im_start|>assistant\nOK<|im_end|>",
    "",
)


@dataclass(frozen=True)
class GGUFVocab:
    """A GGUF file's tokenizer as the file declares it (ids index ``tokens``)."""

    model: str  # "llama" (SentencePiece BPE) or "gpt2" (byte-level BPE)
    pre: str  # the gpt2 cutting's name (PRE_TOKENIZERS); "default" for llama
    tokens: tuple[str, ...]
    types: np.ndarray  # (n,) int32 token types (NORMAL, CONTROL, ...)
    scores: np.ndarray  # (n,) float32; zeros where the file has none
    merges: tuple[str, ...]  # "left right" per rank (gpt2)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None = None

    @property
    def pre_tokenizer(self) -> PreTokenizer:
        return PRE_TOKENIZERS[self.pre]

    def describe(self) -> str:
        kind = "SentencePiece BPE" if self.model == "llama" else f"byte-level BPE ({self.pre})"
        return f"{kind}, {len(self.tokens):,} tokens"


def read_gguf_vocab(path: str | os.PathLike[str]) -> GGUFVocab:
    """The tokenizer of a GGUF file (header checked first, ``weights.check_gguf``); a file whose
    tokenizer edgekit cannot rebuild exactly is refused with the reason."""
    path = Path(path)
    info = check_gguf(path, arrays=TOKENIZER_ARRAYS)
    return vocab_from_metadata(info.metadata, info.arrays, str(path))


def vocab_from_metadata(meta: dict[str, Any], arrays: dict[str, Any], where: str) -> GGUFVocab:
    """``GGUFVocab`` from a GGUF file's metadata (scalars) and arrays, checked."""
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in arrays:
        raise BadInputError(f"{where} carries no tokenizer (tokenizer.ggml.model and tokenizer.ggml.tokens)")
    if model not in MODELS:
        raise BadInputError(f"{where}: unknown tokenizer.ggml.model {str(model)[:40]!r} (edgekit rebuilds "
                            f"{choices(MODELS)})")
    tokens = arrays["tokenizer.ggml.tokens"]
    n = len(tokens)
    types = _array(arrays, "tokenizer.ggml.token_type", n, where, np.full(n, NORMAL, np.int32)).astype(np.int32)
    scores = _array(arrays, "tokenizer.ggml.scores", n, where, np.zeros(n, np.float32)).astype(np.float32)
    if len(set(tokens)) != n:
        seen: dict[str, int] = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise BadInputError(f"{where}: token {t[:40]!r} is declared twice (ids {seen[t]} and {i}); a "
                                    "vocabulary maps each text to one id")
            seen[t] = i
    merges: tuple[str, ...] = ()
    pre = "default"
    if model == "gpt2":
        if "tokenizer.ggml.merges" not in arrays:
            raise BadInputError(f"{where}: a gpt2 tokenizer without tokenizer.ggml.merges")
        merges = tuple(arrays["tokenizer.ggml.merges"])
        _check_merges(merges, set(tokens), where)
        pre = str(meta.get("tokenizer.ggml.pre") or "default")
        if pre not in PRE_TOKENIZERS:
            raise BadInputError(f"{where}: unknown tokenizer.ggml.pre {pre[:40]!r} (edgekit rebuilds "
                                f"{choices(sorted(PRE_TOKENIZERS))})")
    spm = model == "llama"
    if spm:  # byte fallback needs every byte or none (tokenizers misplaces an <unk> among partial bytes)
        index = set(tokens)
        missing = [b for b in range(256) if f"<0x{b:02X}>" not in index]
        if 0 < len(missing) < 256:
            raise BadInputError(f"{where}: the vocabulary has byte tokens for {256 - len(missing)} of the 256 bytes "
                                f"(<0x{missing[0]:02X}> is missing): a byte-fallback vocabulary holds all of them")
        # llama.cpp joins characters into any token that is not cut out of the text first, also from a
        # character that is no token itself, where BPE would fall back to bytes: SentencePiece never
        # makes such pieces
        cut = np.isin(types, (CONTROL, UNKNOWN, USER_DEFINED))
        for i, t in enumerate(tokens):
            if len(t) > 1 and not cut[i] and any(c not in index for c in t):
                c = next(c for c in t if c not in index)
                raise BadInputError(f"{where}: token {i} {t[:40]!r} holds the character {c!r}, which is no token "
                                    "itself: not a SentencePiece BPE vocabulary")
    defaults = {"bos": 1, "eos": 2, "unk": 0} if spm else {"bos": 11, "eos": 11, "unk": None}

    def token_id(key: str, default: int | None) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            if f"tokenizer.ggml.{key}_token_id" in meta:
                raise BadInputError(f"{where}: tokenizer.ggml.{key}_token_id = {value!r} is not a token id "
                                    f"(0 to {n - 1})")
            return None  # llama.cpp disables a default id outside the vocabulary
        return int(value)

    default_bos = spm or PRE_TOKENIZERS[pre].add_bos
    vocab = GGUFVocab(
        model=str(model), pre=pre, tokens=tuple(tokens), types=types, scores=scores, merges=merges,
        bos_id=token_id("bos", defaults["bos"]), eos_id=token_id("eos", defaults["eos"]),
        unk_id=token_id("unknown", defaults["unk"]), pad_id=token_id("padding", None),
        add_bos=_flag(meta, "tokenizer.ggml.add_bos_token", default_bos, where),
        add_eos=_flag(meta, "tokenizer.ggml.add_eos_token", False, where),
        add_space_prefix=_flag(meta, "tokenizer.ggml.add_space_prefix", spm, where),
        chat_template=meta.get("tokenizer.chat_template") if isinstance(meta.get("tokenizer.chat_template"), str)
        else None)
    for flag, key in ((vocab.add_bos, "bos"), (vocab.add_eos, "eos")):
        if flag and getattr(vocab, f"{key}_id") is None:
            raise BadInputError(f"{where}: add_{key}_token is set but the file has no {key} token")
    return vocab


def _check_merges(merges: Sequence[str], tokens: set[str], where: str) -> None:
    """Every merge joins two tokens into a token. (llama.cpp would also join pieces into text no
    token holds and go on merging from there, which a BPE vocabulary cannot express: such a file is
    refused rather than tokenized differently. Hugging Face's BPE refuses them too.)"""
    for i, word in enumerate(merges):
        pos = word.find(" ", 1)
        if pos < 0:
            continue
        left, right = word[:pos], word[pos + 1:]
        for part, what in ((left, "part"), (right, "part"), (left + right, "result")):
            if part not in tokens:
                raise BadInputError(f"{where}: tokenizer.ggml.merges[{i}] {word[:40]!r} has a {what} "
                                    f"{part[:40]!r} that is not a token")


def _array(arrays: dict[str, Any], key: str, n: int, where: str, default: np.ndarray) -> np.ndarray:
    if key not in arrays:
        return default
    value = np.asarray(arrays[key])
    if value.shape != (n,) or value.dtype.kind not in "iuf":
        raise BadInputError(f"{where}: {key} holds {value.shape[0] if value.ndim else 0:,} {value.dtype} values "
                            f"for {n:,} tokens")
    return value


def _flag(meta: dict[str, Any], key: str, default: bool, where: str) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise BadInputError(f"{where}: {key} = {value!r} is not a boolean")
    return value


# --- the Hugging Face tokenizer ----------------------------------------------------------------

def spm_merges(tokens: Sequence[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary as ranked BPE merges: every split of a token into two
    tokens, ranked by the merged token's score (highest first), which is the pair llama.cpp's
    SPM session joins first."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, t in enumerate(tokens):
        for k in range(1, len(t)):
            if t[:k] in index and t[k:] in index:
                found.append((-float(scores[i]), i, k))
    found.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in found]


def _gpt2_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """The file's merges as llama.cpp reads them (split at the first space after the first
    character, a word without one never matches; the first of a repeated pair keeps its rank)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for word in vocab.merges:
        pos = word.find(" ", 1)
        pair = (word[:pos], word[pos + 1:])
        if pos >= 0 and pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def build_tokenizer(vocab: GGUFVocab) -> Any:
    """A ``tokenizers.Tokenizer`` (BPE) that tokenizes as llama.cpp does (``check_tokenizer``
    proves it on ``CHECK_STRINGS``); ``save_tokenizer`` writes it as a Hugging Face tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    index = {t: i for i, t in enumerate(vocab.tokens)}
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    try:
        if vocab.model == "llama":
            tok = Tokenizer(BPE(index, spm_merges(vocab.tokens, vocab.scores), unk_token=unk, byte_fallback=True,
                                fuse_unk=False))
            steps = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
            tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
            strip = [decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []
            tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             *strip])
        else:
            pre = vocab.pre_tokenizer
            tok = Tokenizer(BPE(index, _gpt2_merges(vocab), ignore_merges=pre.ignore_merges))
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
            tok.decoder = decoders.ByteLevel()
    except Exception as e:  # tokenizers raises plain Exceptions for a vocabulary it cannot take
        raise BadInputError(f"the tokenizer cannot be built from the file's vocabulary: {first_line(e)}") from None
    # control and unknown tokens are special (recognised in text, as llama.cpp's parse_special), user-defined
    # ones plain added tokens; both are cut out of the raw text before anything else
    tok.add_special_tokens([AddedToken(vocab.tokens[i], normalized=False, special=True)
                            for i in np.flatnonzero((vocab.types == CONTROL) | (vocab.types == UNKNOWN))
                            if vocab.tokens[i]])
    tok.add_tokens([AddedToken(vocab.tokens[i], normalized=False, special=False)
                    for i in np.flatnonzero(vocab.types == USER_DEFINED) if vocab.tokens[i]])
    head = [vocab.tokens[vocab.bos_id]] if vocab.add_bos and vocab.bos_id is not None else []
    tail = [vocab.tokens[vocab.eos_id]] if vocab.add_eos and vocab.eos_id is not None else []
    if head or tail:
        single = " ".join([*head, "$A", *tail])
        pair = " ".join([single, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)])
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(t, index[t]) for t in dict.fromkeys(head + tail)])
    return tok


def save_tokenizer(vocab: GGUFVocab, tokenizer: Any, folder: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` in ``folder``: what
    ``transformers.AutoTokenizer.from_pretrained(folder)`` loads as a ``PreTrainedTokenizerFast``.
    (Written directly: wrapping a 262k-token tokenizer in transformers first deep-copies it.)"""
    tokenizer.save(str(folder / "tokenizer.json"))
    named = {f"{k}_token": vocab.tokens[i] for k in ("bos", "eos", "unk", "pad")
             if (i := getattr(vocab, f"{k}_id")) is not None}
    # the added tokens listed here spare transformers from parsing tokenizer.json in Python for them
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "added_tokens_decoder": added, **named}
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    (folder / "special_tokens_map.json").write_text(json.dumps(named, indent=1, ensure_ascii=False))


# --- llama.cpp's algorithm, for the check ------------------------------------------------------

def _byte_chars() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_BYTE_CHARS = _byte_chars()


class LlamaCppReference:
    """llama.cpp's tokenization of a vocabulary (``llama_vocab::impl::tokenize`` with
    ``parse_special``), written out plainly: for short strings (the check), not for corpora."""

    def __init__(self, vocab: GGUFVocab) -> None:
        self.vocab = vocab
        self.index = {t: i for i, t in enumerate(vocab.tokens)}
        special = np.flatnonzero(np.isin(vocab.types, (CONTROL, UNKNOWN, USER_DEFINED)))
        # longest first, as tokenizer_st_partition walks them
        self.specials = sorted(((vocab.tokens[i], int(i)) for i in special if vocab.tokens[i]),
                               key=lambda item: -len(item[0].encode()))
        self.ranks: dict[tuple[str, str], int] = {}
        for r, word in enumerate(vocab.merges):
            pos = word.find(" ", 1)
            self.ranks.setdefault((word[:pos], word[pos + 1:]) if pos >= 0 else ("", ""), r)

    def ids(self, text: str, add_special: bool = True) -> list[int]:
        v = self.vocab
        out: list[int] = [v.bos_id] if add_special and v.add_bos and v.bos_id is not None else []
        prev_special = True
        for piece in self._partition(text):
            if isinstance(piece, int):
                out.append(piece)
                prev_special = True
                continue
            if v.model == "llama":
                out += self._spm((" " if v.add_space_prefix and prev_special else "") + piece)
            else:
                out += self._bpe(piece)
            prev_special = False
        if add_special and v.add_eos and v.eos_id is not None:
            out.append(v.eos_id)
        return out

    def _partition(self, text: str) -> list[str | int]:
        """Control, unknown and user-defined tokens cut out of the text, the longest first
        (``tokenizer_st_partition``): text fragments and token ids, in order."""
        pieces: list[str | int] = [text] if text else []
        for word, i in self.specials:
            if not any(isinstance(p, str) and word in p for p in pieces):
                continue
            cut: list[str | int] = []
            for p in pieces:
                if isinstance(p, int):
                    cut.append(p)
                    continue
                for k, part in enumerate(p.split(word)):
                    if k:
                        cut.append(i)
                    if part:
                        cut.append(part)
            pieces = cut
        return pieces

    def _spm(self, raw: str) -> list[int]:
        """``llm_tokenizer_spm_session::tokenize``: spaces escaped to ``▁``, then the adjacent pair
        that forms the best-scored token joined first (ties: the leftmost) until none forms one;
        what is left outside the vocabulary as its bytes."""
        text, index, scores = raw.replace(" ", "▁"), self.index, self.vocab.scores
        n = len(text)
        size = [1] * n
        prev, nxt = [i - 1 for i in range(n)], [i + 1 if i + 1 < n else -1 for i in range(n)]
        queue: list[tuple[float, int, int, int]] = []

        def add(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                joined = text[left:left + size[left] + size[right]]
                if joined in index:
                    heapq.heappush(queue, (-float(scores[index[joined]]), left, right, len(joined)))

        for i in range(1, n):
            add(i - 1, i)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue  # outdated: a side was merged since
            size[left] += size[right]
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        out: list[int] = []
        i = 0 if n else -1
        while i != -1:
            piece = text[i:i + size[i]]
            if piece in index:
                out.append(index[piece])
            else:  # a character outside the vocabulary: its bytes
                byte_ids = [index.get(f"<0x{b:02X}>", index.get(chr(b)) if b < 0x80 else None)
                            for b in piece.encode()]
                if all(b is not None for b in byte_ids):
                    out += [int(b) for b in byte_ids if b is not None]
                elif self.vocab.unk_id is not None:  # llama.cpp fails here; <unk>, as tokenizers gives
                    out.append(self.vocab.unk_id)
                else:
                    raise CheckFailedError(f"the vocabulary has no token for {piece!r}, for all its bytes or "
                                           "unknown")
            i = nxt[i]
        return out

    def _bpe(self, text: str) -> list[int]:
        """``llm_tokenizer_bpe_session::tokenize``: the regex cuts, GPT-2's byte map, then the
        lowest-ranked adjacent pair joined first (ties: the leftmost) until none is ranked."""
        import regex

        words = [text]
        for expr in self.vocab.pre_tokenizer.regexes:
            cut = []
            for w in words:
                last = 0
                for m in regex.finditer(expr, w):
                    if m.start() > last:
                        cut.append(w[last:m.start()])
                    if m.end() > m.start():
                        cut.append(m.group())
                    last = m.end()
                if last < len(w):
                    cut.append(w[last:])
            words = cut
        out: list[int] = []
        for w in words:
            mapped = "".join(_BYTE_CHARS[b] for b in w.encode())
            if self.vocab.pre_tokenizer.ignore_merges and mapped in self.index:
                out.append(self.index[mapped])
                continue
            symbols = list(mapped)
            while len(symbols) > 1:
                best = min(((self.ranks[pair], k) for k, pair in enumerate(zip(symbols, symbols[1:]))
                            if pair in self.ranks), default=None)
                if best is None:
                    break
                k = best[1]
                symbols[k:k + 2] = [symbols[k] + symbols[k + 1]]
            for s in symbols:
                if s in self.index:
                    out.append(self.index[s])
                else:  # a joined text that is not a token: its ASCII bytes that are
                    out += [self.index[chr(b)] for b in s.encode() if b < 0x80 and chr(b) in self.index]
        return out


def reference_ids(vocab: GGUFVocab, text: str, add_special: bool = True) -> list[int]:
    """``text`` tokenized by llama.cpp's algorithm (``LlamaCppReference``)."""
    return LlamaCppReference(vocab).ids(text, add_special)


def check_tokenizer(tokenizer: Any, vocab: GGUFVocab, where: str, strings: Sequence[str] = CHECK_STRINGS,
                    add_special: bool = True, reference_name: str = "llama.cpp's algorithm") -> None:
    """Every string of ``strings`` must tokenize (special tokens added) to llama.cpp's ids;
    ``CheckFailedError`` names the first that does not and both id sequences. ``tokenizer`` is
    a transformers tokenizer (what a model handle uses) or a ``tokenizers.Tokenizer``."""
    reference = LlamaCppReference(vocab)
    for text in strings:
        if hasattr(tokenizer, "backend_tokenizer") or not hasattr(tokenizer, "encode_batch"):
            got = [int(t) for t in tokenizer(text, add_special_tokens=add_special)["input_ids"]]
        else:
            got = [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special).ids]
        want = reference.ids(text, add_special)
        if got != want:
            raise CheckFailedError(f"{where}: the tokenizer ({vocab.describe()}) gives {_shown(got)} for {text!r}, "
                                   f"{reference_name} {_shown(want)}")


def _shown(ids: list[int], limit: int = 40) -> str:
    return str(ids) if len(ids) <= limit else f"{str(ids[:limit])[:-1]}, ... ({len(ids)} ids)]"
