"""LoRA / QLoRA: adapters on float, packed 4-bit and NF4 bases; merge, fold,
save/reload, resume, bad input. Tiny models (a Linear MLP, a CNN, a 2-layer Llama with
random weights); one real-model smoke test (slow)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edgekit.compress import StepContext, compress, load_compressed, lora
from edgekit.compress.lora import packed
from edgekit.compress.lora import train as lora_train
from edgekit.errors import BadInputError
from edgekit.sources.data import Samples
from edgekit.sources.handle import InputSpec, ModelHandle


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; 1 thread avoids spin-waiting under load
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------------------------------------
# Tiny models with reloadable sources (entry points into this module)


def tiny_llama() -> ModelHandle:
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgekit.sources.hf import CausalLMWrapper

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).eval()
    model.config.use_cache = False
    axes = {0: "batch", 1: "sequence"}

    def make_inputs(batch: int = 1, sequence: int | None = None, **_: int) -> dict[str, np.ndarray]:
        ids = _pattern_windows(batch, int(sequence or 16), seed=99)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids)}

    return ModelHandle(name="tiny-llama", source="test_lora:tiny_llama", kind="causal-lm",
                       module=CausalLMWrapper(model).eval(), make_inputs=make_inputs,
                       inputs=[InputSpec("input_ids", ("batch", "sequence"), "int64"),
                               InputSpec("attention_mask", ("batch", "sequence"), "int64")],
                       outputs=["logits"], evaluator="perplexity",
                       dynamic_axes={"input_ids": dict(axes), "attention_mask": dict(axes), "logits": dict(axes)})


def tiny_mlp() -> ModelHandle:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    return ModelHandle(name="tiny-mlp", source="test_lora:tiny_mlp", kind="image-classifier", module=module,
                       inputs=[InputSpec("input", ("batch", 16), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def tiny_cnn() -> ModelHandle:
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),  # depthwise: not adapted by default
        nn.Conv2d(8, 16, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4)).eval()
    return ModelHandle(name="tiny-cnn", source="test_lora:tiny_cnn", kind="image-classifier", module=module,
                       inputs=[InputSpec("input", ("batch", 1, 12, 12), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def _pattern_windows(n: int, seqlen: int, seed: int) -> np.ndarray:
    """Arithmetic token sequences mod 64: learnable structure for a tiny LM."""
    rng = np.random.default_rng(seed)
    step = rng.integers(1, 4, size=(n, 1))
    start = rng.integers(0, 64, size=(n, 1))
    return ((start + step * np.arange(seqlen)) % 64).astype(np.int64)


def text_samples(n: int, seed: int, split: str = "train", seqlen: int = 16) -> Samples:
    ids = _pattern_windows(n, seqlen, seed)
    return Samples("pattern-text", split, {"input_ids": ids, "attention_mask": np.ones_like(ids)},
                   meta={"kind": "token-windows", "seqlen": seqlen})


def labelled(n: int, shape: tuple[int, ...], seed: int, split: str = "train") -> Samples:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    flat = x.reshape(n, -1)
    y = (flat[:, : flat.shape[1] // 2].mean(1) > 0).astype(np.int64) + 2 * (flat[:, ::3].mean(1) > 0)
    return Samples("rule-data", split, {"input": x}, labels=y, meta={"kind": "arrays"})


def _ctx(train: Samples, val: Samples, tmp_path: Path | None = None) -> StepContext:
    return StepContext(train=lora.LoadedData(train), eval=lora.LoadedData(val), progress=False,
                       work_dir=tmp_path)


def _logits(handle: ModelHandle, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return handle.module(torch.from_numpy(ids), torch.ones(ids.shape, dtype=torch.int64))


def _int4(group_size: int = 16, bits: int = 4) -> dict:
    return {"method": "rtn", "bits": bits, "group_size": group_size}


# ---------------------------------------------------------------------------------------------
# Config and bad input


@pytest.mark.parametrize("r", [0, -2])
def test_rank_must_be_positive(r: int) -> None:
    with pytest.raises(BadInputError, match=rf"LoRA rank must be a positive integer, got {r}"):
        lora.LoraConfig(r=r)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(BadInputError, match="give --steps .* or --epochs"):
        lora.LoraConfig(steps=3, epochs=1)
    with pytest.raises(BadInputError, match="unknown QLoRA base 'int3'"):
        lora.LoraConfig(qlora=True, qlora_base="int3")
    with pytest.raises(BadInputError, match="nf4 always merges"):
        lora.LoraConfig(qlora=True, qlora_base="nf4", merge=False)
    assert lora.LoraConfig(targets="q_proj, v_proj").targets == ("q_proj", "v_proj")


def test_targets_matching_nothing_list_candidates() -> None:
    h = tiny_llama()
    with pytest.raises(BadInputError) as e:
        lora.resolve_targets(h, ["qkv"], "float")
    msg = str(e.value)
    assert "\n" not in msg
    assert "LoRA target 'qkv' matches no adaptable module; candidates: q_proj, k_proj, v_proj, o_proj" in msg
    with pytest.raises(BadInputError, match=r"names LlamaRMSNorm, not an adaptable layer"):
        lora.resolve_targets(h, ["input_layernorm"], "float")


def test_default_targets() -> None:
    names = lora.resolve_targets(tiny_llama(), (), "float")
    assert len(names) == 2 * 7 and all(n.split(".")[-1] in lora.TRANSFORMER_TARGETS for n in names)
    assert lora.resolve_targets(tiny_cnn(), (), "float") == ["0", "4", "8"]  # depthwise conv "2" skipped
    assert lora.resolve_targets(tiny_llama(), ["layers\\.0\\..*_proj"], "float")[0].endswith("layers.0.self_attn.q_proj")


def test_data_too_small_for_one_batch() -> None:
    h = tiny_mlp()
    cfg = lora.LoraConfig(steps=2, batch_size=8)
    with pytest.raises(BadInputError, match="training data has 3 sample\\(s\\), fewer than one batch of 8"):
        lora.apply(h, cfg, _ctx(labelled(3, (16,), 0), labelled(4, (16,), 1, "eval")))


def test_plain_lora_on_packed_model_asks_for_qlora_and_qlora_needs_packed() -> None:
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import STEP as INT4

    packed = INT4.apply(tiny_llama(), WeightOnlyConfig(**_int4()), StepContext(progress=False))
    ctx = _ctx(text_samples(8, 0), text_samples(4, 1, "eval"))
    with pytest.raises(BadInputError, match="has packed 4-bit weights: add --qlora"):
        lora.apply(packed, lora.LoraConfig(steps=1), ctx)
    with pytest.raises(BadInputError, match="run `edgekit compress MODEL --bits 4 -o Q`"):
        lora.apply(tiny_llama(), lora.LoraConfig(steps=1, qlora=True), ctx)


def test_adapter_that_does_not_fit() -> None:
    h = tiny_mlp()
    lora.inject(h, lora.LoraConfig(r=4), ["0", "2"], "float")
    state = lora.adapter_state(h.module)
    other = tiny_mlp()
    lora.inject(other, lora.LoraConfig(r=2), ["0", "2"], "float")
    with pytest.raises(BadInputError, match=r"0.lora_A.default.weight is \(4, 16\) in the adapter but \(2, 16\)"):
        lora.load_adapter(other, state)
    only_first = tiny_mlp()
    lora.inject(only_first, lora.LoraConfig(r=4), ["0"], "float")
    with pytest.raises(BadInputError, match="it has no LoRA layer '2'"):
        lora.load_adapter(only_first, state)


# ---------------------------------------------------------------------------------------------
# Float LoRA (peft)


def test_lora_float_mlp_trains_merges_and_reloads(tmp_path: Path) -> None:
    from edgekit.finetune import finetune

    base = tiny_mlp()
    w0 = base.module[0].weight.detach().clone()
    out = finetune(base, labelled(64, (16,), 0), {"r": 4, "steps": 30, "lr": 2e-2, "batch_size": 8, "dropout": 0.0},
                   tmp_path / "ft", eval_data=labelled(32, (16,), 1, "eval"))
    m = json.loads((out / "manifest.json").read_text())
    lm = m["metrics"]["lora"]
    assert lm["trainable_params"] == 4 * (16 + 32) + 4 * (32 + 4)
    assert lm["after"]["loss"] < lm["before"]["loss"]
    assert lm["after_merge"]["loss"] == pytest.approx(lm["after"]["loss"], rel=1e-5)  # merge is exact
    assert m["steps"][-1]["meta"]["merged"] is True and m["files"]["adapter"] == "adapter.safetensors"
    reloaded = load_compressed(out)
    assert isinstance(reloaded.module[0], nn.Linear)  # merged: plain base structure again
    assert not torch.equal(reloaded.module[0].weight, w0)
    assert m["metrics"]["final"]["accuracy"] == pytest.approx(lm["after_merge"]["accuracy"])
    from safetensors.torch import load_file

    assert set(load_file(str(out / "adapter.safetensors"))) == {
        f"{i}.lora_{ab}.default.weight" for i in (0, 2) for ab in "AB"}


def test_lora_float_llama_unmerged_roundtrip(tmp_path: Path) -> None:
    h = tiny_llama()
    cfg = lora.LoraConfig(r=4, steps=6, lr=1e-2, batch_size=4, merge=False, dropout=0.0)
    out = compress(h, [("lora", cfg)], tmp_path / "m", _ctx(text_samples(16, 0), text_samples(4, 1, "eval")))
    ids = _pattern_windows(2, 12, 5)
    want = _logits(h, ids)
    back = load_compressed(out)
    names = [n for n, _ in lora.lora_layers(back.module)]
    assert len(names) == 14
    torch.testing.assert_close(_logits(back, ids), want)


def test_lora_gpt2_conv1d_unmerged_roundtrip_and_nf4_refused(tmp_path: Path) -> None:
    """GPT-2's projections are transformers' Conv1D (weight (in, out)): peft adapts them as such
    (fan_in_fan_out), the adapters reload beside the same Conv1D layers; NF4 (nn.Linear only) stops."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import save_tiny

    from edgekit.loading import load_model

    folder = save_tiny("gpt2", tmp_path)
    h = load_model(str(folder))
    cfg = lora.LoraConfig(r=4, steps=3, lr=1e-2, batch_size=4, merge=False, dropout=0.0)
    out = compress(h, [("lora", cfg)], tmp_path / "m", _ctx(text_samples(8, 0), text_samples(4, 1, "eval")))
    assert h.steps[-1].meta["modules"] == [f"model.transformer.h.{i}.{m}" for i in (0, 1)
                                            for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    ids = _pattern_windows(2, 12, 5)
    want = _logits(h, ids)
    back = load_compressed(out)
    assert len(lora.lora_layers(back.module)) == 8
    torch.testing.assert_close(_logits(back, ids), want)
    nf4 = lora.LoraConfig(r=4, steps=1, qlora=True, qlora_base="nf4")
    with pytest.raises(BadInputError, match="Conv1D"):
        compress(load_model(str(folder)), [("lora", nf4)], tmp_path / "n", _ctx(text_samples(8, 0),
                                                                                 text_samples(4, 1, "eval")))


def test_resume_after_interrupt_matches_uninterrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = lora.LoraConfig(r=2, steps=6, lr=1e-2, batch_size=4, checkpoint_every=2, dropout=0.1)
    train, val = labelled(24, (16,), 0), labelled(8, (16,), 1, "eval")
    ref = lora.apply(tiny_mlp(), cfg, _ctx(train, val, tmp_path / "a"))
    want = ref.extra["lora_adapter"]

    real_loss, calls = lora_train.task_loss, {"n": 0}

    def flaky(*args, **kwargs):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(lora_train, "task_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        lora.apply(tiny_mlp(), cfg, _ctx(train, val, tmp_path / "b"))
    assert (tmp_path / "b" / lora.CHECKPOINT_DIR / "state.json").is_file()
    monkeypatch.setattr(lora_train, "task_loss", real_loss)
    ctx = _ctx(train, val, tmp_path / "b")
    got = lora.apply(tiny_mlp(), cfg, ctx)
    assert ctx.metrics["lora"]["resumed_from"] == 4
    assert not (tmp_path / "b" / lora.CHECKPOINT_DIR).exists()
    for k, v in want.items():
        torch.testing.assert_close(got.extra["lora_adapter"][k], v)


# ---------------------------------------------------------------------------------------------
# QLoRA over edgekit's packed int4 model


@pytest.mark.parametrize("chunked", [False, True])
def test_frozen_dequant_matmul_gradient_matches_plain_linear(chunked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgekit.compress.weight_only.packing import quantize_linear

    if chunked:  # the LM-head path: dequantize in row chunks
        monkeypatch.setattr(packed, "CHUNK_ABOVE", 0)
        monkeypatch.setattr(packed, "CHUNK_ROWS", 3)

    torch.manual_seed(0)
    q = quantize_linear(nn.Linear(32, 8, bias=True), bits=4, group_size=16)
    wrapped = lora.LoraQuantLinear(q, r=2, alpha=4).train()
    with torch.no_grad():
        wrapped.lora_B.weight.normal_()
    x = torch.randn(3, 5, 32, requires_grad=True)
    y = wrapped(x)
    y.square().sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    ref = nn.functional.linear(x2, q.dequantize(), q.bias) + wrapped.lora_B(wrapped.lora_A(x2)) * wrapped.scaling
    ref.square().sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, x2.grad)
    wrapped.eval()
    torch.testing.assert_close(wrapped(x.detach()), ref.detach())
    # a packed layer without adapter (the LM head) takes the same path while training
    head = quantize_linear(nn.Linear(32, 8), bits=8, group_size=16).train()
    x3 = x.detach().clone().requires_grad_(True)
    with lora.frozen_packed_forwards(nn.Sequential(head)):
        assert "forward" in head.__dict__
        head(x3).sum().backward()
    assert "forward" not in head.__dict__
    torch.testing.assert_close(x3.grad, head.dequantize().sum(0).expand_as(x3))


def test_repack_with_zero_update_keeps_codes() -> None:
    from edgekit.compress.weight_only.packing import quantize_linear

    torch.manual_seed(0)
    q = quantize_linear(nn.Linear(40, 6), bits=3, group_size=16)  # last group shorter, 3-bit unpacked
    codes = q.qweight.clone()
    lora.repack(q, q.dequantize())
    assert torch.equal(q.qweight, codes)


def test_qlora_packed_fold_roundtrip_and_merge(tmp_path: Path) -> None:
    from edgekit.compress.weight_only.packing import QuantLinear

    ctx = _ctx(text_samples(24, 0), text_samples(6, 1, "eval"))
    cfg = lora.LoraConfig(r=4, steps=12, lr=2e-2, batch_size=4, qlora=True, dropout=0.0)
    h = tiny_llama()
    out = compress(h, [("weight-only", _int4()), ("lora", cfg)], tmp_path / "q", ctx)
    lm = ctx.metrics["lora"]
    assert lm["base"] == "packed" and lm["after"]["loss"] < lm["before"]["loss"]
    m = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in m["steps"]] == ["weight-only", "lora"] and m["steps"][1]["meta"]["merged"] is False
    ids = _pattern_windows(2, 12, 5)
    want = _logits(h, ids)
    back = load_compressed(out)
    layer = back.module.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, lora.LoraQuantLinear) and isinstance(layer.base_layer, QuantLinear)
    torch.testing.assert_close(_logits(back, ids), want)
    # merge: re-round onto the same 4-bit grid; back to plain packed layers
    stats = lora.merge_adapters(back)
    assert stats["layers"] == 14 and 0.0 <= stats["repack_lost_fraction"] <= 1.5
    assert isinstance(back.module.model.model.layers[0].self_attn.q_proj, QuantLinear)


def test_qlora_packed_fold_exports_matmulnbits(tmp_path: Path) -> None:
    pytest.importorskip("edgekit.export.lm")
    import onnx

    from edgekit.export.onnx import ExportConfig
    from edgekit.loading import export_onnx  # a compressed folder loads through the loaders passed

    ctx = _ctx(text_samples(8, 0), text_samples(2, 1, "eval"))
    cfg = lora.LoraConfig(r=2, steps=2, lr=1e-2, batch_size=4, qlora=True, dropout=0.0)
    art = compress(tiny_llama(), [("weight-only", _int4()), ("lora", cfg)], tmp_path / "q", ctx)
    onnx_dir = export_onnx(art, tmp_path / "onnx", ExportConfig(atol=1e-3, rtol=1e-3))
    graph = onnx.load(str(onnx_dir / "model.onnx"), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") >= 14  # the packed base ...
    assert ops.count("MatMul") >= 2 * 14  # ... plus the adapter pair of every adapted layer
    m = json.loads((onnx_dir / "manifest.json").read_text())
    assert m["metrics"]["parity"]["passed"]
    from edgekit.build import build_engine
    from edgekit.runtimes.base import BuildOptions

    engine = build_engine(onnx_dir, "cpu", tmp_path / "engine", BuildOptions())
    assert (engine / "manifest.json").is_file()


def test_lora_merged_then_requantized_int4(tmp_path: Path) -> None:
    from edgekit.compress.weight_only.packing import QuantLinear
    from edgekit.finetune import finetune

    out = finetune(tiny_llama(), text_samples(16, 0), {"r": 4, "steps": 4, "lr": 1e-2, "batch_size": 4},
                   tmp_path / "ft", eval_data=text_samples(4, 1, "eval"), requant="weight-only", requant_config=_int4())
    m = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in m["steps"]] == ["lora", "weight-only"]
    assert np.isfinite(m["metrics"]["final"]["perplexity"])
    back = load_compressed(out)
    assert isinstance(back.module.model.model.layers[1].mlp.up_proj, QuantLinear)
    with pytest.raises(BadInputError, match="re-quantizes merged weights; drop --no-merge"):
        finetune(tiny_llama(), text_samples(16, 0), {"merge": False}, tmp_path / "x", requant="weight-only")


# ---------------------------------------------------------------------------------------------
# bitsandbytes NF4


def test_qlora_nf4_merges_to_float(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    h = tiny_llama()
    ctx = _ctx(text_samples(16, 0), text_samples(4, 1, "eval"))
    cfg = lora.LoraConfig(r=4, steps=6, lr=2e-2, batch_size=4, qlora=True, qlora_base="nf4", dropout=0.0)
    out = compress(h, [("lora", cfg)], tmp_path / "n", ctx)
    lm = ctx.metrics["lora"]
    assert lm["nf4_layers"] == 14 and lm["after"]["loss"] < lm["before"]["loss"]
    assert lm["after_merge"]["loss"] == pytest.approx(lm["after"]["loss"], rel=1e-3)
    back = load_compressed(out)
    assert type(back.module.model.model.layers[0].mlp.down_proj) is nn.Linear
    torch.testing.assert_close(_logits(back, _pattern_windows(2, 12, 5)), _logits(h, _pattern_windows(2, 12, 5)))


# ---------------------------------------------------------------------------------------------
# Deploy: CNN LoRA merged, re-quantized INT8, exported and built; the CLI


def test_cnn_lora_then_export_and_build(tmp_path: Path) -> None:
    from edgekit.finetune import deploy, finetune

    out = finetune(tiny_cnn(), labelled(32, (1, 12, 12), 0), {"r": 2, "steps": 4, "batch_size": 8, "lr": 1e-2},
                   tmp_path / "ft", eval_data=labelled(16, (1, 12, 12), 1, "eval"))
    res = deploy(out, tmp_path / "deploy")
    assert Path(res["engine"], "manifest.json").is_file()
    assert res["parity"]


def test_cli_finetune_bad_rank_and_happy_path(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from edgekit.cli import cli

    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 16)).astype(np.float32)
    np.savez(tmp_path / "d.npz", input=x, labels=(x[:, 0] > 0).astype(np.int64))
    runner = CliRunner()
    bad = runner.invoke(cli, ["finetune", "test_lora:tiny_mlp", "--data", str(tmp_path / "d.npz"), "--lora-r", "0",
                              "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2
    assert bad.output.strip() == "error: LoRA rank must be a positive integer, got 0 (e.g. --lora-r 8)"
    nothing = runner.invoke(cli, ["finetune", "test_lora:tiny_mlp", "--data", str(tmp_path / "d.npz"),
                                  "--targets", "conv", "-o", str(tmp_path / "x")])
    assert nothing.exit_code == 2 and "candidates: 0, 2" in nothing.output
    ok = runner.invoke(cli, ["finetune", "test_lora:tiny_mlp", "--data", str(tmp_path / "d.npz"), "--steps", "3",
                             "--batch-size", "8", "-o", str(tmp_path / "ok")])
    assert ok.exit_code == 0, ok.output
    assert "wrote" in ok.output and (tmp_path / "ok" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# Real model (slow): QLoRA over RTN W4 SmolLM2-135M, a few steps, lowers the train loss


# one of the longest real-model runs: with -m matrix, apart from CI (CI's 20 minutes)
@pytest.mark.slow
@pytest.mark.matrix
def test_smollm2_qlora_smoke(tmp_path: Path) -> None:
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import STEP as INT4
    from edgekit.loading import load_model
    from edgekit.sources.data import load_samples

    try:
        h = load_model("smollm2-135m")
    except BadInputError:
        pytest.skip("smollm2-135m is not in the zoo yet")
    h = INT4.apply(h, WeightOnlyConfig(method="rtn", bits=4, group_size=128, eval_windows=0), StepContext(progress=False))
    train = load_samples("wikipedia", h, split="train", seqlen=64, limit=8)
    val = load_samples("wikipedia", h, split="eval", seqlen=64, limit=2)
    ctx = _ctx(train, val)
    cfg = lora.LoraConfig(r=8, steps=4, lr=1e-3, batch_size=2, qlora=True, dropout=0.0, eval_samples=2)
    lora.apply(h, cfg, ctx)
    lm = ctx.metrics["lora"]
    assert lm["modules"] == 30 * 7 and lm["trainable_params"] < 0.05 * lm["total_params"]
    assert np.isfinite(lm["after"]["perplexity"])
