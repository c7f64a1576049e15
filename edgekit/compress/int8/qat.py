"""Quantization-aware training of the fake-quant graph.

Straight-through estimator (``torch.fake_quantize_*`` pass gradients inside the range),
activation scales initialised from calibration and optionally learnable (LSQ), weight
scales following the weights. The loss is cross-entropy on labels when the training
split has them, else distillation against the FP32 model (KL of the softmax outputs for
classifiers, 1 - cosine for encoders). Training runs through ``edgekit.training.fit``,
with a checkpoint in ``ctx.work_dir/int8_qat_<config>/`` after every epoch and every
``CHECKPOINT_STEPS`` steps; a rerun with the same config and data resumes there.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn

from edgekit.artifact import sha256_json
from edgekit.compress import StepContext
from edgekit.compress.int8 import qdq
from edgekit.compress.int8.technique_configs import QatConfig
from edgekit.sources.data import Samples
from edgekit.sources.handle import ModelHandle
from edgekit.training import Checkpoints, FitConfig, fit

CHECKPOINT_STEPS = 200
Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor | None]  # model inputs, labels


def qat_loss(out: torch.Tensor, ref: torch.Tensor | None, labels: torch.Tensor | None,
             evaluator: str | None) -> torch.Tensor:
    """Cross-entropy on labels (plus KL to the FP32 outputs when given); without labels,
    KL to the FP32 softmax, or 1 - cosine for encoders."""
    if labels is not None:
        loss = F.cross_entropy(out.reshape(len(out), -1), labels)
        if ref is not None:
            loss = loss + F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True,
                                   reduction="batchmean")
        return loss
    if ref is None:  # train_qat passes the reference outputs whenever labels are missing
        raise ValueError("QAT's loss needs labels or the float model's outputs")
    if evaluator == "cosine":
        return (1 - F.cosine_similarity(out.reshape(len(out), -1), ref.reshape(len(ref), -1))).mean()
    return F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")


def qat_train_mode(gm: nn.Module) -> None:
    """Training mode for the fake quantizers (learnable scales, weight scales following the
    weights) with dropout kept off: QAT adapts the quantized model, it does not regularise it."""
    gm.train()
    for m in gm.modules():
        if isinstance(m, nn.Dropout):
            m.eval()


def train_qat(gm: fx.GraphModule, reference: nn.Module, handle: ModelHandle, train: Samples, config: QatConfig,
              ctx: StepContext, names: list[str], run_key: dict[str, Any]) -> dict[str, Any]:
    """Fine-tune ``gm`` in place on ``train``; returns what it did (steps, loss, seconds, resumed).
    ``run_key``: what the model before QAT depends on (the whole step config): checkpoints resume
    only a run with the same key, not one whose calibration differed."""
    if config.learnable_scales:
        for m in qdq.act_quants(gm):
            m.make_learnable()
    params = [p for p in gm.parameters() if p.requires_grad]
    bs = int(config.batch_size)
    n = len(train)
    steps_per_epoch = max(1, (n + bs - 1) // bs)
    if config.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, int(config.max_steps))
    labels_all = train.labels
    use_ref = labels_all is None or handle.kind == "image-classifier"
    reference.eval()

    def batches(epoch: int) -> Iterator[Batch]:
        order = np.random.default_rng(ctx.seed + epoch).permutation(n)
        for step in range(steps_per_epoch):
            idx = np.sort(order[step * bs:(step + 1) * bs])
            if len(idx) == 0:
                return
            args = tuple(torch.from_numpy(np.ascontiguousarray(train.inputs[k][idx])) for k in names)
            yield args, (torch.from_numpy(labels_all[idx]) if labels_all is not None else None)

    def loss_fn(batch: Batch) -> torch.Tensor:
        args, labels = batch
        ref = None
        if use_ref:
            with torch.no_grad():
                ref = _first(reference(*args))
        return qat_loss(_first(gm(*args)), ref, labels, handle.evaluator)

    key = sha256_json(run_key)[:12]
    checkpoints = None
    if ctx.work_dir is not None:
        checkpoints = Checkpoints(Path(ctx.work_dir) / f"int8_qat_{key}", every=CHECKPOINT_STEPS, fingerprint=sha256_json(
            {"config": run_key, "model": handle.source, "steps": [s.name for s in handle.steps],
             "data": train.source, "n": n}))
    t0 = time.perf_counter()
    result = fit(gm, loss_fn, batches,
                 FitConfig(epochs=int(config.epochs), lr=float(config.lr), steps_per_epoch=steps_per_epoch,
                           grad_clip=None, seed=None),
                 optimizer=torch.optim.Adam(params, lr=config.lr), checkpoints=checkpoints,
                 train_mode=qat_train_mode, progress=None if ctx.progress else False, description="int8 QAT")
    with torch.no_grad():
        for m in qdq.act_quants(gm):
            if m.learnable:
                m.scale.abs_().clamp_min_(1e-8)
            m.refresh()
    for wq in gm.modules():  # weight scales follow the trained weights
        if isinstance(wq, qdq.WeightQuant):
            wq.update_scale(gm.get_parameter(wq.qname + ".weight"))
    losses = result.step_losses[result.resumed_from_step or 0:]  # this call's steps
    return {"steps": len(losses), "epochs": int(config.epochs), "resumed": result.resumed_from_step is not None,
            "first_loss": round(losses[0], 5) if losses else None,
            "last_loss": round(float(np.mean(losses[-20:])), 5) if losses else None,
            "seconds": round(time.perf_counter() - t0, 2), "train_samples": n}


def _first(out: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out
