"""ONNX Runtime GPU execution providers: CUDA and TensorRT options, and cache warming.

ONNX Runtime's TensorRT execution provider builds its TensorRT engines at the first
inference of a session (minutes on a Jetson). edgekit turns the engine cache and the
timing cache on, points them into the engine folder (``trt_cache/``), and runs one
inference at build time (``warm_ep_cache``), so the first real inference loads a
cached engine instead of building one.

The ORT runtime calls ``provider_list(...)`` to get ``providers=`` for
``InferenceSession``: a list of provider names or ``(name, options)`` pairs. Option
names are those documented for ONNX Runtime's TensorRT and CUDA execution providers.
Not verified on a GPU build of ONNX Runtime (onnxruntime-gpu is not available here);
tested for the option dicts it produces and for the missing-provider error.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError, UnavailableError
from edgekit.runtimes.base import BuildOptions
from edgekit.targets import Target

TRT_EP = "TensorrtExecutionProvider"
CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
TRT_CACHE_DIR = "trt_cache"  # inside the engine folder


def require_providers(requested: list[str] | tuple[str, ...], available: list[str] | None = None,
                      target_name: str = "target") -> list[str]:
    """The requested providers, in order, each present here; a missing one is an
    UnavailableError naming the available providers."""
    if available is None:
        import onnxruntime as ort

        available = list(ort.get_available_providers())
    missing = [p for p in requested if p not in available]
    if missing:
        raise UnavailableError(f"execution provider {missing[0]!r} requested by {target_name!r} is not available in "
                               f"this onnxruntime build (available providers are: {', '.join(available)}); "
                               "install onnxruntime-gpu built with TensorRT/CUDA on the device")
    return list(requested)


def cuda_options(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """CUDA EP options: device, memory arena limit, cuDNN algorithm search, TF32, CUDA graphs."""
    e = extra or {}
    opts: dict[str, Any] = {"device_id": int(e.get("device_id", 0)),
                            "arena_extend_strategy": "kNextPowerOfTwo",
                            "cudnn_conv_algo_search": str(e.get("cudnn_conv_algo_search", "EXHAUSTIVE")),
                            "do_copy_in_default_stream": True,
                            "use_tf32": 0 if e.get("precision") == "fp32" else 1}
    if e.get("gpu_mem_limit_mb"):
        opts["gpu_mem_limit"] = int(e["gpu_mem_limit_mb"]) << 20
    if e.get("cuda_graph"):
        opts["enable_cuda_graph"] = True
    return opts


def _shapes_option(shapes: dict[str, dict[str, list[int]]], which: str) -> str:
    return ",".join(f"{n}:{'x'.join(str(d) for d in s[which])}" for n, s in shapes.items())


def tensorrt_options(precision: str, cache_dir: str | Path, extra: dict[str, Any] | None = None,
                     target: Target | None = None) -> dict[str, Any]:
    """TensorRT EP options: precision, engine + timing caches under ``cache_dir``, workspace,
    DLA, optimization profile shapes.

    >>> tensorrt_options("fp16", "/e/trt_cache")["trt_fp16_enable"]
    True
    """
    e = extra or {}
    if precision not in ("fp32", "tf32", "fp16", "bf16", "int8", "best"):
        raise BadInputError(f"the TensorRT execution provider takes precision fp32, fp16, bf16, int8 or best, "
                            f"not {precision!r}")
    cache = str(cache_dir)
    opts: dict[str, Any] = {
        "device_id": int(e.get("device_id", 0)),
        "trt_fp16_enable": precision in ("fp16", "best"),
        "trt_int8_enable": precision in ("int8", "best"),
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": cache,
        "trt_timing_cache_enable": True,
        "trt_timing_cache_path": cache,
    }
    if precision == "bf16":
        opts["trt_bf16_enable"] = True
    if e.get("workspace_mb"):
        opts["trt_max_workspace_size"] = int(e["workspace_mb"]) << 20
    if e.get("builder_optimization_level") is not None:
        opts["trt_builder_optimization_level"] = int(e["builder_optimization_level"])
    if e.get("dla_core") is not None:
        cores = int(target.dla_cores or 0) if target is not None else None
        core = int(e["dla_core"])
        if cores is not None and not 0 <= core < cores:
            raise BadInputError(f"DLA core {core} does not exist on {target.name if target is not None else 'the target'!r} "
                                f"({cores} DLA cores)")
        opts["trt_dla_enable"] = True
        opts["trt_dla_core"] = core
    shapes = e.get("trt_shapes")  # {"input": {"min": [...], "opt": [...], "max": [...]}}
    if shapes:
        for which in ("min", "opt", "max"):
            opts[f"trt_profile_{which}_shapes"] = _shapes_option(shapes, which)
    return opts


def provider_list(providers: list[str], precision: str, engine_dir: str | Path, extra: dict[str, Any] | None = None,
                  target: Target | None = None) -> list[Any]:
    """``providers=`` for ``onnxruntime.InferenceSession``: TensorRT and CUDA with options,
    others by name. The TensorRT caches go to ``engine_dir/trt_cache`` (absolute)."""
    out: list[Any] = []
    for p in providers:
        if p == TRT_EP:
            cache = Path(engine_dir).resolve() / TRT_CACHE_DIR
            cache.mkdir(parents=True, exist_ok=True)
            out.append((p, tensorrt_options(precision, cache, extra, target)))
        elif p == CUDA_EP:
            out.append((p, cuda_options({**(extra or {}), "precision": precision})))
        else:
            out.append(p)
    return out


def recorded_options(providers: list[Any], engine_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Provider options for the manifest, with cache paths relative to the engine folder
    (the folder is staged and renamed, and may be copied to the device)."""
    root = str(Path(engine_dir).resolve())
    out: dict[str, dict[str, Any]] = {}
    for p in providers:
        if isinstance(p, tuple):
            name, opts = p
            out[name] = {k: (str(Path(v).resolve()).replace(root, ".", 1) if k.endswith("_path") else v)
                         for k, v in opts.items()}
    return out


def resolve_options(recorded: dict[str, dict[str, Any]], engine_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Inverse of ``recorded_options`` at load time."""
    root = Path(engine_dir).resolve()
    return {name: {k: (str(root / v[2:]) if k.endswith("_path") and isinstance(v, str) and v.startswith("./") else
                       (str(root) if k.endswith("_path") and v == "." else v))
                   for k, v in opts.items()}
            for name, opts in recorded.items()}


def warm_ep_cache(session: Any, feeds: dict[str, Any], engine_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one inference so the TensorRT EP builds and caches its engines now, at build time.
    Returns the time it took and the cache files present afterwards."""
    t0 = time.perf_counter()
    session.run(None, feeds)
    seconds = time.perf_counter() - t0
    files: list[str] = []
    if engine_dir is not None and (Path(engine_dir) / TRT_CACHE_DIR).is_dir():
        files = sorted(f.name for f in (Path(engine_dir) / TRT_CACHE_DIR).iterdir() if f.is_file())
    return {"warmup_inference_seconds": round(seconds, 3), "trt_cache_files": files}


def build_providers(providers: list[str], options: BuildOptions, engine_dir: str | Path, target: Target | None = None
                    ) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """For the ORT runtime's build: (``providers=`` argument, options to record in the manifest).

    Only GPU providers get options, so a CPU-only target is unchanged. Its one inference at
    build time (ORT's build already runs one) is what warms the TensorRT EP's engine cache.
    """
    arg = provider_list(providers, options.precision, engine_dir, options.extra, target)
    return arg, recorded_options(arg, engine_dir)


def load_providers(providers: list[str], recorded: dict[str, dict[str, Any]] | None, engine_dir: str | Path
                   ) -> list[Any]:
    """For the ORT runtime's load: providers with their recorded options, cache paths
    resolved inside ``engine_dir``."""
    opts = resolve_options(recorded or {}, engine_dir)
    return [(p, opts[p]) if p in opts else p for p in providers]
