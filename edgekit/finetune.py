"""``finetune``: LoRA / QLoRA fine-tuning as one call, and ``deploy`` to an engine.

``finetune`` runs the ``"lora"`` compression step (``edgekit.compress.lora``), optionally
followed by a re-quantization step (``weight-only`` GPTQ/AWQ/RTN or ``int8`` PTQ) on the merged
float weights, and writes a model artifact through ``compress()`` (``model.safetensors``
+ manifest), so ``load_compressed`` / ``load_model`` rebuild it. The artifact also holds
``adapter.safetensors`` (the trained ``lora_A`` / ``lora_B`` tensors, before any merge).
After writing, the artifact is reloaded and evaluated with ``edgekit.evaluate`` on the
validation split (perplexity for causal LMs, accuracy for labelled classifiers); the
numbers land in the manifest's ``metrics.lora`` / ``metrics.final``.

Recipes:

* 4-bit LM recovery: ``edgekit compress smollm2-135m --bits 4 -o q4`` then
  ``edgekit finetune q4 --qlora --steps 200 -o q4-lora`` (adapters folded beside the
  packed weights) then ``edgekit export q4-lora -o q4-lora.onnx`` (MatMulNBits + adapter
  MatMuls) and ``edgekit build``.
* INT8 CNN: ``edgekit finetune fmnist-cnn --data fashion-mnist --requant int8 -o cnn-lora-int8``:
  LoRA on the float model, merged, then PTQ again (the adapters change the weight
  ranges, so the INT8 scales must be recalibrated after merging anyway, and the INT8 step's
  fake-quant wrappers would bypass adapters placed inside them).

>>> finetune("fmnist-cnn", "fashion-mnist", {"r": 4, "steps": 100}, "out/cnn-lora")  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from edgekit.artifact import atomic_write_bytes, read_manifest, staged_dir, work_folder, write_manifest
from edgekit.build import build_engine
from edgekit.compress import LORA_STEP, StepContext, canonical_step, compress, load_compressed, make_config
from edgekit.compress.lora import LoadedData, LoraConfig
from edgekit.errors import BadInputError, bad_choice
from edgekit.evaluate import evaluate
from edgekit.export.onnx import ExportConfig
from edgekit.finetune_options import REQUANT_STEPS
from edgekit.loading import export_onnx, load_model
from edgekit.runtimes.base import BuildOptions
from edgekit.sources.data import Samples, resolve_samples
from edgekit.sources.handle import ModelHandle


def _config(config: LoraConfig | dict[str, Any] | None) -> LoraConfig:
    if config is None:
        return LoraConfig()
    if isinstance(config, LoraConfig):
        return config
    if isinstance(config, dict):
        made = make_config(LORA_STEP, config)
        assert isinstance(made, LoraConfig)
        return made
    raise BadInputError(f"finetune config must be a LoraConfig or a dict, got {type(config).__name__}")


def finetune(model: str | os.PathLike[str] | ModelHandle, data: str | os.PathLike[str] | Samples | None,
             config: LoraConfig | dict[str, Any] | None, out_dir: str | os.PathLike[str], *,
             eval_data: str | os.PathLike[str] | Samples | None = None, requant: str | None = None,
             requant_config: dict[str, Any] | None = None, seed: int = 0, resume: bool = True, progress: bool = True,
             final_eval: bool = True) -> Path:
    """Fine-tune ``model`` with LoRA (or QLoRA) on ``data`` and write the artifact to ``out_dir``.

    model: zoo name, file, entry point, artifact folder (e.g. ``compress --bits 4`` output
        for QLoRA) or a ModelHandle. data / eval_data: data specs (``load_samples``) or
        ``Samples``; None = the model's default train / eval data.
    config: ``LoraConfig`` or a dict of its fields. requant: "weight-only" or "int8" to
        re-quantize the merged float model, with ``requant_config`` (that step's fields).
    resume: continue from the checkpoint in ``<out_dir>.work`` when it matches this run.

    >>> finetune("smollm2-135m-q4/", None, {"qlora": True, "steps": 200}, "out/q4-lora")  # doctest: +SKIP
    PosixPath('out/q4-lora')
    """
    cfg = _config(config)
    steps: list[tuple[str, Any]] = [(LORA_STEP, cfg)]
    if requant is not None:
        requant = canonical_step(requant, where="requant")
        if requant not in REQUANT_STEPS:
            raise bad_choice("re-quantization step", requant, REQUANT_STEPS)
        if cfg.merge is False:
            raise BadInputError(f"--requant {requant} re-quantizes merged weights; drop --no-merge")
        if cfg.qlora and cfg.qlora_base == "packed":
            raise BadInputError(f"--requant {requant}: a QLoRA model over packed 4-bit weights is already quantized "
                                "(merge re-rounds onto its grid); use --qlora-base nf4 to merge to float first")
        steps.append((requant, dict(requant_config or {})))
    handle = load_model(model)
    out = Path(out_dir)
    if eval_data is None and isinstance(data, (str, os.PathLike)):
        eval_data = data  # its eval split: never overlaps the train split
    with staged_dir(out, (model, handle.source, handle.onnx_path, data, eval_data)) as staging:
        _finetune_into(staging, handle, steps, cfg, data, eval_data, seed, work_folder(out), resume, progress,
                       final_eval)
    with_work = work_folder(out)
    if with_work.is_dir() and not any(with_work.iterdir()):
        with_work.rmdir()
    return out


def _finetune_into(folder: Path, handle: ModelHandle, steps: list[tuple[str, Any]], cfg: LoraConfig, data: Any,
                   eval_data: Any, seed: int, work_dir: Path, resume: bool, progress: bool, final_eval: bool) -> None:
    """Train, compress and write the artifact into ``folder`` (a staging folder: the
    output appears complete, adapter and final metrics included, or not at all)."""
    train = resolve_samples(data, handle, "train", cfg.train_samples, cfg.seqlen, seed)
    val = resolve_samples(eval_data, handle, "eval", cfg.eval_samples, cfg.seqlen, seed)
    ctx = StepContext(train=LoadedData(train, _spec(data)), eval=LoadedData(val, _spec(eval_data)), seed=seed,
                      progress=progress, work_dir=work_dir)
    ctx.resume = resume  # type: ignore[attr-defined]  # read by the lora step's training loop
    work_dir.mkdir(parents=True, exist_ok=True)
    compress(handle, steps, folder, ctx)
    adapter = handle.extra.pop("lora_adapter", None)
    manifest = read_manifest(folder)
    if adapter:
        from safetensors.torch import save

        atomic_write_bytes(folder / "adapter.safetensors", save(adapter))
        manifest.files["adapter"] = "adapter.safetensors"
    manifest.config[LORA_STEP] = dataclasses.asdict(cfg)
    manifest.config["train"] = getattr(train, "source", None)
    manifest.config["eval"] = getattr(val, "source", None)
    if final_eval:
        reloaded = load_compressed(folder)
        manifest.metrics["final"] = final_metrics(reloaded, val)
    write_manifest(folder, manifest)


def _spec(data: str | os.PathLike[str] | Samples | None) -> str | None:
    return str(data) if isinstance(data, (str, os.PathLike)) else None


def final_metrics(handle: ModelHandle, samples: Samples) -> dict[str, Any]:
    """The task metric of a (reloaded) model on ``samples`` via ``edgekit.evaluate``."""
    if not isinstance(samples, Samples):
        samples = Samples(getattr(samples, "source", "data"), "eval", dict(samples.inputs),
                          getattr(samples, "labels", None), meta=dict(getattr(samples, "meta", {}) or {}))
    if handle.kind == "causal-lm":
        samples.meta.setdefault("kind", "token-windows")
        return evaluate(handle, samples, evaluator="perplexity", progress=False)
    if samples.labels is not None:
        return evaluate(handle, samples, evaluator="accuracy", progress=False)
    return {}


def deploy(model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], target: str = "cpu", *,
           atol: float = 1e-4, rtol: float = 1e-3) -> dict[str, Any]:
    """Export a fine-tuned artifact to ONNX (parity-checked against PyTorch) and build an
    engine for ``target`` through the spine. Returns the paths and the parity metrics.

    >>> deploy("out/q4-lora", "out/q4-lora-deploy")  # doctest: +SKIP
    """

    out = Path(out_dir)
    onnx_dir = export_onnx(model_dir, out / "onnx", ExportConfig(atol=atol, rtol=rtol))
    engine_dir = build_engine(onnx_dir, target, out / "engine", BuildOptions())
    onnx_m = read_manifest(onnx_dir)
    return {"onnx": str(onnx_dir), "engine": str(engine_dir), "parity": onnx_m.metrics.get("parity"),
            "engine_metrics": read_manifest(engine_dir).metrics}


__all__ = ["REQUANT_STEPS", "deploy", "final_metrics", "finetune"]
