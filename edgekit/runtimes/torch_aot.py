"""The PyTorch-native engine: ``torch.export`` + AOTInductor, on CPU and CUDA.

build: cast the (compressed) model and its sample inputs to the engine precision
(fp32, fp16, bf16), capture it with ``torch.export`` (batch axis dynamic through
``torch.export.Dim`` where the model allows, else static, noted), compile it ahead of
time with AOTInductor into one ``model.pt2`` package in the engine folder, load the
package back and compare it with the eager model (parity in the manifest).

load: ``torch._inductor.aoti_load_package``: runs without the model's Python code.
``timed_run`` is device time: CUDA events on GPUs (inputs already on the device, as
trtexec's GPU compute time), ``perf_counter`` on CPU. ``node_profile`` uses
``torch.profiler``: on CUDA the device time of every kernel (Triton and library
kernels); on CPU the compiled C++ kernels are recorded because the package is built
with ``cpp.enable_kernel_profile`` (and library calls show as ``aten::`` ops).

Quantized models: whatever ``torch.export`` can trace compiles (the int4
``QuantLinear`` unpacks its packed weights with integer ops that AOTInductor fuses;
fake-quant Q/DQ modules trace as float math). A model ``torch.export`` cannot capture
is a ``BadInputError`` that names the reason and suggests ``--runtime onnxruntime``.
AOTInductor on CPU needs a C++ compiler; compiling takes tens of seconds even for a
tiny model.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit import interrupts
from edgekit.artifact import Manifest
from edgekit.errors import BadInputError, UnavailableError, bad_choice
from edgekit.runtimes.base import BuildOptions, CheckedEngine, NodeTiming, RecordedRun, Runtime, check_feeds
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.sources.models import load_model
from edgekit.targets import Target

PACKAGE_FILE = "model.pt2"
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# Quantized handles keep their own integer weights; their float parts run in fp32.
QUANTIZED_PRECISIONS = ("int8", "int4")
MAX_DYNAMIC_BATCH = 1024


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - a hard dependency
        raise UnavailableError(f"torch is not installed ({e})") from None
    return torch


def _compiler() -> str | None:
    for cc in ("g++", "c++", "clang++", "gcc", "cc"):
        if shutil.which(cc):
            return cc
    return None


def device_for(target: Target, options: BuildOptions | None = None) -> str:
    """``cuda`` for GPU and Jetson targets, ``cpu`` for CPU targets; ``options.extra["device"]`` overrides."""
    if options is not None and options.extra.get("device"):
        dev = str(options.extra["device"])
        if dev not in ("cpu", "cuda") and not dev.startswith("cuda:"):
            raise bad_choice("device", dev, ("cpu", "cuda"))
        return dev
    return "cpu" if getattr(target, "kind", "cpu") == "cpu" else "cuda"


def _dtype_name(precision: str) -> str:
    if precision in DTYPES:
        return DTYPES[precision]
    if precision in QUANTIZED_PRECISIONS:
        return "float32"
    raise BadInputError(f"the torch runtime builds fp32, fp16 or bf16 engines (and runs int8/int4 models "
                        f"compressed by edgekit); precision {precision!r} is not one of them "
                        f"(choose from {', '.join([*DTYPES, *QUANTIZED_PRECISIONS])})")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


class TorchAotRuntime:
    """The ``torch`` runtime (the Runtime protocol)."""

    name = "torch"
    input_format = "module"  # build_engine passes the ModelHandle, not an ONNX file
    int8_scheme: str | None = None

    def available(self) -> tuple[bool, str]:
        try:
            import torch  # noqa: F401
            from torch._inductor import aoti_compile_and_package, aoti_load_package  # noqa: F401
        except ImportError as e:
            return False, f"torch with AOTInductor is not installed ({e})"
        if _compiler() is None:
            return False, "AOTInductor needs a C++ compiler (g++ or clang++) on PATH"
        return True, ""

    def measures_here(self, target: Target) -> bool:
        """The CPU targets this machine stands for (``Target.is_this_machine``), and GPU targets where
        this machine has a CUDA GPU."""
        if target.kind == "cpu":
            return target.is_this_machine
        import torch

        return target.kind == "gpu" and bool(torch.cuda.is_available())

    def recorded_run(self, folder: Path, manifest: Manifest | None) -> RecordedRun | None:
        return None  # compiled packages are timed here, by profiling

    def build(self, model: Path | ModelHandle, target: Target, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        torch = _torch()
        handle = model if isinstance(model, ModelHandle) else None
        if handle is None:

            handle = load_model(model)
        if handle.module is None:
            raise BadInputError(f"model {handle.name!r} is an ONNX graph; the torch runtime compiles PyTorch modules "
                                "(build it with --runtime onnxruntime)")
        device = device_for(target, options)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UnavailableError(f"target {getattr(target, 'name', '?')!r} needs CUDA for the torch runtime, and "
                                   "torch.cuda.is_available() is False here")
        dtype_name = _dtype_name(options.precision)
        dtype = getattr(torch, dtype_name)
        out_dir = Path(out_dir)
        notes: list[str] = []
        module = handle.module
        if dtype != torch.float32 or device != "cpu":
            import copy

            module = copy.deepcopy(module)
        module = module.to(device=device, dtype=dtype) if dtype != torch.float32 else module.to(device)
        module.eval()
        dynamic = any(0 in handle.dynamic_axes.get(s.name, {}) or (s.shape and s.shape[0] == "batch")
                      for s in handle.inputs)
        trace_batch = max(2, options.batch) if dynamic else options.batch
        feeds = handle.sample_inputs(trace_batch)
        args = tuple(_to_tensor(torch, feeds[s.name], device, dtype) for s in handle.inputs)
        # Freezing folds weights into the package (oneDNN prepacking on CPU: EfficientNet-Lite0
        # ran ~1.3x faster here). Not for packed integer weights: it would fold the unpacking
        # and store float weights, undoing the 4-bit size.
        quantized = options.precision in QUANTIZED_PRECISIONS or handle.quantized is not None
        freeze = bool(options.extra.get("freezing", device == "cpu" and not quantized))
        t0 = time.perf_counter()
        ep, dynamic = _export(torch, module, args, handle, dynamic, notes)
        export_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            from torch._inductor import aoti_compile_and_package

            configs: dict[str, Any] = {}
            if device == "cpu":
                configs["cpp.enable_kernel_profile"] = True  # kernel names in torch.profiler
                configs["freezing"] = freeze  # weights as constants: oneDNN prepacked convolutions/matmuls
            package = aoti_compile_and_package(ep, package_path=str(out_dir / PACKAGE_FILE),
                                               inductor_configs=configs)
        except Exception as e:
            interrupts.reraise(e)  # a Ctrl-C during the long compile, wrapped in the compiler's own error
            raise BadInputError(f"AOTInductor could not compile {handle.name!r} for {device}: {_first_line(e)} "
                                "(build it with --runtime onnxruntime)") from None
        compile_s = time.perf_counter() - t0
        parity = _parity(torch, module, package, args)
        # The package's input contract: a dynamic batch axis or the traced sizes.
        spec_inputs = [InputSpec(s.name, tuple("batch" if (i == 0 and dynamic) else
                                               (options.batch if i == 0 else int(d)) for i, d in enumerate(a.shape)),
                                 s.dtype) for s, a in zip(handle.inputs, args, strict=True)]
        session = {"device": device, "dtype": dtype_name, "precision": options.precision, "dynamic_batch": dynamic,
                   "max_batch": MAX_DYNAMIC_BATCH if dynamic else options.batch,
                   "inputs": [s.to_dict() for s in spec_inputs], "outputs": list(handle.outputs),
                   "torch": torch.__version__, "compiler": _compiler(), "kernel_profile": device == "cpu",
                   "freezing": freeze if device == "cpu" else False}
        return {"files": {"model": PACKAGE_FILE},
                "config": {"session": session, "notes": notes},
                "metrics": {"export_seconds": round(export_s, 3), "compile_seconds": round(compile_s, 3),
                            "parity": parity,
                            "model_size_mb": round((out_dir / PACKAGE_FILE).stat().st_size / 2**20, 3)}}

    def load(self, engine_dir: Path, manifest: Manifest, threads: int | None = None) -> TorchAotEngine:
        session = dict(manifest.config.get("session", {}))
        path = manifest.path_of(Path(engine_dir), "model")
        inputs = [InputSpec.from_dict(d) for d in session.get("inputs", manifest.model.get("inputs", []))]
        return TorchAotEngine(path, session.get("device", "cpu"), session.get("dtype", "float32"), inputs,
                              list(session.get("outputs", manifest.model.get("outputs", ["output"]))), threads)


def _to_tensor(torch: Any, arr: np.ndarray, device: str, dtype: Any) -> Any:
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.is_floating_point():
        t = t.to(dtype)
    return t.to(device)


def _export(torch: Any, module: Any, args: tuple[Any, ...], handle: ModelHandle, dynamic: bool,
            notes: list[str]) -> tuple[Any, bool]:
    """torch.export with a dynamic batch axis where the model allows it, else static shapes."""
    errors = []
    if dynamic:
        batch = torch.export.Dim("batch", min=1, max=MAX_DYNAMIC_BATCH)
        shapes = tuple({0: batch} if (s.shape and not isinstance(s.shape[0], int)) else None for s in handle.inputs)
        try:
            with torch.no_grad():
                return torch.export.export(module, args, dynamic_shapes=shapes, strict=False), True
        except Exception as e:  # a guard on the batch size, data-dependent control flow, ...
            interrupts.reraise(e)
            errors.append(_first_line(e))
            notes.append(f"dynamic batch export failed ({errors[-1][:160]}); exported with static shapes")
    try:
        with torch.no_grad():
            return torch.export.export(module, args, strict=False), False
    except Exception as e:
        interrupts.reraise(e)
        raise BadInputError(f"torch.export cannot capture model {handle.name!r}: {_first_line(e)} "
                            "(build it with --runtime onnxruntime, which exports through ONNX)") from None


def _parity(torch: Any, module: Any, package: str, args: tuple[Any, ...]) -> dict[str, Any]:
    from torch._inductor import aoti_load_package

    with torch.no_grad():
        ref = _as_list(module(*args))
        got = _as_list(aoti_load_package(package)(*args))
    worst = {"max_abs": 0.0, "max_rel": 0.0}
    for r, g in zip(ref, got, strict=False):
        r32, g32 = r.detach().float().cpu(), g.detach().float().cpu()
        diff = (r32 - g32).abs()
        worst["max_abs"] = max(worst["max_abs"], float(diff.max()) if diff.numel() else 0.0)
        worst["max_rel"] = max(worst["max_rel"], float((diff / r32.abs().clamp(min=1e-6)).max()) if diff.numel() else 0.0)
    worst["outputs"] = len(ref)
    return worst


def _as_list(out: Any) -> list[Any]:
    if isinstance(out, (list, tuple)):
        return [o for o in out]
    if isinstance(out, dict):
        return list(out.values())
    return [out]


class TorchAotEngine(CheckedEngine):
    """A loaded AOTInductor package with edgekit's engine interface."""

    runtime = "torch"

    def __init__(self, path: Path, device: str, dtype: str, inputs: list[InputSpec], outputs: list[str],
                 threads: int | None = None) -> None:
        torch = _torch()
        from torch._inductor import aoti_load_package

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise UnavailableError(f"{path} is a CUDA engine and torch.cuda.is_available() is False here")
        self.torch = torch
        self.path = Path(path)
        self.device = device
        self.dtype = getattr(torch, dtype)
        self.threads = threads
        if threads is not None and device == "cpu":
            torch.set_num_threads(threads)
        self.model = aoti_load_package(str(self.path))
        self.inputs = inputs
        self.outputs = outputs
        self._prepared: tuple[tuple[int, ...], tuple[Any, ...]] | None = None

    @property
    def settings(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "device": self.device, "dtype": str(self.dtype).replace("torch.", ""),
                "threads": self.threads or self.torch.get_num_threads(), "model": self.path.name,
                "timing": "CUDA events (device time)" if self.device != "cpu" else "perf_counter"}

    def _args(self, feeds: dict[str, np.ndarray]) -> tuple[Any, ...]:
        """Feeds as device tensors, converted once per feeds object (timing excludes copies).
        Checked here too: a timed loop converts (and checks) its feeds once, before timing."""
        key = tuple(id(feeds[s.name]) for s in self.inputs if s.name in feeds)
        if self._prepared is None or self._prepared[0] != key:
            check_feeds(self.inputs, feeds)
            args = tuple(_to_tensor(self.torch, feeds[s.name], self.device, self.dtype) for s in self.inputs)
            self._prepared = (key, args)
        return self._prepared[1]

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        args = tuple(_to_tensor(self.torch, feeds[s.name], self.device, self.dtype) for s in self.inputs)
        with self.torch.no_grad():
            out = _as_list(self.model(*args))
        return [o.detach().float().cpu().numpy() if o.is_floating_point() else o.detach().cpu().numpy() for o in out]

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        """One inference in ms: CUDA-event device time on GPUs, wall time on CPU."""
        args = self._args(feeds)
        torch = self.torch
        with torch.no_grad():
            if self.device != "cpu":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                self.model(*args)
                end.record()
                end.synchronize()
                return float(start.elapsed_time(end))
            t0 = time.perf_counter()
            self.model(*args)
            return (time.perf_counter() - t0) * 1e3

    def profile_nodes(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        """Kernel-level times from torch.profiler, ms per inference (device time on CUDA)."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile

        args = self._args(feeds)
        iterations = max(1, iterations)
        cuda = self.device != "cpu"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.no_grad():
            for _ in range(2):
                self.model(*args)
            if cuda:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof:
                for _ in range(iterations):
                    self.model(*args)
                if cuda:
                    torch.cuda.synchronize()
        return kernel_timings(prof.key_averages(), iterations, cuda, str(self.dtype).replace("torch.", ""))

    def token_decoder(self, max_length: int) -> None:
        return None  # no KV-cache generation loop in this runtime

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]  # released; a closed engine is not run again
        self._prepared = None


# Profiler rows that are wrappers around the whole call, not kernels.
_WRAPPERS = ("AOTInductorModel", "aoti", "ProfilerStep", "cudaDeviceSynchronize", "cudaStreamSynchronize",
             "Memcpy", "Memset", "cudaLaunchKernel", "cuLaunchKernel", "cudaEventRecord")


def kernel_timings(events: Any, iterations: int, cuda: bool, dtype: str = "float32") -> list[NodeTiming]:
    """torch.profiler key averages -> one NodeTiming per kernel, ms per inference.

    CUDA: device self time of each kernel. CPU: self CPU time of the compiled kernels
    (``cpp_fused_*``, recorded with ``cpp.enable_kernel_profile``) and library ops."""
    precision = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(dtype, dtype)
    out = []
    for ev in events:
        name = str(ev.key)
        if any(name.startswith(w) or w in name for w in _WRAPPERS):
            continue
        if cuda:
            us = float(getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0.0)) or 0.0)
            if us <= 0:
                continue
        else:
            us = float(ev.self_cpu_time_total or 0.0)
            if us <= 0 or name.startswith(("aten::empty", "aten::as_strided", "aten::view", "aten::detach")):
                continue
        calls = max(1, round(int(ev.count) / iterations))
        out.append(NodeTiming(name=name, op_type=_kernel_kind(name), time_ms=us / iterations / 1e3,
                              precision=precision, quantized=False, calls=calls))
    return sorted(out, key=lambda n: -n.time_ms)


def _kernel_kind(name: str) -> str:
    """A short op type for a kernel name (for per-op-type summaries)."""
    low = name.lower()
    for key, kind in (("conv", "Conv"), ("gemm", "MatMul"), ("addmm", "MatMul"), ("bmm", "MatMul"),
                      ("::mm", "MatMul"), ("mm_", "MatMul"), ("sdpa", "Attention"), ("flash", "Attention"),
                      ("attention", "Attention"), ("softmax", "Softmax"), ("_per_", "Reduction"),
                      ("_red_", "Reduction"), ("mean", "Reduction"), ("_poi_", "Elementwise"),
                      ("cpp_fused", "FusedKernel")):
        if key in low:
            return kind
    return name.split("(")[0][:40]


RUNTIME: Runtime = TorchAotRuntime()
