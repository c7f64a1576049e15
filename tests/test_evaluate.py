"""evaluate() and perplexity() on tiny models with known answers (issue 2)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from edgekit.errors import BadInputError
from edgekit.evaluate import agreement_metrics, compare_lm, evaluate, perplexity, reference_outputs
from edgekit.sources.data import Samples
from edgekit.sources.handle import InputSpec, ModelHandle

VOCAB = 50


class UniformLM(nn.Module):
    """Logits all zero: every next token has probability 1 / VOCAB."""

    def forward(self, input_ids, attention_mask):
        return torch.zeros(*input_ids.shape, VOCAB)


class OracleLM(nn.Module):
    """Puts (almost) all mass on the true next token, which it reads from a fixed sequence."""

    def __init__(self, windows: np.ndarray):
        super().__init__()
        self.next = {tuple(w[: i + 1]): w[i + 1] for w in windows for i in range(len(w) - 1)}

    def forward(self, input_ids, attention_mask):
        out = torch.full((*input_ids.shape, VOCAB), -30.0)
        for b, row in enumerate(input_ids.tolist()):
            for i in range(len(row) - 1):
                out[b, i, self.next[tuple(row[: i + 1])]] = 30.0
        return out


def windows(n=4, seqlen=12, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(n, seqlen)).astype(np.int64)


def classifier_samples(n=20, classes=10, labelled=True) -> Samples:
    rng = np.random.default_rng(1)
    y = rng.integers(0, classes, size=n)
    x = np.eye(classes, dtype=np.float32)[y] + 0.01 * rng.standard_normal((n, classes)).astype(np.float32)
    return Samples("synthetic", "eval", {"input": x}, y.astype(np.int64) if labelled else None)


def linear_handle(weight: np.ndarray, evaluator: str | None = None) -> ModelHandle:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(weight))
    return ModelHandle("lin", "lin", kind="image-classifier", module=lin,
                       inputs=[InputSpec("input", ("batch", weight.shape[1]))], evaluator=evaluator)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    assert perplexity(UniformLM(), windows()) == pytest.approx(VOCAB, rel=1e-6)


def test_perplexity_of_an_oracle_is_one():
    w = windows(3, 10)
    assert perplexity(OracleLM(w), w) == pytest.approx(1.0, abs=1e-6)


def test_evaluate_perplexity_reports_the_protocol():
    w = windows(5, 16)
    s = Samples("text", "eval", {"input_ids": w, "attention_mask": np.ones_like(w)},
                meta={"kind": "token-windows", "seqlen": 16})
    m = evaluate(UniformLM(), s)
    assert m["evaluator"] == "perplexity" and m["seqlen"] == 16 and m["windows"] == 5
    assert m["tokens"] == 5 * 15 and m["perplexity"] == pytest.approx(VOCAB)
    assert m["nll"] == pytest.approx(math.log(VOCAB))


def test_perplexity_respects_the_attention_mask():
    w = windows(2, 8)
    mask = np.ones_like(w)
    mask[:, 4:] = 0
    s = Samples("t", "eval", {"input_ids": w, "attention_mask": mask})
    assert evaluate(UniformLM(), s, evaluator="perplexity")["tokens"] == 2 * 3


def test_accuracy_of_identity_and_shifted_classifiers():
    s = classifier_samples()
    assert evaluate(linear_handle(np.eye(10, dtype=np.float32), "accuracy"), s)["accuracy"] == 1.0
    shifted = np.roll(np.eye(10, dtype=np.float32), 1, axis=0)
    m = evaluate(linear_handle(shifted), s, batch_size=7)
    assert m["evaluator"] == "accuracy" and m["accuracy"] == 0.0 and m["n"] == 20


def test_agreement_with_itself_and_with_another_model():
    s = classifier_samples(labelled=False)
    ident = linear_handle(np.eye(10, dtype=np.float32))
    m = evaluate(ident, s, reference=ident)
    assert m["evaluator"] == "agreement" and m["top1_agreement"] == 1.0 and m["mean_kl"] == pytest.approx(0, abs=1e-12)
    other = linear_handle(np.roll(np.eye(10, dtype=np.float32), 1, axis=0))
    m2 = evaluate(other, s, reference=reference_outputs(ident, s))
    assert m2["top1_agreement"] == 0.0 and m2["mean_kl"] > 0


def test_agreement_metrics_top5_and_kl_by_hand():
    ref = np.array([[3.0, 2, 1, 0, 0, 0, 0]])
    model = np.array([[0.0, 3, 2, 1, 0.5, 0.4, 0]])  # ref's top-1 (0) is not in the model's top 5
    m = agreement_metrics(model, ref)
    assert m["top1_agreement"] == 0.0 and m["top5_agreement"] == 0.0
    p = np.exp(ref[0]) / np.exp(ref[0]).sum()
    q = np.exp(model[0]) / np.exp(model[0]).sum()
    assert m["mean_kl"] == pytest.approx(float((p * np.log(p / q)).sum()))


def test_cosine_against_reference():
    s = classifier_samples(labelled=False)
    ident = linear_handle(np.eye(10, dtype=np.float32), "cosine")
    neg = linear_handle(-np.eye(10, dtype=np.float32), "cosine")
    assert evaluate(ident, s, reference=ident)["mean_cosine"] == pytest.approx(1.0)
    m = evaluate(neg, s, reference=ident)
    assert m["mean_cosine"] == pytest.approx(-1.0) and m["min_cosine"] == pytest.approx(-1.0)


class FixedBatchEngine:
    """An engine with a static batch of 4 (like a batch-4 ONNX Runtime session)."""

    inputs = [InputSpec("input", (4, 10))]

    def __init__(self):
        self.seen = []

    def run(self, feeds):
        x = feeds["input"]
        self.seen.append(x.shape[0])
        return [x * 2.0]


def test_engine_with_a_static_batch_gets_padded_batches():
    s = classifier_samples(n=10)
    eng = FixedBatchEngine()
    m = evaluate(eng, s)
    assert eng.seen == [4, 4, 4] and m["accuracy"] == 1.0 and m["n"] == 10


def test_onnx_only_handle_runs_in_onnxruntime(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    w = np.roll(np.eye(10, dtype=np.float32), 1, axis=1)  # x @ w shifts the class by one
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])], "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 10])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [onnx.numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    h = ModelHandle("m", str(path), onnx_path=path, inputs=[InputSpec("input", ("batch", 10))])
    s = classifier_samples()
    assert evaluate(h, s)["accuracy"] == 0.0
    shifted = Samples("s", "eval", s.inputs, (s.labels + 1) % 10)
    assert evaluate(h, shifted)["accuracy"] == 1.0


def test_bad_evaluations_say_why():
    s = classifier_samples(labelled=False)
    ident = linear_handle(np.eye(10, dtype=np.float32))
    with pytest.raises(BadInputError, match="no labels and no reference"):
        evaluate(ident, s)
    with pytest.raises(BadInputError, match="compares against a reference model"):
        evaluate(ident, s, evaluator="cosine")
    with pytest.raises(BadInputError, match="unknown evaluator 'bleu'"):
        evaluate(ident, s, evaluator="bleu")
    with pytest.raises(BadInputError, match="accuracy needs labelled samples"):
        evaluate(ident, s, evaluator="accuracy")
    with pytest.raises(BadInputError, match="2-D integer array"):
        perplexity(UniformLM(), np.zeros((3,), np.float32))
    with pytest.raises(BadInputError, match="cannot evaluate a str"):
        evaluate("model.onnx", classifier_samples())


def test_modules_are_evaluated_in_eval_mode_and_restored():
    net = nn.Sequential(nn.Linear(10, 10), nn.Dropout(0.9))
    net.train()
    s = classifier_samples(labelled=False)
    m = evaluate(net, s, reference=net)  # with dropout active the two runs would disagree
    assert m["top1_agreement"] == 1.0 and m["mean_kl"] == pytest.approx(0, abs=1e-12)
    assert net.training


def _runner(module):
    calls = []

    def run(feeds):
        calls.append(feeds["input_ids"].shape)
        with torch.no_grad():
            return [module(torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])).numpy()]

    return run, calls


def _token_samples(ids: np.ndarray) -> Samples:
    return Samples("windows", "eval", {"input_ids": ids, "attention_mask": np.ones_like(ids)})


def test_compare_lm_against_itself_and_against_an_oracle():
    ids = windows(n=5, seqlen=12)
    run, calls = _runner(UniformLM())
    same = compare_lm(run, run, _token_samples(ids))
    assert calls == [(1, 12)] * 10  # one window at a time, both models
    assert same["windows"] == 5 and same["tokens"] == 60 and same["top1_agreement"] == 1.0
    assert same["mean_kl"] == pytest.approx(0.0, abs=1e-12) and same["max_abs_diff"] == 0.0
    assert same["perplexity"] == pytest.approx(VOCAB) and same["perplexity_ratio"] == pytest.approx(1.0)
    oracle, _ = _runner(OracleLM(ids))
    vs = compare_lm(run, oracle, _token_samples(ids))  # the uniform model against the oracle as reference
    assert vs["perplexity"] == pytest.approx(VOCAB) and vs["perplexity_reference"] == pytest.approx(1.0, abs=1e-6)
    assert vs["perplexity_ratio"] == pytest.approx(VOCAB, rel=1e-5)
    # KL(oracle || uniform) = log V where the oracle knows the next token, 0 at the last position
    assert vs["mean_kl"] == pytest.approx(math.log(VOCAB) * 11 / 12, rel=1e-3)
    assert vs["max_abs_diff"] == 30.0 and vs["ref_max_abs"] == 30.0


def test_compare_lm_says_what_is_wrong():
    run, _ = _runner(UniformLM())
    with pytest.raises(BadInputError, match=r"comparing causal LMs needs token windows \(input_ids\); 'synthetic' "
                                            r"has \['input'\]"):
        compare_lm(run, run, classifier_samples())
    other = lambda feeds: [np.zeros((1, 12, VOCAB + 1), np.float32)]  # noqa: E731
    with pytest.raises(BadInputError, match=r"logits \(1, 12, 50\) and reference logits \(1, 12, 51\) differ"):
        compare_lm(run, other, _token_samples(windows(n=1)))
