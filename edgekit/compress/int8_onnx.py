"""INT8 for ONNX-only models (an ONNX file edgekit did not produce, no PyTorch module).

The graph is calibrated with edgekit's streaming observers (``calibration.py``: same
four methods, bounded histograms) on the tensors ONNX Runtime's QDQ quantizer will
quantize, and Q/DQ nodes are placed by ONNX Runtime's ``QDQQuantizer`` from those
ranges: per-channel int8 weights, per-tensor activations in the target's scheme
(uint8 for "u8s8", int8 for "s8s8", symmetric int8 for "trt"). The result is an ONNX
model; the handle keeps ``module=None`` and the artifact stores ``model.onnx``.
"""
from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.compress.calibration import HistogramObserver, choose_range
from edgekit.errors import BadInputError
from edgekit.sources.handle import ModelHandle, StepRecord

OP_TYPES = ["Conv", "MatMul", "Gemm", "Add", "Mul", "GlobalAveragePool", "AveragePool", "MaxPool",
            "Relu", "Clip", "Concat", "Reshape", "Flatten", "Transpose", "Sigmoid", "Resize"]


def _ort_dtype_ok(name: str, types: dict[str, int]) -> bool:
    import onnx

    return types.get(name, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT


def quantize_onnx_file(src: Path, dst: Path, samples: Any, input_names: list[str], method: str,
                       percentile: float, scheme: str, batch_size: int = 8) -> dict[str, Any]:
    """Calibrate ``src`` on ``samples`` and write the QDQ model to ``dst``."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    model = onnx.load(str(src))
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:
        pass
    inits = {i.name for i in model.graph.initializer}
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(model.graph.value_info) +
             list(model.graph.input) + list(model.graph.output)}
    quantizable = [n for n in model.graph.node if n.op_type in OP_TYPES]
    if not any(n.op_type in ("Conv", "MatMul", "Gemm") for n in quantizable):
        raise BadInputError(f"{src} has no quantizable layers (no Conv, MatMul or Gemm node)")
    tensors: list[str] = []
    for n in quantizable:
        for t in list(n.input) + list(n.output):
            if t and t not in inits and t not in tensors and _ort_dtype_ok(t, types):
                tensors.append(t)
    augmented = copy.deepcopy(model)
    have = {o.name for o in augmented.graph.output}
    for t in tensors:
        if t not in have:
            augmented.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="edgekit-int8-") as tmp:
        aug_path = Path(tmp) / "augmented.onnx"
        onnx.save(augmented, str(aug_path))
        sess = ort.InferenceSession(str(aug_path), so, providers=["CPUExecutionProvider"])
        out_names = [o.name for o in sess.get_outputs()]
        observers = {t: HistogramObserver(t) for t in tensors}
        import torch

        for b in samples.batches(batch_size):
            outs = sess.run(None, {k: b[k] for k in input_names})
            for name, arr in zip(out_names, outs, strict=True):
                if name in observers and isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                    observers[name].update(torch.from_numpy(np.ascontiguousarray(arr)))
    symmetric = scheme == "trt"
    qmin, qmax = (0, 255) if scheme == "u8s8" else (-128, 127)
    ranges = {}
    for t, obs in observers.items():
        if obs.count == 0:
            continue
        lo, hi = choose_range(obs, method, percentile, qmin, qmax, symmetric)
        ranges[t] = (np.float32(lo), np.float32(hi))
    tensors_range = TensorsData(CalibrationMethod.MinMax, {k: (v[0], v[1]) for k, v in ranges.items()})
    act = QuantType.QUInt8 if scheme == "u8s8" else QuantType.QInt8
    extra = {"ActivationSymmetric": symmetric, "WeightSymmetric": True}
    quantizer = QDQQuantizer(model, True, False, QuantType.QInt8, act, tensors_range, [], [], OP_TYPES, extra)
    quantizer.quantize_model()
    quantizer.model.save_model_to_file(str(dst), False)
    return {"calibrated_tensors": len(ranges)}


def quantize_onnx_handle(handle: ModelHandle, config: Any, ctx: Any, scheme: str) -> ModelHandle:
    from edgekit.compress import config_to_dict
    from edgekit.compress.int8 import _calibration_samples

    if config.method != "ptq":
        raise BadInputError(f"model {handle.name!r} is an ONNX file without a PyTorch module: only --method ptq "
                            "is possible (QAT needs the PyTorch model)")
    if config.max_accuracy_drop is not None:
        raise BadInputError(f"--max-accuracy-drop needs the PyTorch model; {handle.name!r} is ONNX-only")
    t0 = time.perf_counter()
    samples = _calibration_samples(handle, config, ctx)
    names = [s.name for s in handle.inputs]
    work = Path(ctx.work_dir) if ctx.work_dir is not None else Path(tempfile.mkdtemp(prefix="edgekit-int8-"))
    work.mkdir(parents=True, exist_ok=True)
    dst = work / "model.int8.onnx"
    info = quantize_onnx_file(Path(handle.onnx_path), dst, samples, names, config.calib_method,  # type: ignore[arg-type]
                              config.percentile, scheme)
    seconds = time.perf_counter() - t0
    metrics: dict[str, Any] = {"scheme": scheme, "calib_method": config.calib_method,
                               "calib_samples": len(samples), "ptq_seconds": round(seconds, 3), **info}
    if ctx.eval is not None:
        import onnxruntime as ort

        from edgekit.compress.int8 import load_split, score

        ev = load_split(handle, ctx, "eval", config.eval_samples)

        def run(path: Path) -> np.ndarray:
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            return np.concatenate([sess.run(None, {k: b[k] for k in names})[0] for b in ev.batches(16)])

        metrics["int8"] = score(run(dst), run(Path(handle.onnx_path)), ev.labels, handle.evaluator)
    new = copy.copy(handle)
    new.onnx_path = dst
    new.module = None
    new.steps = [*handle.steps, StepRecord("int8", config_to_dict(config),
                                           {"scheme": scheme, "from": "onnx", "float_layers": []})]
    ctx.metrics["int8"] = metrics
    return new
