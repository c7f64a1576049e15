"""edgekit/pipelines/sweep_options.py: SweepOptions checks its values and reads --list
combinations; the module imports neither PyTorch nor ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.errors import BadInputError
from edgekit.pipelines.sweep_options import DEFAULT_MAX_POINTS, SweepOptions


def test_combinations_and_checks():
    assert SweepOptions().combinations() is None and SweepOptions().max_points == DEFAULT_MAX_POINTS == 256
    o = SweepOptions(points=("weight-only.group_size=64,weight-only.sym=true", "weight-only.method=rtn"))
    assert o.combinations() == [{"weight-only.group_size": 64, "weight-only.sym": True}, {"weight-only.method": "rtn"}]
    with pytest.raises(BadInputError, match=r"^--list 'weight-only.bits' must look like 'step.field=v,other.field=w'$"):
        SweepOptions(points=("weight-only.bits",))
    with pytest.raises(BadInputError, match=r"^unknown executor 'slurm' \(choose from 'local', 'process', 'ray'\)$"):
        SweepOptions(executor="slurm")
    with pytest.raises(BadInputError, match=r"^max_points must be >= 1, got 0$"):
        SweepOptions(max_points=0)


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.pipelines.sweep_options; print(sorted(m for m in "
                        "('torch', 'onnx', 'onnxruntime') if m in sys.modules))"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
