"""AWQ (Lin et al., 2023): activation-aware per-channel scaling, then round-to-nearest.

For a group of linears sharing one input ``x`` (q/k/v after the attention norm, gate/up
after the MLP norm, down after up), the salient input channels are those with large mean
activation magnitude. AWQ scales weight columns by ``s = mean|x| ** alpha`` (normalised),
quantizes ``W · diag(s)`` and divides the input by ``s``, choosing ``alpha`` on a grid in
``[0, 1)`` to minimise the group's output error ``||W x - Q(W s)(x / s)||²`` on calibration
tokens. ``1 / s`` is folded into the op producing ``x`` (the RMSNorm weight, or the rows of
``up_proj`` for ``down_proj``; ``v_proj`` rows for ``o_proj`` when heads are not grouped),
so the deployed graph has no extra op; groups with no foldable producer get ``s = 1``. Which
norm feeds which projections, and whether it multiplies by ``w`` or ``1 + w``, comes from the
model's family description (``families.py``: Gemma 2/3 feed the MLP from
``pre_feedforward_layernorm``); for a Hugging Face family it does not describe, from the model's
structure, each fold proven exact on the model (``wiring.py``).
An optional clipping search then shrinks each (row, group) range by the ratio in
``[0.5, 1]`` that minimises that group's output error, and RTN packs the result.

Pure pieces (``search_scale``, ``search_clip``) take tensors and are unit-tested on tiny
layers; ``awq_visit`` is the ``BlockWalker`` callback.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from edgekit.compress.families import Family, family_of, norm_offset
from edgekit.compress.weight_only.awq_config import AwqConfig
from edgekit.compress.weight_only.blocks import GroupInputs, GroupVisit, Quantized, find_blocks, linear_at
from edgekit.compress.weight_only.gptq import HessianAccumulator, solve_group, with_bits
from edgekit.compress.weight_only.rtn import dequantize_groups, rtn_quantize
from edgekit.compress.wiring import probe_family
from edgekit.errors import BadInputError
from edgekit.export.packing import group_width, num_groups

MAX_TOKENS = 2048  # calibration tokens kept per group for the searches (spread over all windows)



def _fake_quant(W: torch.Tensor, bits: int, group_size: int, sym: bool,
                clip: torch.Tensor | None = None) -> torch.Tensor:
    return dequantize_groups(*rtn_quantize(W, bits, group_size, sym, clip), group_size)


@torch.no_grad()
def search_scale(W: torch.Tensor, X: torch.Tensor, x_mean: torch.Tensor, bits: int, group_size: int, sym: bool,
                 grid: int = 20) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scale for ``W`` (rows, cols) given tokens ``X`` (tokens, cols)
    and mean |x| per channel. Returns (s (cols,), best alpha, relative error at it)."""
    W, X = W.float(), X.float()
    ref = X @ W.t()
    denom = ref.pow(2).mean().clamp_min(1e-20)
    best = (torch.ones_like(x_mean), 0.0, float("inf"))
    for k in range(grid):
        alpha = k / grid
        s = x_mean.float().clamp_min(1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        Wq = _fake_quant(W * s, bits, group_size, sym) / s
        err = float(((X @ Wq.t()) - ref).pow(2).mean() / denom)
        if err < best[2]:
            best = (s, alpha, err)
    return best


@torch.no_grad()
def search_clip(W: torch.Tensor, X: torch.Tensor, bits: int, group_size: int, sym: bool,
                grid: int = 20, max_shrink: float = 0.5, max_tokens: int = 512) -> torch.Tensor:
    """Per (row, group) range shrink ratio minimising ``||(W_g - Q(W_g)) x_g||²``: (rows, G)."""
    W = W.float()
    X = X[:: max(1, X.shape[0] // max_tokens)].float()
    rows, cols = W.shape
    g = group_width(cols, group_size)
    ng = num_groups(cols, group_size)
    best_err = torch.full((rows, ng), float("inf"), device=W.device)
    best = torch.ones(rows, ng, device=W.device)
    for k in range(int(grid * max_shrink) + 1):
        ratio = 1 - k / grid
        clip = torch.full((rows, ng), ratio, device=W.device)
        D = _fake_quant(W, bits, group_size, sym, clip) - W  # (rows, cols)
        err = torch.empty(rows, ng, device=W.device)
        for j in range(ng):
            sl = slice(j * g, min(cols, (j + 1) * g))
            err[:, j] = (X[:, sl] @ D[:, sl].t()).pow(2).mean(0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best


def fold_producer(family: Family, block: nn.Module, rel: list[str]) -> tuple[str, nn.Module, float] | None:
    """The op whose output is the group's input, when ``1/s`` can be folded into it: (path in the
    block, module, norm offset). From the family description (``families.py``); None when the
    group has no foldable producer (then ``s = 1``)."""
    pair = family.pair_for(rel[0])
    if pair is None:
        return None
    present = [c for c in pair.consumers if _has(block, c)]
    if sorted(present) != sorted(rel):
        raise BadInputError(f"AWQ: the {family.name} family description says {pair.producer} feeds "
                            f"{', '.join(present)}, but these layers share one input: {', '.join(rel)}")
    if not _has(block, pair.producer):
        raise BadInputError(f"AWQ: the {family.name} family description names {pair.producer}, "
                            f"which this block does not have")
    prod = block.get_submodule(pair.producer)
    w = getattr(prod, "weight", None)
    if not isinstance(w, torch.Tensor):
        return None
    if w.dim() == 1:
        return pair.producer, prod, norm_offset(prod, family)
    if not isinstance(prod, nn.Linear):
        return None
    if prod.out_features != linear_at(block, rel[0]).in_features:  # grouped heads: v feeds several o columns
        return None
    return pair.producer, prod, 0.0


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def awq_visit(module: nn.Module, config: AwqConfig, results: Quantized,
              bits: Mapping[str, int] | None = None) -> GroupVisit:
    """The ``BlockWalker`` callback for AWQ (scale search, fold, clip search, RTN); with
    ``config.then_gptq`` (AWQ+GPTQ) GPTQ replaces clip search + RTN on the scaled weights
    (Hessian of the scaled inputs ``diag(1/s) H diag(1/s)``). ``bits``: a bit width per linear,
    where it differs from ``config.bits`` (mixed precision)."""
    prefix, blocks = find_blocks(module)
    family = family_of(module)
    if not family.known:  # a family the hand table does not describe: its fold pairs measured on the model
        family = probe_family(module, blocks, prefix)
    then_gptq = config.then_gptq

    def visit(block_index: int, names: list[str], inputs: GroupInputs) -> None:
        cfg = with_bits(config, bits, names)
        linears = [linear_at(module, n) for n in names]
        cols = linears[0].in_features
        total = torch.zeros(cols, dtype=torch.float64)
        count = 0
        batches: list[torch.Tensor] = []
        acc = HessianAccumulator(cols, device=linears[0].weight.device) if then_gptq is not None else None
        for x in inputs():
            x = x.reshape(-1, cols)
            if acc is not None:
                acc.add_batch(x)
            total += x.abs().sum(0).double().cpu()
            count += x.shape[0]
            batches.append(x)
        step = max(1, count // MAX_TOKENS)
        X = torch.cat(batches)[::step]
        del batches
        x_mean = (total / max(count, 1)).float().to(X.device)
        W = torch.cat([lin.weight.detach().float() for lin in linears], dim=0)
        block_prefix = f"{prefix}.{block_index}." if prefix else ""
        rel = [n[len(block_prefix):] for n in names]
        prod = fold_producer(family, blocks[block_index], rel)
        scale = torch.ones(cols, device=W.device)  # the inputs' divisor: 1 without a producer to fold into
        if prod is not None:
            s, _, _ = search_scale(W, X, x_mean, cfg.bits, cfg.group_size, cfg.sym, cfg.awq_grid)
            scale = s
            fold_scales(prod[1], s, prod[2])
            if isinstance(prod[1], nn.Linear):  # an already-quantized linear: its row scales absorb 1/s
                pname = block_prefix + prod[0]
                if pname in results:
                    q0, sc0, z0 = results[pname]
                    results[pname] = (q0, sc0 / s.cpu()[:, None], z0)
            W = W * s
            X = X / s
            for lin in linears:
                lin.weight.data.mul_(s.to(lin.weight.dtype))
        if acc is not None and then_gptq is not None:  # awq-gptq
            H = acc.H / (scale[:, None] * scale[None, :]).to(acc.H.device)
            row, weights = 0, dict[str, torch.Tensor]()
            for name, lin in zip(names, linears):
                weights[name] = W[row:row + lin.out_features]
                row += lin.out_features
            # the group's own width: under mixed precision a group chosen for 8 bits is solved on the 8-bit grid
            results.update(solve_group(module, names, weights, H, inputs, with_bits(then_gptq, bits, names),
                                       col_scale=scale))
            for name, lin in zip(names, linears):
                q, sc, z = results[name]
                lin.weight.data.copy_(dequantize_groups(q, sc, z, cfg.group_size).to(lin.weight.device, lin.weight.dtype))
            return
        clip: torch.Tensor | None = None
        if cfg.awq_clip and not any(n.endswith(("q_proj", "k_proj")) for n in names):
            clip = search_clip(W, X, cfg.bits, cfg.group_size, cfg.sym, grid=cfg.awq_grid)
        row = 0
        for name, lin in zip(names, linears):
            r = slice(row, row + lin.out_features)
            row += lin.out_features
            q, sc, z = rtn_quantize(W[r], cfg.bits, cfg.group_size, cfg.sym, None if clip is None else clip[r])
            lin.weight.data.copy_(dequantize_groups(q, sc, z, cfg.group_size).to(lin.weight.dtype))
            results[name] = (q.cpu(), sc.cpu(), z.cpu())

    return visit


def fold_scales(producer: nn.Module, s: torch.Tensor, offset: float = 0.0) -> None:
    """Divide the producer's output channels by ``s``. A norm computing ``x_hat * (offset + w) + b``
    gets ``w' = (offset + w) / s - offset`` (Gemma's ``1 + w``) and ``b' = b / s``."""
    w, bias = getattr(producer, "weight", None), getattr(producer, "bias", None)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(producer).__name__} has no weight to fold AWQ's scales into")
    if w.dim() == 1:  # a norm's elementwise weight
        w.data.copy_(((w.data.double() + offset) / s.to(w.device).double() - offset).to(w.dtype))
    else:  # a linear's output rows
        w.data.div_(s.to(w.dtype)[:, None])
    if isinstance(bias, torch.Tensor):
        bias.data.div_(s.to(w.dtype))
