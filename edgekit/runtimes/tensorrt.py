"""TensorRT engines: the ``tensorrt`` Python API, ``trtexec`` (local or over SSH), or a build bundle.

``RUNTIME.build(onnx, target, out_dir, options)`` takes the first of these that can build
*for the target's GPU*:

(a) **Python API** (TensorRT 10): ``Builder`` -> network (``STRONGLY_TYPED`` when the graph
    has Q/DQ nodes and explicit quantization decides the types) -> ``OnnxParser`` (an
    unsupported op is named in the error) -> builder config (precision flags, workspace
    pool limit, timing cache loaded and saved, DLA core + ``GPU_FALLBACK``, detailed
    profiling verbosity, one optimization profile from the dynamic axes) ->
    ``build_serialized_network`` -> engine inspector JSON for per-layer precision.
(b) **trtexec**, locally or on the device over SSH (``extra["remote"] = "user@host"``), with
    the command line of ``trtexec_argv`` (build, then a timed run with per-layer profile,
    layer info and per-inference times exported as JSON).
(c) otherwise a **build bundle**: the ONNX file, ``build.sh`` running exactly the same
    trtexec command on the device, a README and a manifest of kind ``bundle``. After the
    device ran ``build.sh``, ``edgekit profile BUNDLE_DIR`` reads the JSON it wrote.

The local API/trtexec paths are used only when this machine's GPU has the target's SM
(an engine runs only on the GPU architecture and TensorRT version it was built with);
built engines are cached by ``edgekit.engine_cache.EngineKey``.

What was verified: (a) against a fake ``tensorrt`` module implementing exactly the calls
made here; (b) against a fake ``trtexec`` script (locally and over a loopback sshd); (c)
by its contents and command line. None of it has run on real TensorRT (it cannot be
installed on the machines this was written on); see docs/tensorrt.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError, UnavailableError
from edgekit.runtimes.base import BuildOptions, NodeTiming, check_feeds, resolve_onnx
from edgekit.runtimes.trt_parsers import LAYERS_JSON, PROFILE_JSON, TIMES_JSON

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8", "fp8", "best")
ENGINE_FILE = "model.plan"
TIMING_CACHE_FILE = "timing.cache"
RESULTS_DIR = "results"
BUILD_SCRIPT = "build.sh"
README = "README.md"
DEVICE_FILE = "device.txt"  # what build.sh / the probe saw on the building machine
PATHS = ("api", "trtexec", "bundle")
# trtexec's own measurement defaults (../shared/facts.md): warm-up 200 ms, >= 3 s, >= 100 iterations.
WARMUP_MS = 200
DURATION_S = 3
ITERATIONS = 100
# Abstract precision flags -> trtexec flags (API: getattr(trt.BuilderFlag, name)).
_TRTEXEC_FLAG = {"FP16": "--fp16", "BF16": "--bf16", "INT8": "--int8", "FP8": "--fp8"}
_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
# On JetPack, trtexec is not on PATH.
JETSON_TRTEXEC = "/usr/src/tensorrt/bin/trtexec"

PROBE_SH = r"""
T="${EDGEKIT_TRTEXEC:-trtexec}"
if ! command -v "$T" >/dev/null 2>&1 && [ -x /usr/src/tensorrt/bin/trtexec ]; then T=/usr/src/tensorrt/bin/trtexec; fi
echo "gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
echo "compute_cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1)"
echo "board=$(tr -d '\0' < /proc/device-tree/model 2>/dev/null)"
if command -v "$T" >/dev/null 2>&1; then
  echo "trtexec=$(command -v "$T")"
  echo "trtexec_banner=$("$T" --help 2>&1 | grep -o 'TensorRT v[0-9]*' | head -n1)"
fi
echo "py_tensorrt=$(python3 -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null)"
"""


# --- the device: GPU, SM, TensorRT -------------------------------------------------------

@dataclass
class DeviceInfo:
    gpu: str | None = None
    sm: str | None = None
    tensorrt_version: str | None = None
    trtexec: str | None = None
    python_tensorrt: str | None = None
    board: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_probe(text: str) -> DeviceInfo:
    """Parse PROBE_SH's ``key=value`` lines."""
    kv = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            kv[k.strip()] = v.strip()
    info = DeviceInfo(gpu=kv.get("gpu") or None, trtexec=kv.get("trtexec") or None,
                      python_tensorrt=kv.get("py_tensorrt") or None, board=kv.get("board") or None)
    cc = kv.get("compute_cap", "")
    if re.fullmatch(r"\d+\.\d+", cc):
        major, minor = cc.split(".")
        info.sm = f"sm_{major}{minor}"
    board = info.board or ""
    if info.sm is None and "orin" in board.lower():
        info.sm = "sm_87"  # every Jetson Orin module
        info.gpu = info.gpu or board
    banner = re.search(r"v(\d+)", kv.get("trtexec_banner", ""))
    if banner:
        info.tensorrt_version = trt_version_from_int(int(banner.group(1)))
    if info.python_tensorrt:
        info.tensorrt_version = info.tensorrt_version or info.python_tensorrt
    return info


def trt_version_from_int(v: int) -> str:
    """trtexec's banner ``TensorRT v100300`` -> ``10.3.0`` (``v8601`` -> ``8.6.1``)."""
    if v >= 10000:  # TensorRT >= 10: MMmmpp
        return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
    return f"{v // 1000}.{(v // 100) % 10}.{v % 100}"  # TensorRT 8: Mmpp


def probe_local(trtexec: str | None = None) -> DeviceInfo:
    env = dict(os.environ)
    if trtexec:
        env["EDGEKIT_TRTEXEC"] = trtexec
    try:
        out = subprocess.run(["bash", "-c", PROBE_SH], capture_output=True, text=True, timeout=60, env=env).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    info = parse_probe(out)
    trt = _import_tensorrt()
    if trt is not None:
        info.python_tensorrt = str(getattr(trt, "__version__", "unknown"))
        info.tensorrt_version = info.python_tensorrt
    return info


def _import_tensorrt() -> Any:
    try:
        import tensorrt as trt  # noqa: PLC0415
    except Exception:  # ImportError, or a broken install (missing libnvinfer)
        return None
    return trt


# --- settings and the trtexec command line ------------------------------------------------

@dataclass(frozen=True)
class TrtSettings:
    """Everything that decides what engine gets built (and so goes into the cache key)."""

    precision: str
    strongly_typed: bool = False
    has_qdq: bool = False
    shapes: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # dynamic inputs only
    workspace_mb: int | None = None
    dla_core: int | None = None
    gpu_fallback: bool = False
    builder_optimization_level: int | None = None
    warmup_ms: int = WARMUP_MS
    duration_s: int = DURATION_S
    iterations: int = ITERATIONS

    def precision_flags(self) -> list[str]:
        """Abstract builder flags ("FP16", "INT8", ...). None in a strongly typed network:
        there the graph's own types (and Q/DQ) decide, and TensorRT rejects precision flags."""
        if self.strongly_typed:
            return []
        flags = {"fp32": [], "tf32": [], "fp16": ["FP16"], "bf16": ["BF16"], "int8": ["INT8"], "fp8": ["FP8"],
                 "best": ["FP16", "BF16", "INT8", "FP8"]}[self.precision]
        if self.has_qdq and "INT8" not in flags and self.precision != "fp8":
            flags = flags + ["INT8"]  # a weakly typed network with Q/DQ needs INT8 enabled
        return flags

    def build_flags(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("shapes")
        d.pop("precision")
        d["precision_flags"] = self.precision_flags()
        return d

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "precision_flags": self.precision_flags()}


def _shape_arg(shapes: dict[str, dict[str, list[int]]], which: str) -> str:
    parts = []
    for name, s in shapes.items():
        quoted = f"'{name}'" if any(c in name for c in ":,'") else name
        parts.append(f"{quoted}:{'x'.join(str(d) for d in s[which])}")
    return ",".join(parts)


def trtexec_argv(settings: TrtSettings, *, onnx: str = "model.onnx", engine: str = ENGINE_FILE,
                 results: str = RESULTS_DIR, timing_cache: str = TIMING_CACHE_FILE,
                 trtexec: str = "trtexec") -> list[str]:
    """The exact trtexec command: build (precision, strongly typed, shapes, workspace, timing
    cache, DLA), then time it the trtexec/MLPerf way and export per-layer info, per-layer
    profile (separate profiling run) and per-inference times as JSON.

    >>> trtexec_argv(TrtSettings("fp16"))[:4]
    ['trtexec', '--onnx=model.onnx', '--saveEngine=model.plan', '--fp16']
    """
    argv = [trtexec, f"--onnx={onnx}", f"--saveEngine={engine}"]
    if settings.strongly_typed:
        argv.append("--stronglyTyped")
    else:
        argv += [_TRTEXEC_FLAG[f] for f in settings.precision_flags()]
        if settings.precision == "best":
            argv = [a for a in argv if a not in _TRTEXEC_FLAG.values()] + ["--best"]
        if settings.precision == "fp32":
            argv.append("--noTF32")
    if settings.shapes:
        argv += [f"--minShapes={_shape_arg(settings.shapes, 'min')}", f"--optShapes={_shape_arg(settings.shapes, 'opt')}",
                 f"--maxShapes={_shape_arg(settings.shapes, 'max')}"]
    if settings.workspace_mb:
        argv.append(f"--memPoolSize=workspace:{int(settings.workspace_mb)}")
    if settings.builder_optimization_level is not None:
        argv.append(f"--builderOptimizationLevel={settings.builder_optimization_level}")
    argv.append(f"--timingCacheFile={timing_cache}")
    if settings.dla_core is not None:
        argv.append(f"--useDLACore={settings.dla_core}")
        if settings.gpu_fallback:
            argv.append("--allowGPUFallback")
    argv += ["--profilingVerbosity=detailed",
             f"--exportLayerInfo={results}/{LAYERS_JSON}", f"--exportProfile={results}/{PROFILE_JSON}",
             f"--exportTimes={results}/{TIMES_JSON}", "--separateProfileRun", "--dumpProfile",
             f"--warmUp={settings.warmup_ms}", f"--duration={settings.duration_s}",
             f"--iterations={settings.iterations}"]
    return argv


def onnx_facts(onnx_path: Path) -> tuple[list[tuple[str, list[int | str], str]], bool]:
    """The graph's real inputs (name, dims with dim_param names for dynamic axes, elem type)
    and whether it holds Q/DQ nodes (including inside functions)."""
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    init = {i.name for i in m.graph.initializer}
    inputs = []
    for vi in m.graph.input:
        if vi.name in init:
            continue
        dims: list[int | str] = []
        for d in vi.type.tensor_type.shape.dim:
            dims.append(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?"))
        inputs.append((vi.name, dims, onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)))
    ops = {n.op_type for n in m.graph.node}
    for f in m.functions:
        ops |= {n.op_type for n in f.node}
    return inputs, bool(ops & _QDQ_OPS)


def _parse_shape_spec(spec: Any) -> dict[str, list[int]]:
    """``"input:1x3x224x224,mask:1x128"`` or ``{"input": [1, 3, 224, 224]}`` -> dict."""
    if isinstance(spec, dict):
        return {str(k): [int(x) for x in v] for k, v in spec.items()}
    out = {}
    for part in str(spec).split(","):
        name, _, dims = part.strip().rpartition(":")
        if not name or not dims:
            raise BadInputError(f"bad shape spec {part!r} (use name:1x3x224x224)")
        try:
            out[name.strip("'")] = [int(x) for x in dims.split("x")]
        except ValueError:
            raise BadInputError(f"bad shape spec {part!r} (use name:1x3x224x224)") from None
    return out


def optimization_shapes(inputs: list[tuple[str, list[int | str], str]], options: BuildOptions) -> dict[str, dict[str, list[int]]]:
    """min/opt/max for every input with a dynamic axis.

    Explicit ``extra["min_shapes"|"opt_shapes"|"max_shapes"]`` (trtexec syntax or dicts) win.
    Otherwise: a dynamic axis 0 is the batch: min 1, opt ``options.batch``, max
    ``extra["max_batch"]`` (default: opt). Other dynamic axes take ``extra["dims"][name]``
    or the size in the sample feeds, as min = opt = max.
    """
    extra = options.extra
    explicit = {w: _parse_shape_spec(extra[f"{w}_shapes"]) for w in ("min", "opt", "max") if extra.get(f"{w}_shapes")}
    feeds = extra.get("feeds") or {}
    dims_given = {str(k): int(v) for k, v in (extra.get("dims") or {}).items()}
    max_batch = int(extra.get("max_batch") or options.batch)
    if max_batch < options.batch:
        raise BadInputError(f"max_batch {max_batch} is below the batch {options.batch}")
    out: dict[str, dict[str, list[int]]] = {}
    for name, dims, _ in inputs:
        if not any(isinstance(d, str) for d in dims):
            continue
        if explicit:
            missing = [w for w in ("min", "opt", "max") if name not in explicit.get(w, {})]
            if missing:
                raise BadInputError(f"input {name!r} has dynamic axes but no {'/'.join(missing)} shape given "
                                    f"(give min_shapes, opt_shapes and max_shapes for every dynamic input)")
            out[name] = {w: explicit[w][name] for w in ("min", "opt", "max")}
            continue
        s: dict[str, list[int]] = {"min": [], "opt": [], "max": []}
        feed = feeds.get(name)
        for axis, d in enumerate(dims):
            if isinstance(d, int):
                lo = opt = hi = d
            elif axis == 0:
                lo, opt, hi = 1, options.batch, max_batch
            elif d in dims_given:
                lo = opt = hi = dims_given[d]
            elif feed is not None and np.ndim(feed) > axis:
                lo = opt = hi = int(np.shape(feed)[axis])
            else:
                raise BadInputError(f"input {name!r} axis {axis} ({d!r}) is dynamic and has no size: give it with "
                                    f"extra dims={{'{d}': N}} or min/opt/max shapes")
            s["min"].append(lo)
            s["opt"].append(opt)
            s["max"].append(hi)
        out[name] = s
    return out


def check_precision(precision: str, target: Any) -> None:
    if precision not in PRECISIONS:
        from edgekit.errors import bad_choice

        raise bad_choice("TensorRT precision", precision, PRECISIONS)
    if precision == "best":
        lacking = [p for p in ("fp16", "int8") if p not in target.precisions]
        if lacking:
            raise BadInputError(f"target {target.name!r} does not support precision 'best' (it needs fp16 and int8; "
                                f"the target supports {', '.join(target.precisions)})")
        return
    target.require_precision(precision)


def settings_for(onnx_path: Path, target: Any, options: BuildOptions) -> TrtSettings:
    """Validate the request against the target and turn it into TrtSettings."""
    if getattr(target, "kind", None) == "cpu":
        raise BadInputError(f"target {target.name!r} has no NVIDIA GPU; TensorRT needs a GPU target "
                            "(e.g. jetson-agx-orin-64, h100-sxm; see `edgekit targets`)")
    precision = options.precision
    check_precision(precision, target)
    inputs, has_qdq = onnx_facts(onnx_path)
    extra = options.extra
    strongly = extra.get("strongly_typed")
    if strongly is None:
        strongly = has_qdq and precision in ("int8", "fp8", "best")
    dla_core = extra.get("dla_core")
    if dla_core is not None:
        dla_core = int(dla_core)
        cores = int(getattr(target, "dla_cores", 0) or 0)
        if cores == 0:
            raise BadInputError(f"target {target.name!r} has no DLA (dla_cores: 0); drop dla_core")
        if not 0 <= dla_core < cores:
            raise BadInputError(f"DLA core {dla_core} does not exist on {target.name!r} (choose from "
                                f"{', '.join(str(i) for i in range(cores))})")
        if precision not in ("fp16", "int8", "best"):
            raise BadInputError(f"the DLA runs fp16 or int8 only, not {precision!r} (use --precision fp16 or int8)")
    workspace = extra.get("workspace_mb")
    if workspace is not None and int(workspace) <= 0:
        raise BadInputError(f"workspace must be > 0 MB, got {workspace}")
    level = extra.get("builder_optimization_level")
    if level is not None and not 0 <= int(level) <= 5:
        raise BadInputError(f"builder optimization level must be 0-5, got {level}")
    return TrtSettings(precision=precision, strongly_typed=bool(strongly), has_qdq=has_qdq,
                       shapes=optimization_shapes(inputs, options),
                       workspace_mb=int(workspace) if workspace is not None else None, dla_core=dla_core,
                       gpu_fallback=dla_core is not None and bool(extra.get("gpu_fallback", True)),
                       builder_optimization_level=int(level) if level is not None else None,
                       warmup_ms=int(extra.get("warmup_ms", WARMUP_MS)), duration_s=int(extra.get("duration_s", DURATION_S)),
                       iterations=int(extra.get("iterations", ITERATIONS)))


# --- the Python API path ------------------------------------------------------------------

_UNSUPPORTED_OP = re.compile(r"No importer registered for op:?\s*([A-Za-z0-9_.:]+)")


def _parser_errors(parser: Any) -> tuple[str | None, list[str]]:
    op = None
    msgs = []
    for i in range(int(parser.num_errors)):
        err = parser.get_error(i)
        desc = str(err.desc()) if hasattr(err, "desc") else str(err)
        node_op = str(err.node_operator()) if hasattr(err, "node_operator") else ""
        node_name = str(err.node_name()) if hasattr(err, "node_name") else ""
        m = _UNSUPPORTED_OP.search(desc)
        if op is None and (m or "unsupported" in desc.lower() or "no importer" in desc.lower()):
            op = m.group(1).rstrip(".:") if m else (node_op or None)
        msgs.append(f"{node_op or '?'} node {node_name or '?'}: {desc}")
    return op, msgs


def build_with_api(trt: Any, onnx_path: Path, settings: TrtSettings, out_dir: Path,
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
    from edgekit.artifact import atomic_write_bytes, atomic_write_text

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

class TensorRTEngine:
    """A deserialized engine run with the TensorRT 10 API, buffers held as torch CUDA tensors.

    timed_run returns GPU compute time (CUDA events around ``execute_async_v3``), like
    trtexec's "GPU Compute Time"; inputs are staged on the GPU once per feed dict.
    Written against the documented API; not run on real TensorRT here.
    """

    runtime = "tensorrt"

    def __init__(self, trt: Any, plan: Path, inputs: list[Any], outputs: list[str]) -> None:
        import torch

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
        self._staged: tuple[int, dict[str, Any], dict[str, Any]] | None = None

    def _stage(self, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        import torch

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

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        check_feeds(self.inputs, feeds)
        outs = self._stage(feeds)
        self.context.execute_async_v3(self.stream.cuda_stream)
        self.stream.synchronize()
        return [outs[n].cpu().numpy() for n in self.outputs]

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        import torch

        self._stage(feeds)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        self.context.execute_async_v3(self.stream.cuda_stream)
        end.record(self.stream)
        end.synchronize()
        return float(start.elapsed_time(end))

    def node_profile(self, feeds: dict[str, np.ndarray], iterations: int = 20) -> list[NodeTiming]:
        import tempfile

        from edgekit.runtimes.trt_parsers import LayerTime, nodes_from_trtexec, read_layer_info

        trt = self.trt
        times: dict[str, list[float]] = {}

        class _Profiler(trt.IProfiler):  # type: ignore[misc, name-defined]
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

    def close(self) -> None:
        self._staged = None
        self.context = None
        self.engine = None


# --- the runtime --------------------------------------------------------------------------

def _relative_onnx(onnx_path: Path, out_dir: Path) -> tuple[str, Path]:
    """The ONNX file as a path relative to ``out_dir`` (copied in, with external data, if outside)."""
    onnx_path = Path(onnx_path).resolve()
    out_dir = Path(out_dir).resolve()
    try:
        return str(onnx_path.relative_to(out_dir)), onnx_path
    except ValueError:
        pass
    import onnx

    dst_dir = out_dir / "onnx"
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(onnx_path, dst_dir / onnx_path.name)
    m = onnx.load(str(onnx_path), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location" and (onnx_path.parent / e.value).is_file() and not (dst_dir / e.value).exists():
                shutil.copy2(onnx_path.parent / e.value, dst_dir / e.value)
    return f"onnx/{onnx_path.name}", dst_dir / onnx_path.name


def _find_trtexec(extra: dict[str, Any]) -> str | None:
    cand = extra.get("trtexec") or os.environ.get("EDGEKIT_TRTEXEC")
    if cand:
        return shutil.which(str(cand)) or (str(cand) if Path(str(cand)).is_file() else None)
    return shutil.which("trtexec") or (JETSON_TRTEXEC if Path(JETSON_TRTEXEC).is_file() else None)


def _choose_path(target: Any, extra: dict[str, Any]) -> tuple[str, DeviceInfo | None, str]:
    """(path, local device info, why). Local paths only when this GPU has the target's SM."""
    forced = extra.get("trt_path")
    if forced is not None and forced not in PATHS:
        from edgekit.errors import bad_choice

        raise bad_choice("TensorRT build path", forced, PATHS)
    if extra.get("remote"):
        if forced not in (None, "trtexec"):
            raise BadInputError(f"--remote builds with trtexec on the device; it cannot take path {forced!r}")
        return "trtexec", None, f"trtexec on {extra['remote']}"
    if forced == "bundle":
        return "bundle", None, "asked for a build bundle"
    trtexec = _find_trtexec(extra)
    info = probe_local(trtexec)
    has_api = _import_tensorrt() is not None
    same_gpu = bool(info.sm) and info.sm == getattr(target, "sm", None)
    where = f"this machine's GPU is {info.gpu or 'absent'}" + (f" ({info.sm})" if info.sm else "")
    if forced == "api":
        if not has_api:
            raise UnavailableError("the tensorrt Python package is not installed here (pip install tensorrt on a "
                                   "machine with NVIDIA's index, or use JetPack's)")
        return "api", info, "asked for the Python API"
    if forced == "trtexec":
        if trtexec is None:
            raise UnavailableError("trtexec is not on PATH here (nor at /usr/src/tensorrt/bin/trtexec); "
                                   "set EDGEKIT_TRTEXEC or build a bundle")
        info.trtexec = trtexec
        return "trtexec", info, "asked for trtexec"
    if not same_gpu:
        return "bundle", info, f"{where}; target {target.name!r} needs {getattr(target, 'sm', '?')}"
    if has_api:
        return "api", info, "tensorrt Python API, same GPU architecture as the target"
    if trtexec is not None:
        info.trtexec = trtexec
        return "trtexec", info, "trtexec, same GPU architecture as the target"
    return "bundle", info, f"{where} but neither the tensorrt package nor trtexec is installed"


class TensorRTRuntime:
    """The ``tensorrt`` runtime (the Runtime protocol)."""

    name = "tensorrt"
    input_format = "onnx"

    def available(self) -> tuple[bool, str]:
        # Always: without TensorRT here, build writes a bundle for the device.
        if _import_tensorrt() is not None:
            return True, "tensorrt Python API"
        if _find_trtexec({}) is not None:
            return True, "trtexec"
        return True, "no TensorRT here: builds write a build bundle for the device"

    def build(self, model: Any, target: Any, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        hosts: list[Any] = []
        try:
            return self._build(model, target, out_dir, options, hosts)
        finally:
            for h in hosts:
                h.close()

    def _build(self, model: Any, target: Any, out_dir: Path, options: BuildOptions, hosts: list[Any]) -> dict[str, Any]:
        from edgekit.artifact import sha256_file
        from edgekit.engine_cache import EngineCache, EngineKey

        onnx_path = resolve_onnx(model)
        out_dir = Path(out_dir)
        settings = settings_for(onnx_path, target, options)
        path, info, why = _choose_path(target, options.extra)
        rel_onnx, onnx_path = _relative_onnx(onnx_path, out_dir)
        warnings: list[str] = []
        if not settings.has_qdq and settings.precision in ("int8", "best"):
            warnings.append("the graph has no Q/DQ nodes: TensorRT's INT8 without calibration uses placeholder "
                            "ranges (fine for timing, wrong outputs); quantize first (`edgekit compress --bits 8`) "
                            "for explicit quantization")
        remote = options.extra.get("remote")
        trtexec_cmd = options.extra.get("trtexec") or (info.trtexec if info and info.trtexec else "trtexec")
        argv = trtexec_argv(settings, onnx=rel_onnx, trtexec="trtexec")
        config: dict[str, Any] = {
            "path": path, "path_reason": why, "settings": settings.to_dict(),
            "trtexec": {"argv": argv, "command": shlex.join(argv), "cwd": "the engine folder"},
            "target_sm": getattr(target, "sm", None), "target_tensorrt_versions": getattr(target, "tensorrt_versions", None),
            "session": {"engine": ENGINE_FILE},
        }
        if path == "bundle":
            return self._bundle(out_dir, rel_onnx, argv, settings, target, config, warnings)
        if remote:
            from edgekit.remote import RemoteHost

            host = RemoteHost.from_options(remote, options.extra)
            hosts.append(host)
            info = host.probe(trtexec=options.extra.get("trtexec"))
            if not info.trtexec:
                raise UnavailableError(f"{remote} has no TensorRT: no trtexec on PATH or at {JETSON_TRTEXEC} "
                                       "(install JetPack / TensorRT there)")
            trtexec_cmd = info.trtexec
        if info is None:  # _choose_path probes for every path but the bundle, handled above
            raise RuntimeError(f"TensorRT path {path!r} chosen without probing the machine")
        if info.sm and getattr(target, "sm", None) and info.sm != target.sm:
            raise BadInputError(f"{'the remote ' + remote if remote else 'this machine'} has {info.gpu} ({info.sm}); "
                                f"target {target.name!r} is {target.sm}: an engine built there would not run on the target")
        if info.tensorrt_version and not target.tensorrt_version_ok(info.tensorrt_version):
            warnings.append(f"TensorRT {info.tensorrt_version} is outside the target's range "
                            f"{target.tensorrt_versions} (JetPack pins TensorRT; is the target file right?)")
        device = {"gpu": info.gpu, "sm": info.sm, "tensorrt_version": info.tensorrt_version}
        config["device"] = device
        cache = EngineCache(options.extra.get("engine_cache_dir"))
        key = EngineKey(tensorrt_version=str(info.tensorrt_version), gpu=str(info.gpu), sm=str(info.sm),
                        precision=settings.precision, shapes=settings.shapes, flags={**settings.build_flags(), "path": path},
                        onnx_sha256=sha256_file(onnx_path))
        config["cache_key"] = key.digest()
        timing_cache = cache.timing_cache_path(key.tensorrt_version, key.gpu, key.sm)
        hit = cache.lookup(key)
        metrics: dict[str, Any] = {"warnings": warnings}
        if hit is not None:
            for f in hit.rglob("*"):
                if f.is_file() and f.name != "key.json":
                    dst = out_dir / f.relative_to(hit)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dst)
            metrics["engine_cache"] = "hit"
        else:
            metrics["engine_cache"] = "miss"
            (out_dir / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
            if path == "api":
                trt = _import_tensorrt()
                notes = build_with_api(trt, onnx_path, settings, out_dir, timing_cache)
                metrics.update(notes)
            elif remote:
                metrics.update(self._remote_trtexec(host, out_dir, rel_onnx, settings, trtexec_cmd, timing_cache))
            else:
                metrics.update(self._local_trtexec(out_dir, rel_onnx, settings, trtexec_cmd, timing_cache))
            stored = {ENGINE_FILE: out_dir / ENGINE_FILE}
            for f in (out_dir / RESULTS_DIR).glob("*"):
                if f.is_file():
                    stored[f"{RESULTS_DIR}/{f.name}"] = f
            cache.store(key, stored)
        files = {"model": ENGINE_FILE}
        for role, name in (("layers", LAYERS_JSON), ("profile", PROFILE_JSON), ("times", TIMES_JSON)):
            if (out_dir / RESULTS_DIR / name).is_file():
                files[f"trtexec_{role}"] = f"{RESULTS_DIR}/{name}"
        metrics["engine_size_mb"] = round((out_dir / ENGINE_FILE).stat().st_size / 1e6, 3)
        if not metrics["warnings"]:
            metrics.pop("warnings")
        return {"files": files, "config": config, "metrics": metrics}

    # -- the three ways to run trtexec / hand it over --

    def _local_trtexec(self, out_dir: Path, rel_onnx: str, settings: TrtSettings, trtexec: str,
                       timing_cache: Path) -> dict[str, Any]:
        from edgekit.artifact import atomic_write_bytes

        if timing_cache.is_file():
            shutil.copy2(timing_cache, out_dir / TIMING_CACHE_FILE)
        argv = trtexec_argv(settings, onnx=rel_onnx, trtexec=trtexec)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=out_dir, capture_output=True, text=True)
        (out_dir / RESULTS_DIR / "trtexec.log").write_text(proc.stdout + proc.stderr)
        _check_trtexec(proc.returncode, proc.stdout + proc.stderr, out_dir / ENGINE_FILE)
        if (out_dir / TIMING_CACHE_FILE).is_file():
            atomic_write_bytes(timing_cache, (out_dir / TIMING_CACHE_FILE).read_bytes())
            (out_dir / TIMING_CACHE_FILE).unlink()
        return {"build_seconds": round(time.perf_counter() - t0, 3)}

    def _remote_trtexec(self, host: Any, out_dir: Path, rel_onnx: str, settings: TrtSettings, trtexec: str,
                        timing_cache: Path) -> dict[str, Any]:
        from edgekit.artifact import atomic_write_bytes

        t0 = time.perf_counter()
        onnx_local = out_dir / rel_onnx
        uploads = [p for p in onnx_local.parent.iterdir() if p.is_file()]
        with host.workdir() as wd:
            onnx_dir = str(Path(rel_onnx).parent)
            host.put(uploads, f"{wd}/{onnx_dir}")
            if timing_cache.is_file():
                host.put([timing_cache], wd, names=[TIMING_CACHE_FILE])
            argv = trtexec_argv(settings, onnx=rel_onnx, trtexec=trtexec)
            proc = host.run(f"cd {shlex.quote(wd)} && mkdir -p {RESULTS_DIR} && {shlex.join(argv)}",
                            timeout=host.build_timeout, check=False)
            (out_dir / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
            (out_dir / RESULTS_DIR / "trtexec.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                _check_trtexec(proc.returncode, proc.stdout + proc.stderr, out_dir / ENGINE_FILE)
            wanted = [ENGINE_FILE] + [f"{RESULTS_DIR}/{n}" for n in (LAYERS_JSON, PROFILE_JSON, TIMES_JSON)]
            got = host.get(wd, wanted, out_dir, optional=wanted[1:])
            tc = host.get(wd, [TIMING_CACHE_FILE], out_dir / RESULTS_DIR, optional=[TIMING_CACHE_FILE])
        _check_trtexec(0, proc.stdout + proc.stderr, out_dir / ENGINE_FILE)
        if tc:
            atomic_write_bytes(timing_cache, (out_dir / RESULTS_DIR / TIMING_CACHE_FILE).read_bytes())
            (out_dir / RESULTS_DIR / TIMING_CACHE_FILE).unlink()
        return {"build_seconds": round(time.perf_counter() - t0, 3), "remote": host.spec,
                "fetched": sorted(got), "verified_sha256": True}

    def _bundle(self, out_dir: Path, rel_onnx: str, argv: list[str], settings: TrtSettings, target: Any,
                config: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
        from edgekit.artifact import atomic_write_text

        script = bundle_script(argv, target, settings)
        atomic_write_text(out_dir / BUILD_SCRIPT, script)
        os.chmod(out_dir / BUILD_SCRIPT, 0o755)
        atomic_write_text(out_dir / README, bundle_readme(argv, target, settings, rel_onnx, warnings))
        config = {**config, "session": {"engine": ENGINE_FILE, "built": False}}
        return {"kind": "bundle",
                "files": {"script": BUILD_SCRIPT, "readme": README},
                "config": config,
                "metrics": {"warnings": warnings} if warnings else {}}

    # -- load and profile --

    def load(self, engine_dir: Path, manifest: Any, threads: int | None = None) -> TensorRTEngine:
        from edgekit.engine_cache import check_compatible
        from edgekit.sources.handle import InputSpec

        engine_dir = Path(engine_dir)
        plan = engine_dir / ENGINE_FILE
        if not plan.is_file():
            raise BadInputError(f"{engine_dir} holds no {ENGINE_FILE}: it is a build bundle; run its {BUILD_SCRIPT} "
                                f"on the device, copy the folder back, then `edgekit profile {engine_dir}`")
        trt = _import_tensorrt()
        recorded = dict(manifest.config.get("device") or {})
        device_txt = engine_dir / RESULTS_DIR / DEVICE_FILE
        if not recorded and device_txt.is_file():
            d = parse_probe(device_txt.read_text())
            recorded = {"gpu": d.gpu, "sm": d.sm, "tensorrt_version": d.tensorrt_version}
        local = probe_local()
        check_compatible(recorded, {"gpu": local.gpu, "sm": local.sm, "tensorrt_version": local.tensorrt_version},
                         what=f"engine {engine_dir}")
        if trt is None:
            raise UnavailableError(f"running {engine_dir} here needs the tensorrt Python package and an NVIDIA GPU; "
                                   "for an engine built by trtexec, `edgekit profile` reads trtexec's results instead")
        inputs = [InputSpec.from_dict(s) for s in manifest.model.get("inputs", [])]
        outputs = list(manifest.model.get("outputs", []))
        return TensorRTEngine(trt, plan, inputs, outputs)

    def profile(self, engine_dir: Path, manifest: Any = None, top_k: int | None = None) -> Any:
        """A ProfileResult from trtexec's JSON in the folder, or None when there is none."""
        from edgekit.runtimes.trt_parsers import profile_from_folder, trtexec_outputs

        if "times" not in trtexec_outputs(engine_dir):
            if manifest is not None and getattr(manifest, "kind", None) == "bundle":
                raise BadInputError(f"{engine_dir} is a build bundle without results: run its {BUILD_SCRIPT} on the "
                                    f"device (it writes {RESULTS_DIR}/{TIMES_JSON}), copy the folder back, then profile it")
            return None
        return profile_from_folder(engine_dir, top_k=top_k)


def _check_trtexec(rc: int, log: str, engine: Path) -> None:
    if rc == 0 and engine.is_file():
        return
    m = _UNSUPPORTED_OP.search(log)
    if m:
        raise BadInputError(f"TensorRT's ONNX parser rejects the model: unsupported op {m.group(1).rstrip('.:')!r}")
    tail = [ln for ln in log.strip().splitlines() if "error" in ln.lower()][-3:] or log.strip().splitlines()[-3:]
    raise BadInputError(f"trtexec failed (exit {rc}): {' | '.join(tail)[:500] or 'no output'}")


def bundle_script(argv: list[str], target: Any, settings: TrtSettings) -> str:
    """build.sh: find trtexec (PATH, then JetPack's place), record the device, check the
    GPU architecture and TensorRT version, run exactly ``argv``."""
    from edgekit import __version__

    cmd = " \\\n  ".join(shlex.quote(a) if i else '"$TRTEXEC"' for i, a in enumerate(argv))
    sm = getattr(target, "sm", "") or ""
    rng = getattr(target, "tensorrt_versions", "") or ""
    return f"""#!/usr/bin/env bash
# Build bundle written by edgekit {__version__} for target {target.name} ({getattr(target, 'description', '')}).
# Run it ON THE DEVICE: `bash build.sh`. It builds model.plan with trtexec, then times it the
# trtexec way (warm-up {settings.warmup_ms} ms, >= {settings.duration_s} s, >= {settings.iterations} iterations) and writes
# per-layer info, per-layer profile and per-inference times to {RESULTS_DIR}/*.json.
# Copy the folder back and run `edgekit profile <this folder>` / `edgekit check` / `edgekit report`.
set -euo pipefail
cd "$(dirname "$0")"
TRTEXEC="${{TRTEXEC:-trtexec}}"
if ! command -v "$TRTEXEC" >/dev/null 2>&1; then
  if [ -x {JETSON_TRTEXEC} ]; then TRTEXEC={JETSON_TRTEXEC}; else
    echo "build.sh: trtexec not found (not on PATH, not at {JETSON_TRTEXEC}); install TensorRT or set TRTEXEC=" >&2
    exit 2
  fi
fi
mkdir -p {RESULTS_DIR}
export EDGEKIT_TRTEXEC="$TRTEXEC"
bash -c {shlex.quote(PROBE_SH.strip())} > {RESULTS_DIR}/{DEVICE_FILE} 2>/dev/null || true
CC=$(sed -n 's/^compute_cap=//p' {RESULTS_DIR}/{DEVICE_FILE})
BOARD=$(sed -n 's/^board=//p' {RESULTS_DIR}/{DEVICE_FILE})
SM=""
if [ -n "$CC" ]; then SM="sm_${{CC/./}}"; elif echo "$BOARD" | grep -qi orin; then SM=sm_87; fi
if [ -n "$SM" ] && [ "$SM" != "{sm}" ]; then
  echo "build.sh: this GPU is $SM but the bundle is for {target.name} ({sm}); the engine would not run there" >&2
  exit 2
fi
echo "build.sh: $(sed -n 's/^trtexec_banner=//p' {RESULTS_DIR}/{DEVICE_FILE}) (target expects TensorRT {rng or 'any'})"
{cmd} 2>&1 | tee {RESULTS_DIR}/trtexec.log
test -s {ENGINE_FILE} || {{ echo "build.sh: trtexec wrote no {ENGINE_FILE}; see {RESULTS_DIR}/trtexec.log" >&2; exit 1; }}
echo "build.sh: wrote {ENGINE_FILE} and {RESULTS_DIR}/{{{LAYERS_JSON},{PROFILE_JSON},{TIMES_JSON}}}"
"""


def bundle_readme(argv: list[str], target: Any, settings: TrtSettings, rel_onnx: str, warnings: list[str]) -> str:
    lines = [
        f"# TensorRT build bundle for {target.name}",
        "",
        f"Written by edgekit on a machine without a GPU of the target's architecture ({getattr(target, 'sm', '?')}),",
        "so nothing here was built yet. TensorRT engines only run on the GPU architecture and TensorRT",
        "version they were built with, so the engine is built on the device itself.",
        "",
        "## On the device",
        "```bash",
        "bash build.sh            # or TRTEXEC=/path/to/trtexec bash build.sh",
        "```",
        f"It checks the GPU (expects {getattr(target, 'sm', '?')}) and records it in `results/{DEVICE_FILE}`,",
        "then runs exactly:",
        "```bash",
        shlex.join(argv),
        "```",
        f"Target TensorRT versions: {getattr(target, 'tensorrt_versions', None) or 'any'}"
        + (f" (JetPack {target.jetpack})" if getattr(target, "jetpack", None) else ""),
        "",
        "## Back on the build machine",
        "```bash",
        "edgekit profile THIS_FOLDER --json profile.json   # reads results/*.json",
        "edgekit check profile.json --budget-ms 33",
        "edgekit report THIS_FOLDER",
        "```",
        "",
        "## Settings",
        f"- ONNX: `{rel_onnx}`",
        f"- precision: {settings.precision}; strongly typed: {settings.strongly_typed}; Q/DQ in graph: {settings.has_qdq}",
        f"- optimization profile: {json.dumps(settings.shapes) if settings.shapes else 'static shapes'}",
        f"- workspace: {settings.workspace_mb or 'TensorRT default'} MB; DLA core: {settings.dla_core}"
        + (" with GPU fallback" if settings.gpu_fallback else ""),
        f"- timing cache: `{TIMING_CACHE_FILE}` (created on the first build, reused afterwards)",
    ]
    if warnings:
        lines += ["", "## Warnings"] + [f"- {w}" for w in warnings]
    return "\n".join(lines) + "\n"


RUNTIME = TensorRTRuntime()
