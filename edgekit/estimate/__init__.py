"""Roofline latency estimates per ONNX node for a target, and their calibration.

``estimate(model_or_onnx, target, precision=None, batch=1) -> Estimate`` (roofline.py);
``calibrate(models, target)`` measures where edgekit can (this CPU with ONNX Runtime,
a CUDA GPU with the torch engine), fits per-op-class efficiency factors, saves them
with the target and reports the error before and after (calibrate.py). Every result
says it is an estimate.
"""
from __future__ import annotations

from edgekit.estimate.calibrate import (
                                        CalibrationCase,
                                        CalibrationReport,
                                        calibrate,
                                        calibration_path,
                                        fit_efficiency,
                                        load_calibration,
)
from edgekit.estimate.roofline import ESTIMATE_NOTE, OP_CLASSES, Estimate, NodeEstimate, estimate, op_class

__all__ = ["ESTIMATE_NOTE", "OP_CLASSES", "CalibrationCase", "CalibrationReport", "Estimate", "NodeEstimate",
           "calibrate", "calibration_path", "estimate", "fit_efficiency", "load_calibration", "op_class"]
