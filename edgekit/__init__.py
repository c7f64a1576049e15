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
import sys
from typing import Any

from edgekit import interrupts

__version__ = "0.1.0"

# Started as the command line (`edgekit ...`, or `python -m edgekit.cli`, whose argv[0]
# is "-m" while the module is located): a Ctrl-C while the modules load ends the process
# with exit 130 and one line, instead of a traceback. The API never changes SIGINT.
if sys.argv[:1] == ["-m"] or interrupts.program_name_is("edgekit"):
    interrupts.install(starting=True)

# Public name -> "module:attribute". Resolved lazily so `import edgekit` stays cheap
# and works without the optional runtimes.
_API = {
    "load_model": "edgekit.sources.models:load_model",
    "load_samples": "edgekit.sources.data:load_samples",
    "ModelHandle": "edgekit.sources.handle:ModelHandle",
    "export_onnx": "edgekit.export.onnx:export_onnx",
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
