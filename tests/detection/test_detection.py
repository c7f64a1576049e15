"""Boxes, NMS, decoders' input checks and mAP against hand-computed cases (no models)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekit.detection import (
    CenterFaceDecodeConfig,
    Detections,
    PicoDetDecodeConfig,
    average_precision,
    batched_nms,
    box_iou,
    compare_to_reference,
    decode_centerface,
    decode_picodet,
    evaluate_detections,
    make_decoder,
    nms,
)
from edgekit.detection.decode import dfl_distances
from edgekit.errors import BadInputError, CheckFailedError
from edgekit.pipelines.detection_stages import crop_faces, decode_faces


def dets(boxes, scores=None, labels=None, names=()):
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    n = len(boxes)
    return Detections(boxes, np.ones(n) if scores is None else scores, np.zeros(n) if labels is None else labels,
                      class_names=names)


def test_iou_hand_computed():
    iou = box_iou([[0, 0, 10, 10]], [[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 5, 5]])
    np.testing.assert_allclose(iou, [[1.0, 50 / 150, 0.0, 0.25]])


def test_nms_keeps_best_and_drops_overlaps():
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [20, 0, 30, 10], [0, 0, 10, 10.5]])
    scores = np.array([0.5, 0.9, 0.8, 0.7])
    # 1 (0.9) suppresses 0 (IoU 0.82) and 3 (IoU 0.78); 2 does not overlap
    assert nms(boxes, scores, 0.5).tolist() == [1, 2]
    # at 0.85 only 3 (0.7) suppresses 0 (IoU 100 / 105 = 0.95); 1 overlaps them by 0.82 and 0.78
    assert nms(boxes, scores, 0.85).tolist() == [1, 2, 3]
    assert nms(boxes, scores, 0.5, max_keep=1).tolist() == [1]
    assert nms(boxes, scores, 0.5, max_candidates=1).tolist() == [1]
    assert nms(np.zeros((0, 4)), np.zeros(0), 0.5).tolist() == []


def test_batched_nms_never_suppresses_across_classes():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10]])
    scores = np.array([0.9, 0.8, 0.7])
    labels = np.array([0, 1, 0])
    assert batched_nms(boxes, scores, labels, 0.5).tolist() == [0, 1]
    # the per-class cap: class 0 keeps at most one candidate
    assert batched_nms(boxes + np.array([[0, 0, 0, 0], [0, 0, 0, 0], [50, 0, 50, 0]]), scores, labels, 0.5,
                       max_keep=1).tolist() == [0, 1]


def test_nms_rejects_bad_threshold_and_mismatched_scores():
    with pytest.raises(BadInputError, match=r"NMS IoU threshold must be in \[0, 1\], got 1.5"):
        nms(np.zeros((1, 4)), np.ones(1), 1.5)
    with pytest.raises(BadInputError, match="NMS needs one score per box: 2 boxes, 1 scores"):
        nms(np.zeros((2, 4)), np.ones(1), 0.5)


def test_average_precision_all_point_interpolation():
    assert average_precision(np.array([True, True]), 2) == 1.0
    # TP, FP, TP over 2 truths: recall 0.5 at precision 1, recall 1 at precision 2/3
    assert average_precision(np.array([True, False, True]), 2) == pytest.approx(0.5 + 0.5 * 2 / 3)
    # FP first: the envelope makes precision 1/2 for the first recall step
    assert average_precision(np.array([False, True]), 1) == pytest.approx(0.5)
    assert average_precision(np.array([True]), 2) == pytest.approx(0.5)  # half the truths never found
    assert average_precision(np.array([], bool), 3) == 0.0


def test_map_perfect_shifted_duplicates_and_per_class_mean():
    truth = [dets([[0, 0, 10, 10], [20, 20, 40, 40]], labels=[0, 1], names=("a", "b"))]
    assert evaluate_detections(truth, truth)["map50"] == 1.0
    # a box shifted so that IoU = 1/3 < 0.5: no match; AP of that class 0, mean over 2 classes 0.5
    shifted = [dets([[5, 0, 15, 10], [20, 20, 40, 40]], labels=[0, 1], names=("a", "b"))]
    r = evaluate_detections(shifted, truth)
    assert r["ap_per_class"] == {"a": 0.0, "b": 1.0}
    assert r["map50"] == 0.5
    # a duplicate with a higher score than the true match: precision 1/2 at full recall
    dup = [dets([[0, 0, 10, 10], [0, 0, 10, 10.4]], scores=[0.6, 0.9], labels=[0, 0])]
    r = evaluate_detections(dup, [dets([[0, 0, 10, 10]])])
    assert r["ap_per_class"]["0"] == 1.0  # the first (0.9) matches; the duplicate comes after full recall
    dup_low = [dets([[0, 0, 10, 10], [30, 30, 40, 40]], scores=[0.6, 0.9], labels=[0, 0])]
    assert evaluate_detections(dup_low, [dets([[0, 0, 10, 10]])])["map50"] == pytest.approx(0.5)
    # two detections of one box: the second is a false positive (precision 1/2 once it comes)
    two = [dets([[0, 0, 10, 10], [0, 0, 10, 10], [50, 50, 60, 60]], scores=[0.9, 0.8, 0.7])]
    r = evaluate_detections(two, [dets([[0, 0, 10, 10], [50, 50, 60, 60]])])
    assert r["map50"] == pytest.approx(0.5 + 0.5 * 2 / 3)


def test_map_across_images_and_classes_without_truth():
    truth = [dets([[0, 0, 10, 10]]), dets([[0, 0, 10, 10]])]
    pred = [dets([[0, 0, 10, 10]], scores=[0.9]), dets([[0, 0, 10, 10], [0, 0, 5, 5]], scores=[0.5, 0.7],
                                                        labels=[0, 1])]
    r = evaluate_detections(pred, truth)
    assert r["ap_per_class"] == {"0": 1.0}
    assert r["classes_without_ground_truth"] == ["1"]
    assert r["recall"] == 1.0


def test_score_drift_against_reference():
    ref = [dets([[0, 0, 10, 10], [20, 0, 30, 10]], scores=[0.9, 0.6])]
    pred = [dets([[0, 0, 10, 11], [20, 0, 30, 10]], scores=[0.8, 0.7])]
    r = compare_to_reference(pred, ref)
    assert r["map50"] == 1.0
    assert r["score_drift_mean"] == pytest.approx(0.0, abs=1e-6)
    assert r["score_drift_mean_abs"] == pytest.approx(0.1, abs=1e-6)
    assert r["score_drift_max_abs"] == pytest.approx(0.1, abs=1e-6)
    assert r["mean_iou"] == pytest.approx((10 / 11 + 1) / 2)


def test_no_detections_is_an_error_not_a_zero():
    ref = [dets([[0, 0, 10, 10]]), dets([])]
    with pytest.raises(BadInputError, match="the float model detects nothing on the 2 images of the evaluation set"):
        compare_to_reference(ref, [dets([]), dets([])])
    with pytest.raises(CheckFailedError, match="the model detects nothing on the 2 images of the evaluation set, "
                                               "where the float model detects 1 boxes"):
        compare_to_reference([dets([]), dets([])], ref)
    with pytest.raises(BadInputError, match="no ground-truth boxes in the evaluation set: mAP is undefined"):
        evaluate_detections([dets([])], [dets([])])


def centerface_outputs(h=8, w=10, faces=((3, 4, 0.9),)):
    heat = np.zeros((1, 1, h, w), np.float32)
    scale = np.zeros((1, 2, h, w), np.float32)
    offset = np.zeros((1, 2, h, w), np.float32)
    lms = np.zeros((1, 10, h, w), np.float32)
    for r, c, s in faces:
        heat[0, 0, r, c] = s
        scale[0, :, r, c] = np.log(4.0)  # 4 cells -> 16 pixels
    return [heat, scale, offset, lms]


def test_decode_centerface_hand_computed_box():
    det = decode_centerface(centerface_outputs())[0]
    # centre ((4 + 0.5) * 4, (3 + 0.5) * 4) = (18, 14), size 16
    np.testing.assert_allclose(det.boxes, [[10, 6, 26, 22]])
    np.testing.assert_allclose(det.scores, [0.9])
    np.testing.assert_allclose(det.landmarks[0, :2], [10, 6])  # zero offsets: the box corner
    scaled = decode_centerface(centerface_outputs(), image_sizes=[(64, 80)])[0]  # input 32 x 40 -> image 2x
    np.testing.assert_allclose(scaled.boxes, [[20, 12, 52, 44]])
    # two cells of one face: NMS at 0.3 keeps the better one
    two = decode_centerface(centerface_outputs(faces=((3, 4, 0.9), (3, 5, 0.8))))[0]
    assert len(two) == 1
    assert len(decode_centerface(centerface_outputs(faces=((3, 4, 0.4),)))[0]) == 0


def test_decode_centerface_names_bad_outputs():
    outs = centerface_outputs()
    with pytest.raises(BadInputError, match=r"CenterFace decode: expected 4 outputs \[heatmap \(B, 1, h, w\), "
                                            r"scale \(B, 2, h, w\), offset \(B, 2, h, w\), landmarks \(B, 10, h, w\)\]; "
                                            r"got 3"):
        decode_centerface(outs[:3])
    with pytest.raises(BadInputError, match=r"output scale has shape \(1, 3, 8, 10\); expected \(B, 2, h, w\)"):
        decode_centerface([outs[0], np.zeros((1, 3, 8, 10), np.float32), outs[2], outs[3]])
    with pytest.raises(BadInputError, match=r"output offset has shape \(1, 2, 4, 10\); expected batch and grid "
                                            r"1 x 8 x 10 like the heatmap"):
        decode_centerface([outs[0], outs[1], np.zeros((1, 2, 4, 10), np.float32), outs[3]])
    with pytest.raises(BadInputError, match="output heatmap has dtype uint8; expected a floating-point array"):
        decode_centerface([outs[0].astype(np.uint8), *outs[1:]])
    with pytest.raises(BadInputError, match=r"CenterFace threshold must be in \[0, 1\), got 1.2"):
        CenterFaceDecodeConfig(threshold=1.2)


def picodet_outputs(input_size=(64, 32), classes=3, hits=()):
    cfg = PicoDetDecodeConfig(input_size=input_size, class_names=tuple("abc"[:classes]))
    scores, boxes = [], []
    for s in cfg.strides:
        n = -(-input_size[0] // s) * -(-input_size[1] // s)
        scores.append(np.zeros((1, n, classes), np.float32))
        boxes.append(np.full((1, n, 32), -20.0, np.float32))
    for level, cell, cls, score, dist in hits:
        scores[level][0, cell, cls] = score
        for side, d in enumerate(dist):  # put all probability on bin d of each side
            boxes[level][0, cell, side * 8 + d] = 20.0
    return scores + boxes, cfg


def test_decode_picodet_hand_computed_box():
    # stride 8, 64 x 32 input: 8 rows x 4 cols; cell 5 = row 1, col 1: centre (12, 12)
    outs, cfg = picodet_outputs(hits=[(0, 5, 2, 0.8, (1, 1, 2, 3))])
    det = decode_picodet(outs, cfg)[0]
    np.testing.assert_allclose(det.boxes, [[4, 4, 28, 36]], atol=1e-4)
    assert det.labels.tolist() == [2] and det.scores.tolist() == pytest.approx([0.8])
    # boxes are clipped to the input: distance 7 bins x 8 px from (12, 12) left -> 0
    outs, cfg = picodet_outputs(hits=[(0, 5, 0, 0.9, (7, 0, 0, 0))])
    np.testing.assert_allclose(decode_picodet(outs, cfg)[0].boxes, [[0, 12, 12, 12]], atol=1e-4)
    np.testing.assert_allclose(dfl_distances(np.zeros((1, 32))), [[3.5] * 4])  # uniform bins: their mean


def test_decode_picodet_names_bad_outputs():
    outs, cfg = picodet_outputs()
    with pytest.raises(BadInputError, match=r"PicoDet decode: expected 8 outputs \(class scores \(B, N, C\) for "
                                            r"strides \[8, 16, 32, 64\]"):
        decode_picodet(outs[:7], cfg)
    bad = list(outs)
    bad[1] = np.zeros((1, 9, 3), np.float32)
    with pytest.raises(BadInputError, match=r"class scores at stride 16 has shape \(1, 9, 3\); expected \(1, 8, 3\) "
                                            r"for an input of 64 x 32 \(4 x 2 cells\)"):
        decode_picodet(bad, cfg)
    bad = list(outs)
    bad[4] = bad[4].astype(np.int32)
    with pytest.raises(BadInputError, match="box logits at stride 8 has dtype int32"):
        decode_picodet(bad, cfg)
    with pytest.raises(BadInputError, match="the class scores have 3 classes; the model names 2"):
        decode_picodet(outs, PicoDetDecodeConfig(input_size=(64, 32), class_names=("a", "b")))


def test_make_decoder_rejects_unknown_names_and_options():
    with pytest.raises(BadInputError, match=r"unknown detection decoder 'yolo' \(choose from 'centerface', 'picodet'\)"):
        make_decoder({"decoder": "yolo"})
    with pytest.raises(BadInputError, match="detection decoder 'centerface'"):
        make_decoder({"decoder": "centerface", "config": {"treshold": 0.5}})
    decode = make_decoder({"decoder": "centerface", "config": {"threshold": 0.3}})
    assert len(decode(centerface_outputs(faces=((3, 4, 0.4),)))[0]) == 1


# ----- properties of NMS on random boxes -----


@st.composite
def random_boxes(draw):
    n = draw(st.integers(0, 30))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 100, (n, 2))
    wh = rng.uniform(1, 40, (n, 2))
    return np.concatenate([xy, xy + wh], axis=1), rng.random(n), rng.integers(0, 3, n)


@settings(max_examples=60, deadline=None)
@given(random_boxes(), st.sampled_from([0.3, 0.5, 0.7]))
def test_nms_properties(data, thr):
    boxes, scores, labels = data
    keep = nms(boxes, scores, thr)
    iou = box_iou(boxes, boxes)
    kept = set(keep.tolist())
    # no two kept boxes overlap more than the threshold
    for i in keep:
        for j in keep:
            assert i == j or iou[i, j] <= thr
    # every dropped box overlaps a kept box of at least its score by more than the threshold
    for d in set(range(len(boxes))) - kept:
        assert any(iou[d, k] > thr and scores[k] >= scores[d] for k in kept)
    # per-class NMS in one pass equals NMS class by class
    one_pass = set(batched_nms(boxes, scores, labels, thr).tolist())
    by_class = {int(np.flatnonzero(labels == c)[k]) for c in range(3)
                for k in nms(boxes[labels == c], scores[labels == c], thr)}
    assert one_pass == by_class


# ----- the pipeline stages' own input checks -----

def test_stage_inputs_that_do_not_fit_name_what_was_expected():
    frame = np.zeros((480, 640, 3), np.uint8)
    with pytest.raises(BadInputError, match=r"crop_faces: input image has shape \(480, 640, 3\) and dtype float32; "
                                            r"expected an H x W x 3 uint8 RGB image"):
        crop_faces(frame.astype(np.float32), np.zeros((0, 15), np.float32))
    with pytest.raises(BadInputError, match=r"crop_faces: input faces has shape \(2, 6\) and dtype float32; expected "
                                            r"\(n, 15\) floats as decode_faces returns them"):
        crop_faces(frame, np.zeros((2, 6), np.float32))
    heat, scale, offset, lms = centerface_outputs(h=120, w=160, faces=((30, 40, 0.9),))
    with pytest.raises(BadInputError, match="decode_faces: input heatmap has batch 2; this stage decodes one frame"):
        decode_faces(np.repeat(heat, 2, axis=0), scale, offset, lms)
    faces = decode_faces(heat, scale, offset, lms, frame_size=(480, 640))
    assert faces.shape == (1, 15) and faces.dtype == np.float32
    np.testing.assert_allclose(faces[0, :5], [154, 114, 170, 130, 0.9], atol=1e-5)  # input = frame: 480 x 640
    crops = crop_faces(frame, faces)
    assert crops.shape == (1, 3, 48, 48) and crops.dtype == np.float32
    assert crop_faces(frame, np.zeros((0, 15), np.float32)).shape == (0, 3, 48, 48)
