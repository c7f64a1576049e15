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
reloaded from there (~0.1 s) next time. The tokenizer is not transformers' conversion (which
reads Gemma's SentencePiece vocabulary as a Unigram model): it is rebuilt from the file's own
vocabulary (``gguf_tokenizer``), and every load checks it against llama.cpp's algorithm.

Nothing in a folder or GGUF file runs: ``trust_remote_code=False`` everywhere (so
transformers never asks "Do you wish to run the custom code?"), a folder whose
``auto_map`` names classes transformers does not ship is refused, safetensors are read
when present (their headers checked first, ``edgekit.sources.weights``), a
``pytorch_model.bin`` is read only through the weights-only unpickler, a GGUF header is
checked before transformers parses it, the architecture the config declares must fit in
the tensors the files hold (a config cannot make edgekit allocate more than the weights
it brings), every weight the architecture needs must be in the files (nothing silently
random), and every weight must be finite.

>>> h = load_hf(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
>>> h.module(**{k: torch.from_numpy(v) for k, v in h.sample_inputs(1, sequence=8).items()}).shape  # doctest: +SKIP
torch.Size([1, 8, 49152])
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit import interrupts
from edgekit.artifact import cache_dir, sha256_json, staged_dir
from edgekit.errors import BadInputError, UnavailableError
from edgekit.limits import check_file_size
from edgekit.sources.assets import cache_lock
from edgekit.sources.gguf_tokenizer import (
    CHECK_STRINGS,
    TOKENIZER_ARRAYS,
    build_tokenizer,
    check_tokenizer,
    read_gguf_vocab,
    save_tokenizer,
    vocab_from_metadata,
)
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.sources.text import token_windows, window_prefix
from edgekit.sources.tokenizer_checks import check_tokenizer_files
from edgekit.sources.weights import (
    check_finite_parameters,
    check_gguf,
    check_safetensors,
    first_line,
    refused_by_unpickler,
    unpickler_reason,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_SEQUENCE = 32  # tokens in make_inputs() when no length is asked
# The float copy of a GGUF file is keyed by this too: copies made before the tokenizer was rebuilt
# from the file's vocabulary (1) carry transformers' tokenizer and are not reused.
GGUF_CONVERSION = 2
# Calibration/evaluation window of a causal LM: the model's context (max_position_embeddings),
# capped here: longer windows cost CPU time linearly and change perplexity little.
DEFAULT_WINDOW = 512
MAX_CONFIG_BYTES = 16 * 2**20  # config.json / tokenizer_config.json / index files larger than this are refused
# Tokenizer files are read whole and parsed in memory (tokenizer.json into several times its
# size); the largest real ones are tens of MiB (Gemma 3's tokenizer.json: 33 MiB).
MAX_TOKENIZER_BYTES = 128 * 2**20
TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab", ".codes")
TOKENIZER_EXPANSION = 8  # memory that parsing a tokenizer file takes, per byte of it
MAX_LAYERS = 1024  # a config declaring more layers (or experts) than this is refused before anything is built
MODULE_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_local_experts", "num_experts", "n_routed_experts")
# The architecture a config declares may hold at most this many parameters beyond what the
# weight files carry (slack for buffers and small heads some checkpoints leave out).
PARAMETER_SLACK = (1.1, 1_000_000)
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
    transformers.logging.disable_progress_bar()  # stderr carries edgekit's one-line errors, not tqdm bars
    return transformers


def _gguf_cache_folder(gguf: Path) -> Path:
    st = gguf.stat()
    key = sha256_json({"name": gguf.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "conversion": GGUF_CONVERSION})[:16]
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

    with cache_lock(target.with_name(target.name + ".lock")):
        if not ((target / "config.json").is_file() and (target / "model.safetensors").is_file()):
            _convert_gguf(folder, gguf_file, target)
    return target


def _convert_gguf(folder: Path, gguf_file: str, target: Path) -> None:
    gguf = folder / gguf_file
    info = check_gguf(gguf, arrays=TOKENIZER_ARRAYS)  # bounded header check before transformers parses it
    # the tokenizer first: a file whose tokenizer edgekit cannot reproduce costs no weight conversion
    vocab = vocab_from_metadata(info.metadata, info.arrays, str(gguf))
    tokenizer = build_tokenizer(vocab)
    check_tokenizer(tokenizer, vocab, str(gguf))
    tf = _transformers()
    with _no_remote_code():
        try:
            config = tf.AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file, trust_remote_code=False)
        except Exception as e:  # transformers raises ValueError, KeyError, OSError, ...: all mean "cannot read"
            interrupts.reraise(e)  # a Ctrl-C the library wrapped stops the command (exit 130)
            raise BadInputError(f"{gguf} is not a GGUF model transformers can load: {first_line(e)}") from None
        # GGUF configs carry no architectures: all are causal LMs
        check_parameter_budget(tf.AutoModelForCausalLM, config, info.elements, str(gguf))
        try:
            # transformers' GGUF converter draws its own tqdm bar on stderr, which carries only edgekit's errors
            with contextlib.redirect_stderr(io.StringIO()):
                model, loading = tf.AutoModelForCausalLM.from_pretrained(
                    str(folder), gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=False,
                    output_loading_info=True)
        except Exception as e:  # as above; the message names the file
            interrupts.reraise(e)
            raise BadInputError(f"transformers cannot load {gguf} as a causal LM: {first_line(e)}") from None
    _require_all_weights(loading, gguf.name, str(gguf))
    check_finite_parameters(model, str(gguf))
    # save_pretrained refuses a GGUF-loaded model while it still looks quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(model.config, "quantization_config")
    with staged_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(vocab, tokenizer, tmp)
        (tmp / "edgekit-source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))


@contextlib.contextmanager
def _no_remote_code() -> Iterator[None]:
    """Some tokenizers unpickle their vocabulary when the TRUST_REMOTE_CODE environment
    variable says so; while edgekit loads a model it says no."""
    old = os.environ.get("TRUST_REMOTE_CODE")
    os.environ["TRUST_REMOTE_CODE"] = "False"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRUST_REMOTE_CODE", None)
        else:
            os.environ["TRUST_REMOTE_CODE"] = old


def check_tokenizer_sizes(folder: Path) -> None:
    """The files a tokenizer may read whole (vocabularies, merges, sentencepiece models,
    ``tokenizer.json``), each within ``MAX_TOKENIZER_BYTES`` and the memory parsing it takes,
    before transformers reads any of them."""
    with contextlib.suppress(OSError):
        for f in sorted(folder.iterdir()):
            if f.suffix in TOKENIZER_SUFFIXES and not f.name.endswith(".index.json") and f.is_file():
                check_file_size(f, MAX_TOKENIZER_BYTES, "tokenizer file", expansion=TOKENIZER_EXPANSION)


def read_json_file(path: Path) -> Any:
    """A small JSON file of a model folder (at most ``MAX_CONFIG_BYTES``)."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise BadInputError(f"{path} is {size / 2**20:.0f} MiB; at most {MAX_CONFIG_BYTES // 2**20} MiB is read")
        return json.loads(path.read_bytes())
    except BadInputError:
        raise
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise BadInputError(f"{path} is not valid JSON: {first_line(e)}") from None


@dataclass
class FolderWeights:
    """The weight files of a Hugging Face folder, checked: which format, which files, and
    how many elements they hold in all."""

    safetensors: bool
    files: list[Path]
    elements: int


def check_hf_folder(folder: Path) -> tuple[dict[str, Any], FolderWeights]:
    """``config.json`` and the weight files of a folder, checked before transformers sees them:
    no custom code needed, safetensors headers sound (else ``pytorch_model.bin`` through the
    weights-only unpickler). Returns (config dict, weights)."""
    config = read_json_file(folder / "config.json")
    if not isinstance(config, dict):
        raise BadInputError(f"{folder}/config.json is not a JSON object")
    _refuse_custom_code(folder, config)
    check_module_counts(config, f"{folder}/config.json")
    return config, _weight_files(folder)


def check_module_counts(config: dict[str, Any], where: str) -> None:
    """Counts of repeated modules (layers, experts) within ``MAX_LAYERS``: building even an
    empty (meta-device) model loops over them."""
    for key in MODULE_COUNT_KEYS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LAYERS):
            raise BadInputError(f"{where} declares {key} = {value!r} (edgekit loads at most {MAX_LAYERS})")


def _refuse_custom_code(folder: Path, config: dict[str, Any]) -> None:
    """transformers runs Python files shipped in a folder when ``auto_map`` points at them and
    the class is not one it ships itself; edgekit refuses such folders instead."""
    from transformers import CONFIG_MAPPING

    model_type = config.get("model_type")
    auto_map = config.get("auto_map")
    if auto_map and model_type not in CONFIG_MAPPING:
        classes = ", ".join(f"{k} -> {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else auto_map
        raise BadInputError(f"{folder} needs custom code to load (config.json auto_map: {str(classes)[:200]}; "
                            f"model_type {model_type!r} is not built into transformers); edgekit never runs code "
                            "from a model folder: load it through a Python entry point pkg.mod:fn")
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok = read_json_file(tok_path)
        tok_map = tok.get("auto_map") if isinstance(tok, dict) else None
        if tok_map and not _native_tokenizer(tok.get("tokenizer_class")):
            raise BadInputError(f"{folder} needs custom code for its tokenizer (tokenizer_config.json auto_map: "
                                f"{str(tok_map)[:200]}); edgekit never runs code from a model folder: load it "
                                "through a Python entry point pkg.mod:fn")


def _native_tokenizer(name: Any) -> bool:
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    return isinstance(name, str) and tokenizer_class_from_name(name) is not None


def _weight_files(folder: Path) -> FolderWeights:
    """Safetensors (one file or an index of shards) when present, else pytorch_model.bin
    (one or sharded), each checked."""
    for index, single, safe in (("model.safetensors.index.json", "model.safetensors", True),
                                ("pytorch_model.bin.index.json", "pytorch_model.bin", False)):
        if (folder / index).is_file():
            files = _shards(folder, index)
        elif (folder / single).is_file():
            files = [folder / single]
        else:
            continue
        if safe:
            return FolderWeights(True, files, sum(check_safetensors(f).elements for f in files))
        return FolderWeights(False, files, sum(_check_torch_bin(f) for f in files))
    raise BadInputError(f"{folder} has no weights (model.safetensors, model.safetensors.index.json or "
                        "pytorch_model.bin)")


def _shards(folder: Path, index: str) -> list[Path]:
    data = read_json_file(folder / index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BadInputError(f"{folder}/{index} has no weight_map")
    names = sorted({str(v) for v in weight_map.values()})
    for name in names:
        if Path(name).name != name or not (folder / name).is_file():
            raise BadInputError(f"{folder}/{index} names shard {name[:80]!r}, which is not a file in the folder")
    return [folder / n for n in names]


def _check_torch_bin(path: Path) -> int:
    """A ``pytorch_model.bin`` must load with the weights-only unpickler (memory-mapped:
    nothing is read but the pickle); returns its element count."""
    import warnings
    import zipfile

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as e:  # UnpicklingError for a refused global; anything else for a corrupt file
        interrupts.reraise(e)
        if refused_by_unpickler(e):
            raise BadInputError(f"{path} holds a pickle that only arbitrary code can load ({unpickler_reason(e)}); "
                                "edgekit reads .bin weights only through the weights-only unpickler") from None
        raise BadInputError(f"{path} is not a readable PyTorch checkpoint ({first_line(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise BadInputError(f"{path} is not a state dict (a mapping of names to tensors)")
    return sum(v.numel() for v in state.values())


def check_parameter_budget(auto_class: Any, config: Any, available: int, where: str) -> int:
    """The architecture ``config`` describes, counted on the meta device (nothing allocated),
    must fit in the ``available`` elements the weight files hold; returns its parameter count
    (tied tables once, as ``model.parameters()`` counts them)."""
    check_module_counts(config.to_dict(), where)
    with torch.device("meta"):
        try:
            model = auto_class.from_config(config, trust_remote_code=False)
        except Exception as e:  # a config transformers cannot build a model from
            interrupts.reraise(e)
            raise BadInputError(f"{where}: transformers cannot build the architecture its config describes: "
                                f"{first_line(e)}") from None
    declared = sum(p.numel() for p in model.parameters())
    factor, extra = PARAMETER_SLACK
    if declared > factor * available + extra:
        raise BadInputError(f"{where}: the config describes {declared:,} parameters but the weight files hold "
                            f"{available:,} values; refusing to build it")
    return int(declared)


def _from_pretrained(auto_class: Any, folder: Path, weights: FolderWeights, optional: tuple[str, ...] = (),
                     half_storage: bool = False) -> Any:
    """``auto_class.from_pretrained`` with nothing trusted; every weight must come from the files.
    Float32 weights, or with ``half_storage`` the files' own bfloat16/float16 kept as they are (half
    the memory; ``edgekit.memory.float32_compute`` runs such a model in float32)."""
    try:
        model, info = auto_class.from_pretrained(str(folder), dtype="auto" if half_storage else torch.float32,
                                                 trust_remote_code=False,
                                                 use_safetensors=weights.safetensors, weights_only=True,
                                                 output_loading_info=True)
    except Exception as e:  # OSError, ValueError, RuntimeError, SafetensorError, ...: all mean "cannot load"
        interrupts.reraise(e)
        raise BadInputError(f"{folder}: transformers cannot load the weights "
                            f"({', '.join(f.name for f in weights.files)}): {first_line(e)}") from None
    _require_all_weights(info, ", ".join(f.name for f in weights.files), str(folder), optional)
    if half_storage:  # only half-precision floats stay as they are; anything else becomes float32
        for p in model.parameters():
            if p.is_floating_point() and p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
                p.data = p.data.float()
    check_finite_parameters(model, str(folder))
    return model


def _require_all_weights(info: dict[str, Any], files: str, where: str, optional: tuple[str, ...] = ()) -> None:
    """transformers fills weights missing from the files with random values and only logs
    it; edgekit refuses instead (names starting with ``optional`` may be missing)."""
    missing = [k for k in info.get("missing_keys", []) if not k.startswith(optional)]
    if missing or info.get("mismatched_keys"):
        problem = (f"lacks {len(missing)} weights the architecture needs (first: {', '.join(sorted(missing)[:3])})"
                   if missing else f"has weights of the wrong shape ({str(info['mismatched_keys'][:2])[:200]})")
        raise BadInputError(f"{where}: {files} {problem}")


def _is_causal_lm(config: Any) -> bool:
    """A causal-LM architecture: ``*ForCausalLM`` or another class transformers maps to causal LM
    (GPT-2's ``GPT2LMHeadModel``, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ((v,) if isinstance(v, str) else v)}
    return any(str(a).endswith("ForCausalLM") or str(a) in causal
               for a in (getattr(config, "architectures", None) or []))


def _is_encoder(config: Any) -> bool:
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    return getattr(config, "model_type", "") in ("bert", "roberta", "distilbert", "xlm-roberta", "mpnet") or any(
        a.endswith(("BertModel", "RobertaModel", "MPNetModel")) for a in archs)


def load_hf(folder: str | os.PathLike[str], gguf_file: str | None = None, *, weights: bool = True,
            half_storage: bool = False) -> ModelHandle:
    """A local Hugging Face folder (``config.json``) or a GGUF file in ``folder``, offline;
    nothing from the folder or file is executed (see the module docstring).

    ``weights=False`` reads the config and the tokenizer only: the handle has no ``module``
    (None) but the model's inputs, sample inputs, data preparation, default data, evaluator
    and ``extra`` (parameter count from the architecture on the meta device), which is what
    an ONNX graph of the model borrows (``models.borrow_io``); no weight is read or allocated.
    (A GGUF file is still converted to its cached float folder once, where the tokenizer lives.)
    ``half_storage``: a causal LM whose files hold bfloat16/float16 weights keeps them so (half the
    memory of float32); the weight-only compression step computes in float32 a layer at a time."""
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
    _, files = check_hf_folder(hf_folder)
    tf = _transformers()
    with _no_remote_code():
        try:
            config = tf.AutoConfig.from_pretrained(str(hf_folder), trust_remote_code=False)
        except Exception as e:  # transformers raises ValueError, KeyError, OSError, ...
            interrupts.reraise(e)
            raise BadInputError(f"{hf_folder}/config.json cannot be read: {first_line(e)}") from None
        if _is_causal_lm(config):
            auto_class = tf.AutoModelForCausalLM
        elif _is_encoder(config):
            auto_class = tf.AutoModel
        else:
            archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
            raise BadInputError(f"unsupported Hugging Face architecture {archs[0]!r} in {folder} (edgekit loads causal "
                                "LMs (*ForCausalLM, GPT2LMHeadModel, ...) and BERT-style sentence encoders)")
        params = check_parameter_budget(auto_class, config, files.elements, str(hf_folder))
        check_tokenizer_sizes(hf_folder)
        try:
            tokenizer = tf.AutoTokenizer.from_pretrained(str(hf_folder), trust_remote_code=False)
        except Exception as e:  # OSError, ValueError, TypeError, tokenizers' Exception: the tokenizer files are bad
            interrupts.reraise(e)
            raise BadInputError(f"{hf_folder}: the tokenizer cannot be loaded: {first_line(e)}") from None
        tokenizer_record: dict[str, Any] | None = None
        if gguf_file:  # every load: the cached tokenizer must still tokenize as the file's own algorithm does
            vocab = read_gguf_vocab(folder / gguf_file)
            check_tokenizer(tokenizer, vocab, source)
            tokenizer_record = {"from": "the GGUF vocabulary", "kind": vocab.describe(),
                                "checked_against": "llama.cpp's algorithm", "strings": len(CHECK_STRINGS)}
        else:  # tokenizer.json must tokenize as the folder's tokenizer.model, where it has both
            check_tokenizer_files(tokenizer, hf_folder)
        if auto_class is tf.AutoModelForCausalLM:
            model = _from_pretrained(auto_class, hf_folder, files, half_storage=half_storage) if weights else None
            handle = _causal_lm_handle(model, params, config, tokenizer, name, source)
        else:
            model = _from_pretrained(auto_class, hf_folder, files, optional=("pooler.",)) if weights else None
            handle = _encoder_handle(model, params, hf_folder, config, tokenizer, name, source)
    if tokenizer_record is not None:
        handle.extra["tokenizer"] = tokenizer_record
    handle.extra["load_seconds"] = round(time.perf_counter() - t0, 3)
    handle.extra["hf_folder"] = str(hf_folder)
    return handle


def _repeat_text(texts: tuple[str, ...], min_chars: int) -> str:
    text = " ".join(texts)
    while len(text) < min_chars:
        text = text + " " + " ".join(texts)
    return text


def _causal_lm_handle(model: Any | None, params: int, config: Any, tokenizer: Any, name: str,
                      source: str) -> ModelHandle:
    """The handle of a causal LM; ``model`` None for a weights-free handle (``params`` counted
    on the meta device)."""
    wrapper = None
    if model is not None:
        model.eval()
        model.config.use_cache = False
        wrapper = CausalLMWrapper(model).eval()
        params = sum(p.numel() for p in model.parameters())

    prefix = list(window_prefix(tokenizer))  # <bos> for Gemma: what the model saw at every sequence start

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        """Real news text, tokenized, after the tokenizer's special prefix (``<bos>``); row b
        starts b sentences later so rows differ."""
        seq = int(sequence or DEFAULT_SEQUENCE)
        head = prefix[:max(seq - 1, 0)]
        rows = []
        for b in range(batch):
            sents = SAMPLE_SENTENCES[b % len(SAMPLE_SENTENCES):] + SAMPLE_SENTENCES[:b % len(SAMPLE_SENTENCES)]
            ids = tokenizer(_repeat_text(sents, 8 * seq), add_special_tokens=False)["input_ids"][:seq - len(head)]
            rows.append(head + ids)
        ids_arr = np.asarray(rows, dtype=np.int64)
        return {"input_ids": ids_arr, "attention_mask": np.ones_like(ids_arr)}

    def prepare(text: str | list[str], seqlen: int | None = None) -> dict[str, np.ndarray]:
        joined = text if isinstance(text, str) else "\n\n".join(text)
        ids = token_windows(tokenizer, joined, int(seqlen or window_len), prefix=prefix)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    # a composite config (Fuyu: a language model inside an image one) keeps these in its text config
    text_config = config if hasattr(config, "vocab_size") else config.get_text_config()
    max_positions = getattr(text_config, "max_position_embeddings", None)
    max_positions = int(max_positions) if isinstance(max_positions, int) and max_positions > 1 else None
    window_len = min(DEFAULT_WINDOW, max_positions or DEFAULT_WINDOW)
    seq_axes = {0: "batch", 1: "sequence"}
    return ModelHandle(
        name=name, source=source, kind="causal-lm", module=wrapper,
        inputs=[InputSpec("input_ids", ("batch", "sequence"), "int64"),
                InputSpec("attention_mask", ("batch", "sequence"), "int64")],
        outputs=["logits"], make_inputs=make_inputs, prepare=prepare,
        default_calib="lee-news", default_eval="wikipedia", default_train="wikipedia", evaluator="perplexity",
        tokenizer=tokenizer,
        dynamic_axes={"input_ids": dict(seq_axes), "attention_mask": dict(seq_axes), "logits": dict(seq_axes)},
        extra={"params": params, "hf_config": config.to_dict(),
               "vocab_size": int(text_config.vocab_size), "num_layers": int(getattr(text_config, "num_hidden_layers", 0)),
               "seqlen": window_len, "max_positions": max_positions, "window_prefix": prefix, "eval_batch": 1},
    )


def _sentence_transformers_pooling(folder: Path) -> tuple[str, bool]:
    """(pooling, normalize) from a sentence-transformers folder; mean + normalize otherwise.
    A modules.json that is there but unreadable is an error, not a silent default."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return "mean", True
    mods = read_json_file(modules)
    if not isinstance(mods, list) or not all(isinstance(m, dict) for m in mods):
        raise BadInputError(f"{modules} is not a list of modules")
    pooling, normalize = "mean", any(str(m.get("type", "")).endswith("Normalize") for m in mods)
    for m in mods:
        if str(m.get("type", "")).endswith("Pooling"):
            sub = str(m.get("path", ""))
            if Path(sub).is_absolute() or ".." in Path(sub).parts:
                raise BadInputError(f"{modules} points the pooling module at {sub[:80]!r}, outside the folder")
            cfg = read_json_file(folder / sub / "config.json") if (folder / sub / "config.json").is_file() else {}
            if isinstance(cfg, dict) and cfg.get("pooling_mode_cls_token") and not cfg.get("pooling_mode_mean_tokens"):
                pooling = "cls"
    return pooling, normalize


def _encoder_handle(model: Any | None, params: int, folder: Path, config: Any, tokenizer: Any, name: str,
                    source: str) -> ModelHandle:
    """The handle of a sentence encoder; ``model`` None for a weights-free handle."""
    pooling, normalize = _sentence_transformers_pooling(folder)
    wrapper = None
    if model is not None:
        model.eval()
        wrapper = SentenceEncoderWrapper(model, pooling=pooling, normalize=normalize).eval()
        params = sum(p.numel() for p in model.parameters())
    names = ["input_ids", "attention_mask"]
    type_vocab: Any = getattr(config, "type_vocab_size", 0)
    if "token_type_ids" in getattr(tokenizer, "model_input_names", []) and type_vocab:
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
        extra={"params": params, "hf_config": config.to_dict(),
               "pooling": pooling, "normalize": normalize, "hidden_size": int(config.hidden_size),
               "max_length": max_len, "eval_batch": 32},
    )
