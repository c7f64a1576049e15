"""Model sources: turn a spec string into a ``ModelHandle``, all offline.

A spec is, in the order tried:
  * a previous step's output folder (has ``manifest.json``): a compressed model is
    rebuilt from its base model and its step chain; an ONNX artifact loads its graph;
  * a ``.onnx`` file (goes straight to build);
  * a ``.pt2`` file from ``torch.export.save`` (inspected: nothing in it is unpickled or run);
  * a ``.gguf`` file, or a local Hugging Face folder (``config.json``), via transformers
    with ``HF_HUB_OFFLINE=1``;
  * a Python entry point ``package.module:factory``;
  * a built-in name (``edgekit zoo`` lists them).
"""
from __future__ import annotations

import importlib
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from edgekit.artifact import read_manifest
from edgekit.errors import BadInputError, EdgekitError, bad_choice
from edgekit.memory import own_memory, release_memory
from edgekit.sources.data import image_input
from edgekit.sources.handle import InputSpec, ModelHandle, random_inputs
from edgekit.sources.inputs import (
    DEFAULT_SEQUENCE,
    InputOptions,
    apply_input_options,
    detect_preprocess,
    image_prepare,
    unbound_dims,
)
from edgekit.sources.onnx_file import (
    constants_to_initializers,
    external_tensors,
    graph_inputs,
    integer_input_bounds,
    read_onnx,
)
from edgekit.sources.pt2 import load_exported_program

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Loads an artifact folder of a kind a higher layer defines (e.g. a compressed model: base model,
# step chain and weights) into a handle.
ArtifactLoader = Callable[[Path], ModelHandle]

_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle", ".joblib")  # torch.save / pickle files


def load_model(spec: str | os.PathLike[str] | ModelHandle, input_options: InputOptions | None = None, *,
               half_storage: bool = False, loaders: Mapping[str, ArtifactLoader] | None = None) -> ModelHandle:
    """Load a model from any supported source; ``input_options`` (shapes, a .npz of real
    sample inputs, image preprocessing: ``sources.inputs``) are checked against its inputs
    and followed by its ``sample_inputs`` and ``prepare``. ``half_storage``: a Hugging Face causal
    LM stored in bfloat16/float16 keeps that storage (``hf.load_hf``); other sources load as always.
    ``loaders``: loaders of the artifact kinds a higher layer defines, by manifest kind (a compressed
    model folder, kind "model", loads through its steps: ``edgekit.loading`` passes them).

    >>> handle = load_model("efficientnet-lite0")  # doctest: +SKIP
    >>> handle.inputs[0].shape  # doctest: +SKIP
    ('batch', 3, 224, 224)
    """
    return apply_input_options(_load(spec, half_storage, loaders or {}), input_options)


def _load(spec: str | os.PathLike[str] | ModelHandle, half_storage: bool,
          loaders: Mapping[str, ArtifactLoader]) -> ModelHandle:
    if isinstance(spec, ModelHandle):
        return spec
    text = str(spec)
    path = Path(text)
    if path.is_dir() and (path / "manifest.json").is_file():
        return _load_artifact(path, loaders)
    if text.endswith(".onnx"):
        return load_onnx_file(path)
    if text.endswith(".pt2"):
        return _load_pt2(path)
    if text.endswith(".gguf"):
        from edgekit.sources import hf  # brings torch and transformers: only for a GGUF file

        _require_file(path)
        return hf.load_hf(path.parent, gguf_file=path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            from edgekit.sources import hf  # brings torch and transformers: only for a Hugging Face folder

            return hf.load_hf(path, half_storage=half_storage)
        raise BadInputError(f"{text} is a folder but neither an edgekit output (manifest.json) "
                            "nor a Hugging Face model (config.json)")
    if _ENTRY_POINT.match(text):
        return _load_entry_point(text)
    from edgekit.sources.zoo import ZOO, load_zoo_model  # brings torch: only for a zoo name

    if text in ZOO:
        return load_zoo_model(text)
    if path.is_file():
        hint = (" (edgekit never unpickles a checkpoint: save the model with torch.export.save, or load it in a "
                "Python entry point pkg.mod:fn)" if path.suffix.lower() in PICKLE_SUFFIXES else "")
        raise BadInputError(f"model file {text!r} is of a kind edgekit does not load ({path.suffix or 'no suffix'}); "
                            f"give a .onnx, .pt2 or .gguf file, a Hugging Face folder, an edgekit output folder, a "
                            f"Python entry point pkg.mod:fn or a built-in name{hint}")
    if "/" in text or "\\" in text or "." in Path(text).name:
        raise BadInputError(f"model file {text!r} does not exist")
    raise bad_choice("model", text, ZOO)


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise BadInputError(f"model file {str(path)!r} does not exist")


def load_onnx_file(path: str | os.PathLike[str], name: str | None = None) -> ModelHandle:
    """An ONNX file as a handle: validated (``onnx_file.read_onnx``), its inputs and outputs
    read from the graph. A graph that keeps its weights in ``Constant`` nodes is normalized
    (weights become initializers, outputs unchanged) into a copy that lives as long as the
    handle (``handle.onnx_path``; ``handle.source`` stays the file given). Sample inputs
    follow ``graph_sample_inputs``; an image input gets a ``prepare`` that follows the
    layout and preprocessing the model declares (``sources.inputs.detect_preprocess``)."""
    path = Path(path)
    _require_file(path)
    model = read_onnx(path)
    inputs, dyn = graph_inputs(model)
    outputs = [o.name for o in model.graph.output]
    metadata = {p.key: p.value for p in model.metadata_props}
    if any(i.name.startswith("past_key_values.") for i in inputs):  # a causal LM exported with its KV cache
        return ModelHandle(name=name or path.stem, source=str(path), kind="causal-lm", onnx_path=path,
                           inputs=inputs, outputs=outputs, dynamic_axes=dyn, make_inputs=decode_step_inputs(inputs))
    handle = ModelHandle(name=name or path.stem, source=str(path), kind="generic", onnx_path=path,
                         inputs=inputs, outputs=outputs, dynamic_axes=dyn,
                         make_inputs=graph_sample_inputs(inputs, integer_input_bounds(model)))
    handle.extra["onnx_metadata"] = metadata
    image = image_input(inputs)
    if image is not None:
        preprocess = detect_preprocess(image, metadata)
        handle.prepare = image_prepare(image, preprocess)
        handle.extra["preprocess"] = preprocess.to_dict()
    external = any(True for _ in external_tensors(model.graph))
    moved = 0 if external else constants_to_initializers(model)
    if moved:
        workdir = tempfile.TemporaryDirectory(prefix="edgekit-onnx-")  # removed with the handle, or at exit
        handle.onnx_path = Path(workdir.name) / path.name
        onnx.save_model(model, str(handle.onnx_path))
        handle.extra.update(onnx_workdir=workdir, normalized={"constants_to_initializers": moved})
    return handle


def _is_integer(spec: InputSpec) -> bool:
    return np.dtype(spec.dtype).kind in "iub"


def graph_sample_inputs(specs: list[InputSpec], bounds: dict[str, int]) -> Any:
    """``make_inputs`` for an ONNX graph: values of the declared shapes and dtypes that the
    model accepts. Token ids that index a table (``bounds``: input -> rows, read from the
    graph's Gather) stay below its size; masks are ones; token types (``*type*``,
    ``*segment*``) are a sentence pair (zeros, then ones in the second half) where the type
    table has two rows or more, else zeros; positions count up. Dimensions: the batch axis
    is the batch, named ones come from ``dims`` (``--shapes``), a dynamic dimension of a
    token-id input defaults to ``DEFAULT_SEQUENCE`` (128) tokens, and any other unbound
    dynamic dimension is an error naming the input and its dimensions."""
    token_axes = {d for s in specs if _is_integer(s) for d in s.shape if isinstance(d, str) and d != "batch"}

    def make_inputs(batch: int = 1, **dims: int) -> dict[str, np.ndarray]:
        dims = {**{d: DEFAULT_SEQUENCE for d in token_axes}, **dims}
        for s in specs:
            free = unbound_dims(s, dims)
            if free:
                example = "x".join(str(batch) if d == "batch" else str(d) if isinstance(d, int) else f"<{d}>"
                                   for d in s.shape)
                raise BadInputError(f"input {s.name!r} has dynamic dimensions {free} (shape "
                                    f"({', '.join(map(str, s.shape))})) that nothing binds; give them with "
                                    f"--shapes {s.name}:{example} (or --inputs FILE.npz)")
        feeds = random_inputs(specs, batch, **dims)
        rng = np.random.default_rng(0)
        for s in specs:
            if not _is_integer(s):
                continue
            a = feeds[s.name]
            lname = s.name.lower()
            if "mask" in lname:
                feeds[s.name] = np.ones_like(a)
            elif "type" in lname or "segment" in lname:
                seg = np.zeros_like(a)
                if bounds.get(s.name, 1) >= 2 and a.ndim:
                    seg[..., a.shape[-1] // 2:] = 1  # sentence B
                feeds[s.name] = seg
            elif "position" in lname and a.ndim:
                feeds[s.name] = np.broadcast_to(np.arange(a.shape[-1]) % bounds.get(s.name, 1 << 62),
                                                a.shape).astype(a.dtype)
            elif s.name in bounds:
                feeds[s.name] = rng.integers(0, max(1, bounds[s.name]), size=a.shape).astype(a.dtype)
        return feeds

    return make_inputs


DEFAULT_PAST = 128  # tokens already in the KV cache when a decode step is timed


def decode_step_inputs(specs: list[InputSpec], context: int | None = None) -> Any:
    """``make_inputs`` for a KV-cache graph: consistent feeds for ``sequence`` new tokens
    (default 1: one decode step) after ``past_sequence_length`` cached tokens (default 128, or
    fewer so that past + new fit in the ``context`` the model declares: a position table of 128
    has no row for position 128): attention mask over past + new, positions continuing the past,
    a past of that length."""

    def make_inputs(batch: int = 1, sequence: int | None = None, **dims: int) -> dict[str, np.ndarray]:
        seq = int(sequence or 1)
        default_past = DEFAULT_PAST if context is None else max(0, min(DEFAULT_PAST, context - seq))
        past = int(dims.get("past_sequence_length", default_past))
        rng = np.random.default_rng(0)
        feeds: dict[str, np.ndarray] = {}
        for spec in specs:
            if spec.name.startswith("past_key_values."):
                heads, dim = spec.shape[1], spec.shape[3]
                if not (isinstance(heads, int) and isinstance(dim, int)):
                    raise BadInputError(f"KV-cache input {spec.name} has no static head dimensions: {spec.shape}")
                feeds[spec.name] = (0.1 * rng.standard_normal((batch, heads, past, dim))).astype(np.dtype(spec.dtype))
            elif spec.name == "input_ids":
                feeds[spec.name] = rng.integers(0, 100, size=(batch, seq)).astype(np.int64)
            elif spec.name == "attention_mask":
                feeds[spec.name] = np.ones((batch, past + seq), dtype=np.int64)
            elif spec.name == "position_ids":
                feeds[spec.name] = np.broadcast_to(np.arange(past, past + seq, dtype=np.int64), (batch, seq)).copy()
            else:
                feeds.update(random_inputs([spec], batch, sequence=seq, **dims))
        return feeds

    return make_inputs


def borrow_io(handle: ModelHandle, source: str | None) -> None:
    """Give an ONNX graph of a built-in model that model's realistic inputs, data preparation,
    default data and evaluator (random integers are no valid token ids, token types or masks).
    The model is loaded without its weights (config and tokenizer: ``load_zoo_model(weights=False)``),
    so borrowing costs no memory the size of the model."""
    if not source or all(s.dtype.startswith("float") for s in handle.inputs):
        return  # random floats are fine inputs for image models
    if any(s.name.startswith("past_key_values.") for s in handle.inputs):
        return  # a graph with the KV cache keeps its consistent decode-step inputs (decode_step_inputs)
    # imported only here: the zoo brings torch and transformers, which an ONNX graph does not need otherwise
    from edgekit.sources.zoo import ZOO, load_zoo_model

    if source not in ZOO:
        return
    try:
        base = load_zoo_model(source, weights=False)
    except EdgekitError:  # the base model's package is missing: random inputs, as for any ONNX file
        return
    if [s.name for s in base.inputs] != [s.name for s in handle.inputs]:
        return
    handle.make_inputs, handle.prepare, handle.tokenizer = base.make_inputs, base.prepare, base.tokenizer
    handle.default_calib, handle.default_eval, handle.default_train = (base.default_calib, base.default_eval,
                                                                       base.default_train)
    handle.evaluator = handle.evaluator or base.evaluator


def _load_pt2(path: Path) -> ModelHandle:
    """A ``.pt2`` file from ``torch.export.save``, inspected first (``edgekit.sources.pt2``):
    nothing in it is unpickled unsafely or run."""
    import torch

    _require_file(path)
    ep = load_exported_program(path)
    args, kwargs = ep.example_inputs if ep.example_inputs is not None else ((), {})
    if kwargs or not args:
        raise BadInputError(f"{path} has no positional example inputs saved; re-export with example args")
    if not all(isinstance(a, torch.Tensor) for a in args):
        kinds = sorted({type(a).__name__ for a in args if not isinstance(a, torch.Tensor)})
        raise BadInputError(f"{path}: example inputs must be tensors, found {', '.join(kinds)}; "
                            "re-export with a tuple of tensors")
    names = [f"input_{i}" if len(args) > 1 else "input" for i in range(len(args))]
    shapes = _pt2_input_shapes(ep, args)
    specs = [InputSpec(n, shape, str(a.numpy().dtype)) for n, shape, a in zip(names, shapes, args)]
    example = {n: a.detach().numpy() for n, a in zip(names, args)}
    dynamic = {n: {ax: d for ax, d in enumerate(shape) if isinstance(d, str)} for n, shape in zip(names, shapes)}

    def make_inputs(batch: int = 1, **_: int) -> dict[str, Any]:
        """The saved example inputs; ``batch`` rows of its first sample where the batch is dynamic."""
        import numpy as np

        return {k: np.repeat(v[:1], batch, axis=0) if dynamic[k].get(0) == "batch" else v
                for k, v in example.items()}

    module = ep.module()
    # ExportedProgram.module() forbids .train()/.eval(); the graph is already in inference form,
    # and every later step calls .eval(), so give back nn.Module's own methods.
    for method in ("train", "eval"):
        module.__dict__.pop(method, None)
    return ModelHandle(name=path.stem, source=str(path), module=module, inputs=specs,
                       make_inputs=make_inputs, dynamic_axes={n: d for n, d in dynamic.items() if d})


def _pt2_input_shapes(ep: Any, args: tuple[Any, ...]) -> list[tuple[int | str, ...]]:
    """Each user input's shape as the program was exported: static dimensions as ints,
    dynamic ones named ("batch" for a dynamic first dimension, else "dim<i>")."""
    import torch

    user_inputs = list(ep.graph_signature.user_inputs)
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    shapes = []
    for i, a in enumerate(args):
        val = vals.get(user_inputs[i]) if i < len(user_inputs) else None
        dims = tuple(val.shape) if isinstance(val, torch.Tensor) else tuple(a.shape)
        shapes.append(tuple(("batch" if ax == 0 else f"dim{ax}") if isinstance(d, torch.SymInt) else int(d)
                            for ax, d in enumerate(dims)))
    return shapes


def _load_entry_point(spec: str) -> ModelHandle:
    """``package.module:factory``; the factory returns a ModelHandle, or an nn.Module with
    an ``example_inputs`` attribute (tuple of tensors), or ``(module, example_inputs)``."""
    import torch

    mod_name, fn_name = spec.split(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise BadInputError(f"cannot load entry point {spec!r}: {e}") from None
    obj = fn()
    if isinstance(obj, ModelHandle):
        if not obj.source:
            obj.source = spec
        return obj
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], torch.nn.Module):
        module, example = obj
    elif isinstance(obj, torch.nn.Module) and hasattr(obj, "example_inputs"):
        module = obj
        example = obj.example_inputs() if callable(obj.example_inputs) else obj.example_inputs
    else:
        raise BadInputError(f"entry point {spec!r} returned {type(obj).__name__}; expected a ModelHandle, "
                            "an nn.Module with example_inputs, or (module, example_inputs)")
    if isinstance(example, torch.Tensor):
        example = (example,)
    example = tuple(example)
    names = ["input"] if len(example) == 1 else [f"input_{i}" for i in range(len(example))]
    specs = [InputSpec(n, ("batch", *tuple(t.shape[1:])), str(t.numpy().dtype)) for n, t in zip(names, example)]
    arrays = {n: t.detach().numpy() for n, t in zip(names, example)}

    def make_inputs(batch: int = 1, **_: int) -> dict[str, Any]:
        import numpy as np

        return {k: np.repeat(v[:1], batch, axis=0) for k, v in arrays.items()}

    module.eval()
    return ModelHandle(name=fn_name, source=spec, module=module, inputs=specs, make_inputs=make_inputs,
                       dynamic_axes={n: {0: "batch"} for n in names})


def _load_artifact(folder: Path, loaders: Mapping[str, ArtifactLoader]) -> ModelHandle:
    manifest = read_manifest(folder)
    if manifest.kind in loaders:
        handle = loaders[manifest.kind](folder)
        if handle.module is not None:  # rebuilt from its float model: let go of that model's file
            own_memory(handle.module)
        release_memory()
        return handle
    if manifest.kind == "model":
        raise BadInputError(f"{folder} is a compressed model; loading it needs the compression steps: "
                            "use edgekit.load_model (edgekit.loading), or pass loaders=edgekit.loading.ARTIFACT_LOADERS")
    if manifest.kind == "onnx":
        handle = load_onnx_file(manifest.path_of(folder, "onnx"), name=manifest.model.get("name"))
        base = manifest.model
        handle.kind = base.get("kind", handle.kind)
        handle.source = manifest.source or handle.source
        handle.extra["artifact"] = str(folder)
        context = base.get("context") or {}
        tokens = context.get("tokens") if isinstance(context, dict) else None
        if handle.kind == "causal-lm" and isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 \
                and any(i.name.startswith("past_key_values.") for i in handle.inputs):
            handle.make_inputs = decode_step_inputs(handle.inputs, context=tokens)  # its decode step within it
        borrow_io(handle, manifest.source)
        release_memory()  # the validated graph's bytes and proto, freed: back to the system before the next phase
        return handle
    raise BadInputError(f"{folder} holds a {manifest.kind!r} artifact; this command takes a model, "
                        "a compressed model folder or an ONNX file")
