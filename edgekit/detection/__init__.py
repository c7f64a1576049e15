"""Object detection: boxes, NMS, decoders for real detectors, and mAP (pure NumPy).

``boxes``: ``Detections`` (one image's boxes, scores, labels, landmarks), ``box_iou``,
``nms``, ``batched_nms``. ``decode``: ``decode_centerface`` and ``decode_picodet`` turn
raw model outputs into ``Detections`` exactly as the models' own packages do, and check
the outputs first. ``metrics``: ``evaluate_detections`` (mAP@0.5, VOC/COCO all-point AP
per class) and ``compare_to_reference`` (a compressed detector against its float model,
with score drift). ``DECODERS`` maps a decoder name (what a model handle declares in
``extra["detection"]["decoder"]``) to its config class and function.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edgekit.detection.boxes import Detections, batched_nms, box_area, box_iou, nms
from edgekit.detection.decode import (
    CenterFaceDecodeConfig,
    PicoDetDecodeConfig,
    decode_centerface,
    decode_picodet,
)
from edgekit.detection.metrics import average_precision, compare_to_reference, evaluate_detections
from edgekit.errors import BadInputError, bad_choice

DECODERS: dict[str, tuple[type, Callable[..., list[Detections]]]] = {
    "centerface": (CenterFaceDecodeConfig, decode_centerface),
    "picodet": (PicoDetDecodeConfig, decode_picodet),
}


def make_decoder(spec: dict[str, Any]) -> Callable[..., list[Detections]]:
    """``{"decoder": "picodet", "config": {...}}`` -> ``fn(outputs, image_sizes=None)``."""
    name = spec.get("decoder")
    if name not in DECODERS:
        raise bad_choice("detection decoder", name, DECODERS)
    config_cls, fn = DECODERS[name]
    values = dict(spec.get("config") or {})
    try:
        config = config_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    except TypeError as e:
        raise BadInputError(f"detection decoder {name!r}: {e}") from None

    def decode(outputs: Any, image_sizes: Any = None) -> list[Detections]:
        return fn(outputs, config, image_sizes=image_sizes)

    return decode


__all__ = ["DECODERS", "CenterFaceDecodeConfig", "Detections", "PicoDetDecodeConfig", "average_precision",
           "batched_nms", "box_area", "box_iou", "compare_to_reference", "decode_centerface", "decode_picodet",
           "evaluate_detections", "make_decoder", "nms"]
