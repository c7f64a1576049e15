"""edgekit/report_options.py: ReportOptions declares report's flags, checks --top-k and
imports neither torch nor ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.errors import BadInputError
from edgekit.report_options import ReportOptions


def test_values():
    assert (ReportOptions().budget_ms, ReportOptions().percentile, ReportOptions().top_k) == (None, "p99", 10)
    with pytest.raises(BadInputError, match=r"^--top-k must be at least 1, got 0$"):
        ReportOptions(top_k=0)


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.report_options; print(sorted(m for m in "
                        "('torch', 'onnx', 'onnxruntime') if m in sys.modules))"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
