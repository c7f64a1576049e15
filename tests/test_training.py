"""The shared training loop (issue 5): seeds, checkpoints + resume, early stopping, max_steps."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from edgekit.compress.training import EarlyStopping, array_batches, fit, load_checkpoint, save_checkpoint
from edgekit.errors import BadInputError

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    return {"x": x, "y": y}


def _fit(net, data, **kw):
    return fit(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(),
               lambda epoch: array_batches(data, 16, seed=0, epoch=epoch), progress=False, **kw)


def test_batches_depend_only_on_seed_and_epoch() -> None:
    data = {"a": np.arange(10)}
    first = [b["a"].tolist() for b in array_batches(data, 4, seed=1, epoch=2)]
    assert first == [b["a"].tolist() for b in array_batches(data, 4, seed=1, epoch=2)]
    assert first != [b["a"].tolist() for b in array_batches(data, 4, seed=1, epoch=3)]
    assert sorted(sum(first, [])) == list(range(10)) and [len(b) for b in first] == [4, 4, 2]


def test_fit_learns_and_is_deterministic() -> None:
    data = _problem()
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 1)
    torch.manual_seed(0)
    b = torch.nn.Linear(4, 1)
    ra = _fit(a, data, epochs=5, lr=0.05)
    _fit(b, data, epochs=5, lr=0.05)
    assert ra.history[-1]["train_loss"] < ra.history[0]["train_loss"] / 2
    assert torch.equal(a.weight, b.weight)
    assert ra.steps == 5 * 4 and ra.epochs_run == 5


def test_max_steps_caps_training() -> None:
    net = torch.nn.Linear(4, 1)
    result = _fit(net, _problem(), epochs=10, max_steps=6)
    assert result.steps == 6 and result.epochs_run == 2


def test_early_stopping_restores_best_weights() -> None:
    net = torch.nn.Linear(4, 1)
    values = iter([0.5, 0.9, 0.4, 0.3, 0.2, 0.1])  # "max" mode: best at epoch 1, then worse
    snapshots = []

    def validate() -> float:
        snapshots.append(net.weight.detach().clone())
        return next(values)

    result = _fit(net, _problem(), epochs=6, lr=0.05, validate=validate, mode="max", patience=2)
    assert result.stopped_early and result.epochs_run == 4 and result.best_epoch == 1 and result.best == 0.9
    assert torch.equal(net.weight, snapshots[1])


def test_checkpoint_and_resume(tmp_path) -> None:
    data = _problem()
    torch.manual_seed(0)
    full = torch.nn.Linear(4, 1)
    _fit(full, data, epochs=4, lr=0.05)

    torch.manual_seed(0)
    part = torch.nn.Linear(4, 1)
    _fit(part, data, epochs=2, lr=0.05, work_dir=tmp_path, fingerprint="run")
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["epoch"] == 1 and state["optimizer"]["param_groups"]
    torch.manual_seed(123)
    again = torch.nn.Linear(4, 1)  # a fresh process: different init, resumed from the checkpoint
    result = _fit(again, data, epochs=4, lr=0.05, work_dir=tmp_path, fingerprint="run")
    assert result.resumed_from_epoch == 1 and result.epochs_run == 4
    torch.testing.assert_close(again.weight, full.weight)  # same as training 4 epochs in one go

    torch.manual_seed(123)
    other = torch.nn.Linear(4, 1)
    fresh = _fit(other, data, epochs=1, lr=0.05, work_dir=tmp_path, fingerprint="another config")
    assert fresh.resumed_from_epoch is None


def test_checkpoint_roundtrip_with_tied_weights(tmp_path) -> None:
    emb = torch.nn.Embedding(5, 3)
    net = torch.nn.Sequential(emb, torch.nn.Linear(3, 5, bias=False))
    net[1].weight = emb.weight  # tied
    opt = torch.optim.AdamW(net.parameters())
    net(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, net, opt, {"epoch": 0})
    copy = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    copy[1].weight = copy[0].weight
    opt2 = torch.optim.AdamW(copy.parameters())
    state, best = load_checkpoint(tmp_path, copy, opt2)
    assert state["epoch"] == 0 and best is None
    assert torch.equal(copy[0].weight, emb.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_bad_values() -> None:
    with pytest.raises(BadInputError, match="early-stopping mode"):
        EarlyStopping(mode="up")
    with pytest.raises(BadInputError, match="epochs must be >= 0"):
        _fit(torch.nn.Linear(4, 1), _problem(), epochs=-1)


def test_cosine_schedule_decays_to_zero_and_resumes_on_the_same_curve(tmp_path) -> None:
    data = _problem()
    torch.manual_seed(0)
    full = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(full.parameters(), lr=0.1)
    _fit(full, data, epochs=3, optimizer=opt, steps_per_epoch=4, schedule="cosine")
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 * (1 + np.cos(np.pi * 11 / 12)))
    torch.manual_seed(0)
    part = torch.nn.Linear(4, 1)
    calls = []

    def interrupted(batch):
        calls.append(1)
        if len(calls) == 6:  # Ctrl-C in the second epoch: the first epoch's checkpoint stays
            raise KeyboardInterrupt
        return ((part(batch["x"]) - batch["y"]) ** 2).mean()

    with pytest.raises(KeyboardInterrupt):
        fit(part, interrupted, lambda epoch: array_batches(data, 16, seed=0, epoch=epoch), epochs=3,
            optimizer=torch.optim.SGD(part.parameters(), lr=0.1), steps_per_epoch=4, schedule="cosine",
            work_dir=tmp_path, fingerprint="f", progress=False)
    assert json.loads((tmp_path / "state.json").read_text())["epoch"] == 0
    rest = torch.nn.Linear(4, 1)
    opt2 = torch.optim.SGD(rest.parameters(), lr=0.1)
    _fit(rest, data, epochs=3, optimizer=opt2, steps_per_epoch=4, schedule="cosine", work_dir=tmp_path,
         fingerprint="f")
    torch.testing.assert_close(rest.weight, full.weight)
    with pytest.raises(BadInputError, match="unknown learning-rate schedule 'linear'"):
        _fit(rest, data, epochs=1, schedule="linear")
