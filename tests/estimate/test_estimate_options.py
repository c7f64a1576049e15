"""edgekit/estimate/options.py: EstimateOptions checks its values (the named axes too) and
imports no ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.errors import BadInputError
from edgekit.estimate.options import TIMINGS, EstimateOptions, parse_axis_sizes
from edgekit.limits import MAX_DIM


def test_axes_parse_and_bad_ones_name_themselves():
    o = EstimateOptions(axes=("past_sequence_length=0", "sequence_length=128"))
    assert o.axis_sizes() == {"past_sequence_length": 0, "sequence_length": 128}
    for bad in ("seq", "=4", "seq=x", "seq=-1", f"seq={MAX_DIM + 1}"):
        with pytest.raises(BadInputError, match=rf"^--axis '{bad}' must be NAME=SIZE with a whole number SIZE from "
                                                rf"0 to {MAX_DIM}"):
            parse_axis_sizes((bad,))


def test_values_are_checked():
    assert EstimateOptions().timing == TIMINGS[0] and EstimateOptions().top_k == 10
    with pytest.raises(BadInputError, match=rf"^batch 0 is not one of 1 to {MAX_DIM}$"):
        EstimateOptions(batch=0)
    with pytest.raises(BadInputError, match=r"^top_k 0 must be at least 1$"):
        EstimateOptions(top_k=0)


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.estimate.options; print(sorted(m for m in "
                        "('torch', 'onnx', 'onnxruntime') if m in sys.modules))"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
