"""The packed low-bit layers and their layout, as the compression steps use them.

The layout and the modules live in ``edgekit.export.packing`` (the ONNX writers read it, and export
sits below compress); this module re-exports them under their established names and adds
``quantize_linear`` (round-to-nearest packing of a float ``nn.Linear``).

>>> layer = quantize_linear(nn.Linear(256, 64), bits=4, group_size=128)  # doctest: +SKIP
>>> layer(torch.randn(2, 256)).shape  # doctest: +SKIP
torch.Size([2, 64])
"""
from __future__ import annotations

from torch import nn

from edgekit.compress.weight_only.rtn import rtn_quantize
from edgekit.export.packing import (
    SUPPORTED_BITS,
    QuantEmbedding,
    QuantLinear,
    ScaledEmbedding,
    group_width,
    num_groups,
    pack_codes,
    packed_bytes,
    packed_width,
    storage_bits,
    unpack_codes,
)


def quantize_linear(linear: nn.Linear, bits: int = 4, group_size: int = 128, sym: bool = False) -> QuantLinear:
    """Round-to-nearest quantize a float ``nn.Linear`` into a ``QuantLinear``."""
    q, s, z = rtn_quantize(linear.weight.detach(), bits, group_size, sym)
    return QuantLinear.from_quantized(q, s, z, bits, group_size, linear.bias)


__all__ = ["SUPPORTED_BITS", "QuantEmbedding", "QuantLinear", "ScaledEmbedding", "group_width", "num_groups",
           "pack_codes", "packed_bytes", "packed_width", "quantize_linear", "storage_bits", "unpack_codes"]
