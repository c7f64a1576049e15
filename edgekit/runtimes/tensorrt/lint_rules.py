"""The "Restrictions" column of onnx-tensorrt's operator tables, one rule per sentence.

Each table row's restriction text (``data/onnx_tensorrt_operators.json``, kept as written)
is split into sentences; every sentence of every shipped table has a rule here, keyed by the
operator and the sentence (a test checks that none is left without one). A rule reads a
node (its attributes, outputs, input ranks and shapes, constant inputs) and returns what
about that node breaks the sentence, or None. ``lint.py`` turns that into a finding that
quotes the table's words and cites the row's line in ``docs/operators.md``.

Families (``Rule.family``): ``attribute`` (an attribute value the table excludes), ``mode``
(a mode outside the listed ones), ``output`` (an output the importer does not produce),
``rank`` (input ranks), ``limit`` (a value limit), ``constant-input`` (an input that must be
an initializer or a build-time constant), ``static-shape`` (dimensions that must be known at
build time), ``subgraph`` (If/Loop bodies) and ``ignored`` (what TensorRT ignores: a
warning). Checks that need a shape the graph does not declare stay silent rather than guess.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


class GraphView:
    """What the rules read of a graph: producers, constants and their values, inferred
    types and shapes (``None`` for a dimension that is not a known positive size)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.inits = {i.name: i for i in g.initializer}
        self.const_nodes = {n.output[0]: n for n in g.node if n.op_type == "Constant" and n.output}
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumed = {i for n in g.node for i in n.input if i} | {o.name for o in g.output}
        self.types: dict[str, int] = {}
        self.shapes: dict[str, list[int | None]] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError):
            inferred = model  # checks that need types or shapes skip what they cannot see
        for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            self._record(vi)
        for name, init in self.inits.items():
            self.types[name] = init.data_type
            self.shapes[name] = list(init.dims)

    def _record(self, vi: onnx.ValueInfoProto) -> None:
        tt = vi.type.tensor_type
        self.types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                                    for d in tt.shape.dim]

    def is_const(self, name: str) -> bool:
        """An initializer, a Constant, or a DequantizeLinear/Identity/Cast of one (what TensorRT folds)."""
        if name in self.inits or name in self.const_nodes:
            return True
        p = self.producer.get(name)
        return p is not None and p.op_type in ("DequantizeLinear", "Identity", "Cast") and bool(p.input) \
            and self.is_const(p.input[0])

    def value(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant (through Identity/Cast), else None."""
        if name in self.inits:
            init = self.inits[name]
            if init.data_location == TensorProto.EXTERNAL:
                return None
            return numpy_helper.to_array(init)
        if name in self.const_nodes:
            for a in self.const_nodes[name].attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name in ("value_int", "value_ints"):
                    return np.asarray(onnx.helper.get_attribute_value(a))
            return None
        p = self.producer.get(name)
        if p is not None and p.op_type in ("Identity", "Cast") and p.input:
            return self.value(p.input[0])
        return None

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return len(s) if s is not None else None


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """An attribute's value (strings decoded), or ``default``."""
    for a in node.attribute:
        if a.name == name:
            v = onnx.helper.get_attribute_value(a)
            if isinstance(v, bytes):
                return v.decode()
            if isinstance(v, list) and v and isinstance(v[0], bytes):
                return [x.decode() for x in v]
            return v
    return default


def has_attr(node: onnx.NodeProto, name: str) -> bool:
    return any(a.name == name for a in node.attribute)


def _input(node: onnx.NodeProto, i: int) -> str:
    return node.input[i] if i < len(node.input) else ""


def _formal_index(op: str, name: str) -> int:
    """The position of the input the table names (``axes``, ``K``, ...) in the op's newest schema."""
    formal = [i.name for i in onnx.defs.get_schema(op).inputs]
    return formal.index(name)


# --- the checks, one per kind of sentence ------------------------------------------------------

Check = Callable[[onnx.NodeProto, GraphView], "str | None"]


def _pool_2d_3d(node: onnx.NodeProto, g: GraphView) -> str | None:
    kernel = attr(node, "kernel_shape")
    rank = g.rank(_input(node, 0))
    dims = len(kernel) if kernel else (None if rank is None else rank - 2)
    return None if dims in (None, 2, 3) else f"{dims}D pooling (kernel_shape {kernel})"


def _dilations_one(node: onnx.NodeProto, g: GraphView) -> str | None:
    dil = attr(node, "dilations")
    return None if not dil or all(int(d) == 1 for d in dil) else f"dilations {list(dil)}"


def _rank_in(lo: int, hi: int, what: str = "input") -> Check:
    def check(node: onnx.NodeProto, g: GraphView) -> str | None:
        r = g.rank(_input(node, 0))
        return None if r is None or lo <= r <= hi else f"{what} of rank {r}"
    return check


def _output_unused(first: int) -> Check:
    def check(node: onnx.NodeProto, g: GraphView) -> str | None:
        extra = [o for o in node.output[first:] if o]
        return None if not extra else f"output{'s' if len(extra) > 1 else ''} {', '.join(repr(o) for o in extra)}"
    return check


def _attr_equals(name: str, allowed: Any, default: Any) -> Check:
    def check(node: onnx.NodeProto, g: GraphView) -> str | None:
        v = attr(node, name, default)
        return None if v == allowed else f"{name}={v!r}"
    return check


def _attr_in(name: str, allowed: tuple[str, ...], default: str, when: Callable[[onnx.NodeProto], bool] | None = None
             ) -> Check:
    def check(node: onnx.NodeProto, g: GraphView) -> str | None:
        if when is not None and not when(node):
            return None
        v = attr(node, name, default)
        return None if v in allowed else f"{name}={v!r}"
    return check


def _attrs_absent(*names: str) -> Check:
    def check(node: onnx.NodeProto, g: GraphView) -> str | None:
        present = [n for n in names if has_attr(node, n)]
        return None if not present else f"attribute {', '.join(present)}"
    return check


def _constant_input(op: str, *names: str) -> Check:
    def check(node: onnx.NodeProto, g: GraphView) -> str | None:
        for name in names:
            i = _formal_index(op, name)
            t = _input(node, i)
            if t and not g.is_const(t):
                return f"input {name} ({t!r}) computed at run time"
        return None
    return check


def _same_directions(node: onnx.NodeProto, g: GraphView) -> str | None:
    acts = attr(node, "activations")
    if attr(node, "direction", "forward") != "bidirectional" or not acts or len(acts) % 2:
        return None
    half = len(acts) // 2
    return None if acts[:half] == acts[half:] else f"activations {acts[:half]} forward, {acts[half:]} reverse"


def _deform_pads(node: onnx.NodeProto, g: GraphView) -> str | None:
    pads = attr(node, "pads")
    if not pads:
        return None
    n = len(pads) // 2
    return None if list(pads[:n]) == list(pads[n:]) else f"pads {list(pads)} (begin {list(pads[:n])}, end {list(pads[n:])})"


def _dropout_training(node: onnx.NodeProto, g: GraphView) -> str | None:
    t = _input(node, 2)  # training_mode (the table's `is_traning`)
    if not t:
        return None
    if not g.is_const(t):
        return f"input training_mode ({t!r}) computed at run time"
    v = g.value(t)
    return None if v is None or not bool(np.any(v)) else f"training_mode = {bool(np.any(v))}"


def _static_input(node: onnx.NodeProto, g: GraphView) -> str | None:
    s = g.shapes.get(_input(node, 0))
    return f"input {_input(node, 0)!r} of shape {_dims(s)}" if s is not None and None in s else None


def _static_axis(node: onnx.NodeProto, g: GraphView) -> str | None:
    s = g.shapes.get(_input(node, 0))
    if s is None:
        return None
    axis = int(attr(node, "axis", -1)) % max(len(s), 1)
    return None if s[axis] is not None else f"axis {axis} of {_input(node, 0)!r} is dynamic ({_dims(s)})"


def _dims(s: list[int | None] | None) -> str:
    return "unknown" if s is None else "[" + ", ".join("?" if d is None else str(d) for d in s) + "]"


def _topk_limit(node: onnx.NodeProto, g: GraphView) -> str | None:
    k = _input(node, 1)
    v = g.value(k) if k else None
    if v is not None and v.size and int(np.max(v)) >= 3840:
        return f"K = {int(np.max(v))}"
    return None


def _topk_k_known(node: onnx.NodeProto, g: GraphView) -> str | None:
    k = _input(node, 1)
    return f"K ({k!r}) computed at run time, so its limit cannot be checked offline" if k and not g.is_const(k) else None


def _scatter_reduction(node: onnx.NodeProto, g: GraphView) -> str | None:
    r = attr(node, "reduction", "none")
    return None if r == "none" else f"reduction={r!r}"


def _resize_axes_iota(node: onnx.NodeProto, g: GraphView) -> str | None:
    axes = attr(node, "axes")
    if not axes or not _input(node, 2):
        return None
    r = g.rank(_input(node, 0))
    want = list(range(r)) if r is not None else sorted(int(a) for a in axes)
    got = [int(a) % r if r else int(a) for a in axes]
    return None if got == want else f"scales with axes {list(axes)}"


def _seed(node: onnx.NodeProto, g: GraphView) -> str | None:
    return f"seed={attr(node, 'seed')}" if has_attr(node, "seed") else None


def _einsum_terms(node: onnx.NodeProto) -> list[str]:
    eq = str(attr(node, "equation", "")).replace(" ", "")
    return eq.split("->")[0].split(",") if eq else []


def _einsum_ellipsis_diagonal(node: onnx.NodeProto, g: GraphView) -> str | None:
    eq = str(attr(node, "equation", ""))
    if "..." in eq:
        return f"equation {eq!r} (ellipsis)"
    for term in _einsum_terms(node):
        if len(set(term)) != len(term):
            return f"equation {eq!r} (diagonal: {term!r} repeats an index)"
    return None


def _einsum_broadcast(node: onnx.NodeProto, g: GraphView) -> str | None:
    sizes: dict[str, set[int]] = {}
    for term, name in zip(_einsum_terms(node), node.input):
        s = g.shapes.get(name)
        if s is None or len(s) != len(term):
            continue
        for letter, d in zip(term, s):
            if d is not None:
                sizes.setdefault(letter, set()).add(d)
    bad = sorted(k for k, v in sizes.items() if len(v) > 1)
    return f"index {bad[0]!r} has sizes {sorted(sizes[bad[0]])} across inputs" if bad else None


def _branch_outputs(node: onnx.NodeProto) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    then, other = attr(node, "then_branch"), attr(node, "else_branch")
    return (list(then.output) if then is not None else []), (list(other.output) if other is not None else [])


def _vi_shape(vi: onnx.ValueInfoProto) -> list[int | None] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tt.shape.dim]


def _if_names(node: onnx.NodeProto, g: GraphView) -> str | None:
    a, b = _branch_outputs(node)
    same = sorted({o.name for o in a} & {o.name for o in b})
    return f"both branches write {same[0]!r}" if same else None


def _if_same_rank(node: onnx.NodeProto, g: GraphView) -> str | None:
    for x, y in zip(*_branch_outputs(node)):
        sx, sy = _vi_shape(x), _vi_shape(y)
        if sx is not None and sy is not None and len(sx) != len(sy):
            return f"branch outputs {x.name!r} of rank {len(sx)} and {y.name!r} of rank {len(sy)}"
    return None


def _if_broadcastable(node: onnx.NodeProto, g: GraphView) -> str | None:
    for x, y in zip(*_branch_outputs(node)):
        sx, sy = _vi_shape(x), _vi_shape(y)
        if sx is None or sy is None:
            continue
        for dx, dy in zip(reversed(sx), reversed(sy)):
            if dx is not None and dy is not None and dx != dy and 1 not in (dx, dy):
                return f"branch outputs {x.name!r} {_dims(sx)} and {y.name!r} {_dims(sy)} do not broadcast"
    return None


def _loop_scan_length(node: onnx.NodeProto, g: GraphView) -> str | None:
    body = attr(node, "body")
    carried = max(len(node.input) - 2, 0)
    scans = (len(body.output) - 1 - carried) if body is not None else 0
    trip = _input(node, 0)
    if scans > 0 and (not trip or not g.is_const(trip)):
        return f"{scans} scan output(s) with a trip count {'computed at run time' if trip else 'not given'}"
    return None


def _loop_carried_shapes(node: onnx.NodeProto, g: GraphView) -> str | None:
    body = attr(node, "body")
    if body is None:
        return None
    for vin, vout in zip(list(body.input)[2:], list(body.output)[1:]):
        a, b = _vi_shape(vin), _vi_shape(vout)
        if a is not None and b is not None and None not in a and None not in b and a != b:
            return f"carried {vin.name!r} enters as {_dims(a)} and leaves as {_dims(b)}"
    return None


# --- the rules ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    family: str
    check: Check | None  # None: checked by lint's Q/DQ rules (zero points)
    fix: str
    severity: str = "error"


_RESIZE_CTM = ("half_pixel", "pytorch_half_pixel", "tf_half_pixel_for_nn", "asymmetric", "align_corners")
_RESIZE_NEAREST = ("floor", "ceil", "round_prefer_floor", "round_prefer_ceil")
_RE_EXPORT = "change the model (or its export options) so the node takes the supported form"
_FOLD = "make it a constant: fold it (onnxsim or constant folding before export) or re-export with static shapes"
_STATIC = "export with static shapes, or give the sizes (lint --shapes / build --shapes)"


def _rules() -> dict[tuple[str, str], Rule]:
    pool_fix = "export the pooling as 2D or 3D"
    dil_fix = "remove the dilation (replace the dilated pooling, or pool on a strided slice)"
    rules: dict[tuple[str, str], Rule] = {
        ("AveragePool", "2D or 3D Pooling only"): Rule("rank", _pool_2d_3d, pool_fix),
        ("MaxPool", "2D or 3D pooling only"): Rule("rank", _pool_2d_3d, pool_fix),
        ("AveragePool", "`dilations` must be empty or all ones"): Rule("attribute", _dilations_one, dil_fix),
        ("MaxPool", "`dilations` must be empty or all ones"): Rule("attribute", _dilations_one, dil_fix),
        ("LpPool", "`dilations` must be empty or all ones"): Rule("attribute", _dilations_one, dil_fix),
        ("MaxPool", "`Indices` output tensor unsupported"): Rule(
            "output", _output_unused(1), "drop the Indices output (return_indices=False); compute indices another way"),
        ("LayerNormalization", "Only the first output `Y` is supported"): Rule(
            "output", _output_unused(1), "drop the Mean and InvStdDev outputs (export for inference)"),
        ("Constant", "`sparse_value`, `value_string`, and `value_strings` attributes are unsupported"): Rule(
            "attribute", _attrs_absent("sparse_value", "value_string", "value_strings"),
            "use a dense numeric constant (strings belong outside the engine)"),
        ("CumSum", "`axis` must be an initializer"): Rule("constant-input", _constant_input("CumSum", "axis"), _FOLD),
        ("Pad", "`axes` must be an initializer"): Rule("constant-input", _constant_input("Pad", "axes"), _FOLD),
        ("Slice", "`axes` must be an initializer"): Rule("constant-input", _constant_input("Slice", "axes"), _FOLD),
        ("Squeeze", "`axes` must be an initializer"): Rule("constant-input", _constant_input("Squeeze", "axes"), _FOLD),
        ("Unsqueeze", "`axes` must be a constant tensor"): Rule("constant-input", _constant_input("Unsqueeze", "axes"),
                                                               _FOLD),
        ("TopK", "`K` input must be an initializer"): Rule("constant-input", _constant_input("TopK", "K"), _FOLD),
        ("OneHot", "`depth` must be a build-time constant"): Rule("constant-input", _constant_input("OneHot", "depth"),
                                                                _FOLD),
        ("InstanceNormalization", "Scales `scale` and biases `B` must be initializers"): Rule(
            "constant-input", _constant_input("InstanceNormalization", "scale", "B"), _FOLD),
        ("Dropout", "`is_traning` must be an initializer and evaluate to False"): Rule(
            "constant-input", _dropout_training, "export in eval mode (model.eval()), so training_mode is absent or a "
            "False initializer"),
        ("InstanceNormalization", "Input rank must be >=3 & <=5"): Rule("rank", _rank_in(3, 5), _RE_EXPORT),
        ("GridSample", "Input must be 4D input"): Rule("rank", _rank_in(4, 4), "sample a 4-D (N, C, H, W) input; "
                                                       "3-D sampling has no TensorRT importer"),
        ("DeformConv", "`input` must have 1D or 2D spatial dimensions"): Rule("rank", _rank_in(3, 4), _RE_EXPORT),
        ("DeformConv", "`pads` for the beginning and end along each spatial axis must be the same"): Rule(
            "attribute", _deform_pads, "pad symmetrically (pad the input with a Pad node first for the difference)"),
        ("LSTM", "`input_forget` attribute must be 0"): Rule("attribute", _attr_equals("input_forget", 0, 0),
                                                             "export without coupled input-forget gates"),
        ("LSTM", "`layout` attribute must be 0"): Rule("attribute", _attr_equals("layout", 0, 0),
                                                       "export sequence-first (batch_first=False) or transpose around "
                                                       "the LSTM"),
        ("ScatterND", "`reduction` is not supported"): Rule("attribute", _scatter_reduction,
                                                            "scatter without a reduction (reduction='none')"),
        ("TopK", "`sorted` must be 1"): Rule("attribute", _attr_equals("sorted", 1, 1), "ask for sorted results "
                                             "(sorted=True)"),
        ("TopK", "`K` input must be less than 3840"): Rule("limit", _topk_limit, "take K below 3840 (split the "
                                                           "selection, or select in two stages)"),
        ("EyeLike", "`input` must have static dimensions"): Rule("static-shape", _static_input, _STATIC),
        ("ReverseSequence", "Dynamic input shapes are unsupported"): Rule("static-shape", _static_input, _STATIC),
        ("Hardmax", "`axis` dimension of input must be a build-time constant"): Rule("static-shape", _static_axis,
                                                                                    _STATIC),
        ("Resize", "Supported resize transformation modes: `half_pixel`, `pytorch_half_pixel`, `tf_half_pixel_for_nn`, "
                   "`asymmetric`, and `align_corners`"): Rule(
            "mode", _attr_in("coordinate_transformation_mode", _RESIZE_CTM, "half_pixel"),
            "use one of the listed coordinate modes (crop with a Slice, then resize)"),
        ("Resize", "Supported resize modes: `nearest`, `linear`"): Rule(
            "mode", _attr_in("mode", ("nearest", "linear"), "nearest"), "resize with mode nearest or linear"),
        ("Resize", "Supported nearest modes: `floor`, `ceil`, `round_prefer_floor`, `round_prefer_ceil`"): Rule(
            "mode", _attr_in("nearest_mode", _RESIZE_NEAREST, "round_prefer_floor",
                             when=lambda n: attr(n, "mode", "nearest") == "nearest"),
            "use one of the listed nearest modes"),
        ("Resize", "Supported aspect ratio policy: `stretch`"): Rule(
            "mode", _attr_in("keep_aspect_ratio_policy", ("stretch",), "stretch"), "give the output size explicitly "
            "(keep_aspect_ratio_policy='stretch')"),
        ("Resize", "When `scales` is a tensor input, `axes` must be an iota vector of length rank(input)"): Rule(
            "attribute", _resize_axes_iota, "give scales for every axis (axes 0..rank-1, 1.0 where unchanged)"),
        ("Resize", "Antialiasing is not supported"): Rule("attribute", _attr_equals("antialias", 0, 0),
                                                         "resize without antialiasing (antialias=0)"),
        ("Einsum", "Ellipsis and diagonal operations are not supported"): Rule(
            "attribute", _einsum_ellipsis_diagonal, "write the contraction with explicit indices and no repeated "
            "index (or as MatMul/Transpose), or target TensorRT 10"),
        ("Einsum", "Broadcasting between inputs is not supported"): Rule(
            "attribute", _einsum_broadcast, "expand the inputs to the same sizes first, or target TensorRT 10"),
        ("If", "Output tensors of the two conditional branches must have broadcastable shapes, and must have different "
               "names"): Rule("subgraph", lambda n, g: _if_names(n, g) or _if_broadcastable(n, g),
                              "name the branch outputs differently and make their shapes agree"),
        ("If", "Output tensors of the two conditional branches must have the same rank and must have different names"):
            Rule("subgraph", lambda n, g: _if_names(n, g) or _if_same_rank(n, g),
                 "name the branch outputs differently and give them the same rank"),
        ("Loop", "Scan output length cannot be dynamic"): Rule("subgraph", _loop_scan_length,
                                                               "give the loop a constant trip count"),
        ("Loop", "The shape of Loop carried dependencies must be the same across all loop iterations"): Rule(
            "subgraph", _loop_carried_shapes, "keep each carried value's shape fixed across iterations"),
        ("DequantizeLinear", "`x_zero_point` must be zero"): Rule("qdq", None, ""),
        ("QuantizeLinear", "`y_zero_point` must be 0"): Rule("qdq", None, ""),
    }
    for rnn in ("GRU", "LSTM", "RNN"):
        rules[(rnn, f"For bidirectional {rnn}s, activation functions must be the same for both the forward and "
                    "reverse pass")] = Rule("attribute", _same_directions, "use the same activations in both "
                                            "directions (or two unidirectional layers)")
    for rnd in ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"):
        rules[(rnd, "`seed` value is ignored by TensorRT")] = Rule(
            "ignored", _seed, "expect different random values on the device than in ONNX Runtime", severity="warning")
    for red in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
                "ReduceProd", "ReduceSum", "ReduceSumSquare"):
        rules[(red, "`axes` must be an initializer")] = Rule("constant-input", _constant_input(red, "axes"), _FOLD)
    return rules


RULES = _rules()
# TopK's K when it is not a constant on a table with the 3840 limit: a warning (it cannot be checked)
TOPK_K_UNKNOWN = Rule("limit", _topk_k_known, "make K a constant (or check that it stays below 3840)",
                      severity="warning")


def sentences(restrictions: str) -> list[str]:
    """A restriction cell as its sentences, each as written (a trailing period kept)."""
    parts = re.split(r"<br\s*/>|(?<=\.)\s+(?=[A-Z`])", restrictions or "")
    return [p.strip() for p in parts if p.strip()]


def rule_for(op: str, sentence: str) -> Rule | None:
    return RULES.get((op, sentence.strip().rstrip(".").strip()))
