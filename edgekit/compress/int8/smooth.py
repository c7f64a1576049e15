"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before INT8.

A decoder LLM's activations have a few channels far larger than the rest; one per-tensor int8
scale for such an input spends its levels on those channels and rounds the others away. For a
group of linears sharing one input ``X`` (q/k/v after the attention norm, gate/up after the MLP
norm, down after up, o after v), SmoothQuant divides input channel ``j`` by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(``max|X_j|`` over calibration tokens, ``max|W_j|`` over the group's weight column ``j``) and
multiplies the weight columns by it: ``X W^T = (X diag(s)^-1) (W diag(s))^T``, the same function,
with the activation's range moved into the per-output-channel weight scales, where int8 has room.

``1/s`` is folded into the op producing ``X`` exactly as AWQ folds its scales (``awq.fold_producer``
and ``awq.fold_scales``: the pairs come from the family description, or from ``wiring.probe_family``
for a family it does not describe), so the float model computes what it computed before and the
exported graph has no extra op. Groups whose producer cannot take the fold (``v_proj -> o_proj`` with
grouped heads) are left as they are. ``alpha`` 0 smooths nothing but the weights, 1 flattens the
activations completely; ``alpha`` around 0.5 balances the two ranges.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from edgekit.compress.families import family_of
from edgekit.compress.int8.technique_configs import SmoothConfig
from edgekit.compress.weight_only.awq import fold_producer, fold_scales
from edgekit.compress.weight_only.blocks import find_blocks
from edgekit.compress.wiring import probe_family
from edgekit.errors import BadInputError

FLOOR = 1e-5  # smallest channel maximum used in the scales: a channel never seen nonzero keeps a finite scale


def smoothing_scales(act_max: torch.Tensor, weights: Iterable[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` for one group: ``act_max`` (cols,) the
    per-channel input maxima, ``weights`` the group's (rows, cols) weights."""
    w_max = torch.stack([w.detach().abs().amax(dim=0).float() for w in weights]).amax(dim=0)
    a = act_max.float().clamp_min(FLOOR)
    s = a.pow(alpha) / w_max.clamp_min(FLOOR).pow(1.0 - alpha)
    return s.clamp_min(FLOOR)


@torch.no_grad()
def smooth(module: nn.Module, run: Callable[[nn.Module], None], config: SmoothConfig) -> list[dict[str, Any]]:
    """Fold SmoothQuant's scales into ``module`` (a Hugging Face causal LM) in place.

    ``run(module)`` runs the calibration windows through the model once; forward hooks record the
    per-channel maximum of each group's input. Returns one record per smoothed group: the block,
    producer and consumers, and the largest / median channel maximum before (the outlier ratio).
    ``BadInputError`` when the model has no group whose scales fold exactly."""
    prefix, blocks = find_blocks(module)
    family = family_of(module)
    if not family.known:  # no hand-table row: the fold pairs measured on the model (AWQ does the same)
        family = probe_family(module, blocks, prefix)
    groups: list[tuple[int, str, nn.Module, float, list[str], list[nn.Linear]]] = []
    for index, block in enumerate(blocks):
        for pair in family.scale_pairs:
            present = [c for c in pair.consumers if _linear(block, c) is not None]
            if not present:
                continue
            found = fold_producer(family, block, present)
            if found is None:
                continue
            members = [lin for lin in (_linear(block, c) for c in present) if lin is not None]
            groups.append((index, found[0], found[1], found[2], present, members))
    if not groups:
        raise BadInputError(f"{family.name}: no norm or linear whose output scales fold exactly into the projections "
                            "it feeds; INT8 smoothing does not apply (leave the smoothing alpha unset)")
    maxima: dict[int, torch.Tensor] = {}
    handles = []
    for g, (_, _, _, _, _, linears) in enumerate(groups):
        def record(mod: nn.Module, args: tuple, g: int = g) -> None:
            x = args[0].detach()
            m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            maxima[g] = m if g not in maxima else torch.maximum(maxima[g], m)

        handles.append(linears[0].register_forward_pre_hook(record))  # the group's members read one tensor
    try:
        run(module)
    finally:
        for h in handles:
            h.remove()
    smoothed: list[dict[str, Any]] = []
    for g, (index, producer, prod, offset, consumers, linears) in enumerate(groups):
        if g not in maxima:  # a block the calibration windows never reached (cannot happen in a plain decoder)
            continue
        act = maxima[g].to(linears[0].weight.device)
        s = smoothing_scales(act, [lin.weight for lin in linears], float(config.alpha))
        fold_scales(prod, s, offset)
        for lin in linears:
            lin.weight.data.mul_(s.to(lin.weight.dtype))
        smoothed.append({"block": index, "producer": producer, "consumers": consumers,
                         "act_max": round(float(act.max()), 4), "act_median": round(float(act.median()), 4)})
    return smoothed


def _linear(block: nn.Module, path: str) -> nn.Linear | None:
    try:
        m = block.get_submodule(path)
    except AttributeError:
        return None
    return m if isinstance(m, nn.Linear) else None
