"""edgekit/runtimes/tensorrt/lint_options.py: LintOptions checks the axis ranges of the
optimization profile and imports no ONNX (nor the TensorRT runtime)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.errors import BadInputError
from edgekit.runtimes.tensorrt.lint_options import LintOptions, parse_axis_ranges


def test_axis_ranges():
    assert LintOptions().axis_ranges() is None
    assert LintOptions(axes=("batch=1", "seq=0:256")).axis_ranges() == {"batch": (1, 1), "seq": (0, 256)}
    for bad in ("seq", "seq=9:3", "seq=0", "seq=a:4", "=2"):
        with pytest.raises(BadInputError, match=rf"^--axis '{bad}' must be NAME=SIZE or NAME=MIN:MAX"):
            parse_axis_ranges((bad,))


def test_the_module_is_light():
    code = ("import sys, edgekit.runtimes.tensorrt.lint_options; print(sorted(m for m in ('torch', 'onnx', "
            "'onnxruntime', 'edgekit.runtimes.tensorrt.runtime') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_the_tensorrt_runtime_is_one_object_loaded_on_first_use():
    import edgekit.runtimes.tensorrt as package
    from edgekit.runtimes import get_runtime

    assert get_runtime("tensorrt") is get_runtime("tensorrt") is package.RUNTIME
    assert isinstance(package.RUNTIME, package.TensorRTRuntime)
