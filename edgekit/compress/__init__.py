"""Compression steps and the one explicit registry of them.

A step is one technique in one module: a frozen config dataclass (validated on
construction: a bad value raises ``BadInputError`` naming it and the valid ones) and a
plain ``apply(handle, config, ctx) -> handle`` function. Each module exposes a
``STEP = Step(...)``; ``STEPS`` below maps names to those, imported on first use.

A compressed model is saved as an artifact folder: ``model.safetensors`` (the state
dict of the compressed module; no pickles) and a manifest whose ``source`` is the base
model's spec and whose ``steps`` is the chain of ``{"name", "config", "meta"}``.
``load_compressed`` reloads the base model, lets each step ``rebuild`` the structure
it changed (smaller layers, packed int4 linears, fake-quant wrappers) from its record,
and loads the weights strictly: the safetensors file alone cannot run code.

Every ``compress`` measures the result against the float model it started from on held-out
data (``quality.py``: perplexity ratio, top-1 agreement, output cosine; ``metrics.quality``)
and stops with ``CheckFailedError`` (exit 1), writing nothing, when a quantizing chain costs
more than its sanity bound, unless ``StepContext.accept_quality_loss``.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from edgekit.artifact import (
    MANIFEST,
    Manifest,
    check_output_dir,
    input_record,
    read_manifest,
    staged_dir,
    work_folder,
    write_manifest,
)
from edgekit.errors import BadInputError, CheckFailedError, bad_choice, os_error_from
from edgekit.progress import StepProgress
from edgekit.schema import Loc, from_mapping
from edgekit.sources.handle import ModelHandle, StepRecord, stored_bytes
from edgekit.sources.weights import check_safetensors

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from edgekit.compress.quality import QualityBounds, Reference
    from edgekit.export.onnx import Rewrite
    from edgekit.sources.inputs import InputOptions  # numpy, image resizing: not for the command line's --help
    from edgekit.sources.models import ArtifactLoader
    from edgekit.targets import Target

# The registry and the driver import torch and ONNX (quality, the model loaders, the ONNX
# checks) inside the functions that use them: the step configs' light modules (``STEP_CONFIGS``)
# are read by the command line, which imports this package first, to build its options without torch.

# name -> "module:attribute" of its Step. Order here is the order `edgekit compress` applies
# steps named by flags: structure first (prune, distill), then fine-tune, then quantize.
STEPS: dict[str, str] = {
    "prune": "edgekit.compress.prune:STEP",
    "distill": "edgekit.compress.distill:STEP",
    "lora": "edgekit.compress.lora:STEP",
    "int8": "edgekit.compress.int8.step:STEP",
    "weight-only": "edgekit.compress.weight_only.step:STEP",
    "half": "edgekit.compress.half:STEP",
}

# name -> "module:Class" of its step's config, each in a module that imports no torch or ONNX: the
# command line builds its flags and recipes are checked from these without loading the steps
# (tests/compress/test_compress.py checks that each is its Step's ``config``).
STEP_CONFIGS: dict[str, str] = {
    "prune": "edgekit.compress.prune_config:PruneConfig",
    "distill": "edgekit.compress.distill_config:DistillConfig",
    "lora": "edgekit.compress.lora.config:LoraConfig",
    "int8": "edgekit.compress.int8.config:Int8Config",
    "weight-only": "edgekit.compress.weight_only.config:WeightOnlyConfig",
    "half": "edgekit.compress.half_config:HalfConfig",
}

# The steps the layers around compress name by what they do (the plan's --bits/--method and
# --distill, finetune's LoRA and re-quantization, a sweep's quantizers): they ask here instead of
# spelling a name; tests/compress/test_compress.py checks each against its step's declarations.
INT8_STEP = "int8"  # INT8 weights and activations (Q/DQ)
WEIGHT_ONLY_STEP = "weight-only"  # weight-only quantization to packed codes (2 to 8 bits)
PRUNE_STEP = "prune"
DISTILL_STEP = "distill"
LORA_STEP = "lora"
QUANTIZING_STEPS = (INT8_STEP, WEIGHT_ONLY_STEP)  # the steps that leave float weights quantized

# Old step names -> current ones. Recipes, the command line and the Python API still take an old
# name for one release, with a warning (``canonical_step``); manifests of artifact folders written
# under an old name load silently (their records are read with the current name).
STEP_ALIASES: dict[str, str] = {"int4": WEIGHT_ONLY_STEP}  # "int4" did 2 to 8 bits
_warned_aliases: set[str] = set()  # old names already warned about in this process: one line each


def canonical_step(name: str, *, where: str, warn: bool = True) -> str:
    """The current name of the step called ``name`` (``STEP_ALIASES``); an unknown name is
    returned as given (the registry's lookups name the valid ones). ``where``: what named it
    (``stage 'llm'``, ``--requant``), for the one deprecation warning line an old name prints
    per process; ``warn=False`` for records written by earlier versions (manifests).

    >>> canonical_step("weight-only", where="--requant")
    'weight-only'
    """
    new = STEP_ALIASES.get(name)
    if new is None:
        return name
    if warn and name not in _warned_aliases:
        _warned_aliases.add(name)
        log.warning("%s: %r is now %r; the old name will be removed in a later release", where, name, new)
    return new


@dataclass
class StepContext:
    """What a step may need beyond its config.

    calib / train / eval: data specs (see ``edgekit.sources.data``); None means the
    model's defaults. reference: the model before this chain (FP32 reference, teacher).
    work_dir: a folder that survives interruption, for checkpoints and resume.
    quality_bounds / accept_quality_loss: the quality gate of ``compress`` (``quality.py``).
    """

    target: Target | None = None
    calib: str | None = None
    train: str | None = None
    eval: str | None = None
    device: str = "cpu"
    seed: int = 0
    work_dir: Path | None = None
    progress: bool = True
    reference: ModelHandle | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # steps add what they measured
    inputs: InputOptions | None = None  # --shapes / --inputs / --preprocess (edgekit.sources.inputs)
    # the quality gate of compress() (edgekit/compress/quality.py): bounds against the float model
    # (None: the chain's defaults), and whether a loss beyond them is accepted (exit 0) or stops (exit 1)
    quality_bounds: QualityBounds | None = None
    accept_quality_loss: bool = False
    quality_windows: int | None = None  # causal LM: eval windows the gate measures on (None: quality.EVAL_WINDOWS)
    # the float model's outputs on held-out data (quality.measure_reference): measured by compress() unless
    # given (by a caller compressing one base model several ways); steps then need not measure again
    quality_reference: Reference | None = None
    # times a model's engine on a target: (handle, target) -> {"p50_ms", "p90_ms", "via"}. Given by the
    # callers above build and profile (edgekit.measure.engine_latency); None: steps report no latency
    latency: Callable[[ModelHandle, Target], Mapping[str, Any]] | None = None


# What a model's weights are between steps. Each step declares which of these it takes and
# what it leaves (``Step.transitions``); ``check_order`` derives every verdict on a chain from
# those declarations.
WEIGHT_STATES = ("float", "fake-quant", "packed", "onnx")
STATE_MEANING = {
    "float": "float",
    "fake-quant": "fake-quant (float weights on an int8 grid, with Q/DQ)",
    "packed": "packed (low-bit codes)",
    "onnx": "an ONNX graph (no PyTorch weights)",
}

# A step's config: a frozen dataclass instance (each step's own class, ``Step.config``).
StepConfig = TypeVar("StepConfig", bound="DataclassInstance")


@dataclass(frozen=True)
class Step(Generic[StepConfig]):
    """One registered technique, generic in its config class (``config``), which ``apply``,
    ``rebuild``, ``narrow`` and ``bounds`` take: a type checker holds each step's functions to it.

    apply: does the work on a handle and returns the compressed handle, appending a
        ``StepRecord(name, asdict(config), meta)`` to ``handle.steps``.
    rebuild: given a freshly loaded base handle (after earlier steps' rebuilds) and the
        step's record, recreate the changed structure with placeholder weights so the
        saved state dict loads strictly (``load_compressed`` appends the record to
        ``handle.steps`` afterwards). None when the step does not change structure.
    rewrite_onnx: optional post-export graph rewrite (e.g. packed int4 linears to
        MatMulNBits), called by ``export_onnx`` with (onnx.ModelProto, handle, record).
    transitions: what the step consumes and produces, as {state before: state after}
        over ``WEIGHT_STATES``; a state not listed is one the step cannot take.
        E.g. int8: ``{"float": "fake-quant", "onnx": "onnx"}``.
    narrow: optional ``config -> (transitions, why)`` for steps whose options decide what
        they take (LoRA over float weights, QLoRA over packed ones); a subset of
        ``transitions``.
    bounds: optional ``config -> QualityBounds``: what the step's approximation may cost
        against the float model (``compress``'s quality gate takes the loosest of a chain's).
    deliberate: the step changes what the model computes on purpose (pruning, distillation,
        LoRA): a chain with one is measured and reported, not gated.
    target_aware: the step's result depends on ``StepContext.target`` (INT8's Q/DQ scheme and
        placement): a pipeline keys its cached result on the target.
    half_storage: the step takes a model whose float weights stay stored in bfloat16/float16 (it
        computes in float32 a layer at a time): a chain of such steps loads a Hugging Face model
        stored so without a float32 copy (half the memory).
    """

    name: str
    config: type[StepConfig]
    apply: Callable[[ModelHandle, StepConfig, StepContext], ModelHandle]
    description: str
    rebuild: Callable[[ModelHandle, StepConfig, StepRecord], ModelHandle] | None = None
    rewrite_onnx: Callable[[Any, ModelHandle, StepRecord], Any] | None = None
    transitions: Mapping[str, str] = field(default_factory=lambda: {"float": "float"})
    narrow: Callable[[StepConfig], tuple[Mapping[str, str], str]] | None = None  # e.g. QLoRA: (transitions, why)
    bounds: Callable[[StepConfig], QualityBounds] | None = None
    deliberate: bool = False
    target_aware: bool = False
    half_storage: bool = False
    unchanged_at: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = sorted({s for pair in self.transitions.items() for s in pair} - set(WEIGHT_STATES))
        if bad or not self.transitions:
            raise ValueError(f"step {self.name!r} declares unknown weight states {bad} (known: {WEIGHT_STATES})")

    def transitions_for(self, config: StepConfig | None = None) -> tuple[Mapping[str, str], str]:
        """The transitions for this config (all declared ones when None), and why narrowed."""
        if config is None or self.narrow is None:
            return self.transitions, ""
        moves, why = self.narrow(config)
        return {k: v for k, v in moves.items() if self.transitions.get(k) == v}, why

    def quantizes_to(self, config: Mapping[str, Any]) -> str | None:
        """The integer precision the step leaves float weights in, for its recorded ``config``:
        Q/DQ fake quantization computes in int8, packed codes in their ``bits`` (8: int8, else
        int4); None for a step that keeps float weights."""
        made = self.transitions.get("float")
        if made == "fake-quant":
            return "int8"
        if made == "packed":
            return "int8" if int(config.get("bits", 4)) == 8 else "int4"
        return None


def quantized_precision(records: list[StepRecord]) -> str | None:
    """What the last quantizing step of ``records`` left the model in (``Step.quantizes_to``)."""
    for record in reversed(records):
        precision = get_step(record.name).quantizes_to(record.config or {})
        if precision is not None:
            return precision
    return None


def get_step(name: str) -> Step[Any]:
    """The registered step called ``name`` (an old name as the current one, silently: callers
    that take a name from a user resolve it with ``canonical_step`` first, which warns)."""
    name = STEP_ALIASES.get(name, name)
    if name not in STEPS:
        raise bad_choice("compression step", name, STEPS)
    mod, attr = STEPS[name].split(":")
    step = getattr(importlib.import_module(mod), attr)
    if not isinstance(step, Step):
        raise TypeError(f"{STEPS[name]} is not a Step")
    return step


def config_class(name: str) -> type:
    """The config class of the step named ``name``, without importing the step (``STEP_CONFIGS``)."""
    name = STEP_ALIASES.get(name, name)
    if name not in STEP_CONFIGS:
        raise bad_choice("compression step", name, STEPS)
    mod, attr = STEP_CONFIGS[name].split(":")
    config = getattr(importlib.import_module(mod), attr)
    if not isinstance(config, type):
        raise TypeError(f"{STEP_CONFIGS[name]} is not a class")
    return config


def make_config(name: str, values: Mapping[str, Any] | None = None, where: str = "") -> DataclassInstance:
    """Build a step's config from a plain mapping: known options, checked types, then the
    config's own range checks. ``where`` is the context for messages (``stage 'mlp'``).

    >>> make_config("prune", {"ratio": 0.3}).ratio
    0.3
    """
    config = config_class(name)
    if where:  # in a recipe or manifest: the path of each key
        return from_mapping(config, {} if values is None else values, Loc(where, name))
    return from_mapping(config, {} if values is None else values, Loc(), noun=f"{name} option")


def default_bounds(steps: Sequence[tuple[str, Any]]) -> QualityBounds | None:
    """The quality gate of a chain of (name, config): the loosest bounds its steps declare
    (``Step.bounds``); None when a step changes the model on purpose or none declares any.

    >>> default_bounds([("weight-only", make_config("weight-only", {"bits": 4}))]).max_ppl_ratio
    1.5
    >>> default_bounds([("prune", make_config("prune", {"ratio": 0.3}))]) is None
    True
    """
    from edgekit.compress.quality import loosest  # deferred: torch (see the imports above)

    steps_ = [(get_step(n), c) for n, c in steps]
    if any(step.deliberate for step, _ in steps_):
        return None
    return loosest([step.bounds(c) for step, c in steps_ if step.bounds is not None])


def config_to_dict(config: Any) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def check_order(steps: Sequence[str | tuple[str, Any]], start: str = "float") -> str:
    """Reject a chain in which some step gets weights it cannot take; return the state the
    chain leaves the model in. ``steps``: names, or (name, config or options) pairs (options
    may narrow what a step takes: QLoRA needs packed weights). ``start``: the state of the
    loaded model (``initial_state``).

    >>> check_order(["prune", "int8"])
    'fake-quant'
    >>> check_order(["int8", "prune"])
    Traceback (most recent call last):
    ...
    edgekit.errors.BadInputError: prune needs float weights, but after int8 the model is fake-quant (float weights on an int8 grid, with Q/DQ); put prune before int8
    """
    if start not in WEIGHT_STATES:
        raise bad_choice("weight state", start, WEIGHT_STATES)
    state = start
    history: list[tuple[str, str]] = []  # (step, state it received)
    for item in steps:
        name, config = (item, None) if isinstance(item, str) else item
        step = get_step(name)
        if not dataclasses.is_dataclass(config):  # options, or None: the defaults (plain LoRA, not QLoRA)
            config = make_config(name, config)
        moves, why = step.transitions_for(config)
        if state not in moves:
            raise BadInputError(_order_problem(name, why, moves, state, history))
        history.append((name, state))
        state = moves[state]
    return state


def _order_problem(name: str, why: str, moves: Mapping[str, str], state: str,
                   history: list[tuple[str, str]]) -> str:
    what = f"{name} ({why})" if why else name
    wants = {"float": "float weights", "fake-quant": "fake-quant weights", "packed": "packed weights",
             "onnx": "an ONNX graph"}
    needs = " or ".join(wants[s] for s in WEIGHT_STATES if s in moves)
    changed = [s for s, before in history if get_step(s).transitions.get(before) != before]
    now = (f"after {changed[-1]} the model is {STATE_MEANING[state]}" if changed
           else f"the model is {STATE_MEANING[state]} as loaded")
    earlier = [s for s, before in history if before in moves]
    if earlier and earlier[-1] == name:
        return f"{what} needs {needs}, but {now}; apply {name} once"
    if earlier:
        return f"{what} needs {needs}, but {now}; put {name} before {earlier[-1]}"
    makers = [n for n in STEPS if get_step(n).transitions.get(state) in moves and n != name]
    if makers:
        return f"{what} needs {needs}, but {now}; put {' or '.join(makers)} before it"
    return f"{what} needs {needs}, but {now}"


def initial_state(model: str | os.PathLike[str] | ModelHandle) -> str:
    """The weight state a model source loads in, without loading it: an ONNX file or
    ONNX artifact is "onnx"; a compressed-model folder is where its recorded chain left
    it; anything else (zoo name, checkpoint, Hugging Face folder, entry point) is "float"."""
    if isinstance(model, ModelHandle):
        if model.module is None:
            return "onnx"
        return check_order([(s.name, s.config) for s in model.steps]) if model.steps else "float"
    path = Path(os.fspath(model))
    if path.is_dir() and (path / MANIFEST).is_file():
        manifest = read_manifest(path)
        if manifest.kind == "onnx" or (manifest.kind == "model" and "weights" not in manifest.files):
            return "onnx"
        if manifest.kind == "model":
            where = f"{path}/{MANIFEST}"
            chain = []
            for i, rec in enumerate(manifest.steps):
                if not isinstance(rec.get("name"), str) or not isinstance(rec.get("config", {}), dict):
                    raise BadInputError(f"{where} steps[{i}]: must name a step and its config")
                chain.append((rec["name"], make_config(rec["name"], rec.get("config") or {}, where)))
            try:
                return check_order(chain)
            except BadInputError as e:
                raise BadInputError(f"{where} records an impossible chain: {e}") from None
    return "onnx" if str(path).endswith(".onnx") else "float"


def compress(model: str | os.PathLike[str] | ModelHandle, steps: list[tuple[str, Any]],
             out_dir: str | os.PathLike[str], ctx: StepContext | None = None) -> Path:
    """Apply ``steps`` (name, config or dict) in order and write the artifact folder.

    >>> compress("efficientnet-lite0", [("int8", {"method": "ptq"})], "out/int8")  # doctest: +SKIP
    """
    from edgekit.compress import quality as gate  # deferred: torch (see the imports above)
    from edgekit.sources.models import load_model  # deferred: ONNX, torch

    if not steps:
        raise BadInputError("no compression step given (use --bits, --prune, --distill or a recipe)")
    configs = [(canonical_step(n, where="compress steps"), c) for n, c in steps]
    configs = [(n, c if dataclasses.is_dataclass(c) else make_config(n, c)) for n, c in configs]
    check_order(configs, initial_state(model))
    ctx = ctx or StepContext()
    handle = load_model(model, ctx.inputs, half_storage=all(get_step(n).half_storage for n, _ in configs),
                        loaders=ARTIFACT_LOADERS)
    protect = (model, handle.source, handle.onnx_path, ctx.calib, ctx.train, ctx.eval,
               getattr(ctx.reference, "source", None), getattr(ctx.inputs, "inputs", None))
    # Before hours of work: the folder, and room for the smallest compressed model (4-bit: an eighth).
    check_output_dir(out_dir, protect, expected_bytes=stored_bytes(handle) / 8)
    if ctx.work_dir is None:
        ctx.work_dir = work_folder(out_dir)
    metrics: dict[str, Any] = {}
    bounds = ctx.quality_bounds if ctx.quality_bounds is not None else default_bounds(configs)
    if ctx.quality_reference is None:  # the float model's outputs, before any step (or given: the same base model)
        ctx.quality_reference = gate.measure_reference(handle, ctx)
    reference = ctx.quality_reference
    with StepProgress("compress", total=len(configs), enabled=None if ctx.progress else False) as progress:
        for i, (name, config) in enumerate(configs):  # in a log: a line per step done, and one every 30 s
            progress.phase(f"{name} ({i + 1}/{len(configs)})")
            t0 = time.perf_counter()
            handle = get_step(name).apply(handle, config, ctx)
            handle.quantized = quantized_precision(handle.steps)
            metrics[f"{name}_seconds"] = round(time.perf_counter() - t0, 3)
            progress.update(i + 1)
    metrics.update(ctx.metrics)
    quality = gate.compare(handle, reference)
    broken = gate.check_quality(quality, bounds)
    quality["bounds"] = dataclasses.asdict(bounds) if bounds is not None else None
    quality["passed"] = not broken
    metrics["quality"] = quality
    if handle.steps:  # export checks its graph against the float model with this error as the expectation
        handle.steps[-1].meta = {**(handle.steps[-1].meta or {}), "quality": {
            k: quality[k] for k in ("relative_error", "cosine", "agreement", "perplexity_ratio") if k in quality}}
    if broken and not ctx.accept_quality_loss:
        raise CheckFailedError(f"the compressed model is far from the float model it started from ({quality['data']}): "
                               f"{'; '.join(broken)}; nothing written (accept the loss with --accept-quality-loss, "
                               "or set the bound)")
    with staged_dir(out_dir, protect) as tmp:
        files = save_model_files(handle, tmp)
        inputs = {}
        src = Path(str(model)) if not isinstance(model, ModelHandle) else None
        if src is not None and src.exists():
            inputs["model"] = input_record(src)
        write_manifest(tmp, Manifest(
            kind="model", files=files, source=handle.source, model=handle.describe(),
            steps=[dataclasses.asdict(s) for s in handle.steps], metrics=metrics, inputs=inputs,
            config={"steps": [{"name": n, "config": config_to_dict(c)} for n, c in configs],
                    "calib": ctx.calib, "train": ctx.train, "seed": ctx.seed,
                    "target": getattr(ctx.target, "name", None),
                    **({"input_options": ctx.inputs.to_dict()} if ctx.inputs else {})},
            target=getattr(ctx.target, "name", None)))
    return Path(out_dir)


def save_model_files(handle: ModelHandle, folder: Path) -> dict[str, str]:
    """Write the model's weights (safetensors) or, for ONNX-only models, the graph."""
    files: dict[str, str] = {}
    if handle.module is not None:
        from safetensors.torch import save_model

        try:
            save_model(handle.module, str(folder / "model.safetensors"))
        except Exception as e:  # safetensors' own error type wraps the OS error ("No space left ... (os error 28)")
            raise os_error_from(e, folder / "model.safetensors") from None
        files["weights"] = "model.safetensors"
    if handle.onnx_path is not None and handle.module is None:
        import onnx

        from edgekit.onnx_checks import verify_onnx_runs  # deferred: ONNX Runtime

        model = onnx.load(str(handle.onnx_path))
        large = model.ByteSize() > 2**31 - 2**20
        onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=large,
                        location="model.onnx.data" if large else None)
        verify_onnx_runs(folder / "model.onnx", handle.sample_inputs(1), label=f"the compressed graph of {handle.name}")
        files["onnx"] = "model.onnx"
    return files


def load_compressed(folder: str | os.PathLike[str]) -> ModelHandle:
    """Rebuild a compressed model from its artifact folder (base model + step chain + weights)."""
    from edgekit.export.packing import validate_packed  # deferred: torch
    from edgekit.sources.models import borrow_io, load_model, load_onnx_file  # deferred: ONNX, torch

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.kind != "model":
        raise BadInputError(f"{folder} is a {manifest.kind!r} artifact, not a compressed model")
    if "onnx" in manifest.files and "weights" not in manifest.files:
        handle = load_onnx_file(manifest.path_of(folder, "onnx"), name=manifest.model.get("name"))
        handle.source = manifest.source or handle.source
        handle.steps = _records(manifest.steps)
        handle.step_rewrites = step_rewrite
        handle.kind = manifest.model.get("kind", handle.kind)
        borrow_io(handle, manifest.source)
        handle.quantized = quantized_precision(handle.steps)
        return handle
    if not manifest.source:
        raise BadInputError(f"{folder}/manifest.json names no base model (source)")
    weights = manifest.path_of(folder, "weights")
    check_safetensors(weights)  # bounded header check (sizes and offsets within the file) before any loading
    records = _records(manifest.steps)
    steps = [get_step(record.name) for record in records]
    # a base stored in bfloat16/float16 loads as stored (memory-mapped) where every step takes it so: the
    # layers the steps replace are never read; what is left (norms, biases) is cast to float32 before the
    # compressed weights load into it, so nothing of a float32 weight is rounded to half precision
    half = bool(steps) and all(step.half_storage for step in steps)
    handle = load_model(manifest.source, loaders=ARTIFACT_LOADERS, half_storage=half)
    handle.step_rewrites = step_rewrite
    for record, step in zip(records, steps, strict=True):
        if step.rebuild is not None:
            handle = step.rebuild(handle, make_config(record.name, record.config), record)
        handle.steps.append(record)
    if half and handle.module is not None:
        from edgekit.compress.weight_only.blocks import upcast_half  # deferred: torch (see the imports above)

        upcast_half(handle.module)
    handle.quantized = quantized_precision(handle.steps)
    try:
        from safetensors.torch import load_model as load_st

        missing, unexpected = load_st(handle.module, str(weights), strict=False)
    except Exception as e:
        raise BadInputError(f"{weights} is not a valid checkpoint for {handle.name}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if missing or unexpected:
        raise BadInputError(f"{weights} does not fit the rebuilt model: missing {sorted(missing)[:5]}, "
                            f"unexpected {sorted(unexpected)[:5]}")
    validate_packed(handle.module)  # shapes fit (load checked them); scales finite, zero points in range
    handle.module.eval()
    handle.extra["artifact"] = str(folder)
    return handle


def _records(steps: Sequence[Mapping[str, Any]]) -> list[StepRecord]:
    """A manifest's step records, each under its step's current name: a folder written under an
    old name (``STEP_ALIASES``) loads, reports and exports like one written today."""
    return [StepRecord(**{**rec, "name": canonical_step(rec["name"], where="manifest", warn=False)})
            for rec in steps]


def step_rewrite(name: str) -> Rewrite | None:
    """The ONNX graph rewrite of the step named ``name`` (None: its graph needs none). Handles made
    here carry it (``ModelHandle.step_rewrites``): export, a layer below, applies it."""
    return get_step(name).rewrite_onnx


# ``load_model``'s loader of compressed model folders (manifest kind "model"), for callers in this
# package; the layers above pass ``edgekit.loading``'s, which imports this package only when needed.
ARTIFACT_LOADERS: dict[str, ArtifactLoader] = {"model": load_compressed}
