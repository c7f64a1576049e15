"""Data sources (issue 2): built-in splits never overlap; user sources; bad input."""
from __future__ import annotations

import numpy as np
import pytest

from edgekit.errors import BadInputError
from edgekit.sources.data import (
    DATASETS,
    SPLITS,
    Samples,
    load_samples,
    random_token_windows,
    read_idx,
    split_sentences,
    token_windows,
)
from edgekit.sources.handle import InputSpec, ModelHandle


class CharTokenizer:
    """A stand-in tokenizer: one token per character (code point mod 97)."""

    bos_token_id = 96

    def __call__(self, text, add_special_tokens=False, **_):
        return {"input_ids": [ord(c) % 96 for c in text]}


def image_model(size=28, channels=1) -> ModelHandle:
    def prepare(images):
        from PIL import Image

        out = [np.asarray(Image.fromarray(np.asarray(im)[..., 0] if np.asarray(im).ndim == 3 else np.asarray(im))
                          .resize((size, size))) for im in images]
        return {"x": np.stack(out).astype(np.float32)[:, None] / 255.0}

    return ModelHandle("img", "img", kind="image-classifier", inputs=[InputSpec("x", ("batch", channels, size, size))],
                       prepare=prepare)


def lm_model() -> ModelHandle:
    specs = [InputSpec("input_ids", ("batch", "sequence"), "int64"),
             InputSpec("attention_mask", ("batch", "sequence"), "int64")]
    return ModelHandle("lm", "lm", kind="causal-lm", inputs=specs, tokenizer=CharTokenizer(), extra={"seqlen": 16})


def two_input_model() -> ModelHandle:
    return ModelHandle("two", "two", inputs=[InputSpec("a", ("batch", 3), "float32"), InputSpec("b", ("batch", 2), "int64")])


# --- built-ins --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fashion-mnist", "mnist-5k", "digits", "photos", "lee-news", "wikipedia"])
def test_builtin_splits_are_disjoint(name):
    from edgekit.sources.data import DATASETS

    sets = {split: set(DATASETS[name](split).indices.tolist()) for split in SPLITS}
    assert all(sets.values())
    assert not sets["calib"] & sets["eval"]
    assert not sets["calib"] & sets["train"]
    assert not sets["eval"] & sets["train"]


def test_photos_fashion_mnist_matches_the_reference_protocol():
    raw = {split: DATASETS["photos+fashion-mnist"](split) for split in SPLITS}
    assert len(raw["eval"].images) == 163 + 200  # 163 photo crops + 200 Fashion-MNIST images
    sets = {s: set(r.indices.tolist()) for s, r in raw.items()}
    assert not sets["calib"] & sets["eval"] and not sets["train"] & sets["eval"] and not sets["calib"] & sets["train"]
    # seen by an RGB 224x224 model, Fashion-MNIST images are 3x224x224
    from edgekit.sources.zoo import prepare_effnet

    h = ModelHandle("e", "e", inputs=[InputSpec("input", ("batch", 3, 224, 224))], prepare=prepare_effnet)
    s = load_samples("photos+fashion-mnist", h, split="calib", limit=6, seed=1)
    assert s.inputs["input"].shape == (6, 3, 224, 224) and s.labels is None


def test_fashion_mnist_labels_and_shapes():
    s = load_samples("fashion-mnist", split="eval", limit=32)
    assert s.inputs["input"].shape == (32, 1, 28, 28) and s.inputs["input"].dtype == np.float32
    assert s.labels.dtype == np.int64 and set(s.labels.tolist()) <= set(range(10))
    assert len(load_samples("fashion-mnist", split="calib")) == 5000
    assert len(load_samples("fashion-mnist", split="eval")) == 10000


def test_limit_is_a_seeded_subset_of_the_split():
    a = load_samples("mnist-5k", split="train", limit=20, seed=3)
    b = load_samples("mnist-5k", split="train", limit=20, seed=3)
    c = load_samples("mnist-5k", split="train", limit=20, seed=4)
    np.testing.assert_array_equal(a.indices, b.indices)
    assert not np.array_equal(a.indices, c.indices)
    assert set(a.indices.tolist()) <= set(range(500, 4000))


def test_model_prepare_shapes_digits_for_the_model():
    s = load_samples("digits", image_model(), split="eval", limit=10)
    assert s.inputs["x"].shape == (10, 1, 28, 28)
    assert len(s.labels) == 10


def test_read_idx_parses_and_rejects(tmp_path):
    p = tmp_path / "x.idx"
    p.write_bytes(bytes([0, 0, 8, 2]) + (2).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes(range(6)))
    np.testing.assert_array_equal(read_idx(p), np.arange(6, dtype=np.uint8).reshape(2, 3))
    p.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(BadInputError, match="not an IDX file"):
        read_idx(p)


# --- text -------------------------------------------------------------------------------------


def test_token_windows_are_non_overlapping_and_cover_the_text():
    tok = CharTokenizer()
    text = "abcdefghij" * 10  # 100 tokens
    w = token_windows(tok, text, 16)
    assert w.shape == (6, 16) and w.dtype == np.int64
    np.testing.assert_array_equal(w.reshape(-1), np.asarray(tok(text)["input_ids"][:96]))
    wb = token_windows(tok, text, 16, bos_token_id=96)
    assert (wb[:, 0] == 96).all() and wb.shape == (6, 16)


def test_random_token_windows_are_seeded_slices_of_the_text():
    tok = CharTokenizer()
    text = "".join(chr(33 + i % 90) for i in range(200))  # 200 tokens
    ids = np.asarray(tok(text)["input_ids"])
    w = random_token_windows(tok, text, 16, 50, seed=3)
    assert w.shape == (50, 16) and w.dtype == np.int64
    for row in w:  # every window is a contiguous slice of the token stream
        start = int(np.flatnonzero(ids == row[0])[0])
        np.testing.assert_array_equal(row, ids[start:start + 16])
    np.testing.assert_array_equal(w, random_token_windows(tok, text, 16, 50, seed=3))
    assert not np.array_equal(w, random_token_windows(tok, text, 16, 50, seed=4))
    wb = random_token_windows(tok, text, 16, 5, bos_token_id=96)
    assert wb.shape == (5, 16) and (wb[:, 0] == 96).all()
    with pytest.raises(BadInputError, match="holds 200 tokens, fewer than one 512-token window"):
        random_token_windows(tok, text, 512, 1)


def test_text_file_for_a_causal_lm(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("\n".join(f"line {i} " + "x" * 60 for i in range(40)))
    s = load_samples(str(f), lm_model(), split="eval", seqlen=16)
    # one token per character: 4.8x the default norm of English prose, which the load reports in a warning
    assert s.meta == {"kind": "token-windows", "seqlen": 16, "prefix": [], "bos_per_window": False,
                      "tokens_per_char": 1.0}
    assert s.inputs["input_ids"].shape[1] == 16 and (s.inputs["attention_mask"] == 1).all()
    assert "line 39" in s.text and "line 0 " not in s.text  # eval = the last quarter of the lines
    calib = load_samples(str(f), lm_model(), split="calib", seqlen=16)
    assert not set(calib.indices.tolist()) & set(s.indices.tolist())


def test_wikipedia_eval_is_the_start_of_the_text_and_train_is_disjoint():
    ev = load_samples("wikipedia", lm_model(), split="eval", seqlen=64, limit=4)
    tr = load_samples("wikipedia", split="train")
    assert ev.text.startswith("'''Anarchism'''")
    assert ev.inputs["input_ids"].shape == (4, 64)
    assert ev.text[:2000] not in tr.text and len(ev.text) > 2_000_000


def test_split_sentences():
    s = split_sentences(["The cat sat on the mat. Then it left the room quietly. Ok."])
    assert s == ["The cat sat on the mat.", "Then it left the room quietly."]


# --- user sources -----------------------------------------------------------------------------


def test_npy_single_input(tmp_path):
    x = np.random.default_rng(0).standard_normal((40, 1, 28, 28)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    h = image_model()
    s = load_samples(str(tmp_path / "x.npy"), h, split="calib")
    np.testing.assert_array_equal(s.inputs["x"], x[:10])  # calib: the first quarter
    e = load_samples(str(tmp_path / "x.npy"), h, split="eval")
    np.testing.assert_array_equal(e.inputs["x"], x[30:])
    assert len(load_samples(str(tmp_path / "x.npy") + "@all", h, split="eval")) == 40


def test_npz_named_inputs_and_labels(tmp_path):
    a = np.zeros((8, 3), np.float32)
    b = np.ones((8, 2), np.int64)
    np.savez(tmp_path / "d.npz", a=a, b=b, labels=np.arange(8))
    s = load_samples(str(tmp_path / "d.npz@all"), two_input_model(), split="eval")
    assert set(s.inputs) == {"a", "b"} and s.labels.tolist() == list(range(8))
    assert [len(bt["a"]) for bt in s.batches(3)] == [3, 3, 2]


def test_image_folder(tmp_path):
    from PIL import Image

    for i in range(8):
        Image.fromarray(np.full((30, 40, 3), i * 20, np.uint8)).save(tmp_path / f"img{i}.png")
    s = load_samples(str(tmp_path), image_model(), split="train")
    assert s.inputs["x"].shape == (4, 1, 28, 28)
    assert s.indices.tolist() == [2, 3, 4, 5]
    assert load_samples(str(tmp_path), split="eval").inputs["input"].shape == (2, 3, 30, 40)


def test_entry_point_source(tmp_path, monkeypatch):
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def arrays():\n    return {'a': np.zeros((12, 3), np.float32), 'b': np.zeros((12, 2), np.int64)}\n"
        "def by_split(split):\n    return np.full((5, 1, 28, 28), {'calib': 0, 'eval': 1, 'train': 2}[split], np.float32)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = load_samples("mydata:arrays", two_input_model(), split="train")
    assert len(s) == 6
    e = load_samples("mydata:by_split", image_model(), split="eval")
    assert len(e) == 5 and (e.inputs["x"] == 1).all()


# --- bad input: one clear line each ------------------------------------------------------------


def test_unknown_dataset_lists_the_valid_ones():
    with pytest.raises(BadInputError) as e:
        load_samples("imagenet", split="eval")
    msg = str(e.value)
    assert "unknown data set 'imagenet'" in msg and "'fashion-mnist'" in msg and "\n" not in msg


def test_missing_path():
    with pytest.raises(BadInputError, match=r"data source '/nope/x.npz' does not exist"):
        load_samples("/nope/x.npz", split="eval")


def test_empty_folder(tmp_path):
    with pytest.raises(BadInputError, match="has no images"):
        load_samples(str(tmp_path), split="eval")


def test_wrong_dtype_and_shape_name_the_input(tmp_path):
    np.save(tmp_path / "f64.npy", np.zeros((8, 1, 28, 28), np.float64))
    with pytest.raises(BadInputError, match=r"input 'x' has dtype float64; the model expects float32"):
        load_samples(str(tmp_path / "f64.npy@all"), image_model(), split="calib")
    np.save(tmp_path / "shape.npy", np.zeros((8, 1, 32, 32), np.float32))
    with pytest.raises(BadInputError, match=r"input 'x' has shape \(8, 1, 32, 32\); the model expects "
                                            r"\('batch', 1, 28, 28\)"):
        load_samples(str(tmp_path / "shape.npy@all"), image_model(), split="calib")
    np.savez(tmp_path / "missing.npz", a=np.zeros((4, 3), np.float32))
    with pytest.raises(BadInputError, match=r"missing \['b'\]"):
        load_samples(str(tmp_path / "missing.npz@all"), two_input_model(), split="calib")


def test_too_few_samples():
    with pytest.raises(BadInputError, match=r"has only 5000 samples; asked for 6000"):
        load_samples("fashion-mnist", split="calib", limit=6000)
    with pytest.raises(BadInputError, match=r"windows of 4096 tokens"):
        load_samples("lee-news", lm_model(), split="eval", seqlen=4096, limit=100)


def test_bad_split_and_no_default():
    with pytest.raises(BadInputError, match="unknown split 'test'"):
        load_samples("digits", split="test")
    with pytest.raises(BadInputError, match="no data source given"):
        load_samples(None)
    with pytest.raises(BadInputError, match="has no default eval data"):
        load_samples(None, ModelHandle("m", "m"), split="eval")


def test_samples_len_and_subset():
    s = Samples("x", "eval", {"a": np.arange(10)[:, None]}, np.arange(10), indices=np.arange(10))
    sub = s.subset(np.array([1, 3]))
    assert len(s) == 10 and len(sub) == 2 and sub.labels.tolist() == [1, 3]


def test_refuses_to_build_huge_inputs(monkeypatch):
    import edgekit.sources.data as data

    monkeypatch.setattr(data, "MAX_PREPARED_BYTES", 10_000)
    with pytest.raises(BadInputError, match=r"pass a limit \(at most 3 fit"):
        load_samples("digits", image_model(), split="eval")


def test_text_for_an_image_model_and_images_for_a_language_model(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("some words\n" * 8)
    with pytest.raises(BadInputError, match=r"is text, but model 'img' takes x \('batch', 1, 28, 28\) float32"):
        load_samples(str(f), image_model(), split="eval")
    with pytest.raises(BadInputError, match="holds images, but model 'lm' takes text"):
        load_samples("digits", lm_model(), split="eval")


def test_windows_with_a_limit_equal_the_first_windows_of_the_whole_text():
    tok = CharTokenizer()
    text = "".join(chr(65 + i % 26) for i in range(50_000))
    np.testing.assert_array_equal(token_windows(tok, text, 100, limit=5), token_windows(tok, text, 100)[:5])
