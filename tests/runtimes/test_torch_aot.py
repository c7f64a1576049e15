"""The PyTorch-native engine (torch.export + AOTInductor), issue 8.

AOTInductor compiles C++ even for a tiny MLP: ~20 s on an idle 2-core machine, 40 s on
a busy one, so the build tests are ``slow`` (one compile each, shared by a module
fixture). The error paths and the profiler parsing run without compiling.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgekit.errors import BadInputError, UnavailableError
from edgekit.runtimes.base import BuildOptions
from edgekit.runtimes.torch_aot import RUNTIME, device_for, kernel_timings


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def test_registered_and_available_here() -> None:
    from edgekit.runtimes import get_runtime

    assert get_runtime("torch") is RUNTIME
    ok, why = RUNTIME.available()
    assert ok, why


def test_device_from_target_kind() -> None:
    assert device_for(SimpleNamespace(kind="cpu")) == "cpu"
    assert device_for(SimpleNamespace(kind="gpu")) == "cuda"
    assert device_for(SimpleNamespace(kind="jetson")) == "cuda"
    assert device_for(SimpleNamespace(kind="gpu"), BuildOptions(extra={"device": "cpu"})) == "cpu"
    with pytest.raises(BadInputError, match="unknown device 'tpu'"):
        device_for(SimpleNamespace(kind="cpu"), BuildOptions(extra={"device": "tpu"}))


def test_uncapturable_model_names_the_reason_and_suggests_onnxruntime(tmp_path: Path) -> None:
    import torch

    from edgekit.sources.handle import InputSpec, ModelHandle

    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # control flow on a tensor value: torch.export cannot capture it
                return x * 2
            return x - 1

    handle = ModelHandle(name="branchy", source="tests", module=DataDependent(),
                         inputs=[InputSpec("x", ("batch", 4))], dynamic_axes={"x": {0: "batch"}})
    with pytest.raises(BadInputError, match=r"torch.export cannot capture model 'branchy': .*--runtime onnxruntime"):
        RUNTIME.build(handle, SimpleNamespace(kind="cpu", name="cpu"), tmp_path, BuildOptions())


def test_onnx_only_model_and_bad_precision(tiny_onnx: Path, tiny_mlp, tmp_path: Path) -> None:
    from edgekit.loading import load_model

    with pytest.raises(BadInputError, match="is an ONNX graph.*--runtime onnxruntime"):
        RUNTIME.build(load_model(str(tiny_onnx)), SimpleNamespace(kind="cpu", name="cpu"), tmp_path, BuildOptions())
    with pytest.raises(BadInputError, match=r"precision 'fp8' is not one of them \(choose from fp32, fp16, bf16"):
        RUNTIME.build(tiny_mlp, SimpleNamespace(kind="cpu", name="cpu"), tmp_path, BuildOptions(precision="fp8"))


@pytest.mark.skipif(_cuda(), reason="checks the no-GPU message")
def test_cuda_target_without_gpu_is_unavailable(tiny_mlp, tmp_path: Path) -> None:
    with pytest.raises(UnavailableError, match="needs CUDA for the torch runtime"):
        RUNTIME.build(tiny_mlp, SimpleNamespace(kind="gpu", name="h100-sxm"), tmp_path, BuildOptions())


def test_kernel_timings_from_profiler_rows() -> None:
    rows = [SimpleNamespace(key="graph_0_cpp_fused_relu_0", count=10, self_cpu_time_total=200.0),
            SimpleNamespace(key="aten::addmm", count=20, self_cpu_time_total=1000.0),
            SimpleNamespace(key="aten::empty", count=10, self_cpu_time_total=5.0),
            SimpleNamespace(key="AOTInductorModel::run", count=10, self_cpu_time_total=9000.0)]
    nodes = kernel_timings(rows, iterations=10, cuda=False)
    assert [n.name for n in nodes] == ["aten::addmm", "graph_0_cpp_fused_relu_0"]
    assert nodes[0].time_ms == pytest.approx(0.1) and nodes[0].calls == 2 and nodes[0].op_type == "MatMul"
    assert nodes[1].op_type == "FusedKernel"
    gpu = [SimpleNamespace(key="triton_poi_fused_add_0", count=5, self_device_time_total=50.0),
           SimpleNamespace(key="cudaLaunchKernel", count=5, self_device_time_total=0.0)]
    g = kernel_timings(gpu, iterations=5, cuda=True, dtype="float16")
    assert len(g) == 1 and g[0].op_type == "Elementwise" and g[0].precision == "fp16"


@pytest.fixture(scope="module")
def cpu_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from conftest import make_tiny_mlp

    from edgekit.build import build_engine

    out = tmp_path_factory.mktemp("torch") / "engine"
    return build_engine(make_tiny_mlp(), "cpu", out, BuildOptions(runtime="torch"))


@pytest.mark.slow
def test_build_run_profile_on_cpu(cpu_engine: Path) -> None:
    import torch
    from conftest import make_tiny_mlp

    from edgekit.artifact import read_manifest
    from edgekit.build import load_engine, load_engine_inputs
    from edgekit.profiling import ProfileConfig, profile_engine

    m = read_manifest(cpu_engine)
    assert m.config["runtime"] == "torch" and m.files["model"] == "model.pt2"
    assert (cpu_engine / "model.pt2").is_file()
    assert m.config["session"]["device"] == "cpu" and m.config["session"]["dynamic_batch"] is True
    assert m.metrics["parity"]["max_abs"] < 1e-5 and m.metrics["compile_seconds"] > 0
    engine = load_engine(cpu_engine, threads=1)
    feeds = load_engine_inputs(cpu_engine)
    ref = make_tiny_mlp().module(torch.from_numpy(feeds["input"])).detach().numpy()
    np.testing.assert_allclose(engine.run(feeds)[0], ref, atol=1e-5)
    four = {"input": np.repeat(feeds["input"], 4, axis=0)}  # the dynamic batch axis
    assert engine.run(four)[0].shape == (4, 10)
    assert engine.timed_run(feeds) > 0
    nodes = engine.node_profile(feeds, 3)
    assert any("cpp_fused" in n.name for n in nodes)  # compiled kernels are visible to torch.profiler
    with pytest.raises(BadInputError, match="input 'input' has shape"):
        engine.run({"input": np.zeros((1, 3), np.float32)})
    engine.close()
    prof = profile_engine(cpu_engine, ProfileConfig(warmup_ms=10, duration_s=0.2, iterations=10, threads=1,
                                                    node_iterations=2))
    assert prof.runtime == "torch" and prof.latency_ms.p50 > 0 and prof.latency_ms.count >= 10


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs an NVIDIA GPU with CUDA")
def test_build_fp16_on_cuda_with_cuda_event_timing(tiny_mlp, tmp_path: Path) -> None:
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine, load_engine, load_engine_inputs

    d = build_engine(tiny_mlp, "h100-sxm", tmp_path / "e", BuildOptions(runtime="torch", precision="fp16"))
    m = read_manifest(d)
    assert m.config["session"]["device"] == "cuda" and m.config["session"]["dtype"] == "float16"
    engine = load_engine(d)
    feeds = load_engine_inputs(d)
    assert engine.run(feeds)[0].shape == (1, 10)
    assert engine.timed_run(feeds) > 0  # CUDA events
    assert engine.node_profile(feeds, 3)  # CUDA kernels
