"""Runtimes: one module per runtime, behind the protocol in ``base``.

``RUNTIMES`` is the explicit registry, name -> "module:attribute" of the runtime object,
imported on first use so that the package imports without onnxruntime, TensorRT or a GPU.
It is declared in ``edgekit/targets/runtime_registry.py``, below both: target files are
checked against its names, and every runtime takes a ``Target``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from edgekit.errors import bad_choice
from edgekit.targets.runtime_registry import BEST_RUNTIME, RUNTIMES

if TYPE_CHECKING:
    from edgekit.runtimes.base import Runtime

__all__ = ["BEST_RUNTIME", "RUNTIMES", "get_runtime"]


def __getattr__(name: str) -> Any:
    # ``base`` (numpy, ONNX) on first use: the command line reads option classes of the
    # runtimes' packages (``tensorrt.lint_options``) without it
    if name == "Runtime":
        return importlib.import_module("edgekit.runtimes.base").Runtime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_runtime(name: str) -> Runtime:
    """The runtime object registered under ``name`` (its module is imported now)."""
    if name not in RUNTIMES:
        raise bad_choice("runtime", name, RUNTIMES)
    mod, attr = RUNTIMES[name].split(":")
    runtime: Runtime = getattr(importlib.import_module(mod), attr)
    return runtime
