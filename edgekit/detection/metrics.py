"""Detection quality: mAP@0.5 and score drift, against ground truth or a float model.

The protocol is PASCAL VOC's (2010 on) / COCO's at one IoU threshold:

* per class, every detection of every image is sorted by score (descending, ties in
  image order); each is matched, in that order, to the unmatched ground-truth box of its
  image and class with the highest IoU, if that IoU is at least 0.5: a true positive;
  otherwise (no overlap, or every overlapping box already taken: a duplicate) a false
  positive;
* AP is the area under the precision-recall curve with all-point interpolation
  (precision made monotonically non-increasing from the right, summed over the recall
  steps); a class with ground truth but no detections has AP 0; classes without ground
  truth are left out of the mean (as COCO does), and are listed;
* mAP@0.5 is the mean of the per-class APs.

Against a float model the "ground truth" is the float model's detections (its scores
kept aside): mAP then says how much of the float model's output survives compression,
and the score drift of the matched pairs (compressed score minus float score) says how
far confidences moved, which shifts every threshold downstream.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from edgekit.detection.boxes import Detections, box_iou
from edgekit.errors import BadInputError, CheckFailedError

IOU_THRESHOLD = 0.5


def average_precision(tp: np.ndarray, n_ground_truth: int) -> float:
    """All-point interpolated AP of detections already sorted by score (descending).

    ``tp``: (n,) booleans, True for a true positive. ``n_ground_truth`` > 0.

    >>> average_precision(np.array([True, False, True]), 2)  # precision 1, then 2/3 at recall 1
    0.8333333333333333
    """
    if n_ground_truth <= 0:
        raise BadInputError(f"AP needs at least one ground-truth box, got {n_ground_truth}")
    tp = np.asarray(tp, dtype=bool)
    if tp.size == 0:
        return 0.0
    ctp = np.cumsum(tp)
    recall = ctp / n_ground_truth
    precision = ctp / np.arange(1, len(tp) + 1)
    r = np.concatenate([[0.0], recall, [1.0]])
    p = np.concatenate([[0.0], precision, [0.0]])
    p = np.maximum.accumulate(p[::-1])[::-1]  # the precision envelope
    steps = np.flatnonzero(r[1:] != r[:-1]) + 1
    return float(np.sum((r[steps] - r[steps - 1]) * p[steps]))


def match_image(pred: Detections, truth: Detections, order: np.ndarray,
                iou_threshold: float = IOU_THRESHOLD) -> tuple[np.ndarray, np.ndarray]:
    """Match ``pred[order]`` (one class, score order) to ``truth`` (same class) greedily.

    Returns (matched truth index per prediction, -1 for a false positive; its IoU)."""
    matched = np.full(len(order), -1, dtype=np.int64)
    ious = np.zeros(len(order))
    if len(order) == 0 or len(truth) == 0:
        return matched, ious
    iou = box_iou(pred.boxes[order], truth.boxes)
    taken = np.zeros(len(truth), dtype=bool)
    for i in range(len(order)):
        row = np.where(taken, -1.0, iou[i])
        j = int(np.argmax(row))
        if row[j] >= iou_threshold:
            taken[j] = True
            matched[i], ious[i] = j, row[j]
    return matched, ious


def evaluate_detections(preds: Sequence[Detections], truths: Sequence[Detections], *,
                        iou_threshold: float = IOU_THRESHOLD,
                        class_names: Sequence[str] = ()) -> dict[str, Any]:
    """mAP at ``iou_threshold`` of ``preds`` against ``truths`` (one entry per image).

    Returns ``map50`` (mean over classes with ground truth), ``ap_per_class``
    {name: AP}, counts per class, the matched pairs' ``mean_iou``, and the score drift
    of matched pairs (``score_drift_mean`` signed, ``score_drift_mean_abs``,
    ``score_drift_max_abs``): meaningful when ``truths`` carry scores (a float model).
    """
    if len(preds) != len(truths):
        raise BadInputError(f"{len(preds)} images of detections against {len(truths)} images of ground truth")
    if not 0.0 < iou_threshold <= 1.0:
        raise BadInputError(f"IoU threshold must be in (0, 1], got {iou_threshold}")
    classes = sorted({int(c) for t in truths for c in t.labels} | {int(c) for p in preds for c in p.labels})
    names = list(class_names) or next((list(t.class_names) for t in list(truths) + list(preds) if t.class_names), [])

    def name_of(c: int) -> str:
        return names[c] if c < len(names) else str(c)

    ap: dict[str, float] = {}
    counts: dict[str, dict[str, int]] = {}
    no_truth: list[str] = []
    pair_ious: list[np.ndarray] = []
    drifts: list[np.ndarray] = []
    for c in classes:
        n_gt = sum(int((t.labels == c).sum()) for t in truths)
        scores, img_of = [], []
        per_image = []
        for i, (p, t) in enumerate(zip(preds, truths)):
            pi = np.flatnonzero(p.labels == c)
            per_image.append((p, t.take(t.labels == c), pi))
            scores.append(p.scores[pi])
            img_of.append(np.full(len(pi), i))
        all_scores = np.concatenate(scores) if scores else np.zeros(0)
        all_img = np.concatenate(img_of) if img_of else np.zeros(0, np.int64)
        all_idx = np.concatenate([pi for _, _, pi in per_image]) if per_image else np.zeros(0, np.int64)
        global_order = np.lexsort((all_img, -all_scores))  # score descending, then image order
        tp = np.zeros(len(all_scores), dtype=bool)
        # Matching is per image, in that image's score order; the global order only sorts the result.
        for i, (p, t, _) in enumerate(per_image):
            sel = np.flatnonzero(all_img == i)
            if len(sel) == 0:
                continue
            local = sel[np.lexsort((sel, -all_scores[sel]))]
            matched, ious = match_image(p, t, all_idx[local])
            tp[local] = matched >= 0
            hit = matched >= 0
            pair_ious.append(ious[hit])
            if hit.any():
                drifts.append(all_scores[local][hit] - t.scores[matched[hit]])
        name = name_of(c)
        counts[name] = {"ground_truth": n_gt, "detections": int(len(all_scores)), "true_positives": int(tp.sum())}
        if n_gt == 0:
            no_truth.append(name)
            continue
        ap[name] = average_precision(tp[global_order], n_gt)
    if not ap:
        raise BadInputError("no ground-truth boxes in the evaluation set: mAP is undefined")
    ious = np.concatenate(pair_ious) if pair_ious else np.zeros(0)
    drift = np.concatenate(drifts) if drifts else np.zeros(0)
    n_truth = sum(len(t) for t in truths)
    n_pred = sum(len(p) for p in preds)
    out: dict[str, Any] = {
        "map50" if iou_threshold == IOU_THRESHOLD else f"map@{iou_threshold:g}": float(np.mean(list(ap.values()))),
        "ap_per_class": ap, "counts_per_class": counts, "classes_without_ground_truth": no_truth,
        "images": len(truths), "ground_truth_boxes": n_truth, "detections": n_pred,
        "recall": float(sum(v["true_positives"] for v in counts.values()) / max(n_truth, 1)),
        "mean_iou": float(ious.mean()) if len(ious) else 0.0,
    }
    if len(drift):
        out.update({"score_drift_mean": float(drift.mean()), "score_drift_mean_abs": float(np.abs(drift).mean()),
                    "score_drift_max_abs": float(np.abs(drift).max())})
    return out


def compare_to_reference(preds: Sequence[Detections], reference: Sequence[Detections], *,
                         truths: Sequence[Detections] | None = None, what: str = "model",
                         source: str = "the evaluation set") -> dict[str, Any]:
    """A compressed detector against its float reference (and ground truth, when there is
    some): ``map50`` against the float model's detections, score drift of matched pairs,
    and ``map50_ground_truth`` / ``map50_ground_truth_float`` for both models.

    A reference that detects nothing on the whole set is bad input (the data or the
    preprocessing do not fit the detector: mAP would be undefined); a compressed model
    that detects nothing where the reference does is a failed check, said plainly.
    """
    n_ref = sum(len(r) for r in reference)
    n_pred = sum(len(p) for p in preds)
    if n_ref == 0:
        raise BadInputError(f"the float model detects nothing on the {len(reference)} images of {source}: "
                            "mAP against it is undefined; check that the data holds the objects this detector finds "
                            "and that the preprocessing matches the model")
    if n_pred == 0:
        raise CheckFailedError(f"the {what} detects nothing on the {len(preds)} images of {source}, where the float "
                               f"model detects {n_ref} boxes: compression destroyed the detector (mAP 0)")
    out = evaluate_detections(preds, reference)
    out["reference_detections"] = n_ref
    if truths is not None:
        if sum(len(t) for t in truths) == 0:
            raise BadInputError(f"{source} has no ground-truth boxes")
        gt = evaluate_detections(preds, truths)
        gt_float = evaluate_detections(reference, truths)
        out["map50_ground_truth"] = gt["map50"]
        out["map50_ground_truth_float"] = gt_float["map50"]
        out["ap_per_class_ground_truth"] = gt["ap_per_class"]
        out["ap_per_class_ground_truth_float"] = gt_float["ap_per_class"]
        out["ground_truth_boxes"] = gt["ground_truth_boxes"]
    return out
