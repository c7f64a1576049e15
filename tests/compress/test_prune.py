"""Structured pruning (issue 5): tiny CNN with a residual add and a depthwise conv, tiny Llama."""
from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
import torch
from torch import nn

from edgekit.compress import StepContext, compress, load_compressed, make_config
from edgekit.compress.prune import apply, count_macs, example_inputs, find_output_layers
from edgekit.compress.prune_config import PruneConfig
from edgekit.errors import BadInputError
from edgekit.sources.handle import InputSpec, ModelHandle

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyResNet(nn.Module):
    """conv -> [depthwise 3x3 -> pointwise] + skip -> conv -> pool -> linear head."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.dw = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, groups=width, bias=False),
                                nn.BatchNorm2d(width), nn.ReLU())
        self.pw = nn.Sequential(nn.Conv2d(width, width, 1, bias=False), nn.BatchNorm2d(width))
        self.down = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(2 * width), nn.ReLU())
        self.branch_a = nn.Conv2d(2 * width, width, 1)
        self.branch_b = nn.Conv2d(2 * width, width, 1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(x + self.pw(self.dw(x)))  # residual add couples stem and pw channels
        x = self.down(x)
        x = torch.cat([self.branch_a(x), self.branch_b(x)], 1)  # concatenation
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def tiny_cnn(width: int = 16) -> ModelHandle:
    """Entry point "test_prune:tiny_cnn" (seeded, so the base reloads identically)."""
    torch.manual_seed(0)
    model = TinyResNet(width).eval()
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((4, 1, 28, 28)).astype(np.float32)

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return {"input": np.resize(sample, (batch, 1, 28, 28)).astype(np.float32)}

    return ModelHandle(name="tiny-cnn", source="test_prune:tiny_cnn", kind="image-classifier", module=model,
                       inputs=[InputSpec("input", ("batch", 1, 28, 28))], outputs=["logits"],
                       make_inputs=make_inputs, dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def tiny_cnn_wide() -> ModelHandle:
    h = tiny_cnn(24)
    h.source = "test_prune:tiny_cnn_wide"
    return h


class TinyLM(nn.Module):
    """(input_ids, attention_mask) -> logits around a random-weight Llama."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def tiny_llama() -> ModelHandle:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=True, attn_implementation="eager")
    model = TinyLM(LlamaForCausalLM(cfg).eval()).eval()

    def make_inputs(batch: int = 1, seq: int = 12, **_: int) -> dict[str, np.ndarray]:
        ids = (np.arange(batch * seq).reshape(batch, seq) * 7 % 96).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    return ModelHandle(name="tiny-llama", source="test_prune:tiny_llama", kind="causal-lm", module=model,
                       inputs=[InputSpec("input_ids", ("batch", "seq"), "int64"),
                               InputSpec("attention_mask", ("batch", "seq"), "int64")],
                       outputs=["logits"], make_inputs=make_inputs)


def _run(handle: ModelHandle, batch: int = 2) -> torch.Tensor:
    with torch.no_grad():
        return handle.module(*example_inputs(handle, batch))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("ratio", [0, 1, -0.1, 1.5, True])
def test_ratio_outside_open_interval_is_rejected(ratio: float) -> None:
    with pytest.raises(BadInputError, match=r"pruning ratio must be in \(0, 1\)|ratio: must be a finite number, got True"):
        PruneConfig(ratio=ratio)


def test_bad_importance_lists_choices() -> None:
    with pytest.raises(BadInputError, match="unknown importance 'l3' .*'auto', 'bn-scale', 'l1', 'l2', 'taylor'"):
        PruneConfig(importance="l3")


def test_config_from_registry_rejects_unknown_keys() -> None:
    assert make_config("prune", {"ratio": 0.3, "ignore": ["head"]}).ignore == ("head",)
    with pytest.raises(BadInputError, match=r"ratioo: unknown prune option \(known: calib_batches, .*did you mean .ratio.\?\)"):
        make_config("prune", {"ratioo": 0.3})


# ----------------------------------------------------------------------------- CNN


def test_prune_cnn_keeps_coupled_channels_consistent() -> None:
    h = tiny_cnn()
    before = count_macs(h.module, example_inputs(h))
    apply(h, PruneConfig(ratio=0.5), StepContext())
    m = h.module
    assert m.stem[0].out_channels == 8 == m.pw[0].out_channels  # the residual add ties them
    assert m.dw[0].groups == m.dw[0].in_channels == m.dw[0].out_channels == 8  # depthwise stays depthwise
    assert m.head.out_features == 10  # the classifier head keeps its classes
    assert m.head.in_features == m.branch_a.out_channels + m.branch_b.out_channels  # concatenation
    out = _run(h)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    meta = h.steps[-1].meta
    assert meta["protected"] == ["head"]
    assert meta["macs_after"] < before["macs"] and meta["mac_ratio"] > 2.5
    assert meta["params_after"] < meta["params_before"] == before["params"]
    assert "stem.0" in meta["layers"] and meta["layers"]["stem.0"]["macs_after"] < meta["layers"]["stem.0"]["macs_before"]


def test_round_to_and_global() -> None:
    h = tiny_cnn()
    apply(h, PruneConfig(ratio=0.3, round_to=8), StepContext())
    assert all(c.out_channels % 8 == 0 for c in h.module.modules()
               if isinstance(c, nn.Conv2d) and c.groups == 1)
    g = tiny_cnn()
    apply(g, PruneConfig(ratio=0.5, global_pruning=True, importance="l1"), StepContext())
    assert g.steps[-1].meta["mac_ratio"] > 1.2
    assert _run(g).shape == (2, 10)


@pytest.mark.parametrize("importance", ["taylor", "bn-scale"])
def test_other_importances_and_iterative(importance: str) -> None:
    h = tiny_cnn()
    apply(h, PruneConfig(ratio=0.5, importance=importance, iterative_steps=2), StepContext())
    assert h.module.stem[0].out_channels == 8
    assert _run(h).shape == (2, 10)


def test_ignore_protects_named_layer_and_unknown_name_is_rejected() -> None:
    h = tiny_cnn()
    apply(h, PruneConfig(ratio=0.5, ignore=("down",)), StepContext())
    assert h.module.down[0].out_channels == 32
    assert h.steps[-1].meta["ignored"] == ["down", "down.0", "down.1", "down.2"]
    with pytest.raises(BadInputError, match=r"--ignore 'stemm' names no layer \(layers include: .*stem\.0"):
        apply(tiny_cnn(), PruneConfig(ratio=0.5, ignore=("stemm",)), StepContext())


def test_find_output_layers() -> None:
    h = tiny_cnn()
    assert find_output_layers(h.module, example_inputs(h)) == ["head"]


def test_compress_load_compressed_roundtrip_and_export(tmp_path) -> None:
    import onnxruntime as ort

    h = tiny_cnn()
    out = compress(h, [("prune", PruneConfig(ratio=0.5, round_to=4))], tmp_path / "pruned")
    manifest = json.loads((out / "manifest.json").read_text())
    meta = manifest["steps"][0]["meta"]
    assert meta["shapes"]["stem.0.weight"] == [8, 1, 3, 3] and meta["attrs"]["dw.0"]["groups"] == 8
    assert manifest["metrics"]["prune"]["mac_ratio"] == meta["mac_ratio"]
    loaded = load_compressed(out)
    assert loaded.module.dw[0].groups == 8
    x = example_inputs(h, 3)
    with torch.no_grad():
        assert torch.equal(h.module(*x), loaded.module(*x))
    path = tmp_path / "m.onnx"
    torch.onnx.export(loaded.module.eval(), (x[0][:1],), str(path), input_names=["input"], dynamo=False, opset_version=17)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input": x[0].numpy()[:1]})[0]
    np.testing.assert_allclose(got, h.module(x[0][:1]).detach().numpy(), atol=1e-4)


@pytest.mark.slow
def test_latency_measured_with_target(monkeypatch) -> None:
    """With a target and a timer (the CLI's and pipelines' edgekit.measure.engine_latency), the
    step builds and profiles both engines; without a timer it reports MACs only."""
    from edgekit.measure import engine_latency

    monkeypatch.setattr(importlib.import_module("edgekit.measure"), "LATENCY_SECONDS", 0.05)
    untimed = tiny_cnn()
    apply(untimed, PruneConfig(ratio=0.5), StepContext(target="cpu"))
    assert "latency_before_ms" not in untimed.steps[-1].meta and untimed.steps[-1].meta["mac_ratio"] > 1
    h = tiny_cnn()
    ctx = StepContext(target="cpu", latency=engine_latency)
    apply(h, PruneConfig(ratio=0.5), ctx)
    meta = h.steps[-1].meta
    assert meta["latency_before_ms"] > 0 and meta["latency_after_ms"] > 0 and meta["speedup"] > 0
    assert ctx.metrics["prune"]["speedup"] == meta["speedup"]


# ----------------------------------------------------------------------------- causal LM


def test_llama_mlp_and_heads_pruning_roundtrip(tmp_path) -> None:
    h = tiny_llama()
    ref_cfg = h.module.model.config
    out = compress(h, [("prune", PruneConfig(ratio=0.25, scope="mlp+heads", head_ratio=0.3))], tmp_path / "lm")
    lm = h.module.model
    for layer in lm.model.layers:
        assert layer.mlp.gate_proj.out_features == 48 == layer.mlp.down_proj.in_features
        assert layer.self_attn.q_proj.out_features == 4 * 8 == layer.self_attn.o_proj.in_features
        assert layer.self_attn.k_proj.out_features == 2 * 8  # key/value heads stay (GQA)
        assert layer.self_attn.num_key_value_groups == 2
    assert ref_cfg.intermediate_size == 48 and ref_cfg.num_attention_heads == 4
    assert lm.model.embed_tokens.weight.shape == (96, 48)  # hidden size untouched
    assert h.module.model.lm_head.out_features == 96
    loaded = load_compressed(out)
    x = example_inputs(h, 2)
    with torch.no_grad():
        a, b = h.module(*x), loaded.module(*x)
    assert a.shape == (2, 12, 96) and torch.equal(a, b)
    meta = json.loads((out / "manifest.json").read_text())["steps"][0]["meta"]
    assert meta["hf_config"] == {"intermediate_size": 48, "num_attention_heads": 4}
    assert meta["mac_ratio"] > 1.1


def test_bert_prunes_whole_heads_and_keeps_the_hidden_size(tmp_path) -> None:
    """A BERT sentence encoder: whole attention heads go (query/key/value rows of the same heads,
    the output projection's columns), the intermediate channels too; the hidden size (the pooled
    embedding) stays, although the unused pooler runs after the last layer; reload is exact."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import save_tiny

    from edgekit.loading import load_model

    h = load_model(str(save_tiny("bert", tmp_path)))
    x = example_inputs(h, 2)
    with torch.no_grad():
        before = h.module(*x)
    out = compress(h, [("prune", PruneConfig(ratio=0.25))], tmp_path / "pruned")
    for layer in h.module.model.encoder.layer:
        attn = layer.attention.self
        assert attn.num_attention_heads == 3 and attn.all_head_size == 48 == attn.query.out_features
        assert attn.key.out_features == attn.value.out_features == 48 == layer.attention.output.dense.in_features
        assert layer.intermediate.dense.out_features == 96
    assert h.module.model.embeddings.word_embeddings.embedding_dim == 64
    meta = json.loads((out / "manifest.json").read_text())["steps"][0]["meta"]
    assert meta["heads"] == {f"model.encoder.layer.{i}.attention.self": {"heads": 3} for i in (0, 1)}
    loaded = load_compressed(out)
    with torch.no_grad():
        a, b = h.module(*x), loaded.module(*x)
    assert a.shape == before.shape and torch.equal(a, b)


def test_llama_scope_rejected_for_cnn() -> None:
    with pytest.raises(BadInputError, match="scope 'mlp' is for causal LMs"):
        apply(tiny_cnn(), PruneConfig(ratio=0.5, scope="mlp"), StepContext())


@pytest.mark.slow
def test_fmnist_cnn_prune_distill_export_build(tmp_path) -> None:
    """Real model: prune the Fashion-MNIST CNN 50%, distill briefly, reload, export and build."""
    from edgekit.build import build_engine, load_engine
    from edgekit.runtimes.base import BuildOptions

    steps = [("prune", {"ratio": 0.5, "round_to": 4}), ("distill", {"epochs": 1, "limit": 1500, "eval_limit": 500})]
    ctx = StepContext(train="fashion-mnist", progress=False)
    out = compress("fmnist-cnn", steps, tmp_path / "pd", ctx)
    assert ctx.metrics["prune"]["mac_ratio"] > 3
    assert ctx.metrics["distill"]["eval"]["student_accuracy"] > 0.6
    loaded = load_compressed(out)
    engine_dir = build_engine(out, "cpu", tmp_path / "engine", BuildOptions(threads=1))
    engine = load_engine(engine_dir, threads=1)
    x = example_inputs(loaded, 2)
    got = engine.run({"input": x[0].numpy()})[0]
    engine.close()
    with torch.no_grad():
        np.testing.assert_allclose(got, loaded.module(*x).numpy(), atol=1e-3, rtol=1e-3)
