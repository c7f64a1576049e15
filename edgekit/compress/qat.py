"""Quantization-aware training of the fake-quant graph.

Straight-through estimator (``torch.fake_quantize_*`` pass gradients inside the range),
activation scales initialised from calibration and optionally learnable (LSQ), weight
scales following the weights. The loss is cross-entropy on labels when the training
split has them, else distillation against the FP32 model (KL of the softmax outputs for
classifiers, 1 - cosine for encoders). A checkpoint is written to ``ctx.work_dir`` every
epoch and every ``CHECKPOINT_STEPS`` steps; a rerun with the same config resumes there.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from edgekit.compress import config_to_dict, qdq

CHECKPOINT_STEPS = 200


def _loss(out: torch.Tensor, ref: torch.Tensor | None, labels: torch.Tensor | None, evaluator: str | None) -> torch.Tensor:
    if labels is not None:
        loss = F.cross_entropy(out.reshape(len(out), -1), labels)
        if ref is not None:
            loss = loss + F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True,
                                   reduction="batchmean")
        return loss
    assert ref is not None
    if evaluator == "cosine":
        return (1 - F.cosine_similarity(out.reshape(len(out), -1), ref.reshape(len(ref), -1))).mean()
    return F.kl_div(F.log_softmax(out, -1), F.log_softmax(ref, -1), log_target=True, reduction="batchmean")


def train_qat(gm: Any, reference: nn.Module, handle: Any, config: Any, ctx: Any, names: list[str]) -> dict[str, Any]:
    """Fine-tune ``gm`` in place; returns what it did (steps, loss, seconds, resumed)."""
    from edgekit.compress.int8 import load_split
    from edgekit.progress import progress_bar

    train = load_split(handle, ctx, "train", None)
    if config.learnable_scales:
        for m in qdq.act_quants(gm):
            m.make_learnable()
    params = [p for p in gm.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=config.qat_lr)
    key = hashlib.sha256(json.dumps(config_to_dict(config), sort_keys=True).encode()).hexdigest()[:12]
    ckpt = Path(ctx.work_dir) / f"int8_qat_{key}.pt" if ctx.work_dir is not None else None
    start_epoch, start_step, resumed = 0, 0, False
    if ckpt is not None and ckpt.is_file():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        gm.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start_epoch, start_step, resumed = int(state["epoch"]), int(state["step"]), True

    def save(epoch: int, step: int) -> None:
        if ckpt is None:
            return
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"model": gm.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "step": step}, tmp)
        tmp.replace(ckpt)

    bs = int(config.qat_batch_size)
    n = len(train)
    steps_per_epoch = max(1, (n + bs - 1) // bs)
    if config.qat_max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, int(config.qat_max_steps))
    labels_all = train.labels
    use_ref = labels_all is None or handle.kind == "image-classifier"
    reference.eval()
    t0 = time.perf_counter()
    losses: list[float] = []
    total_steps = 0
    for epoch in range(start_epoch, int(config.qat_epochs)):
        rng = np.random.default_rng(ctx.seed + epoch)
        order = rng.permutation(n)
        first = start_step if epoch == start_epoch else 0
        gm.train()
        for m in gm.modules():
            if isinstance(m, nn.Dropout):
                m.eval()
        for step in progress_bar(range(first, steps_per_epoch), f"int8 QAT epoch {epoch + 1}/{config.qat_epochs}",
                                 enabled=ctx.progress and None):
            idx = np.sort(order[step * bs:(step + 1) * bs])
            if len(idx) == 0:
                break
            args = tuple(torch.from_numpy(np.ascontiguousarray(train.inputs[k][idx])) for k in names)
            labels = torch.from_numpy(labels_all[idx]) if labels_all is not None else None
            ref = None
            if use_ref:
                with torch.no_grad():
                    ref = reference(*args)
                    ref = ref[0] if isinstance(ref, (tuple, list)) else ref
            out = gm(*args)
            out = out[0] if isinstance(out, (tuple, list)) else out
            loss = _loss(out, ref, labels, handle.evaluator)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
            total_steps += 1
            if (step + 1) % CHECKPOINT_STEPS == 0:
                save(epoch, step + 1)
        save(epoch + 1, 0)
    gm.eval()
    with torch.no_grad():
        for m in qdq.act_quants(gm):
            if m.learnable:
                m.scale.abs_().clamp_min_(1e-8)
            m.refresh()
    for name, qname in _layers(gm):
        gm.get_submodule(qname).update_scale(qdq._get_attr(gm, name + ".weight"))
    return {"steps": total_steps, "epochs": int(config.qat_epochs), "resumed": resumed,
            "first_loss": round(losses[0], 5) if losses else None,
            "last_loss": round(float(np.mean(losses[-20:])), 5) if losses else None,
            "seconds": round(time.perf_counter() - t0, 2), "train_samples": n}


def _layers(gm: Any) -> list[tuple[str, str]]:
    out = []
    for name, m in gm.named_modules():
        if isinstance(m, qdq.WeightQuant):
            out.append((m.qname, name))
    return out
