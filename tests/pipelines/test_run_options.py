"""edgekit/pipelines/run_options.py: RunOptions declares run's flags (pairs, unset by default)
and imports neither PyTorch nor ONNX."""
from __future__ import annotations

import subprocess
import sys

from edgekit.options import config_options
from edgekit.pipelines.run_options import RunOptions


def test_flags():
    opts = {o.dest: o for o in config_options([("run", RunOptions)], "run")}
    assert list(opts) == ["force", "remeasure", "wait", "cache", "dry_run"]
    assert all(opts[d].is_pair and opts[d].default is False for d in ("force", "remeasure", "wait", "dry_run"))
    assert opts["cache"].fields[0][1] == "cache_dir"
    assert [d for d, o in opts.items() if o.basic] == ["force", "remeasure", "dry_run"]


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.pipelines.run_options; print(sorted(m for m in "
                        "('torch', 'onnx', 'onnxruntime') if m in sys.modules))"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
