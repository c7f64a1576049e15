"""The graph an estimate reads: ONNX loaded without weight data, dynamic dims bound, shapes
inferred by ONNX Runtime's symbolic shape inference (which knows its contrib ops), falling
back to ``onnx.shape_inference`` with data propagation.

``read_graph(model_or_onnx, batch, dims) -> Graph``: nodes in order with their input and
output tensors (shape, element type, constant or not) and attributes.
"""
from __future__ import annotations

import ast
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from edgekit.artifact import read_manifest
from edgekit.errors import BadInputError, EdgekitError
from edgekit.loading import export_onnx, load_model
from edgekit.sources.onnx_file import read_onnx, sparse_to_initializers

# ONNX element type -> bits per element
ELEM_BITS = {1: 32, 2: 8, 3: 8, 4: 16, 5: 16, 6: 32, 7: 64, 9: 8, 10: 16, 11: 64, 12: 32, 13: 64, 16: 16,
             17: 8, 18: 8, 19: 8, 20: 8, 21: 4, 22: 4, 23: 4}
FLOAT_ELEMS = {1, 10, 11, 16, 17, 18, 19, 20, 23}
_ELEM_PRECISION = {21: "int4", 22: "int4", 2: "int8", 3: "int8", 10: "fp16", 16: "bf16", 17: "fp8", 18: "fp8",
                   19: "fp8", 20: "fp8"}
_BIG_INITIALIZER = 4096  # bytes: larger initializers are weights, their data is not needed for shapes


def elem_precision(elem: int) -> str:
    return _ELEM_PRECISION.get(elem, "fp32")


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...] | None
    elem: int  # onnx TensorProto element type
    const: bool = False  # an initializer, a Constant, or computed from constants only

    @property
    def numel(self) -> float:
        return float(math.prod(self.shape)) if self.shape is not None else 0.0

    @property
    def stored_bytes(self) -> float:
        return self.numel * ELEM_BITS.get(self.elem, 32) / 8.0


@dataclass
class Node:
    index: int
    name: str
    op: str
    domain: str
    inputs: list[Tensor | None]
    outputs: list[Tensor | None]
    attrs: dict[str, Any]
    stage: str = ""

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)


@dataclass
class Graph:
    name: str
    nodes: list[Node]
    dims: dict[str, int]  # the dynamic dims as bound
    outputs: set[str]
    warnings: list[str] = field(default_factory=list)
    consumers: dict[str, list[Node]] = field(default_factory=dict)
    producer: dict[str, Node] = field(default_factory=dict)


# --- loading ----------------------------------------------------------------------------------------
def load_graph(model_or_onnx: Any, export_dir: str | os.PathLike[str] | None = None) -> tuple[Any, str]:
    """(onnx.ModelProto without external weight data, display name) from an ONNX file, an
    edgekit folder (onnx, engine or model artifact), a model spec or a ``ModelHandle``."""

    if isinstance(model_or_onnx, onnx.ModelProto):
        return model_or_onnx, model_or_onnx.graph.name or "model"
    text = str(model_or_onnx) if isinstance(model_or_onnx, (str, os.PathLike)) else None
    if text is not None:
        path = Path(text)
        if path.is_dir() and (path / "manifest.json").is_file():
            m = read_manifest(path)
            for role in ("onnx", "model"):
                if role in m.files and str(m.files[role]).endswith(".onnx"):
                    return load_onnx(path / m.files[role]), m.model.get("name") or path.name
        if text.endswith(".onnx"):
            name = path.stem
            if (path.parent / "manifest.json").is_file():  # a file inside an edgekit folder: its model's name
                try:
                    name = read_manifest(path.parent).model.get("name") or name
                except EdgekitError:
                    name = path.stem
            return load_onnx(path), name
    handle = load_model(model_or_onnx)
    if handle.onnx_path is not None:
        return load_onnx(handle.onnx_path), handle.name
    with tempfile.TemporaryDirectory(prefix="edgekit-estimate-") as tmp:
        out = Path(export_onnx(handle, Path(export_dir or tmp) / "onnx"))
        if out.is_dir():
            out = read_manifest(out).path_of(out, "onnx")
        return load_onnx(out), handle.name


_GRAPH_CACHE: dict[tuple[str, int, int], Any] = {}  # (path, size, mtime) -> ModelProto; the last two


def load_onnx(path: str | os.PathLike[str]) -> Any:
    """An ONNX file without its external data, large initializers' data dropped."""

    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"ONNX file {str(p)!r} does not exist")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if key in _GRAPH_CACHE:  # estimating one graph for many targets reads and parses it once
        return _GRAPH_CACHE[key]
    proto = read_onnx(p)  # the loader build uses: validated, external data inside the folder, input sizes bounded
    sparse_to_initializers(proto, p)
    strip_weights(proto)
    while len(_GRAPH_CACHE) >= 2:
        _GRAPH_CACHE.pop(next(iter(_GRAPH_CACHE)))
    _GRAPH_CACHE[key] = proto
    return proto


def strip_weights(proto: Any, min_bytes: int = _BIG_INITIALIZER) -> Any:
    """The graph without the data of its large initializers (dims and types kept): all the
    estimator needs, at a fraction of the memory."""

    for init in proto.graph.initializer:
        if init.data_type in (6, 7) and len(init.raw_data) <= 1 << 20:
            continue  # int32/int64 tables (positions, indices): shape inference may need their values
        if init.raw_data and len(init.raw_data) > min_bytes:
            init.ClearField("raw_data")
            init.data_location = onnx.TensorProto.EXTERNAL
            del init.external_data[:]
            init.external_data.add(key="location", value="__edgekit_dropped__")
    return proto


# --- dims and shapes ----------------------------------------------------------------------------------
def bind_dims(model: Any, batch: int, dims: dict[str, int] | None) -> tuple[Any, dict[str, int], list[str], set[str]]:
    """A copy of the graph with every dynamic input dim bound: axis 0 (or a dim named
    batch) -> ``batch``, named dims from ``dims``, others 1 (reported). Weights whose
    data was dropped become graph inputs of their shape (shape inference never reads
    them); their names are returned as constants."""

    dims = dict(dims or {})
    m = onnx.ModelProto()
    m.CopyFrom(model)
    strip_weights(m)
    del m.graph.value_info[:]
    inits = {i.name for i in m.graph.initializer}
    dropped = [i for i in m.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    declared = {vi.name for vi in m.graph.input}
    for init in dropped:
        if init.name not in declared:
            m.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    keep = [i for i in m.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    bound: dict[str, int] = {}
    warnings: list[str] = []
    assumed: set[str] = set()
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        for ax, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                if ax == 0 and batch != 1 and d.dim_value == 1 and "batch" not in dims:
                    warnings.append(f"input {vi.name!r} has a static batch of 1; estimated at batch 1, not {batch}")
                continue
            name = d.dim_param or f"{vi.name}_dim{ax}"
            total = _dim_sum(name, dims, batch)
            if name in dims:
                value = int(dims[name])
            elif total is not None:  # an axis the exporter named as a sum: past_sequence_length + sequence_length
                value = total
            elif ax == 0 or name.lower() in ("batch", "batch_size", "n"):
                value = batch
            else:
                value = 1
                assumed.add(name)
            d.ClearField("dim_param")
            d.dim_value = value
            bound[name] = value
    for o in m.graph.output:  # outputs get re-inferred; stale symbolic dims only confuse merging
        if o.type.tensor_type.HasField("shape"):
            o.type.tensor_type.ClearField("shape")
    if assumed:
        warnings.append(f"dynamic dims {sorted(assumed)} were set to 1; pass dims (CLI: --axis NAME=SIZE) to change")
    return m, bound, warnings, inits


def _dim_sum(name: str, dims: dict[str, int], batch: int) -> int | None:
    """``past_sequence_length + sequence_length`` when every term is a number or a given dim."""
    terms = [t.strip() for t in name.split("+")]
    if len(terms) < 2:
        return None
    total = 0
    for t in terms:
        if t.isdigit():
            total += int(t)
        elif t in dims:
            total += int(dims[t])
        else:
            return None
    return total


def infer_shapes(model: Any) -> tuple[Any, list[str]]:
    """Shapes by ONNX Runtime's symbolic shape inference (contrib ops included), node by
    node: a node it cannot infer keeps what onnx's own inference gives it and the rest of
    the graph goes on. Without ONNX Runtime, ``onnx.shape_inference`` with data propagation."""

    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except ImportError:
        try:
            return onnx.shape_inference.infer_shapes(model, data_prop=True), [
                "onnxruntime is not installed: shapes from onnx.shape_inference"]
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
            return model, [f"onnx shape inference failed ({str(e).splitlines()[0][:120]}): shapes are those "
                           "stored in the file"]
    # SymbolicShapeInference.infer_shapes, without its debris: on an incomplete inference it
    # saves the model into the working directory and raises; here each node is tolerated.
    sym = SymbolicShapeInference(2**31 - 1, True, True, 0)
    failed: list[str] = []
    for op, fn in list(sym.dispatcher_.items()):
        sym.dispatcher_[op] = _tolerant(fn, op, failed)
    sym._preprocess(model)
    warnings = []
    try:
        while sym.run_:
            sym._infer_impl()
        sym._update_output_from_vi()
        out = sym.out_mp_
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError) as e:
        # it stopped part-way: what it inferred, then onnx's inference for the rest
        warnings.append(f"symbolic shape inference stopped ({type(e).__name__}: {str(e)[:80]}); the nodes after "
                        "that point take onnx.shape_inference's shapes")
        try:
            out = onnx.shape_inference.infer_shapes(model, data_prop=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
            out = onnx.ModelProto()
            out.CopyFrom(model)
        known = {name: vi for name, vi in sym.known_vi_.items() if vi.type.tensor_type.HasField("shape")}
        keep = [vi for vi in out.graph.value_info if vi.name not in known]
        del out.graph.value_info[:]
        out.graph.value_info.extend(keep + list(known.values()))
    if failed:
        warnings.append(f"symbolic shape inference could not infer {len(failed)} nodes "
                        f"({', '.join(sorted(set(failed)))}); their outputs keep onnx's inference")
    return out, warnings


def _tolerant(fn: Any, op: str, failed: list[str]) -> Any:
    def run(node: Any) -> None:
        try:
            fn(node)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError):
            failed.append(op)  # reported by infer_shapes; the node's outputs keep onnx's inference

    return run


def _shape_of(type_proto: Any) -> tuple[int, ...] | None:
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return tuple(dims)


def _attrs(node: Any) -> dict[str, Any]:

    out: dict[str, Any] = {}
    for a in node.attribute:
        if a.type in (1, 2, 3, 6, 7, 8):  # FLOAT, INT, STRING, FLOATS, INTS, STRINGS
            v = helper.get_attribute_value(a)
            out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def stage_of(node: Any) -> str:
    """The top-level module a node came from (torch's name scopes, or the path in its name)."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [s for s in ast.literal_eval(p.value) if s]
            except (ValueError, SyntaxError):
                break
            if not scopes:
                return ""
            stage = scopes[0]
            if len(scopes) > 1 and scopes[1].isdigit():
                stage += "." + scopes[1]
            return stage
    if node.name.startswith("/"):
        parts = [x for x in node.name.split("/") if x]
        return parts[0] if len(parts) > 1 else ""
    return ""


def read_graph(model_or_onnx: Any, batch: int = 1, dims: dict[str, int] | None = None) -> Graph:
    """The shape-inferred graph with dims bound (see the module docstring)."""
    proto, name = load_graph(model_or_onnx)
    bound_model, bound, warnings, consts = bind_dims(proto, batch, dims)
    m, more = infer_shapes(bound_model)
    warnings += more
    table: dict[str, Tensor] = {}
    for vi in [*m.graph.input, *m.graph.value_info, *m.graph.output]:
        table[vi.name] = Tensor(vi.name, _shape_of(vi.type), vi.type.tensor_type.elem_type, const=vi.name in consts)
    for init in m.graph.initializer:
        table[init.name] = Tensor(init.name, tuple(int(d) for d in init.dims), init.data_type, const=True)
    nodes: list[Node] = []
    assumed_ops: list[str] = []
    g = Graph(name=name, nodes=nodes, dims=bound, outputs={o.name for o in m.graph.output}, warnings=warnings)
    for idx, n in enumerate(m.graph.node):
        ins = [table.get(i) if i else None for i in n.input]
        outs = []
        for o in n.output:
            t = table.get(o) if o else None
            if o and t is None:
                t = table[o] = Tensor(o, None, 1)
            outs.append(t)
        if n.op_type == "Constant" or (ins and all(t is not None and t.const for t in ins if t is not None)
                                       and any(t is not None for t in ins)):
            for t in outs:
                if t is not None:
                    t.const = True
        if outs and outs[0] is not None and outs[0].shape is None and ins and ins[0] is not None \
                and ins[0].shape is not None and n.domain not in ("", "ai.onnx"):
            outs[0].shape = ins[0].shape  # an op no inference knows: assumed shape-preserving (reported below)
            if outs[0].elem == 0:
                outs[0].elem = ins[0].elem
            assumed_ops.append(n.op_type)
        node = Node(idx, n.name or f"{n.op_type}_{idx}", n.op_type, n.domain, ins, outs, _attrs(n), stage_of(n))
        nodes.append(node)
        for t in outs:
            if t is not None:
                g.producer[t.name] = node
        for t in ins:
            if t is not None:
                g.consumers.setdefault(t.name, []).append(node)
    if assumed_ops:
        warnings.append(f"{len(assumed_ops)} nodes of ops no shape inference knows ({', '.join(sorted(set(assumed_ops)))}) "
                        "were given their first input's shape")
    shapeless = [n.op for n in nodes if n.op != "Constant" and any(t is not None and t.shape is None
                                                                     for t in n.outputs)]
    if shapeless:

        top = Counter(shapeless).most_common(6)
        warnings.append(f"{len(shapeless)} nodes have outputs of unknown shape (their work is undercounted): "
                        + ", ".join(f"{op} x{c}" for op, c in top))
    return g
