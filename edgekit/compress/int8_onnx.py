"""INT8 for ONNX-only models (an ONNX file edgekit did not produce, no PyTorch module).

The graph is calibrated with edgekit's streaming observers (``calibration.py``: same
four methods, bounded histograms) on the tensors that get Q/DQ, and Q/DQ nodes are
placed by ONNX Runtime's ``QDQQuantizer`` from those ranges: per-channel int8 weights,
per-tensor activations in the target's scheme (uint8 for "u8s8", int8 for "s8s8",
symmetric int8 for "trt"). The result is an ONNX model; the handle keeps ``module=None``
and the artifact stores ``model.onnx``.

Where the Q/DQ go (``placement``):

- "linear": only the inputs of the MatMul / Gemm nodes whose second operand is a weight
  initializer (a transformer's Q/K/V, output and FFN projections), output left in float,
  so ONNX Runtime runs them as ``MatMulIntegerToFloat``. LayerNorm, Softmax, GELU, the
  residual Adds, the attention-score MatMuls (activation x activation) and the embedding
  Gather stay float: per-tensor int8 on those destroys a BERT's output (mean cosine 0.06
  on MiniLM-L6 with "all", benchmarks/RESULTS.md).
- "all": ONNX Runtime's placement on every op of ``OP_TYPES`` (what CNNs want: QLinearConv,
  QLinearAdd ... end to end in integers).
- "auto" (the default): "all" when the graph has a Conv, else "linear".

    >>> quantize_onnx_file(Path("bert.onnx"), Path("bert.int8.onnx"), samples, ["input_ids", "attention_mask"],
    ...                    "percentile", 99.99, "u8s8", placement="linear")  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.compress.calibration import HistogramObserver, choose_range
from edgekit.errors import BadInputError, bad_choice
from edgekit.sources.handle import ModelHandle, StepRecord

OP_TYPES = ["Conv", "MatMul", "Gemm", "Add", "Mul", "GlobalAveragePool", "AveragePool", "MaxPool",
            "Relu", "Clip", "Concat", "Reshape", "Flatten", "Transpose", "Sigmoid", "Resize"]
PLACEMENTS = ("auto", "linear", "all")
LINEAR_OPS = ("MatMul", "Gemm")
# Calibration when the config leaves it open. MiniLM-L6, linear placement, 533 sentences: mean cosine
# to FP32 mse 0.993, minmax 0.992, percentile 99.99 0.961, entropy 0.961 (percentile and entropy clip
# BERT's few outlier hidden channels; benchmarks/RESULTS.md).
DEFAULT_CALIB_METHOD = {"linear": "mse", "all": "percentile"}


def weight_linear_nodes(model: Any) -> list[Any]:
    """MatMul / Gemm nodes whose B operand is a 2-d float32 weight initializer and whose A operand
    is not (the Linear layers of a transformer; attention-score MatMuls have two activations)."""
    from onnx import TensorProto

    inits = {i.name: i for i in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type not in LINEAR_OPS or len(n.input) < 2:
            continue
        w = inits.get(n.input[1])
        if w is not None and len(w.dims) == 2 and w.data_type == TensorProto.FLOAT and n.input[0] not in inits:
            out.append(n)
    return out


def resolve_placement(model: Any, placement: str) -> str:
    """"auto" -> "all" for graphs with a Conv (CNNs), else "linear" (transformers, MLPs)."""
    if placement not in PLACEMENTS:
        raise bad_choice("INT8 placement", placement, PLACEMENTS)
    if placement != "auto":
        return placement
    return "all" if any(n.op_type == "Conv" for n in model.graph.node) else "linear"


def _ort_dtype_ok(name: str, types: dict[str, int]) -> bool:
    import onnx

    return types.get(name, onnx.TensorProto.FLOAT) == onnx.TensorProto.FLOAT


def quantize_onnx_file(src: Path, dst: Path, samples: Any, input_names: list[str], method: str | None,
                       percentile: float, scheme: str, batch_size: int = 8, placement: str = "auto") -> dict[str, Any]:
    """Calibrate ``src`` on ``samples`` and write the QDQ model to ``dst`` (Q/DQ per ``placement``).
    ``method`` None: "mse" for the linear placement, "percentile" for "all"."""
    import onnx

    model = onnx.load(str(src))
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:
        pass
    inits = {i.name for i in model.graph.initializer}
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(model.graph.value_info) +
             list(model.graph.input) + list(model.graph.output)}
    placement = resolve_placement(model, placement)
    if placement == "linear":
        quantizable = weight_linear_nodes(model)
        if not quantizable:
            raise BadInputError(f"{src} has no quantizable layers for placement 'linear' (no MatMul or Gemm "
                                "with a weight initializer)")
        opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
        if opset < 13:
            raise BadInputError(f"{src} has opset {opset}; per-channel DequantizeLinear needs opset 13 or newer "
                                "(re-export with a newer opset)")
        candidates = [n.input[0] for n in quantizable]
    else:
        quantizable = [n for n in model.graph.node if n.op_type in OP_TYPES]
        if not any(n.op_type in ("Conv", "MatMul", "Gemm") for n in quantizable):
            raise BadInputError(f"{src} has no quantizable layers (no Conv, MatMul or Gemm node)")
        candidates = [t for n in quantizable for t in list(n.input) + list(n.output)]
    if method is None:
        method = DEFAULT_CALIB_METHOD[placement]
    tensors: list[str] = []
    for t in candidates:
        if t and t not in inits and t not in tensors and _ort_dtype_ok(t, types):
            tensors.append(t)
    observers = _observe(model, tensors, samples, input_names, batch_size)
    symmetric = scheme == "trt"
    qmin, qmax = (0, 255) if scheme == "u8s8" else (-128, 127)
    ranges = {}
    for t, obs in observers.items():
        if obs.count == 0:
            continue
        lo, hi = choose_range(obs, method, percentile, qmin, qmax, symmetric)
        ranges[t] = (np.float32(lo), np.float32(hi))
    if placement == "linear":
        quantized = insert_linear_qdq(model, quantizable, ranges, scheme)
        onnx.save(quantized, str(dst))
    else:
        _quantize_all(model, ranges, scheme, dst)
    return {"placement": placement, "calib_method": method, "calibrated_tensors": len(ranges),
            "quantized_nodes": len(quantizable)}


def _observe(model: Any, tensors: list[str], samples: Any, input_names: list[str],
             batch_size: int) -> dict[str, HistogramObserver]:
    """One streaming pass of ONNX Runtime over ``samples``, histograms of ``tensors``."""
    import onnx
    import onnxruntime as ort
    import torch

    augmented = copy.deepcopy(model)
    have = {o.name for o in augmented.graph.output}
    for t in tensors:
        if t not in have:
            augmented.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    observers = {t: HistogramObserver(t) for t in tensors}
    with tempfile.TemporaryDirectory(prefix="edgekit-int8-") as tmp:
        aug_path = Path(tmp) / "augmented.onnx"
        onnx.save(augmented, str(aug_path))
        sess = ort.InferenceSession(str(aug_path), so, providers=["CPUExecutionProvider"])
        out_names = [o.name for o in sess.get_outputs()]
        for b in samples.batches(batch_size):
            outs = sess.run(None, {k: b[k] for k in input_names})
            for name, arr in zip(out_names, outs, strict=True):
                if name in observers and isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                    observers[name].update(torch.from_numpy(np.ascontiguousarray(arr)))
    return observers


def _quantize_all(model: Any, ranges: dict[str, tuple[Any, Any]], scheme: str, dst: Path) -> None:
    """Placement "all": ONNX Runtime's QDQQuantizer on every op of OP_TYPES, from edgekit's ranges."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    tensors_range = TensorsData(CalibrationMethod.MinMax, {k: (v[0], v[1]) for k, v in ranges.items()})
    act = QuantType.QUInt8 if scheme == "u8s8" else QuantType.QInt8
    extra = {"ActivationSymmetric": scheme == "trt", "WeightSymmetric": True}
    quantizer = QDQQuantizer(model, True, False, QuantType.QInt8, act, tensors_range, [], [], OP_TYPES, extra)
    quantizer.quantize_model()
    quantizer.model.save_model_to_file(str(dst), False)


def quantize_weight_per_channel(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 (grid -127..127) of a 2-d weight along ``axis`` (the output
    channels): ``(q int8, scale float32)`` with ``w ~= q * scale`` broadcast on ``axis``."""
    absmax = np.abs(w).max(axis=1 - axis)
    scale = np.maximum(absmax / 127.0, 1e-12).astype(np.float32)
    shape = [1, 1]
    shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -127, 127).astype(np.int8)
    return q, scale


def insert_linear_qdq(model: Any, nodes: list[Any], ranges: dict[str, tuple[Any, Any]], scheme: str) -> Any:
    """Placement "linear": Q/DQ on the activation input and per-channel int8 DQ on the weight of
    each node of ``nodes`` (MatMul / Gemm with a weight initializer); only these nodes read the
    dequantized tensors, every other consumer (residual Adds, LayerNorm) keeps the float one.
    The output stays float, so ONNX Runtime fuses each into ``MatMulIntegerToFloat``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from edgekit.compress.calibration import qparams

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    symmetric = scheme == "trt"
    qmin, qmax = (0, 255) if scheme == "u8s8" else (-128, 127)
    zp_type = TensorProto.UINT8 if scheme == "u8s8" else TensorProto.INT8
    new_inits: list[Any] = []
    new_nodes: dict[str, list[Any]] = {}  # consumer node name -> Q/DQ nodes to insert before it
    done: dict[str, str] = {}  # float tensor -> its dequantized name
    used = {n.name for n in graph.node}

    def unique(name: str) -> str:
        while name in used or name in inits:
            name += "_"
        used.add(name)
        return name

    for k, n in enumerate(nodes):
        if not n.name:
            n.name = unique(f"edgekit_linear_{k}")
        pending: list[Any] = []
        x = n.input[0]
        if x in ranges and x not in done:
            scale, zp = qparams(float(ranges[x][0]), float(ranges[x][1]), qmin, qmax, symmetric)
            s_name, z_name = unique(f"{x}_scale"), unique(f"{x}_zero_point")
            new_inits += [numpy_helper.from_array(np.array(scale, np.float32), s_name),
                          helper.make_tensor(z_name, zp_type, [], [zp])]
            q_out, dq_out = unique(f"{x}_quantized"), unique(f"{x}_dequantized")
            pending += [helper.make_node("QuantizeLinear", [x, s_name, z_name], [q_out], name=unique(f"{x}_Q")),
                        helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out],
                                         name=unique(f"{x}_DQ"))]
            done[x] = dq_out
        if x in done:
            n.input[0] = done[x]
        w_name = n.input[1]
        if w_name not in done:
            w = numpy_helper.to_array(inits[w_name]).astype(np.float32)
            trans_b = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
            axis = 0 if trans_b else 1  # the output-channel axis: (in, out), or (out, in) for Gemm transB
            q, scale = quantize_weight_per_channel(w, axis)
            q_name, s_name, z_name = unique(f"{w_name}_quantized"), unique(f"{w_name}_scale"), unique(f"{w_name}_zero_point")
            new_inits += [numpy_helper.from_array(q, q_name), numpy_helper.from_array(scale, s_name),
                          numpy_helper.from_array(np.zeros(scale.shape, np.int8), z_name)]
            dq_out = unique(f"{w_name}_dequantized")
            pending.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                            name=unique(f"{w_name}_DQ"), axis=axis))
            done[w_name] = dq_out
        n.input[1] = done[w_name]
        new_nodes[n.name] = pending
    ordered = []
    for n in graph.node:
        ordered += new_nodes.get(n.name, [])
        ordered.append(n)
    del graph.node[:]
    graph.node.extend(ordered)
    still_used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [i for i in graph.initializer if i.name in still_used]  # float weights now read only as int8
    del graph.initializer[:]
    graph.initializer.extend(kept + new_inits)
    onnx.checker.check_model(model)
    return model


def quantize_onnx_handle(handle: ModelHandle, config: Any, ctx: Any, scheme: str) -> ModelHandle:
    from edgekit.compress import config_to_dict
    from edgekit.compress.int8 import _calibration_samples

    if config.method != "ptq":
        raise BadInputError(f"model {handle.name!r} is an ONNX file without a PyTorch module: only --method ptq "
                            "is possible (QAT needs the PyTorch model)")
    if config.max_accuracy_drop is not None:
        raise BadInputError(f"--max-accuracy-drop needs the PyTorch model; {handle.name!r} is ONNX-only")
    t0 = time.perf_counter()
    samples, _ = _calibration_samples(handle, config, ctx)  # (calib, held-out): no fallback here
    names = [s.name for s in handle.inputs]
    work = Path(ctx.work_dir) if ctx.work_dir is not None else Path(tempfile.mkdtemp(prefix="edgekit-int8-"))
    work.mkdir(parents=True, exist_ok=True)
    dst = work / "model.int8.onnx"
    # The observation pass returns every calibrated tensor of a batch at once: a model with large
    # activations (a detector at 800 x 608: ~2 GB per image) names a smaller batch in its handle.
    info = quantize_onnx_file(Path(handle.onnx_path), dst, samples, names, config.calib_method,  # type: ignore[arg-type]
                              config.percentile, scheme, placement=config.placement,
                              batch_size=int(handle.extra.get("calib_batch", 8)))
    seconds = time.perf_counter() - t0
    metrics: dict[str, Any] = {"scheme": scheme, "calib_samples": len(samples), "ptq_seconds": round(seconds, 3),
                               **info}
    from edgekit.compress.int8 import load_split, score

    ev = None
    try:  # the given eval data, else the model's default eval split when it has one
        ev = load_split(handle, ctx, "eval", config.eval_samples)
    except BadInputError:
        if ctx.eval is not None:
            raise
    if ev is not None:
        import onnxruntime as ort

        def run(path: Path) -> np.ndarray:
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            return np.concatenate([sess.run(None, {k: b[k] for k in names})[0] for b in ev.batches(16)])

        metrics["int8"] = score(run(dst), run(Path(handle.onnx_path)), ev.labels, handle.evaluator)
    new = copy.copy(handle)
    new.onnx_path = dst
    new.module = None
    new.steps = [*handle.steps, StepRecord("int8", config_to_dict(config),
                                           {"scheme": scheme, "from": "onnx", "float_layers": [],
                                            "placement": info["placement"], "calib_method": info["calib_method"]})]
    ctx.metrics["int8"] = metrics
    return new
