"""Export to ONNX (``onnx.export_onnx``) and the parity check against PyTorch (``parity``);
how to export (``config``: ``ExportConfig``, ``CausalLMExportOptions``).

The names below are imported on first use: ``edgekit.export.config`` is read by the command
line to build its options, without PyTorch or ONNX.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgekit.export.config import ExportConfig as ExportConfig
    from edgekit.export.onnx import export_onnx as export_onnx
    from edgekit.export.parity import ParityReport as ParityReport
    from edgekit.export.parity import check_parity as check_parity

_NAMES = {"ExportConfig": "edgekit.export.config", "export_onnx": "edgekit.export.onnx",
          "ParityReport": "edgekit.export.parity", "check_parity": "edgekit.export.parity"}

__all__ = ["ExportConfig", "ParityReport", "check_parity", "export_onnx"]


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'edgekit.export' has no attribute {name!r}")
