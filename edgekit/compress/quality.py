"""Quality of a compressed model against the float model it started from: the gate of ``compress``.

Before any step runs, ``measure_reference`` runs the float model on held-out data (the
model's eval split, e.g. Wikipedia for a causal LM: never the calibration text; the model's
own sample inputs when it has no eval data) and keeps what the comparison needs: per-token
NLL and argmax for a causal LM, plus a bounded sample of output rows for the cosine.
After the chain, ``compare`` runs the compressed model on the same inputs and reports

* ``perplexity_float``, ``perplexity``, ``perplexity_ratio`` (causal LMs),
* ``agreement``: how often the top prediction (argmax of the last axis) is the float one's,
* ``cosine``: mean cosine similarity of output rows (logits, embeddings, class scores).

``check_quality`` turns a report into a verdict against ``QualityBounds``: by default a chain
that quantizes to 4 bits or fewer may cost at most 1.5x the float perplexity (a dropped scale or
a broken fold costs orders of magnitude), 8 bits at most 1.1x; cosine and agreement floors
catch models without perplexity. Chains that change the model on purpose (pruning,
distillation, LoRA) are reported, not gated, unless bounds are given. Beyond a bound,
``compress`` raises ``CheckFailedError`` (exit 1) and writes nothing, unless the user accepts
the loss (``accept_quality_loss``, ``--accept-quality-loss``).

>>> check_quality({"perplexity_ratio": 3.2}, QualityBounds(max_ppl_ratio=1.5))  # doctest: +SKIP
['perplexity 3.2x the float model (bound 1.5x)']
"""
from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from edgekit.errors import BadInputError
from edgekit.evaluate import make_runner, window_nll
from edgekit.memory import float32_compute, own_memory, release_memory
from edgekit.onnx_checks import ort_errors, ort_failure
from edgekit.schema import check_fields
from edgekit.sources.data import resolve_samples
from edgekit.sources.handle import ModelHandle, data_view

EVAL_WINDOWS = 8  # causal LM: eval-split windows (the int4 step's measurement used as many)
EVAL_SAMPLES = 32  # other models: eval samples
COSINE_ROWS = 64  # output rows kept per model for the cosine (a 262k-vocabulary row is 1 MB)


@dataclass(frozen=True)
class QualityBounds:
    """Sanity bounds of a compressed model against its float model (None: not checked)."""

    max_ppl_ratio: float | None = None
    min_agreement: float | None = None
    min_cosine: float | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_ppl_ratio is not None and not self.max_ppl_ratio >= 1:
            raise BadInputError(f"max perplexity ratio must be >= 1, got {self.max_ppl_ratio!r}")
        for name in ("min_agreement", "min_cosine"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 1:
                raise BadInputError(f"{name.replace('_', ' ')} must be in [0, 1], got {v!r}")


# What a 4-bit (or lower) and an 8-bit chain may cost by default. The perplexity bound is the
# one the issue names (a dropped embedding scale costs 100x and more); cosine/agreement floors are
# loose: tiny random-weight models agree poorly even when nothing is wrong.
BOUNDS_4BIT = QualityBounds(max_ppl_ratio=1.5, min_cosine=0.5)
BOUNDS_8BIT = QualityBounds(max_ppl_ratio=1.1, min_cosine=0.8)
# What a float16/bfloat16 weight cast may cost (measured: cosine 1.0, relative error < 6e-3).
BOUNDS_HALF = QualityBounds(max_ppl_ratio=1.02, min_cosine=0.99)


def loosest(bounds: list[QualityBounds]) -> QualityBounds | None:
    """The bounds of a chain whose steps each declared theirs: what the lossiest step allows."""
    if not bounds:
        return None

    def pick(values: list[float | None], fn: Any) -> float | None:
        set_ = [v for v in values if v is not None]
        return fn(set_) if set_ else None

    return QualityBounds(max_ppl_ratio=pick([b.max_ppl_ratio for b in bounds], max),
                         min_agreement=pick([b.min_agreement for b in bounds], min),
                         min_cosine=pick([b.min_cosine for b in bounds], min))


@dataclass
class Reference:
    """What the float model computed on the held-out inputs."""

    source: str
    feeds: list[dict[str, np.ndarray]]
    nll: list[np.ndarray] | None  # causal LM: per-window token NLL
    top: list[np.ndarray]  # argmax of the last axis
    rows: np.ndarray  # (k, d) output rows for the cosine
    row_index: list[np.ndarray]  # per feed: which flattened rows were kept


def _held_out(handle: ModelHandle, ctx: Any) -> tuple[str, list[dict[str, np.ndarray]]]:
    # the evaluation data, else the eval split of the calibration source (disjoint from what it calibrates on)
    spec = ctx.eval or handle.default_eval or ctx.calib
    names = [s.name for s in handle.inputs]
    if spec:
        limit = (getattr(ctx, "quality_windows", None) or EVAL_WINDOWS) if handle.kind == "causal-lm" else EVAL_SAMPLES
        samples = resolve_samples(spec, data_view(handle), "eval", limit, None, ctx.seed)
        if all(n in samples.inputs for n in names) and len(samples):
            sub = samples.subset(slice(0, limit)) if len(samples) > limit else samples
            first = handle.inputs[0].shape[0] if handle.inputs and handle.inputs[0].shape else None
            batch = 1 if handle.kind == "causal-lm" else first if isinstance(first, int) else 8  # a static batch
            what = spec if isinstance(spec, (str, os.PathLike)) else getattr(spec, "source", "the given data")
            return f"{what} (eval split, {len(sub)} samples)", [{n: b[n] for n in names} for b in sub.batches(batch)]
    first = handle.inputs[0].shape[0] if handle.inputs and handle.inputs[0].shape else None
    n = 2 if handle.kind == "causal-lm" else first if isinstance(first, int) else 8
    feeds = handle.sample_inputs(n)
    return f"the model's sample inputs ({n})", [{k: v for k, v in feeds.items() if k in names}]


def _runner(handle: ModelHandle) -> Any:
    """``feeds -> first output as float32 tensor`` of the model (its PyTorch module, else its ONNX graph,
    loaded once for every window)."""
    try:
        run = make_runner(handle)
    except ort_errors() as e:  # an ONNX graph ONNX Runtime refuses: one line naming the node
        raise BadInputError(f"{handle.onnx_path or handle.name} does not load in ONNX Runtime: "
                            f"{ort_failure(e, handle.onnx_path)}") from None

    def first_output(feeds: dict[str, np.ndarray]) -> torch.Tensor:
        try:
            out = run(feeds)[0]
        except ort_errors() as e:
            raise BadInputError(f"{handle.onnx_path or handle.name} does not run in ONNX Runtime: "
                                f"{ort_failure(e, handle.onnx_path)}") from None
        return torch.from_numpy(np.asarray(out, dtype=np.float32))

    return first_output


def _token_nll(logits: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    """Per-token NLL (b, t - 1), a chunk of positions at a time (never a second vocabulary-sized copy)."""
    return window_nll(logits.numpy(), ids)


def measure_reference(handle: ModelHandle, ctx: Any) -> Reference:
    """The float model's outputs on held-out data (through its PyTorch module or ONNX graph)."""
    source, feeds = _held_out(handle, ctx)
    lm = handle.kind == "causal-lm" and "input_ids" in feeds[0]
    nll: list[np.ndarray] | None = [] if lm else None
    top, rows, index = [], [], []
    per_feed = max(1, COSINE_ROWS // len(feeds))
    run = _runner(handle)
    for f in feeds:
        with float32_compute(handle.module) if handle.module is not None else nullcontext():
            out = run(f)  # weights stored in half precision: float32 a layer at a time
        if nll is not None:
            nll.append(_token_nll(out, f["input_ids"]))
        flat = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
        top.append(flat.argmax(-1).numpy())
        idx = np.linspace(0, flat.shape[0] - 1, min(per_feed, flat.shape[0])).astype(np.int64)
        index.append(idx)
        rows.append(flat[torch.from_numpy(idx)].numpy())
    release_memory()  # the last window's logits
    return Reference(source, feeds, nll, top, np.concatenate(rows), index)


def compare(handle: ModelHandle, ref: Reference) -> dict[str, Any]:
    """Quality of ``handle`` (compressed) against the float reference, on the same inputs."""
    if handle.module is not None:  # the float model's file, still mapped through its untouched tensors
        own_memory(handle.module)
    nll: list[np.ndarray] = []
    agree, count, rows = 0, 0, []
    run = _runner(handle)
    for f, top, idx in zip(ref.feeds, ref.top, ref.row_index):
        out = run(f)
        if ref.nll is not None:
            nll.append(_token_nll(out, f["input_ids"]))
        flat = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
        agree += int((flat.argmax(-1).numpy() == top).sum())
        count += top.size
        rows.append(flat[torch.from_numpy(idx)].numpy())
    got = np.concatenate(rows).astype(np.float64)
    want = ref.rows.astype(np.float64)
    cos = (got * want).sum(1) / np.maximum(np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1), 1e-30)
    report: dict[str, Any] = {"data": ref.source, "agreement": round(agree / max(count, 1), 4),
                              "cosine": round(float(cos.mean()), 5),
                              "relative_error": round(float(np.linalg.norm(got - want)) / max(float(np.linalg.norm(want)),
                                                                                             1e-30), 5)}
    if ref.nll is not None:
        p_float = math.exp(float(np.mean(np.concatenate([a.ravel() for a in ref.nll]))))
        p = math.exp(min(float(np.mean(np.concatenate([a.ravel() for a in nll]))), 700.0))
        report.update({"perplexity_float": round(p_float, 4), "perplexity": round(p, 4),
                       "perplexity_ratio": round(p / p_float, 4)})
    return report


def check_quality(report: dict[str, Any], bounds: QualityBounds | None) -> list[str]:
    """The bounds ``report`` breaks, as phrases (empty: within bounds or no bounds)."""
    if bounds is None:
        return []
    broken = []
    ratio = report.get("perplexity_ratio")
    if bounds.max_ppl_ratio is not None and ratio is not None and not ratio <= bounds.max_ppl_ratio:
        broken.append(f"perplexity {report['perplexity']:.4g} is {ratio:.3g}x the float model's "
                      f"{report['perplexity_float']:.4g} (bound {bounds.max_ppl_ratio:g}x)")
    if bounds.min_cosine is not None and not report["cosine"] >= bounds.min_cosine:
        broken.append(f"output cosine to the float model {report['cosine']:.3g} (bound >= {bounds.min_cosine:g})")
    if bounds.min_agreement is not None and not report["agreement"] >= bounds.min_agreement:
        broken.append(f"top-1 agreement with the float model {report['agreement']:.3g} "
                      f"(bound >= {bounds.min_agreement:g})")
    return broken


__all__ = ["QualityBounds", "BOUNDS_4BIT", "BOUNDS_8BIT", "BOUNDS_HALF", "loosest", "measure_reference", "compare",
           "check_quality", "Reference"]
