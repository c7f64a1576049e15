"""What a TensorRT build is asked to do (runtimes/tensorrt/settings.py): precisions and DLA cores
checked against the target, Q/DQ graphs built strongly typed, dynamic axes given sizes, and the
exact trtexec command line. No TensorRT runs: the settings are data."""
from __future__ import annotations

import numpy as np
import pytest
from test_runtime import _onnx  # the small ONNX graphs the TensorRT tests build

from edgekit.errors import BadInputError
from edgekit.runtimes.base import BuildOptions
from edgekit.runtimes.tensorrt.settings import TrtSettings, settings_for, trtexec_argv
from edgekit.targets import load_target


def test_unsupported_precision_lists_target_precisions(tmp_path):
    onnx_path = _onnx(tmp_path / "m.onnx")
    with pytest.raises(BadInputError, match=r"target 'jetson-agx-orin-64' does not support precision 'fp8' "
                                            r"\(choose from fp32, tf32, fp16, bf16, int8\)"):
        settings_for(onnx_path, load_target("jetson-agx-orin-64"), BuildOptions(precision="fp8"))
    with pytest.raises(BadInputError, match="unknown TensorRT precision 'int4'"):
        settings_for(onnx_path, load_target("h100-sxm"), BuildOptions(precision="int4"))
    with pytest.raises(BadInputError, match="has no NVIDIA GPU"):
        settings_for(onnx_path, load_target("cpu"), BuildOptions(precision="fp16"))
    assert settings_for(onnx_path, load_target("h100-sxm"), BuildOptions(precision="fp8")).precision == "fp8"


def test_dla_checks(tmp_path):
    onnx_path = _onnx(tmp_path / "m.onnx")
    with pytest.raises(BadInputError, match="has no DLA"):
        settings_for(onnx_path, load_target("jetson-orin-nano-8"), BuildOptions("fp16", extra={"dla_core": 0}))
    with pytest.raises(BadInputError, match=r"DLA core 2 does not exist on 'jetson-agx-orin-64' \(choose from 0, 1\)"):
        settings_for(onnx_path, load_target("jetson-agx-orin-64"), BuildOptions("fp16", extra={"dla_core": 2}))
    with pytest.raises(BadInputError, match="the DLA runs fp16 or int8 only"):
        settings_for(onnx_path, load_target("jetson-agx-orin-64"), BuildOptions("fp32", extra={"dla_core": 0}))


def test_exact_trtexec_command_line_fp16_dla(tmp_path):
    onnx_path = _onnx(tmp_path / "m.onnx")
    s = settings_for(onnx_path, load_target("jetson-agx-orin-64"),
                           BuildOptions("fp16", batch=2, extra={"dla_core": 1, "workspace_mb": 2048, "max_batch": 8}))
    assert trtexec_argv(s, onnx="onnx/model.onnx") == [
        "trtexec", "--onnx=onnx/model.onnx", "--saveEngine=model.plan", "--fp16",
        "--minShapes=input:1x4", "--optShapes=input:2x4", "--maxShapes=input:8x4",
        "--memPoolSize=workspace:2048", "--timingCacheFile=timing.cache",
        "--useDLACore=1", "--allowGPUFallback",
        "--profilingVerbosity=detailed", "--exportLayerInfo=results/trtexec_layers.json",
        "--exportProfile=results/trtexec_profile.json", "--exportTimes=results/trtexec_times.json",
        "--separateProfileRun", "--dumpProfile", "--warmUp=200", "--duration=3", "--iterations=100"]


def test_qdq_graph_is_strongly_typed_for_int8(tmp_path):
    onnx_path = _onnx(tmp_path / "q.onnx", qdq=True)
    s = settings_for(onnx_path, load_target("h100-sxm"), BuildOptions("int8"))
    assert s.has_qdq and s.strongly_typed and s.precision_flags() == []
    argv = trtexec_argv(s)
    assert "--stronglyTyped" in argv and not {"--int8", "--fp16"} & set(argv)
    # fp16 on a Q/DQ graph: weakly typed, with INT8 enabled so the Q/DQ layers can run
    s16 = settings_for(onnx_path, load_target("h100-sxm"), BuildOptions("fp16"))
    assert not s16.strongly_typed and trtexec_argv(s16)[3:5] == ["--fp16", "--int8"]
    assert "--best" in trtexec_argv(TrtSettings("best")) and "--noTF32" in trtexec_argv(TrtSettings("fp32"))


def test_dynamic_axes_need_sizes(tmp_path):
    onnx_path = _onnx(tmp_path / "s.onnx", seq=True)
    target = load_target("l4")
    with pytest.raises(BadInputError, match=r"input 'input' axis 1 \('sequence'\) is dynamic and has no size"):
        settings_for(onnx_path, target, BuildOptions("fp16"))
    s = settings_for(onnx_path, target, BuildOptions("fp16", extra={"dims": {"sequence": 128}}))
    assert s.shapes == {"input": {"min": [1, 128, 4], "opt": [1, 128, 4], "max": [1, 128, 4]}}
    feeds = {"input": np.zeros((1, 64, 4), np.float32)}
    s = settings_for(onnx_path, target, BuildOptions("fp16", extra={"feeds": feeds, "max_batch": 4}))
    assert s.shapes["input"]["opt"] == [1, 64, 4] and s.shapes["input"]["max"] == [4, 64, 4]
    s = settings_for(onnx_path, target, BuildOptions("fp16", extra={
        "min_shapes": "input:1x1x4", "opt_shapes": "input:1x32x4", "max_shapes": {"input": [2, 256, 4]}}))
    assert s.shapes["input"] == {"min": [1, 1, 4], "opt": [1, 32, 4], "max": [2, 256, 4]}
