"""Training checkpoints: tensors in safetensors files, the rest in ``state.json``; never a pickle.

A checkpoint folder holds one checkpoint::

    state.json                      position, history, optimizer groups, scheduler, fingerprint,
                                    and "files": the tensor files below, by group
    weights-<tag>.safetensors       the module's state-dict entries (or the ones ``keep`` accepts)
    best-<tag>.safetensors          weights of the best validated epoch (when validating)
    optimizer-<tag>.safetensors     the optimizer's tensors (moments, step counts)
    rng-<tag>.safetensors           torch's RNG state (dropout masks continue where they were)

Every save writes its tensor files under a fresh tag, then ``state.json`` (atomically)
naming them, then removes the previous tag's files: the folder always holds one whole
checkpoint, even when the process dies mid-write.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from edgekit.artifact import atomic_write_bytes, atomic_write_json

Tensors = dict[str, torch.Tensor]
KeepFn = Callable[[str], bool]

STATE_FILE = "state.json"
FORMAT = "edgekit-fit/2"  # state.json's "format"; checkpoints of another format are not resumed
GROUPS = ("weights", "best", "optimizer", "rng")


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed (damaged, another format, another model shape)."""


def module_state(module: nn.Module, keep: KeepFn | None = None) -> Tensors:
    """Detached copies of ``module``'s state-dict entries (those ``keep`` accepts)."""
    return {k: v.detach().clone().contiguous() for k, v in _entries(module, keep).items()}


def _entries(module: nn.Module, keep: KeepFn | None) -> Tensors:
    return {k: v for k, v in module.state_dict().items() if keep is None or keep(k)}


def read_state(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's ``state.json`` (None when there is none); CheckpointError when damaged."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"its {STATE_FILE} cannot be read ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"its {STATE_FILE} is not a JSON object")
    return state


def save_checkpoint(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                    state: dict[str, Any], best: Tensors | None = None, *, scheduler: LRScheduler | None = None,
                    keep: KeepFn | None = None) -> None:
    """Write ``module``'s weights (the entries ``keep`` accepts), the ``best`` weights,
    the optimizer's and the scheduler's state, torch's RNG state and ``state`` (JSON)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups: dict[str, Tensors] = {"weights": _dedup(_entries(module, keep)), "rng": _rng_state()}
    state = {**state, "format": FORMAT}
    if best is not None:
        groups["best"] = _dedup(best)
    if optimizer is not None:
        groups["optimizer"], state["optimizer"] = _optimizer_to_flat(optimizer)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    tag = secrets.token_hex(4)
    files = {group: f"{group}-{tag}.safetensors" for group in groups}
    for group, tensors in groups.items():
        atomic_write_bytes(folder / files[group], safetensors_bytes(tensors))
    atomic_write_json(folder / STATE_FILE, {**state, "files": files})
    for old in folder.glob("*.safetensors"):
        if old.name.split("-")[0] in GROUPS and old.name not in files.values():
            old.unlink(missing_ok=True)


def load_checkpoint(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    scheduler: LRScheduler | None = None, keep: KeepFn | None = None
                    ) -> tuple[dict[str, Any], Tensors | None] | None:
    """Load what ``save_checkpoint`` wrote into ``module``, ``optimizer`` and ``scheduler``
    and restore torch's RNG state; returns (state, best weights or None), or None when the
    folder holds no checkpoint. CheckpointError when it cannot be resumed (then nothing
    was changed)."""
    folder = Path(folder)
    state = read_state(folder)
    if state is None:
        return None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"it was written in another format ({state.get('format')!r}, not {FORMAT!r})")
    try:
        loaded = {group: load_file(str(folder / name)) for group, name in (state.get("files") or {}).items()}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"a tensor file cannot be read ({e})") from None
    expected = _entries(module, keep)
    weights = _restore_tied(expected, loaded.get("weights", {}))
    _check_fits(weights, expected)
    module.load_state_dict(weights, strict=keep is None)
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(_optimizer_from_flat(loaded.get("optimizer", {}), state["optimizer"]))
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if "rng" in loaded:
        _set_rng_state(loaded["rng"])
    best = _restore_tied(expected, loaded["best"]) if "best" in loaded else None
    return state, best


def _check_fits(weights: Tensors, expected: Tensors) -> None:
    extra, missing = sorted(set(weights) - set(expected)), sorted(set(expected) - set(weights))
    if extra or missing:
        name = (extra or missing)[0]
        raise CheckpointError(f"its weights do not fit the model ({name!r} is {'extra' if extra else 'missing'})")
    for k, v in weights.items():
        if v.shape != expected[k].shape:
            raise CheckpointError(f"its weights do not fit the model ({k} is {tuple(v.shape)}, "
                                  f"the model's {tuple(expected[k].shape)})")


def _dedup(sd: Tensors) -> Tensors:
    """safetensors refuses shared storage (tied weights): keep the first name of each tensor."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), int(v.storage_offset()))
        if v.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v.detach().contiguous()
    return out


def _restore_tied(sd: Tensors, loaded: Tensors) -> Tensors:
    """Fill names of ``sd`` dropped by ``_dedup`` from the tensor they share storage with."""
    by_ptr = {(v.untyped_storage().data_ptr(), v.storage_offset()): k for k, v in sd.items() if k in loaded}
    out = dict(loaded)
    for k, v in sd.items():
        source = by_ptr.get((v.untyped_storage().data_ptr(), v.storage_offset()))
        if k not in out and source is not None:
            out[k] = loaded[source]
    return out


def _optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[Tensors, dict[str, Any]]:
    """An optimizer's state as tensors (``<param id>.<key>``) and JSON (groups, scalars)."""
    sd = optimizer.state_dict()
    tensors: Tensors = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in sd["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{pid}.{key}"] = val.detach().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = val
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_flat(tensors: Tensors, meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = t
    for pid, vals in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(vals)
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_state() -> Tensors:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def _set_rng_state(tensors: Tensors) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[f"cuda.{i}"] for i in range(torch.cuda.device_count()) if f"cuda.{i}" in tensors]
    if cuda and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
