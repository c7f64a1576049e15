"""Hugging Face folders and GGUF files, offline, wrapped to plain tensor I/O.

* Causal LMs (``config.architectures`` ending in ``ForCausalLM``) become
  ``CausalLMWrapper``: ``forward(input_ids, attention_mask) -> logits`` (no KV cache).
  The Hugging Face model stays reachable as ``wrapper.model``, so compression steps
  walk ``wrapper.model.model.layers``.
* BERT-style encoders become ``SentenceEncoderWrapper``:
  ``forward(input_ids, attention_mask[, token_type_ids]) -> embedding``, the
  mean-pooled (or CLS-pooled, per the sentence-transformers pooling config), L2-normalised
  sentence embedding (the sentence-transformers all-MiniLM-L6-v2 convention).

A GGUF file is dequantized by transformers (``gguf`` package), which is slow (~14 s for
SmolLM2-135M), so the float32 model and its tokenizer are cached as a Hugging Face
folder under ``cache_dir()/hf-float/`` keyed by the GGUF's name, size and mtime, and
reloaded from there (~0.1 s) next time.

>>> h = load_hf(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
>>> h.module(**{k: torch.from_numpy(v) for k, v in h.sample_inputs(1, sequence=8).items()}).shape  # doctest: +SKIP
torch.Size([1, 8, 49152])
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError, UnavailableError
from edgekit.sources.handle import InputSpec, ModelHandle

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_SEQUENCE = 32  # tokens in make_inputs() when no length is asked
SAMPLE_SENTENCES = (  # real sentences (from gensim's Lee news corpus) for example inputs
    "Hundreds of people have been forced to vacate their homes in the Southern Highlands of New South Wales "
    "as strong winds today pushed a huge bushfire towards the town of Hill Top.",
    "A new blaze near Goulburn, south-west of Sydney, has forced the closure of the Hume Highway.",
    "The Federal Government says it is not concerned by a decision to move the Australian dollar's trading.",
    "Indian security forces have shot dead eight suspected militants in a night-long encounter in "
    "southern Kashmir.",
)

try:  # the wrappers are nn.Modules; define them only where torch exists
    import torch
    from torch import nn
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]
    nn = None  # type: ignore[assignment]


if nn is not None:

    class CausalLMWrapper(nn.Module):
        """``forward(input_ids, attention_mask) -> logits (batch, sequence, vocab)``."""

        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    class SentenceEncoderWrapper(nn.Module):
        """``forward(input_ids, attention_mask[, token_type_ids]) -> embedding (batch, hidden)``,
        pooled over the attended tokens and L2-normalised."""

        def __init__(self, model: nn.Module, pooling: str = "mean", normalize: bool = True) -> None:
            super().__init__()
            if pooling not in ("mean", "cls"):
                raise BadInputError(f"unknown pooling {pooling!r} (choose from 'cls', 'mean')")
            self.model = model
            self.pooling = pooling
            self.normalize = normalize

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
            kwargs = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
            if self.pooling == "cls":
                emb = hidden[:, 0]
            else:
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return nn.functional.normalize(emb, p=2, dim=1) if self.normalize else emb


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - a core dependency
        raise UnavailableError(f"Hugging Face models need the transformers package: {e}") from None
    transformers.logging.set_verbosity_error()
    return transformers


def _gguf_cache_folder(gguf: Path) -> Path:
    from edgekit.artifact import cache_dir, sha256_json

    st = gguf.stat()
    key = sha256_json({"name": gguf.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})[:16]
    return cache_dir() / "hf-float" / f"{gguf.stem}-{key}"


def float_copy_of_gguf(folder: Path, gguf_file: str) -> Path:
    """A float32 Hugging Face folder (config, safetensors, tokenizer) made from the GGUF
    file once and cached; returns its path."""
    gguf = folder / gguf_file
    if not gguf.is_file():
        raise BadInputError(f"model file {str(gguf)!r} does not exist")
    target = _gguf_cache_folder(gguf)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    from edgekit.sources.zoo import cache_lock

    with cache_lock(target.with_name(target.name + ".lock")):
        if not ((target / "config.json").is_file() and (target / "model.safetensors").is_file()):
            _convert_gguf(folder, gguf_file, target)
    return target


def _convert_gguf(folder: Path, gguf_file: str, target: Path) -> None:
    from edgekit.artifact import staged_dir

    gguf = folder / gguf_file
    tf = _transformers()
    try:
        config = tf.AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file)
    except Exception as e:
        raise BadInputError(f"{gguf} is not a GGUF model transformers can load: {str(e).splitlines()[0]}") from None
    del config  # parsing it checks the file; GGUF configs carry no architectures (all are causal LMs)
    try:
        tokenizer = tf.AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file)
        model = tf.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf_file, dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise BadInputError(f"transformers cannot load {gguf} as a causal LM: {str(e).splitlines()[0]}") from None
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(model.config, "quantization_config")
    with staged_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "edgekit-source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))


def _is_causal_lm(config: Any) -> bool:
    return any(str(a).endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or []))


def _is_encoder(config: Any) -> bool:
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    return getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "xlm-roberta", "mpnet") or any(
        a.endswith(("BertModel", "RobertaModel", "MPNetModel")) for a in archs)


def load_hf(folder: str | os.PathLike[str], gguf_file: str | None = None) -> ModelHandle:
    """A local Hugging Face folder (``config.json``) or a GGUF file in ``folder``, offline."""
    folder = Path(folder)
    source = str(folder / gguf_file) if gguf_file else str(folder)
    t0 = time.perf_counter()
    if gguf_file:
        hf_folder = float_copy_of_gguf(folder, gguf_file)
        name = Path(gguf_file).stem
    else:
        if not (folder / "config.json").is_file():
            raise BadInputError(f"{folder} is not a Hugging Face model folder (no config.json)")
        hf_folder = folder
        name = folder.name if folder.name != "model" else folder.parent.name
    tf = _transformers()
    try:
        config = tf.AutoConfig.from_pretrained(str(hf_folder))
    except Exception as e:
        raise BadInputError(f"{hf_folder}/config.json cannot be read: {str(e).splitlines()[0]}") from None
    tokenizer = tf.AutoTokenizer.from_pretrained(str(hf_folder))
    if _is_causal_lm(config):
        handle = _causal_lm_handle(tf, hf_folder, config, tokenizer, name, source)
    elif _is_encoder(config):
        handle = _encoder_handle(tf, hf_folder, config, tokenizer, name, source)
    else:
        archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
        raise BadInputError(f"unsupported Hugging Face architecture {archs[0]!r} in {folder} (edgekit loads causal "
                            "LMs, *ForCausalLM, and BERT-style sentence encoders)")
    handle.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    handle.extra["hf_folder"] = str(hf_folder)
    return handle


def _repeat_text(texts: tuple[str, ...], min_chars: int) -> str:
    text = " ".join(texts)
    while len(text) < min_chars:
        text = text + " " + " ".join(texts)
    return text


def _causal_lm_handle(tf: Any, folder: Path, config: Any, tokenizer: Any, name: str, source: str) -> ModelHandle:
    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    model.config.use_cache = False
    wrapper = CausalLMWrapper(model).eval()

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        """Real news text, tokenized; row b starts b sentences later so rows differ."""
        seq = int(sequence or DEFAULT_SEQUENCE)
        rows = []
        for b in range(batch):
            sents = SAMPLE_SENTENCES[b % len(SAMPLE_SENTENCES):] + SAMPLE_SENTENCES[:b % len(SAMPLE_SENTENCES)]
            ids = tokenizer(_repeat_text(sents, 8 * seq), add_special_tokens=False)["input_ids"][:seq]
            rows.append(ids)
        ids_arr = np.asarray(rows, dtype=np.int64)
        return {"input_ids": ids_arr, "attention_mask": np.ones_like(ids_arr)}

    def prepare(text: str | list[str], seqlen: int | None = None) -> dict[str, np.ndarray]:
        from edgekit.sources.data import DEFAULT_SEQLEN, token_windows

        joined = text if isinstance(text, str) else "\n\n".join(text)
        ids = token_windows(tokenizer, joined, int(seqlen or DEFAULT_SEQLEN))
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    seq_axes = {0: "batch", 1: "sequence"}
    return ModelHandle(
        name=name, source=source, kind="causal-lm", module=wrapper,
        inputs=[InputSpec("input_ids", ("batch", "sequence"), "int64"),
                InputSpec("attention_mask", ("batch", "sequence"), "int64")],
        outputs=["logits"], make_inputs=make_inputs, prepare=prepare,
        default_calib="lee-news", default_eval="wikipedia", default_train="wikipedia", evaluator="perplexity",
        tokenizer=tokenizer,
        dynamic_axes={"input_ids": dict(seq_axes), "attention_mask": dict(seq_axes), "logits": dict(seq_axes)},
        extra={"params": sum(p.numel() for p in model.parameters()), "hf_config": config.to_dict(),
               "vocab_size": int(config.vocab_size), "num_layers": int(getattr(config, "num_hidden_layers", 0)),
               "seqlen": 512, "eval_batch": 1},
    )


def _sentence_transformers_pooling(folder: Path) -> tuple[str, bool]:
    """(pooling, normalize) from a sentence-transformers folder; mean + normalize otherwise."""
    pooling, normalize = "mean", True
    modules = folder / "modules.json"
    if modules.is_file():
        with contextlib.suppress(OSError, json.JSONDecodeError, KeyError, TypeError):
            mods = json.loads(modules.read_text())
            normalize = any(str(m.get("type", "")).endswith("Normalize") for m in mods)
            for m in mods:
                if str(m.get("type", "")).endswith("Pooling"):
                    cfg = json.loads((folder / m["path"] / "config.json").read_text())
                    if cfg.get("pooling_mode_cls_token") and not cfg.get("pooling_mode_mean_tokens"):
                        pooling = "cls"
    return pooling, normalize


def _encoder_handle(tf: Any, folder: Path, config: Any, tokenizer: Any, name: str, source: str) -> ModelHandle:
    model = tf.AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    pooling, normalize = _sentence_transformers_pooling(folder)
    wrapper = SentenceEncoderWrapper(model, pooling=pooling, normalize=normalize).eval()
    names = ["input_ids", "attention_mask"]
    if "token_type_ids" in getattr(tokenizer, "model_input_names", []) and getattr(config, "type_vocab_size", 0):
        names.append("token_type_ids")
    max_len = int(min(getattr(tokenizer, "model_max_length", 512) or 512, getattr(config, "max_position_embeddings", 512)))

    def prepare(sentences: str | list[str], seqlen: int | None = None) -> dict[str, np.ndarray]:
        """Sentences -> padded (to the longest, at most ``seqlen`` tokens) int64 arrays."""
        if isinstance(sentences, str):
            sentences = [sentences]
        enc = tokenizer(list(sentences), padding=True, truncation=True, max_length=min(int(seqlen or 128), max_len),
                        return_tensors="np")
        return {n: np.asarray(enc[n], dtype=np.int64) for n in names}

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        sents = [SAMPLE_SENTENCES[i % len(SAMPLE_SENTENCES)] for i in range(batch)]
        if sequence is None:
            return prepare(sents)
        enc = tokenizer(sents, padding="max_length", truncation=True, max_length=int(sequence), return_tensors="np")
        return {n: np.asarray(enc[n], dtype=np.int64) for n in names}

    seq_axes = {0: "batch", 1: "sequence"}
    return ModelHandle(
        name=name, source=source, kind="text-encoder", module=wrapper,
        inputs=[InputSpec(n, ("batch", "sequence"), "int64") for n in names], outputs=["embedding"],
        make_inputs=make_inputs, prepare=prepare,
        default_calib="wikipedia", default_eval="lee-news", default_train="lee-news", evaluator="cosine",
        tokenizer=tokenizer, dynamic_axes={**{n: dict(seq_axes) for n in names}, "embedding": {0: "batch"}},
        extra={"params": sum(p.numel() for p in model.parameters()), "hf_config": config.to_dict(),
               "pooling": pooling, "normalize": normalize, "hidden_size": int(config.hidden_size),
               "max_length": max_len, "eval_batch": 32},
    )
