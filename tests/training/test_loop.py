"""The one training loop: seeds, checkpoints + resume, early stopping, max_steps, schedules, Ctrl-C."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from edgekit.errors import BadInputError
from edgekit.training import (
    Checkpoints,
    EarlyStopping,
    FitConfig,
    array_batches,
    fit,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(np.float32)
    return {"x": x, "y": y}


CONFIG_FIELDS = {f.name for f in dataclasses.fields(FitConfig)}


def _fit(net, data, *, work_dir=None, fingerprint="", **kw):
    """fit() on a regression problem; keywords go to FitConfig or to fit() by name."""
    config = FitConfig(**{k: v for k, v in kw.items() if k in CONFIG_FIELDS})
    checkpoints = Checkpoints(work_dir, fingerprint) if work_dir is not None else None
    return fit(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(),
               lambda epoch: array_batches(data, 16, seed=0, epoch=epoch), config, progress=False,
               checkpoints=checkpoints, **{k: v for k, v in kw.items() if k not in CONFIG_FIELDS})


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
        fit(part, interrupted, lambda epoch: array_batches(data, 16, seed=0, epoch=epoch),
            FitConfig(epochs=3, steps_per_epoch=4, schedule="cosine"),
            optimizer=torch.optim.SGD(part.parameters(), lr=0.1), checkpoints=Checkpoints(tmp_path, "f"),
            progress=False)
    assert json.loads((tmp_path / "state.json").read_text())["epoch"] == 0
    rest = torch.nn.Linear(4, 1)
    opt2 = torch.optim.SGD(rest.parameters(), lr=0.1)
    _fit(rest, data, epochs=3, optimizer=opt2, steps_per_epoch=4, schedule="cosine", work_dir=tmp_path,
         fingerprint="f")
    torch.testing.assert_close(rest.weight, full.weight)
    with pytest.raises(BadInputError, match="unknown learning-rate schedule 'linear'"):
        _fit(rest, data, epochs=1, schedule="linear")


# ----------------------------------------------------------------------------- Ctrl-C, resume mid-epoch, checkpoints


def _dropout_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))


def _interrupting(net, at_call: int, kind: str = "exception"):
    """The regression loss, interrupted at its ``at_call``-th call: a KeyboardInterrupt raised
    inside the step (``exception``) or a real SIGINT delivered to this process (``signal``)."""
    import os
    import signal

    calls = []

    def loss(b):
        calls.append(1)
        if len(calls) == at_call:
            if kind == "exception":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        return ((net(b["x"]) - b["y"]) ** 2).mean()

    return loss


def _run(net, loss, folder, every=None, config=None):
    return fit(net, loss, lambda epoch: array_batches(_problem(), 16, seed=0, epoch=epoch),
               config or FitConfig(epochs=3, lr=0.05, steps_per_epoch=4, schedule="cosine"),
               checkpoints=Checkpoints(folder, "f", every=every), progress=False)


def test_interrupt_mid_epoch_resumes_to_the_uninterrupted_result(tmp_path, capfd) -> None:
    full = _dropout_net()
    want = _run(full, lambda b: ((full(b["x"]) - b["y"]) ** 2).mean(), tmp_path / "full")
    part = _dropout_net()
    with pytest.raises(KeyboardInterrupt):
        _run(part, _interrupting(part, 7), tmp_path / "b")  # 6 steps done: epoch 0 and 2 of epoch 1
    state = json.loads((tmp_path / "b" / "state.json").read_text())
    assert (state["epoch"], state["epoch_steps"], state["steps"]) == (0, 2, 6)
    assert "interrupted at step 6; the checkpoint in" in capfd.readouterr().err
    again = _dropout_net(seed=5)  # another process: other weights and RNG until the checkpoint loads
    got = _run(again, lambda b: ((again(b["x"]) - b["y"]) ** 2).mean(), tmp_path / "b")
    assert got.resumed_from_step == 6 and got.resumed_from_epoch == 0 and got.steps == 12
    for a, b in zip(full.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # dropout masks and the cosine rate continued exactly
    assert got.step_losses == want.step_losses and got.history[1]["train_loss"] == want.history[1]["train_loss"]


@pytest.mark.usefixtures("python_sigint")
def test_real_sigint_finishes_the_step_then_checkpoints(tmp_path) -> None:
    net = _dropout_net()
    with pytest.raises(KeyboardInterrupt):
        _run(net, _interrupting(net, 3, kind="signal"), tmp_path)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["steps"] == 3 and state["epoch_steps"] == 3  # the step in flight was finished, then saved
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored


def test_checkpoint_every_steps_and_one_set_of_files(tmp_path) -> None:
    net = _dropout_net()
    _run(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(), tmp_path, every=3,
         config=FitConfig(epochs=1, lr=0.05, max_steps=3))
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["steps"] == 3 and state["epoch"] == 0 and state["format"] == "edgekit-fit/2"
    names = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.safetensors"))
    assert names == ["optimizer", "rng", "weights"]  # the mid-epoch set was replaced, not kept beside
    assert sorted(state["files"]) == ["optimizer", "rng", "weights"]


@pytest.mark.parametrize("damage,reason", [
    (lambda d: (d / "state.json").write_text("{not json"), "cannot be resumed: its state.json cannot be read"),
    (lambda d: (d / "state.json").write_text(json.dumps({**json.loads((d / "state.json").read_text()),
                                                          "format": "edgekit-fit/1"})),
     "cannot be resumed: it was written in another format ('edgekit-fit/1', not 'edgekit-fit/2')"),
    (lambda d: [p.write_bytes(b"xx") for p in d.glob("weights-*.safetensors")],
     "cannot be resumed: a tensor file cannot be read"),
])
def test_a_damaged_checkpoint_is_reported_and_training_starts_afresh(tmp_path, damage, reason) -> None:
    net = torch.nn.Linear(4, 1)
    _fit(net, _problem(), epochs=1, work_dir=tmp_path, fingerprint="f")
    damage(tmp_path)
    result = _fit(torch.nn.Linear(4, 1), _problem(), epochs=2, work_dir=tmp_path, fingerprint="f")
    assert result.resumed_from_step is None and reason in result.discarded_checkpoint
    assert result.epochs_run == 2 and json.loads((tmp_path / "state.json").read_text())["steps"] == 8


def test_another_run_or_resume_off_starts_afresh_and_says_why(tmp_path) -> None:
    _fit(torch.nn.Linear(4, 1), _problem(), epochs=1, work_dir=tmp_path, fingerprint="a")
    other = _fit(torch.nn.Linear(4, 1), _problem(), epochs=1, work_dir=tmp_path, fingerprint="b")
    assert other.discarded_checkpoint == (f"the checkpoint in {tmp_path} is of another run "
                                          "(other options, data or model)")
    net = torch.nn.Linear(4, 1)
    fresh = fit(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(),
                lambda epoch: array_batches(_problem(), 16, epoch=epoch), FitConfig(epochs=1),
                checkpoints=Checkpoints(tmp_path, "b", resume=False), progress=False)
    assert fresh.resumed_from_step is None and fresh.discarded_checkpoint.startswith("asked not to resume")


def test_keep_saves_only_the_chosen_tensors_and_resumes_them(tmp_path) -> None:
    from safetensors.torch import load_file

    def make():
        torch.manual_seed(0)
        frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        return torch.nn.Sequential(frozen, torch.nn.Linear(4, 1))

    def run(net, epochs):
        return fit(net, lambda b: ((net(b["x"]) - b["y"]) ** 2).mean(),
                   lambda epoch: array_batches(_problem(), 16, epoch=epoch), FitConfig(epochs=epochs, lr=0.05),
                   checkpoints=Checkpoints(tmp_path, "f", keep=lambda k: k.startswith("1.")), progress=False)

    full = make()
    fit(full, lambda b: ((full(b["x"]) - b["y"]) ** 2).mean(), lambda epoch: array_batches(_problem(), 16, epoch=epoch),
        FitConfig(epochs=2, lr=0.05), progress=False)
    run(make(), 1)
    state = json.loads((tmp_path / "state.json").read_text())
    assert set(load_file(str(tmp_path / state["files"]["weights"]))) == {"1.weight", "1.bias"}
    again = make()
    assert run(again, 2).resumed_from_step == 4
    torch.testing.assert_close(again[1].weight, full[1].weight)


def test_torch_scheduler_state_resumes(tmp_path) -> None:
    from torch.optim.lr_scheduler import OneCycleLR

    def run(net, folder, loss=None):
        return fit(net, loss or (lambda b: ((net(b["x"]) - b["y"]) ** 2).mean()),
                   lambda epoch: array_batches(_problem(), 16, epoch=epoch),
                   FitConfig(epochs=3, lr=0.05, steps_per_epoch=4, grad_clip=None),
                   scheduler=lambda opt: OneCycleLR(opt, max_lr=0.05, total_steps=12, pct_start=0.25),
                   checkpoints=Checkpoints(folder, "f"), progress=False)

    torch.manual_seed(0)
    full = torch.nn.Linear(4, 1)
    run(full, tmp_path / "a")
    torch.manual_seed(0)
    part = torch.nn.Linear(4, 1)
    with pytest.raises(KeyboardInterrupt):
        run(part, tmp_path / "b", _interrupting(part, 6))
    assert json.loads((tmp_path / "b" / "state.json").read_text())["scheduler"]["last_epoch"] == 5
    rest = torch.nn.Linear(4, 1)
    run(rest, tmp_path / "b")
    torch.testing.assert_close(rest.weight, full.weight)


def test_non_finite_loss_is_bad_input() -> None:
    net = torch.nn.Linear(4, 1)
    with pytest.raises(BadInputError, match=r"^demo: the training loss became nan at step 0; lower the learning "
                                            r"rate \(0.001\)$"):
        fit(net, lambda b: net(b["x"]).sum() * float("nan"), lambda epoch: array_batches(_problem(), 16),
            FitConfig(epochs=1), progress=False, description="demo")


def test_progress_lines_off_a_terminal() -> None:
    import io

    from edgekit.progress import StepProgress

    out = io.StringIO()
    with StepProgress("train", total=4, enabled=None, interval=0.0, stream=out) as p:
        p.note("resuming at step 1")
        for done in (2, 4):
            p.update(done, f"epoch 1/1 loss {1 / done:.4f}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "train: resuming at step 1"
    assert lines[1].startswith("train: step 2/4 (50%), epoch 1/1 loss 0.5000, elapsed 0:00:0")
    assert ", remaining 0:00:0" in lines[1] and lines[-1].startswith("train: step 4/4 (100%)")
    quiet = io.StringIO()
    with StepProgress("train", total=4, enabled=False, interval=0.0, stream=quiet) as p:
        p.note("x")
        p.update(4)
    assert quiet.getvalue() == ""
    slow = io.StringIO()  # a short run inside the interval writes nothing
    with StepProgress("train", total=None, interval=30.0, stream=slow) as p:
        p.update(1)
    assert slow.getvalue() == ""
