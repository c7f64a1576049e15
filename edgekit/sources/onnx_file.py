"""ONNX files as they come: validated before anything reads them, normalized so every tool
downstream sees weights as initializers, and described (what is already quantized).

``read_onnx`` refuses, with one line naming the problem, what would crash, hang or exhaust
memory later: undecodable or truncated protobuf, a graph the ONNX checker rejects (cycles,
missing opset, undefined values), an opset newer than this ``onnx`` knows, external data
outside the model's folder, missing or shorter than the tensor it declares, and inputs
whose static shape would take more than ``MAX_INPUT_BYTES`` per sample.

``constants_to_initializers``: exporters such as Paddle2ONNX store every weight as a
``Constant`` node (PP-PicoDet: 878 Constants, 0 initializers). Quantizers and converters
look for weights among initializers, so the same tensors are moved there; a Constant's
output is its value, so the graph computes exactly the same.

``find_quantized`` names what a graph already holds in quantized form: integer ops
(QLinear*, MatMulInteger, ConvInteger, DynamicQuantizeLinear, MatMulNBits, ...), Q/DQ
pairs on activations, and integer weight initializers dequantized in the graph, either by
``DequantizeLinear`` or by ``Cast`` (+ ``Sub`` zero point) + ``Mul`` scale, the form some
weight-only exporters write (``weight_dequant_chains``).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from edgekit.errors import BadInputError
from edgekit.limits import require_memory
from edgekit.sources.handle import InputSpec

# One sample of one input, its symbolic dims taken as 1: edgekit makes such arrays for
# tracing, parity and timing, so a declared 10^12-element image is refused up front.
MAX_INPUT_BYTES = 2**31
# What onnx and protobuf raise on a file that is not a valid model.
ONNX_LOAD_ERRORS = (DecodeError, onnx.checker.ValidationError, ValueError, OSError, RuntimeError, TypeError)

# Ops that compute in integers or read quantized data (integer inputs, packed weights).
QUANTIZED_OPS = frozenset({
    "QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul", "QLinearAveragePool", "QLinearGlobalAveragePool",
    "QLinearConcat", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearSoftmax", "QLinearReduceMean", "QLinearWhere",
    "QLinearConvTranspose", "QGemm", "QAttention", "QOrderedMatMul", "QOrderedAttention", "QEmbedLayerNormalization",
    "ConvInteger", "MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "DynamicQuantizeLSTM",
    "DynamicQuantizeLinear", "MatMulNBits", "MatMulBnb4", "GatherBlockQuantized",
})
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
# Integer types a weight is stored in when it is quantized (int32/int64 are indices and shapes).
WEIGHT_INT_TYPES = frozenset({TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.UINT16,
                              TensorProto.INT4, TensorProto.UINT4})
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# --- reading and validating -----------------------------------------------------------------


def read_onnx(path: Path) -> onnx.ModelProto:
    """The graph of ``path`` (external data not loaded), validated; BadInputError otherwise.

    >>> model = read_onnx(Path("model.onnx"))  # doctest: +SKIP
    """
    try:
        model = onnx.load(str(path), load_external_data=False)
    except ONNX_LOAD_ERRORS as e:
        raise BadInputError(f"{path} is not a valid ONNX model: {first_line(e)}") from None
    check_opsets(model, path)
    check_external_data(model, path)
    external = any(True for _ in external_tensors(model.graph))
    try:  # the path form checks external data too (and works above 2 GB)
        onnx.checker.check_model(str(path) if external or path.stat().st_size >= 2**31 else model)
    except ONNX_LOAD_ERRORS as e:
        raise BadInputError(f"{path} is not a valid ONNX model: {first_line(e)}") from None
    check_input_sizes(model, path)
    return model


def check_opsets(model: onnx.ModelProto, path: Path) -> None:
    """The default domain's opset is declared and known to this ``onnx`` (the checker accepts
    any number; ONNX Runtime then fails at load with a C++ source location)."""
    newest = onnx.defs.onnx_opset_version()
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise BadInputError(f"{path} is not a valid ONNX model: it imports no opset for the default ONNX domain")
    if not 1 <= versions[0] <= newest:
        raise BadInputError(f"{path} declares ONNX opset {versions[0]}; this installation knows opsets 1 to {newest}")


def external_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Tensors of ``graph`` and its subgraphs whose data lives in external files."""
    for t in graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            yield t
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t") and attr.t.data_location == TensorProto.EXTERNAL:
                yield attr.t
            for t in attr.tensors:
                if t.data_location == TensorProto.EXTERNAL:
                    yield t
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from external_tensors(g)


def tensor_nbytes(t: onnx.TensorProto) -> int | None:
    """Bytes the declared dims and type need (None for strings and unknown types)."""
    if t.data_type in (TensorProto.STRING, TensorProto.UNDEFINED):
        return None
    if any(d < 0 for d in t.dims):
        raise ValueError(f"tensor {t.name!r} has a negative dimension {list(t.dims)}")
    if t.data_type in (TensorProto.INT4, TensorProto.UINT4):
        return (math.prod(t.dims) + 1) // 2
    try:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    return math.prod(t.dims) * itemsize


def check_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Every external-data reference names a regular file inside the model's folder that holds
    the bytes the tensor declares (offset + dims x type), before anything reads them."""
    folder = path.parent.resolve()
    for t in external_tensors(model.graph):
        info = {e.key: e.value for e in t.external_data}
        where = f"{path}: tensor {t.name!r}"
        location = info.get("location", "")
        rel = Path(location)
        if not location or rel.is_absolute() or ".." in rel.parts:
            raise BadInputError(f"{where} refers to external data {location!r}; it must be a relative path inside "
                                f"the model's folder")
        data = (folder / rel).resolve()
        if not data.is_relative_to(folder):
            raise BadInputError(f"{where} refers to external data {location!r}, which resolves outside the model's "
                                f"folder ({data})")
        if not data.is_file():
            raise BadInputError(f"{where} refers to external data file {location!r}, which does not exist")
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else None
            need = tensor_nbytes(t)
        except ValueError as e:
            raise BadInputError(f"{where} has malformed external data fields: {first_line(e)}") from None
        size = data.stat().st_size
        if offset < 0 or (length is not None and length < 0):
            raise BadInputError(f"{where} declares a negative external data offset or length ({offset}, {length})")
        if need is not None and length is not None and length != need:
            raise BadInputError(f"{where} declares {length} bytes of external data but its shape "
                                f"{list(t.dims)} needs {need}")
        end = offset + (need if need is not None else (length or 0))
        if end > size:
            raise BadInputError(f"{where} needs bytes {offset} to {end} of {location!r}, which holds {size}")


def check_input_sizes(model: onnx.ModelProto, path: Path) -> None:
    """Graph inputs are tensors with a known type, non-negative dims and at most
    ``MAX_INPUT_BYTES`` per sample."""
    inits = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise BadInputError(f"{path}: input {vi.name!r} is not a tensor (sequence, map and optional inputs are "
                                "not supported)")
        tt = vi.type.tensor_type
        try:
            itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)).itemsize
        except (KeyError, TypeError, ValueError):
            raise BadInputError(f"{path}: input {vi.name!r} has no usable element type ({tt.elem_type})") from None
        dims = [d.dim_value if d.HasField("dim_value") else d.dim_param or "?" for d in tt.shape.dim]
        static = [d for d in dims if isinstance(d, int)]
        if any(d < 0 for d in static):
            raise BadInputError(f"{path}: input {vi.name!r} declares a negative dimension {tuple(dims)}")
        nbytes = math.prod(static) * itemsize
        if nbytes > MAX_INPUT_BYTES:
            raise BadInputError(f"{path}: input {vi.name!r} declares shape {tuple(dims)}, {nbytes / 2**30:.3g} GiB "
                                f"per sample (at most {MAX_INPUT_BYTES / 2**30:.0f} GiB)")


# --- normalizing ------------------------------------------------------------------------------


def sparse_to_initializers(model: onnx.ModelProto, path: Path | str = "model") -> int:
    """The graph's ``sparse_initializer`` tensors as dense initializers of the same name (what
    ONNX Runtime does when it loads them), so tools that know only initializers (shape
    inference, the estimator) see them; each dense tensor is sized against the memory
    first. Returns how many were converted."""
    graph = model.graph
    for sp in graph.sparse_initializer:
        values, dims = sp.values, list(sp.dims)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(values.data_type)
        require_memory(math.prod(dims) * np.dtype(dtype).itemsize,
                       f"{path}: the sparse initializer {values.name!r} of shape {tuple(dims)} as a dense tensor")
        dense = np.zeros(math.prod(dims), dtype=dtype)
        vals = numpy_helper.to_array(values).reshape(-1)
        idx = numpy_helper.to_array(sp.indices).astype(np.int64)
        if idx.ndim == 2:  # (NNZ, rank) coordinates
            idx = np.ravel_multi_index(tuple(idx.T), dims) if idx.size else idx.reshape(-1)
        if idx.size != vals.size or (idx.size and (idx.min() < 0 or idx.max() >= dense.size)):
            raise BadInputError(f"{path}: the sparse initializer {values.name!r} has indices that do not fit its "
                                f"shape {tuple(dims)}")
        dense[idx.reshape(-1)] = vals
        graph.initializer.append(numpy_helper.from_array(dense.reshape(dims), values.name))
    converted = len(graph.sparse_initializer)
    del graph.sparse_initializer[:]
    return converted


def constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor a ``Constant`` node produces (None for sparse and string values)."""
    if len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        t = TensorProto()
        t.CopyFrom(attr.t)
        return None if t.data_type == TensorProto.STRING else t
    values: dict[str, np.ndarray] = {
        "value_float": np.array(attr.f, np.float32), "value_floats": np.array(list(attr.floats), np.float32),
        "value_int": np.array(attr.i, np.int64), "value_ints": np.array(list(attr.ints), np.int64)}
    return numpy_helper.from_array(values[attr.name]) if attr.name in values else None


def constants_to_initializers(model: onnx.ModelProto) -> int:
    """Move the main graph's ``Constant`` nodes into initializers of the same name (in place);
    returns how many. Subgraphs, graph outputs, sparse and string constants stay as they are."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    kept, moved = [], []
    for node in graph.node:
        value = None
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output[0] not in outputs:
            value = constant_value(node)
        if value is None:
            kept.append(node)
            continue
        value.name = node.output[0]
        moved.append(value)
    if not moved:
        return 0
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(moved)
    names = {t.name for t in moved}
    stale = [vi for vi in graph.value_info if vi.name not in names]
    del graph.value_info[:]
    graph.value_info.extend(stale)
    if model.ir_version < 4:  # before IR 4 every initializer had to be a graph input too
        model.ir_version = 4
    return len(moved)


# --- what is already quantized -----------------------------------------------------------------


@dataclass(frozen=True)
class DequantChain:
    """An integer weight initializer turned into float inside the graph.

    ``nodes``: the nodes of the chain, in order (a DequantizeLinear; or Cast [, Sub] [, Mul]).
    ``output``: the float tensor the chain produces. ``quantized``, ``scale``, ``zero_point``:
    initializer names (``zero_point`` may be empty). ``form``: "DequantizeLinear" or "Cast+Mul".
    """

    nodes: tuple[str, ...]
    output: str
    quantized: str
    scale: str
    zero_point: str
    form: str


@dataclass(frozen=True)
class QuantizedGraph:
    """What a graph already holds in quantized form.

    ``ops``: op type -> count, for integer ops and Q/DQ nodes. ``activation_pairs``: Q/DQ on
    activations (a QuantizeLinear whose input is not an initializer). ``weights``: integer
    weight initializers dequantized in the graph, per form. ``region``: names of the nodes
    inside quantized regions (integer ops, Q/DQ, dequantization chains, and the nodes that
    read a dequantized activation): quantizing them again would quantize twice.
    """

    ops: dict[str, int] = field(default_factory=dict)
    activation_pairs: int = 0
    weights: dict[str, int] = field(default_factory=dict)
    region: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.ops or self.weights)

    def describe(self) -> str:
        """``48 MatMulInteger, 48 DynamicQuantizeLinear; 36 int8 weights (Cast+Mul)``."""
        parts = []
        ops = {k: v for k, v in self.ops.items() if k not in QDQ_OPS}
        if ops:
            parts.append(", ".join(f"{n} {op}" for op, n in sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))))
        if self.activation_pairs:
            parts.append(f"{self.activation_pairs} Q/DQ pairs on activations")
        if self.weights:
            parts.append(", ".join(f"{n} integer weights dequantized by {form}" for form, n in sorted(self.weights.items())))
        return "; ".join(parts) or "nothing quantized"

    def to_dict(self) -> dict[str, object]:
        return {"ops": dict(self.ops), "activation_pairs": self.activation_pairs, "weights": dict(self.weights),
                "nodes": len(self.region)}


def _named(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The graph's nodes, each with a name (generated where the file has none, in place)."""
    taken = {n.name for n in graph.node if n.name}
    for k, n in enumerate(graph.node):
        if not n.name:
            name = f"{n.op_type}_{k}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)
    return list(graph.node)


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def weight_dequant_chains(model: onnx.ModelProto) -> list[DequantChain]:
    """Integer weight initializers made float in the graph: ``DequantizeLinear(q, scale[, zp])``,
    or ``Cast(q) [- zero_point] [* scale]`` with float initializers for zero point and scale."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in _named(graph):
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def float_init(name: str) -> bool:
        return name in inits and inits[name].data_type in FLOAT_TYPES

    def only_consumer(tensor: str, op: str) -> onnx.NodeProto | None:
        users = consumers.get(tensor, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    chains = []
    for n in graph.node:
        q = n.input[0] if n.input else ""
        if q not in inits or inits[q].data_type not in WEIGHT_INT_TYPES:
            continue
        if n.op_type == "DequantizeLinear":
            chains.append(DequantChain((n.name,), n.output[0], q, n.input[1],
                                       n.input[2] if len(n.input) > 2 else "", "DequantizeLinear"))
        elif n.op_type == "Cast" and _attr(n, "to", 0) in FLOAT_TYPES:
            nodes, out, zp, scale = [n.name], n.output[0], "", ""
            sub = only_consumer(out, "Sub")
            if sub is not None and sub.input[0] == out and float_init(sub.input[1]):
                nodes.append(sub.name)
                out, zp = sub.output[0], sub.input[1]
            mul = only_consumer(out, "Mul")
            if mul is not None:
                other = mul.input[1] if mul.input[0] == out else mul.input[0]
                if float_init(other):
                    nodes.append(mul.name)
                    out, scale = mul.output[0], other
            if scale:  # a bare Cast of an integer constant is no quantization
                chains.append(DequantChain(tuple(nodes), out, q, scale, zp, "Cast+Mul"))
    return chains


def find_quantized(model: onnx.ModelProto) -> QuantizedGraph:
    """What ``model`` already holds in quantized form (see ``QuantizedGraph``)."""
    graph = model.graph
    nodes = _named(graph)
    inits = {i.name for i in graph.initializer}
    ops: dict[str, int] = {}
    region: set[str] = set()
    activation_dq: set[str] = set()  # outputs of DequantizeLinear nodes on activations
    pairs = 0
    for n in nodes:
        if n.op_type in QUANTIZED_OPS or n.op_type in QDQ_OPS:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
            region.add(n.name)
        if n.op_type in QDQ_OPS and n.input and n.input[0] not in inits:
            pairs += n.op_type == "QuantizeLinear"
            if n.op_type == "DequantizeLinear":
                activation_dq.add(n.output[0])
    weights: dict[str, int] = {}
    for chain in weight_dequant_chains(model):
        weights[chain.form] = weights.get(chain.form, 0) + 1
        region.update(chain.nodes)
    for n in nodes:  # a node reading a dequantized activation is inside a Q/DQ region already
        if any(i in activation_dq for i in n.input):
            region.add(n.name)
    return QuantizedGraph(ops=ops, activation_pairs=pairs, weights=weights, region=frozenset(region))


# --- inputs ---------------------------------------------------------------------------------------


def graph_inputs(model: onnx.ModelProto) -> tuple[list[InputSpec], dict[str, dict[int, str]]]:
    """The graph's inputs (initializers excluded) as InputSpecs, and their symbolic axes; a
    symbolic first axis named like a batch ("N", "batch_size", ...) is called "batch"."""
    init_names = {i.name for i in model.graph.initializer}
    inputs: list[InputSpec] = []
    dyn: dict[str, dict[int, str]] = {}
    for vi in model.graph.input:
        if vi.name in init_names:
            continue
        tt = vi.type.tensor_type
        shape: list[int | str] = []
        for ax, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            else:
                axis_name = d.dim_param or f"dim{ax}"
                if ax == 0 and axis_name in ("N", "batch_size", "unk__0", "dim0"):
                    axis_name = "batch"
                shape.append(axis_name)
                dyn.setdefault(vi.name, {})[ax] = axis_name
        inputs.append(InputSpec(vi.name, tuple(shape), numpy_dtype(tt.elem_type)))
    return inputs, dyn


def numpy_dtype(elem_type: int) -> str:
    """numpy's name for an ONNX element type ("float32" where numpy has none)."""
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return "float32"


def integer_input_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Integer graph inputs used as ``Gather`` indices into an initializer (an embedding table,
    possibly dequantized in the graph): input -> number of rows, so sample ids stay in range."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    dequantized = {c.output: c.quantized for c in weight_dequant_chains(model)}
    bounds: dict[str, int] = {}
    names = {vi.name for vi in graph.input}
    for n in graph.node:
        if n.op_type != "Gather" or len(n.input) < 2 or n.input[1] not in names:
            continue
        table = inits.get(dequantized.get(n.input[0], n.input[0]))
        axis = _attr(n, "axis", 0)
        if table is not None and len(table.dims) > axis >= 0:
            rows = int(table.dims[axis])
            bounds[n.input[1]] = min(bounds.get(n.input[1], rows), rows)
    return bounds


def _scopes(node: onnx.NodeProto) -> list[str]:
    """The exporter's scope chain of a node: ``['', 'block', 'block.conv', 'conv2d']`` (the
    module paths from the root, then the op), from ``pkg.torch.onnx.name_scopes`` (the
    dynamo exporter) or ``namespace`` (``': M/block: B/block.conv: Conv2d/conv2d: aten...'``)."""
    import ast

    meta = {p.key: p.value for p in node.metadata_props}
    raw = meta.get("pkg.torch.onnx.name_scopes")
    if raw and len(raw) < 65536:
        try:
            value = ast.literal_eval(raw)  # a literal list of strings; literal_eval runs no code
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    ns = meta.get("namespace")
    if ns and len(ns) < 65536:
        return [part.split(":", 1)[0].strip() for part in ns.split("/")]
    return []


def onnx_node_label(node: onnx.NodeProto) -> str:
    """A node's name a person can follow: the PyTorch module path the exporter recorded in
    the node's metadata (the deepest module the op ran in, ``block.conv``; a functional op
    directly in the model's forward is its op name, ``relu``), else the ONNX node name.
    Profile, estimate and per-layer precision tables all name nodes with it.

    >>> n = onnx.helper.make_node("Relu", ["x"], ["y"], name="node_relu")
    >>> onnx_node_label(n)
    'node_relu'
    >>> onnx.helper.set_metadata_props(n, {"pkg.torch.onnx.name_scopes": "['', 'block', 'block.conv', 'conv2d']"})
    >>> onnx_node_label(n)
    'block.conv'
    """
    scopes = _scopes(node)
    if len(scopes) >= 2:
        module = next((s for s in reversed(scopes[:-1]) if s), "")
        return module or scopes[-1] or node.name
    return node.name or node.op_type


def node_labels(onnx_path: str | os.PathLike[str]) -> dict[str, str]:
    """ONNX node name -> the PyTorch module path the exporter recorded (``onnx_node_label``),
    for the nodes that have one."""
    try:
        model = read_graph_outline(onnx_path)  # the nodes only: the weights are not read
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot read {onnx_path} for node names: {e}") from None
    labels: dict[str, str] = {}
    for node in model.graph.node:
        label = onnx_node_label(node)
        if node.name and label != node.name:
            labels[node.name] = label
            for out in node.output:  # ORT names some fused nodes after an output (Conv+Clip: "hardtanh_nchwc")
                labels.setdefault(f"output:{out}", label)
    return labels


# Wire-format field numbers (onnx.proto): ModelProto.graph, GraphProto.initializer and
# sparse_initializer, and the TensorProto fields an outline keeps (dims, data_type, name,
# external_data, data_location: where the data lives, not the data).
_MODEL_GRAPH, _GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 7, 5, 15
_TENSOR_OUTLINE_FIELDS = (1, 2, 8, 13, 14)


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, start of the field's key, start of its value, end) of each field of the
    protobuf message in ``buf[start:end]``; a length-delimited value starts after its length."""
    pos = start
    while pos < end:
        key_at = pos
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, stop = _varint(buf, pos)
        elif wire == 1:
            stop = pos + 8
        elif wire == 5:
            stop = pos + 4
        elif wire == 2:
            size, pos = _varint(buf, pos)
            stop = pos + size
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {key_at}")
        if stop > end:
            raise ValueError(f"field at byte {key_at} runs past the end of its message")
        yield key >> 3, key_at, pos, stop
        pos = stop


def _delimited(field_number: int, payload: bytes) -> bytes:
    out = bytearray()
    for n in ((field_number << 3) | 2, len(payload)):
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out) + payload


def read_graph_outline(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The model in ``path`` without the data of its initializers: nodes, inputs, outputs,
    value infos, opsets and metadata as stored, each initializer reduced to its name, type,
    dims and where its data lives (``data_location``, ``external_data``; sparse initializers
    dropped). What the file's weights take is skipped in the
    protobuf wire format, never parsed, so this costs memory the size of the graph's structure
    (``onnx.load`` holds the file's bytes and a parsed copy of every weight). For reading op
    types, attributes, names and labels; not a model to run or save. Unreadable files raise
    ``ValueError`` (or ``OSError``)."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            out = bytearray()
            try:
                for field_no, key_at, start, stop in _fields(buf, 0, len(buf)):
                    if field_no != _MODEL_GRAPH:
                        out += buf[key_at:stop]
                        continue
                    graph = bytearray()
                    for g_no, g_key, g_start, g_stop in _fields(buf, start, stop):
                        if g_no == _GRAPH_INITIALIZER:
                            kept = b"".join(bytes(buf[t_key:t_stop]) for t_no, t_key, _, t_stop
                                            in _fields(buf, g_start, g_stop) if t_no in _TENSOR_OUTLINE_FIELDS)
                            graph += _delimited(_GRAPH_INITIALIZER, kept)
                        elif g_no != _GRAPH_SPARSE_INITIALIZER:
                            graph += buf[g_key:g_stop]
                    out += _delimited(_MODEL_GRAPH, bytes(graph))
            except IndexError:
                raise ValueError(f"{path} is truncated") from None
        finally:
            buf.release()
    model = onnx.ModelProto()
    try:
        model.ParseFromString(bytes(out))
    except DecodeError as e:
        raise ValueError(f"{path} is not an ONNX model: {e}") from None
    return model
