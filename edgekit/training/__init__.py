"""One training loop for everything in edgekit that trains: ``fit``.

QAT, distillation, LoRA / QLoRA and the built-in Fashion-MNIST CNN trainer all train
through ``fit``. Each brings its own math (a loss over a batch: the KD loss, the
fake-quantized forward, the adapter layers) and its own batches; the loop brings the rest:
AdamW (or the caller's optimizer), gradient clipping, a learning-rate schedule, validation
with early stopping, checkpoints with resume (``checkpoint.py``: safetensors + JSON, never
a pickle), progress (a bar on a terminal, timed lines in logs) and Ctrl-C safety.

>>> import numpy as np, torch
>>> net = torch.nn.Linear(4, 1)
>>> data = {"x": np.ones((8, 4), "float32"), "y": np.zeros((8, 1), "float32")}
>>> result = fit(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(),
...              lambda epoch: array_batches(data, 4, seed=0, epoch=epoch), FitConfig(epochs=2, lr=0.1),
...              progress=False)
>>> result.epochs_run, result.steps
(2, 4)
"""
from edgekit.training.checkpoint import CheckpointError, load_checkpoint, module_state, read_state, save_checkpoint
from edgekit.training.loop import (
    Checkpoints,
    EarlyStopping,
    FitConfig,
    FitResult,
    array_batches,
    cosine_schedule,
    fit,
    num_batches,
    seed_everything,
)

__all__ = ["CheckpointError", "Checkpoints", "EarlyStopping", "FitConfig", "FitResult", "array_batches",
           "cosine_schedule", "fit", "load_checkpoint", "module_state", "num_batches", "read_state",
           "save_checkpoint", "seed_everything"]
