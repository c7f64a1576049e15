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

With "linear", layers named in ``keep_float`` stay float (weights and the inputs only they read):
"first", "last", or a layer's module path or its last parts (``lm_head``, ``down_proj``: every
block's), from the name scopes the dynamo exporter records on each node, else the node names.

Calibration observes only the inputs that get Q/DQ, in one streaming pass of ONNX Runtime over a
copy of the graph cut down to what computes them (a causal LM's vocabulary-sized head is not run),
and chooses each range from its histogram (``calibrate_graph``); ``write_int8_graph`` then inserts
the Q/DQ, so that one calibration can serve several variants.

Graphs as they come:

- Already quantized parts stay as they are; only the float parts are quantized. Integer
  ops, Q/DQ regions and their nodes are left out of the placement. Integer weights that
  the graph dequantizes (``DequantizeLinear``, or ``Cast`` [- zero point] ``* scale``, the
  form of some weight-only exporters) keep their stored values and grid: a Cast+Mul chain
  feeding a MatMul / Gemm / Conv weight becomes the equal ``DequantizeLinear`` (same
  integers, same scales, bit-identical result), and only the activation is quantized, so
  the weight-only MatMuls become integer MatMuls without rounding the weights twice.
  A graph with nothing float left to quantize is refused (``BadInputError``) naming what
  is quantized already.
- ``BatchNormalization`` that an exporter left after a Conv is folded first (ONNX
  Runtime's basic, hardware-independent optimizations): a Conv whose output feeds a float
  BatchNormalization cannot become a QLinearConv.
- A static batch dimension is honoured: calibration runs that many samples at a time.

The quantized graph is loaded and run once by ONNX Runtime before it is returned
(``verify_onnx_runs``), and compared with the float graph on data it was not calibrated
on where there is any (every output: cosine, largest and mean absolute difference). A causal
LM is compared window by window with the float model's statistics (``compare_lm_to_reference``):
the quality gate's own reference when the windows are the gate's, and the gate then reports
from that one run of the INT8 graph (``quality.Measured``).

    >>> quantize_onnx_file(Path("bert.onnx"), Path("bert.int8.onnx"), samples, ["input_ids", "attention_mask"],
    ...                    "percentile", 99.99, "u8s8", placement="linear")  # doctest: +SKIP
"""
from __future__ import annotations

import ast
import copy
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from edgekit.compress import StepContext, step_rewrite
from edgekit.compress.int8 import pairs, qdq
from edgekit.compress.int8.calibration import (
    HistogramObserver,
    check_agreement,
    choose_range,
    load_split,
    qparams,
    score,
)
from edgekit.compress.int8.technique_configs import MIN_CALIB_SAMPLES, PLACEMENTS, OnnxGraphConfig
from edgekit.compress.quality import (
    EVAL_WINDOWS,
    MEASURED,
    Measured,
    Reference,
    WindowStats,
    output_statistics,
    reference_on,
)
from edgekit.errors import BadInputError, bad_choice
from edgekit.evaluate import nll_rows
from edgekit.export.onnx import EXTERNAL_DATA_THRESHOLD
from edgekit.onnx_checks import VerifiedRun, ort_errors, ort_failure, verify_onnx_runs
from edgekit.onnx_int8_kernels import describe_semantics, host_semantics, session_for
from edgekit.sources.data import Samples, resolve_samples
from edgekit.sources.handle import ModelHandle, data_view
from edgekit.sources.onnx_file import (
    ONNX_LOAD_ERRORS,
    QuantizedGraph,
    constants_to_initializers,
    find_quantized,
    first_line,
    weight_dequant_chains,
)

OP_TYPES = ["Conv", "MatMul", "Gemm", "Add", "Mul", "GlobalAveragePool", "AveragePool", "MaxPool",
            "Relu", "Clip", "Concat", "Reshape", "Flatten", "Transpose", "Sigmoid", "Resize"]


LINEAR_OPS = ("MatMul", "Gemm")
WEIGHT_OPS = ("MatMul", "Gemm", "Conv")  # input 1 is the weight
# Calibration when the config leaves it open. MiniLM-L6, linear placement, 533 sentences: mean cosine
# to FP32 mse 0.993, minmax 0.992, percentile 99.99 0.961, entropy 0.961 (percentile and entropy clip
# BERT's few outlier hidden channels; benchmarks/RESULTS.md).
DEFAULT_CALIB_METHOD = {"linear": "mse", "all": "percentile"}
# DequantizeLinear takes int8/uint8 from opset 13 (per-axis scales too), 16-bit and 4-bit from opset 21.
DQ_MIN_OPSET = {TensorProto.INT8: 13, TensorProto.UINT8: 13, TensorProto.INT16: 21, TensorProto.UINT16: 21,
                TensorProto.INT4: 21, TensorProto.UINT4: 21}


def weight_linear_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """MatMul / Gemm nodes whose B operand is a 2-d weight, a float32 initializer or an integer
    one dequantized by a ``DequantizeLinear``, and whose A operand is not (the Linear layers of
    a transformer; attention-score MatMuls have two activations)."""
    inits = {i.name: i for i in model.graph.initializer}
    dequantized = {c.output: inits[c.quantized] for c in weight_dequant_chains(model) if c.form == "DequantizeLinear"}
    out = []
    for n in model.graph.node:
        if n.op_type not in LINEAR_OPS or len(n.input) < 2 or n.input[0] in inits:
            continue
        w = inits.get(n.input[1])
        if w is not None and len(w.dims) == 2 and w.data_type == TensorProto.FLOAT:
            out.append(n)
        elif n.input[1] in dequantized and len(dequantized[n.input[1]].dims) == 2:
            out.append(n)
    return out


def resolve_placement(model: onnx.ModelProto, placement: str) -> str:
    """"auto" -> "all" for graphs with a Conv (CNNs), else "linear" (transformers, MLPs)."""
    if placement not in PLACEMENTS:
        raise bad_choice("INT8 placement", placement, PLACEMENTS)
    if placement != "auto":
        return placement
    return "all" if any(n.op_type == "Conv" for n in model.graph.node) else "linear"


def _opset(model: onnx.ModelProto) -> int:
    return max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)


def dequant_chains_to_dq(model: onnx.ModelProto) -> int:
    """Rewrite, in place, each ``Cast(q) [- zero_point] * scale`` chain that feeds only weight
    inputs (MatMul / Gemm / Conv input 1) as the equal ``DequantizeLinear(q, scale, zero_point)``:
    the stored integers and scales are kept, (q - zp) * scale is computed exactly as before.
    Chains whose scales are not per-tensor or per-axis (blocked grids) or whose types
    DequantizeLinear does not take at this opset stay as they are. Returns how many became DQ."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in graph.node:
        for k, i in enumerate(n.input):
            consumers.setdefault(i, []).append((n, k))
    opset = _opset(model)
    replaced: dict[str, onnx.NodeProto] = {}  # first node of a chain -> its DequantizeLinear
    dropped: set[str] = set()
    new_inits: list[onnx.TensorProto] = []
    for chain in weight_dequant_chains(model):
        users = consumers.get(chain.output, [])
        if chain.form != "Cast+Mul" or not users or any(u.op_type not in WEIGHT_OPS or k != 1 for u, k in users):
            continue
        q = inits[chain.quantized]
        scale = numpy_helper.to_array(inits[chain.scale])
        if opset < DQ_MIN_OPSET.get(q.data_type, 99) or scale.dtype != np.float32:
            continue
        axis = _broadcast_axis(scale.shape, tuple(q.dims))
        if axis is None:
            continue
        qtype = helper.tensor_dtype_to_np_dtype(q.data_type)
        zp: np.ndarray = np.zeros(scale.shape, np.float32) if not chain.zero_point else \
            numpy_helper.to_array(inits[chain.zero_point])
        if zp.size > scale.size or np.broadcast_shapes(zp.shape, scale.shape) != scale.shape:
            continue
        zp = np.broadcast_to(zp, scale.shape)
        if not np.array_equal(zp, np.round(zp)) or zp.min() < np.iinfo(qtype).min or zp.max() > np.iinfo(qtype).max:
            continue
        flat = (-1,) if axis >= 0 else ()
        s_name, z_name = f"{chain.output}_dq_scale", f"{chain.output}_dq_zero_point"
        new_inits += [numpy_helper.from_array(scale.reshape(flat).astype(np.float32), s_name),
                      helper.make_tensor(z_name, q.data_type, list(scale.reshape(flat).shape),
                                         zp.reshape(flat).astype(np.int64).tolist())]
        dq = helper.make_node("DequantizeLinear", [chain.quantized, s_name, z_name], [chain.output],
                              name=f"{chain.nodes[-1]}_dq")
        if axis >= 0:
            dq.attribute.append(helper.make_attribute("axis", axis))
        replaced[chain.nodes[0]] = dq
        dropped.update(chain.nodes)
    if not replaced:
        return 0
    nodes = []
    for n in graph.node:
        if n.name in replaced:
            nodes.append(replaced[n.name])
        elif n.name not in dropped:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new_inits)
    _drop_unused_initializers(graph)
    return len(replaced)


def _broadcast_axis(scale_shape: tuple[int, ...], weight_shape: tuple[int, ...]) -> int | None:
    """The weight axis a scale of ``scale_shape`` varies along under numpy broadcasting: -1 for
    one value (per-tensor), None when it varies along more than one axis or does not fit."""
    if int(np.prod(scale_shape)) == 1:
        return -1
    if len(scale_shape) > len(weight_shape):
        return None
    padded = (1,) * (len(weight_shape) - len(scale_shape)) + tuple(scale_shape)
    varying = [k for k, d in enumerate(padded) if d != 1]
    if len(varying) != 1 or padded[varying[0]] != weight_shape[varying[0]]:
        return None
    return varying[0]


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def simplify_graph(model: onnx.ModelProto, workdir: Path, label: str = "the graph") -> tuple[onnx.ModelProto, int]:
    """ONNX Runtime's basic graph optimizations on a float graph before it is quantized: constant
    folding (a converter's Casts of constants), the transpose optimizer (an NHWC model's layout
    transposes), Conv+BatchNormalization/Mul/Add fusion; standard ONNX ops only, the same result up to
    float rounding. Then ``fold_conv_affine`` for what those fusions leave. Graphs that already hold
    quantized parts (their stored integers must stay as they are), or too large to pass through one
    protobuf, are returned as they are. Returns (graph, nodes folded by ``fold_conv_affine``)."""
    if not simplifiable(model):
        return model, 0
    src = workdir / "float.onnx"
    onnx.save_model(model, str(src))
    return simplify_file(src, workdir / "float.basic.onnx", label)


def simplifiable(model: onnx.ModelProto) -> bool:
    """Whether ``simplify_graph`` rewrites ``model``: no quantized parts, and small enough for one protobuf."""
    return not find_quantized(model) and _weight_bytes(model) <= EXTERNAL_DATA_THRESHOLD


def simplify_file(src: Path, dst: Path, label: str = "the graph") -> tuple[onnx.ModelProto, int]:
    """``simplify_graph`` of the graph written at ``src`` (the optimized graph is written to ``dst``): the
    caller need not hold the graph in memory while ONNX Runtime optimizes its own copy."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.optimized_model_filepath = str(dst)
    so.log_severity_level = 4
    try:
        ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    except ort_errors() as e:
        raise BadInputError(f"{label} does not load in ONNX Runtime: {ort_failure(e, src)}") from None
    simplified = onnx.load(str(dst))
    return simplified, fold_conv_affine(simplified)


def fold_conv_affine(model: onnx.ModelProto) -> int:
    """Fold the per-channel Add / Sub / Mul / Div by constants that follow a Conv (a batch norm a
    converter wrote out as ``(x - mean) * scale + shift``) into its weight and bias, so the Conv is
    what gets quantized and fused with its activation. Only a Conv output read by that one node is
    folded, and only constants that broadcast over the output channels. Returns how many nodes folded."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    removed: set[int] = set()
    folded = 0
    for conv in list(graph.node):
        if conv.op_type != "Conv" or conv.input[1] not in inits or (len(conv.input) > 2 and conv.input[2]
                                                                      and conv.input[2] not in inits):
            continue
        w = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
        cout = w.shape[0]
        b = (numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 and conv.input[2]
             else np.zeros(cout))
        changed = False
        while True:
            out = conv.output[0]
            users = consumers.get(out, [])
            if out in outputs or len(users) != 1:
                break
            n = users[0]
            if n.op_type not in ("Add", "Sub", "Mul", "Div") or len(n.input) != 2 or n.input[0] != out:
                break
            c = _channel_constant(inits.get(n.input[1]), cout)
            if c is None or (n.op_type == "Div" and np.any(c == 0)):
                break
            if n.op_type == "Add":
                b = b + c
            elif n.op_type == "Sub":
                b = b - c
            elif n.op_type == "Mul":
                w, b = w * c[:, None, None, None], b * c
            else:
                w, b = w / c[:, None, None, None], b / c
            conv.output[0] = n.output[0]
            removed.add(id(n))
            changed = True
            folded += 1
        if changed:
            w_name, b_name = conv.input[1] + "_folded", conv.output[0] + "_bias_folded"
            graph.initializer.extend([numpy_helper.from_array(w.astype(np.float32), w_name),
                                      numpy_helper.from_array(b.astype(np.float32), b_name)])
            conv.input[1] = w_name
            if len(conv.input) > 2:
                conv.input[2] = b_name
            else:
                conv.input.append(b_name)
    if removed:
        kept = [n for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(kept)
        _drop_unused_initializers(graph)
    return folded


def _channel_constant(t: onnx.TensorProto | None, channels: int) -> np.ndarray | None:
    """A constant as one value per output channel of an NCHW conv output (a scalar, (C,), (C, 1, 1)
    or (1, C, 1, 1)), else None."""
    if t is None:
        return None
    a = numpy_helper.to_array(t).astype(np.float64)
    if a.size == 1:
        return np.full(channels, float(a.reshape(-1)[0]))
    squeezed = a.reshape(-1)
    dims = list(a.shape)
    if squeezed.size != channels or len(dims) > 4:
        return None
    # the channel axis is the one of size C; every other axis 1; NCHW aligns trailing dims
    padded = [1] * (4 - len(dims)) + dims
    if padded[1] != channels or any(d != 1 for i, d in enumerate(padded) if i != 1):
        return None
    return squeezed


def static_batch(model: onnx.ModelProto, input_names: list[str]) -> int | None:
    """The batch every input fixes in its first dimension (a graph exported for batch 1), if any."""
    dims = set()
    for vi in model.graph.input:
        if vi.name in input_names:
            shape = vi.type.tensor_type.shape.dim
            dims.add(int(shape[0].dim_value) if shape and shape[0].HasField("dim_value") else None)
    return dims.pop() if len(dims) == 1 and None not in dims else None


def _region_refusal(src: Path, found: QuantizedGraph, placement: str) -> BadInputError:
    ops = "MatMul or Gemm with a weight" if placement == "linear" else "Conv, MatMul or Gemm"
    return BadInputError(f"{src} is already quantized ({found.describe()}; {len(found.region)} nodes): no float "
                         f"{ops} is left to quantize with placement {placement!r}; compress its float model, or build "
                         "and profile this one as it is")


def quantize_onnx_file(src: Path, dst: Path, samples: Samples, input_names: list[str], method: str | None,
                       percentile: float, scheme: str, batch_size: int = 8, placement: str = "auto",
                       keep_float: tuple[str, ...] = ()) -> dict[str, Any]:
    """Calibrate ``src`` on ``samples`` and write the QDQ model to ``dst`` (Q/DQ per ``placement``;
    the ``keep_float`` layers left in float: ``resolve_float_layers``), loaded and run once by ONNX
    Runtime on the first calibration batch. ``method`` None: "mse" for the linear placement,
    "percentile" for "all"."""
    info, _ = quantize_and_verify(src, dst, samples, input_names, method, percentile, scheme, batch_size, placement,
                                  keep_float)
    return info


def prepare_graph(model: onnx.ModelProto) -> dict[str, Any]:
    """Rewrite ``model`` in place into what the placement expects (same outputs): Constant
    weights as initializers, Cast+Mul weight dequantization as DequantizeLinear. Returns notes."""
    notes: dict[str, Any] = {}
    moved = constants_to_initializers(model)
    if moved:
        notes["constants_to_initializers"] = moved
    converted = dequant_chains_to_dq(model)
    if converted:
        notes["cast_mul_weights_as_dequantize_linear"] = converted
    return notes


def plan_placement(model: onnx.ModelProto, placement: str, src: Path,
                   found: QuantizedGraph) -> tuple[str, list[onnx.NodeProto]]:
    """(resolved placement, the float nodes to quantize) of a prepared graph; BadInputError when
    nothing is left to quantize, naming what ``found`` (the file as given) holds quantized."""
    placement = resolve_placement(model, placement)
    region = find_quantized(model).region
    if placement == "linear":
        quantizable = [n for n in weight_linear_nodes(model) if n.name not in region]
        if not quantizable:
            if found:
                raise _region_refusal(src, found, placement)
            raise BadInputError(f"{src} has no quantizable layers for placement 'linear' (no MatMul or Gemm "
                                "with a weight initializer)")
        opset = _opset(model)
        if opset < 13:
            raise BadInputError(f"{src} has opset {opset}; per-channel DequantizeLinear needs opset 13 or newer "
                                "(re-export with a newer opset)")
        return placement, quantizable
    quantizable = [n for n in model.graph.node if n.op_type in OP_TYPES and n.name not in region]
    if not any(n.op_type in ("Conv", "MatMul", "Gemm") for n in quantizable):
        if found:
            raise _region_refusal(src, found, placement)
        raise BadInputError(f"{src} has no quantizable layers (no Conv, MatMul or Gemm node)")
    return placement, quantizable


def load_graph(src: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(src))
    except ONNX_LOAD_ERRORS as e:
        raise BadInputError(f"{src} is not a valid ONNX model: {first_line(e)}") from None


def check_quantizable(src: Path, placement: str, keep_float: tuple[str, ...] = ()) -> None:
    """Refuse, before any calibration data is read, a graph with nothing float left to quantize, or
    layers to keep in float that it does not have."""
    model = load_graph(src)
    found = find_quantized(model)
    prepare_graph(model)
    _check_float_layers(model, src, *plan_placement(model, placement, src, found), keep_float)


def _check_float_layers(model: onnx.ModelProto, src: Path, placement: str, nodes: list[onnx.NodeProto],
                        keep_float: tuple[str, ...], layers: dict[str, str] | None = None) -> None:
    if not keep_float or keep_float == ("none",):
        return
    if placement != "linear":
        raise BadInputError(f"keeping layers of {src.name} in float needs placement 'linear' (got {placement!r})")
    # before simplification a tied LM head reads its weight through a Transpose of the embedding (an initializer
    # only once constants are folded): every MatMul / Gemm is a candidate here
    names = {n.name for n in nodes}
    candidates = nodes + [n for n in model.graph.node if n.op_type in LINEAR_OPS and n.name not in names]
    resolve_float_layers(model, candidates, keep_float, src, layers)


@dataclass
class CalibratedGraph:
    """A prepared float graph and its calibrated activation ranges, before any Q/DQ is written: one
    calibration serves several quantized variants (``write_int8_graph`` with other float layers)."""

    model: onnx.ModelProto
    src: Path
    placement: str
    quantizable: list[onnx.NodeProto]
    ranges: dict[str, tuple[Any, Any]]
    first: dict[str, np.ndarray]  # the batch the quantized graph is verified on
    method: str
    found: QuantizedGraph
    stored: set[str]  # integer weights the file held already
    notes: dict[str, Any]
    calibration: dict[str, Any]  # what the observation pass cost
    layers: dict[str, str]  # node name -> the layer it came from (``layer_names``, read before simplifying)


def calibrate_graph(src: Path, samples: Samples, input_names: list[str], method: str | None, percentile: float,
                    scheme: str, batch_size: int = 8, placement: str = "auto", hist_sample: int | None = None,
                    keep_float: tuple[str, ...] = ()) -> CalibratedGraph:
    """Load, prepare and simplify ``src``, then observe the tensors that get Q/DQ over ``samples`` in one
    streaming pass and choose their ranges (``method`` None: "mse" for the linear placement,
    "percentile" for "all"). ``hist_sample``: values per tensor and run that go into its histogram
    (None: every value; see ``calibration.HIST_SAMPLE``). ``keep_float``: layer names checked before
    any calibration work (``resolve_float_layers``)."""
    model = load_graph(src)
    found = find_quantized(model)  # what the file holds, before any rewriting
    notes = prepare_graph(model)
    # nothing to quantize, or a layer to keep in float that is not there: refused before any work
    _check_float_layers(model, src, *plan_placement(model, placement, src, found), keep_float)
    stored = {i.name for i in model.graph.initializer if i.data_type in (TensorProto.INT8, TensorProto.UINT8)}
    had_bn = any(n.op_type == "BatchNormalization" for n in model.graph.node)
    nodes_before = len(model.graph.node)
    layers = layer_names(list(model.graph.node))  # ONNX Runtime's simplified graph keeps no node metadata
    folded = 0
    if simplifiable(model):
        with tempfile.TemporaryDirectory(prefix="edgekit-int8-onnx-") as tmp:
            prepared = Path(tmp) / "float.onnx"
            onnx.save_model(model, str(prepared))
            del model  # only ONNX Runtime's copy while it optimizes (a 540 MB graph is held twice otherwise)
            model, folded = simplify_file(prepared, Path(tmp) / "float.basic.onnx", str(src))
    if had_bn and not any(n.op_type == "BatchNormalization" for n in model.graph.node):
        notes["batch_norm_folded"] = True
    elif len(model.graph.node) < nodes_before:
        notes["simplified"] = {"nodes_before": nodes_before, "nodes_after": len(model.graph.node),
                               "affine_folded_into_conv": folded}
    types = _float_types(model)
    inits = {i.name for i in model.graph.initializer}
    placement, quantizable = plan_placement(model, placement, src, found)
    if placement == "linear":
        candidates = [n.input[0] for n in quantizable]
    else:
        candidates = [t for n in quantizable for t in list(n.input) + list(n.output)]
    if method is None:
        method = DEFAULT_CALIB_METHOD[placement]
    dequantized = {n.output[0] for n in model.graph.node if n.op_type == "DequantizeLinear"}
    tensors: list[str] = []
    for t in candidates:
        if t and t not in inits and t not in dequantized and t not in tensors and \
                types.get(t, TensorProto.FLOAT) == TensorProto.FLOAT:
            tensors.append(t)
    fixed = static_batch(model, input_names)
    t0, c0 = time.perf_counter(), time.process_time()
    with tempfile.TemporaryDirectory(prefix="edgekit-int8-") as tmp:
        observed = Path(tmp) / "observed.onnx"
        _save_observed(model, tensors, observed)
        kept: Path | None = None
        if _weight_bytes(model) <= EXTERNAL_DATA_THRESHOLD:
            # the graph leaves memory while ONNX Runtime holds its weights for the pass, and is read back after it
            kept = Path(tmp) / "graph.onnx"
            onnx.save_model(model, str(kept))
            del model, quantizable
        observers, first = _observe(observed, tensors, samples, input_names, fixed or batch_size, fixed is not None,
                                    src, hist_sample)
        if kept is not None:
            model = onnx.load(str(kept))
            placement, quantizable = plan_placement(model, placement, src, found)  # the same nodes, read back
    fmt = qdq.act_format(scheme)
    ranges = {}
    for t, obs in observers.items():
        if obs.count == 0:
            continue
        lo, hi = choose_range(obs, method, percentile, fmt.qmin, fmt.qmax, fmt.symmetric)
        ranges[t] = (np.float32(lo), np.float32(hi))
    cost = {"tensors": len(tensors), "values_observed": int(sum(o.count for o in observers.values())),
            "hist_sample": hist_sample, "wall_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(time.process_time() - c0, 2)}
    return CalibratedGraph(model, src, placement, quantizable, ranges, first, method, found, stored, notes, cost,
                           layers)


def _float_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every value ONNX shape inference can tell (decides which tensors are float)."""
    try:
        # on a copy of the graph without its weights: inference then copies kilobytes, not the model
        light = onnx.ModelProto()
        _structure_copy(model, light)
        inferred = onnx.shape_inference.infer_shapes(light)
    except ONNX_LOAD_ERRORS:
        return {vi.name: vi.type.tensor_type.elem_type for vi in list(model.graph.input) + list(model.graph.output)}
    return {vi.name: vi.type.tensor_type.elem_type for vi in list(inferred.graph.value_info) +
            list(inferred.graph.input) + list(inferred.graph.output)}


def _structure_copy(model: onnx.ModelProto, into: onnx.ModelProto) -> None:
    """``model`` into ``into`` with every initializer's data left out (kept: name, type, dims)."""
    into.ir_version = model.ir_version
    into.opset_import.extend(model.opset_import)
    g = into.graph
    g.name = model.graph.name
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    g.value_info.extend(model.graph.value_info)
    for i in model.graph.initializer:
        # a weight's type and shape as a graph input: what shape inference needs of it, without its data
        g.input.append(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)))
    into.functions.extend(model.functions)


def layer_names(nodes: list[onnx.NodeProto]) -> dict[str, str]:
    """Node name -> the layer it came from: the module path the dynamo exporter records in the node's
    name scopes (``model.model.layers.0.mlp.down_proj``), else the node's own name (graphs from other exporters)."""
    out = {}
    for n in nodes:
        scopes = next((p.value for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), None)
        path = n.name
        if scopes:
            try:
                parts = [str(x) for x in ast.literal_eval(scopes)]
            except (ValueError, SyntaxError):
                parts = []
            if len(parts) >= 2 and parts[-2]:
                path = parts[-2]
        out[n.name] = path
    return out


# ``keep_float`` word for the feed-forward down projections, whatever a family calls them
FFN_DOWN = "ffn-down"


def resolve_float_layers(model: onnx.ModelProto, nodes: list[onnx.NodeProto], keep: tuple[str, ...], src: Path,
                         layers: dict[str, str] | None = None) -> list[str]:
    """Node names of ``nodes`` (the quantizable linears of ``model``, in graph order) that ``keep``
    names: "first", "last", "none" (nothing), "ffn-down" (``ffn_down_layers``), or a layer path or its
    last parts ("lm_head", "mlp.down_proj": every block's). ``layers``: node name -> layer path (default:
    ``layer_names(nodes)``). A name that matches no layer is refused with the valid ones."""
    names = {**layer_names(nodes), **(layers or {})}
    out: list[str] = []
    for k in keep:
        if k == "none":
            continue
        if k == "first":
            hits = [nodes[0].name]
        elif k == "last":
            hits = [nodes[-1].name]
        elif k == FFN_DOWN:
            hits = ffn_down_layers(model, nodes)
        else:
            hits = [n.name for n in nodes if names[n.name] == k or names[n.name].endswith("." + k)]
        if not hits and k != FFN_DOWN:  # a graph without a narrowing linear simply has none to keep
            short = list(dict.fromkeys(names[n.name].rsplit(".", 1)[-1] for n in nodes))
            raise BadInputError(f"{src.name} has no layer {k!r} to keep in float; choose from first, last, none, "
                                f"{FFN_DOWN}, a layer path or its last parts: {', '.join(short[:12])}"
                                f"{' ...' if len(short) > 12 else ''}")
        out += [h for h in hits if h not in out]
    return out


def ffn_down_layers(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> list[str]:
    """The feed-forward down projections among ``nodes``: the linears that read the widest input of
    them all and narrow it (Llama's ``down_proj``, GPT-2's ``c_proj``, OPT's ``fc2``; their inputs, the
    gated or activated FFN width, carry a decoder's largest activation outliers). Found from the
    weights' shapes, so no family table is needed."""
    inits = {i.name: i for i in model.graph.initializer}
    dequantized = {c.output: inits[c.quantized] for c in weight_dequant_chains(model) if c.form == "DequantizeLinear"}
    widths: dict[str, tuple[int, int]] = {}
    for n in nodes:
        w = inits.get(n.input[1]) or dequantized.get(n.input[1])
        if w is None or len(w.dims) != 2:
            continue
        rows, cols = int(w.dims[0]), int(w.dims[1])
        trans_b = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
        widths[n.name] = (cols, rows) if trans_b else (rows, cols)  # (in, out)
    if not widths:
        return []
    widest = max(i for i, _ in widths.values())
    return [n.name for n in nodes if n.name in widths and widths[n.name][0] == widest and widths[n.name][1] < widest]


def write_int8_graph(cal: CalibratedGraph, dst: Path, scheme: str, keep_float: tuple[str, ...] = (),
                     verify: bool = True, copy_graph: bool = False) -> tuple[dict[str, Any], VerifiedRun | None]:
    """Q/DQ from ``cal``'s ranges into its graph (``copy_graph``: into a copy, so that ``cal`` serves
    another variant), written to ``dst``; ``keep_float`` (``resolve_float_layers``; placement "linear"
    only) leaves those layers, and the inputs only they read, in float. Loaded and run once by ONNX
    Runtime (``verify``)."""
    model = copy.deepcopy(cal.model) if copy_graph else cal.model
    grid = qdq.weight_grid(scheme, depthwise=False)
    # the float weights, for re-rounding onto the pair-safe grid from them rather than from 8-bit codes
    floats = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
              if grid.pairs and cal.placement != "linear" and len(i.dims) >= 2 and i.data_type == TensorProto.FLOAT}
    _check_float_layers(model, cal.src, cal.placement, cal.quantizable, keep_float, cal.layers)
    float_nodes = resolve_float_layers(model, _same_nodes(model, cal.quantizable), keep_float, cal.src, cal.layers)
    names = {**layer_names(cal.quantizable), **cal.layers}
    quantized = [n for n in _same_nodes(model, cal.quantizable) if n.name not in float_nodes]
    if cal.placement == "linear":
        onnx.save(insert_linear_qdq(model, quantized, cal.ranges, scheme), str(dst))
    else:
        _quantize_all(model, cal.ranges, scheme, dst, sorted(find_quantized(model).region))
    fitted: dict[str, int] = {}
    if not grid.full:
        written = onnx.load(str(dst))
        fitted = {k: v for k, v in fit_weights_to_kernels(written, scheme, cal.stored, floats).items() if v}
        if fitted:
            onnx.save(written, str(dst))
    run = verify_onnx_runs(dst, cal.first, label=f"the INT8 graph of {cal.src.name}") if verify else None
    info: dict[str, Any] = {"placement": cal.placement, "calib_method": cal.method, "calibrated_tensors": len(cal.ranges),
                            "quantized_nodes": len(quantized), "calibration": cal.calibration}
    if float_nodes:
        info["float_layers"] = [names[n] for n in float_nodes]
    if fitted:
        info["weights_fitted_to_kernels"] = fitted
    if cal.found:
        info["already_quantized"] = {**cal.found.to_dict(), "kept": cal.found.describe()}
    if cal.notes:
        info["preprocessed"] = cal.notes
    return info, run


def _same_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The nodes of ``model`` named as ``nodes`` (the same nodes in a copy of the graph)."""
    by_name = {n.name: n for n in model.graph.node}
    return [by_name.get(n.name, n) for n in nodes]


def quantize_and_verify(src: Path, dst: Path, samples: Samples, input_names: list[str], method: str | None,
                        percentile: float, scheme: str, batch_size: int = 8, placement: str = "auto",
                        keep_float: tuple[str, ...] = (), hist_sample: int | None = None
                        ) -> tuple[dict[str, Any], VerifiedRun]:
    """``quantize_onnx_file``, also returning the verified session of ``dst`` and its outputs."""
    cal = calibrate_graph(src, samples, input_names, method, percentile, scheme, batch_size, placement, hist_sample,
                          keep_float)
    info, _ = write_int8_graph(cal, dst, scheme, keep_float, verify=False)
    first = cal.first
    del cal  # the float graph, before ONNX Runtime loads the INT8 one
    return info, verify_onnx_runs(dst, first, label=f"the INT8 graph of {src.name}")


# What one observation run may hold of the graph's intermediates at once (ONNX Runtime returns them together).
OBSERVE_BYTES = 256 * 2**20


def _observe(observed: Path, tensors: list[str], samples: Samples, input_names: list[str],
             batch_size: int, static: bool, src: Path, hist_sample: int | None = None
             ) -> tuple[dict[str, HistogramObserver], dict[str, np.ndarray]]:
    """One streaming pass of ONNX Runtime over ``samples``, histograms of ``tensors``; also the
    first batch (the feeds the quantized graph is verified on). ``static``: the graph takes
    exactly ``batch_size`` samples, so a smaller last batch is left out.

    ``observed``: the graph with ``tensors`` as its only outputs and only the nodes that compute them
    (``_save_observed``: a causal LM's vocabulary-sized head, which reads the last calibrated tensor, is
    not run)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    so.enable_cpu_mem_arena = False  # every intermediate is an output here: give their memory back after each run
    # every value by default: the histogram sample (calibration.HIST_SAMPLE) was measured on the PyTorch path, and
    # these graphs' default percentile ranges rest on their tails (benchmarks/RESULTS.md, issue 26)
    observers = {t: HistogramObserver(t, sample=hist_sample) for t in tensors}
    first: dict[str, np.ndarray] = {}
    try:
        sess = ort.InferenceSession(str(observed), so, providers=["CPUExecutionProvider"])
    except ort_errors() as e:
        raise BadInputError(f"{src} does not load in ONNX Runtime: {ort_failure(e, observed)}") from None
    out_names = [o.name for o in sess.get_outputs()]
    graph_inputs = {i.name for i in sess.get_inputs()}

    def observe(feeds: dict[str, np.ndarray]) -> int:
        try:
            outs = sess.run(None, {k: v for k, v in feeds.items() if k in graph_inputs})
        except ort_errors() as e:
            shapes = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in feeds.items())
            raise BadInputError(f"{src} does not run in ONNX Runtime on the calibration data ({shapes}): "
                                f"{ort_failure(e)}") from None
        held = 0
        for name, arr in zip(out_names, outs, strict=True):
            if name in observers and isinstance(arr, np.ndarray) and arr.dtype.kind == "f":
                observers[name].update(torch.from_numpy(np.ascontiguousarray(arr)))
            held += arr.nbytes if isinstance(arr, np.ndarray) else 0
        return held

    start = 0
    if not static and batch_size > 1 and len(samples):
        # one sample first: what every intermediate of one sample holds sets the batch (memory bounded)
        first = {k: samples.inputs[k][:1] for k in input_names}
        per_sample = observe(first)
        batch_size = max(1, min(batch_size, OBSERVE_BYTES // max(per_sample, 1)))
        start = 1
    rest = samples.subset(slice(start, len(samples))) if start else samples
    for b in rest.batches(batch_size):
        feeds = {k: b[k] for k in input_names}
        if static and len(next(iter(feeds.values()))) != batch_size:
            continue
        first = first or feeds
        observe(feeds)
    return observers, first


def _save_observed(model: onnx.ModelProto, tensors: list[str], path: Path) -> None:
    """Write ``model`` with ``tensors`` as its outputs and only the nodes they need; ``model`` is
    left as it was (its node and output lists are swapped for the write; the weights are not copied,
    and ONNX Runtime drops the ones no kept node reads)."""
    graph = model.graph
    needed = set(tensors)
    kept: list[onnx.NodeProto] = []
    for n in reversed(graph.node):  # the graph is topologically sorted: consumers after producers
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
            needed.update(_outer_names(n))
    kept.reverse()
    nodes, outputs = list(graph.node), list(graph.output)
    del graph.node[:], graph.output[:]
    graph.node.extend(kept)
    graph.output.extend(helper.make_empty_tensor_value_info(t) for t in tensors)
    try:
        onnx.save(model, str(path), save_as_external_data=_weight_bytes(model) > EXTERNAL_DATA_THRESHOLD)
    finally:
        del graph.node[:], graph.output[:]
        graph.node.extend(nodes)
        graph.output.extend(outputs)


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the initializers' stored data (without serializing the model, as ``ByteSize`` does)."""
    return sum(len(i.raw_data) or 4 * (len(i.float_data) + len(i.int32_data)) + 8 * len(i.int64_data)
               for i in model.graph.initializer)


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If / Loop / Scan bodies) read, the enclosing graph's among them."""
    out: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in g.node:
                out.update(i for i in n.input if i)
                out.update(_outer_names(n))
    return out


def _quantize_all(model: onnx.ModelProto, ranges: dict[str, tuple[Any, Any]], scheme: str, dst: Path,
                  exclude: list[str]) -> None:
    """Placement "all": ONNX Runtime's QDQQuantizer on every op of OP_TYPES, from edgekit's ranges,
    leaving out the ``exclude`` nodes (already quantized regions). Tensors a DequantizeLinear
    produces (weights stored as integers already) are not quantized again by it."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    tensors_range = TensorsData(CalibrationMethod.MinMax, {k: (v[0], v[1]) for k, v in ranges.items()})
    fmt = qdq.act_format(scheme)
    act = QuantType.QUInt8 if fmt.qmin == 0 else QuantType.QInt8
    extra = {"ActivationSymmetric": fmt.symmetric, "WeightSymmetric": True}
    reduce_range = qdq.weight_grid(scheme, depthwise=False).qmax < qdq.WEIGHT_QMAX  # "u8s7": ORT's 7-bit weights
    quantizer = QDQQuantizer(model, True, reduce_range, QuantType.QInt8, act, tensors_range, [], exclude, OP_TYPES,
                             extra)
    quantizer.quantize_model()
    quantizer.model.save_model_to_file(str(dst), False)


def fit_weights_to_kernels(model: onnx.ModelProto, scheme: str, stored: set[str],
                           floats: dict[str, np.ndarray] | None = None) -> dict[str, int]:
    """Put every int8 weight that runs the u8 x s8 GEMM kernels of x86 CPUs without VNNI (MatMul, Gemm,
    non-depthwise Conv) on the grid of ``scheme`` (``qdq.weight_grid``: the pair-safe grid of "u8s8p",
    the 7-bit grid of "u8s7"), so no pair of products overflows their int16 sums:

    * weights this quantization wrote beyond it (ONNX Runtime's quantizer writes 8-bit weights):
      re-rounded onto it per output channel, from ``floats`` (the float graph's initializers, by name;
      ONNX Runtime names the quantized one ``<name>_quantized``) where given, else from the values the
      codes stand for;
    * weights the file already stored (``stored``: a weight-only INT8 file): kept as the same integers
      (nothing re-rounded), as uint8 with the zero point moved by 128, which runs the u8 x u8 kernels,
      exact on every CPU.

    Returns counts: {"to_grid", "stored_as_uint8"}."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producers = {o: n for n in graph.node for o in n.output}
    counts = {"to_grid": 0, "stored_as_uint8": 0}
    for dq in graph.node:
        if dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or dq.input[1] not in inits:
            continue
        q = numpy_helper.to_array(inits[dq.input[0]])
        users = consumers.get(dq.output[0], [])
        if q.dtype != np.int8 or q.ndim < 2 or len(consumers.get(dq.input[0], [])) != 1 or len(users) != 1:
            continue
        depthwise = _gemm_weight(users[0], dq.output[0], inits)
        if depthwise is None:
            continue
        grid = qdq.weight_grid(scheme, depthwise)
        zp = numpy_helper.to_array(inits[dq.input[2]]) if len(dq.input) > 2 and dq.input[2] in inits else None
        if grid.full or (zp is not None and np.any(zp != 0)):
            continue
        out_axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        rows_first = np.moveaxis(q, out_axis, 0)  # (out, reduction...): a matmul's B (K, N) transposed
        if grid.pairs:
            on_grid = pairs.violations(rows_first) == 0
        else:
            on_grid = grid.qmin <= int(q.min()) and int(q.max()) <= grid.qmax
        if on_grid:
            continue
        if dq.input[0] in stored:
            _as_uint8(graph, inits, consumers, dq, q)
            counts["stored_as_uint8"] += 1
            continue
        scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
        source = (floats or {}).get(dq.input[0].removesuffix("_quantized"))
        if source is not None and source.shape == q.shape:
            values = np.moveaxis(source.astype(np.float64), out_axis, 0)
        else:  # from the values the codes stand for, per output channel
            values = rows_first.astype(np.float64) * (scale.reshape(-1, *[1] * (q.ndim - 1)) if scale.size > 1 else scale)
        if grid.pairs:
            new_scale = pairs.safe_scale(values)
        else:
            new_scale = np.maximum(np.abs(values).reshape(values.shape[0], -1).max(1) / grid.qmax, 1e-12)
        if scale.size == 1:  # one scale for the tensor: the coarsest channel's
            new_scale = np.full(1, new_scale.max())
        codes = np.clip(np.round(values / new_scale.reshape(-1, *[1] * (q.ndim - 1))), grid.qmin, grid.qmax)
        if grid.pairs:
            codes = pairs.trim(codes, values / new_scale.reshape(-1, *[1] * (q.ndim - 1)))
        new_scale = new_scale.reshape(scale.shape).astype(np.float32)
        _rescale_int32_bias(users[0], inits, consumers, producers, new_scale / scale.astype(np.float32))
        inits[dq.input[1]].CopyFrom(numpy_helper.from_array(new_scale, dq.input[1]))
        inits[dq.input[0]].CopyFrom(numpy_helper.from_array(np.moveaxis(codes, 0, out_axis).astype(np.int8),
                                                            dq.input[0]))
        counts["to_grid"] += 1
    return counts


def _rescale_int32_bias(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
                        consumers: dict[str, list[onnx.NodeProto]], producers: dict[str, onnx.NodeProto],
                        ratio: np.ndarray) -> None:
    """A Conv's or Gemm's int32 bias (behind a DequantizeLinear, on the ``input_scale * weight_scale`` grid
    engines require to fuse the node) moved to its weight's new scale: ``ratio`` = new / old, per channel."""
    bias = node.input[2] if len(node.input) > 2 else ""
    dq = producers.get(bias)
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or dq.input[1] not in inits:
        return
    b = numpy_helper.to_array(inits[dq.input[0]])
    if b.dtype != np.int32 or len(consumers.get(dq.input[1], [])) != 1:
        return
    old = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float32)
    new = (old * ratio).astype(np.float32)
    values = b.astype(np.float64) * old.astype(np.float64)
    info = np.iinfo(np.int32)
    inits[dq.input[0]].CopyFrom(numpy_helper.from_array(
        np.clip(np.round(values / new.astype(np.float64)), info.min, info.max).astype(np.int32), dq.input[0]))
    inits[dq.input[1]].CopyFrom(numpy_helper.from_array(new.reshape(old.shape), dq.input[1]))


def _gemm_weight(node: onnx.NodeProto, weight: str, inits: dict[str, onnx.TensorProto]) -> bool | None:
    """For a weight the u8 x s8 kernels read (a MatMul's or Gemm's B, a Conv's W): whether the node is a
    depthwise convolution; None for any other use."""
    if node.op_type in ("MatMul", "Gemm") and list(node.input[1:2]) == [weight]:
        return False
    if node.op_type == "Conv" and list(node.input[1:2]) == [weight]:
        return _depthwise(node, inits)
    return None


def _as_uint8(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto],
              consumers: dict[str, list[onnx.NodeProto]], dq: onnx.NodeProto, q: np.ndarray) -> None:
    """A stored int8 weight as the same integers in uint8 around 128 (u8 x u8 kernels: exact sums)."""
    if len(dq.input) < 3 or not dq.input[2]:  # no zero point: int8 zeros, as wide as the scale
        name = dq.input[0] + "_zero_point"
        graph.initializer.append(numpy_helper.from_array(
            np.zeros(numpy_helper.to_array(inits[dq.input[1]]).shape, np.int8), name))
        inits[name] = graph.initializer[-1]
        consumers[name] = [dq]
        if len(dq.input) == 2:
            dq.input.append(name)
        else:
            dq.input[2] = name
    z = numpy_helper.to_array(inits[dq.input[2]]).astype(np.int16)
    stale = {dq.input[0], dq.input[2]}  # their recorded int8 types (an exporter's value_info) no longer hold
    kept = [vi for vi in graph.value_info if vi.name not in stale]
    if len(kept) < len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(kept)
    inits[dq.input[0]].CopyFrom(numpy_helper.from_array((q.astype(np.int16) + 128).astype(np.uint8), dq.input[0]))
    if len(consumers.get(dq.input[2], [])) != 1:  # a shared zero point: this weight gets its own
        consumers[dq.input[2]].remove(dq)
        dq.input[2] = dq.input[0] + "_zero_point_u8"  # the weight's name: used once, so unique
        graph.initializer.append(numpy_helper.from_array((z + 128).astype(np.uint8), dq.input[2]))
        inits[dq.input[2]] = graph.initializer[-1]
        consumers[dq.input[2]] = [dq]
    else:
        inits[dq.input[2]].CopyFrom(numpy_helper.from_array((z + 128).astype(np.uint8), dq.input[2]))


def _depthwise(conv: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    return group > 1 and conv.input[1] in inits and list(inits[conv.input[1]].dims)[1:2] == [1]


def quantize_weight_per_channel(w: np.ndarray, axis: int, qmax: int = 127,
                                pair_safe: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel int8 (grid -qmax..qmax: 127, or 64 for the 7-bit grid of "u8s7"; with
    ``pair_safe``, the pair-safe grid of "u8s8p", ``pairs``) of a 2-d weight along ``axis`` (the output
    channels): ``(q int8, scale float32)`` with ``w ~= q * scale`` broadcast on ``axis``."""
    if pair_safe:
        rows = w.T if axis == 1 else w  # (out, K): pairs run along K
        scale = pairs.safe_scale(rows).astype(np.float32)
        q_rows = np.clip(np.round(rows / scale[:, None]), -127, 127)
        return (q_rows.T if axis == 1 else q_rows).astype(np.int8), scale
    absmax = np.abs(w).max(axis=1 - axis)
    scale = np.maximum(absmax / float(qmax), 1e-12).astype(np.float32)
    shape = [1, 1]
    shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -qmax, qmax).astype(np.int8)
    return q, scale


def insert_linear_qdq(model: onnx.ModelProto, nodes: list[onnx.NodeProto], ranges: dict[str, tuple[Any, Any]],
                      scheme: str) -> onnx.ModelProto:
    """Placement "linear": Q/DQ on the activation input and per-channel int8 DQ on the weight of
    each node of ``nodes`` (MatMul / Gemm with a weight initializer; a weight a DequantizeLinear
    already produces keeps its stored grid); only these nodes read the dequantized tensors, every
    other consumer (residual Adds, LayerNorm) keeps the float one. The output stays float, so
    ONNX Runtime fuses each into ``MatMulIntegerToFloat``."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    fmt = qdq.act_format(scheme)
    symmetric, qmin, qmax = fmt.symmetric, fmt.qmin, fmt.qmax
    zp_type = TensorProto.UINT8 if qmin == 0 else TensorProto.INT8
    w_grid = qdq.weight_grid(scheme, depthwise=False)
    new_inits: list[onnx.TensorProto] = []
    new_nodes: dict[str, list[onnx.NodeProto]] = {}  # consumer node name -> Q/DQ nodes to insert before it
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
        pending: list[onnx.NodeProto] = []
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
        if w_name not in inits:  # stored as integers already (a DequantizeLinear output): kept as it is
            new_nodes[n.name] = pending
            continue
        if w_name not in done:
            w = numpy_helper.to_array(inits[w_name]).astype(np.float32)
            trans_b = n.op_type == "Gemm" and any(a.name == "transB" and a.i for a in n.attribute)
            axis = 0 if trans_b else 1  # the output-channel axis: (in, out), or (out, in) for Gemm transB
            q, w_scale = quantize_weight_per_channel(w, axis, w_grid.qmax, pair_safe=w_grid.pairs)
            q_name, s_name, z_name = unique(f"{w_name}_quantized"), unique(f"{w_name}_scale"), unique(f"{w_name}_zero_point")
            new_inits += [numpy_helper.from_array(q, q_name), numpy_helper.from_array(w_scale, s_name),
                          numpy_helper.from_array(np.zeros(w_scale.shape, np.int8), z_name)]
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


def quantize_onnx_handle(handle: ModelHandle, config: OnnxGraphConfig, ctx: StepContext, scheme: str,
                         kernels: str | None = None) -> tuple[ModelHandle, dict[str, Any]]:
    """The int8 step on an ONNX-only handle: calibrate, quantize, verify, and compare every output
    with the float graph on held-out data (``ctx.metrics["int8"]``), as the target's integer kernels
    compute it (``kernels``: ``onnx_int8_kernels`` semantics; None: this machine's). A causal LM is
    compared with ``ctx.quality_reference`` where it covers the same windows (``shared_reference``),
    else with the float graph's statistics measured before the INT8 graph is loaded. Returns the
    quantized handle and what the step's record keeps of it (the step writes the record)."""
    if handle.onnx_path is None:
        raise BadInputError(f"model {handle.name!r} has no ONNX graph to quantize")
    t0 = time.perf_counter()
    src = Path(handle.onnx_path)
    check_quantizable(src, config.placement, float_layers_to_keep(handle, config))
    view = data_view(handle)
    calib_note = None
    try:
        samples = load_split(view, ctx, "calib", config.calibration.samples)
    except BadInputError:
        # a split smaller than the ask (SmolLM2's lee-news calib split holds 90 windows of 512 tokens, the
        # default asks 128): all of it, said in the metrics, rather than a refusal of the default command
        samples = load_split(view, ctx, "calib", None)
        calib_note = f"the calib split holds {len(samples)} samples, fewer than the {config.calibration.samples} asked: all used"
    need = min(MIN_CALIB_SAMPLES, config.calibration.samples)
    if len(samples) < need:
        raise BadInputError(f"calibration data {samples.source!r} has {len(samples)} samples; INT8 calibration "
                            f"needs at least {need}")
    names = [s.name for s in handle.inputs]
    workdir = tempfile.TemporaryDirectory(prefix="edgekit-int8-onnx-")  # lives as long as the returned handle
    dst = Path(workdir.name) / "model.int8.onnx"
    # The observation pass returns every calibrated tensor of a batch at once: a model with large
    # activations (a detector at 800 x 608: ~2 GB per image) names a smaller batch in its handle.
    # every value into the histograms, a causal LM's too: a bounded sample (calibration.HIST_SAMPLE) saved no
    # CPU time on SmolLM2-135M (198 vs 196 s for 32 windows: ONNX Runtime's forward passes are the cost) and
    # moved validation perplexity by 1% (benchmarks/RESULTS.md, issue 31)
    keep = float_layers_to_keep(handle, config)
    ev, on = comparison_samples(view, config, ctx, samples)
    lm = handle.kind == "causal-lm" and "input_ids" in ev.inputs
    reference = None
    if lm:  # the float side of the comparison, before any INT8 session exists: one model in memory at a time
        reference = shared_reference(ctx.quality_reference, ev, names)
        if reference is None:  # other windows than the gate's (eval_samples), or no gate: the float graph's
            reference = reference_on(handle, on, [{k: b[k] for k in names} for b in ev.batches(1)])
    info, run = quantize_and_verify(src, dst, samples, names, config.calibration.method, config.calibration.percentile, scheme,
                                    batch_size=int(handle.extra.get("calib_batch", 8)), placement=config.placement,
                                    keep_float=keep)
    metrics: dict[str, Any] = {"scheme": scheme, "calib_samples": len(samples),
                               "ptq_seconds": round(time.perf_counter() - t0, 3), **info}
    if calib_note is not None:
        metrics["calib_note"] = calib_note
    if handle.extra.get("normalized"):  # done when the file was loaded (sources.models.load_onnx_file)
        metrics["preprocessed"] = {**handle.extra["normalized"], **info.get("preprocessed", {})}
    host = kernels is None or kernels == host_semantics()
    output_names = [o.name for o in run.session.get_outputs()]
    metrics["compared_on"] = {"data": on, "samples": len(ev), "kernels": describe_semantics(kernels)}
    measured: Measured | None = None
    session = run.session if host else session_for(dst, kernels or host_semantics())
    if reference is not None:  # token by token, one window at a time, against the float model's statistics
        del run  # one INT8 session at a time
        int8, drift, stats = compare_lm_to_reference(session, names, reference)
        del session
        metrics["compared_on"].update(
            reference="the quality gate's float reference" if reference is ctx.quality_reference else reference.source,
            note=(f"agreement and perplexity over every token; KL, cosine and logit differences over the "
                  f"{drift['rows']} logit rows the float reference keeps"))
        metrics["outputs"] = {output_names[0]: drift}
        metrics["int8"] = int8
        if host and reference is ctx.quality_reference:  # what the gate would compute: it reports from these
            measured = Measured(reference, str(dst), stats)
    else:
        fixed = static_batch(onnx.load(str(src), load_external_data=False), names)
        got = run_graph(session, ev, names, fixed or COMPARE_BATCH, fixed is not None)
        ref = run_graph(_float_session(src), ev, names, fixed or COMPARE_BATCH, fixed is not None)
        metrics["outputs"] = {o: output_drift(g, r) for o, g, r in zip(output_names, got, ref, strict=True)}
        metrics["int8"] = score(got[0], ref[0], ev.labels, handle.evaluator)
        check_agreement(metrics["int8"], handle.evaluator, len(ev),
                        f"the INT8 graph on {metrics['compared_on']['kernels']}", ctx.accept_quality_loss)
    new = copy.copy(handle)
    new.onnx_path = dst
    new.module = None
    new.extra = {**handle.extra, "int8_workdir": workdir, **({MEASURED: measured} if measured is not None else {})}
    if handle.make_inputs is None:  # random inputs: the verified real calibration batch serves better
        new.make_inputs = _repeat_first({k: v[:1] for k, v in samples.inputs.items()})
    new.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    ctx.metrics["int8"] = metrics
    return new, {"scheme": scheme, "kernels": kernels or host_semantics(), "from": "onnx",
                 "float_layers": info.get("float_layers", []), "keep_float": list(keep),
                 "placement": info["placement"], "calib_method": info["calib_method"]}




# What a causal LM keeps in float unless ``keep_float`` says otherwise: its feed-forward down projections,
# whose inputs (the gated FFN width) carry outliers one per-tensor int8 scale cannot hold. SmolLM2-135M,
# validation windows: every linear in INT8 1.52x the float perplexity, the LM head also in float 1.49x,
# the down projections in float 1.067x (benchmarks/RESULTS.md, issue 31). "none" quantizes every linear.
LM_KEEP_FLOAT = (FFN_DOWN,)


def float_layers_to_keep(handle: ModelHandle, config: OnnxGraphConfig) -> tuple[str, ...]:
    """``config.keep_float``, else a causal LM's ``LM_KEEP_FLOAT`` (and nothing for other models)."""
    if config.keep_float:
        return tuple(config.keep_float)
    return LM_KEEP_FLOAT if handle.kind == "causal-lm" else ()


def shared_reference(reference: Reference | None, ev: Samples, names: list[str]) -> Reference | None:
    """``reference`` (the quality gate's float reference) when its feeds are exactly the windows of ``ev``,
    one a feed, so the step compares on what the gate measured instead of running the float model again."""
    if reference is None or reference.nll is None or len(reference.feeds) != len(ev):
        return None
    for i, feeds in enumerate(reference.feeds):
        for k in names:
            if k not in feeds or not np.array_equal(feeds[k], ev.inputs[k][i:i + 1]):
                return None
    return reference


def compare_lm_to_reference(session: Any, names: list[str], reference: Reference
                            ) -> tuple[dict[str, Any], dict[str, Any], list[WindowStats]]:
    """The INT8 graph (``session``) against the float model's statistics on the same windows (``reference``:
    per-token NLL, top-1 of every position, the logit rows it keeps), one window's logits in memory at a time.

    Returns (the per-token figures: top-1 / top-5 agreement with the float top-1, perplexity of each and their
    ratio, over every token; the logits' drift: per-row cosine, KL(float || INT8), largest and mean absolute
    difference and the float rows' largest magnitude, over the kept rows; the gate's ``WindowStats`` of each
    window, which it reports from instead of running the graph again)."""
    import torch

    if reference.nll is None:
        raise ValueError("compare_lm_to_reference needs a causal LM's reference, with per-token NLL")
    stats: list[WindowStats] = []
    top1 = top5 = tokens = 0
    offset = 0
    cosines: list[np.ndarray] = []
    kls: list[np.ndarray] = []
    max_diff = abs_sum = ref_max = 0.0
    values = 0
    for feeds, index, ref_top in zip(reference.feeds, reference.row_index, reference.top, strict=True):
        logits = torch.from_numpy(np.asarray(session.run(None, {k: feeds[k] for k in names})[0], np.float32))
        st = output_statistics(logits, feeds, index, lm=True)
        stats.append(st)
        flat = logits.reshape(-1, logits.shape[-1])  # (positions, vocab)
        best = torch.from_numpy(ref_top)
        rows = nll_rows(flat.shape[-1])
        for s in range(0, flat.shape[0], rows):  # top-5 a chunk of positions at a time
            top5 += int((flat[s:s + rows].topk(min(5, flat.shape[-1]), -1).indices == best[s:s + rows, None])
                        .any(-1).sum())
        top1 += int((st.top == ref_top).sum())
        tokens += flat.shape[0]
        del logits, flat
        got = torch.from_numpy(st.rows).double()
        want = torch.from_numpy(reference.rows[offset:offset + len(index)]).double()
        offset += len(index)
        lg, lr = torch.log_softmax(got, -1), torch.log_softmax(want, -1)
        kls.append((lr.exp() * (lr - lg)).sum(-1).numpy())
        cosines.append(((got * want).sum(-1) / (got.norm(dim=-1) * want.norm(dim=-1)).clamp_min(1e-12)).numpy())
        diff = (got - want).abs()
        max_diff, abs_sum = max(max_diff, float(diff.max())), abs_sum + float(diff.sum())
        ref_max, values = max(ref_max, float(want.abs().max())), values + diff.numel()
    nll = float(np.mean(np.concatenate([s.nll.ravel() for s in stats if s.nll is not None]).astype(np.float64)))
    nll_ref = float(np.mean(np.concatenate([a.ravel() for a in reference.nll]).astype(np.float64)))
    ppl, ppl_ref = math.exp(min(nll, 700.0)), math.exp(min(nll_ref, 700.0))
    cos = np.concatenate(cosines)
    kl = np.concatenate(kls)
    drift = {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "max_abs_diff": max_diff,
             "mean_abs_diff": abs_sum / max(values, 1), "ref_max_abs": ref_max, "rows": int(cos.size)}
    per_token = {"windows": len(stats), "tokens": tokens, "top1_agreement": top1 / max(tokens, 1),
                 "top5_agreement": top5 / max(tokens, 1), "mean_kl": float(kl.mean()), "perplexity": ppl,
                 "perplexity_reference": ppl_ref, "perplexity_ratio": ppl / ppl_ref, "max_abs_diff": max_diff}
    return per_token, drift, stats


def eval_limit(handle: ModelHandle, eval_samples: int | None) -> int | None:
    """How many eval samples the INT8 step compares on: ``eval_samples``, else every sample of the
    split, except for a causal LM: its first ``EVAL_WINDOWS`` windows, the ones the compress gate
    measures (an eval split holds thousands: 8,561 Wikipedia windows at 128 tokens)."""
    if eval_samples is not None:
        return int(eval_samples)
    return EVAL_WINDOWS if handle.kind == "causal-lm" else None


def comparison_samples(view: ModelHandle, config: OnnxGraphConfig, ctx: StepContext, calib: Samples) -> tuple[Samples, str]:
    """Data to compare the INT8 graph with the float one on (``eval_limit`` samples): the eval data
    (given, or the model's default); else the eval split of the calibration source (disjoint from its
    calib split); only when neither exists, the calibration samples themselves (said so)."""
    limit = eval_limit(view, config.eval_samples)
    try:
        return load_split(view, ctx, "eval", limit), "eval data"
    except BadInputError:
        if ctx.eval is not None:
            raise
    if isinstance(ctx.calib, (str, os.PathLike)):
        try:
            ev = resolve_samples(ctx.calib, view, "eval", limit, None, ctx.seed)
        except BadInputError:
            ev = None
        if ev is not None and len(ev):
            return ev, f"the eval split of {ctx.calib} (disjoint from its calibration split)"
    if limit is not None and len(calib) > limit:
        calib = calib.subset(slice(0, limit))
    return calib, "the calibration samples (no held-out data given: pass eval data for an unbiased comparison)"


def run_graph(session: Any, samples: Samples, names: list[str], batch_size: int, static: bool) -> list[np.ndarray]:
    """Every output of ``session`` over ``samples``, concatenated along the sample axis."""
    outs: list[list[np.ndarray]] = []
    for b in samples.batches(batch_size):
        feeds = {k: b[k] for k in names}
        if static and len(next(iter(feeds.values()))) != batch_size:
            continue
        for k, o in enumerate(session.run(None, feeds)):
            if k == len(outs):
                outs.append([])
            outs[k].append(np.asarray(o))
    return [np.concatenate(o) for o in outs]


# Samples per run when comparing the INT8 graph with the float one: two sessions are alive at once,
# each holding its largest batch's intermediates (a ResNet-50 at 224: ~25 MB per sample).
COMPARE_BATCH = 4


def _float_session(path: Path) -> Any:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.enable_cpu_mem_arena = False  # the reference runs once per batch: no arena kept beside the INT8 session's
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except ort_errors() as e:
        raise BadInputError(f"{path} does not load in ONNX Runtime: {ort_failure(e, path)}") from None


def output_drift(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    """How far one INT8 output is from the float one: per-sample cosine (mean, min), largest and
    mean absolute difference, and the float output's largest magnitude for scale."""
    a = got.reshape(len(got), -1).astype(np.float64)
    b = ref.reshape(len(ref), -1).astype(np.float64)
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
    diff = np.abs(a - b)
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()), "ref_max_abs": float(np.abs(b).max())}


def _repeat_first(first: dict[str, np.ndarray]) -> Any:
    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return {k: np.repeat(v, batch, axis=0) for k, v in first.items()}

    return make_inputs
