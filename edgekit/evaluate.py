"""Evaluate a model, or an engine, on samples: ``evaluate`` and ``perplexity``; ``evaluate_loss``
for a torch module's training loss on validation data (fine-tuning).

The model is a ``ModelHandle`` (its torch ``module`` runs; an ONNX-only handle runs in
ONNX Runtime on the CPU), a plain ``nn.Module`` (inputs passed positionally in the
samples' order), or any engine with ``run(feeds) -> list[np.ndarray]``. The first
output is the one evaluated (logits or embedding).

Evaluators (``EVALUATORS``):

* ``accuracy``: labelled classifiers; top-1 (and top-5) accuracy against the labels.
  With a reference, the agreement metrics are added.
* ``agreement``: unlabelled classifiers against a reference model: top-1 agreement,
  top-5 agreement (the reference's top-1 class is in the model's top 5), mean
  KL(reference || model) of the softmax outputs.
* ``cosine``: encoders against a reference: mean and minimum cosine similarity of the
  outputs (sentence embeddings), per sample.
* ``detection``: detectors (``evaluate_detection.py``): decoded boxes matched to the
  float model's (IoU >= 0.5) and to ground truth where the data has it: mAP@0.5 per
  class then the mean, score drift of the matched pairs.
* ``perplexity``: causal LMs on non-overlapping token windows (the GPTQ protocol):
  PPL = exp(mean next-token NLL over every predicted token of every window); the
  result names the window size (``seqlen``) and the number of windows and tokens.

>>> from edgekit.sources.models import load_model        # doctest: +SKIP
>>> from edgekit.sources.data import load_samples        # doctest: +SKIP
>>> h = load_model("fmnist-cnn")                           # doctest: +SKIP
>>> evaluate(h, load_samples(None, h, split="eval"))["accuracy"]  # doctest: +SKIP
0.92
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from edgekit.errors import BadInputError, bad_choice
from edgekit.evaluate_detection import evaluate_detector
from edgekit.progress import progress_bar
from edgekit.sources.data import Samples
from edgekit.sources.handle import ModelHandle

if TYPE_CHECKING:  # torch is imported where it runs: ONNX-only evaluations never load it
    import torch

EVALUATORS = ("accuracy", "agreement", "cosine", "perplexity", "detection")
Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
_DEFAULT_BATCH = {"causal-lm": 1, "text-encoder": 32, "image-classifier": 32}


# ----------------------------------------------------------------------------------------------
# Running a model, a module or an engine on a batch of feeds.


def make_runner(model: Any, input_names: list[str] | None = None) -> Runner:
    """A function ``feeds -> [outputs as numpy]`` for a handle, an nn.Module or an engine."""
    if isinstance(model, ModelHandle):
        if model.module is not None:
            return _torch_runner(model.module, [s.name for s in model.inputs] or input_names)
        if model.onnx_path is not None:
            return _onnx_runner(str(model.onnx_path))
        raise BadInputError(f"model {model.name!r} has neither a PyTorch module nor an ONNX file to run")
    if hasattr(model, "run") and callable(model.run):
        engine = model

        def run_engine(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
            return [np.asarray(o) for o in engine.run(feeds)]

        return run_engine
    try:
        import torch

        if isinstance(model, torch.nn.Module):
            return _torch_runner(model, input_names)
    except ImportError:  # pragma: no cover
        pass
    raise BadInputError(f"cannot evaluate a {type(model).__name__}: expected a ModelHandle, an nn.Module, "
                        "or an engine with run(feeds)")


def _torch_runner(module: Any, names: list[str] | None) -> Runner:
    import torch

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        order = names or list(feeds)
        try:
            device = next(module.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])).to(device) for n in order]
        was_training = getattr(module, "training", False)
        if was_training:
            module.eval()  # dropout off, batch-norm running statistics
        try:
            with torch.no_grad():
                out = module(*args)
        finally:
            if was_training:
                module.train()
        if hasattr(out, "logits"):  # a raw Hugging Face model's output
            out = (out.logits,)
        elif isinstance(out, dict):
            out = list(out.values())
        elif isinstance(out, torch.Tensor):
            out = (out,)
        return [o.detach().float().cpu().numpy() if o.dtype in (torch.float16, torch.bfloat16)
                else o.detach().cpu().numpy() for o in out]

    return run


def _onnx_runner(path: str) -> Runner:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(sess.run(None, {n: feeds[n] for n in names if n in feeds}))

    return run


def _fixed_batch(model: Any) -> int | None:
    """The static batch size of an engine (None if its batch axis is dynamic)."""
    inputs = getattr(model, "inputs", None)
    if isinstance(model, ModelHandle) and model.module is not None:
        return None
    if inputs:
        first = inputs[0]
        shape = getattr(first, "shape", None)
        if shape and isinstance(shape[0], int) and shape[0] > 0:
            return int(shape[0])
    return None


def run_batches(model: Any, samples: Samples, batch_size: int | None = None, *, description: str = "evaluate",
                progress: bool | None = None) -> list[np.ndarray]:
    """Run ``model`` over all samples; return the first output for every sample, stacked
    (axis 0 = sample). Engines with a static batch size get padded batches."""
    if len(samples) == 0:
        raise BadInputError(f"no samples to evaluate in {samples.source!r} ({samples.split} split)")
    runner = make_runner(model, list(samples.inputs))
    fixed = _fixed_batch(model)
    bs = fixed or batch_size or _default_batch(model)
    n = len(samples)
    outs: list[np.ndarray] = []
    total = (n + bs - 1) // bs
    enabled = progress if progress is not None else (None if total > 4 else False)  # None: on a terminal
    for feeds in progress_bar(samples.batches(bs), description, total=total, enabled=enabled):
        k = len(next(iter(feeds.values())))
        if fixed and k < fixed:  # pad the last batch of a static-batch engine
            feeds = {name: np.concatenate([v, np.repeat(v[-1:], fixed - k, axis=0)]) for name, v in feeds.items()}
        out = runner(feeds)[0]
        outs.append(np.asarray(out)[:k])
    return outs


def _default_batch(model: Any) -> int:
    if isinstance(model, ModelHandle):
        return int(model.extra.get("eval_batch", _DEFAULT_BATCH.get(model.kind, 16)))
    return 16


# ----------------------------------------------------------------------------------------------
# Metrics (pure numpy: unit-testable on hand-made logits).


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


def topk(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries along the last axis (unordered)."""
    k = min(k, x.shape[-1])
    return np.argpartition(-x, k - 1, axis=-1)[..., :k]


def accuracy_metrics(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    logits = logits.reshape(len(logits), -1)
    out = {"accuracy": float((logits.argmax(-1) == labels).mean())}
    if logits.shape[-1] > 5:
        out["top5_accuracy"] = float((topk(logits, 5) == labels[:, None]).any(-1).mean())
    return out


def agreement_metrics(logits: np.ndarray, ref_logits: np.ndarray) -> dict[str, float]:
    """Top-1 agreement, top-5 agreement (reference top-1 within the model's top 5),
    mean KL(reference || model) in nats, and the largest absolute logit difference."""
    logits = logits.reshape(len(logits), -1)
    ref_logits = ref_logits.reshape(len(ref_logits), -1)
    if logits.shape != ref_logits.shape:
        raise BadInputError(f"model outputs {logits.shape} and reference outputs {ref_logits.shape} differ in shape")
    ref_top1 = ref_logits.argmax(-1)
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"top1_agreement": float((logits.argmax(-1) == ref_top1).mean()),
            "top5_agreement": float((topk(logits, 5) == ref_top1[:, None]).any(-1).mean()),
            "mean_kl": float(kl.mean()),
            "max_abs_diff": float(np.abs(logits.astype(np.float64) - ref_logits).max())}


def cosine_metrics(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    a = out.reshape(len(out), -1).astype(np.float64)
    b = ref.reshape(len(ref), -1).astype(np.float64)
    if a.shape != b.shape:
        raise BadInputError(f"model outputs {a.shape} and reference outputs {b.shape} differ in shape")
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min())}


# Logits rows turned into log-probabilities at once: (tokens x vocabulary) float32 for a whole window
# is 512 MiB for a 262k vocabulary and 512 tokens, and log-softmax would copy it; a chunk of rows is at
# most this many elements (64 MiB). Each row's NLL is the same whatever the chunk.
NLL_CHUNK_ELEMENTS = 1 << 24


def nll_rows(vocab: int) -> int:
    """Rows of (vocab,) logits per chunk of the NLL computation."""
    return max(1, NLL_CHUNK_ELEMENTS // max(int(vocab), 1))


def window_nll(logits: np.ndarray, input_ids: np.ndarray) -> np.ndarray:
    """Next-token NLL (b, t - 1) float32 of one batch of windows, in chunks of positions.
    logits (b, t, vocab), input_ids (b, t): position i predicts token i + 1."""
    import torch

    b, t = input_ids.shape[:2]
    out = np.empty((b, max(t - 1, 0)), dtype=np.float32)
    rows = nll_rows(logits.shape[-1])
    for i in range(b):
        for s in range(0, t - 1, rows):
            e = min(s + rows, t - 1)
            lg = torch.from_numpy(np.ascontiguousarray(logits[i, s:e])).float()
            target = torch.from_numpy(np.ascontiguousarray(input_ids[i, s + 1:e + 1])).long()
            out[i, s:e] = torch.nn.functional.cross_entropy(lg, target, reduction="none").numpy()
    return out


def token_nll(logits: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray | None = None) -> tuple[float, int]:
    """Summed next-token NLL and the number of predicted tokens of one batch of windows.
    logits (b, t, vocab), input_ids (b, t): position i predicts token i + 1."""
    nll = window_nll(logits, input_ids).reshape(-1)
    if attention_mask is not None:
        nll = nll[np.asarray(attention_mask)[:, 1:].reshape(-1).astype(bool)]
    return float(nll.astype(np.float64).sum()), int(nll.size)


def compare_lm(run: Runner, run_reference: Runner, samples: Samples, *, progress: bool | None = None
               ) -> dict[str, Any]:
    """A causal LM against a reference (its float model) on token windows, token by token, one window
    at a time: memory holds one window's logits of each, whatever the number of windows.

    Returns the share of tokens whose top-1 prediction is the reference's (``top1_agreement``; top-5:
    the reference's top-1 within the model's five), mean KL(reference || model) per token, the
    perplexity of each on the windows' next tokens and their ratio, the largest and mean absolute
    logit difference, the largest reference logit, and the per-window cosine of the logits (mean, min).
    ``run`` / ``run_reference``: feeds -> [logits (batch, tokens, vocab), ...] (``make_runner``).
    """
    import torch

    if "input_ids" not in samples.inputs:
        raise BadInputError(f"comparing causal LMs needs token windows (input_ids); {samples.source!r} has "
                            f"{sorted(samples.inputs)}")
    if len(samples) == 0:
        raise BadInputError(f"no windows to compare in {samples.source!r} ({samples.split} split)")
    top1 = top5 = tokens = predicted = 0
    kl = nll = nll_ref = abs_sum = 0.0
    max_diff = ref_max = 0.0
    cosines: list[float] = []
    for feeds in progress_bar(samples.batches(1), "compare", total=len(samples), enabled=progress):
        got = np.asarray(run(feeds)[0], dtype=np.float32)
        ref = np.asarray(run_reference(feeds)[0], dtype=np.float32)
        if got.shape != ref.shape or got.ndim != 3:
            raise BadInputError(f"logits {got.shape} and reference logits {ref.shape} differ in shape (or are not "
                                "(batch, tokens, vocabulary))")
        ids = feeds["input_ids"]
        rows = nll_rows(ref.shape[-1])
        for s in range(0, ref.shape[1], rows):  # log-softmax of a chunk of positions at a time
            g = torch.from_numpy(np.ascontiguousarray(got[0, s:s + rows])).double()
            r = torch.from_numpy(np.ascontiguousarray(ref[0, s:s + rows])).double()
            lg, lr = torch.log_softmax(g, -1), torch.log_softmax(r, -1)
            kl += float((lr.exp() * (lr - lg)).sum())
            best = r.argmax(-1)
            top1 += int((g.argmax(-1) == best).sum())
            top5 += int((g.topk(min(5, g.shape[-1]), -1).indices == best[:, None]).any(-1).sum())
            diff = (g - r).abs()
            max_diff, abs_sum = max(max_diff, float(diff.max())), abs_sum + float(diff.sum())
            ref_max = max(ref_max, float(r.abs().max()))
        tokens += ref.shape[1]
        nll += float(window_nll(got, ids).astype(np.float64).sum())
        nll_ref += float(window_nll(ref, ids).astype(np.float64).sum())
        predicted += ref.shape[1] - 1
        a, b = got.reshape(-1).astype(np.float64), ref.reshape(-1).astype(np.float64)
        cosines.append(float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12)))
    ppl = math.exp(min(nll / max(predicted, 1), 700.0))
    ppl_ref = math.exp(min(nll_ref / max(predicted, 1), 700.0))
    return {"windows": len(samples), "tokens": tokens, "top1_agreement": top1 / max(tokens, 1),
            "top5_agreement": top5 / max(tokens, 1), "mean_kl": kl / max(tokens, 1), "perplexity": ppl,
            "perplexity_reference": ppl_ref, "perplexity_ratio": ppl / ppl_ref, "max_abs_diff": max_diff,
            "mean_abs_diff": abs_sum / max(tokens * ref.shape[-1], 1), "ref_max_abs": ref_max,
            "mean_cosine": float(np.mean(cosines)), "min_cosine": float(np.min(cosines))}


# ----------------------------------------------------------------------------------------------
# Public API.


def perplexity(model: Any, token_windows: np.ndarray | Samples, *, batch_size: int = 1,
               progress: bool | None = None) -> float:
    """Perplexity of a causal LM on non-overlapping token windows: exp(mean token NLL).

    ``model``: a ModelHandle, an nn.Module taking ``(input_ids, attention_mask)`` and
    returning logits, or an engine. ``token_windows``: (n, seqlen) int64, or Samples.

    >>> perplexity(handle, load_samples("wikipedia", handle, split="eval", limit=16))  # doctest: +SKIP
    """
    return _perplexity(model, token_windows, batch_size=batch_size, progress=progress)["perplexity"]


def _perplexity(model: Any, windows: np.ndarray | Samples, *, batch_size: int = 1,
                progress: bool | None = None) -> dict[str, Any]:
    if isinstance(windows, Samples):
        samples = windows
    else:
        ids = np.asarray(windows)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise BadInputError(f"token windows must be a 2-D integer array (windows, seqlen); got {ids.shape} {ids.dtype}")
        ids = ids.astype(np.int64)
        samples = Samples("windows", "eval", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    if "input_ids" not in samples.inputs:
        raise BadInputError(f"perplexity needs token windows (input_ids); {samples.source!r} has {sorted(samples.inputs)}")
    runner = make_runner(model, list(samples.inputs))
    fixed = _fixed_batch(model)
    bs = fixed or batch_size
    total_nll, total_tok = 0.0, 0
    n = len(samples)
    for feeds in progress_bar(samples.batches(bs), "perplexity", total=(n + bs - 1) // bs, enabled=progress):
        k = len(feeds["input_ids"])
        run_feeds = feeds
        if fixed and k < fixed:
            run_feeds = {name: np.concatenate([v, np.repeat(v[-1:], fixed - k, axis=0)]) for name, v in feeds.items()}
        logits = np.asarray(runner(run_feeds)[0])[:k]
        s, c = token_nll(logits, feeds["input_ids"], feeds.get("attention_mask"))
        total_nll += s
        total_tok += c
    mean = total_nll / max(total_tok, 1)
    return {"evaluator": "perplexity", "perplexity": float(math.exp(mean)), "nll": float(mean),
            "windows": n, "seqlen": int(samples.inputs["input_ids"].shape[1]), "tokens": total_tok,
            "protocol": "non-overlapping windows, PPL = exp(mean next-token NLL)"}


def _pick_evaluator(model: Any, samples: Samples, reference: Any, evaluator: str | None) -> str:
    if evaluator is not None:
        if evaluator not in EVALUATORS:
            raise bad_choice("evaluator", evaluator, EVALUATORS)
        return evaluator
    for obj in (model, reference):
        if isinstance(obj, ModelHandle) and obj.evaluator:
            return obj.evaluator
    if samples.meta.get("kind") == "token-windows":
        return "perplexity"
    if samples.labels is not None:
        return "accuracy"
    if reference is not None:
        return "agreement"
    raise BadInputError(f"cannot tell how to evaluate on {samples.source!r}: the samples have no labels and no "
                        f"reference was given (evaluators: {', '.join(EVALUATORS)})")


def reference_outputs(reference: Any, samples: Samples, batch_size: int | None = None,
                      progress: bool | None = None) -> np.ndarray:
    """The reference's first output on every sample (pass it back as ``reference=`` to
    evaluate several variants without rerunning the reference)."""
    if isinstance(reference, np.ndarray):
        return reference
    if isinstance(reference, list | tuple) and reference and isinstance(reference[0], np.ndarray):
        return np.concatenate(list(reference))
    return np.concatenate(run_batches(reference, samples, batch_size, description="reference", progress=progress))


def evaluate(model: Any, samples: Samples, reference: Any = None, *, evaluator: str | None = None,
             batch_size: int | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Evaluate ``model`` on ``samples``; returns a metrics dict (always with "evaluator"
    and "n").

    ``reference``: a model, module or engine to compare against, or its precomputed
    outputs (``reference_outputs``). The evaluator defaults to the handle's, else is
    inferred from the samples (token windows: perplexity; labels: accuracy; a
    reference: agreement).

    >>> evaluate(engine, samples, reference=handle)  # doctest: +SKIP
    {'evaluator': 'agreement', 'n': 363, 'top1_agreement': 0.99, ...}
    """
    if not isinstance(samples, Samples):
        raise BadInputError(f"evaluate() takes Samples (from load_samples), got {type(samples).__name__}")
    name = _pick_evaluator(model, samples, reference, evaluator)
    n = len(samples)
    if n == 0:
        raise BadInputError(f"no samples to evaluate in {samples.source!r} ({samples.split} split)")
    if name == "perplexity":
        out = _perplexity(model, samples, batch_size=batch_size or 1, progress=progress)
        out["n"] = n
        out["source"] = samples.source
        return out
    if name == "detection":
        return evaluate_detector(model, samples, reference, batch_size=batch_size, progress=progress,
                                 runner_of=lambda m: (make_runner(m, list(samples.inputs)), _fixed_batch(m)))
    if name in ("agreement", "cosine") and reference is None:
        raise BadInputError(f"the {name} evaluation compares against a reference model; pass reference=")
    if name == "accuracy" and samples.labels is None:
        raise BadInputError(f"accuracy needs labelled samples; {samples.source!r} has no labels "
                            "(use a labelled data set, or evaluator 'agreement' with a reference)")
    outputs = np.concatenate(run_batches(model, samples, batch_size, progress=progress))
    result: dict[str, Any] = {"evaluator": name, "n": n, "source": samples.source, "split": samples.split}
    if name == "accuracy":
        assert samples.labels is not None
        result.update(accuracy_metrics(outputs, samples.labels))
    if reference is not None:
        ref = reference_outputs(reference, samples, batch_size, progress)
        if len(ref) != n:
            raise BadInputError(f"reference outputs cover {len(ref)} samples; the samples are {n}")
        result.update(cosine_metrics(outputs, ref) if name == "cosine" else agreement_metrics(outputs, ref))
    return result



# ----------------------------------------------------------------------------------------------
# The task loss in torch: what fine-tuning minimises, and its value on validation data.


def sample_count(samples: Samples) -> int:
    """Number of samples (axis 0 of the first input; 0 when there are no inputs)."""
    arrays = list(samples.inputs.values())
    return int(arrays[0].shape[0]) if arrays else 0


def torch_batch(handle: ModelHandle, samples: Samples, idx: np.ndarray) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The samples at ``idx`` as the model's positional input tensors, and their labels (or None)."""
    import torch

    names = [s.name for s in handle.inputs] or list(samples.inputs)
    missing = [n for n in names if n not in samples.inputs]
    if missing:
        raise BadInputError(f"data {getattr(samples, 'source', '?')!r} has inputs {sorted(samples.inputs)}, "
                            f"but the model takes {names}")
    xs = [torch.from_numpy(np.ascontiguousarray(samples.inputs[n][idx])) for n in names]
    labels = samples.labels
    y = torch.from_numpy(np.ascontiguousarray(labels[idx])).long() if labels is not None else None
    return xs, y


def first_output(out: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    """A module's first output (logits)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def task_loss(handle: ModelHandle, out: torch.Tensor, inputs: list[torch.Tensor],
              labels: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Mean loss of one batch and its number of scored targets (tokens or samples): the
    next-token cross-entropy over unmasked positions for a causal LM (``inputs`` =
    input_ids, attention_mask), else the cross-entropy of ``out`` against ``labels``."""
    import torch
    import torch.nn.functional as F

    if handle.kind == "causal-lm":
        ids = inputs[0]
        mask = inputs[1] if len(inputs) > 1 else torch.ones_like(ids)
        logits = out[:, :-1].reshape(-1, out.shape[-1]).float()
        target = ids[:, 1:].reshape(-1).clone()
        target[mask[:, 1:].reshape(-1) == 0] = -100
        n = int((target != -100).sum())
        return F.cross_entropy(logits, target, ignore_index=-100), n
    if labels is None:
        raise BadInputError(f"fine-tuning {handle.name!r} ({handle.kind}) needs labelled data "
                            "(an image classification set such as fashion-mnist, or .npz with labels)")
    return F.cross_entropy(out.float(), labels), int(labels.shape[0])


def evaluate_loss(handle: ModelHandle, samples: Samples, batch_size: int = 8, limit: int | None = None
                  ) -> dict[str, float]:
    """Mean ``task_loss`` of the handle's torch module on ``samples`` (the first ``limit``),
    and the matching task metric: perplexity (exp of the mean token loss) or accuracy."""
    import torch

    module = handle.module
    was_training = module.training
    module.eval()
    n = sample_count(samples) if limit is None else min(limit, sample_count(samples))
    total, count, correct = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            xs, y = torch_batch(handle, samples, np.arange(start, min(n, start + batch_size)))
            out = first_output(module(*xs))
            loss, k = task_loss(handle, out, xs, y)
            total += float(loss) * k
            count += k
            if handle.kind != "causal-lm" and y is not None:
                correct += int((out.argmax(-1) == y).sum())
    module.train(was_training)
    mean = total / max(count, 1)
    if handle.kind == "causal-lm":
        return {"loss": mean, "perplexity": float(math.exp(min(mean, 50.0)))}
    return {"loss": mean, "accuracy": correct / max(count, 1)}
