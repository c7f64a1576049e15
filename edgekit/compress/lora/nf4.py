"""QLoRA as the paper does it: a float model quantized to bitsandbytes NF4, adapters through peft.

``to_nf4`` replaces float ``nn.Linear`` layers by bitsandbytes ``Linear4bit`` (NF4, CPU
works); peft's bitsandbytes LoRA layers then wrap them. bitsandbytes layers do not save
or export, so an NF4 base always ends merged into float weights (dequantized NF4 + B A,
``adapters.merge_adapters``), to be re-quantized by the next step if wanted. bitsandbytes
repacks CPU weights for its fast inference kernel after a no-grad forward in eval mode,
which breaks training and dequantization; the layers made here turn that repacking off.
bitsandbytes is optional (``pip install edgekit[qlora]``) and slow to import: it is
imported only when NF4 is asked for.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgekit.errors import UnavailableError
from edgekit.sources.handle import ModelHandle


def is_nf4(module: nn.Module) -> bool:
    """A bitsandbytes 4-bit linear (checked without importing bitsandbytes)."""
    cls = type(module)
    return (cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes")
            and hasattr(getattr(module, "weight", None), "quant_state"))


def to_nf4(handle: ModelHandle, names: list[str]) -> int:
    """Replace the named float ``nn.Linear`` layers by bitsandbytes NF4 ``Linear4bit`` (CPU);
    returns how many were replaced."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # not installed, or a broken native library: said in the message
        raise UnavailableError(f"--qlora-base nf4 needs bitsandbytes (pip install bitsandbytes): {e}") from None
    module = handle.module
    n = 0
    for name in names:
        lin = module.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            continue
        q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                              compute_dtype=torch.float32, quant_type="nf4")
        weight = bnb.nn.Params4bit(lin.weight.data.float().contiguous(), requires_grad=False,
                                   quant_type="nf4")._quantize("cpu")
        weight.module = q
        q.weight = weight
        if lin.bias is not None:
            q.bias = nn.Parameter(lin.bias.data.float(), requires_grad=False)
        # Its CPU inference repack (after a no-grad eval forward) breaks training and
        # dequantization: keep the plain NF4 layout.
        q.support_avx512bf16_for_cpu = False
        module.set_submodule(name, q)
        n += 1
    return n


def dequantize_nf4(layer: nn.Module) -> torch.Tensor:
    """The float (out, in) weight of a bitsandbytes NF4 layer."""
    import bitsandbytes.functional as bnbf

    weight: Any = layer.weight  # a bitsandbytes Params4bit: the packed data and its quantization state
    return bnbf.dequantize_4bit(weight.data, weight.quant_state).float()

