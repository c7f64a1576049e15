"""Quality of a compressed model against the float model it started from: the gate of ``compress``.

Before any step runs, ``measure_reference`` runs the float model on held-out data (the
model's eval split, e.g. Wikipedia for a causal LM: never the calibration text; the model's
own sample inputs when it has no eval data) and keeps what the comparison needs: per-token
NLL and argmax for a causal LM, plus a bounded sample of output rows for the cosine.
After the chain, ``compare`` runs the compressed model on the same inputs and reports

* ``perplexity_float``, ``perplexity``, ``perplexity_ratio`` (causal LMs),
* ``agreement``: how often the top prediction (argmax of the last axis) is the float one's,
* ``cosine``: mean cosine similarity of output rows (logits, embeddings, class scores).

For a causal LM of a family edgekit knows, neither pass holds a window's logits (tokens x vocabulary:
311 MB for a 512-token window of a 152k vocabulary) at once: the model runs up to its LM head, and the
head's logits are computed ``LOGITS_BLOCK`` elements (a block of positions) at a time, each block's
log-softmax NLL, argmax and kept rows taken before the next (``lm_statistics``). A model stored in half
precision computes in float32 a layer at a time, each layer's memory-mapped weights leaving resident
memory once its forward returns (``float32_compute(drop_pages=True)``), so the float reference holds one
layer of the file, not all of it.

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

from edgekit.compress.families import family_of, hf_model
from edgekit.errors import BadInputError
from edgekit.evaluate import make_runner, window_nll
from edgekit.export.packing import dequantized_once, keep_dequantized_budget
from edgekit.memory import drop_file_pages, float32_compute, own_memory, release_memory
from edgekit.onnx_checks import ort_errors, ort_failure
from edgekit.schema import check_fields
from edgekit.sources.data import resolve_samples
from edgekit.sources.handle import ModelHandle, data_view

EVAL_WINDOWS = 8  # causal LM: eval-split windows (the weight-only step's measurement used as many)
EVAL_SAMPLES = 32  # other models: eval samples
COSINE_ROWS = 64  # output rows kept per model for the cosine (a 262k-vocabulary row is 1 MB)
LOGITS_BLOCK = 1 << 24  # elements of a causal LM's logits computed at a time (64 MB of float32)


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


class _HeadInput(Exception):
    """Raised by the LM head's pre-hook: the model ran up to the head; its input is ``hidden``."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


def lm_head(module: torch.nn.Module) -> tuple[torch.nn.Module, float | None] | None:
    """(LM head, final soft-capping or None) of a causal LM of a family edgekit knows, whose logits
    are the head's output (soft-capped where the config says so: Gemma 2); None for anything else
    (an unknown family may transform its logits further: it is measured whole)."""
    hf = hf_model(module)
    if hf is None or not family_of(module).known:
        return None
    for m in module.modules():
        get = getattr(m, "get_output_embeddings", None)
        if not callable(get):
            continue
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            continue
        if isinstance(head, torch.nn.Module):
            cfg = hf.config
            cap = getattr(cfg, "final_logit_softcapping", None) or getattr(
                getattr(cfg, "text_config", None), "final_logit_softcapping", None)
            return head, float(cap) if cap else None
    return None


@dataclass
class WindowStats:
    """What the quality gate keeps of one batch of windows' logits."""

    nll: np.ndarray | None  # (b, t - 1) per-token NLL (causal LM)
    top: np.ndarray  # (rows,) argmax of each flattened output row
    rows: np.ndarray  # (len(index), vocab) the output rows at ``index``


def lm_statistics(module: torch.nn.Module, head: torch.nn.Module, softcap: float | None,
                  feeds: dict[str, np.ndarray], names: list[str], index: np.ndarray | None) -> WindowStats | None:
    """Per-token NLL, argmax and the rows at ``index`` (flattened positions; None: ``COSINE_ROWS``
    spread over the batch) of a causal LM's logits on ``feeds``, ``LOGITS_BLOCK`` elements at a time:
    the model runs up to ``head``, then the head runs on a block of positions at a time. None when the
    model's forward never reached ``head`` (measure its output whole instead)."""
    args = [torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in names]
    # first among the head's pre-hooks: float32_compute's cast up does not run for a forward that stops here
    hook = head.register_forward_pre_hook(lambda _m, a: _raise(_HeadInput(a[0].detach())), prepend=True)
    try:
        with torch.no_grad():
            module(*args)
        return None
    except _HeadInput as stop:
        hidden = stop.hidden  # (b, t, d)
    finally:
        hook.remove()
    ids = feeds["input_ids"]
    b, t = hidden.shape[:2]
    out_features = getattr(head, "out_features", None)
    out_rows = out_features if isinstance(out_features, int) else None
    step = max(1, LOGITS_BLOCK // out_rows) if out_rows else t
    nll = np.empty((b, max(t - 1, 0)), dtype=np.float32)
    top = np.empty(b * t, dtype=np.int64)
    if index is None:
        index = np.linspace(0, b * t - 1, min(COSINE_ROWS, b * t)).astype(np.int64)
    rows: list[np.ndarray | None] = [None] * len(index)
    for i in range(b):
        for s in range(0, t, step):
            e = min(s + step, t)
            with torch.no_grad():
                logits = head(hidden[i:i + 1, s:e])[0].float()  # (e - s, vocab)
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            top[i * t + s:i * t + e] = logits.argmax(-1).numpy()
            last = min(e, t - 1)
            if last > s:
                target = torch.from_numpy(np.ascontiguousarray(ids[i, s + 1:last + 1])).long()
                nll[i, s:last] = torch.nn.functional.cross_entropy(logits[:last - s], target, reduction="none").numpy()
            for k in np.nonzero((index >= i * t + s) & (index < i * t + e))[0]:
                rows[k] = logits[int(index[k]) - i * t - s].numpy().copy()
            del logits
    return WindowStats(nll, top, np.stack([r for r in rows if r is not None]))


def _raise(e: Exception) -> None:
    raise e


def _stats(handle: ModelHandle, run: Any, head: tuple[torch.nn.Module, float | None] | None,
           feeds: dict[str, np.ndarray], index: np.ndarray | None, per_feed: int) -> WindowStats:
    """One feed's statistics: a block of positions at a time (``lm_statistics``) where the model is a
    causal LM of a known family, else from its whole output."""
    lm = handle.kind == "causal-lm" and "input_ids" in feeds
    if lm and head is not None and handle.module is not None:
        stats = lm_statistics(handle.module, head[0], head[1], feeds, [s.name for s in handle.inputs] or list(feeds),
                              index if index is not None else _spread(feeds["input_ids"].size, per_feed))
        if stats is not None:
            return stats
    out = run(feeds)
    rows = out.shape[:-1].numel() if out.dim() > 1 else 1
    return output_statistics(out, feeds, index if index is not None else _spread(rows, per_feed), lm)


def output_statistics(out: torch.Tensor, feeds: dict[str, np.ndarray], index: np.ndarray, lm: bool) -> WindowStats:
    """What the gate keeps of one feed's whole first output ``out``: per-token NLL (``lm``: a causal LM's
    logits (b, t, vocab) on ``feeds["input_ids"]``), the argmax of every flattened row, and the rows at ``index``."""
    flat = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
    return WindowStats(_token_nll(out, feeds["input_ids"]) if lm else None, flat.argmax(-1).numpy(),
                       flat[torch.from_numpy(index)].numpy())


def _spread(n: int, k: int) -> np.ndarray:
    """``k`` (at most ``n``) row indices spread evenly over ``n`` rows."""
    return np.linspace(0, n - 1, min(k, n)).astype(np.int64)


def measure_reference(handle: ModelHandle, ctx: Any) -> Reference:
    """The float model's outputs on held-out data (through its PyTorch module or ONNX graph)."""
    return reference_on(handle, *_held_out(handle, ctx))


def reference_on(handle: ModelHandle, source: str, feeds: list[dict[str, np.ndarray]]) -> Reference:
    """The float model's outputs on ``feeds`` (``source`` says what they are), as ``measure_reference`` keeps
    them: for a step that compares on other data than the gate's."""
    lm = handle.kind == "causal-lm" and "input_ids" in feeds[0]
    nll: list[np.ndarray] | None = [] if lm else None
    top, rows, index = [], [], []
    per_feed = max(1, COSINE_ROWS // len(feeds))
    run = _runner(handle)
    head = lm_head(handle.module) if lm and handle.module is not None else None
    # weights stored in half precision: float32 a layer at a time, each layer's file pages let go after it
    with float32_compute(handle.module, drop_pages=True) if handle.module is not None else nullcontext():
        for f in feeds:
            st = _stats(handle, run, head, f, None, per_feed)
            if nll is not None and st.nll is not None:
                nll.append(st.nll)
            top.append(st.top)
            index.append(_spread(st.top.size, per_feed))
            rows.append(st.rows)
    if handle.module is not None:  # what the pass read of a memory-mapped file (the LM head's table) goes too
        drop_file_pages([*handle.module.parameters(), *handle.module.buffers()])
    release_memory()  # the last window's logits
    return Reference(source, feeds, nll, top, np.concatenate(rows), index)


# ``ModelHandle.extra`` key of the statistics a step measured of its own result on the gate's inputs
MEASURED = "quality_measured"


@dataclass
class Measured:
    """A compressed ONNX graph's statistics on a reference's feeds (one ``WindowStats`` a feed, rows at the
    reference's ``row_index``), measured by the step that wrote the graph while it compared it with the float
    model: ``compare`` reports from them instead of running the graph a second time. They stand for the graph
    at ``onnx_path`` on exactly ``reference``'s feeds; anything else is measured anew."""

    reference: Reference
    onnx_path: str
    stats: list[WindowStats]


def shared_statistics(handle: ModelHandle, ref: Reference) -> list[WindowStats] | None:
    """The statistics a step stored in ``handle.extra[MEASURED]`` for this very graph and reference, else None."""
    got = handle.extra.get(MEASURED)
    if not isinstance(got, Measured) or got.reference is not ref or handle.module is not None:
        return None
    if handle.onnx_path is None or str(handle.onnx_path) != got.onnx_path or len(got.stats) != len(ref.feeds):
        return None
    return got.stats


def compare(handle: ModelHandle, ref: Reference) -> dict[str, Any]:
    """Quality of ``handle`` (compressed) against the float reference, on the same inputs (from the
    statistics the step that wrote the graph measured on them, when it stored them: ``Measured``)."""
    shared = shared_statistics(handle, ref)
    if shared is not None:
        return report_from(ref, shared)
    if handle.module is not None:  # the float model's file, still mapped through its untouched tensors
        own_memory(handle.module)
    stats: list[WindowStats] = []
    run = _runner(handle)
    lm = handle.kind == "causal-lm" and bool(ref.feeds) and "input_ids" in ref.feeds[0]
    head = lm_head(handle.module) if lm and handle.module is not None else None
    # packed 4-bit layers: dequantized once for all the windows, not on every forward (same outputs), as
    # far as the memory goal allows (nothing kept for small models, up to 1 GiB from ~1B parameters on)
    with dequantized_once(handle.module, max_bytes=keep_dequantized_budget(handle.module)) \
            if handle.module is not None else nullcontext():
        for f, idx in zip(ref.feeds, ref.row_index):
            stats.append(_stats(handle, run, head, f, idx, len(idx)))
    return report_from(ref, stats)


def report_from(ref: Reference, stats: list[WindowStats]) -> dict[str, Any]:
    """The gate's report of a compressed model whose statistics on ``ref``'s feeds are ``stats``."""
    nll: list[np.ndarray] = []
    agree, count, rows = 0, 0, []
    for st, top in zip(stats, ref.top, strict=True):
        if ref.nll is not None and st.nll is not None:
            nll.append(st.nll)
        agree += int((st.top == top).sum())
        count += top.size
        rows.append(st.rows)
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
           "check_quality", "Reference", "WindowStats", "lm_head", "lm_statistics", "reference_on", "Measured",
           "MEASURED", "output_statistics", "report_from", "shared_statistics"]
