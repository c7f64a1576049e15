"""Stages for the example perception recipe (examples/perception.yaml).

A camera frame goes through NumPy preprocessing, the EfficientNet-Lite0 backbone
(stem and MBConv blocks, real pretrained weights) and the classification head (the
model's own conv head, pooling and classifier, real weights): three stages whose
latencies add up against the 33 ms budget.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.sources.zoo import load_zoo_model

FRAME_SHAPE = (480, 640, 3)


def preprocess(image: np.ndarray) -> np.ndarray:
    """HxWx3 uint8 camera frame -> (1, 3, 224, 224) float32: shorter side to 256 by
    nearest-neighbour index sampling, center crop 224, (x - 127.5) / 127.5, NCHW."""
    h, w = image.shape[:2]
    scale = 256 / min(h, w)
    nh, nw = round(h * scale), round(w * scale)
    rows = np.minimum((np.arange(nh) / scale).astype(np.int64), h - 1)
    cols = np.minimum((np.arange(nw) / scale).astype(np.int64), w - 1)
    top, left = (nh - 224) // 2, (nw - 224) // 2
    crop = image[rows[top:top + 224]][:, cols[left:left + 224]]
    x = (crop.astype(np.float32) - 127.5) / 127.5
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def _effnet() -> Any:
    return load_zoo_model("efficientnet-lite0")



def _backbone_module(net: Any) -> Any:
    import torch

    class EfficientNetBackbone(torch.nn.Module):
        """Stem and MBConv blocks: (B, 3, 224, 224) -> (B, 320, 7, 7)."""

        def __init__(self, net: Any):
            super().__init__()
            self._conv_stem, self._bn0, self._swish = net._conv_stem, net._bn0, net._swish
            self._blocks = net._blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self._swish(self._bn0(self._conv_stem(x)))
            for block in self._blocks:
                x = block(x)
            return x

    return EfficientNetBackbone(net).eval()


def _head_module(net: Any) -> Any:
    import torch

    class EfficientNetHead(torch.nn.Module):
        """Conv head, BN, ReLU6, global pooling and the classifier: (B, 320, 7, 7) -> (B, 1000)."""

        def __init__(self, net: Any):
            super().__init__()
            self._conv_head, self._bn1, self._swish, self._fc = net._conv_head, net._bn1, net._swish, net._fc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self._swish(self._bn1(self._conv_head(x)))
            return self._fc(x.mean(dim=(2, 3)))

    return EfficientNetHead(net).eval()


def efficientnet_backbone() -> ModelHandle:
    full = _effnet()
    module = _backbone_module(full.module)
    return ModelHandle(
        name="efficientnet-lite0-backbone", source="edgekit.pipelines.examples:efficientnet_backbone",
        kind="generic", module=module, inputs=[InputSpec("input", ("batch", 3, 224, 224), "float32")],
        outputs=["features"], make_inputs=full.make_inputs, prepare=full.prepare,
        default_calib=full.default_calib, default_eval=full.default_eval, evaluator="cosine",
        dynamic_axes={"input": {0: "batch"}, "features": {0: "batch"}})


def efficientnet_head() -> ModelHandle:
    import torch

    full = _effnet()
    backbone = _backbone_module(full.module)
    module = _head_module(full.module)

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        # Real features: the backbone applied to real photos.
        with torch.no_grad():
            x = torch.from_numpy(full.make_inputs(batch)["input"])
            return {"features": backbone(x).numpy()}

    def prepare(images: list[np.ndarray]) -> dict[str, np.ndarray]:
        with torch.no_grad():
            return {"features": backbone(torch.from_numpy(full.prepare(images)["input"])).numpy()}

    return ModelHandle(
        name="efficientnet-lite0-head", source="edgekit.pipelines.examples:efficientnet_head",
        kind="image-classifier", module=module, inputs=[InputSpec("features", ("batch", 320, 7, 7), "float32")],
        outputs=["logits"], make_inputs=make_inputs, prepare=prepare, default_calib=full.default_calib,
        default_eval=full.default_eval, evaluator="agreement",
        dynamic_axes={"features": {0: "batch"}, "logits": {0: "batch"}})


def tiny_mlp(width: int = 32) -> ModelHandle:
    """A seeded two-layer MLP (16 -> width -> 4): the smallest model stage, for trying a
    recipe or a sweep in seconds (the tests use it)."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)).eval()
    return ModelHandle(name="tiny-mlp", source="edgekit.pipelines.examples:tiny_mlp", kind="generic", module=module,
                       inputs=[InputSpec("input", ("batch", 16), "float32")], outputs=["output"],
                       dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})


def tiny_mlp_wide() -> ModelHandle:
    return tiny_mlp(width=64)


def scale(x: np.ndarray) -> np.ndarray:
    """A trivial post-processing stage: scores -> probabilities."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
