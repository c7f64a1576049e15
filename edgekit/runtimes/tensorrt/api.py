"""The TensorRT Python API path: build an engine with ``tensorrt`` (TensorRT 10), and run
it (``TensorRTEngine``, buffers as torch CUDA tensors).

Written against the documented API and tested against a fake ``tensorrt`` module that
implements exactly these calls; not run on real TensorRT where edgekit is developed.
"""
from __future__ import annotations

import contextlib
import re
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from edgekit.artifact import atomic_write_bytes, atomic_write_text
from edgekit.errors import BadInputError
from edgekit.runtimes.base import CheckedEngine, NodeTiming
from edgekit.runtimes.tensorrt.parsers import LAYERS_JSON, LayerTime, nodes_from_trtexec, read_layer_info
from edgekit.runtimes.tensorrt.settings import ENGINE_FILE, RESULTS_DIR, TrtSettings
from edgekit.sources.handle import InputSpec

# --- the Python API path ------------------------------------------------------------------

UNSUPPORTED_OP = re.compile(r"No importer registered for op:?\s*([A-Za-z0-9_.:]+)")


def _parser_errors(parser: Any) -> tuple[str | None, list[str]]:
    op = None
    msgs = []
    for i in range(int(parser.num_errors)):
        err = parser.get_error(i)
        desc = str(err.desc()) if hasattr(err, "desc") else str(err)
        node_op = str(err.node_operator()) if hasattr(err, "node_operator") else ""
        node_name = str(err.node_name()) if hasattr(err, "node_name") else ""
        m = UNSUPPORTED_OP.search(desc)
        if op is None and (m or "unsupported" in desc.lower() or "no importer" in desc.lower()):
            op = m.group(1).rstrip(".:") if m else (node_op or None)
        msgs.append(f"{node_op or '?'} node {node_name or '?'}: {desc}")
    return op, msgs


def build_with_api(trt: ModuleType, onnx_path: Path, settings: TrtSettings, out_dir: Path,
                   timing_cache: Path | None) -> dict[str, Any]:
    """Build with the TensorRT 10 Python API; write model.plan, the timing cache and the
    engine inspector's layer JSON. Returns notes (DLA fallback layers, timings)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if settings.strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        op, msgs = _parser_errors(parser)
        head = f"unsupported op {op!r}" if op else "parse error"
        raise BadInputError(f"TensorRT's ONNX parser rejects {onnx_path.name}: {head} ({'; '.join(msgs[:3]) or 'no detail'})")
    config = builder.create_builder_config()
    if settings.workspace_mb:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(settings.workspace_mb) << 20)
    for name in settings.precision_flags():
        config.set_flag(getattr(trt.BuilderFlag, name))
    if settings.precision == "fp32" and not settings.strongly_typed:
        config.clear_flag(trt.BuilderFlag.TF32)
    if settings.builder_optimization_level is not None:
        config.builder_optimization_level = settings.builder_optimization_level
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    blob = timing_cache.read_bytes() if timing_cache is not None and timing_cache.is_file() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, False)
    fallback: list[str] = []
    if settings.dla_core is not None:
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = settings.dla_core
        if settings.gpu_fallback:
            config.set_flag(trt.BuilderFlag.GPU_FALLBACK)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if not config.can_run_on_DLA(layer):
                fallback.append(layer.name)
        if fallback and not settings.gpu_fallback:
            raise BadInputError(f"{len(fallback)} layers cannot run on the DLA ({', '.join(fallback[:5])}) and GPU "
                                "fallback is off")
    if settings.shapes:
        profile = builder.create_optimization_profile()
        for name, s in settings.shapes.items():
            profile.set_shape(name, tuple(s["min"]), tuple(s["opt"]), tuple(s["max"]))
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    build_s = time.perf_counter() - t0
    if serialized is None:
        raise BadInputError(f"TensorRT could not build an engine from {onnx_path.name} with {settings.precision} "
                            "(see the TensorRT log above)")
    plan = bytes(memoryview(serialized))
    atomic_write_bytes(out_dir / ENGINE_FILE, plan)
    if timing_cache is not None:
        atomic_write_bytes(timing_cache, bytes(memoryview(config.get_timing_cache().serialize())))
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is not None:
        inspector = engine.create_engine_inspector()
        info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
        atomic_write_text(out_dir / RESULTS_DIR / LAYERS_JSON, str(info))
    return {"build_seconds": round(build_s, 3), "dla_fallback_layers": fallback}


# --- the engine (API path) -------------------------------------------------------------------

class TensorRTEngine(CheckedEngine):
    """A deserialized engine run with the TensorRT 10 API, buffers held as torch CUDA tensors.

    timed_run returns GPU compute time (CUDA events around ``execute_async_v3``), like
    trtexec's "GPU Compute Time"; inputs are staged on the GPU once per feed dict.
    Written against the documented API; not run on real TensorRT here.
    """

    runtime = "tensorrt"

    def __init__(self, trt: ModuleType, plan: Path, inputs: list[InputSpec], outputs: list[str]) -> None:
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self.logger)
        self.engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise BadInputError(f"TensorRT cannot deserialize {plan}: it was built for another GPU or TensorRT "
                                "version; rebuild it here with `edgekit build`")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.inputs = inputs
        self.outputs = outputs
        self.plan = plan
        self.path = plan
        self._staged: tuple[int, dict[str, Any], dict[str, Any]] | None = None

    def _stage(self, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        key = id(feeds)
        if self._staged is not None and self._staged[0] == key:
            return self._staged[2]
        trt = self.trt
        bufs: dict[str, Any] = {}
        for name, arr in feeds.items():
            t = torch.from_numpy(np.ascontiguousarray(arr)).cuda()
            self.context.set_input_shape(name, tuple(arr.shape))
            self.context.set_tensor_address(name, t.data_ptr())
            bufs[name] = t
        outs = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            np_dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(name)))
            t = torch.from_numpy(np.empty(shape, np_dtype)).cuda()
            self.context.set_tensor_address(name, t.data_ptr())
            outs[name] = t
        self._staged = (key, bufs, outs)
        return outs

    @property
    def settings(self) -> dict[str, Any]:
        return {"engine": self.plan.name, "staged_on": "cuda"}

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outs = self._stage(feeds)
        self.context.execute_async_v3(self.stream.cuda_stream)
        self.stream.synchronize()
        return [outs[n].cpu().numpy() for n in self.outputs]

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        self._stage(feeds)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        self.context.execute_async_v3(self.stream.cuda_stream)
        end.record(self.stream)
        end.synchronize()
        return float(start.elapsed_time(end))

    def profile_nodes(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        trt = self.trt
        times: dict[str, list[float]] = {}

        class _Profiler(trt.IProfiler):  # type: ignore[name-defined]
            def __init__(self) -> None:
                trt.IProfiler.__init__(self)

            def report_layer_time(self, layer_name: str, ms: float) -> None:
                times.setdefault(layer_name, []).append(float(ms))

        self._stage(feeds)
        self.context.profiler = _Profiler()
        try:
            for _ in range(max(1, iterations)):
                self.context.execute_async_v3(self.stream.cuda_stream)
                self.stream.synchronize()
        finally:
            with contextlib.suppress(TypeError, AttributeError):
                self.context.profiler = None
        layer_times = [LayerTime(n, sum(v), sum(v) / len(v), float(np.median(v)), 0.0) for n, v in times.items()]
        inspector = self.engine.create_engine_inspector()
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "layers.json"
            p.write_text(str(inspector.get_engine_information(trt.LayerInformationFormat.JSON)))
            try:
                info = read_layer_info(p)
            except BadInputError:
                info = None
        return nodes_from_trtexec(layer_times, info)

    def token_decoder(self, max_length: int) -> None:
        return None  # no KV-cache generation loop in this runtime

    def close(self) -> None:
        self._staged = None
        self.context = None
        self.engine = None

