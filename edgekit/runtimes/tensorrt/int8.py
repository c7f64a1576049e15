"""INT8 decided where the engine is built: put a quantized graph into TensorRT's Q/DQ
flavour (``qdq.convert_to_tensorrt``) and measure what that costs.

The cost is measured against the float model the graph was quantized from, on that
model's calibration data, with ONNX Runtime running both graphs exactly as written
(optimizations off: plain Q/DQ arithmetic, which is what TensorRT is asked to compute):
top-1 agreement, top-5 agreement and mean KL for classifiers, cosine similarity for
other outputs, before and after the conversion. Where the float model or its data are
not known (an ONNX file that arrived quantized), the converted graph is compared with
the graph as given on the engine's sample inputs, and the record says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from edgekit.artifact import is_artifact, read_manifest
from edgekit.errors import EdgekitError
from edgekit.evaluate import agreement_metrics, cosine_metrics, make_runner
from edgekit.runtimes.tensorrt.qdq import QdqConversion, convert_to_tensorrt
from edgekit.sources.data import load_samples
from edgekit.sources.models import load_model

CONVERTED_SUFFIX = "_tensorrt"
DEFAULT_SAMPLES = 64
_BATCH = 8


@dataclass
class Int8Graph:
    """The graph a TensorRT build uses and how it was made from the graph it was given."""

    onnx: Path  # the graph to build from (the given one when nothing changed)
    conversion: QdqConversion
    accuracy: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {**self.conversion.to_dict(), "built_from": self.onnx.name, "accuracy": self.accuracy}

    def message(self) -> str:
        """One line for the build's output."""
        acc = self.accuracy
        if not self.conversion.changed:
            return f"INT8: {self.conversion.summary()}"
        head = f"INT8 converted to TensorRT's Q/DQ form: {self.conversion.summary()}"
        if not acc.get("measured"):
            return f"{head}; accuracy cost not measured: {acc.get('reason')}"
        before, after = acc["as_given"], acc["converted"]
        keys = ("top1_agreement", "mean_kl") if "top1_agreement" in after else ("mean_cosine", "min_cosine")
        change = ", ".join(f"{k} {before[k]:.4f} -> {after[k]:.4f}" for k in keys)
        return (f"{head}; cost against {acc['reference']} on {acc['samples']} samples of {acc['data']}, as given -> "
                f"converted: {change}")


def prepare_int8_graph(onnx_path: Path, feeds: dict[str, np.ndarray] | None = None,
                       samples: int = DEFAULT_SAMPLES) -> Int8Graph:
    """Convert ``onnx_path`` (a graph with Q/DQ) into TensorRT's flavour, written beside it as
    ``<name>_tensorrt.onnx`` when anything changed, and measure the cost. Raises
    ``QdqRefusal`` (exit 2) with the reason when the graph cannot be converted."""
    model = onnx.load(str(onnx_path))
    converted, report = convert_to_tensorrt(model)
    if not report.changed:
        return Int8Graph(onnx_path, report, {"measured": False, "reason": "nothing changed"})
    out = onnx_path.with_name(onnx_path.stem + CONVERTED_SUFFIX + ".onnx")
    large = converted.ByteSize() > 1_800_000_000
    onnx.save_model(converted, str(out), save_as_external_data=large,
                    location=out.name + ".data" if large else None)
    return Int8Graph(out, report, measure_cost(onnx_path, out, feeds, samples))


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # Q/DQ arithmetic as written
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The first output over all samples, in batches (one at a time for a static batch of 1)."""
    first = sess.get_inputs()[0]
    static = isinstance(first.shape[0], int) and first.shape[0] > 0
    step = int(first.shape[0]) if static else _BATCH
    names = [i.name for i in sess.get_inputs()]
    n = len(next(iter(inputs.values())))
    outs = []
    for start in range(0, n - (n % step if static else 0), step):
        outs.append(sess.run(None, {k: inputs[k][start:start + step] for k in names})[0])
    return np.concatenate(outs)


def _compare(out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    classifier = out.ndim == 2 and out.shape[-1] > 5
    return agreement_metrics(out, ref) if classifier else cosine_metrics(out, ref)


def measure_cost(original: Path, converted: Path, feeds: dict[str, np.ndarray] | None,
                 limit: int = DEFAULT_SAMPLES) -> dict[str, Any]:
    """Metrics of the graph as given and of the converted graph against the float model
    on its calibration data (or, where those are unknown, converted against as given)."""
    reason = _float_model_unknown(original)
    manifest = read_manifest(original.parent) if reason is None else None
    if manifest is not None and manifest.source:
        try:
            handle = load_model(manifest.source)
            data = load_samples(None, handle, split="calib", limit=limit)
            if handle.module is None:
                raise EdgekitError(f"{manifest.source!r} loads without a PyTorch module")
        except (EdgekitError, OSError, ImportError) as e:
            reason = f"the float model {manifest.source!r} or its calibration data could not be loaded ({e})"
        else:
            runner = make_runner(handle)
            ref = np.concatenate([runner({k: v[i:i + _BATCH] for k, v in data.inputs.items()})[0]
                                  for i in range(0, len(data), _BATCH)])
            given = _run(_session(original), data.inputs)
            conv = _run(_session(converted), data.inputs)
            ref = ref[:len(given)]
            return {"measured": True, "reference": f"the float model {manifest.source}",
                    "data": f"{data.source} ({data.split} split)", "samples": int(len(given)),
                    "as_given": _compare(given, ref), "converted": _compare(conv, ref),
                    "method": "ONNX Runtime, optimizations off (Q/DQ arithmetic as written)"}
    if feeds:
        given = _run(_session(original), feeds)
        conv = _run(_session(converted), feeds)
        return {"measured": False, "reason": reason, "converted_vs_given": _compare(conv, given),
                "samples": int(len(given)), "data": "the engine's sample inputs"}
    return {"measured": False, "reason": reason}


def _float_model_unknown(original: Path) -> str | None:
    """Why the float model cannot be used (None when it can)."""
    if not is_artifact(original.parent):
        return "the graph is a bare ONNX file: its float model is not known"
    m = read_manifest(original.parent)
    if not m.source:
        return "the graph's manifest names no source model"
    if not m.steps:
        source = Path(m.source).name if m.source and Path(m.source).exists() else m.source
        return (f"{source!r} arrived already quantized: its float model is not known (quantize with "
                "`edgekit compress --bits 8` to have the cost measured)")
    return None
