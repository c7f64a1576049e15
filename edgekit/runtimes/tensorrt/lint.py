"""An offline TensorRT compatibility check of an ONNX graph for a target.

``lint_onnx(path, target)`` checks, without TensorRT:

- operators, opset and data types against onnx-tensorrt's support table of the TensorRT
  version the target's JetPack pins (``data/onnx_tensorrt_operators.json``: 8.5, 8.6, 10.0,
  10.1; a version is checked against the newest table at or below it);
- every sentence of the table's "Restrictions" column (``lint_rules.py``: attribute values,
  modes, outputs, ranks, limits, constant inputs, static shapes, If/Loop bodies) and its
  "Supported Types" column, each finding quoting the table's words and citing the row's
  line in ``docs/operators.md``;
- Q/DQ: zero points must be 0 and types signed (int8; fp8 and int4 from TensorRT 10);
  int32 DequantizeLinear (quantized biases) is not imported; blocked int4 DequantizeLinear
  needs TensorRT 10 and the form its importer takes (one blocked axis of the scale, an even
  last dimension: onnx-tensorrt's ``onnxOpImporters.cpp``);
- dynamic input axes without an optimization profile (``shapes``: the profile the build uses);
- for a DLA core, dynamic dimensions and the layers that will fall back to the GPU, by the
  layer rules of TensorRT's ``NvInfer.h`` and NVIDIA's "DLA Supported Layers and
  Restrictions" page (see ``data/README.md``).

Each ``Finding`` names the node, says why, what to do, and where the rule comes from
(``source``). Severity ``error``: the build or the engine would fail on the device;
``warning``: it builds, but not as asked (a layer falls back from the DLA to the GPU) or a
rule could not be checked offline.
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
from onnx import TensorProto

from edgekit.artifact import is_artifact, read_manifest
from edgekit.errors import BadInputError, bad_choice
from edgekit.runtimes.tensorrt.lint_rules import TOPK_K_UNKNOWN, GraphView, Rule, attr, rule_for, sentences
from edgekit.sources.onnx_file import read_onnx
from edgekit.targets import Target, list_targets, load_target

TABLE_FILE = Path(__file__).parent / "data" / "onnx_tensorrt_operators.json"
TABLE_DOC = "docs/operators.md"
# JetPack -> the TensorRT it ships, for target files that name JetPack but no TensorRT range.
JETPACK_TENSORRT = {"5.1": "8.5", "6.0": "8.6", "6.1": "10.3", "6.2": "10.3"}
DLA_RULES_SOURCE = ("TensorRT include/NvInfer.h (TensorRT 10.9 OSS) and NVIDIA's 'DLA Supported Layers and "
                    "Restrictions'")
# The Q/DQ importer that decides what blocked int4 TensorRT 10 takes (read at onnx-tensorrt 10.1-GA).
QDQ_IMPORTER_SOURCE = "onnx-tensorrt 10.1-GA onnxOpImporters.cpp (QuantizeLinear/DequantizeLinear importer)"
# onnx-tensorrt 10.x sets no maximum opset (ModelImporter.cpp warns only below opset 7).
OPSET_SOURCE = "onnx-tensorrt 10.1-GA ModelImporter.cpp (no maximum opset is enforced)"
# ONNX opset 21 changed these operators only by adding types (int4/uint4, float8; Q/DQ also
# block_size and output_dtype): a graph at opset 21 means at them what it means at opset 20.
# GroupNormalization-21 changed its scale and bias to per-channel (onnx-tensorrt: 10.9 changelog).
OPSET21_TYPE_ONLY = {"Cast", "CastLike", "Constant", "ConstantOfShape", "DequantizeLinear", "Flatten", "Identity",
                     "If", "Loop", "Pad", "QLinearMatMul", "QuantizeLinear", "Reshape", "Scan", "Shape", "Size",
                     "Squeeze", "Transpose", "Unsqueeze"}
_TABLE_TYPE: dict[int, str] = {TensorProto.FLOAT: "FLOAT32", TensorProto.FLOAT16: "FLOAT16", TensorProto.BFLOAT16: "BFLOAT16",
               TensorProto.DOUBLE: "DOUBLE", TensorProto.INT8: "INT8", TensorProto.UINT8: "UINT8",
               TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.BOOL: "BOOL",
               TensorProto.INT4: "INT4", TensorProto.UINT4: "UINT4", TensorProto.FLOAT8E4M3FN: "FP8",
               TensorProto.INT16: "INT16", TensorProto.UINT16: "UINT16", TensorProto.UINT32: "UINT32",
               TensorProto.UINT64: "UINT64", TensorProto.STRING: "STRING", TensorProto.COMPLEX64: "COMPLEX64"}
# The names of the "Supported Types" column.
_COLUMN_TYPE: dict[int, str] = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
                                TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.INT8: "INT8",
                                TensorProto.UINT8: "UINT8", TensorProto.BOOL: "BOOL",
                                TensorProto.FLOAT8E4M3FN: "FP8", TensorProto.INT4: "INT4"}
# Ops whose first input is not the data the "Supported Types" column describes (a condition,
# a trip count, a shape, indices), or whose types the Q/DQ rules check.
_TYPES_SKIP = {"If", "Loop", "Scan", "ConstantOfShape", "OneHot", "Shape", "Size", "Cast", "CastLike",
               "QuantizeLinear", "DequantizeLinear", "Constant", "Identity", "NonZero", "Range", "EyeLike",
               "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike"}


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    # operator | opset | dtype | type | attribute | mode | output | rank | limit | constant-input |
    # static-shape | subgraph | ignored | qdq | int4 | dynamic-shape | dla
    check: str
    node: str
    op_type: str
    why: str
    fix: str
    source: str = ""  # where the rule comes from: a table row (file:line at a branch), a header, a source file

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
    shapes: dict[str, dict[str, list[int]]] | None = None  # the optimization profile checked against

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
                "table": self.table, "opset": self.opset, "dla_core": self.dla_core, "shapes": self.shapes,
                "exit_code": self.exit_code, "summary": self.summary(), "findings": [asdict(f) for f in self.findings]}


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


def table_source(table: dict[str, Any], line: int | None) -> str:
    """``onnx-tensorrt 10.1-GA docs/operators.md:207``: where a rule of a table comes from."""
    return f"onnx-tensorrt {table['branch']} {TABLE_DOC}" + (f":{line}" if line else "")


# --- the checks -----------------------------------------------------------------------------

def _name(node: onnx.NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


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
    if shapes:
        shapes = _checked_profile(model, shapes)
    report = LintReport(model=str(path), target=target.name, tensorrt_version=version,
                        table=f"{key} (onnx-tensorrt {table['branch']})", opset=opset, dla_core=dla_core,
                        shapes=shapes or None)
    g = GraphView(model)
    where = f"onnx-tensorrt's {key} table" + ("" if key == version else f" (the newest at or below {version})")
    _check_opset(report, model, opset, table, where, version)
    _check_io_types(report, g, table, where, version)
    functions = {(f.domain, f.name) for f in model.functions}
    for i, node in enumerate(model.graph.node):
        _check_node(report, g, node, _name(node, i), table, where, functions, version)
    _check_dynamic(report, g, shapes, dla_core)
    if dla_core is not None:
        if precision is not None and precision not in ("fp16", "int8", "best"):
            report.findings.append(Finding("error", "dla", "-", "network", f"the DLA runs fp16 or int8, not {precision}",
                                           "build with --precision fp16 or int8", DLA_RULES_SOURCE))
        for i, node in enumerate(model.graph.node):
            why = dla_fallback_reason(node, g)
            if why:
                report.findings.append(Finding(
                    "warning", "dla", _name(node, i), node.op_type, f"falls back from DLA core {dla_core} to the GPU: "
                    f"{why} (rules: {DLA_RULES_SOURCE})",
                    "keep GPU fallback on (edgekit's default), or change the layer so the DLA takes it", DLA_RULES_SOURCE))
    return report


def _checked_profile(model: onnx.ModelProto, shapes: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, list[int]]]:
    """The profile against the graph's inputs: known names, the right rank, static dims kept,
    min <= opt <= max; anything else is bad input naming the input."""
    inits = {i.name for i in model.graph.initializer}
    inputs = {vi.name: vi for vi in model.graph.input if vi.name not in inits}
    out = {}
    for name, prof in shapes.items():
        if name not in inputs:
            raise BadInputError(f"--shapes names input {name!r}, which the model does not have (inputs: "
                                f"{', '.join(inputs) or 'none'})")
        dims = inputs[name].type.tensor_type.shape.dim
        for which in ("min", "opt", "max"):
            got = list(prof[which])
            if len(got) != len(dims):
                raise BadInputError(f"--shapes gives input {name!r} {len(got)} dimensions ({'x'.join(map(str, got))}); "
                                    f"it has {len(dims)}")
            for axis, (d, v) in enumerate(zip(dims, got)):
                if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != v:
                    raise BadInputError(f"--shapes gives input {name!r} axis {axis} size {v}; the model fixes it at "
                                        f"{d.dim_value}")
        if any(lo > hi for lo, hi in zip(prof["min"], prof["max"])) or \
                any(not lo <= o <= hi for lo, o, hi in zip(prof["min"], prof["opt"], prof["max"])):
            raise BadInputError(f"the profile of input {name!r} is not min <= opt <= max: {prof}")
        out[name] = {k: [int(x) for x in prof[k]] for k in ("min", "opt", "max")}
    return out


def _check_opset(report: LintReport, model: onnx.ModelProto, opset: int, table: dict[str, Any], where: str,
                 version: str) -> None:
    hi, lo = table["opset_max"], table["opset_min"]
    source = table_source(table, table.get("opset_line"))
    if opset > hi:
        changed = _changed_since(model, hi, opset)
        if opset == 21 and hi == 20 and _vtuple(version) >= (10,) and changed <= OPSET21_TYPE_ONLY:
            report.findings.append(Finding(
                "warning", "opset", "-", "model",
                f"opset 21 is above 20, the highest in {where}; opset 21 changed "
                + (", ".join(sorted(changed)) if changed else "none of this graph's operators")
                + " only by adding types (int4/uint4, float8; Q/DQ also block_size); onnx-tensorrt 10.x sets no "
                "maximum opset, so its parser takes the graph as at opset 20 (the first table read here that lists "
                "opset 21 is TensorRT 10.15's; not verified on a device)",
                "check the engine on the device (build.sh), or export at opset 20 where no 4-bit type is needed",
                f"{source}; {OPSET_SOURCE}"))
            return
        extra = ("" if not changed else f" ({', '.join(sorted(changed - OPSET21_TYPE_ONLY) or sorted(changed))} "
                 f"changed after opset {hi})")
        report.findings.append(Finding("error", "opset", "-", "model", f"opset {opset} is above {hi}, the highest in "
                                       f"{where}{extra}", f"re-export with opset {hi} or lower (edgekit export "
                                       f"--opset {hi})", source))
    elif lo is not None and opset < lo:
        report.findings.append(Finding("error", "opset", "-", "model", f"opset {opset} is below {lo}, the lowest in "
                                       f"{where}", f"re-export with opset {lo} or higher", source))


def _changed_since(model: onnx.ModelProto, old: int, new: int) -> set[str]:
    """The graph's standard operators whose definition changed between opset ``old`` and ``new``."""
    out = set()
    for op in {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}:
        try:
            a = onnx.defs.get_schema(op, max_inclusive_version=new).since_version
            b = onnx.defs.get_schema(op, max_inclusive_version=old).since_version
        except onnx.defs.SchemaError:
            continue
        if a != b:
            out.add(op)
    return out


def _type_ok(t: int, table: dict[str, Any]) -> bool:
    name = _TABLE_TYPE.get(t, str(t))
    return name in table["data_types"] or name in table["limited_types"]


def _check_io_types(report: LintReport, g: GraphView, table: dict[str, Any], where: str, version: str) -> None:
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
                                              and name in ("UINT8", "BFLOAT16") else ""),
                                           table_source(table, table.get("data_types_line"))))


def _check_node(report: LintReport, g: GraphView, node: onnx.NodeProto, name: str, table: dict[str, Any], where: str,
                functions: set[tuple[str, str]], version: str) -> None:
    op = node.op_type
    if (node.domain, op) in functions:
        return  # a model-local function: the parser inlines it, its body ops are what matter
    if node.domain not in ("", "ai.onnx"):
        report.findings.append(Finding("error", "operator", name, f"{node.domain}::{op}",
                                       f"a {node.domain} op, not standard ONNX: TensorRT has no importer for it",
                                       "export without runtime-specific contrib ops, or provide a TensorRT plugin",
                                       table_source(table, None)))
        return
    entry = table["operators"].get(op)
    source = table_source(table, entry.get("line") if entry else None)
    if entry is None or not entry["supported"]:
        state = "not in" if entry is None else "marked unsupported in"
        report.findings.append(Finding("error", "operator", name, op, f"{op} is {state} {where}",
                                       _operator_fix(op, version), source))
        return
    if entry.get("experimental"):
        report.findings.append(Finding("warning", "operator", name, op, f"{op} is experimental in {where}",
                                       "check the engine's outputs against ONNX Runtime on the device", source))
    _check_types(report, g, node, name, entry, where, source, version)
    for sentence in sentences(entry.get("restrictions", "")):
        rule = rule_for(op, sentence)
        if rule is None:  # a table sentence without a rule (a test keeps the shipped tables covered)
            report.findings.append(Finding("warning", "unchecked", name, op, f"{where} says \"{sentence}\", which "
                                           "edgekit does not check", "check it by hand", source))
            continue
        _apply(report, rule, g, node, name, sentence, where, source)
        if op == "TopK" and "3840" in sentence:
            _apply(report, TOPK_K_UNKNOWN, g, node, name, sentence, where, source)
    if op in ("QuantizeLinear", "DequantizeLinear"):
        _check_qdq(report, g, node, name, version, table)


def _apply(report: LintReport, rule: Rule, g: GraphView, node: onnx.NodeProto, name: str, sentence: str, where: str,
           source: str) -> None:
    if rule.check is None:
        return
    got = rule.check(node, g)
    if got:
        report.findings.append(Finding(rule.severity, rule.family, name, node.op_type,
                                       f"{got}; {where} says: \"{sentence}\"", rule.fix, source))


def _check_types(report: LintReport, g: GraphView, node: onnx.NodeProto, name: str, entry: dict[str, Any], where: str,
                 source: str, version: str) -> None:
    """The "Supported Types" column, read for the tensor the op computes on (its first input)."""
    types = entry.get("types") or []
    if not types or node.op_type in _TYPES_SKIP or not node.input or not node.input[0]:
        return
    t = g.types.get(node.input[0])
    column = _COLUMN_TYPE.get(t) if t else None
    if t == TensorProto.DOUBLE:
        column = "FP32"  # the header: DOUBLE is cast down to FLOAT
    if column == "INT64" and _vtuple(version) < (9,):
        column = "INT32"  # TensorRT 8's header: INT64 is cast down to INT32
    if column is None or column in types:
        return
    report.findings.append(Finding("error", "type", name, node.op_type,
                                   f"input {node.input[0]!r} is {column}; {where} lists {', '.join(types)} for "
                                   f"{node.op_type}", f"compute {node.op_type} in one of {', '.join(types)} (a Cast "
                                   "before it), or keep the op out of the engine", source))


def _operator_fix(op: str, version: str) -> str:
    if op in ("QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"):
        return "quantize with Q/DQ instead (edgekit compress --bits 8 writes QuantizeLinear/DequantizeLinear)"
    if op in ("LayerNormalization", "GroupNormalization", "Gelu") and _vtuple(version) < (10,):
        return f"re-export with opset 16 or lower so the exporter decomposes {op}, or target TensorRT 10 (JetPack 6.1+)"
    return ("replace it in the model, re-export so the exporter decomposes it, or provide a TensorRT plugin"
            + (", or target TensorRT 10 (JetPack 6.1+)" if _vtuple(version) < (10,) else ""))


def _check_qdq(report: LintReport, g: GraphView, node: onnx.NodeProto, name: str, version: str,
               table: dict[str, Any]) -> None:
    op = node.op_type
    trt10 = _vtuple(version) >= (10,)
    entry = table["operators"].get(op, {})
    source = table_source(table, entry.get("line"))
    said = f" (onnx-tensorrt's table: \"{entry.get('restrictions', '').strip()}\")" if entry.get("restrictions") else ""
    block = attr(node, "block_size", 0)
    data_t = g.types.get(node.input[0]) if op == "DequantizeLinear" else None
    zp_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
    zp_t = g.types.get(zp_name) if zp_name else (TensorProto.UINT8 if op == "QuantizeLinear" else data_t)
    four_bit = bool(block) or data_t in (TensorProto.INT4, TensorProto.UINT4)
    if four_bit and not trt10:
        report.findings.append(Finding(
            "error", "int4", name, op, f"blocked 4-bit DequantizeLinear (block_size {block or '-'}) needs TensorRT 10; "
            f"TensorRT {version} (JetPack 5.1 / 6.0) imports int8 DequantizeLinear only",
            "keep int8 weights for this target (edgekit compress --bits 8), or target JetPack 6.1+ (TensorRT 10.3)",
            table_source(table, table.get("data_types_line"))))
        return
    if op == "DequantizeLinear" and data_t == TensorProto.INT32:
        report.findings.append(Finding(
            "error", "qdq", name, op, "int32 DequantizeLinear (a quantized bias) is not imported by TensorRT",
            "fold it to a float constant (edgekit build does so when it converts the graph)", source))
        return
    if zp_t in (TensorProto.UINT8, TensorProto.UINT4):
        report.findings.append(Finding(
            "error", "qdq", name, op, f"{'uint4' if zp_t == TensorProto.UINT4 else 'uint8'} quantization; TensorRT's "
            "explicit quantization takes signed types with a zero point of 0",
            "build with edgekit build (it converts uint8/asymmetric Q/DQ to signed symmetric int8 and records the "
            "accuracy cost), or re-quantize for the target (edgekit compress --target ...)", source))
        return
    if zp_name:
        zp = g.value(zp_name)
        if zp is not None and np.any(zp):
            report.findings.append(Finding(
                "error", "qdq", name, op, f"zero point {int(np.max(np.abs(zp)))} (non-zero): TensorRT requires "
                f"symmetric quantization (zero point 0){said}",
                "build with edgekit build (it converts the ranges to symmetric scales), or re-quantize symmetric",
                source))
            return
    allowed = {TensorProto.INT8, TensorProto.FLOAT8E4M3FN, TensorProto.INT4} if trt10 else {TensorProto.INT8}
    if zp_t is not None and zp_t not in allowed and zp_t != 0:
        report.findings.append(Finding(
            "error", "qdq", name, op, f"{_TABLE_TYPE.get(zp_t, zp_t)} quantization is not imported by TensorRT {version}",
            "quantize to int8", source))
        return
    if four_bit:
        _check_blocked(report, g, node, name)


def _check_blocked(report: LintReport, g: GraphView, node: onnx.NodeProto, name: str) -> None:
    """What TensorRT 10's Q/DQ importer asserts of a blocked (4-bit) DequantizeLinear."""
    raw_data, raw_scale = g.shapes.get(node.input[0]), g.shapes.get(node.input[1]) if len(node.input) > 1 else None
    if raw_data is None or raw_scale is None or None in raw_data or None in raw_scale:
        return  # shapes not known: the importer's checks need them
    data, scale = [int(d or 0) for d in raw_data], [int(d or 0) for d in raw_scale]
    problem = None
    if len(scale) not in (0, 1) and len(scale) != len(data):
        problem = f"a scale of rank {len(scale)} for data of rank {len(data)} (the importer takes rank 1 or the data's)"
    elif len(scale) == len(data):
        blocked = [i for i, (d, s) in enumerate(zip(data, scale)) if s and d // s != 1]
        if len(blocked) > 1:
            problem = f"blocks along axes {blocked} (scale {scale} for data {data}): only one axis may be blocked"
    if problem is None and g.types.get(node.input[0]) == TensorProto.INT4 and data and data[-1] % 2:
        problem = f"an odd last dimension ({data[-1]}) of int4 data: int4 is packed in pairs"
    if problem:
        report.findings.append(Finding("error", "int4", name, node.op_type, problem,
                                       "quantize with one block axis (the input dimension of the weight) and an even "
                                       "last dimension", QDQ_IMPORTER_SOURCE))


def _check_dynamic(report: LintReport, g: GraphView, shapes: dict[str, dict[str, list[int]]] | None,
                   dla_core: int | None) -> None:
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
                "give the sizes: lint --shapes NAME:DIMS (trtexec syntax) or --axis NAME=SIZE, build --shapes; or "
                "export with static shapes", "TensorRT developer guide, 'Working with Dynamic Shapes'"))
            if dla_core is not None and not others:
                report.findings.append(Finding(
                    "warning", "dla", vi.name, "graph input", f"dynamic {names}: the DLA takes no dynamic dimensions, "
                    f"so DLA core {dla_core} runs this network only with a fixed batch (min = opt = max)",
                    "build with a fixed batch (edgekit build fixes it at --batch unless --max-batch is larger), or "
                    "export with a static batch", DLA_RULES_SOURCE))
        elif dla_core is not None and profile["min"] != profile["max"]:
            report.findings.append(Finding(
                "warning", "dla", vi.name, "graph input", f"optimization profile {profile['min']}..{profile['max']}: "
                "the DLA takes no dynamic dimensions (min, opt and max must be equal), so the network runs on the GPU",
                "build with a fixed batch (--max-batch equal to --batch)", DLA_RULES_SOURCE))


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


def dla_fallback_reason(node: onnx.NodeProto, g: GraphView) -> str | None:
    """Why this node's layer cannot run on the DLA (None: the rules allow it)."""
    op = node.op_type
    rank = g.rank(node.input[0]) if node.input else None
    if op in _SHAPE_OPS:
        return None
    if op in ("Conv", "ConvTranspose"):
        w = g.shapes.get(node.input[1]) if len(node.input) > 1 else None
        kernel = list(attr(node, "kernel_shape", None) or (w[2:] if w else []))
        if len(kernel) != 2:
            return "only 2D convolutions run on the DLA"
        strides = list(attr(node, "strides", None) or [1, 1])
        pads = list(attr(node, "pads", None) or [0, 0, 0, 0])
        dil = list(attr(node, "dilations", None) or [1, 1])
        group = int(attr(node, "group", 1))
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
        kernel = list(attr(node, "kernel_shape", []))
        if len(kernel) != 2:
            return "only 2D pooling runs on the DLA"
        if not _in_range(kernel, 1, 8):
            return f"pooling window {kernel} outside the DLA's [1,8]"
        if not _in_range(list(attr(node, "strides", None) or [1, 1]), 1, 16):
            return "pooling stride outside the DLA's [1,16]"
        if not _in_range(list(attr(node, "pads", None) or [0, 0, 0, 0]), 0, 7):
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
        axis = int(attr(node, "axis", 0))
        if rank is not None and (axis % rank) != rank - 3:
            return f"concatenation on axis {axis}; the DLA concatenates on the channel axis only"
        return None
    if op == "Softmax":
        s = g.shapes.get(node.input[0])
        axis = int(attr(node, "axis", -1))
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
        mode = attr(node, "mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        ctm = attr(node, "coordinate_transformation_mode", b"half_pixel")
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
        return None if int(attr(node, "size", 0)) in (3, 5, 7, 9) else "LRN window not in {3, 5, 7, 9}"
    if op == "Gemm":
        return None  # a fully connected layer
    return f"{op} is not a layer the DLA runs"


# --- the command ----------------------------------------------------------------------------

def resolve_lint_input(model: str | Path) -> tuple[Path, dict[str, dict[str, list[int]]] | None]:
    """An ONNX file, or an edgekit folder holding one (the graph a TensorRT build used, if any),
    with the optimization profile the folder's build recorded (None when it recorded none)."""
    p = Path(model)
    if p.is_file():
        if p.suffix != ".onnx":
            raise BadInputError(f"{p} is not an .onnx file (lint takes an ONNX file or an edgekit folder holding one)")
        return p, None
    if p.is_dir() and is_artifact(p):
        m = read_manifest(p)
        recorded = (m.config.get("settings") or {}).get("shapes") or None
        for role in ("onnx_tensorrt", "onnx"):
            if role in m.files:
                return m.path_of(p, role), recorded
        raise BadInputError(f"{p} holds a {m.kind!r} artifact without an ONNX graph; export it first "
                            f"(edgekit export {p} -o ONNX_DIR)")
    raise BadInputError(f"{str(p)!r} is neither an ONNX file nor an edgekit folder (export the model first: "
                        "edgekit export MODEL -o ONNX_DIR)")


def lint_profile(onnx_path: Path, shapes: dict[str, tuple[int, ...]] | None = None,
                 dims: dict[str, tuple[int, int]] | None = None) -> dict[str, dict[str, list[int]]]:
    """An optimization profile from ``--shapes`` (fixed shapes per input, trtexec syntax) and
    ``--axis NAME=SIZE|MIN:MAX`` (every input axis of that name): min/opt/max per dynamic input
    (opt = max; an axis the exporter named as a sum of others, such as ``past_sequence_length +
    sequence_length``, adds their ranges). Inputs with a dynamic axis neither gives stay out
    (lint reports them)."""
    model = read_onnx(onnx_path)  # the loader build uses (a file that is not ONNX is one line)
    inits = {i.name for i in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    dims = dict(dims or {})
    known = {t.strip() for vi in inputs for d in vi.type.tensor_type.shape.dim if d.dim_param
             for t in d.dim_param.split("+")}
    unknown = sorted(set(dims) - known)
    if unknown:
        raise BadInputError(f"--axis names {unknown[0]!r}, which no input axis of {onnx_path.name} is called (named "
                            f"axes: {', '.join(sorted(known)) or 'none'})")
    out: dict[str, dict[str, list[int]]] = {}
    for name, fixed in (shapes or {}).items():
        out[name] = {w: [int(x) for x in fixed] for w in ("min", "opt", "max")}
    for vi in inputs:
        if vi.name in out:
            continue
        axes = vi.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") and d.dim_value > 0 for d in axes):
            continue
        lo, hi = [], []
        for d in axes:
            size = (d.dim_value, d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else \
                _dim_range(d.dim_param, dims)
            if size is None:
                break
            lo.append(size[0])
            hi.append(size[1])
        else:
            out[vi.name] = {"min": lo, "opt": hi, "max": hi}
    return out


def _dim_range(param: str, dims: dict[str, tuple[int, int]]) -> tuple[int, int] | None:
    """A named axis's (min, max): given, or a sum the exporter wrote (``past_sequence_length +
    sequence_length``) of given names and numbers; None when a term is not given."""
    if param in dims:
        return dims[param]
    terms = [t.strip() for t in param.split("+")] if param else []
    if len(terms) < 2:
        return None
    lo = hi = 0
    for t in terms:
        if t.isdigit():
            lo, hi = lo + int(t), hi + int(t)
        elif t in dims:
            lo, hi = lo + dims[t][0], hi + dims[t][1]
        else:
            return None
    return lo, hi


def lint_model(model: str | Path, target: str | Target, *, tensorrt_version: str | None = None,
               dla_core: int | None = None, precision: str | None = None,
               shapes: dict[str, tuple[int, ...]] | None = None,
               dims: dict[str, tuple[int, int]] | None = None) -> LintReport:
    """``edgekit lint``: check an ONNX file or edgekit folder against a TensorRT target, with
    the optimization profile ``shapes``/``dims`` give (else the one the folder's build recorded)."""
    t = load_target(target) if isinstance(target, str) else target
    if "tensorrt" not in t.runtimes:
        raise bad_choice("target for a TensorRT check (it lists the tensorrt runtime)", t.name,
                         [n for n in _tensorrt_targets()])
    path, recorded = resolve_lint_input(model)
    profile = lint_profile(path, shapes, dims) if (shapes or dims) else recorded
    return lint_onnx(path, t, tensorrt_version=tensorrt_version, dla_core=dla_core, precision=precision,
                     shapes=profile)


def _tensorrt_targets() -> list[str]:
    return [name for name in list_targets() if "tensorrt" in load_target(name).runtimes]
