"""Latency estimates of a model on a target, without the device; and their calibration.

Modules, each one idea: ``graph`` (ONNX loaded and shape-inferred by ONNX Runtime's
symbolic shape inference), ``fusion`` (the kernels a runtime makes of the graph), ``cost``
(ops and bytes per operator), ``efficiency`` (roofs and shape-dependent efficiency),
``uncertainty`` (the range from validation errors), ``roofline`` (``estimate(model,
target) -> Estimate``), ``calibrate`` (fit a target's factors to measurements here).
Every result says it is an estimate and carries ``low_ms``/``high_ms``/``basis``.
"""
from __future__ import annotations

from edgekit.estimate.calibrate import (
    CalibrationCase,
    CalibrationReport,
    calibrate,
    fit_efficiency,
)
from edgekit.estimate.cost import OP_CLASSES, op_class
from edgekit.estimate.efficiency import calibration_path, load_calibration
from edgekit.estimate.fusion import FUSION_RUNTIMES, fuse
from edgekit.estimate.graph import read_graph
from edgekit.estimate.roofline import ESTIMATE_NOTE, Estimate, NodeEstimate, estimate

__all__ = ["ESTIMATE_NOTE", "FUSION_RUNTIMES", "OP_CLASSES", "CalibrationCase", "CalibrationReport", "Estimate",
           "NodeEstimate", "calibrate", "calibration_path", "estimate", "fit_efficiency", "fuse",
           "load_calibration", "op_class", "read_graph"]
