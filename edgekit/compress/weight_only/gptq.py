"""GPTQ (Frantar et al., 2022): second-order weight quantization, one layer at a time.

The math is two pure pieces, in the paper's names:

* ``HessianAccumulator.add_batch(x)`` accumulates ``H = 2 X Xᵀ / n`` from a layer's real
  inputs ``x`` (..., in_features), streamed batch by batch;
* ``gptq_solve(W, H, grid, ...)`` solves, onto any grid passed in: dampen ``H`` (``damp`` x
  mean diagonal), take the upper Cholesky factor of ``H⁻¹`` and quantize columns left to
  right in blocks of ``block_size``, spreading each column's error ``Err1`` over the columns
  not yet quantized (``W[:, i:] -= Err1 · Hinv[i, i:]``), lazily for columns beyond the
  block; optional act-order (columns by decreasing ``diag(H)``). The one solver behind the
  4-bit grids here and INT8 rounding (``int8/rounding.py``: the fixed per-channel int8 grid).
* ``gptq_quantize(W, H, ...)`` is the 4-bit solve: the asymmetric group grid of ``rtn.py``,
  optional static groups (group grids fitted once on the original weight, so groups stay
  contiguous for packing).

One departure from the paper, for attention value projections (``v_proj``): their output
reaches the model only through the attention, ``P_h (X Wᵀ)``, so their Hessian is built from
the attention-mixed inputs ``P_h X`` of the query heads that read each key/value head
(``GptqConfig.value_hessian = "attention"``, the default). With the paper's ``X Xᵀ``
every key token weighs the same, while the attention-sink token is read by most queries;
on SmolLM2 GPTQ then lands on a worse perplexity than RTN (benchmarks/RESULTS.md).

Two additions that lower the same objective, both on by default (``GptqConfig``):
``refit`` re-solves each row's group scales by least squares once the codes are fixed
(``refit_scales``), and ``gptaq_alpha`` makes each layer match the float model's output
rather than its own on already-degraded inputs (GPTAQ, Li et al., 2025: ``AsymmetricAccumulator``
collects ``dXXT``; ``asymmetric_target`` turns it into the weight GPTQ then quantizes).

The driver that walks a model block by block, feeding each layer the outputs of the
already-quantized layers before it, lives in ``blocks.py`` (shared with AWQ);
``gptq_visit`` is its per-group callback.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from edgekit.compress.weight_only.blocks import GroupInputs, GroupVisit, Quantized, linear_at, value_projection
from edgekit.compress.weight_only.gptq_config import GptqConfig
from edgekit.compress.weight_only.grid_config import GridConfig
from edgekit.compress.weight_only.rtn import dequantize_groups, qparams, quantize_int, rtn_quantize
from edgekit.export.packing import group_width, num_groups


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one intra-op thread inside the ``with``. GPTQ's column solve, its grid search, refit and
    GPTAQ target are thousands of small tensor operations: a second thread adds a fork and join to each,
    and on a busy machine the join waits for a descheduled thread (SmolLM2-135M, 4 blocks, AVX2 EPYC at
    load 10: those phases took 75.6 CPU s on two threads, 9.4 on one; benchmarks/RESULTS.md, issue 30).
    It also makes the codes independent of the thread count: two threads sum some products in another
    order, and the last bits flip roundings (18% of the codes of 3 SmolLM2 blocks). The forward passes
    and Hessian products around the solve keep every thread.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def add_gram_(H: torch.Tensor, x: torch.Tensor, blocks: int = 4) -> None:
    """``H += xᵀ x`` for ``x`` (rows, n), computing only the blocks on and above the diagonal (a
    ``blocks`` x ``blocks`` tiling of ``H``) and mirroring the rest: 5/8 of the full product's work
    at 4 blocks. ``H`` must be symmetric before the call."""
    n = H.shape[-1]
    width = -(-n // blocks)
    width = -(-width // 64) * 64  # whole kernel tiles
    if n <= width:
        H.addmm_(x.t(), x)
        return
    for i0 in range(0, n, width):
        i1 = min(n, i0 + width)
        H[i0:i1, i0:].addmm_(x[:, i0:i1].t(), x[:, i0:])
        H[i1:, i0:i1] = H[i0:i1, i1:].t()


class HessianAccumulator:
    """Running ``H = 2/n Σ x xᵀ`` over the rows of the inputs seen so far (float32).

    With ``groups``, one Hessian per group, ``H`` (groups, columns, columns), from inputs
    (groups, rows, columns): a depthwise convolution's channels each see their own inputs.
    Inputs may be transposed views (an im2col matrix (columns, rows) passed as ``.t()``): the
    product then runs on the original memory without a copy. ``symmetric``: each product is
    computed on and above the diagonal only (``add_gram_``), 5/8 of the work; the sums then run
    in another order than the full product's, so the last bits differ."""

    def __init__(self, columns: int, device: torch.device | str = "cpu", groups: int | None = None,
                 symmetric: bool = False) -> None:
        shape = (columns, columns) if groups is None else (groups, columns, columns)
        self.H = torch.zeros(shape, dtype=torch.float32, device=device)
        self.groups = groups
        self.symmetric = symmetric and groups is None
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        x = x.detach().to(self.H.device, torch.float32)
        if self.groups is None:
            x = x.reshape(-1, x.shape[-1])
        n = x.shape[-2]
        self.H *= self.nsamples / (self.nsamples + n)
        self.nsamples += n
        if self.groups is None:
            x = x * (2.0 / self.nsamples) ** 0.5
            if self.symmetric:
                add_gram_(self.H, x)
            else:
                self.H.addmm_(x.t(), x)
        else:  # a few columns per group: scaling H costs less than scaling x
            self.H.baddbmm_(x.transpose(1, 2), x, alpha=2.0 / self.nsamples)


class AsymmetricAccumulator(HessianAccumulator):
    """``H`` plus GPTAQ's (Li et al., 2025) ``dXXT = 2/n Σ (x_fp - x) xᵀ``: ``x`` the layer's input in
    the partly quantized model, ``x_fp`` the same token's input in the float model."""

    def __init__(self, columns: int, device: torch.device | str = "cpu", symmetric: bool = False) -> None:
        super().__init__(columns, device, symmetric=symmetric)
        self.dXXT = torch.zeros_like(self.H)
        self.npairs = 0  # rows behind dXXT (``add_batch`` adds rows to H only)

    def add_pair(self, x: torch.Tensor, x_fp: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(self.H.device, torch.float32)
        dx = x_fp.detach().reshape(-1, x_fp.shape[-1]).to(self.H.device, torch.float32) - x
        n = x.shape[0]
        self.dXXT *= self.npairs / (self.npairs + n)
        self.dXXT.addmm_(dx.t(), x, alpha=2.0 / (self.npairs + n))
        self.npairs += n
        self.add_batch(x)


def add_attention_mixed(accumulators: list[HessianAccumulator], P: torch.Tensor, X: torch.Tensor, rep: int,
                        query_blocks: int = 4, query_stride: int = 1) -> None:
    """Add to ``accumulators[g]`` the attention-mixed inputs ``P_h X`` of the ``rep`` query heads ``h``
    that read key/value head ``g``: ``P`` (batch, heads, queries, keys), ``X`` (batch, keys, features).
    A causal ``P`` (nothing above its diagonal) is multiplied ``query_blocks`` blocks of queries at a
    time against the keys they can see only (5/8 of the product at 4 blocks). ``query_stride``: every
    n-th query only (a sample of the rows; 1: all)."""
    X = X.float()
    nq, nk = P.shape[-2], P.shape[-1]
    causal = nq == nk and not bool(P.triu(1).any())
    queries = torch.arange(0, nq, query_stride, device=P.device)
    if query_stride > 1:
        P = P[:, :, queries]
    rows = P.shape[-2]
    step = -(-rows // query_blocks)
    for g, acc in enumerate(accumulators):
        Pg = P[:, g * rep:(g + 1) * rep].float()  # (batch, rep, queries, keys)
        if causal:
            Y = torch.empty(*Pg.shape[:-1], X.shape[-1], dtype=X.dtype, device=X.device)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                keys = int(queries[r1 - 1]) + 1  # the last query of the block sees keys up to itself
                Y[:, :, r0:r1] = torch.matmul(Pg[:, :, r0:r1, :keys], X[:, None, :keys])
        else:
            Y = torch.matmul(Pg, X[:, None])
        acc.add_batch(Y)


def asymmetric_target(W: torch.Tensor, H: torch.Tensor, dXXT: torch.Tensor, alpha: float,
                      damp: float = 0.01) -> torch.Tensor:
    """The weight GPTQ should reproduce when the layer must match the *float* model's output:
    ``Σ ||W x_fp - Q x||²`` = ``||(W̃ - Q) X||²`` + const with ``W̃ = W + W dXXT H⁻¹`` (least
    squares; ``H`` dampened). ``alpha`` in [0, 1] moves only that far (GPTAQ's alpha), since
    the correction is fitted on the calibration tokens."""
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    L = torch.linalg.cholesky(H)
    shift = torch.cholesky_solve((W.float() @ dXXT.to(W.device)).t(), L).t()  # (W dXXT) H⁻¹, H symmetric
    return W.float() + alpha * shift


# The grid GPTQ rounds onto, passed in: ``grid(column, w, ahead)`` gets the original index of the
# column being quantized, its current (error-updated) values ``w`` (rows,) and ``ahead(n)``, the next
# ``n`` error-updated columns in solve order (rows, n) for grids fitted on the fly; it returns the
# column on the grid, dequantized (rows,). A grid that needs integer codes records them itself.
ColumnGrid = Callable[[int, torch.Tensor, Callable[[int], torch.Tensor]], torch.Tensor]


@torch.no_grad()
def gptq_solve(W: torch.Tensor, H: torch.Tensor, grid: ColumnGrid, *, block_size: int = 128, damp: float = 0.01,
               act_order: bool = False) -> tuple[torch.Tensor, float]:
    """The GPTQ solve (the reference's ``fasterquant``): ``W`` (rows, cols) quantized column by
    column onto ``grid``, each column's error ``Err1`` spread over the columns not yet quantized
    through the upper Cholesky factor of ``H⁻¹``, lazily beyond the current block of
    ``block_size`` columns. ``H``: (cols, cols) shared by all rows, or (rows, cols, cols) one per
    row (a depthwise convolution's channels). Dead inputs (zero diagonal) get a unit diagonal,
    then ``damp`` x the mean diagonal is added. ``act_order``: columns by decreasing ``diag(H)``
    (shared ``H`` only). Works in ``W``'s dtype. Returns (``Q`` (rows, cols) dequantized, in the
    original column order; the reference's loss ``Σ (w - q)² / 2 Hinv_ii²``).

    >>> W, X = torch.randn(4, 8), torch.randn(64, 8)
    >>> Q, loss = gptq_solve(W, X.t() @ X, lambda c, w, ahead: torch.round(w * 4) / 4)
    >>> bool((Q * 4 == torch.round(Q * 4)).all())
    True
    """
    W, Hinv, perm = _prepare(W, H, damp, act_order)
    rows, cols = W.shape
    batched = Hinv.dim() == 3
    order = perm.tolist() if perm is not None else None

    Q = torch.zeros_like(W)
    loss = torch.zeros((), dtype=W.dtype, device=W.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[..., i1:i2, i1:i2]
        for i in range(i2 - i1):
            w = W1[:, i]
            d = Hinv1[..., i, i]  # () or (rows,)
            col = i1 + i if order is None else order[i1 + i]

            def ahead(n: int, i: int = i, W1: torch.Tensor = W1, i2: int = i2) -> torch.Tensor:
                return torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :n]

            q = grid(col, w, ahead)
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1) * Hinv1[..., i, i:]
            Err1[:, i] = err1
        Q[:, i1:i2] = Q1
        loss += (Err1 * Err1).sum() / 2
        if batched:
            W[:, i2:] -= torch.einsum("rk,rkj->rj", Err1, Hinv[:, i1:i2, i2:])
        else:
            W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return Q, float(loss)


def _prepare(W: torch.Tensor, H: torch.Tensor, damp: float,
             act_order: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What every GPTQ solve starts from: a copy of ``W``, the upper Cholesky factor of the dampened
    ``H⁻¹``, both in solve order, and that order (None: the columns' own). Dead inputs (zero
    diagonal) get a unit diagonal first: the column is still quantized, its error spreads nowhere."""
    W = W.detach().clone()
    H = H.detach().to(W.device, W.dtype).clone()
    if H.dim() == 3 and act_order:
        raise ValueError("act_order needs one Hessian shared by all rows")
    diag = H.diagonal(dim1=-2, dim2=-1)
    diag.masked_fill_(diag <= 0, 1.0)
    perm: torch.Tensor | None = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal(dim1=-2, dim2=-1).add_(damp * H.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True))
    return W, _inverse_cholesky(H), perm


@torch.no_grad()
def _clamp_to_pairs(q: torch.Tensor, Zt: torch.Tensor, codes: torch.Tensor, c: int, earlier: list[int],
                    bound: int) -> None:
    """Clamp column ``c``'s codes ``q`` in place so that with each already rounded partner column the
    positive codes sum to at most ``bound`` and the negative ones to at least ``-bound``."""
    signed = q - Zt[c]
    for p in earlier:
        partner = codes[p] - Zt[p]
        signed = torch.minimum(signed, bound - partner.clamp_min(0))
        signed = torch.maximum(signed, (-partner).clamp_min(0) - bound)
    torch.add(signed, Zt[c], out=q)


def gptq_solve_fixed(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int, *,
                     block_size: int = 128, damp: float = 0.01, act_order: bool = False,
                     pair_partners: list[list[int]] | None = None, pair_bound: int = 0) -> torch.Tensor:
    """``gptq_solve`` onto a grid fixed before the solve: column ``c`` rounds to
    ``clamp(round(w / scale[:, c]) + zero[:, c], 0, maxq)`` (``scale``, ``zero``: (rows, cols), one
    entry per column, e.g. a static group grid repeated over its columns). Returns the integer codes
    (rows, cols, float) in the original column order. The same algorithm as ``gptq_solve`` with the
    grid inlined: it works on the transposed weight, so each column is contiguous memory, in place,
    a few tensor operations per column; the sums run in another order, so the last bits can differ.
    ``pair_partners`` (the INT8 pair-safe grid, ``int8.pairs``): column c -> earlier columns it is
    paired with; its signed code (``code - zero``) is clamped so each pair's same-sign codes sum to at
    most ``pair_bound`` in magnitude (column order only, not with ``act_order``).

    >>> W, X = torch.randn(4, 8), torch.randn(64, 8)
    >>> codes = gptq_solve_fixed(W, X.t() @ X, torch.full((4, 8), 0.25), torch.full((4, 8), 8.0), 15)
    >>> bool(((codes >= 0) & (codes <= 15) & (codes == codes.round())).all())
    True
    """
    if pair_partners is not None and act_order:
        raise ValueError("pair_partners follow the column order: not with act_order")
    W, Hinv, perm = _prepare(W, H, damp, act_order)
    if perm is not None:
        scale, zero = scale[:, perm], zero[:, perm]
    Wt = W.t().contiguous()  # (cols, rows): column i is the row Wt[i]
    St, Zt = scale.to(W.dtype).t().contiguous(), zero.to(W.dtype).t().contiguous()
    cols, rows = Wt.shape
    codes = torch.empty_like(Wt)
    deq = torch.empty(rows, dtype=W.dtype, device=W.device)
    for i1 in range(0, cols, block_size):
        i2 = min(i1 + block_size, cols)
        W1 = Wt[i1:i2]  # a view: updated in place
        Err1 = torch.empty_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            c = i1 + i
            q = codes[c]
            torch.div(W1[i], St[c], out=q)
            q.round_().add_(Zt[c]).clamp_(0, maxq)
            if pair_partners is not None and pair_partners[c]:
                _clamp_to_pairs(q, Zt, codes, c, pair_partners[c], pair_bound)
            torch.sub(q, Zt[c], out=deq).mul_(St[c])
            err = Err1[i]
            torch.sub(W1[i], deq, out=err).div_(Hinv1[i, i])
            W1[i + 1:].addr_(Hinv1[i, i + 1:], err, alpha=-1)
        Wt[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1)
    out = codes.t()
    return out[:, torch.argsort(perm)] if perm is not None else out.contiguous()


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = False,
                  act_order: bool = False, static_groups: bool = False, damp: float = 0.01,
                  block_size: int = 128, mse_grid: bool = False,
                  refit: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``W`` (rows, cols) given the Hessian ``H`` (cols, cols) of its inputs.

    Returns ``q`` (rows, cols) uint8 codes, ``scales`` (rows, G) float32, ``zeros`` (rows, G)
    uint8 in the original column order, groups contiguous (see ``rtn.py`` for the grid).
    With act-order and groups, static groups are always used (contiguous groups are what
    packed layers and ``MatMulNBits`` store). ``mse_grid``: each group's range shrunk by the
    ratio in [0.75, 1] minimising its own ``||w - Q(w)||^2.4`` (QuaRot's ``w_clip``) instead of min-max.
    ``refit``: once the codes are fixed, the scales are re-solved by least squares under ``H``
    (``refit_scales``), which lowers the same objective GPTQ minimises. The solve is ``gptq_solve``
    with the asymmetric group grid of ``rtn.py``.
    """
    W = W.detach().clone().float()
    H = H.detach().clone().float().to(W.device)
    originals = (W.clone(), H.clone()) if refit else None
    rows, cols = W.shape
    maxq = 2**bits - 1
    g = group_width(cols, group_size)
    ng = num_groups(cols, group_size)
    static = group_size != -1 and (static_groups or act_order)

    def fit(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mse_qparams(w, bits, sym) if mse_grid else qparams(w, bits, sym)

    W[:, torch.diag(H) == 0] = 0  # inputs never seen: the reference GPTQ zeroes their weights

    scales = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)
    zeros = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)
    if group_size == -1 or static:  # the grid is known before the solve
        full = cols // g  # whole groups, fitted in one call: each row of each group is its own problem
        if full:
            s_full, z_full = fit(W[:, :full * g].reshape(rows * full, g))
            scales[:, :full], zeros[:, :full] = s_full.reshape(rows, full), z_full.reshape(rows, full)
        if full < ng:  # a last, shorter group
            scales[:, full], zeros[:, full] = fit(W[:, full * g:])
        per_column = (scales.repeat_interleave(g, dim=1)[:, :cols], zeros.repeat_interleave(g, dim=1)[:, :cols])
        codes = gptq_solve_fixed(W, H, *per_column, maxq, block_size=block_size, damp=damp, act_order=act_order)
    else:
        codes = torch.zeros(rows, cols, dtype=torch.float32, device=W.device)

        def grid(col: int, w: torch.Tensor, ahead: Callable[[int], torch.Tensor]) -> torch.Tensor:
            j = col // g
            if col % g == 0:
                scales[:, j], zeros[:, j] = fit(ahead(g))  # this group's grid on the error-updated weights
            s, z = scales[:, j], zeros[:, j]
            q = quantize_int(w, s, z, bits)
            codes[:, col] = q
            return (q - z) * s

        gptq_solve(W, H, grid, block_size=block_size, damp=damp, act_order=act_order)
    Q = codes.clamp(0, maxq)
    if originals is not None:
        scales = refit_scales(*originals, Q, scales, zeros, group_size, damp)
    return Q.to(torch.uint8), scales, zeros.to(torch.uint8)


def refit_scales(W: torch.Tensor, H: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, damp: float = 0.01) -> torch.Tensor:
    """Scales re-solved for fixed codes ``q`` and zero points: per row, the least-squares
    ``s = argmin (w - ŵ)ᵀ H (w - ŵ)`` with ``ŵ_c = s_g(c) (q_c - z_g(c))``, a linear problem in the
    row's group scales (``G x G`` normal equations, ``H`` dampened as in GPTQ). Zero points stay
    integers (the packed layout). A row keeps its old scales where the new ones are not all positive
    and finite or do not lower the objective."""
    rows, cols = W.shape
    g, ng = group_width(cols, group_size), num_groups(cols, group_size)
    W, q = W.float(), q.float()
    H = H.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    D = q - zeros.float().repeat_interleave(g, dim=-1)[:, :cols]  # ŵ = D * s per column's group
    spans = [slice(j * g, min(cols, (j + 1) * g)) for j in range(ng)]
    M = torch.zeros(rows, ng, ng, dtype=torch.float32, device=W.device)
    b = torch.zeros(rows, ng, dtype=torch.float32, device=W.device)
    for j, sj in enumerate(spans):
        B = D[:, sj] @ H[sj, :]  # (rows, cols): D_j H_j,:
        b[:, j] = (B * W).sum(1)
        for k, sk in enumerate(spans):
            M[:, j, k] = (B[:, sk] * D[:, sk]).sum(1)
    # a tiny ridge towards the old scales keeps groups whose codes all sit on the zero point solvable
    ridge = 1e-6 * M.diagonal(dim1=1, dim2=2).abs().mean(1, keepdim=True).clamp_min(1e-12)
    new = torch.linalg.solve(M + torch.diag_embed(ridge.expand(rows, ng)), (b + ridge * scales).unsqueeze(-1)).squeeze(-1)

    def objective(s: torch.Tensor) -> torch.Tensor:
        E = W - D * s.repeat_interleave(g, dim=-1)[:, :cols]
        return ((E @ H) * E).sum(1)

    ok = torch.isfinite(new).all(1) & (new > 0).all(1) & (D != 0).any(1)  # a row all on its zero points: nothing to fit
    ok &= objective(torch.where(ok[:, None], new, scales)) <= objective(scales)
    return torch.where(ok[:, None], new, scales)


def mse_qparams(w: torch.Tensor, bits: int, sym: bool, steps: int = 11, max_shrink: float = 0.25,
                norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scale and zero point with the range shrunk by the ratio in ``[1 - max_shrink, 1]``
    (``steps`` points) that minimises ``sum |w - Q(w)|^norm`` over the row (QuaRot's ``w_clip``)."""
    best_err = torch.full((w.shape[0],), float("inf"), device=w.device)
    best_s, best_z = qparams(w, bits, sym)
    for ratio in torch.linspace(1.0, 1.0 - max_shrink, steps).tolist():
        s, z = qparams(w, bits, sym, ratio)
        err = (w - (quantize_int(w, s[:, None], z[:, None], bits) - z[:, None]) * s[:, None]).abs().pow(norm).sum(1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def _inverse_cholesky(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of ``H⁻¹`` (also for a batch of them, (..., K, K)), adding damping
    until ``H`` is positive definite."""
    extra = 0.0
    step = H.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(H.shape[-1], dtype=H.dtype,
                                                                             device=H.device)
    for _ in range(6):
        try:
            L = torch.linalg.cholesky(H + extra * step if extra else H)
            Hinv = torch.cholesky_inverse(L)
            return torch.linalg.cholesky(Hinv, upper=True)
        except torch.linalg.LinAlgError:
            extra = (extra * 10) if extra else 0.01
    raise RuntimeError("GPTQ: the layer's Hessian is not positive definite even after damping")


def quantization_error(W: torch.Tensor, Wq: torch.Tensor, H: torch.Tensor) -> float:
    """The GPTQ objective ``tr((W - Wq) H (W - Wq)ᵀ)``, proportional to ||W X - Wq X||²."""
    D = (W.float() - Wq.float())
    return float(torch.einsum("ij,jk,ik->", D, H.float(), D))


def solve_group(module: torch.nn.Module, names: list[str], weights: dict[str, torch.Tensor], H: torch.Tensor,
                inputs: GroupInputs, config: GptqConfig, col_scale: torch.Tensor | None = None) -> Quantized:
    """GPTQ on one group of linears sharing an input: ``weights[name]`` (rows, cols) float,
    ``H`` their input Hessian. Returns name -> (codes, scales, zeros).

    The rows are solved jointly with ``H`` (GPTQ is row-separable), except an attention value
    projection with ``config.value_hessian == "attention"``: one Hessian per key/value head
    from the attention-mixed inputs ``P_h X`` of the query heads that read it (its output
    reaches the model only as ``P_h (X Wᵀ)``). ``col_scale``: the inputs were divided by it
    (AWQ), so the mixed inputs are too.
    """
    def solve(W: torch.Tensor, Hm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with one_thread():
            return gptq_quantize(W, Hm, bits=config.bits, group_size=config.group_size, sym=config.sym,
                                 act_order=config.act_order, static_groups=config.static_groups,
                                 damp=config.damp, block_size=config.block_size,
                                 mse_grid=config.grid_search, refit=config.refit)

    value = value_projection(module, names) if config.value_hessian == "attention" else None
    v_hessians: list[HessianAccumulator] = []
    if value is not None:
        v_name, attn, rep, head_dim = value
        v_lin = linear_at(module, v_name)
        v_hessians = [HessianAccumulator(v_lin.in_features, device=H.device, symmetric=True)
                      for _ in range(v_lin.out_features // head_dim)]
        for P, X in inputs.attention_mixed(attn, v_lin):
            X = X.float() if col_scale is None else X.float() / col_scale.to(X.device)
            add_attention_mixed(v_hessians, P, X, rep, query_stride=config.value_query_stride)
    results: Quantized = {}
    plain = [n for n in names if not (value is not None and v_hessians and n == value.name)]
    if plain:
        q, s, z = solve(torch.cat([weights[n] for n in plain], dim=0), H)
        row = 0
        for name in plain:
            rows = weights[name].shape[0]
            results[name] = (q[row:row + rows].cpu(), s[row:row + rows].cpu(), z[row:row + rows].cpu())
            row += rows
    if value is not None and v_hessians:
        Wv = weights[value.name]
        d = value.head_dim
        parts = [solve(Wv[g * d:(g + 1) * d], acc_g.H) for g, acc_g in enumerate(v_hessians)]
        q, s, z = (torch.cat([p[i] for p in parts], dim=0).cpu() for i in range(3))
        results[value.name] = (q, s, z)
    return results


Grid = TypeVar("Grid", bound=GridConfig)


def with_bits(config: Grid, bits: Mapping[str, int] | None, names: list[str]) -> Grid:
    """``config`` with the bit width ``bits`` gives the group of ``names`` (mixed precision), else as is."""
    if bits is None or bits.get(names[0], config.bits) == config.bits:
        return config
    return dataclasses.replace(config, bits=bits[names[0]])


def gptq_visit(module: torch.nn.Module, config: GptqConfig, results: Quantized,
               bits: Mapping[str, int] | None = None, experts: dict[str, Any] | None = None) -> GroupVisit:
    """The ``BlockWalker`` callback: the group's Hessian from its real inputs, ``solve_group``,
    then the weights onto the grid (only after every Hessian of the group saw float layers).
    ``bits``: a bit width per linear, where it differs from ``config.bits`` (mixed precision).

    A group that saw no calibration token (a mixture-of-experts expert the router never chose)
    has no Hessian: its layers are rounded to the nearest grid point (RTN) and their names listed
    in ``experts["without_calibration_tokens"]``, for the step's report. A routed expert's GPTAQ
    pairs are its own tokens (``GroupInputs.paired``): ``experts["routed_rows"]`` counts them,
    ``experts["routed_rows_paired"]`` those the float model also sent to that expert."""
    report = experts if experts is not None else {}
    def visit(_block: int, names: list[str], inputs: GroupInputs) -> None:
        cfg = with_bits(config, bits, names)
        linears = [linear_at(module, n) for n in names]
        weights = {n: lin.weight.detach().float() for n, lin in zip(names, linears)}
        acc: HessianAccumulator
        if cfg.gptaq_alpha > 0:
            pairs = acc = AsymmetricAccumulator(linears[0].in_features, device=linears[0].weight.device,
                                                symmetric=True)
            for x, x_fp in inputs.paired():
                if x_fp is None:  # beyond the windows the float model runs for (gptaq_windows)
                    pairs.add_batch(x)
                else:
                    pairs.add_pair(x, x_fp)
            if inputs.paired_rows:
                report["routed_rows"] = report.get("routed_rows", 0) + inputs.paired_rows
                report["routed_rows_paired"] = report.get("routed_rows_paired", 0) + inputs.float_rows
            if pairs.nsamples:
                with one_thread():
                    weights = {n: asymmetric_target(w, pairs.H, pairs.dXXT, cfg.gptaq_alpha, cfg.damp)
                               for n, w in weights.items()}
        else:
            acc = HessianAccumulator(linears[0].in_features, device=linears[0].weight.device, symmetric=True)
            for x in inputs():
                acc.add_batch(x)
        if acc.nsamples:
            results.update(solve_group(module, names, weights, acc.H, inputs, cfg))
        else:  # no token reached the group: nothing to weigh the columns by
            for name, w in weights.items():
                q, s, z = rtn_quantize(w, cfg.bits, cfg.group_size, cfg.sym)
                results[name] = (q.cpu(), s.cpu(), z.cpu())
            report.setdefault("without_calibration_tokens", []).extend(names)
        with one_thread():
            for name, lin in zip(names, linears):
                q, s, z = results[name]
                lin.weight.data.copy_(dequantize_groups(q, s, z, cfg.group_size).to(lin.weight.device, lin.weight.dtype))

    return visit
