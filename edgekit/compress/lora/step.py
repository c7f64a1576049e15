"""The ``lora`` compression step: train adapters, then merge them or keep them beside the base."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgekit.artifact import sha256_json
from edgekit.compress import Step, StepContext, config_to_dict, step_rewrite
from edgekit.compress.families import is_conv1d
from edgekit.compress.lora.adapters import adapter_state, inject, merge_adapters, trainable_parameters
from edgekit.compress.lora.config import LoraConfig
from edgekit.compress.lora.nf4 import to_nf4
from edgekit.compress.lora.targets import base_kind, candidate_modules, is_head, resolve_targets
from edgekit.compress.lora.train import train_adapters
from edgekit.errors import BadInputError
from edgekit.evaluate import evaluate_loss, sample_count
from edgekit.sources.data import Samples, resolve_samples
from edgekit.sources.handle import ModelHandle, StepRecord


class LoadedData(str):
    """Samples already loaded, passed through ``StepContext.train`` / ``.eval`` so the lora
    step does not load them again. It *is* the data spec string (``"fashion-mnist"``), so
    later steps of the chain (``int8``, ``weight-only``) and manifests see the plain spec."""

    samples: Samples

    def __new__(cls, samples: Samples, spec: str | None = None) -> LoadedData:
        obj = super().__new__(cls, spec if spec is not None else str(getattr(samples, "source", "data")))
        obj.samples = samples
        return obj


def apply(handle: ModelHandle, config: LoraConfig, ctx: StepContext) -> ModelHandle:
    """Train adapters on ``ctx.train`` (validated on ``ctx.eval``), then merge or keep them."""
    if handle.module is None:
        raise BadInputError(f"{handle.name!r} is an ONNX-only model; LoRA needs the PyTorch model")
    base = _check_base(handle, config)
    torch.manual_seed(ctx.seed)
    names = resolve_targets(handle, config.targets, base)
    train = resolve_samples(ctx.train, handle, "train", config.train_samples, config.seqlen, ctx.seed)
    val = resolve_samples(ctx.eval, handle, "eval", config.eval_samples, config.seqlen, ctx.seed)
    if sample_count(train) < config.batch_size:
        raise BadInputError(f"training data has {sample_count(train)} sample(s), fewer than one batch of "
                            f"{config.batch_size}; give more data or a smaller --batch-size")
    if sample_count(val) == 0:
        raise BadInputError("validation data is empty; give --eval-data")
    metrics: dict[str, Any] = {"modules": len(names), "base": base if not config.qlora else config.qlora_base}
    vb = min(config.batch_size, 8)
    if config.qlora and config.qlora_base == "nf4":
        linears = [n for n in candidate_modules(handle, "float")
                   if isinstance(handle.module.get_submodule(n), nn.Linear) and not is_head(n, handle)]
        metrics["nf4_layers"] = to_nf4(handle, linears)
        base = "nf4"
    metrics["before"] = evaluate_loss(handle, val, vb, config.eval_samples)
    inject(handle, config, names, base)
    trainable, total = trainable_parameters(handle.module)
    metrics.update(trainable_params=trainable, total_params=total,
                   trainable_share=round(trainable / max(total, 1), 6))
    data_name = str(getattr(train, "source", ctx.train))
    fingerprint = sha256_json({"config": config_to_dict(config), "source": handle.source,
                               "steps": [s.name for s in handle.steps], "modules": names, "seed": ctx.seed,
                               "data": data_name})
    metrics.update(train_adapters(handle, config, train, seed=ctx.seed, work_dir=ctx.work_dir,
                                  fingerprint=fingerprint, resume=getattr(ctx, "resume", True),
                                  progress=ctx.progress))
    metrics["after"] = evaluate_loss(handle, val, vb, config.eval_samples)
    handle.extra["lora_adapter"] = adapter_state(handle.module)
    merge = config.merge if config.merge is not None else base != "packed"
    if merge:
        metrics["merge"] = merge_adapters(handle)
        metrics["after_merge"] = evaluate_loss(handle, val, vb, config.eval_samples)
    metrics["train_data"] = data_name
    metrics["eval_data"] = str(getattr(val, "source", ctx.eval))
    handle.module.eval()
    ctx.metrics["lora"] = {k: v for k, v in metrics.items() if k != "loss_history"}
    ctx.metrics["lora_loss_history"] = metrics.get("loss_history", [])
    handle.steps.append(StepRecord("lora", config_to_dict(config), {
        "modules": names, "merged": bool(merge), "base": base, "r": config.r, "alpha": config.alpha,
        "trainable_params": trainable}))
    handle.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    return handle


def _check_base(handle: ModelHandle, config: LoraConfig) -> str:
    """The base's kind, once it is one this config can train over."""
    for s in handle.steps:
        if s.name == "int8":
            raise BadInputError(
                "LoRA over an INT8 fake-quant model is not supported: fine-tune the float model and re-quantize "
                "(edgekit finetune MODEL --requant int8), so PTQ recalibrates the merged weights")
        if s.name == "lora" and not s.meta.get("merged", True):
            raise BadInputError("this model already carries unmerged LoRA adapters; merge them first (--merge)")
    base = base_kind(handle.module)
    if config.qlora:
        if config.qlora_base == "packed" and base != "packed":
            raise BadInputError(f"--qlora trains over edgekit's packed 4-bit model, but {handle.name!r} is {base}: "
                                "run `edgekit compress MODEL --bits 4 -o Q` and fine-tune Q, "
                                "or use --qlora-base nf4 (bitsandbytes) on the float model")
        if config.qlora_base == "nf4" and base != "float":
            raise BadInputError(f"--qlora-base nf4 quantizes a float model itself; {handle.name!r} is already {base}")
        if config.qlora_base == "nf4" and any(is_conv1d(m) for m in handle.module.modules()):
            raise BadInputError(f"--qlora-base nf4 quantizes nn.Linear layers, but {handle.name!r} computes its "
                                "projections with transformers' Conv1D (GPT-2); use plain LoRA, or --qlora over "
                                "the packed 4-bit model (compress --bits 4 first)")
    elif base == "packed":
        raise BadInputError(f"{handle.name!r} has packed 4-bit weights: add --qlora to train adapters over them")
    return base


def rebuild(handle: ModelHandle, config: LoraConfig, record: StepRecord) -> ModelHandle:
    """Recreate the adapter layers (unmerged) so the saved weights load strictly. A merged
    record changed no structure (float, or packed re-rounded in place); nf4 merges to float
    ``nn.Linear`` layers of the same names and shapes as the base's."""
    if record.meta.get("merged", True):
        return handle
    names = list(record.meta.get("modules") or [])
    present = {n for n, _ in handle.module.named_modules()}
    lacking = [n for n in names if n not in present]
    if lacking:
        raise BadInputError(f"adapters do not fit {handle.name!r}: it has no module {lacking[0]!r} "
                            f"(and {len(lacking) - 1} more); was the adapter trained on another model?")
    base = record.meta.get("base", "float")
    if base == "packed" and base_kind(handle.module) != "packed":
        raise BadInputError(f"adapters were trained over packed 4-bit layers but {handle.name!r} has none")
    inject(handle, config, names, "packed" if base == "packed" else "float")
    handle.module.eval()
    return handle


def weight_transitions(config: LoraConfig) -> tuple[dict[str, str], str]:
    """What LoRA takes with these options: plain LoRA and NF4 QLoRA a float model (merged
    back to float), packed QLoRA edgekit's packed 4-bit model (adapters beside the codes)."""
    if config.qlora and config.qlora_base == "packed":
        return {"packed": "packed"}, "qlora over packed weights"
    if config.qlora:
        return {"float": "float"}, "qlora_base nf4 quantizes float weights itself"
    return {"float": "float"}, "plain LoRA; qlora: true trains over packed weights"


STEP = Step(
    name="lora",
    config=LoraConfig,
    apply=apply,
    rebuild=rebuild,
    description="LoRA / QLoRA fine-tuning (peft on float models; adapters over packed 4-bit or NF4 bases)",
    transitions={"float": "float", "packed": "packed"},
    narrow=weight_transitions,
    deliberate=True,
)
