"""Model sources (issue 2): the zoo, Hugging Face wrappers, the Fashion-MNIST CNN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edgekit.errors import BadInputError
from edgekit.sources import fmnist
from edgekit.sources.zoo import ZOO


def test_zoo_names():
    assert {"efficientnet-lite0", "smollm2-135m", "minilm-l6", "fmnist-cnn", "fmnist-cnn-wide"} <= set(ZOO)
    assert ZOO["smollm2-135m"].kind == "causal-lm" and ZOO["minilm-l6"].kind == "text-encoder"


# --- tiny Hugging Face folders (fast): the wrappers' I/O contract -------------------------------


def _tiny_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "[PAD] [UNK] [CLS] [SEP] the a cat dog sat on mat hundreds of people have been forced to".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", bos_token="[CLS]")
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    _tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(folder)
    _tiny_tokenizer(folder)
    return folder


def test_hf_causal_lm_wrapper(tiny_llama):
    from edgekit.sources.hf import CausalLMWrapper, load_hf

    h = load_hf(tiny_llama)
    assert h.kind == "causal-lm" and h.evaluator == "perplexity" and isinstance(h.module, CausalLMWrapper)
    assert [s.name for s in h.inputs] == ["input_ids", "attention_mask"]
    assert h.inputs[0].shape == ("batch", "sequence") and h.inputs[0].dtype == "int64"
    assert len(h.module.model.model.layers) == 2  # compression steps walk wrapper.model.model.layers
    x = h.sample_inputs(2, sequence=7)
    assert x["input_ids"].shape == (2, 7) and x["input_ids"].dtype == np.int64
    with torch.no_grad():
        logits = h.module(*(torch.from_numpy(x[s.name]) for s in h.inputs))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 7, 32)
    assert h.default_calib == "lee-news" and h.default_eval == "wikipedia"


def test_hf_encoder_wrapper_returns_unit_embeddings(tiny_bert):
    from edgekit.sources.hf import SentenceEncoderWrapper, load_hf

    h = load_hf(tiny_bert)
    assert h.kind == "text-encoder" and isinstance(h.module, SentenceEncoderWrapper)
    assert [s.name for s in h.inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    x = h.prepare(["the cat sat on the mat", "a dog"])
    assert x["input_ids"].shape == x["attention_mask"].shape == (2, 6)
    with torch.no_grad():
        emb = h.module(*(torch.from_numpy(x[s.name]) for s in h.inputs))
    assert emb.shape == (2, 16)
    np.testing.assert_allclose(emb.norm(dim=1).numpy(), 1.0, rtol=1e-5)
    # padding does not change the embedding (mean over attended tokens only)
    alone = h.prepare(["a dog"])
    with torch.no_grad():
        e2 = h.module(*(torch.from_numpy(alone[s.name]) for s in h.inputs))
    np.testing.assert_allclose(e2[0].numpy(), emb[1].numpy(), atol=1e-5)


def test_hf_folder_errors(tmp_path):
    from edgekit.sources.hf import load_hf

    with pytest.raises(BadInputError, match="no config.json"):
        load_hf(tmp_path)
    with pytest.raises(BadInputError, match="does not exist"):
        load_hf(tmp_path, gguf_file="missing.gguf")


def test_corrupt_gguf_is_bad_input(tmp_path, monkeypatch):
    from edgekit.sources.models import load_model

    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file" * 64)
    with pytest.raises(BadInputError, match=r"bad.gguf is not a GGUF file \(it starts with b.not ., not b.GGUF.\)"):
        load_model(str(bad))
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


def test_load_model_routes_hf_folders(tiny_llama):
    from edgekit.sources.models import load_model

    assert load_model(str(tiny_llama)).kind == "causal-lm"


def test_wikipedia_windows_for_a_causal_lm(tiny_llama):
    from edgekit.evaluate import evaluate
    from edgekit.sources.data import load_samples
    from edgekit.sources.hf import load_hf

    h = load_hf(tiny_llama)
    s = load_samples(None, h, split="eval", seqlen=32, limit=3)
    assert s.inputs["input_ids"].shape == (3, 32) and s.meta["kind"] == "token-windows"
    m = evaluate(h, s)
    assert m["evaluator"] == "perplexity" and m["seqlen"] == 32 and m["tokens"] == 3 * 31
    assert 1 < m["perplexity"] < 1000


# --- weights-free handles (what an ONNX graph borrows): nothing the size of the model ----------


def _same_io(a, b):
    """Two handles of one model give the same inputs, preparation, data defaults and extra."""
    assert [s.to_dict() for s in a.inputs] == [s.to_dict() for s in b.inputs] and a.outputs == b.outputs
    for batch, seq in ((1, None), (2, 7)):
        x, y = a.sample_inputs(batch, sequence=seq), b.sample_inputs(batch, sequence=seq)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    text = "the cat sat on the mat . a dog sat on the mat"
    px, py = a.prepare(text), b.prepare(text)
    assert px.keys() == py.keys() and all(np.array_equal(px[k], py[k]) for k in px)
    assert (a.kind, a.evaluator, a.default_calib, a.default_eval, a.default_train, a.dynamic_axes) == (
        b.kind, b.evaluator, b.default_calib, b.default_eval, b.default_train, b.dynamic_axes)
    skip = {"load_seconds"}
    assert {k: v for k, v in a.extra.items() if k not in skip} == {k: v for k, v in b.extra.items() if k not in skip}


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_bert"])
def test_hf_handle_without_weights_reads_no_weights(fixture, request, monkeypatch):
    from edgekit.sources import hf

    folder = request.getfixturevalue(fixture)
    full = hf.load_hf(folder)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(hf, "_from_pretrained", no_weights)
    light = hf.load_hf(folder, weights=False)
    assert light.module is None and light.tokenizer is not None
    assert light.extra["params"] == full.extra["params"] == sum(p.numel() for p in full.module.parameters())
    _same_io(light, full)


def test_borrow_io_loads_the_zoo_model_without_weights(tiny_llama, monkeypatch):
    """An ONNX graph of a built-in text model borrows its tokenizer and inputs from a handle
    without weights (module None): the full model is never loaded; a KV-cache graph keeps its
    decode-step inputs and loads nothing."""
    from edgekit.sources import hf, zoo
    from edgekit.sources.handle import InputSpec, ModelHandle
    from edgekit.sources.models import borrow_io, decode_step_inputs

    full = hf.load_hf(tiny_llama)
    light: list[ModelHandle] = []

    def load_io():
        light.append(hf.load_hf(tiny_llama, weights=False))
        return light[-1]

    def load():
        raise AssertionError("the float model was loaded")

    monkeypatch.setitem(zoo.ZOO, "tiny-lm", zoo.ZooEntry("tiny-lm", "causal-lm", "tiny", "tests", load, load_io))
    assert zoo.load_zoo_model("tiny-lm", weights=False).module is None
    specs = [InputSpec("input_ids", ("batch", "sequence"), "int64"),
             InputSpec("attention_mask", ("batch", "sequence"), "int64")]
    graph = ModelHandle(name="g", source="tiny-lm", kind="causal-lm", onnx_path=tiny_llama / "model.onnx",
                        inputs=specs, outputs=["logits"], make_inputs=lambda batch=1, **_: {})
    borrow_io(graph, "tiny-lm")
    assert light and light[-1].module is None and graph.tokenizer is light[-1].tokenizer
    x, y = graph.sample_inputs(2, sequence=6), full.sample_inputs(2, sequence=6)
    assert all(np.array_equal(x[k], y[k]) for k in ("input_ids", "attention_mask"))
    assert (graph.evaluator, graph.default_eval) == ("perplexity", "wikipedia")

    calls = len(light)
    kv = [*specs, InputSpec("past_key_values.0.key", ("batch", 2, "past_sequence_length", 8), "float32")]
    cached = ModelHandle(name="g", source="tiny-lm", kind="causal-lm", onnx_path=tiny_llama / "model.onnx",
                         inputs=kv, outputs=["logits"], make_inputs=decode_step_inputs(kv))
    borrow_io(cached, "tiny-lm")
    assert len(light) == calls and cached.tokenizer is None
    assert cached.sample_inputs(1)["attention_mask"].shape == (1, 129)  # 128 cached tokens + 1 new one


def test_decode_step_inputs_stay_within_the_declared_context():
    """A model with a 128-position table has no row for position 128: its decode step is timed after
    127 cached tokens, not the default 128 (a tiny GPT-2's engine build failed on it)."""
    from edgekit.sources.handle import InputSpec
    from edgekit.sources.models import DEFAULT_PAST, decode_step_inputs

    kv = [InputSpec("input_ids", ("batch", "sequence"), "int64"),
          InputSpec("attention_mask", ("batch", "total"), "int64"),
          InputSpec("position_ids", ("batch", "sequence"), "int64"),
          InputSpec("past_key_values.0.key", ("batch", 2, "past_sequence_length", 8), "float32")]
    step = decode_step_inputs(kv, context=128)(1)
    assert step["past_key_values.0.key"].shape == (1, 2, 127, 8) and step["attention_mask"].shape == (1, 128)
    assert int(step["position_ids"].max()) == 127
    assert decode_step_inputs(kv, context=4096)(1)["position_ids"].tolist() == [[DEFAULT_PAST]]
    assert decode_step_inputs(kv, context=128)(1, past_sequence_length=5)["attention_mask"].shape == (1, 6)


# --- Fashion-MNIST CNN -------------------------------------------------------------------------


def test_fmnist_cnn_architecture_is_stable():
    m = fmnist.FashionCNN((16, 32, 64))
    names = set(m.state_dict())
    assert {"features.0.conv.weight", "features.0.bn.weight", "features.2.conv.weight",
            "classifier.weight", "classifier.bias"} <= names
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    wide = fmnist.FashionCNN(fmnist.VARIANTS["fmnist-cnn-wide"].channels)
    assert wide.features[0].conv.out_channels == 2 * m.features[0].conv.out_channels


def test_fmnist_handle_contract():
    h = fmnist.fmnist_handle("fmnist-cnn", module=fmnist.FashionCNN().eval())
    x = h.sample_inputs(3)
    assert x["input"].shape == (3, 1, 28, 28) and x["input"].dtype == np.float32
    assert h.evaluator == "accuracy" and h.default_eval == "fashion-mnist"
    from edgekit.sources.data import load_samples

    s = load_samples(None, h, split="eval", limit=16)
    np.testing.assert_allclose(s.inputs["input"][:3].mean(), x["input"].mean(), atol=1.0)
    rgb = h.prepare([np.zeros((40, 50, 3), np.uint8)])  # any image -> grey 28x28
    assert rgb["input"].shape == (1, 1, 28, 28)


def test_train_fmnist_cnn_learns():
    model, info = fmnist.train_fmnist_cnn(channels=(4, 8, 8), epochs=1, limit=3000, eval_limit=1000, progress=False)
    assert info["test_accuracy"] > 0.4 and info["train_images"] == 3000  # chance is 0.1
    assert not model.training


def test_fmnist_weights_are_trained_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path))
    calls = []

    def fake_train(**kw):
        calls.append(kw)
        return fmnist.FashionCNN(kw["channels"]).eval(), {"test_accuracy": 0.5, "seconds": 0.1, "threads": 1}

    monkeypatch.setattr(fmnist, "train_fmnist_cnn", fake_train)
    m1, meta = fmnist.load_fmnist_weights("fmnist-cnn")
    m2, _ = fmnist.load_fmnist_weights("fmnist-cnn")
    assert len(calls) == 1 and meta["test_accuracy"] == "0.5000"
    assert fmnist.weights_path("fmnist-cnn").is_file()
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(BadInputError, match="unknown Fashion-MNIST model 'fmnist-x'"):
        fmnist.load_fmnist_weights("fmnist-x")


# --- real models (slow) ------------------------------------------------------------------------


@pytest.mark.slow
def test_efficientnet_lite0_classifies_a_real_photo():
    from edgekit.sources.models import load_model

    h = load_model("efficientnet-lite0")
    x = h.sample_inputs(2)
    with torch.no_grad():
        logits = h.module(torch.from_numpy(x["input"]))
    assert logits.shape == (2, 1000)
    assert int(logits[0].argmax()) in (281, 282, 285)  # chelsea: tabby / tiger cat / Egyptian cat


@pytest.mark.slow
def test_smollm2_logits_shape():
    from edgekit.sources.models import load_model

    h = load_model("smollm2-135m")
    assert h.kind == "causal-lm" and h.extra["vocab_size"] == 49152 and len(h.module.model.model.layers) == 30
    x = h.sample_inputs(1, sequence=8)
    with torch.no_grad():
        logits = h.module(torch.from_numpy(x["input_ids"]), torch.from_numpy(x["attention_mask"]))
    assert logits.shape == (1, 8, 49152)
    from edgekit.artifact import cache_dir

    assert h.extra["hf_folder"].startswith(str(cache_dir()))  # reloads come from the float32 copy


@pytest.mark.slow
def test_minilm_embeddings_have_unit_norm_and_meaning():
    from edgekit.sources.models import load_model

    h = load_model("minilm-l6")
    x = h.prepare(["A cat sits on the mat.", "A kitten is sitting on a rug.", "Stock markets fell sharply today."])
    with torch.no_grad():
        emb = h.module(*(torch.from_numpy(x[s.name]) for s in h.inputs)).numpy()
    assert emb.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2] + 0.2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "minilm-l6"])
def test_zoo_text_models_load_without_weights(name):
    from edgekit.sources.zoo import load_zoo_model

    light = load_zoo_model(name, weights=False)
    assert light.module is None and light.name == light.source == name
    _same_io(light, load_zoo_model(name))


@pytest.mark.slow  # tens of seconds on a loaded 2-core machine (transformers' Fuyu classes)
def test_a_causal_lm_with_a_composite_config_loads_its_sizes_from_the_text_config(tmp_path):
    """Fuyu's config keeps ``vocab_size`` and the layer count in its ``text_config``; loading its folder
    ended in an AttributeError before (the decoder matrix's fuyu row)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny_models import byte_tokenizer, tiny_causal_lm

    from edgekit.sources.hf import load_hf

    model = tiny_causal_lm("fuyu")
    assert not hasattr(model.config, "vocab_size")
    model.save_pretrained(tmp_path, safe_serialization=True)
    byte_tokenizer().save_pretrained(tmp_path)
    h = load_hf(tmp_path)
    assert (h.kind, h.extra["vocab_size"], h.extra["num_layers"]) == ("causal-lm", 260, 2)
    assert h.extra["max_positions"] == model.config.text_config.max_position_embeddings
