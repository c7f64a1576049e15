"""ONNX Runtime engines (CPU, CUDA and TensorRT execution providers).

build: open the ONNX graph with the target's execution providers and graph
optimizations, and save the optimized graph (ORT's offline optimization) as the
engine's ``model.opt.onnx``. ORT warns that a graph optimized at the highest levels
may hold hardware-specific fused or layout nodes; the engine is built for one target,
and the saved graph is re-opened and run once at build time and compared with the
online-optimized session. When it does not load or does not agree, the engine falls
back to the original graph optimized at load time (recorded in the manifest).

load: an ``OrtEngine`` (run, timed_run, node_profile, close). ``node_profile`` uses
ORT's own profiler: per node time, op type, execution provider, and whether the
node computes in integers (QLinearConv, MatMulInteger, MatMulNBits, ... or a fused
node fed int8/uint8 tensors).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit import interrupts
from edgekit.artifact import Manifest
from edgekit.errors import BadInputError, UnavailableError
from edgekit.kv_cache import KVCacheDecoder, is_causal_lm_session
from edgekit.onnx_checks import allocation_failures, optimization_level, ort_failure, ort_module
from edgekit.onnx_checks import session_options as base_session_options
from edgekit.runtimes.base import BuildOptions, CheckedEngine, NodeTiming, RecordedRun, Runtime, resolve_onnx
from edgekit.runtimes.ort_providers import build_providers, load_providers, warm_ep_cache
from edgekit.sources.handle import InputSpec, ModelHandle, random_inputs
from edgekit.sources.onnx_file import read_graph_outline
from edgekit.targets import Target

OPT_FILE = "model.opt.onnx"
OPT_DATA_FILE = "model.opt.onnx.data"

# Ops that compute in integer arithmetic or read packed integer weights.
INTEGER_OPS = {
    "QLinearConv": "int8", "QLinearMatMul": "int8", "ConvInteger": "int8", "MatMulInteger": "int8",
    "MatMulIntegerToFloat": "int8", "DynamicQuantizeMatMul": "int8", "DynamicQuantizeLSTM": "int8",
    "QGemm": "int8", "QAttention": "int8", "QOrderedMatMul": "int8", "QOrderedAttention": "int8",
    "QLinearAdd": "int8", "QLinearMul": "int8", "QLinearAveragePool": "int8", "QLinearGlobalAveragePool": "int8",
    "QLinearConcat": "int8", "QLinearLeakyRelu": "int8", "QLinearSigmoid": "int8", "QLinearSoftmax": "int8",
    "QLinearReduceMean": "int8", "QLinearWhere": "int8", "QEmbedLayerNormalization": "int8",
    "MatMulNBits": "int4", "GatherBlockQuantized": "int4", "MatMulBnb4": "int4",
}
NBITS_OPS = ("MatMulNBits", "GatherBlockQuantized")  # their ``bits`` attribute (default 4) gives the width
_INT8_TYPES = {"int8", "uint8"}
_INT4_TYPES = {"int4", "uint4"}
_FP16_TYPES = {"float16"}
_BF16_TYPES = {"bfloat16"}
# ORT's profiler type names -> numpy-ish names.
_ORT_TYPES = {"float": "float32", "double": "float64", "int8_t": "int8", "uint8_t": "uint8", "int8": "int8",
              "uint8": "uint8", "MLFloat16": "float16", "float16": "float16", "BFloat16": "bfloat16",
              "int32_t": "int32", "int64_t": "int64", "Int4x2": "int4", "UInt4x2": "uint4", "bool": "bool"}


def select_providers(requested: tuple[str, ...] | list[str], target_name: str = "target") -> list[str]:
    """The target's execution providers that exist here; a missing GPU provider is an error."""
    available = list(ort_module().get_available_providers())
    requested = list(requested) or ["CPUExecutionProvider"]
    missing = [p for p in requested if p not in available and p != "CPUExecutionProvider"]
    if missing:
        raise UnavailableError(f"execution provider {missing[0]!r} requested by target {target_name!r} is not "
                               f"available in this onnxruntime build (available: {', '.join(available)})")
    chosen = [p for p in requested if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")  # ORT's own fallback for nodes other EPs do not take
    return chosen


def session_options(level: str, threads: int | None, profile_prefix: str | None = None,
                    optimized_path: str | None = None, large: bool = False) -> Any:
    """``onnx_checks.session_options`` plus what an engine adds: the optimized graph saved to
    ``optimized_path`` (its weights apart when ``large``), ORT's profiler."""
    so = base_session_options(level, threads)
    if optimized_path:
        so.optimized_model_filepath = optimized_path
        if large:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", OPT_DATA_FILE)
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    return so


def _session(path: Path, so: Any, providers: list[Any]) -> Any:
    """A session; ``providers`` is ORT's ``providers=`` argument: names, or ``(name, options)``
    pairs for the GPU providers (``ort_providers``: TensorRT EP precision, engine cache, ...)."""
    ort = ort_module()
    try:
        return ort.InferenceSession(str(path), so, providers=providers)
    except Exception as e:  # ORT's pybind errors, and provider-option errors: all mean "cannot load"
        raise BadInputError(f"onnxruntime cannot load {path}: {ort_failure(e, path)}") from None


def _inputs_of(sess: Any) -> list[InputSpec]:
    out = []
    for i in sess.get_inputs():
        dtype = _type_to_numpy(i.type)
        shape = tuple(d if isinstance(d, int) else (d or f"dim{k}") for k, d in enumerate(i.shape))
        if shape and isinstance(shape[0], str):
            shape = ("batch", *shape[1:]) if shape[0] in ("batch", "N", "batch_size", "unk__0", "dim0") else shape
        out.append(InputSpec(i.name, shape, dtype))
    return out


def _type_to_numpy(t: str) -> str:
    inner = t[len("tensor("):-1] if t.startswith("tensor(") else t
    return {"float": "float32", "double": "float64", "float16": "float16"}.get(inner, inner)


def _sample_feeds(inputs: list[InputSpec]) -> dict[str, np.ndarray]:

    return random_inputs(inputs, 1)


class OnnxRuntime:
    """The ``onnxruntime`` runtime (the Runtime protocol)."""

    name = "onnxruntime"
    input_format = "onnx"
    int8_scheme: str | None = None

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime  # noqa: F401
        except ImportError as e:  # pragma: no cover
            return False, f"onnxruntime is not installed ({e})"
        return True, ""

    def measures_here(self, target: Target) -> bool:
        """The CPU targets this machine stands for (``Target.is_this_machine``: the same architecture
        and integer kernels): an engine timed here says nothing of a GPU's latency or another CPU's."""
        return target.is_this_machine

    def recorded_run(self, folder: Path, manifest: Manifest | None) -> RecordedRun | None:
        return None  # ONNX Runtime engines are timed here, by profiling

    def build(self, model: Path | ModelHandle, target: Target, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        """Optimize ``model`` (an ONNX file or onnx artifact) for ``target`` into ``out_dir``."""

        src = resolve_onnx(model)
        out_dir = Path(out_dir)
        providers = select_providers(tuple(getattr(target, "execution_providers", ()) or ()),
                                     getattr(target, "name", "target"))
        if options.precision == "bf16" and providers == ["CPUExecutionProvider"]:
            raise BadInputError("ONNX Runtime's CPU execution provider cannot run precision 'bf16' (choose from "
                                "fp32, int8, int4; or --runtime openvino for bf16)")
        level = options.optimization_level
        optimization_level(level)  # validate
        notes: list[str] = []
        if target.kind == "cpu" and not target.is_this_machine and level in ("layout", "all"):
            # the saved graph of those levels holds this machine's layouts and fused kernels
            notes.append(f"optimization level {level!r} would save a graph for this machine's CPU, not target "
                         f"{target.name!r}'s: saved at 'extended' (its runtime applies the rest when it loads)")
            level = "extended"
        large = _has_external_data(src)
        opt_path = out_dir / OPT_FILE
        t0 = time.perf_counter()
        so = session_options(level, options.threads, optimized_path=str(opt_path), large=large)

        provider_arg, provider_options = build_providers(providers, options, out_dir, target)
        sess = _session(src, so, provider_arg)
        build_s = time.perf_counter() - t0
        inputs = _inputs_of(sess)
        feeds = options.extra.get("feeds") or _sample_feeds(inputs)
        offline = opt_path.is_file()
        warm: dict[str, Any] = {}
        if "TensorrtExecutionProvider" in providers:  # its engines build at the first inference: do it now

            warm = warm_ep_cache(sess, feeds, out_dir)
        try:
            ref = sess.run(None, feeds)
        except Exception as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BadInputError(f"onnxruntime cannot run {src.name} on its sample inputs "
                                f"{ {k: (tuple(v.shape), str(v.dtype)) for k, v in feeds.items()} }: {msg}") from None
        if offline:  # the saved graph must load and agree with the online-optimized session
            try:
                check = _session(opt_path, session_options("disable", options.threads), provider_arg)
                got = check.run(None, feeds)
                bad = [i for i, (a, b) in enumerate(zip(ref, got, strict=True))
                       if a.shape != b.shape or not np.allclose(a, b, atol=1e-4, rtol=1e-3, equal_nan=True)]
                if bad:
                    offline = False
                    notes.append(f"the saved optimized graph disagrees with the online one on output {bad[0]}; "
                                 "using the original graph optimized at load time")
                del check
            except Exception as e:  # ORT's caveat: some optimized graphs do not reload
                interrupts.reraise(e)
                offline = False
                notes.append(f"the saved optimized graph does not reload ({str(e).splitlines()[0][:200]}); "
                             "using the original graph optimized at load time")
        if offline:
            files = {"model": OPT_FILE}
            if (out_dir / OPT_DATA_FILE).exists():
                files["model_data"] = OPT_DATA_FILE
        else:
            for f in (opt_path, out_dir / OPT_DATA_FILE):
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
            files = {"model": os.path.relpath(src, out_dir) if _inside(src, out_dir) else _copy_model(src, out_dir)}
        graph = read_graph_outline(out_dir / files["model"])  # nodes only: the weights are not read
        op_counts: dict[str, int] = {}
        for node in graph.graph.node:
            op_counts[node.op_type] = op_counts.get(node.op_type, 0) + 1
        quantized_ops = sum(c for op, c in op_counts.items() if op in INTEGER_OPS)
        kernels = kernel_summary(out_dir / files["model"], providers)
        session = {
            "graph_optimization_level": level, "intra_op_num_threads": options.threads or 0,
            "inter_op_num_threads": 1, "execution_mode": "sequential", "providers": providers,
            "provider_options": provider_options, "offline_optimized": offline,
            # a graph saved below the level asked for (another CPU's target) gets the rest where it loads
            "load_optimization_level": options.optimization_level if level != options.optimization_level else
            ("disable" if offline else level),
        }
        return {
            "files": files,
            "config": {"session": session, "notes": notes,
                       "hardware_specific": level in ("layout", "all") and offline},
            "metrics": {"build_seconds": round(build_s, 3), "nodes": len(graph.graph.node),
                        "integer_nodes": quantized_ops, "op_counts": op_counts, "kernels": kernels,
                        "model_size_mb": round(_size_mb(out_dir, files), 3), **warm},
        }

    def load(self, engine_dir: Path, manifest: Manifest, threads: int | None = None) -> OrtEngine:
        engine_dir = Path(engine_dir)
        session = dict(manifest.config.get("session", {}))
        providers = select_providers(tuple(session.get("providers", ["CPUExecutionProvider"])),
                                     manifest.target or "engine")
        level = session.get("load_optimization_level", "disable")
        threads = threads if threads is not None else (session.get("intra_op_num_threads") or None)
        path = manifest.path_of(engine_dir, "model")

        provider_arg = load_providers(providers, session.get("provider_options") or {}, engine_dir)
        return OrtEngine(path, providers, level, threads, provider_arg)


class OrtEngine(CheckedEngine):
    """One ONNX Runtime session with edgekit's engine interface."""

    runtime = "onnxruntime"

    def __init__(self, path: Path, providers: list[str], level: str, threads: int | None,
                 provider_arg: list[Any] | None = None) -> None:
        self.path = Path(path)
        self.providers = providers
        self.provider_arg = provider_arg or list(providers)  # names or (name, options) pairs
        self.level = level
        self.threads = threads
        self.session = _session(self.path, session_options(level, threads), self.provider_arg)
        self.inputs = _inputs_of(self.session)
        self.outputs = [o.name for o in self.session.get_outputs()]

    @property
    def settings(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "providers": self.providers, "optimization_level": self.level,
                "intra_op_num_threads": self.threads or 0, "model": self.path.name}

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with allocation_failures():
            return list(self.session.run(None, feeds))

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        run = self.session.run
        with allocation_failures():
            t0 = time.perf_counter()
            run(None, feeds)
            return (time.perf_counter() - t0) * 1e3

    def profile_nodes(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        """Per-node times from ORT's profiler (a separate session, so end-to-end timing never
        pays for profiling), averaged over ``iterations`` runs after two warm-up runs."""
        tmp = tempfile.mkdtemp(prefix="edgekit-ortprof-")
        try:
            so = session_options(self.level, self.threads, profile_prefix=str(Path(tmp) / "ort"))
            sess = _session(self.path, so, self.provider_arg)
            warm = 2
            for _ in range(warm):
                sess.run(None, feeds)
            for _ in range(max(1, iterations)):
                sess.run(None, feeds)
            trace = sess.end_profiling()
            events = json.loads(Path(trace).read_text())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return parse_profile(events, runs=warm + max(1, iterations), skip_runs=warm,
                             graph_types=graph_dtypes(self.path), depthwise=depthwise_nodes(self.path),
                             node_bits=graph_bits(self.path))

    def token_decoder(self, max_length: int) -> KVCacheDecoder | None:
        return KVCacheDecoder(self.session, max_length) if is_causal_lm_session(self.session) else None

    def close(self) -> None:
        self.session = None


def parse_profile(events: list[dict[str, Any]], runs: int, skip_runs: int = 0,
                  graph_types: dict[str, tuple[str, str, list[str]]] | None = None,
                  depthwise: set[str] | None = None, node_bits: dict[str, int] | None = None) -> list[NodeTiming]:
    """ORT's profiler JSON (Chrome trace events) -> one NodeTiming per node, ms per inference.

    Node events are ``{"cat": "Node", "name": "<node>_kernel_time", "dur": us, "args":
    {"op_name", "provider", "input_type_shape": [{dtype: shape}, ...]}}``. The first
    ``skip_runs`` occurrences of each node (warm-up) are dropped. ``node_bits``: the ``bits``
    attribute of packed-weight nodes (``graph_bits``), which decides their precision label.
    """
    graph_types = graph_types or {}
    node_bits = node_bits or {}
    per_node: dict[str, dict[str, Any]] = {}
    for ev in events:
        if not isinstance(ev, dict) or ev.get("cat") != "Node":
            continue
        name = str(ev.get("name", ""))
        if not name.endswith("_kernel_time"):
            continue
        node = name[: -len("_kernel_time")]
        args = ev.get("args", {}) or {}
        rec = per_node.setdefault(node, {"durs": [], "op": args.get("op_name", ""),
                                         "provider": args.get("provider", ""), "types": []})
        rec["durs"].append(float(ev.get("dur", 0.0)))
        if not rec["types"]:
            for item in args.get("input_type_shape", []) or []:
                if isinstance(item, dict):
                    rec["types"].extend(_ORT_TYPES.get(k, k) for k in item)
    measured = max(1, runs - skip_runs)
    isa = cpu_isa_flags()
    out = []
    for node, rec in per_node.items():
        durs = rec["durs"]
        calls_per_run = max(1, round(len(durs) / max(1, runs)))
        kept = durs[skip_runs * calls_per_run:] or durs
        op = rec["op"] or graph_types.get(node, ("", "", []))[0]
        types = rec["types"] or graph_types.get(node, ("", "", []))[2]
        precision, quantized = node_precision(op, types, node_bits.get(node))
        out.append(NodeTiming(name=node, op_type=op, time_ms=sum(kept) / measured / 1e3, precision=precision,
                              quantized=quantized, calls=calls_per_run,
                              kernel=kernel_label(op, precision, rec["provider"] or "CPUExecutionProvider", isa,
                                                  domain=graph_types.get(node, ("", "", []))[1],
                                                  depthwise=node in (depthwise or ()))))
    for n in out:  # the provider is useful in reports; NodeTiming has no field for it, so keep it in the name
        prov = per_node[n.name]["provider"]
        if prov and prov != "CPUExecutionProvider":
            n.op_type = f"{n.op_type}@{prov.replace('ExecutionProvider', '')}"
    return out


# --- which kernels run: ONNX Runtime does not report MLAS's choice, so it is inferred from the op,
# its precision and the CPU's flags, the order MLAS's platform dispatch tries them in -------------

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
_GEMM_OPS = {"Conv", "FusedConv", "NhwcFusedConv", "MatMul", "FusedMatMul", "Gemm", "FusedGemm", "ConvTranspose",
             "Attention", "MultiHeadAttention", "GroupQueryAttention"}


@functools.cache
def cpu_isa_flags() -> tuple[str, ...]:
    """The CPU's SIMD and matrix flags that decide kernels (from /proc/cpuinfo; empty where unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return tuple(f for f in ISA_FLAGS if f in have)
    return ()


def kernel_label(op_type: str, precision: str, provider: str, isa: tuple[str, ...], domain: str = "",
                 depthwise: bool = False) -> str:
    """The kernel family and ISA a CPU node most likely runs: ``mlas-int8-u8s8/avx512-vnni`` for an
    int8 convolution or matmul on a VNNI CPU (MLAS's integer GEMM for that ISA),
    ``mlas-nchwc/avx512f`` for a float convolution in the NCHWc layout, ``mlas-sgemm/avx512f``
    for other float ones; depthwise convolutions run MLAS's depthwise kernels, named without
    an ISA (inferred: ONNX Runtime's profiler names the op, not the MLAS kernel). Other
    providers: their name."""
    if provider != "CPUExecutionProvider":
        return provider.replace("ExecutionProvider", "").lower()
    base = op_type.split("@")[0]
    flags = set(isa)
    avx = "avx512f" if "avx512f" in flags else "fma3" if "fma" in flags else "sse"
    if depthwise and precision in ("int8", "fp32"):
        return "mlas-int8-depthwise" if precision == "int8" else f"mlas-depthwise/{avx}"
    if precision == "int4" or base in NBITS_OPS:  # packed 4- or 8-bit weights: MLAS's n-bit GEMM
        return "mlas-sqnbitgemm/" + ("avx512-vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags
                                     else "avx2" if "avx2" in flags else "scalar")
    if precision == "int8" and (base in INTEGER_OPS or base in _GEMM_OPS):
        simd = ("amx" if "amx_int8" in flags else "avx512-vnni" if "avx512_vnni" in flags else "avx-vnni"
                if "avx_vnni" in flags else "avx512bw" if "avx512bw" in flags else "avx2" if "avx2" in flags
                else "sse4.1")
        return f"mlas-int8-u8s8/{simd}"
    if domain == "com.microsoft.nchwc" and base in ("Conv", "FusedConv"):
        return f"mlas-nchwc/{avx}"
    if base in _GEMM_OPS and precision == "fp32":
        return f"mlas-sgemm/{avx}"
    return "ort-cpu"


def depthwise_nodes(path: Path) -> set[str]:
    """Names of the convolutions in the graph at ``path`` with one group per input channel (group > 1)."""
    try:
        graph = read_graph_outline(path).graph
    except (OSError, ValueError):
        return set()
    out = set()
    for n in graph.node:
        if "Conv" in n.op_type:
            group = next((a.i for a in n.attribute if a.name == "group"), 1)
            if group > 1:
                out.add(n.name)
    return out


def kernel_summary(path: Path, providers: list[str]) -> dict[str, Any]:
    """Nodes of the engine's graph by inferred kernel (``kernel_label``), with the CPU's flags."""
    isa = cpu_isa_flags()
    provider = providers[0] if providers else "CPUExecutionProvider"
    counts: dict[str, int] = {}
    depthwise = depthwise_nodes(path)
    for name, (op, domain, types) in graph_dtypes(path).items():
        label = kernel_label(op, node_precision(op, types)[0], provider, isa, domain=domain,
                             depthwise=name in depthwise)
        counts[label] = counts.get(label, 0) + 1
    return {"isa": list(isa), "providers": providers,
            "source": "inferred from op types, precisions and CPU flags (ONNX Runtime does not report MLAS's "
                      "kernel choice)",
            "by_kernel": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def node_precision(op_type: str, input_types: list[str], bits: int | None = None) -> tuple[str, bool]:
    """(precision, quantized) of one node from its op type and its input dtypes; ``bits``: the
    node's ``bits`` attribute, for ops whose weights may be packed at several widths (an 8-bit
    ``MatMulNBits`` is int8, not int4)."""
    base = op_type.split("@")[0]
    if base in NBITS_OPS and bits:
        return f"int{int(bits)}", True
    if base in INTEGER_OPS:
        return INTEGER_OPS[base], True
    if base in ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"):
        return "fp32", False  # conversions, not integer compute
    types = set(input_types)
    if types & _INT4_TYPES:
        return "int4", True
    if types & _INT8_TYPES and base != "Cast":
        # a fused node fed int8/uint8 (e.g. a QDQ conv fused by the CPU EP), or data movement that
        # stays in the integer domain (MaxPool, Flatten, Transpose of uint8): no float round trip
        return "int8", True
    if types & _FP16_TYPES:
        return "fp16", False
    if types & _BF16_TYPES:
        return "bf16", False
    return "fp32", False


def graph_dtypes(path: Path) -> dict[str, tuple[str, str, list[str]]]:
    """node name -> (op_type, domain, input dtypes) from the (optimized) graph, as far as known."""
    try:
        model = read_graph_outline(path)  # types and names only: the weights are not read
    except (OSError, ValueError):  # no graph to read: no dtypes (best effort)
        return {}
    types: dict[str, str] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        et = vi.type.tensor_type.elem_type
        if et:
            types[vi.name] = _elem_name(et)
    for init in g.initializer:
        types[init.name] = _elem_name(init.data_type)
    return {n.name: (n.op_type, n.domain, [types.get(i, "") for i in n.input if i]) for n in g.node}


def graph_bits(path: Path) -> dict[str, int]:
    """node name -> ``bits`` attribute of the packed-weight nodes (``NBITS_OPS``) of a graph."""
    try:
        model = read_graph_outline(path)
    except (OSError, ValueError):  # no graph to read: no widths (best effort)
        return {}
    return {n.name: int(a.i) for n in model.graph.node if n.op_type in NBITS_OPS
            for a in n.attribute if a.name == "bits"}


def _elem_name(et: int) -> str:
    import onnx

    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(et))
    except (KeyError, ValueError, TypeError):  # no numpy dtype (bfloat16, float8, int4): ONNX's own name
        return onnx.TensorProto.DataType.Name(et).lower()


def _has_external_data(path: Path) -> bool:
    import onnx

    m = read_graph_outline(path)  # where each initializer's data lives, not the data
    return any(i.data_location == onnx.TensorProto.EXTERNAL for i in m.graph.initializer)


def _inside(path: Path, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(folder).resolve())
        return True
    except ValueError:
        return False


def _copy_model(src: Path, out_dir: Path) -> str:
    import onnx

    if _has_external_data(src):
        m = onnx.load(str(src))
        onnx.save_model(m, str(out_dir / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    else:
        shutil.copyfile(src, out_dir / "model.onnx")
    return "model.onnx"


def _size_mb(folder: Path, files: dict[str, str]) -> float:
    total = 0
    for rel in files.values():
        p = Path(folder) / rel
        if p.is_file():
            total += p.stat().st_size
            data = p.with_name(p.name + ".data")
            if data.is_file() and data.name not in files.values():
                total += data.stat().st_size
    return total / 2**20


# --- every ONNX file edgekit writes is loaded and run once before it is committed ------------




RUNTIME: Runtime = OnnxRuntime()

