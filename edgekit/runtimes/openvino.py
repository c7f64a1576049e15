"""OpenVINO engines for x86 CPU targets.

build: read the ONNX graph with OpenVINO's ONNX front end (Q/DQ pairs become
FakeQuantize, which OpenVINO's low-precision transformations turn into INT8 kernels: the
ranges are edgekit's calibrated ones, nothing is re-calibrated), fix its input shapes to the
sample inputs (static shapes take OpenVINO's fastest kernels; the engine recompiles when fed
other sizes of the source graph's dynamic dimensions), and save it as OpenVINO IR
(``model.xml`` + ``model.bin``, weights kept in their own precision). The saved IR is
compiled for the CPU and run on the sample inputs, and its outputs are compared with ONNX
Runtime's on the source ONNX (the parity record in the manifest).

Precision: ``fp32`` compiles with ``INFERENCE_PRECISION_HINT=f32`` (OpenVINO's own default
on a CPU with BF16 is bf16, which would change the numbers silently); ``bf16`` asks for
bf16 and needs a CPU that has it (AVX-512 BF16 or AMX); a Q/DQ graph (edgekit INT8) runs
its quantized layers in INT8 and the rest at the hint.

The manifest records the kernels OpenVINO chose: from the compiled model's execution
graph, each node's primitive type (``brgconv_avx512_I8``, ``jit_avx512_FP32``, ...) and
runtime precision, summarized by count, and the CPU's ISA flags. ``node_profile`` reads
OpenVINO's per-node performance counters (``PERF_COUNT``), with the primitive in each
``NodeTiming.kernel``.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import Manifest
from edgekit.errors import BadInputError, CheckFailedError, UnavailableError
from edgekit.onnx_checks import verify_onnx_runs
from edgekit.runtimes.base import BuildOptions, CheckedEngine, NodeTiming, RecordedRun, Runtime, resolve_onnx
from edgekit.runtimes.onnxruntime import cpu_isa_flags
from edgekit.sources.handle import InputSpec, ModelHandle, random_inputs
from edgekit.targets import Target

IR_FILE = "model.xml"
IR_WEIGHTS = "model.bin"
DEVICE = "CPU"
PRECISIONS = ("fp32", "bf16", "int8")  # int8: a Q/DQ graph (edgekit compress --bits 8)
HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}
INSTALL = "pip install 'edgekit[openvino]' (OpenVINO 2026.4 from PyPI)"
# Largest error of the built engine against ONNX Runtime on the source graph, as a share of
# the reference output's largest magnitude. INT8: OpenVINO and ONNX Runtime round the
# requantized activations differently, so a few codes move by one step.
PARITY_TOLERANCE = {"fp32": 1e-3, "bf16": 0.1, "int8": 0.1}
_QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
_OV_PRECISIONS = {"I8": "int8", "U8": "int8", "I4": "int4", "U4": "int4", "BF16": "bf16", "FP16": "fp16",
                  "F16": "fp16", "FP32": "fp32", "F32": "fp32", "I32": "int32", "I64": "int64", "BOOL": "bool",
                  "BOOLEAN": "bool"}


def _ov() -> Any:
    _decline_telemetry()
    try:
        import openvino as ov
    except ImportError:
        raise UnavailableError(f"runtime 'openvino' needs the openvino package: {INSTALL}") from None
    return ov


def _decline_telemetry() -> None:
    """``import openvino`` starts OpenVINO's usage telemetry (openvino_telemetry: a client id
    and a usage count under ~/intel/, events sent to Google Analytics by its converters)
    unless a consent file in ~/intel says no. edgekit declines it for its own process, before
    the import; a user's consent file is left as it is."""
    try:
        from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    except ImportError:
        return
    OptInChecker.check = lambda self, *args, **kwargs: ConsentCheckResult.DECLINED


@functools.cache
def _core() -> Any:
    return _ov().Core()


def _compile_config(precision: str, threads: int | None, perf_count: bool = False) -> dict[str, Any]:
    return {"INFERENCE_PRECISION_HINT": HINTS[precision], "INFERENCE_NUM_THREADS": int(threads or 0),
            "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "ENABLE_CPU_PINNING": False,
            "PERF_COUNT": perf_count}


def _read(path: Path) -> Any:
    try:
        return _core().read_model(str(path))
    except RuntimeError as e:  # OpenVINO's front-end errors are RuntimeErrors (or subclasses)
        raise BadInputError(f"openvino cannot read {path.name}: {_first_line(e)}") from None


def _compile(model: Any, config: dict[str, Any], what: str) -> Any:
    try:
        return _core().compile_model(model, DEVICE, config)
    except RuntimeError as e:
        raise BadInputError(f"openvino cannot compile {what} for the CPU: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    """OpenVINO's message without its ``Exception from src/...cpp:84:`` and ``Check '...' failed at``
    location lines: the first line that says what is wrong."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("Exception from ", "Check '", "FrontEnd API failed"))
             and " failed at src/" not in ln]
    text = lines[0] if lines else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _graph_ops(path: Path) -> dict[str, int]:
    import onnx

    counts: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def engine_precision(requested: str, ops: dict[str, int]) -> str:
    """What the engine is compiled as: ``int8`` for a Q/DQ graph at fp32 (the quantized layers
    in INT8, the rest in fp32), else the requested precision (one of ``PRECISIONS``)."""
    quantized = bool(_QDQ_OPS & set(ops))
    if requested not in PRECISIONS:
        raise BadInputError(f"runtime 'openvino' cannot build precision {requested!r} (choose from "
                            f"{', '.join(PRECISIONS)}; int8 from a model compressed with `edgekit compress --bits 8`)")
    if requested == "int8" and not quantized:
        raise BadInputError("runtime 'openvino' builds int8 from a graph with Q/DQ nodes; this one has none "
                            "(compress the model first: `edgekit compress MODEL --bits 8`)")
    if requested == "fp32" and quantized:
        return "int8"
    return requested


def require_bf16() -> None:
    caps = list(_core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES"))
    if "BF16" not in caps:
        raise UnavailableError(f"this CPU has no bf16 support for OpenVINO (its capabilities: {', '.join(caps)}); "
                               "choose --precision fp32 or int8")


def _static_shapes(model: Any, feeds: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """Fix every input to the shape of its sample input (OpenVINO's static-shape kernels)."""
    shapes: dict[str, list[int]] = {}
    for port in model.inputs:
        name = port.get_any_name()
        if name in feeds:
            shapes[name] = [int(d) for d in feeds[name].shape]
    if shapes and any(not model.input(n).get_partial_shape().is_static for n in shapes):
        try:
            model.reshape({n: s for n, s in shapes.items()})
        except RuntimeError as e:
            raise BadInputError(f"openvino cannot fix the inputs to the sample shapes {shapes}: {_first_line(e)}") from None
    return shapes


def dynamic_dims(model: Any, src: Path) -> dict[str, dict[str, str]]:
    """input -> {axis: name} of the dimensions that are dynamic in the source graph (axis 0:
    ``batch``; others: the ONNX ``dim_param`` or ``dim<axis>``), read before the shapes are fixed."""
    import onnx

    params = {i.name: [d.dim_param for d in i.type.tensor_type.shape.dim]
              for i in onnx.load(str(src), load_external_data=False).graph.input}
    out: dict[str, dict[str, str]] = {}
    for port in model.inputs:
        ps = port.get_partial_shape()
        if ps.rank.is_dynamic:
            continue
        name = port.get_any_name()
        axes = {str(k): "batch" if k == 0 else ((params.get(name) or [""] * len(ps))[k] or f"dim{k}")
                for k, d in enumerate(ps) if d.is_dynamic}
        if axes:
            out[name] = axes
    return out


def exec_graph_kernels(compiled: Any) -> dict[str, dict[str, str]]:
    """node name -> {layer_type, primitive, precision} from the compiled model's execution graph."""
    out: dict[str, dict[str, str]] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()

        def get(key: str, rt: Any = rt) -> str:
            return str(rt[key].astype(str)) if key in rt else ""

        out[op.get_friendly_name()] = {"layer_type": get("layerType"), "primitive": get("primitiveType"),
                                       "precision": get("runtimePrecision")}
    return out


def kernel_summary(kernels: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Counts of primitive types and runtime precisions over the nodes of the execution graph
    that run a kernel (inputs, outputs, constants and in-place reshapes counted apart), and
    the CPU's ISA flags."""
    by_primitive: dict[str, int] = {}
    by_precision: dict[str, int] = {}
    in_place = 0
    for k in kernels.values():
        if k["layer_type"] in ("Input", "Output", "Parameter", "Result", "Const", "Constant"):
            continue
        prim = k["primitive"] or "unknown"
        if prim.startswith("unknown"):  # no kernel: a Reshape/Squeeze done in place
            in_place += 1
            continue
        by_primitive[prim] = by_primitive.get(prim, 0) + 1
        prec = ov_precision(k["precision"])
        by_precision[prec] = by_precision.get(prec, 0) + 1
    return {"isa": list(cpu_isa_flags()), "device": str(_core().get_property(DEVICE, "FULL_DEVICE_NAME")),
            "source": "OpenVINO execution graph (primitiveType, runtimePrecision per node)",
            "by_primitive": dict(sorted(by_primitive.items(), key=lambda kv: -kv[1])),
            "by_precision": dict(sorted(by_precision.items(), key=lambda kv: -kv[1])), "in_place_nodes": in_place}


def ov_precision(name: str) -> str:
    """OpenVINO's precision names (``I8``, ``u8``, ``bf16``, ``FP32``) -> edgekit's (``int8``, ``bf16``, ``fp32``)."""
    key = name.strip().upper()
    return _OV_PRECISIONS.get(key, key.lower() or "fp32")


def primitive_precision(primitive: str) -> str:
    """The precision suffix of a primitive type: ``brgconv_avx512_I8`` -> ``int8``; ``""`` when none."""
    tail = primitive.rsplit("_", 1)[-1] if "_" in primitive else ""
    return _OV_PRECISIONS.get(tail.upper(), "")


def _parity(ref: list[np.ndarray], got: list[np.ndarray], names: list[str], precision: str) -> dict[str, Any]:
    tol = PARITY_TOLERANCE[precision]
    outputs: dict[str, Any] = {}
    worst = 0.0
    for name, a, b in zip(names, ref, got, strict=True):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise CheckFailedError(f"the openvino engine's output {name!r} has shape {b.shape}; the ONNX graph's "
                                   f"has {a.shape}")
        scale = float(np.abs(a).max()) or 1.0
        err = float(np.abs(a - b).max()) if a.size else 0.0
        rec: dict[str, Any] = {"max_abs_error": err, "ref_max_abs": scale, "relative_error": err / scale,
                               "tolerance": tol}
        if a.ndim == 2 and a.shape[1] > 1:
            rec["top1_match"] = float((a.argmax(1) == b.argmax(1)).mean())
        outputs[name] = rec
        worst = max(worst, err / scale)
    return {"reference": "onnxruntime on the source ONNX", "precision": precision, "outputs": outputs,
            "worst_relative_error": worst, "passed": worst <= tol}


class OpenVinoRuntime:
    """The ``openvino`` runtime (the Runtime protocol): CPU targets only."""

    name = "openvino"
    input_format = "onnx"
    int8_scheme: str | None = None

    def available(self) -> tuple[bool, str]:
        try:
            _ov()
        except UnavailableError:
            return False, f"the openvino package is not installed: {INSTALL}"
        if DEVICE not in _core().available_devices:
            return False, "OpenVINO finds no CPU device"
        return True, ""

    def measures_here(self, target: Target) -> bool:
        """The CPU targets this machine stands for: the same architecture and integer kernels."""
        return target.is_this_machine

    def recorded_run(self, folder: Path, manifest: Manifest | None) -> RecordedRun | None:
        return None

    def build(self, model: Path | ModelHandle, target: Target, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        """Convert ``model`` (an ONNX file or onnx artifact) to OpenVINO IR for a CPU target."""
        ov = _ov()
        if getattr(target, "kind", "cpu") != "cpu":
            raise BadInputError(f"runtime 'openvino' builds for CPU targets; target {target.name!r} is a "
                                f"{target.kind} (choose a cpu target, or --runtime onnxruntime | tensorrt)")
        src = resolve_onnx(model)
        out_dir = Path(out_dir)
        ops = _graph_ops(src)
        precision = engine_precision(options.precision, ops)
        if precision == "bf16":
            require_bf16()
        t0 = time.perf_counter()
        graph = _read(src)
        feeds = options.extra.get("feeds") or {}
        if not feeds:
            feeds = random_inputs(_inputs_of(graph), options.batch)
        dynamic = dynamic_dims(graph, src)
        shapes = _static_shapes(graph, feeds)
        ov.save_model(graph, str(out_dir / IR_FILE), compress_to_fp16=False)
        convert_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        engine = OpenVinoEngine(out_dir / IR_FILE, precision, options.threads, dynamic)  # as load() opens it
        compile_s = time.perf_counter() - t1
        try:
            got = engine.run({k: v for k, v in feeds.items() if k in {s.name for s in engine.inputs}})
        except RuntimeError as e:
            raise BadInputError(f"openvino cannot run {src.name} on its sample inputs: {_first_line(e)}") from None
        ref = verify_onnx_runs(src, feeds, label=src.name, error=BadInputError).outputs
        parity = _parity(ref, got, engine.outputs, precision)
        if not parity["passed"]:
            raise CheckFailedError(f"the openvino engine disagrees with ONNX Runtime on {src.name}: relative error "
                                   f"{parity['worst_relative_error']:.3g} > {PARITY_TOLERANCE[precision]:g} ({precision})")
        kernels = exec_graph_kernels(engine.compiled)
        summary = kernel_summary(kernels)
        engine.close()
        session = {"device": DEVICE, "inference_precision_hint": HINTS[precision],
                   "inference_num_threads": options.threads or 0, "num_streams": 1, "performance_hint": "LATENCY",
                   "cpu_pinning": False, "static_shapes": shapes, "dynamic_dims": dynamic,
                   "openvino": ov.__version__}
        size = sum((out_dir / f).stat().st_size for f in (IR_FILE, IR_WEIGHTS) if (out_dir / f).is_file())
        return {
            "files": {"model": IR_FILE, "weights": IR_WEIGHTS},
            "config": {"session": session},
            "metrics": {"build_seconds": round(convert_s + compile_s, 3), "compile_seconds": round(compile_s, 3),
                        "engine_parity": parity, "kernels": summary, "nodes": sum(summary["by_primitive"].values()),
                        "integer_nodes": summary["by_precision"].get("int8", 0),
                        "model_size_mb": round(size / 2**20, 3)},
        }

    def load(self, engine_dir: Path, manifest: Any, threads: int | None = None) -> OpenVinoEngine:
        session = dict(manifest.config.get("session", {}))
        hint = session.get("inference_precision_hint", "f32")
        precision = {"f32": "fp32", "bf16": "bf16"}.get(hint)
        if precision is None:
            raise BadInputError(f"{engine_dir}: unknown OpenVINO precision hint {hint!r} (choose from f32, bf16)")
        threads = threads if threads is not None else (session.get("inference_num_threads") or None)
        return OpenVinoEngine(manifest.path_of(Path(engine_dir), "model"), precision, threads,
                              dict(session.get("dynamic_dims") or {}))


def _inputs_of(model: Any) -> list[InputSpec]:
    out = []
    for port in model.inputs:
        ps = port.get_partial_shape()
        shape = tuple(d.get_length() if d.is_static else ("batch" if k == 0 else f"dim{k}") for k, d in enumerate(ps))
        out.append(InputSpec(port.get_any_name(), shape, str(np.dtype(port.get_element_type().to_dtype()))))
    return out


class OpenVinoEngine(CheckedEngine):
    """One compiled OpenVINO model (CPU) with edgekit's engine interface. The IR has static
    shapes (the build's sample inputs); inputs whose batch axis was dynamic in the source graph
    dimensions were dynamic in the source graph (``dynamic_dims``: the batch, a sequence length)
    take any size there: feeds of new sizes recompile the model for them."""

    runtime = "openvino"

    def __init__(self, path: Path, precision: str, threads: int | None,
                 dynamic: dict[str, dict[str, str]] | None = None) -> None:
        self.path = Path(path)
        self.precision = precision
        self.threads = threads
        self.dynamic = {name: {int(axis): label for axis, label in axes.items()} for name, axes in (dynamic or {}).items()}
        self.model = _read(self.path)
        self.inputs = [InputSpec(s.name, tuple(self.dynamic.get(s.name, {}).get(k, d) for k, d in enumerate(s.shape)),
                                 s.dtype) for s in _inputs_of(self.model)]
        self.shapes = {s.name: tuple(int(d) for d in s.shape) for s in _inputs_of(self.model)}
        self.compiled = _compile(self.model, _compile_config(precision, threads), self.path.name)
        self.request = self.compiled.create_infer_request()
        self.outputs = [port.get_any_name() for port in self.compiled.outputs]

    def _fit_shapes(self, feeds: dict[str, np.ndarray]) -> None:
        """Recompile for the feeds' shapes when they differ from the compiled ones (dynamic dims only:
        ``check_feeds`` has checked the static ones)."""
        shapes = {n: tuple(int(d) for d in feeds[n].shape) for n in self.dynamic if n in feeds}
        if all(self.shapes.get(n) == shape for n, shape in shapes.items()):
            return
        try:
            self.model.reshape({n: list(shape) for n, shape in shapes.items()})
        except RuntimeError as e:
            raise BadInputError(f"openvino cannot take inputs of shapes {shapes}: {_first_line(e)}") from None
        self.compiled = _compile(self.model, _compile_config(self.precision, self.threads), self.path.name)
        self.request = self.compiled.create_infer_request()
        self.shapes.update(shapes)

    @property
    def settings(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "device": DEVICE, "inference_precision_hint": HINTS[self.precision],
                "inference_num_threads": self.threads or 0, "num_streams": 1, "model": self.path.name}

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self._fit_shapes(feeds)
        self.request.infer(feeds)
        return [np.array(self.request.get_output_tensor(i).data) for i in range(len(self.outputs))]

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        self._fit_shapes(feeds)
        infer = self.request.infer
        t0 = time.perf_counter()
        infer(feeds, share_inputs=True, share_outputs=True)
        return (time.perf_counter() - t0) * 1e3

    def profile_nodes(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        """Per-node times from OpenVINO's performance counters (a separately compiled model, so
        end-to-end timing never pays for counting), averaged over ``iterations`` runs."""
        self._fit_shapes(feeds)
        compiled = _compile(self.model, _compile_config(self.precision, self.threads, perf_count=True), self.path.name)
        kernels = exec_graph_kernels(compiled)
        request = compiled.create_infer_request()
        for _ in range(2):
            request.infer(feeds)
        totals: dict[str, list[Any]] = {}
        runs = max(1, iterations)
        for _ in range(runs):
            request.infer(feeds)
            for info in request.get_profiling_info():
                if str(info.status).endswith("EXECUTED") and not str(info.status).endswith("NOT_EXECUTED"):
                    rec = totals.setdefault(info.node_name, [info.node_type, info.exec_type, 0.0])
                    rec[2] += info.real_time.total_seconds() * 1e3
        return profile_nodes(totals, kernels, runs)

    def token_decoder(self, max_length: int) -> None:
        return None  # no KV-cache generation loop in this runtime

    def close(self) -> None:
        self.request = None
        self.compiled = None


def profile_nodes(totals: dict[str, list[Any]], kernels: dict[str, dict[str, str]], runs: int) -> list[NodeTiming]:
    """{node: [layer type, exec type, summed ms]} over ``runs`` -> NodeTimings with precision and kernel."""
    out = []
    for name, (layer, exec_type, ms) in totals.items():
        if layer in ("Parameter", "Result", "Input", "Output", "Constant"):
            continue
        info = kernels.get(name, {})
        precision = primitive_precision(exec_type) or ov_precision(info.get("precision", "") or "FP32")
        out.append(NodeTiming(name=name, op_type=layer, time_ms=ms / runs, precision=precision,
                              quantized=precision in ("int8", "int4"), kernel=exec_type or info.get("primitive", "")))
    return out


RUNTIME: Runtime = OpenVinoRuntime()
