"""What a TensorRT build is asked to do: ``TrtSettings``, validated against the target,
and the exact trtexec command line that carries it out (locally, over SSH, or in a
bundle's ``build.sh``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from edgekit.errors import BadInputError, bad_choice
from edgekit.runtimes.base import TRT_PATHS, BuildOptions, parse_shape_spec
from edgekit.runtimes.tensorrt.parsers import LAYERS_JSON, PROFILE_JSON, TIMES_JSON
from edgekit.targets import Target

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8", "fp8", "best")
ENGINE_FILE = "model.plan"
TIMING_CACHE_FILE = "timing.cache"
RESULTS_DIR = "results"
BUILD_SCRIPT = "build.sh"
README = "README.md"
DEVICE_FILE = "device.txt"  # what build.sh / the probe saw on the building machine
MACHINE_FILE = "machine.txt"  # JetPack, TensorRT package, power mode, ... as build.sh saw them
PATHS = TRT_PATHS  # declared with the build options, which check a recipe's trt_path against them
# trtexec's own measurement defaults (trtexec's documentation): warm-up 200 ms, >= 3 s, >= 100 iterations.
WARMUP_MS = 200
DURATION_S = 3
ITERATIONS = 100
# Abstract precision flags -> trtexec flags (API: getattr(trt.BuilderFlag, name)).
TRTEXEC_FLAG = {"FP16": "--fp16", "BF16": "--bf16", "INT8": "--int8", "FP8": "--fp8"}
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}



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
        argv += [TRTEXEC_FLAG[f] for f in settings.precision_flags()]
        if settings.precision == "best":
            argv = [a for a in argv if a not in TRTEXEC_FLAG.values()] + ["--best"]
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
    return inputs, bool(ops & QDQ_OPS)


def optimization_shapes(inputs: list[tuple[str, list[int | str], str]], options: BuildOptions) -> dict[str, dict[str, list[int]]]:
    """min/opt/max for every input with a dynamic axis.

    Explicit ``extra["min_shapes"|"opt_shapes"|"max_shapes"]`` (trtexec syntax or dicts) win.
    Otherwise: a dynamic axis 0 is the batch: min 1, opt ``options.batch``, max
    ``extra["max_batch"]`` (default: opt). Other dynamic axes take ``extra["dims"][name]``
    or the size in the sample feeds, as min = opt = max.
    """
    extra = options.extra
    explicit = {w: parse_shape_spec(extra[f"{w}_shapes"]) for w in ("min", "opt", "max") if extra.get(f"{w}_shapes")}
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


def check_precision(precision: str, target: Target) -> None:
    if precision not in PRECISIONS:
        raise bad_choice("TensorRT precision", precision, PRECISIONS)
    if precision == "best":
        lacking = [p for p in ("fp16", "int8") if p not in target.precisions]
        if lacking:
            raise BadInputError(f"target {target.name!r} does not support precision 'best' (it needs fp16 and int8; "
                                f"the target supports {', '.join(target.precisions)})")
        return
    target.require_precision(precision)


def settings_for(onnx_path: Path, target: Target, options: BuildOptions) -> TrtSettings:
    """Validate the request against the target and turn it into TrtSettings."""
    if target.kind == "cpu":
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
        cores = int(target.dla_cores or 0)
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

