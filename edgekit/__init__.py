"""edgekit: take a PyTorch model to a small, fast engine on an edge device, and prove
that it meets its latency budget.

The Python API mirrors the CLI; each command calls one of these functions::

    import edgekit
    onnx_dir = edgekit.export_onnx("efficientnet-lite0", "out/onnx")
    engine = edgekit.build_engine(onnx_dir, "cpu", "out/engine")
    profile = edgekit.profile_engine(engine)
    verdict = edgekit.check_budget(profile, budget_ms=33, percentile="p99")
"""
from __future__ import annotations

import importlib
import os
import sys
import types
from typing import TYPE_CHECKING, Any

from edgekit import interrupts
from edgekit.version import __version__

# ONNX Runtime's telemetry, off before it is first imported: from its import on, ONNX Runtime
# 1.31 writes a device id and an event store under ~/.cache/Microsoft/DeveloperTools/ unless
# ORT_DISABLE_TELEMETRY is set (the variable is read once, at that import). Set it yourself to
# decide otherwise. Where the host program imported ONNX Runtime first, its telemetry events are
# turned off (the files it wrote at its own import are its own).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
_ort_first = sys.modules.get("onnxruntime")  # the ONNX Runtime package, where the host program imported it first
if os.environ["ORT_DISABLE_TELEMETRY"] == "1" and _ort_first is not None:
    getattr(_ort_first, "disable_telemetry_events", lambda: None)()
del _ort_first

# Started as the command line (`edgekit ...`, or `python -m edgekit.cli`, whose argv[0]
# is "-m" while the module is located): a Ctrl-C while the modules load ends the process
# with exit 130 and one line, instead of a traceback. The API never changes SIGINT.
if sys.argv[:1] == ["-m"] or interrupts.program_name_is("edgekit"):
    interrupts.install(starting=True)

# The public API, imported explicitly for editors and type checkers. At run time each name is
# imported on first use (`_API` below, the same names): importing all of them takes seconds
# (torch, transformers, ONNX Runtime) and every `edgekit` command, even `--help`, loads this
# package first. tests/test_public_api.py checks that the two lists agree.
if TYPE_CHECKING:
    from edgekit.build import build_engine as build_engine
    from edgekit.build import load_engine as load_engine
    from edgekit.check import check_budget as check_budget
    from edgekit.compress import compress as compress
    from edgekit.compress.distill import distill as distill
    from edgekit.estimate import estimate as estimate
    from edgekit.evaluate import evaluate as evaluate
    from edgekit.export.lm import export_causal_lm as export_causal_lm
    from edgekit.finetune import finetune as finetune
    from edgekit.loading import export_onnx as export_onnx
    from edgekit.loading import load_model as load_model
    from edgekit.pipelines.recipe import load_recipe as load_recipe
    from edgekit.pipelines.run import run_recipe as run_recipe
    from edgekit.pipelines.sweep import run_sweep as run_sweep
    from edgekit.profiling import profile_engine as profile_engine
    from edgekit.profiling_lm import check_generation as check_generation
    from edgekit.profiling_lm import profile_with_generation as profile_with_generation
    from edgekit.report import render_report as render_report
    from edgekit.sources.data import load_samples as load_samples
    from edgekit.sources.handle import ModelHandle as ModelHandle
    from edgekit.targets import list_targets as list_targets
    from edgekit.targets import load_target as load_target

# Public name -> "module:attribute", imported on first use.
_API = {
    "load_model": "edgekit.loading:load_model",
    "load_samples": "edgekit.sources.data:load_samples",
    "ModelHandle": "edgekit.sources.handle:ModelHandle",
    "export_onnx": "edgekit.loading:export_onnx",
    "build_engine": "edgekit.build:build_engine",
    "load_engine": "edgekit.build:load_engine",
    "profile_engine": "edgekit.profiling:profile_engine",
    "check_budget": "edgekit.check:check_budget",
    "export_causal_lm": "edgekit.export.lm:export_causal_lm",
    "profile_with_generation": "edgekit.profiling_lm:profile_with_generation",
    "check_generation": "edgekit.profiling_lm:check_generation",
    "render_report": "edgekit.report:render_report",
    "compress": "edgekit.compress:compress",
    "load_target": "edgekit.targets:load_target",
    "list_targets": "edgekit.targets:list_targets",
    "evaluate": "edgekit.evaluate:evaluate",
    "estimate": "edgekit.estimate:estimate",
    "finetune": "edgekit.finetune:finetune",
    "distill": "edgekit.compress.distill:distill",
    "run_recipe": "edgekit.pipelines.run:run_recipe",
    "load_recipe": "edgekit.pipelines.recipe:load_recipe",
    "run_sweep": "edgekit.pipelines.sweep:run_sweep",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        mod, attr = _API[name].split(":")
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'edgekit' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Four API functions share their names with subpackages (compress, estimate, evaluate,
    finetune). Importing such a subpackage makes Python set it as an attribute of this package,
    which would hide the function from then on; the function keeps the name instead (as an
    explicit ``from edgekit.compress import compress`` here would), the subpackage stays in
    ``sys.modules`` and ``from edgekit.compress import ...`` works as ever."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
