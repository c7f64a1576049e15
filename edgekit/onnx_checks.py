"""Every ONNX file edgekit writes is loaded and run once by ONNX Runtime before it is
committed (``verify_onnx_runs``), and ONNX Runtime's errors become one line naming the file,
the node, the op and the reason (``ort_failure``, ``ort_errors``, ``allocation_failures``).

These are checks of ONNX graphs, not an engine: ``export`` and ``compress`` use them on what
they write and read, and the ONNX Runtime engine (``runtimes/onnxruntime.py``) on the graphs it
loads. ONNX Runtime is imported on first use.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import CheckFailedError, EdgekitError, UnavailableError, bad_choice

LEVELS = ("disable", "basic", "extended", "layout", "all")  # ONNX Runtime's graph optimization levels


def ort_module() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - a hard dependency
        raise UnavailableError(f"onnxruntime is not installed: {e}") from None
    return ort



def optimization_level(name: str) -> Any:
    ort = ort_module()
    if name not in LEVELS:
        raise bad_choice("optimization level", name, LEVELS)
    attr = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED",
            "layout": "ORT_ENABLE_LAYOUT", "all": "ORT_ENABLE_ALL"}[name]
    return getattr(ort.GraphOptimizationLevel, attr, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)



def session_options(level: str, threads: int | None) -> Any:
    """ONNX Runtime's session options as edgekit runs every graph: optimizations at ``level``,
    ``threads`` intra-op threads (None: ORT picks), one inter-op thread, sequential."""
    ort = ort_module()
    so = ort.SessionOptions()
    so.graph_optimization_level = optimization_level(level)
    so.intra_op_num_threads = int(threads or 0)  # 0: ORT picks (all physical cores)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return so


@dataclass
class VerifiedRun:
    """A session that loaded a graph and the outputs of its one run (reuse both)."""

    session: Any
    outputs: list[np.ndarray]


def verify_onnx_runs(path: str | os.PathLike[str], feeds: dict[str, np.ndarray], *, label: str | None = None,
                     error: type[EdgekitError] = CheckFailedError, level: str = "all",
                     threads: int | None = None, session: Any = None) -> VerifiedRun:
    """Load ``path`` in ONNX Runtime (CPU, graph optimizations at ``level``) and run it once on
    ``feeds``; raise ``error`` (CheckFailedError: edgekit wrote a graph that does not work)
    naming the file (``label``, else the path), the node and op, and ORT's one-line reason.
    ``session``: one the caller already has for this file (then only the run is checked).

    >>> run = verify_onnx_runs("out/model.onnx", handle.sample_inputs(1))  # doctest: +SKIP
    >>> run.outputs[0].shape  # doctest: +SKIP
    """
    ort = ort_module()
    name = label or str(path)
    if session is None:
        so = session_options(level, threads)
        so.log_severity_level = 4  # the reason goes into the error, not onto stderr
        try:
            session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except ort_errors() as e:
            raise error(f"{name} does not load in ONNX Runtime: {ort_failure(e, path)}") from None
    wanted = [i.name for i in session.get_inputs()]
    missing = [n for n in wanted if n not in feeds]
    if missing:
        raise error(f"{name} takes inputs {wanted}; no sample input for {missing}")
    chosen = {n: feeds[n] for n in wanted}
    try:
        outputs = list(session.run(None, chosen))
    except ort_errors() as e:
        shapes = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in chosen.items())
        raise error(f"{name} does not run in ONNX Runtime on sample inputs ({shapes}): {ort_failure(e)}") from None
    return VerifiedRun(session, outputs)


@functools.cache
def ort_errors() -> tuple[type[BaseException], ...]:
    """ONNX Runtime's exception classes (pybind11 derives them from Exception), and what its
    Python wrapper raises on bad feeds: ``except ort_errors() as e`` (imports ORT on first use)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as C
    except ImportError:  # pragma: no cover - a hard dependency
        return (RuntimeError, ValueError)
    names = ("Fail", "InvalidArgument", "NoSuchFile", "NoModel", "EngineError", "RuntimeException", "InvalidProtobuf",
             "ModelLoaded", "NotImplemented", "InvalidGraph", "EPFail", "NotFound", "ModelRequiresCompilation")
    return tuple(getattr(C, n) for n in names if hasattr(C, n)) + (RuntimeError, ValueError, MemoryError)


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_LOAD_PREFIX = re.compile(r"^Load model from .*? failed:\s*")
_NODE_PATTERNS = (
    re.compile(r"Node \((?P<node>[^)]*)\) Op \((?P<op>[^)]*)\)\s*(?P<reason>.*)"),
    re.compile(r"In Node, \(\"(?P<node>[^\"]*)\", (?P<op>[^,]+),.*?, Error (?P<reason>.*)"),
    re.compile(r"running (?P<op>\S+) node\. Name:'(?P<node>[^']*)' Status Message: (?P<reason>.*)"),
)
_FATAL_PREFIX = re.compile(r"^Fatal error: ")
_UNREGISTERED_OP = re.compile(r"^(?:(?P<domain>[\w.]+):)?(?P<op>\w+)\(-?\d+\) is not a registered function/op")
_SOURCE_LOCATION = re.compile(r"[\w/-]+\.(?:cc|h|cpp|hpp|cu):\d+\s+")


@contextlib.contextmanager
def allocation_failures() -> Iterator[None]:
    """ONNX Runtime's "Failed to allocate memory" (its own exception type) raised as the
    MemoryError it is, so the command line reports it in one line."""
    try:
        yield
    except Exception as e:
        if "failed to allocate memory" in str(e).lower() or "bad_alloc" in str(e):
            raise MemoryError(f"ONNX Runtime: {ort_failure(e)}") from None
        raise


def ort_failure(e: BaseException, path: str | os.PathLike[str] | None = None) -> str:
    """ONNX Runtime's exception as one line: ``node 'x' (QLinearMul): <reason>`` when ORT names
    the node, without its error-code prefix, source locations and C++ signatures. When ORT names
    only an op it has no kernel for, the node is looked up in the graph at ``path``."""
    text = " ".join(str(e).split())
    text = _FATAL_PREFIX.sub("", _LOAD_PREFIX.sub("", _ORT_PREFIX.sub("", text)))
    where = ""
    for pattern in _NODE_PATTERNS:
        m = pattern.search(text)
        if m:
            where = f"node {m.group('node')!r} ({m.group('op').strip()}): "
            text = m.group("reason")
            break
    m = _UNREGISTERED_OP.match(text)
    if not where and m and path is not None:
        nodes = _nodes_of_op(Path(path), m.group("domain") or "", m.group("op"))
        if nodes:
            more = f" and {len(nodes) - 1} more" if len(nodes) > 1 else ""
            where = f"node {nodes[0]!r}{more} ({m.group(0).split('(')[0]}): "
            text = "no such op in this ONNX Runtime (not a registered function or op)"
    text = _strip_source_location(text).strip() or type(e).__name__
    return where + (text if len(text) <= 300 else text[:297] + "...")


def _nodes_of_op(path: Path, domain: str, op: str) -> list[str]:
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except (OSError, ValueError, RuntimeError):  # the graph ORT could not load may not decode either
        return []
    return [n.name or f"#{k}" for k, n in enumerate(graph.node) if n.op_type == op and n.domain == domain]


def _strip_source_location(text: str) -> str:
    """``reshape_helper.h:91 onnxruntime::ReshapeHelper::ReshapeHelper(args) input_shape_size ...``
    -> ``input_shape_size ...``."""
    m = _SOURCE_LOCATION.search(text)
    if m is None:
        return text
    rest = text[m.end():]
    head = rest.split("(", 1)[0]
    if "::" in head:  # a C++ signature precedes the message: drop it up to its closing parenthesis
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if c == ")" and depth == 0:
                rest = rest[i + 1:]
                break
    return text[:m.start()] + rest.strip()
