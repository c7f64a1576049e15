"""edgekit/profiling_options.py: ProfileOptions declares profile's own flags (generation, the
trtexec exports read in place of an engine), refuses an incomplete set of the trtexec flags,
and imports no torch or ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.errors import BadInputError
from edgekit.profiling_options import ProfileOptions


def test_exports_are_read_with_all_three_flags():
    assert not ProfileOptions().reads_exports and ProfileOptions().generation
    assert ProfileOptions(trtexec="d", onnx="m.onnx", target="t").reads_exports


@pytest.mark.parametrize("given, message", [
    ({"target": "t"}, "--target applies with --trtexec (an engine folder records its target)"),
    ({"trtexec": "d"}, "trtexec exports are read with --trtexec DIR --onnx MODEL.onnx --target TARGET "
                       "(missing --onnx, --target)"),
    ({"trtexec": "d", "onnx": "m.onnx"}, "trtexec exports are read with --trtexec DIR --onnx MODEL.onnx --target "
                                         "TARGET (missing --target)"),
])
def test_incomplete_trtexec_flags_are_refused(given, message):
    with pytest.raises(BadInputError) as e:
        ProfileOptions(**given)
    assert str(e.value) == message


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.profiling_options; "
                        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
