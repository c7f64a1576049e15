"""Export to ONNX (``onnx.export_onnx``) and the parity check against PyTorch (``parity``)."""
from __future__ import annotations

from edgekit.export.onnx import ExportConfig, export_onnx
from edgekit.export.parity import ParityReport, check_parity

__all__ = ["ExportConfig", "ParityReport", "check_parity", "export_onnx"]
