"""A small, reusable training loop for compression steps (distillation, LoRA, QAT).

What it gives a step, so each technique writes only its loss:

* ``seed_everything(seed)``: Python, NumPy and torch seeds (deterministic batches).
* ``array_batches(arrays, batch_size, seed=, epoch=)``: shuffled minibatches of a dict of
  equally long numpy arrays, as torch tensors; the order depends only on (seed, epoch).
* ``fit(module, loss_fn, batches, ...)``: epochs with a progress bar, AdamW (or your
  optimizer), an optional ``max_steps`` cap, validation after every epoch with early
  stopping (``patience``) and the best weights restored at the end, and a checkpoint
  after every epoch in ``work_dir`` (``last.safetensors`` + ``optimizer.safetensors``
  + ``state.json``; no pickles). Calling ``fit`` again with the same ``work_dir`` and
  ``fingerprint`` resumes after the last finished epoch.

>>> import torch
>>> from edgekit.compress.training import fit, array_batches
>>> net = torch.nn.Linear(4, 1)
>>> data = {"x": np.ones((8, 4), "float32"), "y": np.zeros((8, 1), "float32")}
>>> result = fit(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(),
...              lambda epoch: array_batches(data, 4, seed=0, epoch=epoch), epochs=2, lr=0.1,
...              progress=False)
>>> result.epochs_run
2
"""
from __future__ import annotations

import copy
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError

STATE_FILE = "state.json"
WEIGHTS_FILE = "last.safetensors"
BEST_FILE = "best.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
SCHEDULES = ("constant", "cosine")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def array_batches(arrays: dict[str, np.ndarray], batch_size: int, *, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, device: str = "cpu") -> Iterator[dict[str, Any]]:
    """Minibatches of ``arrays`` (axis 0 = sample) as torch tensors; the last one may be short."""
    import torch

    if not arrays:
        return
    n = len(next(iter(arrays.values())))
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        yield {k: torch.from_numpy(np.ascontiguousarray(v[idx])).to(device) for k, v in arrays.items()}


def num_batches(n: int, batch_size: int) -> int:
    return max(1, math.ceil(n / batch_size))


@dataclass
class EarlyStopping:
    """Tracks a validation metric; ``update`` returns True when it improved.

    mode "min" (a loss) or "max" (an accuracy). ``should_stop`` after ``patience``
    epochs without improvement (patience None or 0: never stops early)."""

    patience: int | None = None
    mode: str = "min"
    min_delta: float = 0.0
    best: float | None = None
    best_epoch: int = -1
    bad_epochs: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise BadInputError(f"unknown early-stopping mode {self.mode!r} (choose from 'max', 'min')")

    def update(self, value: float, epoch: int) -> bool:
        better = self.best is None or (value < self.best - self.min_delta if self.mode == "min"
                                       else value > self.best + self.min_delta)
        if better:
            self.best, self.best_epoch, self.bad_epochs = float(value), epoch, 0
        else:
            self.bad_epochs += 1
        return better

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.bad_epochs >= (self.patience or 0)


@dataclass
class FitResult:
    """What ``fit`` did: per-epoch history (train loss, validation value, seconds)."""

    epochs_run: int = 0
    steps: int = 0
    best: float | None = None
    best_epoch: int = -1
    stopped_early: bool = False
    resumed_from_epoch: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _trainable_state(module: Any) -> dict[str, Any]:
    return {k: v.detach().clone().contiguous() for k, v in module.state_dict().items()}


def save_checkpoint(folder: Path, module: Any, optimizer: Any | None, state: dict[str, Any],
                    best: dict[str, Any] | None = None) -> None:
    """Write ``module``'s weights, the optimizer's tensors and ``state`` (JSON) atomically."""
    from safetensors.torch import save as st_save

    from edgekit.artifact import atomic_write_bytes, atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)

    atomic_write_bytes(folder / WEIGHTS_FILE, st_save(_dedup(module.state_dict())))
    if best is not None:
        atomic_write_bytes(folder / BEST_FILE, st_save(_dedup(best)))
    if optimizer is not None:
        tensors, meta = _optimizer_to_flat(optimizer)
        atomic_write_bytes(folder / OPTIMIZER_FILE, st_save(tensors) if tensors else b"")
        state = {**state, "optimizer": meta}
    atomic_write_json(folder / STATE_FILE, state)


def load_checkpoint(folder: Path, module: Any, optimizer: Any | None) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """Load what ``save_checkpoint`` wrote; returns (state, best weights or None), or None."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / STATE_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        return None
    state = json.loads((folder / STATE_FILE).read_text())
    module.load_state_dict(_restore_tied(module, load_file(str(folder / WEIGHTS_FILE))), strict=True)
    if optimizer is not None and "optimizer" in state and (folder / OPTIMIZER_FILE).is_file():
        raw = (folder / OPTIMIZER_FILE).read_bytes()
        tensors = load_file(str(folder / OPTIMIZER_FILE)) if raw else {}
        optimizer.load_state_dict(_optimizer_from_flat(tensors, state["optimizer"]))
    best = None
    if (folder / BEST_FILE).is_file():
        best = _restore_tied(module, load_file(str(folder / BEST_FILE)))
    return state, best


def _dedup(sd: dict[str, Any]) -> dict[str, Any]:
    """safetensors refuses shared storage (tied weights): keep the first name of each tensor."""
    seen: dict[tuple[int, int], str] = {}
    out = {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else (id(v), 0)
        if key in seen and v.numel():
            continue
        seen[key] = k
        out[k] = v.detach().contiguous()
    return out


def _restore_tied(module: Any, loaded: dict[str, Any]) -> dict[str, Any]:
    """Fill names dropped by ``_dedup`` from the tensor they share storage with."""
    sd = module.state_dict()
    if set(sd) == set(loaded):
        return loaded
    by_ptr = {}
    for k, v in sd.items():
        if k in loaded:
            by_ptr[(v.untyped_storage().data_ptr(), v.storage_offset())] = k
    out = dict(loaded)
    for k, v in sd.items():
        if k not in out:
            src = by_ptr.get((v.untyped_storage().data_ptr(), v.storage_offset()))
            if src is not None:
                out[k] = loaded[src]
    return out


def _optimizer_to_flat(optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    sd = optimizer.state_dict()
    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{pid}.{key}"] = val.detach().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = val
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars,
                     "ids": [str(p) for p in sd["state"]]}


def _optimizer_from_flat(tensors: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = t
    for pid, vals in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(vals)
    return {"state": state, "param_groups": meta["param_groups"]}


def fit(module: Any, loss_fn: Callable[[dict[str, Any]], Any],
        batches: Callable[[int], Iterable[dict[str, Any]]], *, epochs: int,
        lr: float = 1e-3, weight_decay: float = 0.0, optimizer: Any | None = None,
        params: Iterable[Any] | None = None, steps_per_epoch: int | None = None,
        validate: Callable[[], float] | None = None, mode: str = "min", patience: int | None = None,
        max_steps: int | None = None, work_dir: str | Path | None = None, fingerprint: str = "",
        seed: int = 0, progress: bool | None = None, description: str = "train",
        grad_clip: float | None = 1.0, schedule: str = "constant") -> FitResult:
    """Train ``module`` by minimising ``loss_fn(batch)``.

    batches(epoch) yields that epoch's batches (see ``array_batches``). validate()
    returns the value early stopping watches (``mode`` "min" or "max"); the weights of
    the best validated epoch are restored at the end. With ``work_dir``, every epoch
    ends with a checkpoint there and a later call with the same ``fingerprint``
    resumes after the last finished epoch (a different fingerprint starts afresh).
    ``max_steps`` caps the total optimizer steps (across epochs). ``schedule`` "cosine"
    decays the learning rate from ``lr`` to 0 over the run (derived from the step count,
    so a resumed run continues the same curve; needs ``steps_per_epoch`` or
    ``max_steps``). Ctrl-C stops after the current batch with the last epoch's
    checkpoint kept.
    """
    import torch

    from edgekit.progress import progress_bar

    if epochs < 0:
        raise BadInputError(f"epochs must be >= 0, got {epochs}")
    if schedule not in SCHEDULES:
        raise BadInputError(f"unknown learning-rate schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")
    seed_everything(seed)
    trainable = [p for p in (params if params is not None else module.parameters()) if p.requires_grad]
    if optimizer is None:
        optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    stopper = EarlyStopping(patience=patience, mode=mode)
    result = FitResult()
    best_state: dict[str, Any] | None = None
    start_epoch = 0
    folder = Path(work_dir) if work_dir is not None else None
    if folder is not None:
        loaded = _try_resume(folder, module, optimizer, fingerprint)
        if loaded is not None:
            state, best_state = loaded
            start_epoch = int(state["epoch"]) + 1
            result.resumed_from_epoch = int(state["epoch"])
            result.steps = int(state.get("steps", 0))
            result.history = list(state.get("history", []))
            stopper.best, stopper.best_epoch = state.get("best"), int(state.get("best_epoch", -1))
            stopper.bad_epochs = int(state.get("bad_epochs", 0))  # an early-stopped run stays stopped
    import time

    base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
    for g, base in zip(optimizer.param_groups, base_lrs, strict=True):
        g["initial_lr"] = base
    total_steps = min(x for x in (epochs * steps_per_epoch if steps_per_epoch else None, max_steps)
                      if x is not None) if (steps_per_epoch or max_steps) else 0
    for epoch in range(start_epoch, epochs):
        if stopper.should_stop or (max_steps is not None and result.steps >= max_steps):
            break
        module.train()
        t0, total, count = time.perf_counter(), 0.0, 0
        try:
            for batch in progress_bar(batches(epoch), f"{description} {epoch + 1}/{epochs}",
                                      total=steps_per_epoch, enabled=progress):
                if schedule == "cosine" and total_steps:
                    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
                        group["lr"] = base * 0.5 * (1 + math.cos(math.pi * min(result.steps / total_steps, 1.0)))
                loss = loss_fn(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if grad_clip:
                    torch.nn.utils.clip_grad_norm_(trainable, grad_clip)
                optimizer.step()
                total += float(loss.detach())
                count += 1
                result.steps += 1
                if max_steps is not None and result.steps >= max_steps:
                    break
        finally:
            module.eval()
        entry: dict[str, Any] = {"epoch": epoch, "train_loss": total / max(count, 1), "steps": count}
        if validate is not None:
            with torch.no_grad():
                value = float(validate())
            entry["val"] = value
            if stopper.update(value, epoch):
                best_state = _trainable_state(module)
        entry["seconds"] = round(time.perf_counter() - t0, 3)
        result.history.append(entry)
        if folder is not None:
            save_checkpoint(folder, module, optimizer, {
                "fingerprint": fingerprint, "epoch": epoch, "steps": result.steps, "history": result.history,
                "best": stopper.best, "best_epoch": stopper.best_epoch, "bad_epochs": stopper.bad_epochs},
                best=best_state if stopper.best_epoch == epoch else None)
    result.stopped_early = stopper.should_stop
    result.epochs_run = len(result.history)
    result.best, result.best_epoch = stopper.best, stopper.best_epoch
    if best_state is not None:
        module.load_state_dict(best_state, strict=True)
    module.eval()
    return result


def _try_resume(folder: Path, module: Any, optimizer: Any, fingerprint: str) -> tuple[dict[str, Any], Any] | None:
    state_file = folder / STATE_FILE
    if not state_file.is_file():
        return None
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if state.get("fingerprint") != fingerprint:
        return None
    backup = copy.deepcopy(module.state_dict())
    try:
        return load_checkpoint(folder, module, optimizer)
    except Exception:  # a checkpoint of another shape: start afresh
        module.load_state_dict(backup)
        return None
