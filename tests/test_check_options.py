"""edgekit/check_options.py: CheckOptions declares check's flags, refuses a check with
nothing to check, and imports no ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.check_options import CheckOptions
from edgekit.errors import BadInputError


def test_a_check_needs_a_budget():
    assert CheckOptions().percentile == "p99"
    with pytest.raises(BadInputError, match=r"^give a budget: --budget-ms, --min-tokens-per-s or --max-ttft-ms "):
        CheckOptions().require_a_budget()
    for given in ({"budget_ms": 33.0}, {"min_tokens_per_s": 20.0}, {"max_ttft_ms": 200.0}, {"require_verified": True}):
        CheckOptions(**given).require_a_budget()  # type: ignore[arg-type]


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.check_options; "
                        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
