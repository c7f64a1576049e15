"""edgekit/finetune_options.py: FinetuneOptions declares finetune's re-quantization and resume
flags, refuses re-quantization fields without the step they set, names only steps of the
compress registry that quantize, and imports no torch or ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.compress import get_step
from edgekit.errors import BadInputError
from edgekit.finetune_options import REQUANT_STEPS, FinetuneOptions


def test_requant_config_is_what_was_given():
    assert FinetuneOptions().requant_config() == {} and FinetuneOptions().resume is True
    o = FinetuneOptions(requant="weight-only", bits=3, group_size=64)
    assert o.requant_config() == {"bits": 3, "group_size": 64}
    assert FinetuneOptions(requant="int8", method="ptq").requant_config() == {"method": "ptq"}


@pytest.mark.parametrize("given, message", [
    ({"bits": 3}, "--bits set the weight-only re-quantization: give --requant weight-only"),
    ({"requant": "int8", "group_size": 32}, "--group-size set the weight-only re-quantization: give --requant weight-only"),
    ({"method": "gptq"}, "--method chooses the re-quantization's method: give --requant (weight-only or int8)"),
    ({"requant": "int2"}, "unknown re-quantization step 'int2' (choose from weight-only, int8)"),
])
def test_fields_without_their_step_are_refused(given, message):
    with pytest.raises(BadInputError) as e:
        FinetuneOptions(**given)
    assert str(e.value) == message


def test_requant_steps_are_registered_quantizers():
    """The names are spelled here (the module stays light); the registry must agree."""
    assert [get_step(name).quantizes_to({}) for name in REQUANT_STEPS] == ["int4", "int8"]


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.finetune_options; "
                        "print(sorted(m for m in ('torch', 'onnx', 'onnxruntime') if m in sys.modules))"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
