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
