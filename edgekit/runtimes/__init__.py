"""Runtimes: one module per runtime, behind the protocol in ``base``.

``RUNTIMES`` (in ``registry``) is the explicit registry, name -> "module:attribute" of
the runtime object, imported on first use so that the package imports without
onnxruntime, TensorRT or a GPU.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from edgekit.errors import bad_choice
from edgekit.runtimes.registry import BEST_RUNTIME, RUNTIMES

if TYPE_CHECKING:  # base imports this registry; the protocol is only a type here
    from edgekit.runtimes.base import Runtime

__all__ = ["BEST_RUNTIME", "RUNTIMES", "get_runtime"]


def get_runtime(name: str) -> Runtime:
    """The runtime object registered under ``name`` (its module is imported now)."""
    if name not in RUNTIMES:
        raise bad_choice("runtime", name, RUNTIMES)
    mod, attr = RUNTIMES[name].split(":")
    runtime: Runtime = getattr(importlib.import_module(mod), attr)
    return runtime
