"""GPTQ (Frantar et al., 2022): second-order weight quantization, one layer at a time.

The math is two pure pieces, in the paper's names:

* ``HessianAccumulator.add_batch(x)`` accumulates ``H = 2 X Xᵀ / n`` from a layer's real
  inputs ``x`` (..., in_features), streamed batch by batch;
* ``gptq_quantize(W, H, ...)`` solves: dampen ``H`` (``damp`` x mean diagonal), take the
  upper Cholesky factor of ``H⁻¹`` and quantize columns left to right in blocks of
  ``block_size``, spreading each column's error ``Err1`` over the columns not yet
  quantized (``W[:, i:] -= Err1 · Hinv[i, i:]``), lazily for columns beyond the block.
  Optional act-order (columns by decreasing ``diag(H)``) and static groups (group grids
  fitted once on the original weight, so groups stay contiguous for packing).

The driver that walks a model block by block, feeding each layer the outputs of the
already-quantized layers before it, lives in ``weight_only.py`` (shared with AWQ);
``GPTQLayerwise`` is its per-block callback.
"""
from __future__ import annotations

import torch

from edgekit.compress.rtn import group_width, num_groups, qparams, quantize_int


class HessianAccumulator:
    """Running ``H = 2/n Σ x xᵀ`` over the rows of the inputs seen so far (float32)."""

    def __init__(self, columns: int, device: torch.device | str = "cpu") -> None:
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)
        n = x.shape[0]
        self.H *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        x = x * (2.0 / self.nsamples) ** 0.5
        self.H.addmm_(x.t(), x)


@torch.no_grad()
def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                  act_order: bool = False, static_groups: bool = False, damp: float = 0.01,
                  block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``W`` (rows, cols) given the Hessian ``H`` (cols, cols) of its inputs.

    Returns ``q`` (rows, cols) uint8 codes, ``scales`` (rows, G) float32, ``zeros`` (rows, G)
    uint8 in the original column order, groups contiguous (see ``rtn.py`` for the grid).
    With act-order and groups, static groups are always used (contiguous groups are what
    packed layers and ``MatMulNBits`` store).
    """
    W = W.detach().clone().float()
    H = H.detach().clone().float().to(W.device)
    rows, cols = W.shape
    maxq = 2**bits - 1
    g = group_width(cols, group_size)
    ng = num_groups(cols, group_size)
    static = group_size != -1 and (static_groups or act_order)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    scales = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)
    zeros = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)
    if group_size == -1 or static:
        for j in range(ng):
            s, z = qparams(W[:, j * g:(j + 1) * g], bits, sym)
            scales[:, j], zeros[:, j] = s, z

    perm = torch.arange(cols, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W = W[:, perm]
        H = H[perm][:, perm]
    group_of = perm // g  # group index of each (permuted) column

    Q = torch.zeros(rows, cols, dtype=torch.float32, device=W.device)
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    Hinv = _inverse_cholesky(H)

    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            col = i1 + i
            w = W1[:, i]
            d = Hinv1[i, i]
            j = int(group_of[col])
            if not static and group_size != -1 and col % g == 0:
                # fit this group's grid on the error-updated weights still to quantize
                ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :g]
                scales[:, j], zeros[:, j] = qparams(ahead, bits, sym)
            s, z = scales[:, j], zeros[:, j]
            q = quantize_int(w, s, z, bits)
            Q1[:, i] = q
            err1 = (w - (q - z) * s) / d
            W1[:, i:] -= err1.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return Q.clamp(0, maxq).to(torch.uint8), scales, zeros.to(torch.uint8)


def _inverse_cholesky(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of ``H⁻¹``, adding damping until ``H`` is positive definite."""
    extra = 0.0
    mean_diag = torch.mean(torch.diag(H)).item()
    for _ in range(6):
        try:
            L = torch.linalg.cholesky(H + extra * torch.eye(H.shape[0], device=H.device) if extra else H)
            Hinv = torch.cholesky_inverse(L)
            return torch.linalg.cholesky(Hinv, upper=True)
        except torch.linalg.LinAlgError:
            extra = (extra * 10) if extra else 0.01 * mean_diag
    raise RuntimeError("GPTQ: the layer's Hessian is not positive definite even after damping")


def quantization_error(W: torch.Tensor, Wq: torch.Tensor, H: torch.Tensor) -> float:
    """The GPTQ objective ``tr((W - Wq) H (W - Wq)ᵀ)``, proportional to ||W X - Wq X||²."""
    D = (W.float() - Wq.float())
    return float(torch.einsum("ij,jk,ik->", D, H.float(), D))


def gptq_visit(module: torch.nn.Module, config, results: dict):
    """The ``BlockWalker`` callback: one Hessian per group of linears sharing an input
    (q/k/v, gate/up), solved jointly on their stacked rows (GPTQ is row-separable)."""

    def visit(_block: int, names: list[str], inputs) -> None:
        linears = [module.get_submodule(n) for n in names]
        acc = HessianAccumulator(linears[0].in_features, device=linears[0].weight.device)
        for x in inputs():
            acc.add_batch(x)
        W = torch.cat([lin.weight.detach().float() for lin in linears], dim=0)
        q, s, z = gptq_quantize(W, acc.H, bits=config.bits, group_size=config.group_size, sym=config.sym,
                                act_order=config.act_order, static_groups=config.static_groups,
                                damp=config.damp, block_size=config.block_size)
        from edgekit.compress.rtn import dequantize_groups

        row = 0
        for name, lin in zip(names, linears):
            r = slice(row, row + lin.out_features)
            row += lin.out_features
            lin.weight.data.copy_(dequantize_groups(q[r], s[r], z[r], config.group_size).to(lin.weight.dtype))
            results[name] = (q[r].cpu(), s[r].cpu(), z[r].cpu())

    return visit
