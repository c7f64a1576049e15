"""The flags of ``edgekit build`` (runtimes/build_options.py): trtexec's shape syntax parsed, and
every BuildOptions and BuildExtras field checked as it is made, in one line naming the field, the
bad value and what is valid."""
from __future__ import annotations

import pytest

from edgekit.errors import BadInputError
from edgekit.limits import MAX_DIM
from edgekit.runtimes.build_options import BuildExtras, BuildOptions, parse_shape_spec


def test_shape_spec_text_and_mapping():
    assert parse_shape_spec("input:1x3x224x224, mask:1x128") == {"input": [1, 3, 224, 224], "mask": [1, 128]}
    assert parse_shape_spec("'input.1':2x4") == {"input.1": [2, 4]}  # a quoted name, as trtexec takes it
    assert parse_shape_spec({"x": ("1", 8)}) == {"x": [1, 8]}
    for bad in ("input1x3", "input:1xa", "input:"):
        with pytest.raises(BadInputError, match=rf"^bad shape spec '{bad}' \(use name:1x3x224x224\)$"):
            parse_shape_spec(bad)


@pytest.mark.parametrize("kwargs, message", [
    ({"threads": 0}, "threads: must be 1 to 4096, got 0"),
    ({"batch": 0}, f"batch: must be 1 to {MAX_DIM}, got 0"),
    ({"runtime": "tvm"}, "unknown runtime 'tvm' (choose from 'best', 'onnxruntime', 'openvino', 'tensorrt', 'torch')"),
    ({"optimization_level": "max"}, "unknown optimization level 'max' (choose from"),
    ({"extra": {"ssh_port": 70000}}, "extra.ssh_port: must be a TCP port (1 to 65535), got 70000"),
    ({"extra": {"trt_path": "x"}}, "extra.trt_path: unknown TensorRT build path 'x' (choose from api, trtexec, bundle)"),
    ({"extra": {"device": "gpu"}}, "extra.device: unknown device 'gpu' (choose from cpu, cuda, cuda:N)"),
    ({"extra": {"max_shapes": "input:1x0"}}, f"extra.max_shapes.input: dimensions must be 1 to {MAX_DIM}, got [1, 0]"),
    ({"extra": {"max_shapes": "bad"}}, "extra.max_shapes: bad shape spec 'bad' (use name:1x3x224x224)"),
    ({"extra": {"builder_optimization_level": 6}}, "extra.builder_optimization_level: must be 0 to 5, got 6"),
    ({"extra": {"build_timeout": 0}}, "extra.build_timeout: must be > 0 seconds"),
    ({"extra": {"dla_core": -1}}, "extra.dla_core: must be >= 0, got -1"),
])
def test_bad_options_are_refused_in_one_line(kwargs, message):
    with pytest.raises(BadInputError) as caught:
        BuildOptions(**kwargs)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_valid_options_are_kept_as_given():
    opts = BuildOptions("fp16", threads=2, batch=4, runtime="best",
                        extra={"device": "cuda:1", "max_shapes": "input:8x3", "dla_core": 0})
    assert (opts.precision, opts.threads, opts.batch, opts.runtime) == ("fp16", 2, 4, "best")
    assert opts.extra == {"device": "cuda:1", "max_shapes": "input:8x3", "dla_core": 0}  # text parsed when read
    assert BuildExtras(max_shapes="input:1x3", ssh_port=65535).max_shapes == "input:1x3"
