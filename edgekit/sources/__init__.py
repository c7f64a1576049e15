"""Model and data sources.

The names below are imported on first use: the light modules of this package (``handle``,
``inputs``, ``weights``) are read by the command line's option classes and the compress
registry without ``models`` (ONNX, and torch for the models that need it).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgekit.sources.handle import InputSpec as InputSpec
    from edgekit.sources.handle import ModelHandle as ModelHandle
    from edgekit.sources.handle import StepRecord as StepRecord
    from edgekit.sources.models import load_model as load_model

_NAMES = {"InputSpec": "edgekit.sources.handle", "ModelHandle": "edgekit.sources.handle",
          "StepRecord": "edgekit.sources.handle", "load_model": "edgekit.sources.models"}

__all__ = ["InputSpec", "ModelHandle", "StepRecord", "load_model"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'edgekit.sources' has no attribute {name!r}")
