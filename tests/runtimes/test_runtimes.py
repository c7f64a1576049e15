"""The runtime registry (runtimes/__init__.py): a runtime's module is imported when it is first
asked for, an unknown name is refused listing the registered ones, and ``Runtime`` (the protocol
of base.py) is read on first use."""
from __future__ import annotations

import subprocess
import sys

import pytest

import edgekit.runtimes as runtimes
from edgekit.errors import BadInputError
from edgekit.runtimes import BEST_RUNTIME, RUNTIMES, get_runtime


def test_registry_names_and_lookup():
    assert sorted(RUNTIMES) == ["onnxruntime", "openvino", "tensorrt", "torch"] and BEST_RUNTIME == "best"
    ort = get_runtime("onnxruntime")
    assert ort.name == "onnxruntime" and get_runtime("onnxruntime") is ort  # one object per runtime
    with pytest.raises(BadInputError, match=r"^unknown runtime 'tvm' \(choose from 'onnxruntime', 'openvino', "
                                            r"'tensorrt', 'torch'\)$"):
        get_runtime("tvm")
    assert runtimes.Runtime.__name__ == "Runtime"
    with pytest.raises(AttributeError, match="has no attribute 'nosuch'"):
        runtimes.nosuch  # noqa: B018


def test_importing_the_registry_imports_no_runtime():
    code = ("import sys, edgekit.runtimes; "
            "print(sorted(m for m in sys.modules if m.startswith('edgekit.runtimes.') or m in ('onnxruntime', 'onnx')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
