"""The pair-safe weight grid: 8-bit weights that never overflow the int16 pair sums of x86 CPUs without VNNI.

Without VNNI, ONNX Runtime (MLAS) and OpenVINO (oneDNN) multiply uint8 activation codes by int8 weight
codes with ``vpmaddubsw``, which adds each pair of adjacent products along the reduction axis in a
saturating int16. For activation codes anywhere in [0, 255], a pair of weight codes ``(w0, w1)`` is exact
exactly when its positive codes sum to at most 128 and its negative codes to at least -128:
255 x 128 = 32,640 <= 32,767 (codes of opposite signs partly cancel and never overflow).

The 7-bit grid (|code| <= 64, scheme "u8s7") meets that for every pair, at half the resolution of int8.
The pair-safe grid (scheme "u8s8p") keeps each output channel on the finest scale at which
round-to-nearest meets it for the pairs the kernels actually form:

    scale = max(max|w| / 127, max over same-sign pairs of (|w0| + |w1|) / 127.5)

(|round(a)| + |round(b)| <= a + b + 1 <= 128.5, so a rounded pair stays within 128). It is never coarser
than the 7-bit grid, and on EfficientNet-Lite0 0.70 bits finer on average (benchmarks/RESULTS.md, issue 26).
GPTQ keeps it while it spreads errors (``partners``: a column's codes are clamped by those of its
partner, rounded before it); ``trim`` puts any other codes back within it.

Which products are adjacent (measured on ONNX Runtime 1.31 and OpenVINO 2026.4 on an AVX2 CPU,
``tests/compress/int8/test_pairs.py``): MLAS pairs indices (2j, 2j+1) of the reduction axis, in im2col
order (kh, kw, c) per group for a convolution, K for a matmul; oneDNN pairs input channels (2j, 2j+1) at
each kernel tap. The two agree when a group's input channel count is even or the kernel is 1x1; otherwise
(a convolution over RGB input) every pair of both is kept within the bound.

NumPy only: the PyTorch side (``qdq.WeightQuant``) and the ONNX side (``onnx_graph``, ``qdq_onnx``) both
use it.
"""
from __future__ import annotations

import numpy as np

PAIR_BOUND = 128  # 255 x 128 = 32,640: the largest same-sign pair of codes that never saturates
_ROUNDED_BOUND = PAIR_BOUND - 0.5  # round-to-nearest adds at most 1 to a pair: 127.5 + 1 <= 128.5


def pairings(shape: tuple[int, ...]) -> np.ndarray:
    """The pairs of adjacent products of a weight of ``shape``, rows first (``(out, in)`` of a linear
    layer or of a matmul's transposed B, ``(out, in / groups, *kernel)`` of a convolution): (P, 2) indices
    into a row of ``w.reshape(out, -1)``; -1 where an odd count leaves a product alone."""
    k = int(np.prod(shape[1:], dtype=np.int64))
    if len(shape) <= 2:
        return _adjacent(np.arange(k))
    cin, taps = int(shape[1]), k // int(shape[1])
    flat = np.arange(k).reshape(cin, taps)  # row index at (c, tap)
    mlas = _adjacent(flat.T.reshape(-1))  # (tap, c) order: pairs cross taps when cin is odd
    if cin % 2 == 0 or taps == 1:
        return mlas
    onednn = np.concatenate([_adjacent(flat[:, t]) for t in range(taps)])  # channel pairs at each tap
    return np.unique(np.concatenate([mlas, onednn]), axis=0)  # (c0, c1) at tap 0 is in both


def _adjacent(order: np.ndarray) -> np.ndarray:
    if order.size % 2:
        order = np.append(order, -1)
    return order.reshape(-1, 2)


def _pair_values(flat: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """(rows, P, 2) values of ``flat`` (rows, K) at ``pairs``, 0 where the index is -1."""
    padded = np.concatenate([flat, np.zeros((flat.shape[0], 1), flat.dtype)], 1)  # -1 reads the zero column
    return padded[:, pairs]


def same_sign_sums(values: np.ndarray) -> np.ndarray:
    """(rows, P) of (rows, P, 2) pairs: the larger of a pair's positive sum and its negative sum's magnitude."""
    return np.maximum(np.clip(values, 0, None).sum(-1), np.clip(-values, 0, None).sum(-1))


def _max_pair_sums(flat: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """(rows,): each row's largest ``same_sign_sums``, a block of rows at a time (an LLM's embedding-sized
    weights would otherwise take several copies of themselves in float64)."""
    out = np.empty(flat.shape[0], np.float64)
    step = max(1, _BLOCK // max(1, flat.shape[1]))
    for r in range(0, flat.shape[0], step):
        out[r:r + step] = same_sign_sums(_pair_values(flat[r:r + step], pairs)).max(1)
    return out


_BLOCK = 1 << 20  # values per block of rows in ``_max_pair_sums``


def safe_scale(w: np.ndarray) -> np.ndarray:
    """(rows,): the finest per-row scale at which round-to-nearest codes of ``w`` (rows first) keep every
    code within 127 and every pair within ``PAIR_BOUND``."""
    flat = np.asarray(w).reshape(w.shape[0], -1)
    amax = np.maximum(flat.max(1), -flat.min(1)).astype(np.float64)
    sums = _max_pair_sums(flat.astype(np.float64) if flat.dtype.kind != "f" else flat, pairings(w.shape))
    return np.maximum(np.maximum(amax / 127, sums / _ROUNDED_BOUND), 1e-12)


def violations(codes: np.ndarray) -> int:
    """How many (row, pair) of integer ``codes`` (a weight's, rows first) exceed the bound."""
    flat = np.asarray(codes).reshape(codes.shape[0], -1)
    pairs = pairings(codes.shape)
    step = max(1, _BLOCK // max(1, flat.shape[1]))
    # int8 sums would wrap: each block widened on its own
    return sum(int((same_sign_sums(_pair_values(flat[r:r + step].astype(np.int32), pairs)) > PAIR_BOUND).sum())
               for r in range(0, flat.shape[0], step))


def trim(codes: np.ndarray, ratios: np.ndarray | None = None) -> np.ndarray:
    """``codes`` (a weight's integer codes, rows first) with every same-sign pair beyond ``PAIR_BOUND``
    cut back to it, the cut split so the pair stays nearest ``ratios`` (the unrounded codes
    ``w / scale``; default: the codes). Round-to-nearest on ``safe_scale`` never exceeds the bound and
    GPTQ keeps it (``partners``): this is for codes from anywhere else."""
    shape = codes.shape
    pairs = pairings(shape)
    flat = np.array(codes, np.float64).reshape(shape[0], -1)
    target = flat.copy() if ratios is None else np.asarray(ratios, np.float64).reshape(shape[0], -1)
    for _ in range(4):  # a code in two pairs (odd-channel kernels) may need a second pass
        vals = _pair_values(flat, pairs)
        bad = same_sign_sums(vals) > PAIR_BOUND
        if not bad.any():
            break
        r, p = np.nonzero(bad)
        i0, i1 = pairs[p, 0], pairs[p, 1]  # both real: a lone product is within 127
        sign = np.sign(vals[r, p].sum(-1))
        a = np.clip(np.round((np.abs(target[r, i0]) - np.abs(target[r, i1]) + PAIR_BOUND) / 2), 1, PAIR_BOUND - 1)
        flat[r, i0] = sign * a
        flat[r, i1] = sign * (PAIR_BOUND - a)
    return flat.reshape(shape).astype(codes.dtype)


def partners(shape: tuple[int, ...]) -> list[list[int]]:
    """For GPTQ, which rounds a row's columns in order: column c -> the earlier columns paired with it."""
    earlier: list[list[int]] = [[] for _ in range(int(np.prod(shape[1:], dtype=np.int64)))]
    for a, b in pairings(shape).tolist():
        if a >= 0 and b >= 0:
            earlier[max(a, b)].append(min(a, b))
    return earlier
