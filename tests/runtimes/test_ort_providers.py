"""ONNX Runtime's execution providers (runtimes/ort_providers.py): the TensorRT and CUDA provider
options a target and the build options give, the paths recorded relative to the engine folder and
resolved where it is loaded, a missing provider named with those available, and the warm-up that
fills the TensorRT EP's engine cache. Only the CPU provider runs here; the GPU providers' options
are checked as data."""
from __future__ import annotations

import numpy as np
import pytest

from edgekit.errors import BadInputError, UnavailableError
from edgekit.runtimes.base import BuildOptions
from edgekit.targets import load_target


def test_ort_tensorrt_and_cuda_options(tmp_path):
    from edgekit.runtimes import ort_providers as op

    opts = op.tensorrt_options("int8", tmp_path / "c", {"workspace_mb": 1024, "dla_core": 1, "device_id": 0,
                                                        "trt_shapes": {"input": {"min": [1, 3], "opt": [2, 3],
                                                                                 "max": [4, 3]}}},
                               load_target("jetson-agx-orin-64"))
    assert opts == {"device_id": 0, "trt_fp16_enable": False, "trt_int8_enable": True,
                    "trt_engine_cache_enable": True, "trt_engine_cache_path": str(tmp_path / "c"),
                    "trt_timing_cache_enable": True, "trt_timing_cache_path": str(tmp_path / "c"),
                    "trt_max_workspace_size": 1024 << 20, "trt_dla_enable": True, "trt_dla_core": 1,
                    "trt_profile_min_shapes": "input:1x3", "trt_profile_opt_shapes": "input:2x3",
                    "trt_profile_max_shapes": "input:4x3"}
    with pytest.raises(BadInputError, match="DLA core 2 does not exist"):
        op.tensorrt_options("fp16", tmp_path, {"dla_core": 2}, load_target("jetson-agx-orin-64"))
    with pytest.raises(BadInputError, match="not 'fp8'"):
        op.tensorrt_options("fp8", tmp_path)
    assert op.cuda_options({"gpu_mem_limit_mb": 256})["gpu_mem_limit"] == 256 << 20
    providers = op.provider_list([op.TRT_EP, op.CUDA_EP, op.CPU_EP], "fp16", tmp_path / "engine")
    assert providers[0][0] == op.TRT_EP and providers[0][1]["trt_fp16_enable"] is True
    assert providers[1][0] == op.CUDA_EP and providers[2] == op.CPU_EP
    rec = op.recorded_options(providers, tmp_path / "engine")
    assert rec[op.TRT_EP]["trt_engine_cache_path"] == "./trt_cache"
    assert op.resolve_options(rec, tmp_path / "moved")[op.TRT_EP]["trt_engine_cache_path"] == \
        str((tmp_path / "moved").resolve() / "trt_cache")


def test_ort_missing_provider_names_available():
    from edgekit.runtimes import ort_providers as op

    with pytest.raises(UnavailableError, match=r"'TensorrtExecutionProvider' requested by 'jetson-agx-orin-64' is not "
                                               r"available .*available providers are: .*CPUExecutionProvider"):
        op.require_providers([op.TRT_EP, op.CPU_EP], target_name="jetson-agx-orin-64")
    assert op.require_providers([op.CPU_EP]) == [op.CPU_EP]


def test_warm_ep_cache_runs_one_inference(tiny_onnx, tmp_path):
    import onnxruntime as ort

    from edgekit.runtimes import ort_providers as op

    sess = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    (tmp_path / op.TRT_CACHE_DIR).mkdir()
    (tmp_path / op.TRT_CACHE_DIR / "model_fp16.engine").write_bytes(b"x")
    info = op.warm_ep_cache(sess, {"input": np.zeros((1, 3, 16, 16), np.float32)}, tmp_path)
    assert info["warmup_inference_seconds"] >= 0 and info["trt_cache_files"] == ["model_fp16.engine"]


def test_ort_build_and_load_providers(tmp_path):
    from edgekit.runtimes import ort_providers as op

    arg, rec = op.build_providers([op.CPU_EP], BuildOptions("fp32"), tmp_path)
    assert arg == [op.CPU_EP] and rec == {}  # a CPU target is unchanged
    arg, rec = op.build_providers([op.TRT_EP, op.CUDA_EP, op.CPU_EP], BuildOptions("fp16", extra={"workspace_mb": 64}),
                                  tmp_path / "e", load_target("l4"))
    assert rec[op.TRT_EP]["trt_engine_cache_path"] == "./trt_cache" and rec[op.TRT_EP]["trt_max_workspace_size"] == 64 << 20
    loaded = op.load_providers([op.TRT_EP, op.CUDA_EP, op.CPU_EP], rec, tmp_path / "moved")
    assert loaded[0][1]["trt_timing_cache_path"] == str((tmp_path / "moved").resolve() / "trt_cache")
    assert loaded[1][0] == op.CUDA_EP and loaded[2] == op.CPU_EP
