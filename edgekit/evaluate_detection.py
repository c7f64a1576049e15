"""The "detection" evaluation: a detector's decoded boxes against its float model's and
against ground truth where the data has it (mAP@0.5 per class, then the mean; score drift).

The decoder comes from the model handle's ``extra["detection"]`` (``{"decoder":
"centerface" | "picodet", "config": {...}, "input_size": [h, w]}``), looked up on the
evaluated model first and then on the reference (an engine carries none; its float
reference does). Ground truth comes from ``edgekit.sources.detection_data.ground_truth``
for the built-in detection data sets (``layout-pages``, ``cabin-faces``), looked up by
the samples' pool indices; other data are compared with the float model only.

Metrics (all in the returned dict): ``map50`` against the float model's detections when
a reference is given, else against ground truth; ``map50_ground_truth`` and
``map50_ground_truth_float`` (both models against ground truth) when there is ground
truth; ``ap_per_class``; ``score_drift_mean`` / ``_mean_abs`` / ``_max_abs`` of matched
pairs; ``mean_iou``; ``recall``; box counts.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edgekit.detection import Detections, compare_to_reference, evaluate_detections, make_decoder
from edgekit.errors import BadInputError
from edgekit.progress import progress_bar
from edgekit.sources.data import Samples
from edgekit.sources.detection_data import ground_truth
from edgekit.sources.handle import ModelHandle

Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]
# model -> (a function feeds -> all outputs, the model's static batch size or None); the
# evaluate module passes its own (the runners every evaluation shares)
RunnerOf = Callable[[Any], tuple[Runner, int | None]]


def detection_spec(*models: Any) -> dict[str, Any]:
    """The first ``extra["detection"]`` among ``models`` (handles; engines have none)."""
    for m in models:
        if isinstance(m, ModelHandle) and isinstance(m.extra.get("detection"), dict):
            return m.extra["detection"]
    names = ", ".join(getattr(m, "name", type(m).__name__) for m in models if m is not None)
    raise BadInputError(f"cannot decode detections of {names}: no model declares a detection decoder "
                        "(extra['detection']); evaluate against the float zoo model (reference=) or use a built-in "
                        "detector (centerface, picodet-layout)")


def run_detector(model: Any, samples: Samples, spec: dict[str, Any], runner_of: RunnerOf, *,
                 batch_size: int | None = None, description: str = "detect",
                 progress: bool | None = None) -> list[Detections]:
    """Run ``model`` over ``samples`` (all outputs) and decode every image, in input pixels."""
    runner, fixed = runner_of(model)
    decode = make_decoder(spec)
    default = model.extra.get("eval_batch", 4) if isinstance(model, ModelHandle) else 4
    bs = fixed or batch_size or int(default)
    out: list[Detections] = []
    total = (len(samples) + bs - 1) // bs
    for feeds in progress_bar(samples.batches(bs), description, total=total, enabled=progress):
        k = len(next(iter(feeds.values())))
        if fixed and k < fixed:  # pad the last batch of a static-batch engine
            feeds = {n: np.concatenate([v, np.repeat(v[-1:], fixed - k, axis=0)]) for n, v in feeds.items()}
        outputs = [np.asarray(o) for o in runner(feeds)]
        out.extend(decode(outputs)[:k])
    return out


def to_image_pixels(dets: list[Detections], input_size: tuple[int, int],
                    image_sizes: list[tuple[int, int]]) -> list[Detections]:
    """Boxes from the model's input frame to each image's pixels (plain resize per axis)."""
    ih, iw = input_size
    return [d.scaled(w / iw, h / ih) for d, (h, w) in zip(dets, image_sizes)]


def evaluate_detector(model: Any, samples: Samples, reference: Any = None, *, runner_of: RunnerOf,
                      batch_size: int | None = None, progress: bool | None = None) -> dict[str, Any]:
    """mAP@0.5 and score drift of ``model`` on ``samples`` (see the module docstring).

    Called by ``edgekit.evaluate.evaluate`` (evaluator "detection"), which passes ``runner_of``.

    >>> evaluate(int8_engine, load_samples("layout-pages", h, split="eval"), reference=h)  # doctest: +SKIP
    {'evaluator': 'detection', 'map50': 0.97, 'map50_ground_truth': 0.81, ...}
    """
    spec = detection_spec(model, reference)
    if len(samples) == 0:
        raise BadInputError(f"no samples to evaluate in {samples.source!r} ({samples.split} split)")
    truth = ground_truth(samples.source, samples.split, samples.indices)
    if reference is None and truth is None:
        raise BadInputError(f"{samples.source!r} has no ground-truth boxes; detection quality needs the float model "
                            f"as reference (built-in data with boxes: layout-pages, cabin-faces)")
    if isinstance(reference, (np.ndarray, list, tuple)):
        raise BadInputError("the detection evaluation needs the reference model itself (its outputs are decoded), "
                            "not precomputed outputs")
    where = f"{len(samples)} images of {samples.source!r} ({samples.split} split)"
    preds = run_detector(model, samples, spec, runner_of, batch_size=batch_size, progress=progress)
    input_size = tuple(spec.get("input_size") or ())
    if truth is not None and len(input_size) != 2:
        raise BadInputError("the detector's spec names no input_size [height, width]; boxes cannot be mapped to the "
                            "images' ground truth")
    result: dict[str, Any] = {"evaluator": "detection", "n": len(samples), "source": samples.source,
                              "split": samples.split, "decoder": spec.get("decoder"), "iou_threshold": 0.5}
    if reference is not None:
        ref = run_detector(reference, samples, spec, runner_of, batch_size=batch_size, description="reference",
                           progress=progress)
        if truth is not None:
            preds = to_image_pixels(preds, input_size, truth.image_sizes)
            ref = to_image_pixels(ref, input_size, truth.image_sizes)
        result.update(compare_to_reference(preds, ref, truths=None if truth is None else truth.detections,
                                           what="compressed model", source=where))
        result["matched_to"] = "float model (IoU >= 0.5)"
    else:
        assert truth is not None
        preds = to_image_pixels(preds, input_size, truth.image_sizes)
        if sum(len(p) for p in preds) == 0:
            raise BadInputError(f"the model detects nothing on the {where}: mAP is undefined; check that the "
                                "preprocessing matches the model")
        gt = evaluate_detections(preds, truth.detections)
        result.update(gt)
        result["map50_ground_truth"] = gt["map50"]
        result["matched_to"] = "ground truth (IoU >= 0.5)"
    return result
