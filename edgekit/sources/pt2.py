"""``.pt2`` files from ``torch.export.save``, loaded without running anything they carry.

``torch.export.load`` trusts its file: it unpickles sample inputs and pickled weights with
``weights_only=False`` when the safe unpickler refuses them, unpickles custom objects with
``pickle.loads``, loads AOTInductor shared libraries, hands symbolic-shape strings to
``sympy.sympify`` (which evaluates Python), ``exec``s the program's guard strings, and
pastes argument and attribute names from the file into the Python source of the graph
module it compiles. So the archive is inspected first and refused (naming the entry) unless:

* it is a plain pt2 archive: stored (uncompressed) entries under one root folder, the
  current archive format and version, no legacy ``version`` entry (torch would fall back to
  its old, unpickling reader) and no AOTInductor code;
* every pickle torch would read (sample inputs, pickled weights and tensor constants,
  legacy weight files) loads with ``torch.load(weights_only=True)``; custom-object
  constants (TorchScript or pickled objects) are refused outright;
* the program JSON holds only what it should: node targets that are ATen/registered
  operators, higher-order operators or the symbolic integer operators; symbolic
  expressions built from sympy constructors, numbers and symbol names; guards that compare
  input sizes; names made of letters, digits, ``_`` and ``.``; and no control characters in
  free text (stack traces, module stacks), which the compiled source repeats in comments.

Then the very bytes that were inspected (read once, so the file cannot change in between)
go to ``torch.export.load``.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import math
import operator
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError
from edgekit.sources.weights import first_line, refused_by_unpickler, unpickler_reason

MAX_JSON_BYTES = 512 * 2**20  # a program or config JSON larger than this is refused
MAX_EXPR_CHARS = 4096  # a symbolic-shape expression longer than this is refused (sympify is slow)
NAME = re.compile(r"^[A-Za-z0-9_.]*$")  # names the compiled graph source may contain
SYMBOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
NUMBER = re.compile(r"^-?[0-9.eE+\-]+$")
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls but tab and newline
# Keys whose strings are free text (never pasted into code as names).
FREE_TEXT = frozenset({"stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "custom", "from_node",
                       "torch_version", "in_spec", "out_spec", "as_string", "as_strings", "expr_str", "guards_code"})
# Strings of these keys are repr()-ed by the compiler, so newlines are harmless there.
MULTILINE = frozenset({"stack_trace", "as_string", "as_strings"})
SYMPY_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "Eq", "Ne", "Lt",
    "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality", "Unequality",
    "And", "Or", "Not", "Piecewise", "ExprCondPair", "ITE", "floor", "ceiling", "sqrt", "true", "false", "True",
    "False", "oo", "int_oo", "zoo", "nan", "Half", "One", "Zero", "NegativeOne", "BooleanTrue", "BooleanFalse",
})
GUARD_CALLS = frozenset({"abs", "min", "max", "int", "float", "IsNonOverlappingAndDenseIndicator",
                         "cast_symbool_to_symint_guardless"})
GUARD_MATH = frozenset({"floor", "ceil", "trunc", "sqrt", "log2", "pow"})
TENSOR_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
SAFE_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
                  ast.Not, ast.Invert, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.And, ast.Or,
                  ast.BitAnd, ast.BitOr, ast.BitXor, ast.LShift, ast.RShift)


def load_exported_program(path: str | Path) -> Any:
    """``path`` (a ``.pt2`` file) as a ``torch.export.ExportedProgram``, after
    ``check_pt2_archive`` found nothing in it that loading would execute.

    >>> ep = load_exported_program("model.pt2")  # doctest: +SKIP
    """
    import torch

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInputError(f"cannot read model file {path}: {e.strerror or e}") from None
    check_pt2_archive(data, str(path))
    with _torch_export_log() as logged:
        try:
            return torch.export.load(io.BytesIO(data))
        except Exception as e:  # torch raises RuntimeError, AssertionError, KeyError, SerializeError, ...
            reason = logged[0] if logged else first_line(e)
            raise BadInputError(f"{path} is not a loadable torch.export program: {reason}") from None


@contextlib.contextmanager
def _torch_export_log() -> Iterator[list[str]]:
    """Keep torch.export's warnings (tracebacks of failed loads) off stderr; collect their causes."""
    causes: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                causes.append(first_line(record.exc_info[1]))

    loggers = [logging.getLogger(n) for n in ("torch.export", "torch._export")]
    saved = [(lg.propagate, lg.handlers[:]) for lg in loggers]
    handler = Collect()
    for lg in loggers:
        lg.propagate = False
        lg.handlers = [handler]
    try:
        yield causes
    finally:
        for lg, (propagate, handlers) in zip(loggers, saved):
            lg.propagate = propagate
            lg.handlers = handlers


# ----------------------------------------------------------------------------------------------
# The archive


def check_pt2_archive(data: bytes, where: str) -> None:
    """Refuse (``BadInputError`` naming the entry) a ``.pt2`` archive that ``torch.export.load``
    would unpickle unsafely, run code from, or read through its legacy pickle path."""
    from torch.export.pt2_archive import PT2ArchiveReader
    from torch.export.pt2_archive import constants as k

    try:
        infos = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise BadInputError(f"{where} is not a .pt2 archive (not a readable zip file: {first_line(e)})") from None
    if not infos:
        raise BadInputError(f"{where} is an empty zip file, not a .pt2 archive")
    root = infos[0].filename.split("/", 1)[0]
    seen: set[str] = set()
    for info in infos:
        name = info.filename
        if not name.startswith(root + "/"):
            raise BadInputError(f"{where}: entry {name!r} lies outside the archive's folder {root!r} "
                                "(torch.export.save writes one folder; torch would read such files as a legacy, "
                                "pickled program)")
        if name in seen:
            raise BadInputError(f"{where}: entry {name!r} appears twice")
        seen.add(name)
        if info.compress_type != zipfile.ZIP_STORED:
            raise BadInputError(f"{where}: entry {name!r} is compressed; torch.export.save stores entries uncompressed")
    try:
        reader = PT2ArchiveReader(io.BytesIO(data))
        names = set(reader.get_file_names())
        version = reader.read_string(k.ARCHIVE_VERSION_PATH) if k.ARCHIVE_VERSION_PATH in names else None
    except (RuntimeError, AssertionError, UnicodeDecodeError) as e:
        raise BadInputError(f"{where} is not a .pt2 archive from torch.export.save: {first_line(e)}") from None
    if version != k.ARCHIVE_VERSION_VALUE:
        raise BadInputError(f"{where} has archive version {version!r}; this torch reads version "
                            f"{k.ARCHIVE_VERSION_VALUE!r} (re-export it with torch.export.save)")
    for name in sorted(names):
        if name.startswith(k.AOTINDUCTOR_DIR):
            raise BadInputError(f"{where}: entry {name!r} is AOTInductor compiled code, which loading would run; "
                                "edgekit loads only the exported program (save it without aoti_files)")
    models = sorted(n[len(k.MODELS_DIR):-len(".json")] for n in names
                    if n.startswith(k.MODELS_DIR) and n.endswith(".json"))
    if "model" not in models:
        raise BadInputError(f"{where} holds no exported program ({k.MODELS_FILENAME_FORMAT.format('model')} is missing)")
    for model in models:
        program = _read_json(reader, k.MODELS_FILENAME_FORMAT.format(model), where)
        check_program_json(program, f"{where}: {k.MODELS_FILENAME_FORMAT.format(model)}")
        sample = k.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
        if sample in names:
            _check_pickle(reader, sample, where)
        _check_payloads(reader, names, model, where, k.WEIGHTS_DIR, k.WEIGHTS_CONFIG_FILENAME_FORMAT.format(model))
        _check_payloads(reader, names, model, where, k.CONSTANTS_DIR, k.CONSTANTS_CONFIG_FILENAME_FORMAT.format(model))


def _read_json(reader: Any, name: str, where: str) -> Any:
    size = reader.archive_file.get_record_size(name)
    if size > MAX_JSON_BYTES:
        raise BadInputError(f"{where}: entry {name!r} is {size / 2**20:.0f} MiB of JSON; "
                            f"at most {MAX_JSON_BYTES // 2**20} MiB is read")
    try:
        return json.loads(reader.read_bytes(name))
    except (ValueError, RecursionError, RuntimeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadInputError(f"{where}: entry {name!r} is not valid JSON: {first_line(e)}") from None


def _check_payloads(reader: Any, names: set[str], model: str, where: str, folder: str, config_name: str) -> None:
    """Weights or constants of one program: legacy pickled files and pickled entries must load
    with the safe unpickler; custom objects are refused."""
    from torch.export.pt2_archive import constants as k

    legacy = f"{folder}{model}.pt"
    if legacy in names:
        _check_pickle(reader, legacy, where)
        return
    if config_name not in names:
        raise BadInputError(f"{where}: entry {config_name!r} is missing")
    config = _read_json(reader, config_name, where)
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise BadInputError(f"{where}: entry {config_name!r} has no 'config' mapping")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            raise BadInputError(f"{where}: entry {config_name!r} describes {fqn!r} without a path_name")
        path_name = meta["path_name"]
        if not SYMBOL_NAME.match(path_name):
            raise BadInputError(f"{where}: entry {config_name!r} points {fqn!r} at {path_name!r}, not a plain file name")
        entry = folder + path_name
        if path_name.startswith((k.CUSTOM_OBJ_FILENAME_PREFIX, k.OPAQUE_OBJ_FILENAME_PREFIX)):
            raise BadInputError(f"{where}: entry {entry!r} (constant {fqn!r}) is a custom object, which only "
                                "unpickling can load; edgekit never unpickles objects from model files (export the "
                                "model without it, or load it through a Python entry point pkg.mod:fn)")
        if meta.get("use_pickle"):
            if entry not in names:
                raise BadInputError(f"{where}: entry {entry!r} (for {fqn!r}) is missing")
            _check_pickle(reader, entry, where)


def _check_pickle(reader: Any, name: str, where: str) -> None:
    """The entry must load with torch's restricted (weights-only) unpickler."""
    import torch

    data = reader.read_bytes(name)
    if not data:
        return
    try:
        with warnings.catch_warnings():  # the restricted unpickler warns about protocols; its refusal is the news
            warnings.simplefilter("ignore")
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for a refused global; anything else for a corrupt pickle
        if refused_by_unpickler(e):
            raise BadInputError(f"{where}: entry {name!r} is a pickle that only arbitrary code can load "
                                f"({unpickler_reason(e)}); edgekit never unpickles objects from model files") from None
        raise BadInputError(f"{where}: entry {name!r} is not a readable tensor pickle ({first_line(e)})") from None


# ----------------------------------------------------------------------------------------------
# The program JSON


def check_program_json(program: Any, where: str) -> None:
    """Walk the serialized program: every node target, symbolic expression, guard and name
    must be of the kinds ``torch.export.save`` writes for an ordinary model."""
    if not isinstance(program, dict):
        raise BadInputError(f"{where} is not a serialized ExportedProgram (a JSON object)")
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise BadInputError(f"{where}: guards_code is not a list")
    for guard in guards:
        check_guard(guard, where)
    stack: list[tuple[str, Any]] = [("", program)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            if "target" in value and "inputs" in value and "outputs" in value:
                check_target(value["target"], where)
            if "expr_str" in value:
                check_sym_expr(value["expr_str"], where)
            for k, v in value.items():
                _check_string("key", k, where)
                stack.append((k, v))
        elif isinstance(value, list):
            stack.extend((key, v) for v in value)
        elif isinstance(value, str):
            _check_string(key, value, where)


def _check_string(key: str, value: str, where: str) -> None:
    if key in FREE_TEXT:
        bad = CONTROL.search(value) or (None if key in MULTILINE else re.search("\n", value))
        if bad:
            raise BadInputError(f"{where}: {key} text {value[:60]!r} holds the control character {bad.group()!r} "
                                "(the compiled graph's source would contain it)")
    elif not NAME.match(value):
        bad = re.search(r"[^A-Za-z0-9_.]", value)
        raise BadInputError(f"{where}: {key} {value[:60]!r} holds {bad.group() if bad else '?'!r}; names in a "
                            "program are letters, digits, '_' and '.' (the compiled graph's source would contain it)")


def check_target(target: Any, where: str) -> None:
    """A node's target must resolve to an operator overload, a higher-order operator or one
    of the symbolic integer operators; anything else (``torch.os.system``) is refused."""
    import torch

    if not isinstance(target, str) or not NAME.match(target):
        raise BadInputError(f"{where}: node target {str(target)[:60]!r} is not an operator name")
    parts = target.split(".")
    obj: Any = None
    if parts[0] == "torch" and len(parts) >= 4 and parts[1] == "ops":
        obj = torch.ops
        for part in parts[2:]:
            try:
                obj = getattr(obj, part)
            except (AttributeError, RuntimeError):  # no such operator registered here
                obj = None
                break
    elif len(parts) == 2 and parts[0] in ("_operator", "operator", "math", "torch"):
        module = {"_operator": operator, "operator": operator, "math": math, "torch": torch}[parts[0]]
        obj = getattr(module, parts[1], None)
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return
    if obj is not None and any(obj is op for op in symbolic_operators()):
        return
    raise BadInputError(f"{where}: node target {target!r} is not an operator (targets are torch.ops overloads, "
                        "higher-order operators or symbolic integer arithmetic)")


def symbolic_operators() -> frozenset[Any]:
    """The Python-level operators torch.export serializes for symbolic integers (``_SYM_OPS``)."""
    from torch._export.serde import serialize

    return frozenset(serialize._SYM_OPS)


def _sympy_function_names() -> frozenset[str]:
    import sympy
    import torch.utils._sympy.functions as functions

    return frozenset(n for n in dir(functions) if isinstance(getattr(functions, n), type)
                     and issubclass(getattr(functions, n), sympy.Basic))


def check_sym_expr(expr: Any, where: str) -> None:
    """A symbolic-shape expression (``Mul(Integer(2), Symbol('s77', positive=True, integer=True))``)
    may use only sympy constructors, torch's sympy functions, numbers and symbol names:
    ``sympy.sympify`` evaluates it as Python."""
    if not isinstance(expr, str) or len(expr) > MAX_EXPR_CHARS:
        raise BadInputError(f"{where}: symbolic expression {str(expr)[:60]!r} is not a string of at most "
                            f"{MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise BadInputError(f"{where}: symbolic expression {expr[:60]!r} does not parse") from None
    functions = SYMPY_NAMES | _sympy_function_names()
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Load, ast.Tuple, ast.BinOp, ast.UnaryOp, ast.Compare,
                               ast.BoolOp, *SAFE_OPERATORS))
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in functions
        elif isinstance(node, ast.Name):
            ok = node.id in functions or bool(re.fullmatch(r"[a-z]+[0-9]+", node.id))
        elif isinstance(node, ast.keyword):
            ok = node.arg is not None and SYMBOL_NAME.match(node.arg) is not None and not node.arg.startswith("_")
        elif isinstance(node, ast.Constant):
            v = node.value
            ok = isinstance(v, (bool, int, float)) or (isinstance(v, str) and bool(
                SYMBOL_NAME.match(v) or NUMBER.match(v)) and not v.startswith("_"))
        if not ok:
            raise BadInputError(f"{where}: symbolic expression {expr[:80]!r} uses {_node_text(node)!r}; only "
                                "sympy constructors, numbers and symbol names are accepted")


def check_guard(guard: Any, where: str) -> None:
    """A guard (``L['x'].size()[0] > 3``) may only compare sizes, strides and numbers:
    ``ExportedProgram.module()`` compiles it with ``exec``."""
    if not isinstance(guard, str) or len(guard) > MAX_EXPR_CHARS or CONTROL.search(guard) or "\n" in guard:
        raise BadInputError(f"{where}: guard {str(guard)[:60]!r} is not a one-line expression of at most "
                            f"{MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(guard, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise BadInputError(f"{where}: guard {guard[:60]!r} does not parse") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Load, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp,
                               ast.Subscript, *SAFE_OPERATORS))
        if isinstance(node, ast.Name):
            ok = node.id in ("L", "math") or node.id in GUARD_CALLS
        elif isinstance(node, ast.Attribute):
            base = node.value
            ok = (node.attr in GUARD_MATH and isinstance(base, ast.Name) and base.id == "math") or (
                node.attr in TENSOR_METHODS and isinstance(base, ast.Subscript))
        elif isinstance(node, ast.Call):
            ok = not node.keywords and ((isinstance(node.func, ast.Name) and node.func.id in GUARD_CALLS)
                                        or isinstance(node.func, ast.Attribute))
        elif isinstance(node, ast.Constant):
            v = node.value
            ok = isinstance(v, (bool, int, float)) or (isinstance(v, str) and SYMBOL_NAME.match(v) is not None)
        if not ok:
            raise BadInputError(f"{where}: guard {guard[:80]!r} uses {_node_text(node)!r}; guards may only "
                                "compare input sizes, strides and numbers")


def _node_text(node: ast.AST) -> str:
    try:
        return ast.unparse(node)[:60]
    except (ValueError, TypeError, AttributeError):
        return type(node).__name__
