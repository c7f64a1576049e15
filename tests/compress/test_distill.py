"""Knowledge distillation: KD loss, chained after pruning, standalone, LM logits, errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_prune import tiny_cnn, tiny_cnn_wide, tiny_llama

from edgekit.compress import StepContext, compress, load_compressed
from edgekit.compress.distill import DistillConfig, distill, evaluate_pair, kd_loss
from edgekit.compress.prune import example_inputs
from edgekit.compress.prune_config import PruneConfig
from edgekit.errors import BadInputError
from edgekit.sources.data import Samples

pytestmark = pytest.mark.usefixtures("one_thread")


def _image_data(teacher, n: int, seed: int, labels: bool = True) -> Samples:
    """Random images labelled by the teacher: a task the student can learn exactly."""
    x = np.random.default_rng(seed).standard_normal((n, 1, 28, 28)).astype(np.float32)
    with torch.no_grad():
        y = teacher.module(torch.from_numpy(x)).argmax(-1).numpy().astype(np.int64)
    return Samples(source=f"synthetic-{seed}", split="train", inputs={"input": x}, labels=y if labels else None)


def test_kd_loss_matches_formula() -> None:
    torch.manual_seed(0)
    s, t = torch.randn(5, 4), torch.randn(5, 4)
    y = torch.tensor([0, 1, 2, 3, 0])
    T, a = 4.0, 0.7
    p_t = torch.softmax(t / T, -1)
    kl = (p_t * (p_t.log() - torch.log_softmax(s / T, -1))).sum(-1).mean()
    want = a * T * T * kl + (1 - a) * torch.nn.functional.cross_entropy(s, y)
    torch.testing.assert_close(kd_loss(s, t, y, T, a), want)
    assert float(kd_loss(t, t, None, T, 1.0)) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(BadInputError, match="needs labels"):
        kd_loss(s, t, None, T, 0.5)


@pytest.mark.parametrize("kw,msg", [({"temperature": 0}, "temperature must be > 0"),
                                    ({"alpha": 1.5}, r"alpha \(weight of the soft loss\) must be in \[0, 1\]"),
                                    ({"epochs": 0}, "epochs must be >= 1")])
def test_config_validation(kw, msg) -> None:
    with pytest.raises(BadInputError, match=msg):
        DistillConfig(**kw)


def test_prune_then_distill_chain_recovers_and_reloads(tmp_path) -> None:
    teacher = tiny_cnn()
    train = _image_data(teacher, 512, seed=1)
    evaluation = _image_data(teacher, 256, seed=2)
    student = tiny_cnn()
    ctx = StepContext(reference=teacher, train=train, eval=evaluation, progress=False,
                      work_dir=tmp_path / "work")
    from edgekit.compress.prune import apply as prune

    prune(student, PruneConfig(ratio=0.5), ctx)
    before = evaluate_pair(teacher, student, evaluation)["student_accuracy"]
    cfg = DistillConfig(epochs=4, lr=3e-3, batch_size=32, patience=None)
    out = compress(student, [("distill", cfg)], tmp_path / "kd", ctx)
    m = ctx.metrics["distill"]
    assert m["eval"]["teacher_accuracy"] == 1.0
    assert m["eval"]["student_accuracy"] > before + 0.1, (before, m)
    assert m["train_samples"] == 461 and m["val_samples"] == 51 and m["validation"] == "accuracy"
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in manifest["steps"]] == ["prune", "distill"]
    assert manifest["steps"][1]["meta"]["fit"]["epochs_run"] == 4
    assert (tmp_path / "work" / "distill" / "state.json").is_file()  # checkpoints for resume
    loaded = load_compressed(out)
    x = example_inputs(teacher, 4)
    with torch.no_grad():
        assert torch.equal(loaded.module(*x), student.module(*x))


def test_distill_beats_hard_labels_only_for_a_smaller_student(tmp_path) -> None:
    teacher = tiny_cnn_wide()
    train, evaluation = _image_data(teacher, 384, seed=3), _image_data(teacher, 256, seed=4)
    kd = distill(teacher, tiny_cnn(), train, DistillConfig(epochs=3, lr=3e-3, batch_size=32, patience=None),
                 eval_data=evaluation, progress=False)
    agree_kd = kd.steps[-1].meta["eval"]["agreement"]
    plain = distill(teacher, tiny_cnn(), train, DistillConfig(epochs=3, lr=3e-3, batch_size=32, alpha=0.0,
                                                              patience=None), eval_data=evaluation, progress=False)
    assert agree_kd >= plain.steps[-1].meta["eval"]["agreement"] - 0.02
    assert agree_kd > 0.3


def test_feature_loss_with_adapter_and_artifact(tmp_path) -> None:
    teacher = tiny_cnn_wide()  # 48 features into its head; the student has 32: a 1x1 adapter bridges them
    train = _image_data(teacher, 128, seed=5)
    out = tmp_path / "student"
    distill(teacher, tiny_cnn(), train, DistillConfig(epochs=1, batch_size=32, feature_loss=True), out,
            eval_data=train, progress=False)
    loaded = load_compressed(out)
    assert loaded.steps[-1].name == "distill"
    assert "adapter" not in " ".join(loaded.module.state_dict())


def test_shape_mismatch_and_missing_labels_are_bad_input() -> None:
    teacher = tiny_cnn()
    other = tiny_cnn()
    other.module.head = torch.nn.Linear(32, 5)
    train = _image_data(teacher, 32, seed=6)
    with pytest.raises(BadInputError, match=r"teacher output shape \(2, 10\) and student output shape \(2, 5\) differ"):
        distill(teacher, other, train, DistillConfig(epochs=1), eval_data=train, progress=False)
    unlabelled = _image_data(teacher, 32, seed=6, labels=False)
    with pytest.raises(BadInputError, match=r"has no labels; the hard-label loss \(alpha 0.7 < 1\) needs them"):
        distill(teacher, tiny_cnn(), unlabelled, DistillConfig(epochs=1), eval_data=unlabelled, progress=False)
    # soft-only distillation needs no labels
    s = distill(teacher, tiny_cnn(), unlabelled, DistillConfig(epochs=1, alpha=1.0), eval_data=unlabelled,
                progress=False)
    assert s.steps[-1].meta["validation"] == "kd_loss"


def test_lm_distillation_on_logits_lowers_kd_gap() -> None:
    teacher = tiny_llama()
    with torch.no_grad():
        teacher.module.model.model.norm.weight.mul_(20.0)  # peaked teacher distributions: a visible gap
    student = tiny_llama()
    from edgekit.compress.prune import apply as prune

    prune(student, PruneConfig(ratio=0.5, scope="mlp"), StepContext())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 96, size=(48, 12)).astype(np.int64)
    data = Samples(source="tokens", split="train", inputs={"input_ids": ids, "attention_mask": np.ones_like(ids)})
    x = (torch.from_numpy(ids), torch.ones(48, 12, dtype=torch.long))

    def gap() -> float:
        with torch.no_grad():
            return float(kd_loss(student.module(*x), teacher.module(*x), None, 1.0, 1.0))

    before = gap()
    distill(teacher, student, data, DistillConfig(epochs=3, lr=1e-2, batch_size=8, alpha=1.0, temperature=1.0, patience=None),
            eval_data=data, progress=False)
    meta = student.steps[-1].meta
    assert meta["validation"] == "nll" and meta["eval"]["student_ppl"] > 1
    assert gap() < 0.75 * before


def test_cli_distill_on_npz_and_resume(tmp_path) -> None:
    from click.testing import CliRunner

    from edgekit.cli import cli

    teacher = tiny_cnn_wide()
    d = _image_data(teacher, 400, seed=7)
    data = tmp_path / "data.npz"
    np.savez(data, input=d.inputs["input"], labels=d.labels)
    out = tmp_path / "kd"
    args = ["distill", "test_prune:tiny_cnn", "--teacher", "test_prune:tiny_cnn_wide",
            "--data", str(data), "--epochs", "1", "--batch-size", "32", "-o", str(out)]
    r = CliRunner().invoke(cli, args, catch_exceptions=False, standalone_mode=False)
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "manifest.json").read_text())["steps"][0]["meta"]
    assert meta["teacher"] == "tiny-cnn" and meta["fit"]["epochs_run"] == 1 and "student_accuracy" in meta["eval"]
    # the same command with more epochs resumes from the checkpoint in OUT.work
    r = CliRunner().invoke(cli, [a if a != "1" else "2" for a in args], catch_exceptions=False,
                           standalone_mode=False)
    assert r.exit_code == 0, r.output
    fit = json.loads((out / "manifest.json").read_text())["steps"][0]["meta"]["fit"]
    assert fit["resumed_from_epoch"] == 0 and fit["epochs_run"] == 2


def test_cli_bad_alpha_exits_2(tmp_path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "edgekit.cli", "distill", "b", "--teacher", "a",
                        "--distill-alpha", "2", "-o", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: alpha (weight of the soft loss) must be in [0, 1], got 2.0"
