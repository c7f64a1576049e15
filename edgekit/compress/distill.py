"""Knowledge distillation: train a student on a teacher's softened outputs.

Loss (Hinton et al. 2015), with T the temperature and alpha the soft weight:

    L = alpha * T^2 * KL(softmax(t / T) || softmax(s / T)) + (1 - alpha) * CE(s, labels)

For a causal LM the logits of every position are distilled and the hard loss is the
next-token cross-entropy. With ``feature_loss`` the student's features entering its
output layer (the penultimate features; the final hidden state of an LM) are also
matched to the teacher's by MSE, through a learned 1x1 adapter when the widths differ
(the adapter is trained alongside and then dropped).

As a chained step (``edgekit compress --prune 0.5 --distill``) the teacher is
``ctx.reference`` (else the reloaded base model: the model before the chain); alone,
``distill(teacher, student, data, config, out_dir)``. Training uses
``edgekit.training.fit``: seeds, progress, checkpoints in the work folder (after every
epoch and on Ctrl-C; resume by running again), early stopping on a validation split
carved from the training split, then a final evaluation on the eval split.

>>> distill("fmnist-cnn-wide", "fmnist-cnn", "fashion-mnist", DistillConfig(epochs=2), "out/kd")  # doctest: +SKIP
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edgekit.artifact import check_output_dir, sha256_json, work_folder
from edgekit.compress import ARTIFACT_LOADERS, Step, StepContext, compress, config_to_dict, step_rewrite
from edgekit.compress.distill_config import DistillConfig as DistillConfig
from edgekit.compress.prune import find_output_layers
from edgekit.errors import BadInputError
from edgekit.sources.data import Samples, load_samples
from edgekit.sources.handle import ModelHandle, StepRecord
from edgekit.sources.models import load_model
from edgekit.training import Checkpoints, FitConfig, array_batches, fit, num_batches, seed_everything

# ----------------------------------------------------------------------------- losses


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor | None, temperature: float,
            alpha: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """alpha * T^2 * KL(p_t || p_s) + (1 - alpha) * CE(student, labels).

    student/teacher: logits (N, C) or (N, L, C); labels: (N,) / (N, L) class ids, -100
    ignored; mask: (N, L) positions that count for the soft loss (None: all)."""
    c = student.shape[-1]
    s = student.reshape(-1, c)
    t = teacher.reshape(-1, c).detach()
    kl = F.kl_div(F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1),
                  reduction="none", log_target=True).sum(-1)
    if mask is not None:
        m = mask.reshape(-1).to(kl.dtype)
        soft = (kl * m).sum() / m.sum().clamp_min(1)
    else:
        soft = kl.mean()
    loss = alpha * temperature**2 * soft
    if alpha < 1:
        if labels is None:
            raise BadInputError("the hard-label loss needs labels (use alpha 1 for soft-only distillation)")
        loss = loss + (1 - alpha) * F.cross_entropy(s, labels.reshape(-1).long(), ignore_index=-100)
    return loss


def _lm_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets aligned with logits[:, t]: ids[:, t+1]; the last position -100."""
    labels = torch.full_like(input_ids, -100)
    labels[:, :-1] = input_ids[:, 1:]
    if attention_mask is not None:
        labels[:, :-1][attention_mask[:, 1:] == 0] = -100
    return labels.long()


class FeatureTap:
    """Captures the input of a layer (the features entering the output layer)."""

    def __init__(self, module: nn.Module, layer_name: str) -> None:
        self.value: torch.Tensor | None = None
        self.handle = module.get_submodule(layer_name).register_forward_hook(self._hook)

    def _hook(self, mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        self.value = args[0]

    def close(self) -> None:
        self.handle.remove()


def make_adapter(student_dim: int, teacher_dim: int, ndim: int) -> nn.Module:
    """A 1x1 adapter from student to teacher width (identity when equal)."""
    if student_dim == teacher_dim:
        return torch.nn.Identity()
    if ndim == 4:
        return torch.nn.Conv2d(student_dim, teacher_dim, 1, bias=False)
    return torch.nn.Linear(student_dim, teacher_dim, bias=False)


# ----------------------------------------------------------------------------- data


def _as_samples(data: str | os.PathLike[str] | Samples | None, handle: ModelHandle, split: str,
                config: DistillConfig, limit: int | None, seed: int) -> Samples:
    if data is not None and not isinstance(data, (str, os.PathLike)):
        return data  # Samples (or anything with .inputs / .labels)
    spec = None if data is None else str(data)
    if spec is None:
        spec = {"train": handle.default_train, "eval": handle.default_eval}.get(split) or handle.default_calib
    samples = load_samples(spec, handle, split=split, seed=seed,
                           seqlen=config.seqlen if handle.kind == "causal-lm" else None)
    if limit is not None and len(samples) > limit:  # a cap, not a demand
        samples = samples.subset(np.arange(limit))
    return samples


def _ordered(handle: ModelHandle, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    names = [i.name for i in handle.inputs]
    missing = [n for n in names if n not in batch]
    if missing:
        raise BadInputError(f"data has no input(s) {missing} for {handle.name} (it has {sorted(batch)})")
    return tuple(batch[n] for n in names)


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    logits = getattr(out, "logits", out)  # a Hugging Face output, or the tensor itself
    if not isinstance(logits, torch.Tensor):
        raise BadInputError(f"distillation needs the model's output as a tensor (or .logits); got {type(logits).__name__}")
    return logits


def check_compatible(teacher: ModelHandle, student: ModelHandle, arrays: dict[str, np.ndarray]) -> None:
    """Teacher and student must map the same inputs to outputs of the same shape."""
    one = {k: torch.from_numpy(np.ascontiguousarray(v[:2])) for k, v in arrays.items()}
    with torch.no_grad():
        t = _logits(teacher.module(*_ordered(teacher, one)))
        s = _logits(student.module(*_ordered(student, one)))
    if tuple(t.shape) != tuple(s.shape):
        raise BadInputError(f"teacher output shape {tuple(t.shape)} and student output shape {tuple(s.shape)} "
                            "differ; distillation needs the same output shape")


# ----------------------------------------------------------------------------- training


def run_distillation(teacher: ModelHandle, student: ModelHandle, train: Samples, evaluation: Samples | None,
                     config: DistillConfig, *, work_dir: Path | None = None, progress: bool | None = None,
                     fingerprint: str = "") -> dict[str, Any]:
    """Distill ``teacher`` into ``student`` (in place) on ``train`` samples; validate on a
    held-out part of them; evaluate both models on ``evaluation``. Returns the metrics."""
    if student.module is None or teacher.module is None:
        raise BadInputError("distillation needs PyTorch teacher and student models (not ONNX-only)")
    is_lm = student.kind == "causal-lm"
    inputs = {k: np.asarray(v) for k, v in train.inputs.items()}
    n = len(next(iter(inputs.values())))
    labels = None if is_lm else (None if train.labels is None else np.asarray(train.labels))
    if not is_lm and labels is None and config.alpha < 1:
        raise BadInputError(f"data {getattr(train, 'source', '')!r} has no labels; the hard-label loss "
                            f"(alpha {config.alpha} < 1) needs them (use --alpha 1 for soft-only distillation)")
    if n < 4:
        raise BadInputError(f"distillation needs at least 4 training samples, got {n}")
    check_compatible(teacher, student, inputs)
    seed_everything(config.seed)
    order = np.random.default_rng(config.seed).permutation(n)
    n_val = max(1, int(round(n * config.val_fraction)))
    tr_idx, va_idx = order[n_val:], order[:n_val]
    arrays = dict(inputs)
    if labels is not None:
        arrays["__labels__"] = labels
    tr = {k: v[tr_idx] for k, v in arrays.items()}
    va = {k: v[va_idx] for k, v in arrays.items()}

    teacher.module.eval()
    for p in teacher.module.parameters():
        p.requires_grad_(False)
    adapter, taps = _feature_taps(teacher, student, inputs) if config.feature_loss else (None, None)
    params = list(student.module.parameters()) + (list(adapter.parameters()) if adapter is not None else [])
    for p in student.module.parameters():
        p.requires_grad_(True)

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        y = batch.pop("__labels__", None)
        with torch.no_grad():
            t = _logits(teacher.module(*_ordered(teacher, batch)))
        s = _logits(student.module(*_ordered(student, batch)))
        mask = batch.get("attention_mask") if is_lm else None
        if is_lm:
            y = _lm_labels(batch[student.inputs[0].name], mask)
        loss = kd_loss(s, t, y, config.temperature, config.alpha, mask=mask)
        if adapter is not None and taps is not None:
            t_feat, s_feat = taps[0].value, taps[1].value
            if t_feat is None or s_feat is None:  # the forward passes above run the hooks
                raise RuntimeError("feature taps saw no forward pass")
            loss = loss + config.feature_weight * F.mse_loss(adapter(s_feat), t_feat.detach())
        return loss

    def validate() -> float:
        if is_lm:
            return _lm_nll(student, va, config.batch_size)
        if labels is not None:
            return _accuracy(student, va, config.batch_size)
        total, count = 0.0, 0
        for b in array_batches(va, config.batch_size, shuffle=False):
            b.pop("__labels__", None)
            t = _logits(teacher.module(*_ordered(teacher, b)))
            s = _logits(student.module(*_ordered(student, b)))
            total += float(kd_loss(s, t, None, config.temperature, 1.0)) * len(s)
            count += len(s)
        return total / max(count, 1)

    fit_config = FitConfig(epochs=config.epochs, lr=config.lr, schedule=config.schedule,
                           steps_per_epoch=num_batches(len(tr_idx), config.batch_size), max_steps=config.max_steps,
                           patience=config.patience, mode="max" if (not is_lm and labels is not None) else "min",
                           seed=config.seed)
    # the adapter trains beside the student: both go into checkpoints
    trained = student.module if adapter is None else nn.ModuleDict({"student": student.module, "adapter": adapter})
    try:
        result = fit(trained, loss_fn,
                     lambda epoch: array_batches(tr, config.batch_size, seed=config.seed, epoch=epoch), fit_config,
                     params=params, validate=validate, progress=progress, description="distill",
                     checkpoints=Checkpoints(work_dir, fingerprint) if work_dir is not None else None)
    finally:
        for tap in taps or ():
            tap.close()
    metrics: dict[str, Any] = {"train_samples": int(len(tr_idx)), "val_samples": int(len(va_idx)),
                               "fit": result.to_dict(), "validation": "nll" if is_lm else
                               ("accuracy" if labels is not None else "kd_loss")}
    if evaluation is not None:
        metrics["eval"] = evaluate_pair(teacher, student, evaluation, config.batch_size)
    return metrics


def _feature_taps(teacher: ModelHandle, student: ModelHandle, inputs: dict[str, np.ndarray]
                  ) -> tuple[nn.Module, tuple[FeatureTap, FeatureTap]]:
    """Hooks on the features entering both output layers, and the adapter between their widths."""
    ex = {k: torch.from_numpy(v[:2]) for k, v in inputs.items()}
    t_head = find_output_layers(teacher.module, _ordered(teacher, ex))
    s_head = find_output_layers(student.module, _ordered(student, ex))
    if not t_head or not s_head:
        raise BadInputError("feature loss needs an output layer (linear/conv head) in teacher and student")
    taps = (FeatureTap(teacher.module, t_head[0]), FeatureTap(student.module, s_head[0]))
    with torch.no_grad():
        teacher.module(*_ordered(teacher, ex))
        student.module(*_ordered(student, ex))
    tf, sf = taps[0].value, taps[1].value
    if tf is None or sf is None:  # the forward passes above run the hooks
        raise RuntimeError("feature taps saw no forward pass")
    axis = 1 if tf.dim() == 4 else -1
    return make_adapter(sf.shape[axis], tf.shape[axis], tf.dim()), taps


def _accuracy(handle: ModelHandle, arrays: dict[str, np.ndarray], batch_size: int) -> float:
    right, total = 0, 0
    with torch.no_grad():
        for b in array_batches(arrays, batch_size, shuffle=False):
            y = b.pop("__labels__")
            pred = _logits(handle.module(*_ordered(handle, b))).argmax(-1)
            right += int((pred == y.long()).sum())
            total += len(y)
    return right / max(total, 1)


def _lm_nll(handle: ModelHandle, arrays: dict[str, np.ndarray], batch_size: int) -> float:
    """Mean next-token negative log-likelihood (exp of it is the perplexity)."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in array_batches(arrays, batch_size, shuffle=False):
            b.pop("__labels__", None)
            logits = _logits(handle.module(*_ordered(handle, b)))
            y = _lm_labels(b[handle.inputs[0].name], b.get("attention_mask"))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), ignore_index=-100,
                                   reduction="sum")
            nll += float(loss)
            count += int((y != -100).sum())
    return nll / max(count, 1)


def evaluate_pair(teacher: ModelHandle, student: ModelHandle, samples: Samples, batch_size: int = 64) -> dict[str, Any]:
    """Accuracy (labelled data) or perplexity (causal LM) of teacher and student, and their
    top-1 agreement."""
    arrays = {k: np.asarray(v) for k, v in samples.inputs.items()}
    out: dict[str, Any] = {"samples": int(len(next(iter(arrays.values()))))}
    if student.kind == "causal-lm":
        out["teacher_ppl"] = round(math.exp(_lm_nll(teacher, arrays, batch_size)), 4)
        out["student_ppl"] = round(math.exp(_lm_nll(student, arrays, batch_size)), 4)
        return out
    if samples.labels is not None:
        lab = {**arrays, "__labels__": np.asarray(samples.labels)}
        out["teacher_accuracy"] = round(_accuracy(teacher, lab, batch_size), 5)
        out["student_accuracy"] = round(_accuracy(student, lab, batch_size), 5)
    agree, total = 0, 0
    with torch.no_grad():
        for b in array_batches(arrays, batch_size, shuffle=False):
            t = _logits(teacher.module(*_ordered(teacher, b))).argmax(-1)
            s = _logits(student.module(*_ordered(student, b))).argmax(-1)
            agree += int((t == s).sum())
            total += t.numel()
    out["agreement"] = round(agree / max(total, 1), 5)
    return out


# ----------------------------------------------------------------------------- step and API


def apply(handle: ModelHandle, config: DistillConfig, ctx: StepContext) -> ModelHandle:
    """The chained step: distill ``ctx.reference`` (the model before the chain) into
    ``handle`` on ``ctx.train`` (a data spec or Samples; None: the model's default)."""
    teacher = ctx.reference if ctx.reference is not None else load_model(handle.source)
    train = _as_samples(ctx.train, handle, "train", config, config.limit, ctx.seed)
    if ctx.eval is not None:
        evaluation = _as_samples(ctx.eval, handle, "eval", config, config.eval_limit, ctx.seed)
    elif ctx.train is None or isinstance(ctx.train, (str, os.PathLike)):
        evaluation = _as_samples(ctx.train, handle, "eval", config, config.eval_limit, ctx.seed)
    else:
        evaluation = None
    # what the run's weights depend on; epochs, max_steps and patience may grow on a resumed run
    same_run = {k: v for k, v in config_to_dict(config).items() if k not in ("epochs", "max_steps", "patience",
                                                                              "eval_limit")}
    fingerprint = sha256_json({"config": same_run, "student": handle.source,
                               "steps": [[s.name, s.config] for s in handle.steps], "data": getattr(train, "source", None),
                               "n": len(next(iter(train.inputs.values())))})
    metrics = run_distillation(teacher, handle, train, evaluation, config,
                               work_dir=Path(ctx.work_dir) / "distill" if ctx.work_dir is not None else None,
                               progress=None if ctx.progress else False, fingerprint=fingerprint)
    metrics["teacher"] = teacher.name
    metrics["data"] = getattr(train, "source", None)
    handle.steps.append(StepRecord("distill", config_to_dict(config), metrics))
    handle.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    ctx.metrics["distill"] = {k: v for k, v in metrics.items() if k != "fit"}
    return handle


def distill(teacher: str | os.PathLike[str] | ModelHandle, student: str | os.PathLike[str] | ModelHandle,
            data: str | os.PathLike[str] | Samples | None, config: DistillConfig | None = None,
            out_dir: str | os.PathLike[str] | None = None, *, eval_data: str | os.PathLike[str] | Samples | None = None,
            work_dir: str | os.PathLike[str] | None = None, progress: bool | None = None) -> ModelHandle:
    """Distill ``teacher`` into ``student`` on ``data`` (a spec such as "fashion-mnist",
    or Samples); with ``out_dir`` write the student as a model artifact (reloadable
    with ``load_compressed``). Returns the trained student handle.

    >>> distill("fmnist-cnn-wide", "fmnist-cnn", "fashion-mnist", DistillConfig(epochs=1))  # doctest: +SKIP
    """
    config = config or DistillConfig()
    if out_dir is not None:
        check_output_dir(out_dir, (teacher, student, data, eval_data))  # before training; the inputs stay
    t = load_model(teacher, loaders=ARTIFACT_LOADERS)
    s = load_model(student, loaders=ARTIFACT_LOADERS)
    # StepContext takes Samples and paths as data too (its annotation says str; to be widened)
    ctx = StepContext(train=data, eval=eval_data, seed=config.seed, reference=t,  # type: ignore[arg-type]
                      work_dir=Path(work_dir) if work_dir is not None else
                      (work_folder(out_dir) if out_dir is not None else None),
                      progress=True if progress is None else progress)
    if out_dir is not None:
        compress(s, [("distill", config)], out_dir, ctx)
        return s
    return apply(s, config, ctx)


STEP = Step("distill", DistillConfig, apply, "knowledge distillation from the model before the chain (or a named teacher)",
            rebuild=None, transitions={"float": "float"}, deliberate=True)
__all__ = ["DistillConfig", "distill", "kd_loss", "run_distillation", "evaluate_pair", "STEP"]
