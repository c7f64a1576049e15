"""Round-to-nearest (RTN) weight quantization: the integer grid every weight-only method shares.

Notation (as in GPTQ's ``quant.py``): ``maxq = 2**bits - 1``; a weight row (or group of a
row) gets a ``scale`` and an integer ``zero`` so that ``q = clamp(round(w / scale) + zero,
0, maxq)`` and ``w ~ (q - zero) * scale``.

* asymmetric: ``scale = (max - min) / maxq``, ``zero = round(-min / scale)`` (clamped to the grid);
* symmetric: ``scale = 2 * max|w| / maxq``, ``zero = 2**(bits - 1)`` (8 for 4 bits, the
  default zero point of ``com.microsoft::MatMulNBits``).

Groups are contiguous runs of ``group_size`` input columns (``-1``: one group per output
row, i.e. per-channel); a last, shorter group is allowed when ``group_size`` does not
divide the input width (like GPTQ's reference code and ONNX Runtime's MatMulNBits padding).

All functions are pure tensor math on ``(rows, cols)`` float weights.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from edgekit.export.packing import group_width, num_groups

ROW_BLOCK_ELEMENTS = 2**24  # weights rounded per pass of ``rtn_quantize`` (64 MiB in float32)


def qparams(w: torch.Tensor, bits: int, sym: bool, clip: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and integer zero point per row of ``w`` (rows, cols) -> ``(rows,)`` each.

    ``clip`` (scalar or per-row) shrinks the range before the grid is fitted (AWQ's clip search).
    """
    maxq = 2**bits - 1
    w = w.float()
    xmin = w.amin(dim=1) * clip
    xmax = w.amax(dim=1) * clip
    if sym:
        amax = torch.maximum(xmin.abs(), xmax.abs())
        scale = 2 * amax / maxq
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
        return scale, zero
    scale = (xmax - xmin) / maxq
    flat = scale == 0
    scale = torch.where(flat, torch.where(xmax != 0, xmax.abs(), torch.ones_like(scale)), scale)
    zero = torch.clamp(torch.round(-xmin / scale), 0, maxq)
    zero = torch.where(flat & (xmin > 0), torch.zeros_like(zero), zero)
    return scale, zero


def quantize_int(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes in ``[0, 2**bits - 1]`` (float dtype). ``scale``/``zero`` broadcast against ``w``."""
    return torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize then dequantize: the value the packed model will compute with."""
    return (quantize_int(w, scale, zero, bits) - zero) * scale


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                 clip: torch.Tensor | None = None,
                 done_with: Callable[[torch.Tensor], object] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest per group.

    w: (out, in) float. clip: optional (out, n_groups) range shrink factors. done_with: called
    with each block of rows of ``w`` once rounded (the LM head lets a memory-mapped table's pages
    go block by block, ``memory.drop_file_pages``, instead of holding all of them until the end).
    Returns ``q`` (out, in) uint8 codes, ``scales`` (out, n_groups) float32 and ``zeros``
    (out, n_groups) uint8.
    """
    rows, cols = w.shape
    g = group_width(cols, group_size)
    ng = num_groups(cols, group_size)
    q = torch.empty(rows, cols, dtype=torch.uint8, device=w.device)
    scales = torch.empty(rows, ng, dtype=torch.float32, device=w.device)
    zeros = torch.empty(rows, ng, dtype=torch.uint8, device=w.device)
    # rows are independent: a half-precision LM head (Llama-3.2's 128,256 x 2,048) is cast to float32
    # a block of rows at a time, never whole (the same codes)
    step = max(1, ROW_BLOCK_ELEMENTS // max(cols, 1))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        wb = w[lo:hi].float()
        for j in range(ng):
            sl = slice(j * g, min(cols, (j + 1) * g))
            c = 1.0 if clip is None else clip[lo:hi, j]
            s, z = qparams(wb[:, sl], bits, sym, c)
            q[lo:hi, sl] = quantize_int(wb[:, sl], s[:, None], z[:, None], bits).to(torch.uint8)
            scales[lo:hi, j] = s
            zeros[lo:hi, j] = z.to(torch.uint8)
        if done_with is not None:
            done_with(w[lo:hi])
    return q, scales, zeros


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in) codes + per-group params -> (out, in) float32 weight."""
    cols = q.shape[-1]
    g = group_width(cols, group_size)
    s = scales.float().repeat_interleave(g, dim=-1)[..., :cols]
    z = zeros.float().repeat_interleave(g, dim=-1)[..., :cols]
    return (q.float() - z) * s
