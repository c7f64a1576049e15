"""Runtimes: one module per runtime, behind the protocol in ``base``.

``RUNTIMES`` is the explicit registry, name -> "module:attribute" of the runtime
object, imported on first use so that the package imports without onnxruntime,
TensorRT or a GPU.
"""
from __future__ import annotations

import importlib
from typing import Any

from edgekit.errors import bad_choice

RUNTIMES: dict[str, str] = {
    "onnxruntime": "edgekit.runtimes.onnxruntime:RUNTIME",
    "torch": "edgekit.runtimes.torch_aot:RUNTIME",
    "tensorrt": "edgekit.runtimes.tensorrt:RUNTIME",
    "openvino": "edgekit.runtimes.openvino:RUNTIME",
}
BEST_RUNTIME = "best"  # build: time each of the target's runtimes here and keep the fastest


def get_runtime(name: str) -> Any:
    if name not in RUNTIMES:
        raise bad_choice("runtime", name, RUNTIMES)
    mod, attr = RUNTIMES[name].split(":")
    return getattr(importlib.import_module(mod), attr)
