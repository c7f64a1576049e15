"""The TensorRT runtime, self-contained: everything TensorRT-specific lives in this package.

- ``runtime``: ``TensorRTRuntime`` (the Runtime protocol) and how it picks a build path
  (Python API, trtexec here or over SSH, or a build bundle for the device);
- ``settings``: what a build is asked to do and the exact trtexec command line;
- ``device``: the GPU, SM and TensorRT of a machine (here, over SSH, or in a bundle's results);
- ``api``: the ``tensorrt`` Python API path and ``TensorRTEngine``;
- ``bundle``: ``build.sh`` and the README of a build bundle;
- ``parsers``: trtexec's ``--exportTimes/--exportProfile/--exportLayerInfo`` JSON;
- ``engine_cache``: built engines keyed by everything that makes them valid.

The registry (``edgekit.runtimes.RUNTIMES``) names ``RUNTIME`` here.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgekit.runtimes.base import Runtime
    from edgekit.runtimes.tensorrt.runtime import TensorRTRuntime as TensorRTRuntime

    RUNTIME: Runtime

__all__ = ["RUNTIME", "TensorRTRuntime"]


def __getattr__(name: str) -> Any:
    # the runtime on first use (get_runtime): ``lint_options`` is read by the command line
    # to build its flags, without numpy or ONNX
    if name in __all__:
        runtime_module = importlib.import_module("edgekit.runtimes.tensorrt.runtime")
        globals().setdefault("RUNTIME", runtime_module.TensorRTRuntime())  # one runtime object
        globals()["TensorRTRuntime"] = runtime_module.TensorRTRuntime
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
