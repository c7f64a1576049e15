"""Export a model to an ONNX artifact folder, with a parity check against PyTorch.

Steps: ``torch.onnx.export`` with the dynamo exporter (the legacy TorchScript exporter
as a fallback, with a warning) tracing ``handle.module`` itself, so custom modules of
the compression steps export as they are; each compression step's ``rewrite_onnx``
in chain order (fake-quant -> QDQ, packed int4 linears -> MatMulNBits); the ONNX
checker and shape inference; one file below 2 GB, external data above; then parity:
ONNX Runtime against PyTorch on the model's own sample inputs at batch 1 and 2. The
artifact is written only when parity passes; a failing graph is kept beside the
output as ``<out>.failed.onnx`` for debugging.

An ONNX model (``handle.module is None``: an external file, an ONNX artifact, or a
compress artifact of an ONNX-only model) is validated and copied, without parity.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from edgekit import interrupts
from edgekit.artifact import Manifest, check_output_dir, input_record, staged_dir, write_manifest
from edgekit.errors import BadInputError, CheckFailedError, EdgekitError
from edgekit.export.config import ExportConfig
from edgekit.export.parity import check_parity, module_device
from edgekit.export.rope import traceable_rope
from edgekit.onnx_checks import ort_failure, verify_onnx_runs
from edgekit.onnx_int8_kernels import SEMANTICS, host_semantics
from edgekit.sources.handle import ModelHandle, StepRecord, stored_bytes
from edgekit.sources.inputs import InputOptions
from edgekit.sources.models import ArtifactLoader, load_model

log = logging.getLogger(__name__)

DYNAMO_MIN_OPSET = 18  # the dynamo exporter's lowest; below it the legacy exporter is used
LEGACY_MAX_OPSET = 20
# Above this many bytes of weights the graph is saved with external data (protobuf's 2 GB limit).
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**24
ONNX_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"


def export_onnx(model: str | os.PathLike[str] | ModelHandle, out_dir: str | os.PathLike[str],
                config: ExportConfig | None = None, input_options: InputOptions | None = None,
                rewrites: Mapping[str, Rewrite | None] | None = None, failed_path: Path | None = None,
                loaders: Mapping[str, ArtifactLoader] | None = None) -> Path:
    """Export ``model`` (a spec, folder or ModelHandle) to an "onnx" artifact folder.
    ``input_options`` (``--shapes``, ``--inputs``) set the inputs traced and compared.
    ``rewrites``: each compression step's graph rewrite by step name (default: those of the steps
    that made the model, ``ModelHandle.step_rewrites``), applied in chain order after tracing.
    ``loaders``: ``load_model``'s, for artifact kinds a higher layer defines (``edgekit.loading``'s
    ``export_onnx`` passes the compressed model's).
    ``failed_path``: where a graph that fails parity is kept (default ``<out_dir>.failed.onnx``;
    a caller exporting into a staging folder names a place that outlives it).

    >>> out = export_onnx("efficientnet-lite0", "out/onnx")  # doctest: +SKIP
    >>> read_manifest(out).metrics["parity"]["passed"]  # doctest: +SKIP
    True
    """

    config = config or ExportConfig()
    out_dir = Path(out_dir)
    if not isinstance(model, ModelHandle):
        check_output_dir(out_dir, (model,))  # before loading: a zoo model may be trained on first use
    handle = load_model(model, input_options, loaders=loaders)
    protect = (model, handle.source, handle.onnx_path, getattr(input_options, "inputs", None))  # never touched
    check_output_dir(out_dir, protect, expected_bytes=stored_bytes(handle))  # before any work, with room for it
    inputs = _input_records(model, handle)
    t0 = time.perf_counter()
    steps = [dataclasses.asdict(s) for s in handle.steps]
    if handle.module is None:
        if handle.onnx_path is None:
            raise BadInputError(f"model {handle.name!r} has neither a PyTorch module nor an ONNX file to export")
        with staged_dir(out_dir, protect) as tmp:
            files = _copy_onnx(Path(handle.onnx_path), tmp)
            given = handle.source if isinstance(model, ModelHandle) else str(model)  # the file or folder named
            verify_onnx_runs(tmp / files["onnx"], handle.sample_inputs(1), label=given, error=BadInputError)
            write_manifest(tmp, Manifest(
                kind="onnx", files=files, source=handle.source, model=handle.describe(), steps=steps,
                inputs=inputs, config={**config.to_dict(), "exporter": "copy",
                                       **({"input_options": input_options.to_dict()} if input_options else {})},
                metrics={"parity": {"skipped": True, "reason": "ONNX input: nothing to compare against"},
                         "export_seconds": round(time.perf_counter() - t0, 3)}))
        return out_dir

    with traceable_rope(handle.module):  # dynamic NTK and longrope choose their rotation in the graph
        proto, exporter = _trace(handle, config)
    proto = _apply_rewrites(proto, handle, rewrites)
    trace_s = time.perf_counter() - t0
    failed = failed_path or Path(f"{out_dir}.failed.onnx")
    with staged_dir(out_dir, protect) as tmp:
        files = _save_checked(proto, tmp)
        onnx_path = tmp / files["onnx"]
        parity: dict[str, Any] = {"skipped": True}
        if config.skip_parity:  # then at least loaded and run once
            verify_onnx_runs(onnx_path, handle.sample_inputs(1), label=f"the exported graph of {handle.name}")
        else:

            try:
                atol, rtol, per_output = effective_tolerances(config, handle)
                report = check_parity(onnx_path, handle, atol, rtol, per_output,
                                      batches=(1, 2) if config.dynamic_batch else (1,),
                                      semantics=parity_semantics(config, handle))
            except EdgekitError:
                raise
            except Exception as e:  # ONNX Runtime cannot even run the graph
                _keep_failed(onnx_path, failed)
                raise CheckFailedError(f"parity failed: ONNX Runtime could not run the exported graph "
                                       f"({ort_failure(e, onnx_path)}); kept it at {failed}") from None
            if not report.passed:
                _keep_failed(onnx_path, failed)
                hint = _scheme_hint(handle, parity_semantics(config, handle) or host_semantics())
                raise CheckFailedError(f"{report.message()}{hint}; the failing graph is kept at {failed}")
            parity = report.to_dict()
            log.info(report.message())
        with contextlib.suppress(FileNotFoundError):
            failed.unlink()
        write_manifest(tmp, Manifest(
            kind="onnx", files=files, source=handle.source, model=_describe(handle, config), steps=steps,
            inputs=inputs, config={**config.to_dict(), "exporter": exporter, "opset_used": _opset(proto),
                                   **({"input_options": input_options.to_dict()} if input_options else {})},
            metrics={"parity": parity, "export_seconds": round(trace_s, 3),
                     "total_seconds": round(time.perf_counter() - t0, 3),
                     "size_mb": round(sum((tmp / f).stat().st_size for f in files.values()) / 2**20, 3)}))
    return out_dir


def parity_semantics(config: ExportConfig, handle: ModelHandle) -> str | None:
    """The integer arithmetic an INT8 graph is judged in: the config's, else what the INT8 step
    recorded for its target (``meta["kernels"]``), else None (this machine's; float graphs)."""
    if config.int8_kernels is not None:
        return config.int8_kernels
    for rec in reversed(handle.steps):
        kernels = (rec.meta or {}).get("kernels")
        if isinstance(kernels, str) and kernels in SEMANTICS:
            return kernels
    return None


def _scheme_hint(handle: ModelHandle, semantics: str) -> str:
    """Why an INT8 graph with 8-bit weights fails where the integer kernels sum in int16 pairs."""
    # the INT8 step records its Q/DQ scheme (u8s8, u8s8p, u8s7, s8s8, trt) in its meta
    scheme = next((str(r.meta["scheme"]) for r in reversed(handle.steps) if "scheme" in (r.meta or {})), None)
    if scheme in ("u8s8", "s8s8") and semantics == "int16-pairs":
        return (" (its 8-bit weights overflow the int16 pair sums of x86 integer kernels without VNNI: compress "
                "for this target, whose INT8 scheme u8s8p keeps every pair of such weights within the int16 range)")
    return ""


def effective_tolerances(config: ExportConfig, handle: ModelHandle
                         ) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """Parity tolerances: the config's, loosened to what a compression step asks for in its
    record (``meta["parity"] = {"atol": .., "rtol": ..}``): a fake-quantized PyTorch model and
    its QDQ graph may differ by one quantization step, which FP32 tolerances would reject."""
    atol, rtol = float(config.atol), float(config.rtol)
    for rec in handle.steps:
        tol = (rec.meta or {}).get("parity") or {}
        atol = max(atol, float(tol.get("atol", 0.0)))
        rtol = max(rtol, float(tol.get("rtol", 0.0)))
    per_output = {k: (float(v[0]), float(v[1])) for k, v in config.tolerances.items()}  # explicit: as given
    return atol, rtol, per_output


def _describe(handle: ModelHandle, config: ExportConfig) -> dict[str, Any]:
    """``handle.describe()``, with the batch axis fixed to 1 when exported static."""
    d = handle.describe()
    if not config.dynamic_batch:
        for spec in d["inputs"]:
            spec["shape"] = [1 if x == "batch" else x for x in spec["shape"]]
        d["dynamic_axes"] = {}
    return d


# --- tracing -------------------------------------------------------------------------------


def _trace(handle: ModelHandle, config: ExportConfig) -> tuple[Any, str]:
    """(onnx.ModelProto, "dynamo" | "legacy")."""
    import torch

    module = handle.module
    module.eval()
    names = [s.name for s in handle.inputs]
    batch = config.batch if config.dynamic_batch and _batch_dynamic(handle) else 1
    feeds = handle.sample_inputs(batch)
    device = module_device(module)
    args = tuple(torch.from_numpy(feeds[n].copy()).to(device) for n in names)
    if config.dynamo and config.opset < DYNAMO_MIN_OPSET:
        log.warning("the dynamo ONNX exporter emits opset %d or later; using the legacy TorchScript exporter "
                    "for opset %d", DYNAMO_MIN_OPSET, config.opset)
    elif config.dynamo:
        try:
            return _trace_dynamo(module, args, handle, config), "dynamo"
        except EdgekitError:
            raise
        except Exception as e:
            interrupts.reraise(e)  # the exporter wraps a Ctrl-C in its own error
            log.warning("the dynamo ONNX exporter failed on %s (%s: %s); falling back to the legacy "
                        "TorchScript exporter", handle.name, type(e).__name__, _first_line(e))
    try:
        return _trace_legacy(module, args, handle, config), "legacy"
    except Exception as e:
        hf_config = handle.extra.get("hf_config") or {}
        experts = [hf_config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")]
        why = f"{type(e).__name__}: {_first_line(e)}"
        if any(isinstance(n, int) and n > 1 for n in experts):  # the usual cause, named where it applies
            why = (f"its mixture-of-experts layers ({hf_config.get('model_type')!r}) route each token through a "
                   f"data-dependent loop over experts, which neither ONNX exporter traces ({why})")
        raise BadInputError(f"cannot export {handle.name!r} to ONNX: {why}") from None


def _batch_dynamic(handle: ModelHandle) -> bool:
    return any(0 in axes and axes[0] == "batch" for axes in handle.dynamic_axes.values()) or any(
        s.shape and s.shape[0] == "batch" for s in handle.inputs)


def _dynamic_axes(handle: ModelHandle, config: ExportConfig) -> dict[str, dict[int, str]]:
    if not config.dynamic_batch:
        return {}
    axes = {k: dict(v) for k, v in handle.dynamic_axes.items()}
    for s in handle.inputs:  # the InputSpec's named axes are dynamic too
        for i, d in enumerate(s.shape):
            if isinstance(d, str):
                axes.setdefault(s.name, {})[i] = d
    return axes


def _trace_dynamo(module: Any, args: tuple[Any, ...], handle: ModelHandle, config: ExportConfig) -> Any:
    """Named dynamic dims first ("batch", "sequence"); when torch.export rejects them (the
    model constrains a dim, e.g. a fixed position table), once more with ``Dim.AUTO``
    (torch decides what stays dynamic) and the axis names set on the graph afterwards."""
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    axes = _dynamic_axes(handle, config)
    try:
        proto = _dynamo_export(module, args, handle, config, axes, auto=False)
    except Exception as e:
        if not axes:
            raise
        log.info("named dynamic axes rejected (%s); retrying with Dim.AUTO", _first_line(e))
        proto = _dynamo_export(module, args, handle, config, axes, auto=True)
        _name_input_dims(proto, axes)
    rename_outputs(proto, list(handle.outputs))
    return proto


def _dynamo_export(module: Any, args: tuple[Any, ...], handle: ModelHandle, config: ExportConfig,
                   axes: dict[str, dict[int, str]], auto: bool) -> Any:
    import torch

    dims: dict[str, Any] = {}
    dynamic_shapes = []
    for s in handle.inputs:
        spec = {}
        for ax, name in axes.get(s.name, {}).items():
            if auto:
                spec[int(ax)] = torch.export.Dim.AUTO
                continue
            if name not in dims:
                dims[name] = torch.export.Dim(_dim_name(name), min=1, max=1 << 20) if name == "batch" \
                    else torch.export.Dim(_dim_name(name))
            spec[int(ax)] = dims[name]
        dynamic_shapes.append(spec or None)
    with _quiet(), _torchlib_registry_reused():
        # Output names are set afterwards: the exporter's own renaming can clash with the
        # names it gave intermediate values (an output "embedding" after an aten.embedding).
        prog = torch.onnx.export(
            module, args, dynamo=True, input_names=[s.name for s in handle.inputs],
            opset_version=config.opset, dynamic_shapes=tuple(dynamic_shapes) if axes else None,
            verbose=False, optimize=True)
    if prog is None:  # only the legacy exporter writes to a file and returns nothing
        raise EdgekitError(f"torch.onnx.export returned no program for {handle.name}")
    proto = prog.model_proto
    drop_stack_traces(proto)
    return proto


STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"


def drop_stack_traces(proto: Any) -> int:
    """Remove the exporter's per-node Python stack traces (``pkg.torch.onnx.stack_trace``): they hold the
    absolute paths and line numbers of the exporting machine's source files, so a shipped graph would carry
    them and the same model exported from another folder would differ in its bytes. The module path of
    each node (``pkg.torch.onnx.name_scopes``, read by per-layer profiles) stays. Returns how many went."""
    def nodes(graph_nodes: Any) -> Iterator[Any]:  # with the nodes of If / Loop / Scan bodies
        for n in graph_nodes:
            yield n
            for a in n.attribute:
                for g in [a.g] if a.HasField("g") else list(a.graphs):
                    yield from nodes(g.node)

    dropped = 0
    for n in [*nodes(proto.graph.node), *(m for f in proto.functions for m in nodes(f.node))]:
        keep = [p for p in n.metadata_props if p.key != STACK_TRACE_KEY]
        if len(keep) != len(n.metadata_props):
            dropped += len(n.metadata_props) - len(keep)
            del n.metadata_props[:]
            n.metadata_props.extend(keep)
    return dropped


def _name_input_dims(proto: Any, axes: dict[str, dict[int, str]]) -> None:
    """Give the graph inputs' symbolic dims the handle's axis names (after a Dim.AUTO export)."""
    for vi in proto.graph.input:
        dims = vi.type.tensor_type.shape.dim
        for ax, name in axes.get(vi.name, {}).items():
            if int(ax) < len(dims) and not dims[int(ax)].HasField("dim_value"):
                dims[int(ax)].dim_param = name


def rename_outputs(proto: Any, names: list[str]) -> None:
    """Give the graph outputs ``names`` (in order), moving any other value of that name aside."""
    outs = [o.name for o in proto.graph.output]
    if len(names) != len(outs):
        if len(outs) == 1 and names:
            names = names[:1]
        else:
            log.warning("the model declares %d outputs %s but the graph has %d; keeping the graph's names",
                        len(names), names, len(outs))
            return
    taken = _value_names(proto.graph)
    for old, new in zip(outs, names, strict=True):
        if old == new:
            continue
        if new in taken:  # an intermediate value already has this name: rename it first
            alt, k = f"{new}_0", 0
            while alt in taken:
                k += 1
                alt = f"{new}_{k}"
            _rename_value(proto.graph, new, alt)
            taken.add(alt)
        _rename_value(proto.graph, old, new)
        taken.add(new)


def _value_names(graph: Any) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.output)
        names.update(node.input)
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                names |= _value_names(g)
    return names


def _rename_value(graph: Any, old: str, new: str) -> None:
    for coll in (graph.input, graph.output, graph.value_info):
        for v in coll:
            if v.name == old:
                v.name = new
    for init in graph.initializer:
        if init.name == old:
            init.name = new
    for node in graph.node:
        for i, n in enumerate(node.input):
            if n == old:
                node.input[i] = new
        for i, n in enumerate(node.output):
            if n == old:
                node.output[i] = new
        for attr in node.attribute:
            for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _rename_value(g, old, new)


def _trace_legacy(module: Any, args: tuple[Any, ...], handle: ModelHandle, config: ExportConfig) -> Any:
    import onnx
    import torch

    axes = _dynamic_axes(handle, config)
    with tempfile.TemporaryDirectory(prefix="edgekit-export-") as tmp, _quiet():
        path = Path(tmp) / ONNX_FILE
        torch.onnx.export(module, args, str(path), dynamo=False, input_names=[s.name for s in handle.inputs],
                          output_names=list(handle.outputs), opset_version=min(config.opset, LEGACY_MAX_OPSET),
                          dynamic_axes={k: {int(a): n for a, n in v.items()} for k, v in axes.items()} or None,
                          do_constant_folding=True)
        return onnx.load(str(path))  # loads external data, if the exporter wrote any


def _dim_name(name: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "dim"


_TORCHLIB_REGISTRIES: dict[int, Any] = {}  # opset -> the exporter's registry of ATen -> ONNX functions


@contextlib.contextmanager
def _torchlib_registry_reused() -> Iterator[None]:
    """The dynamo exporter builds its registry of ATen -> ONNX functions on every call
    (``ONNXRegistry.from_torchlib``: the source of ~500 onnxscript functions parsed again, about 1 CPU s,
    two thirds of a small model's export). Built once per opset and process, each export gets a copy
    of the lists it may extend with custom ops; the registry's contents, and so the graph, are the same.
    A torch without that internal exports as it would anyway."""
    try:
        from torch.onnx._internal.exporter import _registration
        registry_cls = _registration.ONNXRegistry
        build = registry_cls.__dict__["from_torchlib"]
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def from_torchlib(cls: Any, opset_version: int = _registration._constants.TORCHLIB_OPSET) -> Any:
        if opset_version not in _TORCHLIB_REGISTRIES:
            _TORCHLIB_REGISTRIES[opset_version] = build.__func__(cls, opset_version)
        base = _TORCHLIB_REGISTRIES[opset_version]
        registry = cls()
        registry._opset_version = base._opset_version
        registry.functions = {target: list(metas) for target, metas in base.functions.items()}
        return registry

    setattr(registry_cls, "from_torchlib", classmethod(from_torchlib))  # noqa: B010 (a method of torch's class)
    try:
        yield
    finally:
        setattr(registry_cls, "from_torchlib", build)  # noqa: B010


@contextlib.contextmanager
def _quiet() -> Any:
    """The exporters print progress lines to stdout; keep the CLI's output clean."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    for line in buf.getvalue().splitlines():
        log.debug(line)


# A compression step's graph rewrite: (proto, handle, the step's record) -> proto (None: changed in place).
Rewrite = Callable[[Any, ModelHandle, StepRecord], Any]
RewriteLookup = Callable[[str], "Rewrite | None"]
def _apply_rewrites(proto: Any, handle: ModelHandle, rewrites: Mapping[str, Rewrite | None] | None) -> Any:
    """Each step's graph rewrite, in chain order: from ``rewrites`` where given, else from the
    compression steps that made the handle (``handle.step_rewrites``)."""
    if not handle.steps:
        return proto
    for record in handle.steps:
        if rewrites is not None:
            rewrite = rewrites.get(record.name)
        elif handle.step_rewrites is not None:
            rewrite = handle.step_rewrites(record.name)
        else:
            raise EdgekitError(f"{handle.name} carries the compression step {record.name!r} but not its steps' "
                               "graph rewrites (load it with edgekit.load_model, or pass rewrites=)")
        if rewrite is not None:
            out = rewrite(proto, handle, record)
            proto = out if out is not None else proto
    return proto


# --- saving and checking -------------------------------------------------------------------


def weights_bytes(proto: Any) -> int:
    """Bytes of the initializers and constants, without serializing the whole graph."""
    total = 0
    for init in proto.graph.initializer:
        total += len(init.raw_data) if init.raw_data else init.ByteSize()
    for node in proto.graph.node:
        if node.op_type == "Constant":
            total += node.ByteSize()
    return total


def _save_checked(proto: Any, folder: Path) -> dict[str, str]:
    """Check, infer shapes and save ``proto`` into ``folder``; external data above the threshold."""
    import onnx

    path = folder / ONNX_FILE
    if weights_bytes(proto) > EXTERNAL_DATA_THRESHOLD:
        onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)
        try:
            onnx.checker.check_model(str(path))
            onnx.shape_inference.infer_shapes_path(str(path), str(path))
        except Exception as e:
            raise BadInputError(f"the exported graph is not valid ONNX: {_first_line(e)}") from None
        return {"onnx": ONNX_FILE, "onnx_data": DATA_FILE} if (folder / DATA_FILE).exists() else {"onnx": ONNX_FILE}
    try:
        onnx.checker.check_model(proto)
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception as e:
        raise BadInputError(f"the exported graph is not valid ONNX: {_first_line(e)}") from None
    onnx.save_model(proto, str(path))
    return {"onnx": ONNX_FILE}


def _copy_onnx(src: Path, folder: Path) -> dict[str, str]:
    """Copy a (validated) ONNX file; one with external data is re-saved with its data beside it."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    has_external = any(init.data_location == onnx.TensorProto.EXTERNAL for init in model.graph.initializer)
    if not has_external:
        shutil.copyfile(src, folder / ONNX_FILE)
        return {"onnx": ONNX_FILE}
    return _save_checked(onnx.load(str(src)), folder)


def _keep_failed(path: Path, failed: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.copyfile(path, failed)
        data = path.parent / DATA_FILE
        if data.exists():  # the graph refers to its data file by this name
            shutil.copyfile(data, failed.parent / DATA_FILE)
    log.warning("parity failed; the exported graph is kept at %s", failed)


def _opset(proto: Any) -> int | None:
    for o in proto.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return None


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _input_records(spec: Any, handle: ModelHandle) -> dict[str, dict[str, str]]:
    """What went in, with hashes: a file or folder is hashed; a zoo model or entry point by
    its weights (the state dict's bytes), so caches key on the actual model."""

    if not isinstance(spec, ModelHandle):
        p = Path(str(spec))
        if p.exists():
            return {"model": input_record(p)}
    if handle.onnx_path is not None and handle.module is None:
        return {"model": input_record(handle.onnx_path)}
    if handle.module is not None:
        h = hashlib.sha256()
        for k, v in handle.module.state_dict().items():
            h.update(k.encode())
            with contextlib.suppress(Exception):
                h.update(v.detach().cpu().contiguous().numpy().tobytes())
        return {"model": {"path": handle.source, "sha256": h.hexdigest()}}
    return {}
