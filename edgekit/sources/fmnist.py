"""A small real CNN for Fashion-MNIST, trained by edgekit on first use.

``FashionCNN`` is three conv-bn-relu blocks (the first two max-pooled, 28 -> 14 -> 7)
and a linear head on the flattened 7x7 maps, on 1x28x28 inputs. Module names are stable (``features.<i>.conv/bn``, ``classifier``) so
pruning can rebuild shapes from a channel list: ``FashionCNN(channels=(c1, c2, c3))``.

* ``fmnist-cnn``: channels (16, 32, 64), 54,778 parameters, ~1.9M MACs per image;
  91.64% test accuracy after 4 epochs (seed 0): 57 CPU-seconds on one thread.
* ``fmnist-cnn-wide``: channels (32, 64, 128), 155,626 parameters (a distillation teacher).

Weights are trained with a fixed seed on the Fashion-MNIST train split (the calib slice
held out), checked on the 10,000 test images, and cached as safetensors under
``cache_dir()/fmnist/``. ``train_fmnist_cnn`` trains through ``edgekit.training.fit``
(with an optional custom loss); ``fmnist_tensors`` (normalised tensors of a split) and
``accuracy_of`` are public for experiments and benchmarks.

>>> model, info = train_fmnist_cnn(channels=(8, 16, 32), epochs=1, limit=2000)  # doctest: +SKIP
>>> info["test_accuracy"] > 0.6                                                 # doctest: +SKIP
True
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

from edgekit.artifact import atomic_write_bytes, cache_dir, sha256_json
from edgekit.errors import BadInputError, bad_choice
from edgekit.sources.assets import cache_lock
from edgekit.sources.data import DATASETS, FASHION_MNIST_CLASSES, fashion_mnist
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.training import FitConfig, fit

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST train pixel statistics (x / 255)


@dataclass(frozen=True)
class FmnistVariant:
    channels: tuple[int, int, int]
    epochs: int
    description: str


VARIANTS: dict[str, FmnistVariant] = {
    "fmnist-cnn": FmnistVariant((16, 32, 64), 4, "small CNN for Fashion-MNIST (student)"),
    "fmnist-cnn-wide": FmnistVariant((32, 64, 128), 4, "wide CNN for Fashion-MNIST (teacher, 2x channels)"),
}
TRAIN_SEED = 0


class ConvBlock(nn.Sequential):
    """conv 3x3 (no bias) -> batch norm -> ReLU, optionally followed by a 2x2 max-pool."""

    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        layers: list[tuple[str, nn.Module]] = [
            ("conv", nn.Conv2d(cin, cout, 3, padding=1, bias=False)),
            ("bn", nn.BatchNorm2d(cout)),
            ("relu", nn.ReLU(inplace=True)),
        ]
        if pool:
            layers.append(("pool", nn.MaxPool2d(2)))
        super().__init__(OrderedDict(layers))


class FashionCNN(nn.Module):
    """(batch, 1, 28, 28) -> logits (batch, 10).

    features.0: 1->c1 @28x28, pool -> 14x14; features.1: c1->c2, pool -> 7x7;
    features.2: c2->c3 @7x7; flatten; classifier: Linear(c3 * 7 * 7, 10)."""

    def __init__(self, channels: Sequence[int] = (16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        c1, c2, c3 = (int(c) for c in channels)
        self.channels = (c1, c2, c3)
        self.features = nn.Sequential(ConvBlock(1, c1, pool=True), ConvBlock(c1, c2, pool=True),
                                      ConvBlock(c2, c3, pool=False))
        self.classifier = nn.Linear(c3 * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def normalize_images(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 1, 28, 28), (x / 255 - mean) / std."""
    x = images.astype(np.float32) / 255.0
    return ((x - MEAN) / STD)[:, None]


def prepare_fmnist(images: Sequence[np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
    """Raw images (grey or RGB, any size) -> the model's 1x28x28 normalised input."""
    out = []
    for im in images:
        a = np.asarray(im)
        if a.ndim == 3 and a.shape[2] == 1:
            a = a[:, :, 0]
        if a.ndim == 3:  # RGB(A) -> grey
            a = np.asarray(Image.fromarray(np.ascontiguousarray(a[:, :, :3]).astype(np.uint8)).convert("L"))
        if a.shape != (28, 28):
            a = np.asarray(Image.fromarray(a.astype(np.uint8)).resize((28, 28), Image.Resampling.BILINEAR))
        out.append(a.astype(np.uint8))
    return {"input": np.ascontiguousarray(normalize_images(np.stack(out)))}


def fmnist_tensors(split: str, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised (N, 1, 28, 28) float tensor and int64 labels of a Fashion-MNIST split
    (the same splits as ``load_samples("fashion-mnist")``)."""
    raw = DATASETS["fashion-mnist"](split)
    assert raw.images is not None and raw.labels is not None
    x, y = np.asarray(raw.images), np.asarray(raw.labels)
    if limit is not None:
        x, y = x[:limit], y[:limit]
    return torch.from_numpy(normalize_images(x)), torch.from_numpy(y.astype(np.int64))


@torch.no_grad()
def accuracy_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
    was = model.training
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        correct += int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
    model.train(was)
    return correct / max(len(x), 1)


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y, label_smoothing=0.05)


def train_fmnist_cnn(model: nn.Module | None = None, *, channels: Sequence[int] = (16, 32, 64), epochs: int = 4,
                     batch_size: int = 128, lr: float = 3e-3, weight_decay: float = 1e-4, seed: int = TRAIN_SEED,
                     loss_fn: LossFn | None = None, limit: int | None = None, eval_limit: int | None = None,
                     augment: bool = False, threads: int | None = 1, progress: bool | None = None,
                     description: str = "train fmnist-cnn") -> tuple[nn.Module, dict[str, Any]]:
    """Train ``model`` (a new ``FashionCNN(channels)`` if None) on the Fashion-MNIST train
    split with AdamW and a one-cycle schedule (through ``edgekit.training.fit``); returns
    (model in eval mode, info with test_accuracy, seconds, epochs, losses).

    ``loss_fn(model, x, y) -> loss`` replaces the cross-entropy. ``limit`` trains on the
    first ``limit`` images only, ``eval_limit`` tests on the first test images only (tests).
    ``augment``: random 2-pixel shifts and left-right flips (off by default: at 4 epochs
    it slowed convergence, 89.4% after 3 epochs with it versus 91.6% after 4 without). ``threads``: torch threads
    while training (default 1: these small convolutions gain little from a second
    thread, and one thread degrades gracefully on a shared machine; None keeps torch's).
    """
    if epochs < 1 or batch_size < 1 or lr <= 0:
        raise BadInputError(f"epochs, batch_size and lr must be positive (got {epochs}, {batch_size}, {lr})")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(model, channels, epochs, batch_size, lr, weight_decay, seed, loss_fn or cross_entropy_loss,
                      limit, eval_limit, augment, progress, description)
    finally:
        torch.set_num_threads(previous_threads)


def _train(model: nn.Module | None, channels: Sequence[int], epochs: int, batch_size: int, lr: float,
           weight_decay: float, seed: int, loss_fn: LossFn, limit: int | None, eval_limit: int | None,
           augment: bool, progress: bool | None, description: str) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)  # batch order and augmentation, in the order they are drawn
    trained = model if model is not None else FashionCNN(channels)
    x, y = fmnist_tensors("train", limit)
    xt, yt = fmnist_tensors("eval", eval_limit)
    # ~1.5x faster convolutions on CPU; Module.to takes memory_format (torch's overloads omit it)
    trained.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = x.contiguous(memory_format=torch.channels_last)
    sizes = [min(batch_size, len(x) - i) for i in range(0, len(x), batch_size)]

    def batches(epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch_size):
            idx = order[i:i + batch_size]
            yield (_augment(x[idx], gen) if augment else x[idx]), y[idx]

    t0, c0 = time.perf_counter(), time.process_time()
    result = fit(trained, lambda batch: loss_fn(trained, *batch), batches,
                 FitConfig(epochs=epochs, lr=lr, weight_decay=weight_decay, steps_per_epoch=len(sizes),
                           grad_clip=None, seed=None),
                 scheduler=lambda opt: OneCycleLR(opt, max_lr=lr, total_steps=epochs * len(sizes), pct_start=0.25),
                 progress=progress, description=description)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    trained.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]
    losses = []  # per epoch, weighted by batch size (the last batch is short)
    for epoch in range(epochs):
        running = 0.0
        for size, loss in zip(sizes, result.step_losses[epoch * len(sizes):(epoch + 1) * len(sizes)], strict=True):
            running += loss * size
        losses.append(running / len(x))
    acc = accuracy_of(trained, xt, yt)
    return trained, {"test_accuracy": acc, "seconds": round(seconds, 1), "cpu_seconds": round(cpu_seconds, 1),
                     "epochs": epochs, "losses": losses,
                     "train_images": len(x), "seed": seed, "threads": torch.get_num_threads()}


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 2 pixels (zero-padded) and random left-right flips."""
    n = len(x)
    flip = torch.rand(n, generator=gen) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    pad = nn.functional.pad(x, (2, 2, 2, 2), value=-MEAN / STD)
    dx, dy = (int(v) for v in torch.randint(0, 5, (2,), generator=gen))
    return pad[:, :, dy:dy + 28, dx:dx + 28]


# --- cached weights and the zoo handle -------------------------------------------------------------


def weights_path(variant: str) -> Path:
    v = VARIANTS[variant]
    key = sha256_json({"channels": v.channels, "epochs": v.epochs, "seed": TRAIN_SEED, "augment": False,
                       "version": 2})[:12]
    return cache_dir() / "fmnist" / f"{variant}-{key}.safetensors"


def load_fmnist_weights(variant: str, progress: bool | None = None) -> tuple[FashionCNN, dict[str, str]]:
    """The variant's trained model: from the cache, else trained now (and cached)."""
    if variant not in VARIANTS:
        raise bad_choice("Fashion-MNIST model", variant, VARIANTS)
    v = VARIANTS[variant]
    path = weights_path(variant)
    model = FashionCNN(v.channels)
    with cache_lock(path.with_suffix(".lock")):  # two processes train once, not twice
        if not path.is_file():
            trained, info = train_fmnist_cnn(channels=v.channels, epochs=v.epochs, progress=progress,
                                             description=f"train {variant} (first use, cached)")
            meta = {"test_accuracy": f"{info['test_accuracy']:.4f}", "train_seconds": str(info["seconds"]),
                    "train_cpu_seconds": str(info.get("cpu_seconds", "")),
                    "epochs": str(v.epochs), "seed": str(TRAIN_SEED), "threads": str(info["threads"])}
            state = {k: t.contiguous() for k, t in trained.state_dict().items()}
            atomic_write_bytes(path, save(state, metadata=meta))
    with safe_open(str(path), "pt") as f:
        meta = dict(f.metadata() or {})
    model.load_state_dict(load_file(str(path)), strict=True)
    return model.eval(), meta


def fmnist_handle(variant: str, module: nn.Module | None = None) -> ModelHandle:
    """The zoo handle of a Fashion-MNIST CNN (``module`` given: skip loading weights)."""
    meta: dict[str, str] = {}
    if module is None:
        module, meta = load_fmnist_weights(variant)

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        images, _labels = fashion_mnist("test")
        return prepare_fmnist(images[:batch] if batch <= len(images) else np.resize(images, (batch, 28, 28)))

    channels = getattr(module, "channels", VARIANTS[variant].channels)
    extra: dict[str, Any] = {"num_classes": 10, "labels": list(FASHION_MNIST_CLASSES), "channels": list(channels),
                             "params": sum(p.numel() for p in module.parameters()), "eval_batch": 500}
    if meta:
        extra["test_accuracy"] = float(meta.get("test_accuracy", "nan"))
        extra["train_seconds"] = float(meta.get("train_seconds", "nan"))
    return ModelHandle(
        name=variant, source=variant, kind="image-classifier", module=module,
        inputs=[InputSpec("input", ("batch", 1, 28, 28), "float32")], outputs=["logits"],
        make_inputs=make_inputs, prepare=prepare_fmnist,
        default_calib="fashion-mnist", default_eval="fashion-mnist", default_train="fashion-mnist",
        evaluator="accuracy", dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, extra=extra,
    )
