"""Half-precision weights: the float32 weights of linear, convolution and embedding layers
stored as float16 or bfloat16 (half the bytes), normalization layers and everything else
left in float32.

Each cast layer computes in its storage type, as a half-precision engine runs it: its
floating inputs are cast down on the way in and its output back to float32 on the way out
(forward hooks, so the module tree and the state-dict keys stay as they were). Norms,
softmax and the residual stream stay float32, where fp16 would lose the small differences
a norm divides by. fp16 keeps 11 significant bits in a range of +-65504 (a weight beyond it
stops the step: use bf16); bf16 keeps float32's range with 8 significant bits.

>>> from torch import nn
>>> from edgekit.sources.handle import InputSpec, ModelHandle
>>> h = ModelHandle(name="mlp", source="doc", kind="generic", module=nn.Sequential(nn.Linear(4, 2)),
...                 inputs=[InputSpec("x", ("batch", 4), "float32")], outputs=["y"])
>>> apply(h, HalfConfig("bf16")).module[0].weight.dtype
torch.bfloat16
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgekit.compress import Step, StepContext, config_to_dict, step_rewrite
from edgekit.compress.half_config import HalfConfig
from edgekit.compress.quality import BOUNDS_HALF
from edgekit.errors import BadInputError
from edgekit.sources.handle import ModelHandle, StepRecord

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # HalfConfig.dtype -> storage type
CAST = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)  # the layers whose weights are stored in half


def _inputs_down(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    dtype = module.get_parameter("weight").dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _output_up(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    return out.float() if isinstance(out, torch.Tensor) and out.is_floating_point() else out


def cast_layer(layer: nn.Module, dtype: torch.dtype) -> None:
    """Store ``layer``'s parameters in ``dtype``; it computes in it, between float32 neighbours."""
    layer.to(dtype)
    layer.register_forward_pre_hook(_inputs_down)
    layer.register_forward_hook(_output_up)


def half_layers(module: nn.Module) -> list[str]:
    """The names of the layers the step casts: linear, conv and embedding layers with float32 weights."""
    return [name for name, m in module.named_modules()
            if isinstance(m, CAST) and getattr(m, "weight", None) is not None and m.weight.dtype == torch.float32]


def apply(handle: ModelHandle, config: HalfConfig, ctx: StepContext | None = None) -> ModelHandle:
    """Cast the weights of ``handle``'s linear, conv and embedding layers to ``config.dtype``
    in place; record the layers, the bytes before and after and the weights' largest
    relative rounding error."""
    if handle.module is None:
        raise BadInputError(f"half-precision weights need a PyTorch model; {handle.name} is ONNX only")
    dtype = DTYPES[config.dtype]
    names = half_layers(handle.module)
    if not names:
        raise BadInputError(f"{handle.name} has no float32 linear, convolution or embedding layer to store in "
                            f"{config.dtype}")
    limit, size = torch.finfo(dtype).max, torch.finfo(dtype).bits // 8
    before = after = 0
    worst = 0.0
    for name in names:
        layer = handle.module.get_submodule(name)
        for pname, p in layer.named_parameters(recurse=False):
            peak = float(p.detach().abs().max()) if p.numel() else 0.0
            if peak > limit:
                raise BadInputError(f"{name}.{pname} holds {peak:.4g}, beyond {config.dtype}'s range (+-{limit:.6g}); "
                                    "use bf16")
            rounded = p.detach().to(dtype).float()
            if peak > 0:
                worst = max(worst, float((rounded - p.detach()).abs().max()) / peak)
            before += p.numel() * p.element_size()
            after += p.numel() * size
        cast_layer(layer, dtype)
    summary = {"dtype": config.dtype, "layers": len(names), "weight_bytes_before": before, "weight_bytes_after": after,
               "max_weight_rel_error": worst}
    handle.steps.append(StepRecord("half", config_to_dict(config), {"layers": names}))
    handle.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    if ctx is not None:
        ctx.metrics["half"] = summary
    return handle


def rebuild(handle: ModelHandle, config: HalfConfig, record: StepRecord) -> ModelHandle:
    """Cast the recorded layers of a freshly loaded base model, so the saved half weights load."""
    if handle.module is None:
        raise BadInputError(f"half-precision weights need a PyTorch model; {handle.name} is ONNX only")
    layers = (record.meta or {}).get("layers")
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise BadInputError("the half step's record names no layers (meta.layers)")
    for name in layers:
        try:
            layer = handle.module.get_submodule(name)
        except AttributeError:
            raise BadInputError(f"the half step's record names layer {name!r}, which the model does not have") from None
        cast_layer(layer, DTYPES[config.dtype])
    return handle


STEP = Step("half", HalfConfig, apply, "float16 / bfloat16 storage of linear, conv and embedding weights",
            rebuild=rebuild, transitions={"float": "float"}, bounds=lambda config: BOUNDS_HALF)
