"""Parsers for trtexec's JSON outputs, into a ``RecordedRun`` that profiling summarizes.

trtexec writes three JSON files when asked (formats as documented by TensorRT's
``samples/common/sampleReporting.cpp`` and read by its ``trt-engine-explorer``):

``--exportTimes=times.json``
    one record per timed inference: ``startEnqMs endEnqMs startH2dMs endH2dMs
    startComputeMs endComputeMs startD2hMs endD2hMs h2dMs computeMs d2hMs latencyMs``
    (TensorRT 8.x also writes ``endToEndMs`` and keeps the warm-up records; 10.x drops
    them). ``latencyMs = h2dMs + computeMs + d2hMs``.
``--exportProfile=profile.json``
    ``[{"count": N}, {"name", "timeMs", "averageMs", "medianMs", "percentage"}, ...]``:
    per-layer time summed over N profiled iterations (``medianMs`` since TensorRT 10).
``--exportLayerInfo=layers.json`` (with ``--profilingVerbosity=detailed``)
    ``{"Layers": [{"Name", "LayerType", "ParameterType", "Inputs": [...], "Outputs": [...],
    "Weights": {"Type", "Count"}, "Origin", "TacticName", ...}], "Bindings": [...]}``;
    each input/output has ``"Format/Datatype"`` such as ``"Thirty-two wide channel
    vectorized row major Int8 format"`` or ``"Row major linear FP32"``.

A layer's precision is the data type of its first input (as trt-engine-explorer
does), or its weights' type when that is 8-bit or narrower; it is *quantized* when that
precision is an integer or FP8 type. These parsers were tested on hand-written
fixtures in the documented format, not on files written by a real trtexec.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import Manifest, is_artifact, read_manifest
from edgekit.errors import BadInputError
from edgekit.runtimes.base import NodeTiming, RecordedRun, read_device_file, read_device_text

# The file names edgekit asks trtexec to write (build bundles and the trtexec path).
TIMES_JSON = "trtexec_times.json"
PROFILE_JSON = "trtexec_profile.json"
LAYERS_JSON = "trtexec_layers.json"
LOG_FILE = "trtexec.log"
QUANTIZED_PRECISIONS = ("int8", "uint8", "int4", "fp8", "fp4")
# trtexec warns when the coefficient of variation of GPU compute time exceeds 1 %
# (kUNSTABLE_PERF_REPORTING_THRESHOLD in TensorRT's samples/common/sampleReporting.cpp).
TRTEXEC_CV_THRESHOLD = 0.01

# Ordered: more specific names first ("BFloat16" before "Float", "UInt8" before "Int8").
_DTYPE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"bfloat16|\bbf16\b", "bf16"),
    (r"\bfp8\b|e4m3|e5m2", "fp8"),
    (r"\bfp4\b|e2m1", "fp4"),
    (r"\buint8\b", "uint8"),
    (r"\bint8\b", "int8"),
    (r"\bint4\b", "int4"),
    (r"\bfp16\b|\bhalf\b", "fp16"),
    (r"\bfp32\b|\bfloat\b", "fp32"),
    (r"\bint32\b", "int32"),
    (r"\bint64\b", "int64"),
    (r"\bbool\b", "bool"),
)


def dtype_of(fmt: str | None) -> str:
    """``"Thirty-two wide channel vectorized row major Int8 format"`` -> ``"int8"``."""
    if not fmt:
        return "unknown"
    s = str(fmt).lower()
    for pattern, name in _DTYPE_PATTERNS:
        if re.search(pattern, s):
            return name
    return "unknown"


def load_export_json(path: str | Path, what: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"trtexec {what} file {str(p)!r} does not exist")
    try:
        return json.loads(read_device_file(p, f"trtexec {what} file"))
    except RecursionError:
        raise BadInputError(f"{p} is nested too deeply; expected trtexec's {what} output") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{p} is not valid JSON ({e}); expected trtexec's {what} output") from None


# --- --exportTimes -------------------------------------------------------------------------

@dataclass
class TimingTrace:
    """Per-inference times from ``--exportTimes`` (milliseconds)."""

    latency_ms: list[float]  # h2d + compute + d2h, trtexec's "Latency"
    compute_ms: list[float]  # trtexec's "GPU Compute Time"
    h2d_ms: list[float]
    d2h_ms: list[float]
    enqueue_ms: list[float]
    walltime_ms: float  # first H2D start to last D2H end
    dropped_warmup: int = 0

    @property
    def throughput_per_s(self) -> float:
        return len(self.latency_ms) / self.walltime_ms * 1e3 if self.walltime_ms > 0 else 0.0


def read_times(path: str | Path, warmup_ms: float | None = None) -> TimingTrace:
    """Parse ``--exportTimes``. Records whose compute started before ``warmup_ms`` are
    dropped, as trtexec does for its own summary (TensorRT 8 files include warm-up)."""
    data = load_export_json(path, "--exportTimes")
    if not isinstance(data, list) or not data or not all(isinstance(r, dict) for r in data):
        raise BadInputError(f"{path} is not a trtexec --exportTimes file (expected a non-empty list of records)")
    need = ("computeMs", "latencyMs")
    missing = [k for k in need if k not in data[0]]
    if missing:
        raise BadInputError(f"{path} is not a trtexec --exportTimes file (records lack {missing})")
    records = data
    dropped = 0
    if warmup_ms is not None and "startComputeMs" in data[0]:
        kept = [r for r in data if float(r["startComputeMs"]) >= warmup_ms]
        if kept:
            dropped = len(data) - len(kept)
            records = kept
    lat = [float(r["latencyMs"]) for r in records]
    comp = [float(r["computeMs"]) for r in records]
    h2d = [float(r.get("h2dMs", 0.0)) for r in records]
    d2h = [float(r.get("d2hMs", 0.0)) for r in records]
    enq = [float(r["endEnqMs"]) - float(r["startEnqMs"]) if "startEnqMs" in r and "endEnqMs" in r else 0.0
           for r in records]
    if "startH2dMs" in records[0] and "endD2hMs" in records[-1]:
        wall = float(records[-1]["endD2hMs"]) - float(records[0]["startH2dMs"])
    else:
        wall = float(sum(lat))
    return TimingTrace(lat, comp, h2d, d2h, enq, wall, dropped)


# --- --exportProfile -----------------------------------------------------------------------

@dataclass
class LayerTime:
    name: str
    total_ms: float
    average_ms: float
    median_ms: float | None
    percentage: float


def read_profile(path: str | Path) -> tuple[int, list[LayerTime]]:
    """Parse ``--exportProfile``: (profiled iterations, per-layer times)."""
    data = load_export_json(path, "--exportProfile")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "count" not in data[0]:
        raise BadInputError(f"{path} is not a trtexec --exportProfile file (expected [{{\"count\": N}}, layers...])")
    count = int(data[0]["count"])
    layers = []
    for rec in data[1:]:
        if not isinstance(rec, dict) or "name" not in rec or "averageMs" not in rec:
            raise BadInputError(f"{path}: a layer record lacks 'name' or 'averageMs': {str(rec)[:80]}")
        layers.append(LayerTime(str(rec["name"]), float(rec.get("timeMs", rec["averageMs"] * count)),
                                float(rec["averageMs"]),
                                float(rec["medianMs"]) if "medianMs" in rec else None,
                                float(rec.get("percentage", 0.0))))
    return count, layers


# --- --exportLayerInfo ---------------------------------------------------------------------

@dataclass
class LayerInfo:
    name: str
    layer_type: str  # e.g. CaskConvolution, Reformat, Myelin, DLA
    op_type: str  # ParameterType where present (Convolution, Reformat, ...), else LayerType
    input_types: list[str] = field(default_factory=list)
    output_types: list[str] = field(default_factory=list)
    weights_type: str | None = None
    origin: str | None = None  # "QDQ" for layers made from Q/DQ nodes
    tactic: str | None = None

    @property
    def precision(self) -> str:
        weights = self.weights_type
        if weights in QUANTIZED_PRECISIONS:
            return weights
        if self.input_types and self.input_types[0] != "unknown":
            return self.input_types[0]
        if self.output_types:
            return self.output_types[0]
        return weights or "unknown"

    @property
    def quantized(self) -> bool:
        # A Q/DQ reformat turns float into int8 and a NoOp does nothing: neither computes in int8.
        if self.role != "compute":
            return False
        return self.precision in QUANTIZED_PRECISIONS

    @property
    def role(self) -> str:
        """"compute", "reformat" (layout or Q/DQ conversion) or "noop"."""
        return layer_role(self.op_type, self.name)

    @property
    def device(self) -> str:
        return "dla" if "dla" in self.layer_type.lower() else "gpu"


def layer_role(op_type: str, name: str) -> str:
    if op_type == "NoOp":
        return "noop"
    if op_type == "Reformat" or name.startswith("Reformatting CopyNode"):
        return "reformat"
    return "compute"


def precision_breakdown(nodes: list[NodeTiming]) -> dict[str, Any]:
    """Which layers really compute in a quantized type, which in float, and their time.

    Returns ``{"rows": [{"precision", "role", "layers", "time_ms", "share"}], "fallbacks":
    [{"name", "op_type", "precision", "time_ms"}]}``: ``fallbacks`` are the compute layers
    of a quantized engine that run in a float type (what to look at when INT8 is slow)."""
    total = sum(n.time_ms for n in nodes) or 1.0
    groups: dict[tuple[str, str], list[NodeTiming]] = {}
    for n in nodes:
        groups.setdefault((n.precision, layer_role(n.op_type, n.name)), []).append(n)
    ordered = sorted(groups.items(), key=lambda kv: -sum(n.time_ms for n in kv[1]))
    rows = [{"precision": p, "role": r, "layers": len(ns), "time_ms": sum(n.time_ms for n in ns),
             "share": sum(n.time_ms for n in ns) / total} for (p, r), ns in ordered]
    quantized = any(n.quantized for n in nodes)
    fell_back = [n for n in nodes if quantized and not n.quantized and layer_role(n.op_type, n.name) == "compute"]
    fallbacks = [{"name": n.name, "op_type": n.op_type, "precision": n.precision, "time_ms": n.time_ms}
                 for n in sorted(fell_back, key=lambda n: -n.time_ms)]
    return {"rows": rows, "fallbacks": fallbacks}


def read_layer_info(path: str | Path) -> list[LayerInfo]:
    """Parse ``--exportLayerInfo`` (needs ``--profilingVerbosity=detailed``)."""
    data = load_export_json(path, "--exportLayerInfo")
    layers = data.get("Layers") if isinstance(data, dict) else None
    if not isinstance(layers, list):
        raise BadInputError(f"{path} is not a trtexec --exportLayerInfo file (no 'Layers' list)")
    if layers and not isinstance(layers[0], dict):
        raise BadInputError(f"{path} holds only layer names: rebuild with --profilingVerbosity=detailed "
                            "to get per-layer precision")
    out = []
    for raw in layers:
        weights = raw.get("Weights")
        wtype = dtype_of(weights.get("Type")) if isinstance(weights, dict) and "Type" in weights else None
        out.append(LayerInfo(
            name=str(raw.get("Name", "")),
            layer_type=str(raw.get("LayerType", "")),
            op_type=str(raw.get("ParameterType") or raw.get("LayerType") or "unknown"),
            input_types=[dtype_of(t.get("Format/Datatype")) for t in raw.get("Inputs", []) if isinstance(t, dict)],
            output_types=[dtype_of(t.get("Format/Datatype")) for t in raw.get("Outputs", []) if isinstance(t, dict)],
            weights_type=wtype, origin=raw.get("Origin"), tactic=raw.get("TacticName")))
    return out


# --- the log: build options, device, performance summary ----------------------------------------

_LOG_LINE = re.compile(r"^\[\d+/\d+/\d+-\d+:\d+:\d+\] \[I\] (.*)$")
_SECTIONS = {"Model Options": "model_options", "Build Options": "build_options",
             "Inference Options": "inference_options", "Device Information": "device_information",
             "Performance summary": "performance_summary"}
_STAT = re.compile(r"(min|max|mean|median|percentile\((\d+(?:\.\d+)?)%\))\s*=\s*([-+0-9.eE]+)")
# Engine Explorer's metadata keeps a stats line as a bare list, in trtexec's printing order.
_TREX_STAT_ORDER = {5: ("min", "max", "mean", "median", "p99"), 7: ("min", "max", "mean", "median", "p90", "p95", "p99")}
_STAT_LINES = ("Latency", "Enqueue Time", "H2D Latency", "GPU Compute Time", "D2H Latency")


def _parse_stats(text: str) -> dict[str, float]:
    """``min = 0.87 ms, max = ..., percentile(99%) = 0.88 ms`` -> {"min", "max", ..., "p99"}."""
    out = {}
    for name, pct, value in _STAT.findall(text):
        key = f"p{pct.rstrip('0').rstrip('.') if '.' in pct else pct}" if pct else name
        out[key] = float(value)
    return out


def read_trtexec_log(path: str | Path) -> dict[str, dict[str, Any]]:
    """The option, device and performance sections of a trtexec log (``trtexec ... | tee log``):
    {"build_options": {"Precision": "FP32+FP16+INT8", ...}, "device_information": {"Selected Device":
    ..., "Compute Capability": "8.7", ...}, "performance_summary": {"Throughput": 1130.0,
    "GPU Compute Time": {"min", "max", "mean", "median", "p90", "p95", "p99"}, ...}, ...}."""
    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"trtexec log {str(p)!r} does not exist")
    out: dict[str, dict[str, Any]] = {}
    section: dict[str, Any] | None = None
    for raw in read_device_text(p, "trtexec log").splitlines():
        m = _LOG_LINE.match(raw.strip())
        text = m.group(1).strip() if m else ""
        header = re.fullmatch(r"=== (.+) ===", text)
        if header:
            key = _SECTIONS.get(header.group(1))
            section = out.setdefault(key, {}) if key else None
            continue
        if section is None or ":" not in text:
            section = None if not m else section
            continue
        key, value = (x.strip() for x in text.split(":", 1))
        if key in _STAT_LINES:
            section[key] = _parse_stats(value)
        elif key in ("Throughput", "Total Host Walltime", "Total GPU Compute Time"):
            number = re.match(r"[-+0-9.eE]+", value)
            section[key] = float(number.group(0)) if number else value
        else:
            section[key] = value
    return out


def read_trex_metadata(path: str | Path) -> dict[str, dict[str, Any]]:
    """TensorRT Engine Explorer's ``*.build.metadata.json`` / ``*.profile.metadata.json`` (the
    same log sections, stats as bare lists) in ``read_trtexec_log``'s form."""
    data = load_export_json(path, "Engine Explorer metadata")
    if not isinstance(data, dict) or not any(k in data for k in _SECTIONS.values()):
        raise BadInputError(f"{path} is not Engine Explorer metadata (no {', '.join(_SECTIONS.values())} section)")
    out = {k: dict(v) for k, v in data.items() if k in _SECTIONS.values() and isinstance(v, dict)}
    perf = out.get("performance_summary", {})
    for key in _STAT_LINES:
        values = perf.get(key)
        if isinstance(values, list) and len(values) in _TREX_STAT_ORDER:
            perf[key] = dict(zip(_TREX_STAT_ORDER[len(values)], (float(v) for v in values), strict=True))
    return out


# --- into a RecordedRun ---------------------------------------------------------------------

def nodes_from_trtexec(layer_times: list[LayerTime], layer_info: list[LayerInfo] | None) -> list[NodeTiming]:
    """Join per-layer times with per-layer precision by layer name."""
    info = {li.name: li for li in (layer_info or [])}
    nodes = []
    for lt in layer_times:
        li = info.get(lt.name)
        if li is not None:
            nodes.append(NodeTiming(lt.name, li.op_type, lt.average_ms, precision=li.precision, quantized=li.quantized))
        else:
            op = "Reformat" if lt.name.startswith("Reformatting CopyNode") else "unknown"
            nodes.append(NodeTiming(lt.name, op, lt.average_ms, precision="unknown", quantized=False))
    return nodes


def recorded_run_from_trtexec(*, times: str | Path, profile: str | Path | None = None, layers: str | Path | None = None,
                              engine: str = "", target: str | None = None, model: str | None = None,
                              settings: dict[str, Any] | None = None, metric: str = "latency",
                              warmup_ms: float | None = None, source: str = "trtexec") -> RecordedRun:
    """trtexec's JSON outputs as a ``RecordedRun`` (profiling turns it into a ``ProfileResult``).

    ``metric`` chooses what the latency samples hold: ``"latency"`` (H2D + GPU compute + D2H,
    trtexec's "Latency") or ``"compute"`` (GPU compute time only); the GPU compute
    statistics are kept in ``settings`` either way.
    """
    if metric not in ("latency", "compute"):
        raise BadInputError(f"unknown trtexec metric {metric!r} (choose from 'compute', 'latency')")
    trace = read_times(times, warmup_ms=warmup_ms)
    samples = trace.latency_ms if metric == "latency" else trace.compute_ms
    compute = np.asarray(trace.compute_ms, dtype=np.float64)
    compute_cv = float(compute.std(ddof=1) / compute.mean()) if compute.size > 1 and compute.mean() > 0 else 0.0
    warnings: list[str] = []
    if compute_cv > TRTEXEC_CV_THRESHOLD:
        warnings.append(f"GPU compute time varies: coefficient of variation {compute_cv:.1%} exceeds "
                        f"{TRTEXEC_CV_THRESHOLD:.1%} (trtexec's threshold); check clocks and power mode")
    nodes: list[NodeTiming] = []
    profile_count = None
    if profile is not None:
        profile_count, layer_times = read_profile(profile)
        info = read_layer_info(layers) if layers is not None else None
        nodes = nodes_from_trtexec(layer_times, info)
        if info is not None:
            dla = [li for li in info if li.device == "dla"]
            if dla:
                fell_back = [li.name for li in info if li.device == "gpu" and li.op_type != "Reformat"]
                if fell_back:
                    warnings.append(f"{len(fell_back)} layers run on the GPU, not the DLA: "
                                    + ", ".join(fell_back[:5]) + (" ..." if len(fell_back) > 5 else ""))
    mean_of = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    q = np.percentile(compute, [50, 90, 95, 99])
    all_settings = {
        **(settings or {}),
        "metric": metric,
        "timed_inferences": len(samples),
        "dropped_warmup_records": trace.dropped_warmup,
        "gpu_compute_ms": {"min": float(compute.min()), "mean": float(compute.mean()), "p50": float(q[0]),
                           "p90": float(q[1]), "p95": float(q[2]), "p99": float(q[3]), "max": float(compute.max()),
                           "cv": compute_cv, "count": int(compute.size)},
        "h2d_mean_ms": mean_of(trace.h2d_ms),
        "d2h_mean_ms": mean_of(trace.d2h_ms),
        "enqueue_mean_ms": mean_of(trace.enqueue_ms),
        "walltime_ms": trace.walltime_ms,
    }
    if profile_count is not None:
        all_settings["profiled_iterations"] = profile_count
    if nodes and any(n.precision != "unknown" for n in nodes):
        breakdown = precision_breakdown(nodes)
        all_settings["precision_breakdown"] = breakdown
        fb = breakdown["fallbacks"]
        if fb:
            warnings.append(f"{len(fb)} compute layers of this quantized engine run in float: "
                            + ", ".join(f"{f['name']} ({f['precision']}, {f['time_ms']:.3f} ms)" for f in fb[:5])
                            + (" ..." if len(fb) > 5 else ""))
    return RecordedRun(runtime="tensorrt", latency_ms=list(samples), nodes=nodes, settings=all_settings, warnings=warnings, source=source,
                       throughput_per_s=trace.throughput_per_s, engine=engine, target=target, model=model)


def trtexec_outputs(folder: str | Path) -> dict[str, Path]:
    """The trtexec JSON outputs present in a bundle or engine folder (role -> path).

    Looks in the folder and in its ``results/`` subfolder (where a bundle's build.sh
    writes them)."""
    folder = Path(folder)
    found: dict[str, Path] = {}
    for base in (folder, folder / "results"):
        for role, name in (("times", TIMES_JSON), ("profile", PROFILE_JSON), ("layers", LAYERS_JSON)):
            if role not in found and (base / name).is_file():
                found[role] = base / name
    return found


def recorded_run_from_folder(folder: str | Path, manifest: Manifest | None = None, *,
                             metric: str = "latency", found: dict[str, Path] | None = None) -> RecordedRun:
    """A RecordedRun from a bundle or engine folder where trtexec has written its JSON.

    ``found``: the exports by role (``times``, ``profile``, ``layers``, ``log``, ``metadata``: Engine
    Explorer's profile metadata); default: edgekit's file names in the folder or its ``results/``."""
    folder = Path(folder)
    found = dict(found) if found is not None else trtexec_outputs(folder)
    if "times" not in found:
        raise BadInputError(f"{folder} has no trtexec results ({TIMES_JSON}); run its build.sh on the device "
                            "first, then copy the folder back")
    if "log" not in found and (found["times"].parent / LOG_FILE).is_file():
        found["log"] = found["times"].parent / LOG_FILE
    target = model = None
    settings: dict[str, Any] = {}
    warmup_ms = None
    if manifest is None and is_artifact(folder):
        manifest = read_manifest(folder)
    sections: dict[str, dict[str, Any]] = {}
    if "log" in found:  # trtexec's own account: build options, device, its performance summary
        sections = read_trtexec_log(found["log"])
    elif "metadata" in found:  # the same sections as Engine Explorer kept them
        sections = read_trex_metadata(found["metadata"])
        if "build_metadata" in found:
            sections.update(read_trex_metadata(found["build_metadata"]))
    if manifest is not None:
        target = manifest.target
        model = (manifest.model or {}).get("name")
        trt = manifest.config.get("trtexec") or {}
        build = manifest.config.get("settings") or {}
        settings = {"precision": manifest.config.get("precision"), "trt_path": manifest.config.get("path"),
                    "trtexec_command": trt.get("command")}
        warmup_ms = build.get("warmup_ms")  # TensorRT 8 files keep the warm-up records
    if warmup_ms is None:  # the log's own warm-up, else trtexec's default (200 ms)
        warmup_ms = logged_warmup_ms(sections)
        settings["warmup_ms"] = warmup_ms
    run = recorded_run_from_trtexec(times=found["times"], profile=found.get("profile"), layers=found.get("layers"),
                                    engine=str(folder), target=target, model=model, settings=settings, metric=metric,
                                    warmup_ms=warmup_ms)
    if sections:
        run.settings["trtexec_log"] = sections
        device = sections.get("device_information", {})
        if device.get("Selected Device"):
            run.machine.setdefault("gpu", device["Selected Device"])
    return run


TRTEXEC_WARMUP_MS = 200.0  # trtexec's default --warmUp


def logged_warmup_ms(sections: dict[str, dict[str, Any]]) -> float:
    """The warm-up a trtexec run used, from its log's inference options ("Warmup: 200ms" or
    "Duration: 3s (+ 200ms warm up)"); trtexec's default when the log does not say."""
    options = sections.get("inference_options", {})
    for key in ("Warmup", "Duration"):
        m = re.search(r"(\d+(?:\.\d+)?)\s*ms", str(options.get(key, "")))
        if m:
            return float(m.group(1))
    return TRTEXEC_WARMUP_MS
