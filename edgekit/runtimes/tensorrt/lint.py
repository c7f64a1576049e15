"""An offline TensorRT compatibility check of an ONNX graph for a target.

``lint_onnx(path, target)`` checks, without TensorRT:

- operators, opset and data types against onnx-tensorrt's support table of the TensorRT
  version the target's JetPack pins (``data/onnx_tensorrt_operators.json``: 8.5, 8.6, 10.0,
  10.1; a version is checked against the newest table at or below it), including the
  inputs its "Restrictions" column says must be initializers or build-time constants;
- Q/DQ: zero points must be 0 and types signed (int8; fp8 and int4 from TensorRT 10);
  int32 DequantizeLinear (quantized biases) is not imported; blocked int4
  DequantizeLinear needs TensorRT 10 (JetPack 6.1+);
- dynamic input axes without an optimization profile;
- for a DLA core, the layers that will fall back to the GPU, by the layer rules of
  TensorRT's ``NvInfer.h`` and NVIDIA's "DLA Supported Layers and Restrictions" page
  (see ``data/README.md``).

Each ``Finding`` names the node, says why, and what to do. Severity ``error``: the build or
the engine would fail on the device; ``warning``: it builds, but not as asked (a layer
falls back from the DLA to the GPU, a dynamic axis gets a default profile).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from edgekit.artifact import is_artifact, read_manifest
from edgekit.errors import BadInputError, bad_choice
from edgekit.sources.onnx_file import read_onnx
from edgekit.targets import Target, list_targets, load_target

TABLE_FILE = Path(__file__).parent / "data" / "onnx_tensorrt_operators.json"
# JetPack -> the TensorRT it ships, for target files that name JetPack but no TensorRT range.
JETPACK_TENSORRT = {"5.1": "8.5", "6.0": "8.6", "6.1": "10.3", "6.2": "10.3"}
DLA_RULES_SOURCE = ("TensorRT include/NvInfer.h (TensorRT 10.9 OSS) and NVIDIA's 'DLA Supported Layers and "
                    "Restrictions'")
_TABLE_TYPE: dict[int, str] = {TensorProto.FLOAT: "FLOAT32", TensorProto.FLOAT16: "FLOAT16", TensorProto.BFLOAT16: "BFLOAT16",
               TensorProto.DOUBLE: "DOUBLE", TensorProto.INT8: "INT8", TensorProto.UINT8: "UINT8",
               TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.BOOL: "BOOL",
               TensorProto.INT4: "INT4", TensorProto.UINT4: "UINT4", TensorProto.FLOAT8E4M3FN: "FP8",
               TensorProto.INT16: "INT16", TensorProto.UINT16: "UINT16", TensorProto.UINT32: "UINT32",
               TensorProto.UINT64: "UINT64", TensorProto.STRING: "STRING", TensorProto.COMPLEX64: "COMPLEX64"}
_CONST_PHRASES = re.compile(r"`([A-Za-z_]+)`[^`|]*?must be (?:an initializer|a build-time constant|a constant tensor)")


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    check: str  # operator | opset | dtype | constant-input | qdq | int4 | dynamic-shape | dla
    node: str
    op_type: str
    why: str
    fix: str

    def line(self) -> str:
        return f"{self.severity}: {self.op_type} {self.node!r}: {self.why}; {self.fix}"


@dataclass
class LintReport:
    model: str
    target: str
    tensorrt_version: str
    table: str  # the onnx-tensorrt table used, e.g. "10.1 (onnx-tensorrt 10.1-GA)"
    opset: int
    dla_core: int | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def exit_code(self) -> int:
        """0 clean (warnings allowed), 1 findings that would fail on the device."""
        return 1 if self.errors else 0

    def summary(self) -> str:
        verdict = ("would fail on the device" if self.errors else "passes")
        return (f"TensorRT {self.tensorrt_version} check of {self.model} for {self.target} "
                f"(onnx-tensorrt table {self.table}): {verdict}: {len(self.errors)} errors, "
                f"{len(self.warnings)} warnings")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "tensorrt_version": self.tensorrt_version,
                "table": self.table, "opset": self.opset, "dla_core": self.dla_core, "exit_code": self.exit_code,
                "summary": self.summary(), "findings": [asdict(f) for f in self.findings]}


# --- which TensorRT, which table ------------------------------------------------------------

def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


@lru_cache(maxsize=1)
def operator_tables() -> dict[str, Any]:
    return json.loads(TABLE_FILE.read_text())["versions"]


def tensorrt_version_of(target: Target, override: str | None = None) -> str:
    """The TensorRT version to check against: ``override``, else the lower bound of the
    target's ``tensorrt_versions``, else what its JetPack ships."""
    if override:
        if not re.fullmatch(r"\d+(\.\d+){0,2}", override.strip()):
            raise BadInputError(f"bad TensorRT version {override!r} (use e.g. 8.5 or 10.3)")
        return override.strip()
    if target.tensorrt_versions:
        lows = re.findall(r">=?\s*(\d+(?:\.\d+)*)", target.tensorrt_versions)
        eq = re.findall(r"==\s*(\d+(?:\.\d+)*)", target.tensorrt_versions)
        if lows or eq:
            return (lows or eq)[0]
    if target.jetpack:
        jp = ".".join(target.jetpack.split(".")[:2])
        if jp in JETPACK_TENSORRT:
            return JETPACK_TENSORRT[jp]
    raise BadInputError(f"target {target.name!r} names no TensorRT version (tensorrt_versions) or known JetPack "
                        f"({', '.join(JETPACK_TENSORRT)}); give one with --tensorrt")


def table_for(version: str) -> tuple[str, dict[str, Any]]:
    """The newest table at or below ``version`` (the oldest one when it is older than all)."""
    tables = operator_tables()
    known = sorted(tables, key=_vtuple)
    below = [k for k in known if _vtuple(k) <= _vtuple(version)]
    if not below:
        raise BadInputError(f"TensorRT {version} is older than every shipped operator table "
                            f"({', '.join(known)}); edgekit checks TensorRT 8.5 and newer")
    key = below[-1]
    return key, tables[key]


# --- the graph ------------------------------------------------------------------------------

class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.inits = {i.name: i for i in g.initializer}
        self.const_nodes = {n.output[0]: n for n in g.node if n.op_type == "Constant"}
        self.producer = {o: n for n in g.node for o in n.output}
        self.types: dict[str, int] = {}
        self.shapes: dict[str, list[int | None]] = {}
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError):
            inferred = model  # checks that need types or shapes skip what they cannot see
        for vi in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            tt = vi.type.tensor_type
            self.types[vi.name] = tt.elem_type
            if tt.HasField("shape"):
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                                        for d in tt.shape.dim]
        for name, init in self.inits.items():
            self.types[name] = init.data_type
            self.shapes[name] = list(init.dims)

    def is_const(self, name: str) -> bool:
        """An initializer, a Constant, or a DequantizeLinear of one (what TensorRT folds)."""
        if name in self.inits or name in self.const_nodes:
            return True
        p = self.producer.get(name)
        return p is not None and p.op_type in ("DequantizeLinear", "Identity", "Cast") and bool(p.input) \
            and self.is_const(p.input[0])

    def value(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            init = self.inits[name]
            if init.data_location == TensorProto.EXTERNAL:
                return None
            return numpy_helper.to_array(init)
        if name in self.const_nodes:
            a = self.const_nodes[name].attribute[0]
            return numpy_helper.to_array(a.t) if a.name == "value" else None
        return None

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return len(s) if s is not None else None


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


# --- the checks -----------------------------------------------------------------------------

def lint_onnx(onnx_path: str | Path, target: Target | str, *, tensorrt_version: str | None = None,
              dla_core: int | None = None, shapes: dict[str, dict[str, list[int]]] | None = None,
              precision: str | None = None) -> LintReport:
    """Check ``onnx_path`` against the TensorRT of ``target`` (see the module doc).

    ``shapes``: the optimization profile the build will use (input -> min/opt/max); None
    when none is known yet. ``dla_core``: check DLA fallbacks for that core.

    >>> lint_onnx("model.onnx", "jetson-agx-orin-64").exit_code  # doctest: +SKIP
    0
    """
    target = load_target(target) if isinstance(target, str) else target
    path = Path(onnx_path)
    if not path.is_file():
        raise BadInputError(f"ONNX file {str(path)!r} does not exist")
    model = read_onnx(path)  # the loader build uses: validated, external data inside the folder, input sizes bounded
    if dla_core is not None:
        cores = int(target.dla_cores or 0)
        if not 0 <= dla_core < max(cores, 1) or cores == 0:
            raise BadInputError(f"target {target.name!r} has {cores} DLA cores; DLA core {dla_core} does not exist"
                                + (f" (choose from {', '.join(str(i) for i in range(cores))})" if cores else ""))
    version = tensorrt_version_of(target, tensorrt_version)
    key, table = table_for(version)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    report = LintReport(model=str(path), target=target.name, tensorrt_version=version,
                        table=f"{key} (onnx-tensorrt {table['branch']})", opset=opset, dla_core=dla_core)
    g = _Graph(model)
    where = f"onnx-tensorrt's {key} table" + ("" if key == version else f" (the newest at or below {version})")
    _check_opset(report, opset, table, where)
    _check_io_types(report, g, table, where, version)
    functions = {(f.domain, f.name) for f in model.functions}
    for i, node in enumerate(model.graph.node):
        _check_node(report, g, node, _name(node, i), table, where, functions, version)
    _check_dynamic(report, g, shapes, dla_core is not None)
    if dla_core is not None:
        if precision is not None and precision not in ("fp16", "int8", "best"):
            report.findings.append(Finding("error", "dla", "-", "network", f"the DLA runs fp16 or int8, not {precision}",
                                           "build with --precision fp16 or int8"))
        for i, node in enumerate(model.graph.node):
            why = dla_fallback_reason(node, g)
            if why:
                report.findings.append(Finding(
                    "warning", "dla", _name(node, i), node.op_type, f"falls back from DLA core {dla_core} to the GPU: "
                    f"{why} (rules: {DLA_RULES_SOURCE})",
                    "keep GPU fallback on (edgekit's default), or change the layer so the DLA takes it"))
    return report


def _check_opset(report: LintReport, opset: int, table: dict[str, Any], where: str) -> None:
    hi, lo = table["opset_max"], table["opset_min"]
    if opset > hi:
        report.findings.append(Finding("error", "opset", "-", "model", f"opset {opset} is above {hi}, the highest in "
                                       f"{where}", f"re-export with opset {hi} or lower (edgekit export --opset {hi})"))
    elif lo is not None and opset < lo:
        report.findings.append(Finding("error", "opset", "-", "model", f"opset {opset} is below {lo}, the lowest in "
                                       f"{where}", f"re-export with opset {lo} or higher"))


def _type_ok(t: int, table: dict[str, Any]) -> bool:
    name = _TABLE_TYPE.get(t, str(t))
    return name in table["data_types"] or name in table["limited_types"]


def _check_io_types(report: LintReport, g: _Graph, table: dict[str, Any], where: str, version: str) -> None:
    for vi in [*g.model.graph.input, *g.model.graph.output]:
        if vi.name in g.inits:
            continue
        t = vi.type.tensor_type.elem_type
        if not _type_ok(t, table):
            name = _TABLE_TYPE.get(t, str(t))
            report.findings.append(Finding("error", "dtype", vi.name, "graph input/output",
                                           f"type {name} is not among the data types of {where}",
                                           "cast it to a supported type in the model (FLOAT32, FLOAT16, INT32, ...)"
                                           + (" or target TensorRT 10 (JetPack 6.1+)" if _vtuple(version) < (10,)
                                              and name in ("UINT8", "BFLOAT16") else "")))


def _const_inputs(op: str, restrictions: str) -> list[int]:
    """Input indices that the table's restriction text says must be constants."""
    names = _CONST_PHRASES.findall(restrictions)
    if not names:
        return []
    try:
        schema = onnx.defs.get_schema(op)
    except onnx.defs.SchemaError:
        return []
    formal = [i.name for i in schema.inputs]
    return [formal.index(n) for n in names if n in formal]


def _check_node(report: LintReport, g: _Graph, node: onnx.NodeProto, name: str, table: dict[str, Any], where: str,
                functions: set[tuple[str, str]], version: str) -> None:
    op = node.op_type
    if (node.domain, op) in functions:
        return  # a model-local function: the parser inlines it, its body ops are what matter
    if node.domain not in ("", "ai.onnx"):
        report.findings.append(Finding("error", "operator", name, f"{node.domain}::{op}",
                                       f"a {node.domain} op, not standard ONNX: TensorRT has no importer for it",
                                       "export without runtime-specific contrib ops, or provide a TensorRT plugin"))
        return
    entry = table["operators"].get(op)
    if entry is None or not entry["supported"]:
        state = "not in" if entry is None else "marked unsupported in"
        report.findings.append(Finding("error", "operator", name, op, f"{op} is {state} {where}",
                                       _operator_fix(op, version)))
        return
    if entry.get("experimental"):
        report.findings.append(Finding("warning", "operator", name, op, f"{op} is experimental in {where}",
                                       "check the engine's outputs against ONNX Runtime on the device"))
    for idx in _const_inputs(op, entry.get("restrictions", "")):
        if idx < len(node.input) and node.input[idx] and not g.is_const(node.input[idx]):
            report.findings.append(Finding("error", "constant-input", name, op,
                                           f"input {node.input[idx]!r} is computed at run time; {where} says: "
                                           f"{entry['restrictions'].strip()}",
                                           "make it a constant (fold it with onnxsim / constant folding before "
                                           "export) or re-export with static shapes"))
    if op in ("QuantizeLinear", "DequantizeLinear"):
        _check_qdq(report, g, node, name, version)


def _operator_fix(op: str, version: str) -> str:
    if op in ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"):
        return "quantize with Q/DQ instead (edgekit compress --bits 8 writes QuantizeLinear/DequantizeLinear)"
    if op in ("LayerNormalization", "GroupNormalization", "Gelu") and _vtuple(version) < (10,):
        return f"re-export with opset 16 or lower so the exporter decomposes {op}, or target TensorRT 10 (JetPack 6.1+)"
    return ("replace it in the model, re-export so the exporter decomposes it, or provide a TensorRT plugin"
            + (", or target TensorRT 10 (JetPack 6.1+)" if _vtuple(version) < (10,) else ""))


def _check_qdq(report: LintReport, g: _Graph, node: onnx.NodeProto, name: str, version: str) -> None:
    op = node.op_type
    trt10 = _vtuple(version) >= (10,)
    block = _attr(node, "block_size", 0)
    data_t = g.types.get(node.input[0]) if op == "DequantizeLinear" else None
    zp_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    zp_t = g.types.get(zp_name) if zp_name else (TensorProto.UINT8 if op == "QuantizeLinear" else data_t)
    four_bit = bool(block) or data_t in (TensorProto.INT4, TensorProto.UINT4)
    if four_bit and not trt10:
        report.findings.append(Finding(
            "error", "int4", name, op, f"blocked 4-bit DequantizeLinear (block_size {block or '-'}) needs TensorRT 10; "
            f"TensorRT {version} (JetPack 5.1 / 6.0) imports int8 DequantizeLinear only",
            "keep int8 weights for this target (edgekit compress --bits 8), or target JetPack 6.1+ (TensorRT 10.3)"))
        return
    if op == "DequantizeLinear" and data_t == TensorProto.INT32:
        report.findings.append(Finding(
            "error", "qdq", name, op, "int32 DequantizeLinear (a quantized bias) is not imported by TensorRT",
            "fold it to a float constant (edgekit build does so when it converts the graph)"))
        return
    if zp_t in (TensorProto.UINT8, TensorProto.UINT4):
        report.findings.append(Finding(
            "error", "qdq", name, op, f"{'uint4' if zp_t == TensorProto.UINT4 else 'uint8'} quantization; TensorRT's "
            "explicit quantization takes signed types with a zero point of 0",
            "build with edgekit build (it converts uint8/asymmetric Q/DQ to signed symmetric int8 and records the "
            "accuracy cost), or re-quantize for the target (edgekit compress --target ...)"))
        return
    if zp_name:
        zp = g.value(zp_name)
        if zp is not None and np.any(zp):
            report.findings.append(Finding(
                "error", "qdq", name, op, f"zero point {int(np.max(np.abs(zp)))} (non-zero): TensorRT requires "
                "symmetric quantization (zero point 0)",
                "build with edgekit build (it converts the ranges to symmetric scales), or re-quantize symmetric"))
            return
    allowed = {TensorProto.INT8, TensorProto.FLOAT8E4M3FN, TensorProto.INT4} if trt10 else {TensorProto.INT8}
    if zp_t is not None and zp_t not in allowed and zp_t != 0:
        report.findings.append(Finding(
            "error", "qdq", name, op, f"{_TABLE_TYPE.get(zp_t, zp_t)} quantization is not imported by TensorRT {version}",
            "quantize to int8"))


def _check_dynamic(report: LintReport, g: _Graph, shapes: dict[str, dict[str, list[int]]] | None, dla: bool) -> None:
    for vi in g.model.graph.input:
        if vi.name in g.inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        dynamic = [i for i, d in enumerate(dims) if not (d.HasField("dim_value") and d.dim_value > 0)]
        if not dynamic:
            continue
        profile = (shapes or {}).get(vi.name)
        names = ", ".join(f"axis {i} ({dims[i].dim_param or '?'})" for i in dynamic)
        if profile is None:
            others = [i for i in dynamic if i != 0]
            report.findings.append(Finding(
                "error" if others else "warning", "dynamic-shape", vi.name, "graph input",
                f"dynamic {names} and no optimization profile: TensorRT needs min/opt/max shapes for it",
                "edgekit build adds one for a dynamic batch (min 1, opt --batch, max --max-batch)" if not others else
                "export with static shapes, or give the sizes (BuildOptions.extra dims or min/opt/max shapes)"))
        elif dla and profile["min"] != profile["max"]:
            report.findings.append(Finding(
                "warning", "dla", vi.name, "graph input", f"optimization profile {profile['min']}..{profile['max']}: "
                "the DLA takes no dynamic dimensions (min, opt and max must be equal), so the network runs on the GPU",
                "build with a fixed batch (--max-batch equal to --batch)"))


# --- DLA ------------------------------------------------------------------------------------

_DLA_ACTIVATIONS = {"Relu", "Sigmoid", "Tanh", "Clip", "LeakyRelu"}
_DLA_ELEMENTWISE = {"Add", "Sub", "Mul", "Max", "Min", "Div", "Pow", "Sum"}
_SHAPE_OPS = {"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout",
              "QuantizeLinear", "DequantizeLinear", "Constant", "BatchNormalization", "Shape", "Cast"}
_OTHER_ACTIVATIONS = {"HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus", "Softsign", "Mish", "Gelu",
                      "ThresholdedRelu", "Celu"}
_UNARY = {"Exp", "Log", "Sqrt", "Neg", "Sin", "Cos", "Tan", "Reciprocal", "Floor", "Ceil", "Erf", "Not", "Sign",
          "Round", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"}


def _in_range(values: list[int], lo: int, hi: int) -> bool:
    return all(lo <= int(v) <= hi for v in values)


def dla_fallback_reason(node: onnx.NodeProto, g: _Graph) -> str | None:
    """Why this node's layer cannot run on the DLA (None: the rules allow it)."""
    op = node.op_type
    rank = g.rank(node.input[0]) if node.input else None
    if op in _SHAPE_OPS:
        return None
    if op in ("Conv", "ConvTranspose"):
        w = g.shapes.get(node.input[1]) if len(node.input) > 1 else None
        kernel = list(_attr(node, "kernel_shape", None) or (w[2:] if w else []))
        if len(kernel) != 2:
            return "only 2D convolutions run on the DLA"
        strides = list(_attr(node, "strides", None) or [1, 1])
        pads = list(_attr(node, "pads", None) or [0, 0, 0, 0])
        dil = list(_attr(node, "dilations", None) or [1, 1])
        group = int(_attr(node, "group", 1))
        if op == "ConvTranspose":
            if group != 1:
                return f"a grouped deconvolution (group {group}); the DLA needs 1 group"
            if any(pads) or any(d != 1 for d in dil):
                return "a padded or dilated deconvolution; the DLA needs padding 0 and no dilation"
            if not _in_range(kernel, 1, 32) or not _in_range(strides, 1, 32):
                return f"kernel {kernel} / stride {strides} outside the DLA's [1,32]"
            return None
        if not _in_range(kernel, 1, 32):
            return f"kernel {kernel} outside the DLA's [1,32]"
        if not _in_range(strides, 1, 8):
            return f"stride {strides} outside the DLA's [1,8]"
        if not _in_range(pads, 0, 31) or any(p >= k for p, k in zip(pads, kernel + kernel)):
            return f"padding {pads} outside [0,31] or not below the kernel size {kernel}"
        if not _in_range(dil, 1, 32):
            return f"dilation {dil} outside the DLA's [1,32]"
        if group > 8192 or (w is not None and w[0] is not None and w[0] > 8192):
            return "more than 8192 groups or output maps"
        return None
    if op in _DLA_ACTIVATIONS:
        return None if rank is None or rank <= 4 else "the DLA runs activations on 2D (4D NCHW) tensors only"
    if op in _OTHER_ACTIVATIONS:
        return f"{op}: the DLA's activations are ReLU, Sigmoid, TanH, Clip and Leaky ReLU"
    if op == "PRelu":
        return None if len(node.input) > 1 and g.is_const(node.input[1]) else "the slope is not a build-time constant"
    if op in ("MaxPool", "AveragePool"):
        kernel = list(_attr(node, "kernel_shape", []))
        if len(kernel) != 2:
            return "only 2D pooling runs on the DLA"
        if not _in_range(kernel, 1, 8):
            return f"pooling window {kernel} outside the DLA's [1,8]"
        if not _in_range(list(_attr(node, "strides", None) or [1, 1]), 1, 16):
            return "pooling stride outside the DLA's [1,16]"
        if not _in_range(list(_attr(node, "pads", None) or [0, 0, 0, 0]), 0, 7):
            return "pooling padding outside the DLA's [0,7]"
        return None
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        s = g.shapes.get(node.input[0])
        if s is None or len(s) != 4 or s[2] is None or s[3] is None:
            return None
        return None if _in_range([s[2], s[3]], 1, 8) else f"a global pooling window {s[2]}x{s[3]} exceeds the DLA's [1,8]"
    if op in _DLA_ELEMENTWISE:
        return None if rank is None or rank <= 4 else "the DLA runs element-wise ops on 2D (4D NCHW) tensors only"
    if op in ("Equal", "Greater", "Less"):
        return None
    if op == "Concat":
        axis = int(_attr(node, "axis", 0))
        if rank is not None and (axis % rank) != rank - 3:
            return f"concatenation on axis {axis}; the DLA concatenates on the channel axis only"
        return None
    if op == "Softmax":
        s = g.shapes.get(node.input[0])
        axis = int(_attr(node, "axis", -1))
        if s is None:
            return None
        ax = axis % len(s)
        if ax == 0:
            return "softmax over the batch axis"
        others = [d for i, d in enumerate(s) if i not in (0, ax)]
        n = s[ax]
        if n is not None and (n > 8192 or (any(d is not None and d > 1 for d in others) and n > 1024)):
            return f"softmax over {n} values exceeds the DLA's limit (8192, or 1024 with other dimensions above 1)"
        return None
    if op == "Abs":
        return None
    if op in _UNARY:
        return f"{op}: the DLA runs only the Abs unary operation"
    if op in ("Gather", "GatherElements", "GatherND"):
        return "gather has no DLA support"
    if op in ("Slice", "Split"):  # the parser makes slice layers of both
        return None if all(g.is_const(i) for i in node.input[1:] if i) else "slice bounds are not build-time constants"
    if op == "Resize":
        mode = _attr(node, "mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        ctm = _attr(node, "coordinate_transformation_mode", b"half_pixel")
        ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
        if len(node.input) > 3 and node.input[3]:
            return "resize to given output sizes (the DLA takes scales only)"
        if mode == "nearest" and ctm not in ("asymmetric", "half_pixel"):
            return f"nearest resize with {ctm!r} coordinates"
        if mode == "linear" and ctm != "half_pixel":
            return f"linear resize with {ctm!r} coordinates (the DLA takes half_pixel)"
        if mode not in ("nearest", "linear"):
            return f"{mode} resize"
        return None
    if op == "LRN":
        return None if int(_attr(node, "size", 0)) in (3, 5, 7, 9) else "LRN window not in {3, 5, 7, 9}"
    if op == "Gemm":
        return None  # a fully connected layer
    return f"{op} is not a layer the DLA runs"


# --- the command ----------------------------------------------------------------------------

def resolve_lint_input(model: str | Path) -> Path:
    """An ONNX file, or an edgekit folder holding one (the graph a TensorRT build used, if any)."""
    p = Path(model)
    if p.is_file():
        if p.suffix != ".onnx":
            raise BadInputError(f"{p} is not an .onnx file (lint takes an ONNX file or an edgekit folder holding one)")
        return p
    if p.is_dir() and is_artifact(p):
        m = read_manifest(p)
        for role in ("onnx_tensorrt", "onnx"):
            if role in m.files:
                return m.path_of(p, role)
        raise BadInputError(f"{p} holds a {m.kind!r} artifact without an ONNX graph; export it first "
                            f"(edgekit export {p} -o ONNX_DIR)")
    raise BadInputError(f"{str(p)!r} is neither an ONNX file nor an edgekit folder (export the model first: "
                        "edgekit export MODEL -o ONNX_DIR)")


def lint_model(model: str | Path, target: str | Target, *, tensorrt_version: str | None = None,
               dla_core: int | None = None, precision: str | None = None) -> LintReport:
    """``edgekit lint``: check an ONNX file or edgekit folder against a TensorRT target."""
    t = load_target(target) if isinstance(target, str) else target
    if "tensorrt" not in t.runtimes:
        raise bad_choice("target for a TensorRT check (it lists the tensorrt runtime)", t.name,
                         [n for n in _tensorrt_targets()])
    return lint_onnx(resolve_lint_input(model), t, tensorrt_version=tensorrt_version, dla_core=dla_core,
                     precision=precision)


def _tensorrt_targets() -> list[str]:
    return [name for name in list_targets() if "tensorrt" in load_target(name).runtimes]
