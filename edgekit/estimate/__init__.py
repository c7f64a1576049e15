"""Latency estimates of a model on a target, without the device; and their calibration.

Modules, each one idea: ``graph`` (ONNX loaded and shape-inferred by ONNX Runtime's
symbolic shape inference), ``fusion`` (the kernels a runtime makes of the graph), ``cost``
(ops and bytes per operator), ``efficiency`` (roofs and shape-dependent efficiency),
``uncertainty`` (the range from validation errors), ``roofline`` (``estimate(model,
target) -> Estimate``), ``calibrate`` (fit a target's factors to measurements here),
``options`` (what ``edgekit estimate`` is asked).
Every result says it is an estimate and carries ``low_ms``/``high_ms``/``basis``.

The names below are imported on first use: the command line reads ``options`` to build its
flags without ONNX.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgekit.estimate.calibrate import CalibrationCase as CalibrationCase
    from edgekit.estimate.calibrate import CalibrationReport as CalibrationReport
    from edgekit.estimate.calibrate import calibrate as calibrate
    from edgekit.estimate.calibrate import fit_efficiency as fit_efficiency
    from edgekit.estimate.cost import OP_CLASSES as OP_CLASSES
    from edgekit.estimate.cost import op_class as op_class
    from edgekit.estimate.efficiency import calibration_path as calibration_path
    from edgekit.estimate.efficiency import load_calibration as load_calibration
    from edgekit.estimate.fusion import FUSION_RUNTIMES as FUSION_RUNTIMES
    from edgekit.estimate.fusion import fuse as fuse
    from edgekit.estimate.graph import read_graph as read_graph
    from edgekit.estimate.roofline import ESTIMATE_NOTE as ESTIMATE_NOTE
    from edgekit.estimate.roofline import Estimate as Estimate
    from edgekit.estimate.roofline import NodeEstimate as NodeEstimate
    from edgekit.estimate.roofline import estimate as estimate

# Public name -> the module that defines it.
_NAMES = {"CalibrationCase": "calibrate", "CalibrationReport": "calibrate", "calibrate": "calibrate",
          "fit_efficiency": "calibrate", "OP_CLASSES": "cost", "op_class": "cost", "calibration_path": "efficiency",
          "load_calibration": "efficiency", "FUSION_RUNTIMES": "fusion", "fuse": "fusion", "read_graph": "graph",
          "ESTIMATE_NOTE": "roofline", "Estimate": "roofline", "NodeEstimate": "roofline", "estimate": "roofline"}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    """``calibrate`` is both a function and the module that defines it. Importing the module
    makes Python set it as an attribute of this package, which would hide the function; the
    function keeps the name instead (``edgekit.estimate.calibrate`` stays in ``sys.modules``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NAMES and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
