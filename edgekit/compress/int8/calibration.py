"""Streaming activation statistics and the four range-selection methods.

An observer accumulates a histogram of one tensor over any number of batches in bounded
memory: ``BINS`` bins over a symmetric range ``[-R, R]`` that doubles (merging bins
pairwise) whenever a batch exceeds it, so memory never grows with the number of samples.
A batch of more than ``HIST_SAMPLE`` values is histogrammed through a seeded uniform sample of
them (each standing for its share of the batch); the extremes always come from every value.
``choose_range(hist, method, ...)`` turns the histogram into a clipping range:

  minmax      the observed extremes.
  percentile  the ``p``-th percentile of |x| on each side (99.99 by default; NVIDIA's recipe).
  entropy     TensorRT's KL-divergence threshold on |x| (2048 bins, 128 quantized levels).
  mse         the clip that minimises the expected quantize-dequantize squared error.

``qparams(lo, hi, qmin, qmax, symmetric)`` maps a range to (scale, zero_point).

The calibration data side, shared by the INT8 files: ``load_split`` (one split's samples),
``tensor_batches`` (samples as torch batches), ``run_module`` (a module's first output on
every sample), ``score`` / ``quality`` (metrics against the FP32 reference) and ``check_agreement`` (a
classifier's floor).

>>> obs = HistogramObserver("relu1")
>>> obs.update(torch.randn(64, 16))
>>> lo, hi = choose_range(obs, "minmax")
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from edgekit.compress import StepContext
from edgekit.compress.int8.technique_configs import CALIB_METHODS
from edgekit.errors import BadInputError, CheckFailedError, bad_choice
from edgekit.evaluate import accuracy_metrics, agreement_metrics, cosine_metrics
from edgekit.sources.data import Samples, check_arrays, load_samples
from edgekit.sources.handle import ModelHandle

BINS = 4096  # over [-R, R]; 2048 bins per side, as TensorRT's entropy calibrator uses
# Values per batch that go into a tensor's histogram: above this, a seeded uniform sample of them (weighted
# by how many values each stands for); the extremes still come from every value. torch.histc was half of
# EfficientNet-Lite0's calibration time; the sample keeps the histogram's shape (benchmarks/RESULTS.md).
HIST_SAMPLE = 1 << 17


class HistogramObserver:
    """Bounded-memory streaming statistics of one activation tensor."""

    def __init__(self, name: str, bins: int = BINS, sample: int | None = HIST_SAMPLE, seed: int = 0) -> None:
        self.name = name
        self.bins = bins
        self.sample = sample  # None: every value
        self._gen: torch.Generator | None = None
        self._seed = seed
        self.hist = torch.zeros(bins, dtype=torch.float64)
        self.R = 0.0  # histogram covers [-R, R]
        self.min = math.inf
        self.max = -math.inf
        self.count = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            x = x.permute(0, 2, 3, 1)  # the same values in memory order: a view, not a copy
        x = x.reshape(-1)
        if x.numel() == 0:
            return
        lo_t, hi_t = torch.aminmax(x)  # one pass; NaN and Inf show in the extremes
        lo, hi = float(lo_t), float(hi_t)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            bad = int((~torch.isfinite(x)).sum())
            raise BadInputError(f"non-finite activations ({bad} NaN/Inf values) at layer {self.name!r} "
                                "during calibration; check the calibration data and the model's preprocessing")
        self.min, self.max = min(self.min, lo), max(self.max, hi)
        need = max(abs(lo), abs(hi), 1e-8)
        if self.R == 0.0:
            self.R = need
        elif need > self.R:
            # Grow by powers of two: merge 2^k adjacent bins so the old counts stay exact.
            k = math.ceil(math.log2(need / self.R))
            f = 2 ** k
            half = self.bins // 2
            if f >= half:
                merged = torch.zeros_like(self.hist)
                merged[half - 1] = self.hist[:half].sum()
                merged[half] = self.hist[half:].sum()
            else:
                neg = self.hist[:half].flip(0).reshape(-1, f).sum(1)  # from 0 outwards
                pos = self.hist[half:].reshape(-1, f).sum(1)
                merged = torch.zeros_like(self.hist)
                merged[half - len(neg):half] = neg.flip(0)
                merged[half:half + len(pos)] = pos
            self.hist = merged
            self.R *= f
        n = x.numel()
        if self.sample is not None and n > self.sample:
            if self._gen is None:
                self._gen = torch.Generator().manual_seed(self._seed)
            picked = x[torch.randint(n, (self.sample,), generator=self._gen)]
            self.hist += torch.histc(picked, bins=self.bins, min=-self.R, max=self.R).double() * (n / self.sample)
        else:
            self.hist += torch.histc(x, bins=self.bins, min=-self.R, max=self.R).double()
        self.count += n

    @property
    def edges(self) -> np.ndarray:
        return np.linspace(-self.R, self.R, self.bins + 1)

    def state(self) -> dict[str, float]:
        return {"min": self.min, "max": self.max, "count": self.count}


def _abs_hist(obs: HistogramObserver) -> tuple[np.ndarray, float]:
    """Histogram of |x| with bins//2 bins over [0, R]."""
    h = obs.hist.numpy()
    half = obs.bins // 2
    return h[half:] + h[:half][::-1], obs.R


def _percentile_abs(obs: HistogramObserver, p: float) -> float:
    h, R = _abs_hist(obs)
    c = np.cumsum(h)
    if c[-1] <= 0:
        return 0.0
    i = int(np.searchsorted(c, c[-1] * p / 100.0))
    return float((min(i, len(h) - 1) + 1) * R / len(h))


def _entropy_threshold(obs: HistogramObserver, levels: int = 128) -> float:
    """TensorRT's KL calibration on the |x| histogram (2048 bins, 128 levels)."""
    h, R = _abs_hist(obs)
    h = h.copy()
    h[0] = 0.0  # the spike of exact zeros (after ReLU) would make the smallest clip look best
    nb = len(h)
    if h.sum() <= 0:
        return float(R)
    best, best_i = math.inf, nb
    for i in range(levels, nb + 1, 16):
        ref = h[:i].copy()
        ref[i - 1] += h[i:].sum()
        # quantize the first i bins into `levels` bins, then expand back, keeping zero bins zero
        idx = (np.arange(i) * levels) // i
        qsum = np.bincount(idx, weights=h[:i], minlength=levels)
        nz = (h[:i] > 0).astype(np.float64)
        qcnt = np.bincount(idx, weights=nz, minlength=levels)
        expanded = np.where(nz > 0, qsum[idx] / np.maximum(qcnt[idx], 1), 0.0)
        p = ref / ref.sum()
        q = expanded / max(expanded.sum(), 1e-12)
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / np.maximum(q[mask], 1e-12))))
        if kl < best:
            best, best_i = kl, i
    return float(best_i * R / nb)


def _mse_range(obs: HistogramObserver, qmin: int, qmax: int, symmetric: bool) -> tuple[float, float]:
    h = obs.hist.numpy()
    e = obs.edges
    centers = (e[:-1] + e[1:]) / 2
    keep = h > 0
    c, w = centers[keep], h[keep]
    lo0, hi0 = min(obs.min, 0.0), max(obs.max, 0.0)
    best, best_r = math.inf, (lo0, hi0)
    for a in np.linspace(0.05, 1.0, 96):
        lo, hi = lo0 * a, hi0 * a
        if symmetric:
            m = max(-lo, hi)
            lo, hi = -m, m
        s, zp = qparams(lo, hi, qmin, qmax, symmetric)
        q = np.clip(np.round(c / s) + zp, qmin, qmax)
        err = float(np.sum(w * (c - (q - zp) * s) ** 2))
        if err < best:
            best, best_r = err, (lo, hi)
    return best_r


def choose_range(obs: HistogramObserver, method: str, percentile: float = 99.99,
                 qmin: int = 0, qmax: int = 255, symmetric: bool = False) -> tuple[float, float]:
    """Clipping range (lo <= 0 <= hi) of one observed tensor by ``method``."""
    if method not in CALIB_METHODS:
        raise bad_choice("calibration method", method, CALIB_METHODS)
    if obs.count == 0:
        raise BadInputError(f"layer {obs.name!r} saw no data during calibration")
    lo, hi = min(obs.min, 0.0), max(obs.max, 0.0)
    if method == "minmax":
        pass
    elif method == "percentile":
        t = _percentile_abs(obs, percentile)
        lo, hi = max(lo, -t), min(hi, t)
    elif method == "entropy":
        t = _entropy_threshold(obs)
        lo, hi = max(lo, -t), min(hi, t)
    else:
        lo, hi = _mse_range(obs, qmin, qmax, symmetric)
    if symmetric:
        m = max(-lo, hi)
        lo, hi = -m, m
    if hi - lo < 1e-8:
        hi = lo + 1e-8
    return float(lo), float(hi)


def qparams(lo: float, hi: float, qmin: int, qmax: int, symmetric: bool) -> tuple[float, int]:
    """Scale and zero point mapping [lo, hi] onto [qmin, qmax] (zero exactly representable)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        m = max(-lo, hi, 1e-8)
        half = (qmax - qmin) // 2  # 127 for int8
        return m / half, 0
    scale = max((hi - lo) / (qmax - qmin), 1e-8)
    zp = int(round(qmin - lo / scale))
    return scale, int(min(max(zp, qmin), qmax))


@dataclass(frozen=True)
class QRange:
    """A chosen range and its quantization parameters."""

    lo: float
    hi: float
    scale: float
    zero_point: int


# ------------------------------------------------------------------------------------------
# Calibration data and metrics


def load_split(handle: ModelHandle, ctx: StepContext, split: str, limit: int | None) -> Samples:
    """Samples of one split. ``ctx.calib`` / ``ctx.train`` / ``ctx.eval`` (a ``StepContext``)
    may be a data spec, None (the model's default) or an already loaded ``Samples``."""
    spec = {"calib": ctx.calib, "train": ctx.train, "eval": ctx.eval}[split]
    if isinstance(spec, Samples):
        samples = spec if limit is None or len(spec) <= limit else spec.subset(slice(0, limit))
        if handle.inputs:
            check_arrays(handle.inputs, samples.inputs, f"{split} data")
    else:
        samples = load_samples(spec, handle, split=split, limit=limit, seed=ctx.seed)
    if len(samples) == 0:
        raise BadInputError(f"{split} data {getattr(samples, 'source', spec)!r} holds no samples")
    return samples


def tensor_batches(samples: Samples, names: list[str], batch_size: int,
                   channels_last: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """The samples' inputs ``names`` as tuples of torch tensors, ``batch_size`` samples at a time;
    with ``channels_last``, 4-D float inputs in NHWC memory order (same values and shape: PyTorch's
    CPU convolutions then run their faster NHWC kernels and keep that order, see ``channels_last_ok``)."""
    for b in samples.batches(batch_size):
        out = tuple(torch.from_numpy(np.ascontiguousarray(b[n])) for n in names)
        if channels_last:
            out = tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point()
                        else t for t in out)
        yield out


def run_module(module: nn.Module, samples: Samples, names: list[str], batch_size: int = 32,
               channels_last: bool = False) -> np.ndarray:
    """First output of ``module`` on every sample, as one array (``channels_last``: see ``tensor_batches``)."""
    outs = []
    with torch.no_grad():
        for args in tensor_batches(samples, names, batch_size, channels_last):
            y = module(*args)
            if isinstance(y, (tuple, list)):
                y = y[0]
            outs.append(y.float().contiguous().numpy())
    return np.concatenate(outs)


def score(outputs: np.ndarray, ref: np.ndarray, labels: np.ndarray | None, evaluator: str | None) -> dict[str, float]:
    """Metrics of a variant against the FP32 reference outputs (and labels)."""
    out: dict[str, float] = {}
    if labels is not None:
        out.update(accuracy_metrics(outputs, labels))
    if evaluator == "cosine":
        out.update(cosine_metrics(outputs, ref))
    else:
        out.update(agreement_metrics(outputs, ref))
    return out


def quality(metrics: dict[str, float]) -> float:
    """The one number fallback protects: accuracy, else top-1 agreement, else cosine."""
    for key in ("accuracy", "top1_agreement", "mean_cosine"):
        if key in metrics:
            return float(metrics[key])
    raise KeyError("no quality metric")


# A classifier's INT8 model that agrees with its float model on fewer images than this is broken, not lossy
# (EfficientNet-Lite0's default engine: 92.8%; a layer kept in float whose weights ONNX Runtime then quantized
# per tensor: 52.6%, which the engine-against-fake-quant check cannot see, both being the same graph)
MIN_AGREEMENT = 0.8
CLASSIFIER_EVALUATORS = ("agreement", "accuracy")


def agreement_floor(n: int) -> float:
    """``MIN_AGREEMENT`` less two standard errors of that proportion on ``n`` samples, so that a small
    evaluation set does not fail a sound model by chance (363 images: 75.8%; 32: 65.9%)."""
    return MIN_AGREEMENT - 2 * math.sqrt(MIN_AGREEMENT * (1 - MIN_AGREEMENT) / max(n, 1))


def check_agreement(metrics: dict[str, Any], evaluator: str | None, n: int, what: str, accept: bool) -> None:
    """A classifier's (``evaluator`` in ``CLASSIFIER_EVALUATORS``) top-1 agreement with its float model on
    ``n`` samples below ``agreement_floor(n)``: ``CheckFailedError`` (exit 1), unless ``accept``. Records
    the floor in ``metrics`` (``min_agreement``)."""
    if evaluator not in CLASSIFIER_EVALUATORS or "top1_agreement" not in metrics:
        return
    floor = agreement_floor(n)
    metrics["min_agreement"] = round(floor, 4)
    if metrics["top1_agreement"] < floor and not accept:
        raise CheckFailedError(
            f"{what} agrees with the float model on {100 * metrics['top1_agreement']:.1f}% of {n} evaluation "
            f"samples, below the {100 * floor:.1f}% a classifier's INT8 model keeps when nothing is broken: "
            "nothing written (accept the loss with --accept-quality-loss)")
