"""Mixed precision under a size budget: which groups of linears keep 8 bits (``--max-size-mb``,
``--avg-bits`` of the ``weight-only`` step).

llama.cpp's Q4_K_M keeps some tensors at higher precision by a fixed rule (attention values and
half of the MLP down projections at 6 bits). Here the choice is measured on the model:

* a **unit** is a group of linears sharing one input (q/k/v, o, gate/up, down in a decoder
  layer: the walk's groups, ``BlockWalker.groups``), which the fused decoder graph stores as one
  matrix, so its linears share a bit width;
* ``sensitivities`` scores each unit by the second-order estimate of what rounding it to the low
  bit width costs the language-model loss, over rounding it to 8 bits:
  ``½ Σ F (ΔW_low² - ΔW_8²)``, with ``F`` the empirical Fisher diagonal, the squared gradients of
  the loss on a few calibration windows (SqueezeLLM's sensitivity), and ``ΔW_b`` the
  round-to-nearest error at ``b`` bits. Each weight's gradient is reduced to its unit's sum as
  soon as backpropagation produces it, so no gradient is kept;
* ``allocate`` gives 8 bits to the units with the largest estimated cost per extra byte, until
  the budget is spent (the greedy order of the fractional knapsack).

The step records the choice (``meta.layers[...]["bits"]``) and, per unit, its estimate and
bytes (``meta.mixed``).

>>> allocate([Unit(("a",), 100, 60, 110, 1.0), Unit(("b",), 100, 60, 110, 5.0)], budget=180)
[False, True]
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from edgekit.compress.weight_only.blocks import linear_at
from edgekit.compress.weight_only.config import HIGH_BITS
from edgekit.compress.weight_only.rtn import dequantize_groups, rtn_quantize
from edgekit.errors import BadInputError
from edgekit.export.packing import num_groups, packed_width


@dataclass(frozen=True)
class Unit:
    """Linears stored at one bit width: their weight count, packed bytes at the low and the high
    bit width, and the estimated loss cost of the low one over the high one."""

    names: tuple[str, ...]
    weights: int
    low_bytes: int
    high_bytes: int
    sensitivity: float = 0.0


def layer_bytes(rows: int, cols: int, bits: int, group_size: int, bias: bool = False) -> int:
    """Bytes of a packed layer (``export/packing.QuantLinear``): codes, float32 scales, packed zero points."""
    ng = num_groups(cols, group_size)
    return rows * packed_width(cols, bits) + rows * ng * 4 + rows * packed_width(ng, bits) + (4 * rows if bias else 0)


def make_units(module: nn.Module, groups: Sequence[Sequence[str]], low_bits: int, group_size: int) -> list[Unit]:
    units = []
    for names in groups:
        lins = [linear_at(module, n) for n in names]
        units.append(Unit(tuple(names), sum(m.weight.numel() for m in lins),
                          sum(layer_bytes(m.out_features, m.in_features, low_bits, group_size, m.bias is not None)
                              for m in lins),
                          sum(layer_bytes(m.out_features, m.in_features, HIGH_BITS, group_size, m.bias is not None)
                              for m in lins)))
    return units


def _rounding_gap(W: torch.Tensor, low_bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """``ΔW_low² - ΔW_8²`` elementwise (round to nearest, per group)."""
    W = W.detach().float()
    gap = torch.zeros_like(W)
    for bits, sign in ((low_bits, 1.0), (HIGH_BITS, -1.0)):
        err = dequantize_groups(*rtn_quantize(W, bits, group_size, sym), group_size) - W
        gap.add_(err.square_(), alpha=sign)
    return gap


def sensitivities(module: nn.Module, units: list[Unit], windows: torch.Tensor, low_bits: int, group_size: int,
                  sym: bool) -> list[Unit]:
    """``units`` with their ``sensitivity``: ``½ Σ F (ΔW_low² - ΔW_8²)``, ``F`` the mean over
    ``windows`` (token ids, (n, seq)) of each window's squared loss gradient. ``module`` is a causal
    LM taking ``(input_ids, attention_mask)`` and returning logits; its weights are not changed."""
    sums = [0.0] * len(units)
    params = {p: False for p in module.parameters()}
    for p in params:
        params[p] = p.requires_grad
        p.requires_grad_(False)
    hooks = []
    for u, unit in enumerate(units):
        for name in unit.names:
            weight = linear_at(module, name).weight
            weight.requires_grad_(True)

            def reduce(p: torch.Tensor, u: int = u) -> None:
                if p.grad is not None:
                    sums[u] += 0.5 * float((_rounding_gap(p, low_bits, group_size, sym) * p.grad.square()).sum())
                    p.grad = None

            hooks.append(weight.register_post_accumulate_grad_hook(reduce))
    was_training = module.training
    module.eval()
    try:
        for ids in windows:
            ids = ids[None]
            logits = module(ids, torch.ones_like(ids))
            loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
            loss.backward()
            del logits, loss
    finally:
        for h in hooks:
            h.remove()
        for p, flag in params.items():
            p.requires_grad_(flag)
            p.grad = None
        module.train(was_training)
    n = max(len(windows), 1)
    return [replace(unit, sensitivity=s / n) for unit, s in zip(units, sums, strict=True)]


def allocate(units: Sequence[Unit], budget: float, fixed: float = 0.0) -> list[bool]:
    """Which units get the high bit width: all start low; the units with the largest sensitivity per
    extra byte move up while ``fixed`` + their bytes stay within ``budget`` (a unit that no longer
    fits is skipped for the next). BadInputError when even all-low does not fit."""
    total = fixed + sum(u.low_bytes for u in units)
    if total > budget:
        raise BadInputError(f"the size budget ({budget / 1e6:.2f} MB) is below the model at the lowest bit width "
                            f"({total / 1e6:.2f} MB)")
    high = [False] * len(units)
    order = sorted(range(len(units)), key=lambda i: units[i].sensitivity / max(units[i].high_bytes - units[i].low_bytes, 1),
                   reverse=True)
    for i in order:
        extra = units[i].high_bytes - units[i].low_bytes
        if units[i].sensitivity > 0 and total + extra <= budget:
            high[i] = True
            total += extra
    return high


__all__ = ["HIGH_BITS", "Unit", "allocate", "layer_bytes", "make_units", "sensitivities"]
