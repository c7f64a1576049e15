"""Build an engine folder for a target, and load it back.

``build_engine`` takes any model source (spec, ModelHandle, compress or onnx artifact
folder, ``.onnx`` file), picks the runtime (``BuildOptions.runtime`` or the target's
first available one), exports to ONNX when the runtime needs it (into the engine
folder's ``onnx/``, removed again when the runtime writes an optimized ONNX graph of its
own, so the folder holds one copy of the model), lets the runtime write its files, and records everything in an
"engine" manifest (or the kind the runtime returns, e.g. a TensorRT "bundle" to build on
the device). The engine folder also keeps the model's sample inputs
(``inputs.npz``: real inputs, for realistic timing), so profiling never reloads PyTorch.

A runtime says what it builds from with an ``input_format`` attribute: ``"onnx"`` (the
default: ``build`` gets the path of ``<engine>/onnx/model.onnx``, already exported and
parity-checked) or ``"torch"`` (``build`` gets the ModelHandle itself).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import Error as ProtobufError  # what onnx.load raises for a damaged file

from edgekit.artifact import (
    Manifest,
    atomic_write_bytes,
    atomic_write_json,
    check_output_dir,
    copy_tree,
    input_record,
    read_manifest,
    sha256_file,
    staged_dir,
    write_manifest,
)
from edgekit.errors import BadInputError, CheckFailedError, UnavailableError, bad_choice
from edgekit.export.onnx import ExportConfig
from edgekit.limits import require_memory
from edgekit.loading import export_onnx, load_model
from edgekit.onnx_int8_kernels import semantics_for_target
from edgekit.runtimes import BEST_RUNTIME, RUNTIMES, get_runtime
from edgekit.runtimes.base import BuildOptions, Engine, Runtime
from edgekit.sources.arrays import read_arrays
from edgekit.sources.handle import InputSpec, ModelHandle, bind_dims, fit_feeds, stored_bytes
from edgekit.sources.inputs import InputOptions, check_shapes, read_input_file
from edgekit.sources.onnx_file import node_labels, read_graph_outline
from edgekit.targets import Target, TargetLike, load_target
from edgekit.targets.cpu_isa import cpu_features, host_int8_kernel

INPUTS_FILE = "inputs.npz"
ONNX_DIR = "onnx"


def choose_runtime(target: Target, requested: str | None = None) -> Runtime:
    """The requested runtime (must be available), or the target's first available one."""
    if requested:
        rt = _try_runtime(requested)
        if rt is None:
            raise UnavailableError(f"runtime {requested!r} is not implemented in this edgekit installation")
        ok, why = rt.available()
        if not ok:
            raise UnavailableError(f"runtime {requested!r} is not available here: {why}")
        return rt
    reasons = []
    for name in target.runtimes:
        if name not in RUNTIMES:
            reasons.append(f"{name}: unknown runtime")
            continue
        rt = _try_runtime(name)
        if rt is None:
            reasons.append(f"{name}: not installed")
            continue
        ok, why = rt.available()
        if ok:
            return rt
        reasons.append(f"{name}: {why}")
    raise UnavailableError(f"no runtime of target {target.name!r} is available here ({'; '.join(reasons)})")


def _try_runtime(name: str) -> Runtime | None:
    try:
        return get_runtime(name)
    except (ImportError, AttributeError):
        return None


def build_engine(model: str | os.PathLike[str] | ModelHandle, target: TargetLike, out_dir: str | os.PathLike[str],
                 options: BuildOptions | None = None, input_options: InputOptions | None = None) -> Path:
    """Build an engine folder for ``target`` (a name, YAML path or Target). ``input_options``
    (``--shapes``, ``--inputs``: ``sources.inputs``) set the sample inputs the engine keeps
    (``inputs.npz``), so profiling times those shapes and values.

    >>> build_engine("efficientnet-lite0", "cpu", "out/engine")  # doctest: +SKIP
    PosixPath('out/engine')
    """
    options = options or BuildOptions()
    target = load_target(target)
    target.require_precision(options.precision)
    if options.batch < 1:
        raise BadInputError(f"batch must be >= 1, got {options.batch}")
    if options.threads is not None and options.threads < 1:
        raise BadInputError(f"threads must be >= 1, got {options.threads}")
    if options.runtime == BEST_RUNTIME:
        return _build_best(model, target, Path(out_dir), options, input_options)
    runtime = choose_runtime(target, options.runtime)
    out_dir = Path(out_dir)
    src = None if isinstance(model, ModelHandle) else Path(str(model))
    onnx_artifact = src if src is not None and src.is_dir() and _kind(src) == "onnx" else None
    handle = load_model(model, input_options)
    if input_options is not None and input_options.shapes:  # the batch --shapes gives is the engine's (trtexec's opt)
        shaped = bind_dims(handle.inputs, input_options.shapes, options.batch)[0]
        if shaped != options.batch and options.batch != 1:
            raise BadInputError(f"--batch {options.batch} and --shapes (batch {shaped}) disagree; give one of them")
        options = dataclasses.replace(options, batch=shaped)
    inputs = {"model": input_record(src)} if src is not None and src.exists() else {}
    t0 = time.perf_counter()
    given_inputs = input_options.inputs if input_options is not None else None
    feeds = handle.sample_inputs(options.batch)  # sized against the memory before the output is staged
    with staged_dir(out_dir, (model, handle.source, handle.onnx_path, given_inputs),
                    expected_bytes=stored_bytes(handle)) as tmp:
        files: dict[str, str] = {}
        metrics: dict[str, Any] = {}
        _save_inputs(tmp / INPUTS_FILE, feeds)
        files["inputs"] = INPUTS_FILE
        if runtime.input_format == "onnx":
            if onnx_artifact is not None:
                copy_tree(onnx_artifact, tmp / ONNX_DIR)
            else:
                export_cfg = options.extra.get("export")
                if isinstance(export_cfg, dict):
                    export_cfg = ExportConfig(**export_cfg)
                export_cfg = export_cfg or ExportConfig()
                if export_cfg.int8_kernels is None:  # an INT8 graph is judged on the kernels of the target built for
                    export_cfg = dataclasses.replace(export_cfg, int8_kernels=semantics_for_target(target))
                # a graph that fails parity is kept beside the output (the staging folder goes away)
                export_onnx(handle, tmp / ONNX_DIR, export_cfg, failed_path=out_dir.parent / f"{out_dir.name}.failed.onnx")
            onnx_manifest = read_manifest(tmp / ONNX_DIR)
            files["onnx"] = f"{ONNX_DIR}/{onnx_manifest.files['onnx']}"
            if "parity" in onnx_manifest.metrics:
                metrics["parity"] = onnx_manifest.metrics["parity"]
            metrics["quality"] = engine_quality(metrics.get("parity"), onnx_manifest.config.get("exporter"))
            if not inputs:
                inputs = {"model": dict(onnx_manifest.inputs.get("model", {}))} if onnx_manifest.inputs else {}
            described = onnx_manifest.model or handle.describe()  # as exported (a static batch is fixed there)
            built_from: Any = tmp / files["onnx"]
            opts = dataclasses.replace(options, extra={**options.extra, "feeds": _fit_feeds(feeds, tmp / files["onnx"])})
        else:
            built_from = handle
            opts = options
            described = handle.describe()
        result = runtime.build(built_from, target, tmp, opts)
        files.update(result.get("files", {}))
        metrics.update(result.get("metrics", {}))
        if "quality" not in metrics:  # a runtime that builds from the PyTorch model checks its own parity
            metrics["quality"] = engine_quality(metrics.get("parity"), "runtime")
        warnings = list(metrics.get("warnings", []))
        if metrics["quality"].get("status") == "unverified":
            warnings.append(f"quality: unverified: {metrics['quality']['reason']}")
        if target.kind == "cpu" and not target.is_this_machine:
            metrics["not_run_on_the_target"] = other_cpu_note(target, metrics.get("parity"))
            warnings.append(metrics["not_run_on_the_target"])
        if warnings:
            metrics["warnings"] = warnings
        metrics["build_total_seconds"] = round(time.perf_counter() - t0, 3)
        precision = _precision(handle, options, tmp / files["onnx"] if "onnx" in files else None)
        if result.get("kind", "engine") == "engine":
            _drop_unused_source_graph(tmp, files, metrics)
        config = {"runtime": runtime.name, "target": target.name, "precision": precision,
                  "batch": options.batch, "threads": options.threads,
                  "optimization_level": options.optimization_level, **result.get("config", {})}
        config.setdefault("session", {})
        if input_options:
            config["input_options"] = input_options.to_dict()
        write_manifest(tmp, Manifest(
            kind=result.get("kind", "engine"), files=files, config=config, metrics=metrics, inputs=inputs,
            source=handle.source, model=described, steps=[dataclasses.asdict(s) for s in handle.steps],
            target=target.name))
    return out_dir


def other_cpu_note(target: Target, parity: Any) -> str:
    """What could not run on the real kernels of a CPU target that is not this machine."""
    arch, _, _ = cpu_features()
    theirs = (f"{target.arch}, {target.int8_kernel.name} integer kernels" if target.int8_kernel is not None
              else "a CPU it does not describe")
    judged = parity.get("kernels") if isinstance(parity, dict) and parity.get("kernels") else None
    return (f"built on this machine ({arch}, {host_int8_kernel().name} integer kernels) for target {target.name!r} "
            f"({theirs}): " + (f"parity ran on {judged}; " if judged else "")
            + "nothing was run or timed on that CPU (profile the engine there, or with `edgekit remote`)")


def engine_quality(parity: Any, exporter: Any) -> dict[str, Any]:
    """Whether an engine was checked against the model it came from: "verified" (parity passed),
    "unverified" (parity skipped: ``export --no-parity``; ``check --require-verified`` fails on it) or
    "as-given" (an ONNX file was the input: there is no other model to compare it with)."""
    if exporter == "copy":
        return {"status": "as-given", "reason": "an ONNX file was the input: nothing to compare it with"}
    if isinstance(parity, dict) and parity.get("passed") is True:
        return {"status": "verified", "against": "the PyTorch model", "kernels": parity.get("kernels", "")}
    reason = (parity or {}).get("reason") if isinstance(parity, dict) else None
    return {"status": "unverified",
            "reason": str(reason or "parity with the PyTorch model was skipped (export --no-parity)")}


def _build_best(model: str | os.PathLike[str] | ModelHandle, target: Target, out_dir: Path, options: BuildOptions,
                input_options: InputOptions | None = None) -> Path:
    """``--runtime best``: build with each of the target's runtimes that is available and can be
    timed here, time each engine briefly (interleaved rounds), keep the fastest, and record every
    candidate's timing (or why it could not build) in the manifest."""
    import tempfile

    handle_paths = (model.source, model.onnx_path) if isinstance(model, ModelHandle) else (None, None)
    protect = (model, *handle_paths, input_options.inputs if input_options is not None else None)
    check_output_dir(out_dir, protect)
    candidates: dict[str, dict[str, Any]] = {}
    for name in target.runtimes:
        rt = _try_runtime(name)
        if rt is None:
            ok, why = False, "not installed"
        else:
            ok, why = rt.available()
            if ok and not rt.measures_here(target):
                ok, why = False, f"cannot be timed here as it runs on target {target.name!r}"
        if not ok:
            candidates[name] = {"skipped": why}
    names = [n for n in target.runtimes if n not in candidates]
    if not names:
        why = "; ".join(f"{k}: {v['skipped']}" for k, v in candidates.items())
        raise UnavailableError(f"--runtime {BEST_RUNTIME} builds and times each runtime on this machine; no runtime "
                               f"of target {target.name!r} can be ({why})")
    with tempfile.TemporaryDirectory(prefix="edgekit-best-") as work:
        built: dict[str, Path] = {}
        for name in names:
            t0 = time.perf_counter()
            try:
                built[name] = build_engine(model, target, Path(work) / name, dataclasses.replace(options, runtime=name),
                                           input_options)
            except (BadInputError, UnavailableError, CheckFailedError) as e:
                candidates[name] = {"error": str(e)}
                continue
            candidates[name] = {"build_seconds": round(time.perf_counter() - t0, 3)}
        if not built:
            why = "; ".join(f"{k}: {next(iter(v.values()))}" for k, v in candidates.items())
            raise UnavailableError(f"no runtime of target {target.name!r} builds this model ({why})")
        for name in list(built):  # a candidate that skipped its check is no candidate
            status = read_manifest(built[name]).metrics.get("quality", {}).get("status")
            if status == "unverified":
                candidates[name] = {"error": "quality unverified (parity was skipped); not kept"}
                del built[name]
        if not built:
            why = "; ".join(f"{k}: {next(iter(v.values()))}" for k, v in candidates.items())
            raise UnavailableError(f"no runtime of target {target.name!r} builds this model with its quality "
                                   f"verified ({why})")
        for name, timing in time_candidates(built, options.threads).items():
            candidates[name].update(timing)
        chosen = min(built, key=lambda n: candidates[n]["p50_ms"])
        with staged_dir(out_dir, protect) as tmp:
            copy_tree(built[chosen], tmp)
            manifest = read_manifest(tmp)
            manifest.config["runtime_choice"] = {
                "requested": BEST_RUNTIME, "chosen": chosen,
                "method": "each candidate built and timed here, interleaved rounds at batch "
                          f"{options.batch}, threads {options.threads or 'all'}; the lowest p50 wins"}
            manifest.metrics["runtime_candidates"] = candidates
            write_manifest(tmp, manifest)
    return out_dir


def time_candidates(folders: dict[str, Path], threads: int | None, rounds: int = 5,
                    round_s: float = 0.1, warmup_s: float = 0.2) -> dict[str, dict[str, float]]:
    """Latency of each engine folder on its stored inputs: a warm-up, then ``rounds`` rounds in
    which every engine runs for ``round_s`` (at least 3 runs), so a neighbour's load hits all alike."""
    engines = {name: load_engine(folder, threads=threads) for name, folder in folders.items()}
    feeds = {name: load_engine_inputs(folder) for name, folder in folders.items()}
    samples: dict[str, list[float]] = {name: [] for name in folders}
    try:
        for name, engine in engines.items():
            t_end = time.perf_counter() + warmup_s
            engine.timed_run(feeds[name])
            while time.perf_counter() < t_end:
                engine.timed_run(feeds[name])
        for _ in range(rounds):
            for name, engine in engines.items():
                t_end = time.perf_counter() + round_s
                n = 0
                while n < 3 or time.perf_counter() < t_end:
                    samples[name].append(engine.timed_run(feeds[name]))
                    n += 1
    finally:
        for engine in engines.values():
            engine.close()
    return {name: {"p50_ms": round(float(np.median(v)), 4), "mean_ms": round(float(np.mean(v)), 4),
                   "iterations": len(v)} for name, v in samples.items()}


def load_engine(engine_dir: str | os.PathLike[str], threads: int | None = None) -> Engine:
    """Load an engine folder with the runtime that built it.

    >>> engine = load_engine("out/engine", threads=1)  # doctest: +SKIP
    >>> engine.run(load_engine_inputs("out/engine"))  # doctest: +SKIP
    """
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    if manifest.kind not in ("engine", "bundle"):  # a runtime may write a build bundle (TensorRT, off-device)
        raise BadInputError(f"{engine_dir} holds a {manifest.kind!r} artifact, not an engine (build one with "
                            "`edgekit build`)")
    name = manifest.config.get("runtime")
    if name not in RUNTIMES:
        raise bad_choice("runtime", name, RUNTIMES)
    runtime = _try_runtime(name)
    if runtime is None:
        raise UnavailableError(f"{engine_dir} was built for runtime {name!r}, which is not installed here")
    ok, why = runtime.available()
    if not ok:
        raise UnavailableError(f"{engine_dir} needs runtime {name!r}, not available here: {why}")
    return runtime.load(engine_dir, manifest, threads)


def load_engine_inputs(engine_dir: str | os.PathLike[str], batch: int | None = None,
                       input_options: InputOptions | None = None) -> dict[str, np.ndarray]:
    """The sample inputs stored at build time, repeated or cut along axis 0 to ``batch`` (or
    the ``--inputs`` file as it is, checked against the engine's inputs), then brought to the
    ``--shapes`` given (cut or tiled along each axis, so ids stay ids and masks masks)."""
    engine_dir = Path(engine_dir)
    manifest = read_manifest(engine_dir)
    specs = [InputSpec.from_dict(d) for d in manifest.model.get("inputs", [])
             if isinstance(d, dict) and "name" in d and "shape" in d]  # a KV-cache engine records names only
    name = manifest.model.get("name") or str(engine_dir)
    if input_options is not None and input_options.inputs is not None:
        feeds = read_input_file(input_options.inputs, specs, name)
    else:
        path = manifest.path_of(engine_dir, "inputs")
        feeds = _batched(read_arrays(path), manifest, batch)  # header-checked: a crafted inputs.npz is one line
    if input_options is not None and input_options.shapes:
        check_shapes(specs, input_options.shapes, name)
        feeds = fit_feeds(feeds, input_options.shapes)
    return feeds


def _batched(feeds: dict[str, np.ndarray], manifest: Any, batch: int | None) -> dict[str, np.ndarray]:
    if batch is None:
        return feeds
    dynamic = {s["name"] for s in manifest.model.get("inputs", []) if s.get("shape") and s["shape"][0] == "batch"}
    need = sum(v.nbytes // max(v.shape[0], 1) * batch if k in dynamic and v.ndim else v.nbytes for k, v in feeds.items())
    require_memory(need, f"a batch of {batch} sample inputs", "lower --batch")
    out = {}
    for k, v in feeds.items():
        if k in dynamic and v.ndim and v.shape[0] != batch:
            reps = -(-batch // v.shape[0])
            v = np.concatenate([v] * reps, axis=0)[:batch]
        out[k] = np.ascontiguousarray(v)
    return out


def _save_inputs(path: Path, feeds: dict[str, np.ndarray]) -> None:
    import io

    buf = io.BytesIO()
    arrays: dict[str, Any] = {k: np.ascontiguousarray(v) for k, v in feeds.items()}  # Any: numpy's stub reads **kwds as allow_pickle
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


NODE_LABELS = "node_labels.json"


def _drop_unused_source_graph(folder: Path, files: dict[str, str], metrics: dict[str, Any]) -> None:
    """The exported graph in ``onnx/`` is removed when the runtime loads an ONNX graph of its own
    instead (ONNX Runtime's saved optimized graph holds the same weights) and none of its files
    lies in ``onnx/``: an engine folder holds one copy of the model. Its size and digest stay in
    the metrics; the inputs record names where it came from."""
    model = files.get("model", "")
    if ("onnx" not in files or not model.endswith(".onnx")
            or any(Path(v).parts[:1] == (ONNX_DIR,) for k, v in files.items() if k != "onnx")):
        return

    src = folder / files.pop("onnx")
    labels = node_labels(src)  # the exporter's module paths, which the runtime's optimized copy drops
    if labels:
        atomic_write_json(folder / NODE_LABELS, labels)
        files["node_labels"] = NODE_LABELS
    metrics["source_onnx"] = {"sha256": sha256_file(src),
                              "bytes": sum(f.stat().st_size for f in (folder / ONNX_DIR).iterdir() if f.is_file())}
    shutil.rmtree(folder / ONNX_DIR)


def _fit_feeds(feeds: dict[str, np.ndarray], onnx_path: Path) -> dict[str, np.ndarray]:
    """Only the feeds the graph takes (an ONNX graph may drop an unused input)."""
    m = read_graph_outline(onnx_path)  # names only: the weights are not read
    init = {i.name for i in m.graph.initializer}
    names = [i.name for i in m.graph.input if i.name not in init]
    return {n: feeds[n] for n in names if n in feeds} if all(n in feeds for n in names) else {}


def _precision(handle: ModelHandle, options: BuildOptions, onnx_path: Path | None = None) -> str:
    """What the engine computes in: the quantization step's bits, else what the ONNX graph
    holds (Q/DQ or integer ops: an external quantized model), else the requested precision."""
    if handle.quantized is not None:  # what compress's steps left (8-bit packed weights are int8)
        return handle.quantized
    if options.precision == "fp32" and onnx_path is not None:
        try:
            nodes = list(read_graph_outline(onnx_path).graph.node)
        except (OSError, ValueError, ProtobufError):  # no graph to read: the precision asked for
            return options.precision
        ops = {n.op_type for n in nodes}
        if ops & {"MatMulNBits", "GatherBlockQuantized"}:  # packed weights: their ``bits`` (default 4)
            bits = [a.i for n in nodes if n.op_type in ops & {"MatMulNBits", "GatherBlockQuantized"}
                    for a in n.attribute if a.name == "bits"]
            return "int8" if bits and min(bits) == 8 else "int4"
        if ops & {"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "MatMulInteger",
                  "ConvInteger", "DynamicQuantizeLinear"}:
            return "int8"
    return options.precision


def _kind(folder: Path) -> str | None:
    try:
        return read_manifest(folder).kind
    except BadInputError:
        return None
