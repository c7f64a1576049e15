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
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.runtimes.onnxruntime import verify_onnx_runs
from edgekit.sources.handle import ModelHandle, StepRecord

# name -> "module:attribute" of its Step. Order here is the order `edgekit compress` applies
# steps named by flags: structure first (prune, distill), then fine-tune, then quantize.
STEPS: dict[str, str] = {
    "prune": "edgekit.compress.prune:STEP",
    "distill": "edgekit.compress.distill:STEP",
    "lora": "edgekit.compress.lora:STEP",
    "int8": "edgekit.compress.int8:STEP",
    "int4": "edgekit.compress.weight_only:STEP",
}


@dataclass
class StepContext:
    """What a step may need beyond its config.

    calib / train / eval: data specs (see ``edgekit.sources.data``); None means the
    model's defaults. reference: the model before this chain (FP32 reference, teacher).
    work_dir: a folder that survives interruption, for checkpoints and resume.
    """

    target: Any = None  # edgekit.targets.Target
    calib: str | None = None
    train: str | None = None
    eval: str | None = None
    device: str = "cpu"
    seed: int = 0
    work_dir: Path | None = None
    progress: bool = True
    reference: ModelHandle | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # steps add what they measured


@dataclass(frozen=True)
class Step:
    """One registered technique.

    apply: does the work on a handle and returns the compressed handle, appending a
        ``StepRecord(name, asdict(config), meta)`` to ``handle.steps``.
    rebuild: given a freshly loaded base handle (after earlier steps' rebuilds) and the
        step's record, recreate the changed structure with placeholder weights so the
        saved state dict loads strictly (``load_compressed`` appends the record to
        ``handle.steps`` afterwards). None when the step does not change structure.
    rewrite_onnx: optional post-export graph rewrite (e.g. packed int4 linears to
        MatMulNBits), called by ``export_onnx`` with (onnx.ModelProto, handle, record).
    needs_float: the step needs floating-point weights (so cannot follow packing).
    output: "float" | "fake-quant" | "packed" | "onnx": what the model is afterwards.
    """

    name: str
    config: type
    apply: Callable[[ModelHandle, Any, StepContext], ModelHandle]
    description: str
    rebuild: Callable[[ModelHandle, Any, StepRecord], ModelHandle] | None = None
    rewrite_onnx: Callable[[Any, ModelHandle, StepRecord], Any] | None = None
    needs_float: bool = True
    output: str = "float"


def get_step(name: str) -> Step:
    if name not in STEPS:
        raise bad_choice("compression step", name, STEPS)
    mod, attr = STEPS[name].split(":")
    return getattr(importlib.import_module(mod), attr)


def make_config(name: str, values: dict[str, Any] | None = None) -> Any:
    """Build a step's config from a plain dict, rejecting unknown keys."""
    step = get_step(name)
    values = dict(values or {})
    known = {f.name for f in dataclasses.fields(step.config)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise BadInputError(f"step {name!r} has no option(s) {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(known))})")
    return step.config(**values)


def config_to_dict(config: Any) -> dict[str, Any]:
    out = dataclasses.asdict(config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def check_order(names: list[str]) -> None:
    """Reject chains that need float weights after a step that removed them."""
    packed_at = None
    for i, name in enumerate(names):
        step = get_step(name)
        if packed_at is not None and step.needs_float:
            raise BadInputError(f"step {name!r} needs floating-point weights but comes after "
                                f"{names[packed_at]!r}, which packs them; put {name!r} first")
        if step.output in ("packed", "onnx"):
            packed_at = i


def compress(model: str | os.PathLike[str] | ModelHandle, steps: list[tuple[str, Any]],
             out_dir: str | os.PathLike[str], ctx: StepContext | None = None) -> Path:
    """Apply ``steps`` (name, config or dict) in order and write the artifact folder.

    >>> compress("efficientnet-lite0", [("int8", {"method": "ptq"})], "out/int8")  # doctest: +SKIP
    """
    from edgekit.artifact import Manifest, input_record, staged_dir, write_manifest
    from edgekit.sources.models import load_model

    if not steps:
        raise BadInputError("no compression step given (use --bits, --prune, --distill or a recipe)")
    configs = [(n, c if dataclasses.is_dataclass(c) else make_config(n, c)) for n, c in steps]
    check_order([n for n, _ in configs])
    ctx = ctx or StepContext()
    handle = load_model(model)
    if ctx.work_dir is None:
        ctx.work_dir = Path(f"{os.fspath(out_dir)}.work")
    metrics: dict[str, Any] = {}
    for name, config in configs:
        t0 = time.perf_counter()
        handle = get_step(name).apply(handle, config, ctx)
        metrics[f"{name}_seconds"] = round(time.perf_counter() - t0, 3)
    metrics.update(ctx.metrics)
    with staged_dir(out_dir) as tmp:
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
                    "target": getattr(ctx.target, "name", None)},
            target=getattr(ctx.target, "name", None)))
    return Path(out_dir)


def save_model_files(handle: ModelHandle, folder: Path) -> dict[str, str]:
    """Write the model's weights (safetensors) or, for ONNX-only models, the graph."""
    files: dict[str, str] = {}
    if handle.module is not None:
        from safetensors.torch import save_model

        save_model(handle.module, str(folder / "model.safetensors"))
        files["weights"] = "model.safetensors"
    if handle.onnx_path is not None and handle.module is None:
        import onnx

        model = onnx.load(str(handle.onnx_path))
        large = model.ByteSize() > 2**31 - 2**20
        onnx.save_model(model, str(folder / "model.onnx"), save_as_external_data=large,
                        location="model.onnx.data" if large else None)
        verify_onnx_runs(folder / "model.onnx", handle.sample_inputs(1), label=f"the compressed graph of {handle.name}")
        files["onnx"] = "model.onnx"
    return files


def load_compressed(folder: str | os.PathLike[str]) -> ModelHandle:
    """Rebuild a compressed model from its artifact folder (base model + step chain + weights)."""
    from edgekit.artifact import read_manifest
    from edgekit.sources.models import load_model, load_onnx_file

    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.kind != "model":
        raise BadInputError(f"{folder} is a {manifest.kind!r} artifact, not a compressed model")
    if "onnx" in manifest.files and "weights" not in manifest.files:
        handle = load_onnx_file(manifest.path_of(folder, "onnx"), name=manifest.model.get("name"))
        handle.source = manifest.source or handle.source
        handle.steps = [StepRecord(**s) for s in manifest.steps]
        handle.kind = manifest.model.get("kind", handle.kind)
        from edgekit.sources.models import borrow_io

        borrow_io(handle, manifest.source)
        return handle
    if not manifest.source:
        raise BadInputError(f"{folder}/manifest.json names no base model (source)")
    handle = load_model(manifest.source)
    for rec in manifest.steps:
        record = StepRecord(**rec)
        step = get_step(record.name)
        if step.rebuild is not None:
            handle = step.rebuild(handle, make_config(record.name, record.config), record)
        handle.steps.append(record)
    weights = manifest.path_of(folder, "weights")
    try:
        from safetensors.torch import load_model as load_st

        missing, unexpected = load_st(handle.module, str(weights), strict=False)
    except Exception as e:
        raise BadInputError(f"{weights} is not a valid checkpoint for {handle.name}: "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if missing or unexpected:
        raise BadInputError(f"{weights} does not fit the rebuilt model: missing {sorted(missing)[:5]}, "
                            f"unexpected {sorted(unexpected)[:5]}")
    from edgekit.compress.weight_only import validate_packed

    validate_packed(handle.module)  # shapes fit (load checked them); scales finite, zero points in range
    handle.module.eval()
    handle.extra["artifact"] = str(folder)
    return handle
