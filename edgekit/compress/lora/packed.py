"""QLoRA over edgekit's packed 4-bit layers (``QuantLinear``, made by ``compress --bits 4``).

peft does not know that layer, so each targeted ``QuantLinear`` is wrapped by
``LoraQuantLinear``: ``y = base(x) + dropout(x) A^T B^T * alpha / r``. While training,
the frozen product ``x W^T`` goes through ``FrozenDequantMatmul``, which dequantizes the
packed weight in forward and again in backward instead of saving it, so the float weights
never stay resident: this is what makes QLoRA's peak memory lower than LoRA's. In eval
mode and on export the packed layer's own forward runs (``MatMulNBits`` after export).

Merging (``repack``) adds ``B A`` to the dequantized weight and re-rounds it onto the
layer's own 4-bit grid (same scales and zero points): updates below half a quantization
step are lost, which is why a packed base keeps its adapters beside it by default.
"""
from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

import torch
from torch import nn

from edgekit.compress.weight_only.packing import QuantLinear
from edgekit.compress.weight_only.rtn import quantize_int
from edgekit.export.packing import group_width

# Packed layers larger than this many weights (an LM head: 49152 x 576) are dequantized in
# row chunks of CHUNK_ROWS, so no full float copy of them ever exists at once.
CHUNK_ROWS = 4096
CHUNK_ABOVE = 4_000_000


def row_chunks(base: QuantLinear) -> list[tuple[int, int]]:
    """(lo, hi) row ranges to dequantize ``base`` in: one for most layers, several for the LM head."""
    rows = int(base.out_features)
    if rows * int(base.in_features) <= CHUNK_ABOVE:
        return [(0, rows)]
    return [(i, min(rows, i + CHUNK_ROWS)) for i in range(0, rows, CHUNK_ROWS)]


class FrozenDequantMatmul(torch.autograd.Function):
    """``x @ W^T`` for a frozen packed weight W (out, in), without keeping W for backward.

    Autograd would save the dequantized float weight of every layer until backward (the
    whole float model again); this dequantizes it a second time in backward, in row
    chunks for large layers (the LM head), so QLoRA's memory stays that of the packed
    weights plus the activations. dL/dx = dL/dy @ W; W gets no gradient.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,
                base: QuantLinear) -> torch.Tensor:
        ctx.base = base  # type: ignore[attr-defined]
        chunks = row_chunks(base)
        if len(chunks) == 1:
            return x @ base.dequantize(x.dtype).t()
        return torch.cat([x @ base.dequantize_rows(lo, hi, x.dtype).t() for lo, hi in chunks], dim=-1)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        base: QuantLinear = ctx.base  # type: ignore[attr-defined]
        out = None
        for lo, hi in row_chunks(base):
            part = grad[..., lo:hi] @ base.dequantize_rows(lo, hi, grad.dtype)
            out = part if out is None else out.add_(part)
        return out, None


def frozen_linear_forward(base: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """A packed layer's forward through ``FrozenDequantMatmul`` (training only)."""
    y = FrozenDequantMatmul.apply(x, base)
    return y if base.bias is None else y + base.bias.to(y.dtype)


def _training_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    if self.training and torch.is_grad_enabled():
        return frozen_linear_forward(self, x)
    return type(self).forward(self, x)


@contextlib.contextmanager
def frozen_packed_forwards(module: nn.Module) -> Iterator[None]:
    """While training, route every packed layer that has no adapter (the LM head, layers
    not targeted) through the memory-saving matmul too; restore their forward afterwards."""
    patched = []
    for m in module.modules():
        if isinstance(m, QuantLinear) and "forward" not in m.__dict__:
            m.forward = types.MethodType(_training_forward, m)  # type: ignore[method-assign]
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


class LoraQuantLinear(nn.Module):
    """LoRA over a frozen packed 4-bit linear: ``y = base(x) + dropout(x) A^T B^T * alpha / r``.

    State dict keys: ``base_layer.*`` (the packed layer's own), ``lora_A.weight`` (r, in),
    ``lora_B.weight`` (out, r): the names peft uses, less its adapter name.
    """

    def __init__(self, base: QuantLinear, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        self.base_layer = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.r = r
        self.scaling = float(alpha) / r
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, self.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as peft
        nn.init.zeros_(self.lora_B.weight)
        for p in self.base_layer.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            y = frozen_linear_forward(self.base_layer, x)
        else:  # inference and export: the packed layer's own forward (-> MatMulNBits on export)
            y = self.base_layer(x)
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """(out, in) float update ``B A * alpha / r``."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, scaling={self.scaling}"


def repack(qlinear: QuantLinear, weight: torch.Tensor) -> None:
    """Re-round a float (out, in) weight onto ``qlinear``'s own grid (its scales and zero
    points stay), in place: ``q = clamp(round(w / scale) + zero, 0, 2**bits - 1)``."""
    cols = int(qlinear.in_features)
    g = group_width(cols, int(qlinear.group_size))
    col_group = torch.arange(cols) // g  # (in,)
    scales = qlinear.scales.float()  # (out, G)
    zeros = qlinear.zeros().float()  # (out, G)
    q = quantize_int(weight.float(), scales[:, col_group], zeros[:, col_group], int(qlinear.bits))
    qlinear.set_quantized(q.to(torch.uint8), scales, zeros.to(torch.uint8))
