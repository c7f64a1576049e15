"""Adapters in a model: inject, read, load, merge and count them.

float and NF4 bases get peft's LoRA layers (``peft.inject_adapter_in_model``); a packed
base gets ``LoraQuantLinear`` (``packed.py``). Either way the trainable tensors are named
``...lora_A...`` / ``...lora_B...`` in the state dict, which is what ``adapter_state``
saves and ``load_adapter`` checks.

peft is imported where adapters are injected or found, not at the top: it imports
transformers and bitsandbytes (seconds), which looking the step up (recipes, ``--help``)
should not pay.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn

from edgekit.compress.families import is_conv1d
from edgekit.compress.lora.config import LoraConfig
from edgekit.compress.lora.nf4 import dequantize_nf4, is_nf4
from edgekit.compress.lora.packed import LoraQuantLinear, repack
from edgekit.compress.weight_only.packing import QuantLinear
from edgekit.errors import BadInputError
from edgekit.sources.handle import ModelHandle

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer


def inject(handle: ModelHandle, config: LoraConfig, names: list[str], base: str) -> None:
    """Add adapters to ``names`` in place; freeze everything else."""
    module = handle.module
    for p in module.parameters():
        p.requires_grad_(False)
    if base == "packed":
        for n in names:
            module.set_submodule(n, LoraQuantLinear(module.get_submodule(n), config.r, config.alpha, config.dropout))
    else:
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model

        pattern = "^(" + "|".join(re.escape(n) for n in names) + ")$"
        # transformers' Conv1D (GPT-2) stores its weight (in, out): peft's fan_in_fan_out
        conv1d = bool(names) and all(is_conv1d(module.get_submodule(n)) for n in names)
        # peft annotates lora_alpha as int; it scales by alpha / r in float, so a float alpha is kept
        peft_config = PeftLoraConfig(r=config.r, lora_alpha=config.alpha,  # type: ignore[arg-type]
                                     lora_dropout=config.dropout, target_modules=pattern, bias="none",
                                     fan_in_fan_out=conv1d)
        try:
            inject_adapter_in_model(peft_config, module)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise BadInputError(f"peft cannot adapt the chosen modules of {handle.name!r}: "
                                f"{str(e).splitlines()[0]}") from None
    for n, p in module.named_parameters():
        p.requires_grad_(is_adapter_key(n))
    if not any(p.requires_grad for p in module.parameters()):  # pragma: no cover - guarded above
        raise BadInputError(f"no LoRA parameters were created in {handle.name!r}")


def is_adapter_key(name: str) -> bool:
    """A state-dict or parameter name of an adapter tensor (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors (``lora_A`` / ``lora_B``) by state-dict name, detached copies."""
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items() if is_adapter_key(k)}


def load_adapter(handle: ModelHandle, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (``adapter_state`` names) into an injected model; BadInputError
    when they do not fit it (a module it lacks, or a shape for another rank/size)."""
    own = handle.module.state_dict()
    for k, v in tensors.items():
        if k not in own:
            layer = k.split(".lora_")[0]
            raise BadInputError(f"adapter does not fit {handle.name!r}: it has no LoRA layer {layer!r}")
        if tuple(own[k].shape) != tuple(v.shape):
            raise BadInputError(f"adapter does not fit {handle.name!r}: {k} is {tuple(v.shape)} in the adapter "
                                f"but {tuple(own[k].shape)} in the model (another rank or base model?)")
    missing = sorted(k for k in own if is_adapter_key(k) and k not in tensors)
    if missing:
        raise BadInputError(f"adapter does not fit {handle.name!r}: it lacks {missing[0]} "
                            f"(and {len(missing) - 1} more)")
    handle.module.load_state_dict(tensors, strict=False)


def lora_layers(module: nn.Module) -> list[tuple[str, LoraLayer | LoraQuantLinear]]:
    """(name, layer) of every adapter layer: peft's ``LoraLayer`` or ``LoraQuantLinear``."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in module.named_modules() if isinstance(m, (LoraLayer, LoraQuantLinear))]


def merge_adapters(handle: ModelHandle) -> dict[str, float]:
    """Fold every adapter into its base weight and remove the adapter layers.

    float (peft): ``W += B A * s``; nf4: dequantize, add, back to a float ``nn.Linear``;
    packed: dequantize, add, re-round onto the layer's own grid (``repack``).
    Returns statistics (layers, mean relative size of the update, share of it lost by
    re-rounding for packed layers).
    """
    module = handle.module
    stats: dict[str, float] = {"layers": 0}
    lost: list[float] = []
    rel: list[float] = []
    with torch.no_grad():
        for name, layer in lora_layers(module):
            merged: nn.Module
            if isinstance(layer, LoraQuantLinear):
                base = layer.base_layer
                w = base.dequantize().float()
                delta = layer.delta_weight().float()
                rel.append(_relative(delta, w))
                repack(base, w + delta)
                got = base.dequantize().float() - w
                lost.append(_relative(got - delta, delta))
                merged = base
            elif is_nf4(layer.get_base_layer()):
                nf4 = layer.get_base_layer()
                w = dequantize_nf4(nf4)
                delta = _peft_delta(layer).float()
                rel.append(_relative(delta, w))
                merged = _float_linear(w + delta, None if nf4.bias is None else _tensor(nf4.bias))
            else:
                delta = _peft_delta(layer)
                rel.append(_relative(delta, _tensor(layer.get_base_layer().weight)))
                layer.merge(safe_merge=True)
                merged = layer.get_base_layer()
            module.set_submodule(name, merged)
            stats["layers"] += 1
    for p in module.parameters():
        p.requires_grad_(False)
    if rel:
        stats["mean_relative_update"] = float(np.mean(rel))
    if lost:
        stats["repack_lost_fraction"] = float(np.mean(lost))
    return stats


def _peft_delta(layer: object) -> torch.Tensor:
    """The ``B A * s`` update of peft's default adapter (its lora.Linear defines get_delta_weight)."""
    delta: torch.Tensor = cast(Any, layer).get_delta_weight("default")
    return delta


def _tensor(value: torch.Tensor | nn.Module) -> torch.Tensor:
    """A layer's weight or bias as the tensor it is (nn.Module's attribute type is a union)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(value).__name__}")
    return value


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a|| / ||b||."""
    return float(a.norm() / b.norm().clamp(min=1e-12))


def _float_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    lin.weight.copy_(weight)
    if bias is not None:
        lin.bias.copy_(bias.float())
    return lin


def trainable_parameters(module: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; packed int4 buffers count as their weights'."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    for m in module.modules():
        if isinstance(m, QuantLinear):
            total += int(m.in_features) * int(m.out_features)
    return trainable, total
