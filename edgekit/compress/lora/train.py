"""Training the adapters: LoRA's batches, loss and schedule, run by ``edgekit.training.fit``."""
from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.optim.lr_scheduler import LambdaLR

from edgekit.compress.lora.adapters import is_adapter_key
from edgekit.compress.lora.config import LoraConfig
from edgekit.compress.lora.packed import frozen_packed_forwards
from edgekit.errors import BadInputError
from edgekit.evaluate import first_output, sample_count, task_loss, torch_batch
from edgekit.sources.data import Samples
from edgekit.sources.handle import ModelHandle
from edgekit.training import Checkpoints, FitConfig, cosine_schedule, fit

CHECKPOINT_DIR = "lora"  # under the step's work folder; removed once training has finished
Batch = tuple[list[torch.Tensor], torch.Tensor | None]  # model inputs, labels


def train_adapters(handle: ModelHandle, config: LoraConfig, train: Samples, *, seed: int,
                   work_dir: Path | None = None, fingerprint: str = "", resume: bool = True,
                   progress: bool = True) -> dict[str, object]:
    """AdamW over the trainable (adapter) parameters of ``handle.module`` on ``train``, with a
    linear warm-up then a cosine to 10% of ``config.lr``; returns the training metrics.

    Batches are equal (the last partial one of an epoch is dropped), in an order drawn from
    ``seed``. With ``work_dir``, checkpoints (the adapters and the optimizer) go to
    ``work_dir/lora`` every ``config.checkpoint_every`` steps and on Ctrl-C; a run with the
    same fingerprint resumes there, and the folder goes once training has finished.
    """
    module = handle.module
    n = sample_count(train)
    bs = config.batch_size
    if n < bs:
        raise BadInputError(f"training data has {n} sample(s), fewer than one batch of {bs}; "
                            "give more data or a smaller --batch-size")
    per_epoch = n // bs
    total = config.steps or (config.epochs or 1) * per_epoch
    order_rng = np.random.default_rng(seed)
    orders = [order_rng.permutation(n) for _ in range(math.ceil(total / per_epoch))]

    def batches(epoch: int) -> Iterator[Batch]:
        for j in range(per_epoch):
            yield torch_batch(handle, train, orders[epoch][j * bs:(j + 1) * bs])

    def loss_fn(batch: Batch) -> torch.Tensor:
        xs, y = batch
        return task_loss(handle, first_output(module(*xs)), xs, y)[0]

    params = [p for p in module.parameters() if p.requires_grad]
    folder = Path(work_dir) / CHECKPOINT_DIR if work_dir is not None else None
    checkpoints = (Checkpoints(folder, fingerprint, resume=resume, every=config.checkpoint_every or None,
                               keep=is_adapter_key) if folder is not None else None)
    fit_config = FitConfig(epochs=len(orders), lr=config.lr, weight_decay=config.weight_decay,
                           steps_per_epoch=per_epoch, max_steps=total, grad_clip=config.grad_clip or None, seed=None)
    with frozen_packed_forwards(module):
        result = fit(module, loss_fn, batches, fit_config, params=params,
                     scheduler=lambda opt: LambdaLR(opt, cosine_schedule(total, warmup=config.warmup_steps, floor=0.1)),
                     checkpoints=checkpoints, progress=None if progress else False,
                     description=f"LoRA fine-tuning ({len(params)} tensors)")
    if folder is not None and folder.is_dir():  # finished: nothing left to resume
        shutil.rmtree(folder)
    start = result.resumed_from_step or 0
    ran = result.steps - start
    history = result.step_losses
    tail = history[-max(1, min(10, len(history))):]
    return {"steps": result.steps, "resumed_from": start, "train_seconds": round(result.train_seconds, 3),
            "seconds_per_step": round(result.train_seconds / ran, 4) if ran else None,
            "train_loss_first": history[0] if history else None,
            "train_loss_last": float(np.mean(tail)) if tail else None,
            "loss_history": [round(v, 5) for v in history]}
