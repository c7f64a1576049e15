"""``fit``: the training loop, with early stopping, checkpoints, resume, progress and Ctrl-C safety."""
from __future__ import annotations

import math
import random
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from types import FrameType
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from edgekit.errors import BadInputError, bad_choice
from edgekit.progress import StepProgress
from edgekit.schema import check_fields
from edgekit.training.checkpoint import (
    CheckpointError,
    KeepFn,
    Tensors,
    load_checkpoint,
    module_state,
    read_state,
    save_checkpoint,
)

B = TypeVar("B")  # a batch: whatever the technique's loss function takes
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]

SCHEDULES = ("constant", "cosine")
MODES = ("max", "min")


# ----------------------------------------------------------------------------- seeds, batches, schedules


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def array_batches(arrays: dict[str, np.ndarray], batch_size: int, *, seed: int = 0, epoch: int = 0,
                  shuffle: bool = True, device: str = "cpu") -> Iterator[Tensors]:
    """Minibatches of ``arrays`` (axis 0 = sample) as torch tensors; the last one may be
    short. The order depends only on (seed, epoch), so a resumed epoch sees the same batches."""
    if not arrays:
        return
    n = len(next(iter(arrays.values())))
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        yield {k: torch.from_numpy(np.ascontiguousarray(v[idx])).to(device) for k, v in arrays.items()}


def num_batches(n: int, batch_size: int) -> int:
    return max(1, math.ceil(n / batch_size))


def cosine_schedule(total: int, *, warmup: int = 0, floor: float = 0.0) -> Callable[[int], float]:
    """The learning-rate factor of optimizer step k (for ``LambdaLR``): a linear warm-up
    over ``warmup`` steps, then a cosine from 1 down to ``floor`` at step ``total``."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return factor


# ----------------------------------------------------------------------------- what to run


@dataclass(frozen=True)
class FitConfig:
    """How long and how to train (validated on construction).

    epochs: passes over ``batches(epoch)``; steps_per_epoch: its batch count where known
    (progress, the cosine schedule); max_steps: a cap on optimizer steps across epochs.
    lr, weight_decay: AdamW's (when ``fit`` makes the optimizer). schedule: "constant", or
    "cosine" from ``lr`` to 0 over the run (derived from the step count, so a resumed run
    follows the same curve; needs steps_per_epoch or max_steps). grad_clip: max gradient
    norm (None or 0: no clipping). patience: epochs without validation improvement before
    stopping (None: never); mode: "min" (a loss) or "max" (an accuracy). seed: seeds every
    generator at the start (None: leave them as the caller set them).
    """

    epochs: int
    lr: float = 1e-3
    weight_decay: float = 0.0
    schedule: str = "constant"
    steps_per_epoch: int | None = None
    max_steps: int | None = None
    grad_clip: float | None = 1.0
    patience: int | None = None
    mode: str = "min"
    seed: int | None = 0

    def __post_init__(self) -> None:
        check_fields(self)
        if self.epochs < 0:
            raise BadInputError(f"epochs must be >= 0, got {self.epochs}")
        if self.schedule not in SCHEDULES:
            raise BadInputError(f"unknown learning-rate schedule {self.schedule!r} (choose from {', '.join(SCHEDULES)})")
        if self.mode not in MODES:
            raise bad_choice("early-stopping mode", self.mode, MODES)
        if not self.lr > 0:
            raise BadInputError(f"learning rate must be > 0, got {self.lr}")
        for name in ("steps_per_epoch", "max_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BadInputError(f"{name.replace('_', ' ')} must be >= 1, got {value}")

    @property
    def total_steps(self) -> int | None:
        """Optimizer steps of the whole run, where known."""
        known = [x for x in (self.epochs * self.steps_per_epoch if self.steps_per_epoch else None, self.max_steps)
                 if x is not None]
        return min(known) if known else None

    def reached(self, steps: int) -> bool:
        return self.max_steps is not None and steps >= self.max_steps


@dataclass(frozen=True)
class Checkpoints:
    """Where and when ``fit`` writes checkpoints (``edgekit.training.checkpoint``).

    folder: the checkpoint's folder (one checkpoint, replaced as training goes on).
    fingerprint: what the run's result depends on (config, data, model); a checkpoint with
    another fingerprint is not resumed. resume: False starts afresh even from a matching
    one. every: also write one every this many steps (None: at epoch ends and on Ctrl-C
    only). keep: which state-dict entries to save (None: all; LoRA keeps its adapters).
    """

    folder: Path
    fingerprint: str
    resume: bool = True
    every: int | None = None
    keep: KeepFn | None = None


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
        if self.mode not in MODES:
            raise bad_choice("early-stopping mode", self.mode, MODES)

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
    """What ``fit`` did. history: one entry per epoch (train loss, steps, validation value,
    seconds); step_losses: the loss of every optimizer step of the run (a resumed run's
    earlier steps included); train_seconds: time in the step loops of this call.
    resumed_from_step, and resumed_from_epoch (the last epoch the checkpoint had
    finished), are None after a fresh start; discarded_checkpoint says why a checkpoint
    found in the folder was not resumed."""

    epochs_run: int = 0
    steps: int = 0
    best: float | None = None
    best_epoch: int = -1
    stopped_early: bool = False
    resumed_from_epoch: int | None = None
    resumed_from_step: int | None = None
    discarded_checkpoint: str | None = None
    train_seconds: float = 0.0
    history: list[dict[str, float]] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the per-step losses (for manifests)."""
        out = asdict(self)
        del out["step_losses"]
        return out


# ----------------------------------------------------------------------------- the loop


def fit(module: nn.Module, loss_fn: Callable[[B], torch.Tensor], batches: Callable[[int], Iterable[B]],
        config: FitConfig, *, optimizer: torch.optim.Optimizer | None = None,
        params: Iterable[nn.Parameter] | None = None, scheduler: SchedulerFactory | None = None,
        validate: Callable[[], float] | None = None, checkpoints: Checkpoints | None = None,
        train_mode: Callable[[nn.Module], object] = nn.Module.train, progress: bool | None = None,
        description: str = "train") -> FitResult:
    """Train ``module`` by minimising ``loss_fn(batch)`` over ``batches(epoch)``.

    optimizer: the caller's (default: AdamW over ``params``, else over the module's
    trainable parameters). scheduler: a factory ``optimizer -> torch LR scheduler`` (its
    state goes into checkpoints as JSON), stepped so that optimizer step k runs at its
    k-th rate; default: ``config.schedule``. validate(): the value early stopping watches,
    after every epoch, under ``torch.no_grad``; the best epoch's weights are restored at
    the end. checkpoints: see ``Checkpoints``; ``batches(epoch)`` must give the same
    batches again for a resumed epoch. train_mode(module): training mode at the start of
    every epoch (QAT keeps dropout off). progress: False for silence, else a bar or timed
    lines (``StepProgress``). A non-finite loss raises BadInputError. The module is left
    in eval mode.
    """
    run = _Run(module, loss_fn, config, optimizer, params, scheduler, validate, checkpoints, train_mode, description)
    with StepProgress(description, config.total_steps, done=run.result.steps, enabled=progress) as bar, \
            _DeferredInterrupt() as interrupt:
        if run.resumed and checkpoints is not None:
            bar.note(f"resuming at step {run.result.steps} from the checkpoint in {checkpoints.folder}")
        elif run.result.discarded_checkpoint is not None:
            bar.note(f"starting afresh: {run.result.discarded_checkpoint}")
        try:
            for epoch in range(run.at.epoch + 1, config.epochs):
                if run.stopper.should_stop or (config.reached(run.result.steps) and run.at.steps == 0):
                    break
                run.train_epoch(epoch, batches(epoch), bar, interrupt)
                if interrupt.pending:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            run.interrupted()
            raise
        finally:
            module.eval()
    return run.finish()


@dataclass
class _Position:
    """Where a run stands: the last finished epoch, and what is done of the next one."""

    epoch: int = -1
    steps: int = 0
    loss_sum: float = 0.0
    seconds: float = 0.0


class _Run(Generic[B]):
    """The state of one ``fit`` call: the optimizer, the schedule, the position, the best weights."""

    def __init__(self, module: nn.Module, loss_fn: Callable[[B], torch.Tensor], config: FitConfig,
                 optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter] | None,
                 scheduler: SchedulerFactory | None, validate: Callable[[], float] | None,
                 checkpoints: Checkpoints | None, train_mode: Callable[[nn.Module], object], description: str) -> None:
        if config.seed is not None:
            seed_everything(config.seed)
        if optimizer is None:
            chosen = [p for p in (params if params is not None else module.parameters()) if p.requires_grad]
            optimizer = torch.optim.AdamW(chosen, lr=config.lr, weight_decay=config.weight_decay)
        self.module, self.loss_fn, self.config, self.optimizer = module, loss_fn, config, optimizer
        self.validate, self.checkpoints, self.train_mode, self.description = validate, checkpoints, train_mode, description
        self.trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self.schedule = _make_scheduler(config, optimizer, scheduler)
        self.keep = checkpoints.keep if checkpoints is not None else None
        self.stopper = EarlyStopping(patience=config.patience, mode=config.mode)
        self.result = FitResult()
        self.at = _Position()
        self.best_state: Tensors | None = None
        if checkpoints is not None:
            self._resume(checkpoints)
        self.resumed = self.result.resumed_from_step is not None
        self.saved_at = self.result.steps  # the step of this run's newest checkpoint
        self.updating = False  # inside backward / optimizer.step: weights half-updated, not a state to save
        self.epoch_started = time.perf_counter()

    def train_epoch(self, epoch: int, batches: Iterable[B], bar: StepProgress, interrupt: _DeferredInterrupt) -> None:
        """The rest of ``epoch`` (all of it, unless a resumed checkpoint had begun it), then
        validation, the history entry and a checkpoint."""
        config, at, result = self.config, self.at, self.result
        self.train_mode(self.module)
        t0 = self.epoch_started = time.perf_counter()
        for batch in islice(batches, at.steps, None):
            if interrupt.pending:
                raise KeyboardInterrupt
            if config.reached(result.steps):
                break
            value = self._step(batch)
            at.steps += 1
            at.loss_sum += value
            bar.update(result.steps, f"epoch {epoch + 1}/{config.epochs} loss {at.loss_sum / at.steps:.4f}")
            if self.checkpoints is not None and self.checkpoints.every and result.steps % self.checkpoints.every == 0:
                self.save()
        self.module.eval()
        result.train_seconds += time.perf_counter() - t0
        entry = {"epoch": epoch, "train_loss": at.loss_sum / max(at.steps, 1), "steps": at.steps}
        if self.validate is not None:
            with torch.no_grad():
                entry["val"] = float(self.validate())
            if self.stopper.update(entry["val"], epoch):
                self.best_state = module_state(self.module, self.keep)
        entry["seconds"] = round(at.seconds + time.perf_counter() - t0, 3)
        result.history.append(entry)
        self.at = _Position(epoch=epoch)
        self.epoch_started = time.perf_counter()
        if self.checkpoints is not None:
            self.save()

    def _step(self, batch: B) -> float:
        """One optimizer step; returns its loss."""
        if self.schedule is not None:
            _advance(self.schedule, self.result.steps)
        loss = self.loss_fn(batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            group = self.optimizer.param_groups[0]
            raise BadInputError(f"{self.description}: the training loss became {value} at step {self.result.steps}; "
                                f"lower the learning rate ({group.get('initial_lr', group['lr']):g})")
        self.updating = True
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip:
            nn.utils.clip_grad_norm_(self.trainable, self.config.grad_clip)
        self.optimizer.step()
        self.updating = False
        self.result.steps += 1
        self.result.step_losses.append(value)
        return value

    def save(self) -> None:
        assert self.checkpoints is not None
        at, result, stopper = self.at, self.result, self.stopper
        save_checkpoint(self.checkpoints.folder, self.module, self.optimizer, {
            "fingerprint": self.checkpoints.fingerprint, "epoch": at.epoch, "epoch_steps": at.steps,
            "epoch_loss_sum": at.loss_sum, "epoch_seconds": at.seconds + time.perf_counter() - self.epoch_started,
            "steps": result.steps,
            "history": result.history, "step_losses": result.step_losses, "best": stopper.best,
            "best_epoch": stopper.best_epoch, "bad_epochs": stopper.bad_epochs},
            best=self.best_state, scheduler=self.schedule, keep=self.keep)
        self.saved_at = result.steps

    def interrupted(self) -> None:
        """Ctrl-C: checkpoint the last whole step (when newer than the last checkpoint) and say where."""
        if self.checkpoints is None:
            return
        if not self.updating and self.result.steps > self.saved_at:
            self.save()
        if self.resumed or self.saved_at > 0:
            print(f"{self.description}: interrupted at step {self.result.steps}; the checkpoint in "
                  f"{self.checkpoints.folder} resumes it (run the same command again)", file=sys.stderr, flush=True)

    def finish(self) -> FitResult:
        result, stopper = self.result, self.stopper
        result.stopped_early = stopper.should_stop
        result.epochs_run = len(result.history)
        result.best, result.best_epoch = stopper.best, stopper.best_epoch
        result.train_seconds = round(result.train_seconds, 3)
        if self.best_state is not None:
            self.module.load_state_dict(self.best_state, strict=self.keep is None)
        self.module.eval()
        return result

    def _resume(self, checkpoints: Checkpoints) -> None:
        """Load a matching checkpoint into this run, or record why not."""
        folder, result = checkpoints.folder, self.result
        try:
            state = read_state(folder)
            if state is None:
                return
            if not checkpoints.resume:
                result.discarded_checkpoint = f"asked not to resume the checkpoint in {folder}"
                return
            if state.get("fingerprint") != checkpoints.fingerprint:
                result.discarded_checkpoint = f"the checkpoint in {folder} is of another run (other options, data or model)"
                return
            loaded = load_checkpoint(folder, self.module, self.optimizer, scheduler=self.schedule, keep=self.keep)
        except CheckpointError as e:
            result.discarded_checkpoint = f"the checkpoint in {folder} cannot be resumed: {e}"
            return
        assert loaded is not None
        state, self.best_state = loaded
        result.steps = result.resumed_from_step = int(state["steps"])
        last_epoch = int(state["epoch"])
        result.resumed_from_epoch = last_epoch if last_epoch >= 0 else None
        result.history = list(state.get("history", []))
        result.step_losses = [float(v) for v in state.get("step_losses", [])]
        self.stopper.best, self.stopper.best_epoch = state.get("best"), int(state.get("best_epoch", -1))
        self.stopper.bad_epochs = int(state.get("bad_epochs", 0))  # an early-stopped run stays stopped
        self.at = _Position(last_epoch, int(state.get("epoch_steps", 0)), float(state.get("epoch_loss_sum", 0.0)),
                            float(state.get("epoch_seconds", 0.0)))


def _make_scheduler(config: FitConfig, optimizer: torch.optim.Optimizer,
                    scheduler: SchedulerFactory | None) -> LRScheduler | None:
    if scheduler is not None:
        return scheduler(optimizer)
    total = config.total_steps
    if config.schedule == "cosine" and total:
        return LambdaLR(optimizer, cosine_schedule(total))
    return None


def _advance(scheduler: LRScheduler, step: int) -> None:
    """Bring the schedule to optimizer step ``step``: the rate of step k is set just before
    step k (built at step 0, or loaded where a checkpoint left it), so a resumed run
    continues the same curve and the last rate set is the last one used."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()` before", UserWarning)
        while scheduler.last_epoch < step:
            scheduler.step()


class _DeferredInterrupt:
    """While training in the main thread, the first Ctrl-C only sets ``pending``: the loop
    finishes the step in flight, writes a checkpoint and raises KeyboardInterrupt. A
    second Ctrl-C raises at once."""

    def __init__(self) -> None:
        self.pending = False
        self._installed = False
        self._previous: Any = None  # whatever signal.signal returned: a handler, SIG_DFL, or None

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
