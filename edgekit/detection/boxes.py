"""Boxes: the per-image detection record, IoU and greedy non-maximum suppression.

Boxes are ``(x1, y1, x2, y2)`` in pixels, float32, with ``x2 >= x1`` and ``y2 >= y1``;
areas are ``(x2 - x1) * (y2 - y1)`` (no "+1" pixel convention). Everything here is
NumPy, vectorised over boxes; the only Python loop is the greedy pass of NMS over the
score-sorted candidates, which reads one precomputed row of the IoU matrix per kept box.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgekit.errors import BadInputError

BOX_EPS = 1e-9  # guards IoU against 0 / 0 for degenerate (zero-area) boxes


@dataclass
class Detections:
    """The detections of one image.

    boxes: (n, 4) float32 xyxy pixels; scores: (n,) float32; labels: (n,) int64 class
    indices; landmarks: None or (n, k) float32 (x, y pairs, e.g. CenterFace's 5 points).
    """

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    landmarks: np.ndarray | None = None
    class_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        self.boxes = np.asarray(self.boxes, dtype=np.float32).reshape(-1, 4)
        self.scores = np.asarray(self.scores, dtype=np.float32).reshape(-1)
        self.labels = np.asarray(self.labels, dtype=np.int64).reshape(-1)
        n = len(self.boxes)
        if len(self.scores) != n or len(self.labels) != n:
            raise BadInputError(f"detections need one score and one label per box: {n} boxes, "
                                f"{len(self.scores)} scores, {len(self.labels)} labels")
        if self.landmarks is not None:
            self.landmarks = np.asarray(self.landmarks, dtype=np.float32).reshape(n, -1)

    def __len__(self) -> int:
        return len(self.boxes)

    def take(self, index: np.ndarray) -> Detections:
        """The detections at ``index`` (indices or a boolean mask), same class names."""
        return Detections(self.boxes[index], self.scores[index], self.labels[index],
                          None if self.landmarks is None else self.landmarks[index], self.class_names)

    def scaled(self, sx: float, sy: float) -> Detections:
        """Boxes and landmarks multiplied by ``sx`` along x and ``sy`` along y (to map from
        the model's input frame back to the image: sx = image width / input width)."""
        f = np.array([sx, sy, sx, sy], dtype=np.float32)
        lm = None
        if self.landmarks is not None:
            lm = self.landmarks * np.tile(np.array([sx, sy], np.float32), self.landmarks.shape[1] // 2)
        return Detections(self.boxes * f, self.scores, self.labels, lm, self.class_names)

    def to_dict(self) -> dict[str, object]:
        return {"boxes": self.boxes.round(2).tolist(), "scores": self.scores.round(4).tolist(),
                "labels": self.labels.tolist(),
                **({"class_names": [self.class_names[i] for i in self.labels]} if self.class_names else {})}

    @classmethod
    def empty(cls, class_names: tuple[str, ...] = ()) -> Detections:
        return cls(np.zeros((0, 4), np.float32), np.zeros(0, np.float32), np.zeros(0, np.int64),
                   class_names=class_names)


def box_area(boxes: np.ndarray) -> np.ndarray:
    """(n, 4) -> (n,) areas; inverted boxes count as 0."""
    return np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pairwise IoU: (n, 4) and (m, 4) -> (n, m), float64 for exact comparisons at thresholds."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.clip(rb - lt, 0, None)
    inter = wh[..., 0] * wh[..., 1]
    union = box_area(a)[:, None] + box_area(b)[None, :] - inter
    return inter / np.maximum(union, BOX_EPS)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float, *, max_candidates: int | None = None,
        max_keep: int | None = None) -> np.ndarray:
    """Greedy non-maximum suppression: indices of the kept boxes, highest score first.

    A box is dropped when its IoU with a higher-scoring kept box exceeds ``iou_threshold``.
    ``max_candidates``: only the that many highest-scoring boxes are considered (the rest
    are dropped, as in PaddleDetection's ``hard_nms``); ``max_keep``: stop after that many.
    Ties in score keep the earlier box first (a stable sort).

    >>> nms(np.array([[0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]]), np.array([0.9, 0.8, 0.7]), 0.5)
    array([0, 2])
    """
    if not 0.0 <= iou_threshold <= 1.0:
        raise BadInputError(f"NMS IoU threshold must be in [0, 1], got {iou_threshold}")
    boxes = np.asarray(boxes).reshape(-1, 4)
    scores = np.asarray(scores).reshape(-1)
    if len(boxes) != len(scores):
        raise BadInputError(f"NMS needs one score per box: {len(boxes)} boxes, {len(scores)} scores")
    order = np.argsort(-scores, kind="stable")
    if max_candidates is not None:
        order = order[:max_candidates]
    n = len(order)
    if n == 0:
        return order.astype(np.int64)
    iou = box_iou(boxes[order], boxes[order])
    keep = np.ones(n, dtype=bool)
    kept = 0
    for i in range(n):
        if not keep[i]:
            continue
        kept += 1
        if max_keep is not None and kept >= max_keep:
            keep[i + 1:] = False
            break
        keep[i + 1:] &= iou[i, i + 1:] <= iou_threshold
    return order[keep].astype(np.int64)


def batched_nms(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, iou_threshold: float, *,
                max_candidates: int | None = None, max_keep: int | None = None) -> np.ndarray:
    """Per-class NMS in one pass: boxes of different classes never suppress each other.

    Each class is moved to its own region of the plane (offset by label x the largest
    coordinate + 1), so one greedy pass equals running ``nms`` per class.
    ``max_candidates`` / ``max_keep`` apply per class. Returns kept indices, grouped by
    class in ascending label order, highest score first within a class.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    scores = np.asarray(scores).reshape(-1)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if not (len(boxes) == len(scores) == len(labels)):
        raise BadInputError(f"NMS needs one score and one label per box: {len(boxes)} boxes, {len(scores)} scores, "
                            f"{len(labels)} labels")
    if len(boxes) == 0:
        return np.zeros(0, np.int64)
    # rank of each box within its class by score (0 = best): for the per-class candidate cap
    order = np.lexsort((-scores, labels))  # by label, then score descending (stable)
    sorted_labels = labels[order]
    starts = np.flatnonzero(np.r_[True, sorted_labels[1:] != sorted_labels[:-1]])
    rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
    if max_candidates is not None:
        keep_mask = rank < max_candidates
        order, sorted_labels, rank = order[keep_mask], sorted_labels[keep_mask], rank[keep_mask]
    span = float(np.abs(boxes).max()) + 1.0
    shifted = boxes[order] + (sorted_labels.astype(np.float64) * span)[:, None]
    kept = order[nms(shifted, scores[order], iou_threshold)]
    if max_keep is not None:
        kl = labels[kept]
        by_class = np.lexsort((-scores[kept], kl))
        kept, kl = kept[by_class], kl[by_class]
        starts = np.flatnonzero(np.r_[True, kl[1:] != kl[:-1]])
        r = np.arange(len(kept)) - np.repeat(starts, np.diff(np.r_[starts, len(kept)]))
        kept = kept[r < max_keep]
    kl = labels[kept]
    return kept[np.lexsort((-scores[kept], kl))].astype(np.int64)
