"""Where device results come from, checked before they are believed.

A results folder (a bundle's ``results/`` as ``build.sh`` writes it, or trtexec exports a user
made by hand) records the machine and the engine that produced it, spread over several files:

- the GPU and its SM: ``device.txt`` (the probe), the trtexec log's "Device Information",
  Engine Explorer's ``*.profile.metadata.json``, or the engine manifest edgekit wrote;
- the TensorRT version: the trtexec banner in ``device.txt`` or the log, ``machine.txt``'s
  package version, the engine manifest;
- the engine's inputs: the layer info (``--exportLayerInfo``: each layer's input names and
  dimensions) and the shapes trtexec timed ("Input inference shape" in the log or metadata);
- its layers: the names in the per-layer profile and the layer info (TensorRT names a layer
  after the ONNX nodes fused into it; TensorRT 10 also keeps them in each layer's metadata).

``check_provenance(record, claim)`` compares them with what the bundle claims (``EngineClaim``:
the target's SM and TensorRT range, its ONNX graph's inputs, the optimization profile's batch,
the ONNX node and tensor names) and the files with each other. Any mismatch is bad input (exit
2) naming both sides; a fact no file records leaves the results ``unverified``, with the
reasons, rather than silently believed.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from edgekit.artifact import Manifest
from edgekit.errors import BadInputError
from edgekit.runtimes.base import MAX_DEVICE_NOTE_BYTES, Provenance, read_device_text
from edgekit.runtimes.tensorrt.device import parse_probe, trt_version_from_int
from edgekit.runtimes.tensorrt.parsers import (
    LAYERS_JSON,
    LOG_FILE,
    PROFILE_JSON,
    TIMES_JSON,
    load_export_json,
    read_trex_metadata,
    read_trtexec_log,
)
from edgekit.runtimes.tensorrt.settings import DEVICE_FILE, MACHINE_FILE, RESULTS_DIR
from edgekit.targets import Target, load_target

# Below this share of a profile's attributable layers carrying a name of the claimed ONNX, the
# results are of another model; below it between two files, the files are of different engines.
MIN_LAYER_OVERLAP = 0.5
_BANNER = re.compile(r"TensorRT v(\d{4,6})\b")
_VERSION_LINE = re.compile(r"TensorRT version:\s*(\d+\.\d+(?:\.\d+)*)")
_SHAPE = re.compile(r"([^\s=,]+)=(\d+(?:x\d+)*)")
_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]\x1e]+)\]")
# names TensorRT generates for layers of its own (Myelin regions, shape plumbing): no ONNX name to compare
_GENERATED = re.compile(r"^(__myl|__mye|\[trainStation|shuffle_(?:before|after|between)_|reshape_(?:before|after)_)")


# --- the files of a results folder ----------------------------------------------------------------

def find_exports(folder: Path) -> dict[str, Path]:
    """The trtexec exports and records in ``folder`` by role: ``times``, ``profile``, ``layers``,
    ``log``, ``metadata`` (Engine Explorer's profile metadata), ``build_metadata``, ``device``,
    ``machine``. edgekit's own names first; files named otherwise (a user's ``--exportTimes=t.json``)
    are recognised by their content. Two candidates for one role are bad input."""
    folder = Path(folder)
    found: dict[str, Path] = {}
    for role, name in (("times", TIMES_JSON), ("profile", PROFILE_JSON), ("layers", LAYERS_JSON), ("log", LOG_FILE),
                       ("device", DEVICE_FILE), ("machine", MACHINE_FILE)):
        if (folder / name).is_file():
            found[role] = folder / name
    candidates: dict[str, list[Path]] = {}
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not p.is_file() or p in found.values() or p.name.startswith("."):
            continue
        kind = _role_of(p)
        if kind is not None and kind not in found:
            candidates.setdefault(kind, []).append(p)
    for role, paths in candidates.items():
        if len(paths) > 1:
            raise BadInputError(f"{folder} holds {len(paths)} candidates for trtexec's {role} file "
                                f"({', '.join(p.name for p in paths)}); keep one engine's exports per folder")
        found[role] = paths[0]
    return found


def exports_of(folder: Path) -> dict[str, Path]:
    """``find_exports`` of the folder, or of its ``results/`` (a bundle or engine folder)."""
    found = find_exports(folder)
    if "times" not in found and (folder / RESULTS_DIR).is_dir():
        inner = find_exports(folder / RESULTS_DIR)
        if "times" in inner:
            return inner
    return found


def _role_of(path: Path) -> str | None:
    if path.suffix in (".log", ".txt"):
        with open(path, "rb") as f:  # a regular file (find_exports): its head only, however large
            head = f.read(20000).decode("utf-8", errors="replace")
        return "log" if ("TensorRT.trtexec" in head or "=== Performance summary ===" in head) else None
    if path.suffix != ".json" or path.stat().st_size > 64 << 20:
        return None
    try:
        data = load_export_json(path, "trtexec export")
    except BadInputError:
        return None
    if isinstance(data, list) and data and isinstance(data[0], dict):
        if "count" in data[0] and len(data[0]) == 1:
            return "profile"
        if "computeMs" in data[0] and "latencyMs" in data[0]:
            return "times"
    if isinstance(data, dict):
        if isinstance(data.get("Layers"), list):
            return "layers"
        if "performance_summary" in data or "device_information" in data:
            return "metadata"
        if "build_options" in data or "model_options" in data:
            return "build_metadata"
    return None


# --- what the files record ------------------------------------------------------------------------

@dataclass
class EngineRecord:
    """What a results folder says about the machine and the engine, each fact with its file."""

    sm: list[tuple[str, str]] = field(default_factory=list)  # (sm_87, file)
    gpu: list[tuple[str, str]] = field(default_factory=list)
    tensorrt: list[tuple[str, str]] = field(default_factory=list)
    inputs: dict[str, list[int | None]] = field(default_factory=dict)  # engine input -> dims (layer info)
    inputs_from: str = ""
    timed: dict[str, list[int]] = field(default_factory=dict)  # input -> the shape trtexec timed
    timed_from: str = ""
    profiled: list[str] = field(default_factory=list)  # layer names of the per-layer profile
    described: list[str] = field(default_factory=list)  # layer names of the layer info
    onnx_names: dict[str, list[str]] = field(default_factory=dict)  # layer -> ONNX names in its metadata


def _sm_of(cc: Any) -> str | None:
    m = re.fullmatch(r"(\d+)\.(\d+)", str(cc).strip())
    return f"sm_{m.group(1)}{m.group(2)}" if m else None


def read_record(found: dict[str, Path], manifest: Manifest | None = None) -> EngineRecord:
    rec = EngineRecord()
    if "device" in found:
        info = parse_probe(read_device_text(found["device"], f"{found['device'].stem} record", MAX_DEVICE_NOTE_BYTES))
        name = found["device"].name
        if info.sm:
            rec.sm.append((info.sm, name))
        if info.gpu:
            rec.gpu.append((info.gpu, name))
        if info.tensorrt_version:
            rec.tensorrt.append((info.tensorrt_version, name))
    if "machine" in found:
        m = re.search(r"^tensorrt_package=(\d+\.\d+(?:\.\d+)?)", read_device_text(found["machine"], f"{found['machine'].stem} record", MAX_DEVICE_NOTE_BYTES), re.M)
        if m:
            rec.tensorrt.append((m.group(1), found["machine"].name))
    if "log" in found:
        _read_log(found["log"], rec)
    if "metadata" in found:
        meta = read_trex_metadata(found["metadata"])
        _read_device_section(meta.get("device_information", {}), found["metadata"].name, rec)
        _read_inference_shapes([str(v) for k, v in meta.get("inference_options", {}).items()
                                if k.startswith("Input inference shape")], found["metadata"].name, rec)
    recorded = (manifest.config.get("device") or {}) if manifest is not None else {}
    if recorded.get("sm"):  # an engine edgekit built here or over SSH: the machine it probed
        rec.sm.append((str(recorded["sm"]), "the engine manifest"))
        if recorded.get("gpu"):
            rec.gpu.append((str(recorded["gpu"]), "the engine manifest"))
    if recorded.get("tensorrt_version"):
        rec.tensorrt.append((str(recorded["tensorrt_version"]), "the engine manifest"))
    if "profile" in found:
        data = load_export_json(found["profile"], "--exportProfile")
        rec.profiled = [str(r["name"]) for r in data[1:] if isinstance(r, dict) and "name" in r] \
            if isinstance(data, list) else []
    if "layers" in found:
        _read_layer_info(found["layers"], rec)
    return rec


def _read_log(path: Path, rec: EngineRecord) -> None:
    text = read_device_text(path, "trtexec log")
    banner = _BANNER.search(text)
    if banner:
        rec.tensorrt.append((trt_version_from_int(int(banner.group(1))), path.name))
    else:
        line = _VERSION_LINE.search(text)
        if line:
            rec.tensorrt.append((line.group(1), path.name))
    sections = read_trtexec_log(path)
    _read_device_section(sections.get("device_information", {}), path.name, rec)
    shapes = [ln.split(":", 1)[1] for ln in text.splitlines() if "Input inference shape" in ln and ":" in ln]
    _read_inference_shapes(shapes, path.name, rec)


def _read_device_section(info: dict[str, Any], name: str, rec: EngineRecord) -> None:
    sm = _sm_of(info.get("Compute Capability", ""))
    if sm:
        rec.sm.append((sm, name))
    if info.get("Selected Device"):
        rec.gpu.append((str(info["Selected Device"]), name))


def _read_inference_shapes(values: list[str], name: str, rec: EngineRecord) -> None:
    for value in values:
        for inp, dims in _SHAPE.findall(value):
            rec.timed[inp.strip("'\"")] = [int(d) for d in dims.split("x")]
            rec.timed_from = name


def _read_layer_info(path: Path, rec: EngineRecord) -> None:
    data = load_export_json(path, "--exportLayerInfo")
    layers = data.get("Layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not layers or not isinstance(layers[0], dict):
        return  # names only (no --profilingVerbosity=detailed): nothing about inputs
    bindings = [b if isinstance(b, str) else str(b.get("Name", "")) for b in data.get("Bindings", [])]
    produced = {str(t.get("Name")) for layer in layers for t in layer.get("Outputs", []) if isinstance(t, dict)}
    for layer in layers:
        lname = str(layer.get("Name", ""))
        rec.described.append(lname)
        meta = layer.get("Metadata")
        if isinstance(meta, str) and meta:
            rec.onnx_names[lname] = _ONNX_LAYER.findall(meta)
        for t in layer.get("Inputs", []):
            if not isinstance(t, dict):
                continue
            tname = str(t.get("Name", ""))
            if tname in produced or (bindings and tname not in bindings) or tname in rec.inputs:
                continue
            dims = t.get("Dimensions")
            if isinstance(dims, list):
                rec.inputs[tname] = [int(d) if isinstance(d, int) and d >= 0 else None for d in dims]
    rec.inputs_from = path.name if rec.inputs else ""


# --- what the bundle claims -----------------------------------------------------------------------

@dataclass
class EngineClaim:
    """What the engine was built from and for: the target, its ONNX graph's inputs (None for a
    dynamic dimension), the optimization profile, and the graph's node and tensor names."""

    target: Target
    inputs: dict[str, list[int | None]]
    profile: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    names: set[str] | None = None
    model: str | None = None
    onnx: str = ""  # which graph, for messages

    def batch(self) -> int | None:
        """The batch the engine is timed at: the profile's opt batch, else a static first dimension."""
        for name, dims in self.inputs.items():
            prof = self.profile.get(name)
            if prof and prof.get("opt"):
                return int(prof["opt"][0])
            if dims and dims[0] is not None:
                return int(dims[0])
        return None


def expectation(onnx_path: Path) -> dict[str, Any]:
    """What a bundle records of its ONNX for checking results later (``config.expect`` of its
    manifest, copied with it into ``results/``): input dims and node/tensor names."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    inputs = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        inputs[vi.name] = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                           for d in vi.type.tensor_type.shape.dim]
    names = {n.name for n in model.graph.node if n.name} | {o for n in model.graph.node for o in n.output if o} | inits
    return {"inputs": inputs, "names": sorted(names)}


def claim_for(folder: Path, manifest: Manifest) -> EngineClaim:
    """The claim of a bundle or engine manifest: its ``config.expect`` (written at build time), else
    its ONNX file where it is reachable, else the inputs its manifest describes."""
    if not manifest.target:
        raise BadInputError(f"the manifest of {folder} names no target; results cannot be checked against a device")
    target = load_target(manifest.config.get("target_spec") or manifest.target)  # a user's YAML keeps its path
    profile = dict((manifest.config.get("settings") or {}).get("shapes") or {})
    expect = manifest.config.get("expect")
    given = manifest.config.get("onnx")  # exports brought in by hand: the ONNX the user named
    if not isinstance(expect, dict) and isinstance(given, str) and Path(given).is_file():
        expect = expectation(Path(given))
    onnx_rel = next((manifest.files[r] for r in ("onnx_tensorrt", "onnx") if r in manifest.files), None)
    if isinstance(expect, dict) and isinstance(expect.get("inputs"), dict):
        return EngineClaim(target, {k: list(v) for k, v in expect["inputs"].items()}, profile,
                           set(expect.get("names") or []) or None, (manifest.model or {}).get("name"),
                           onnx_rel or Path(str(given or "")).name)
    for base in (folder, folder.parent):
        if onnx_rel and (base / onnx_rel).is_file():
            e = expectation(base / onnx_rel)
            return EngineClaim(target, e["inputs"], profile, set(e["names"]), (manifest.model or {}).get("name"),
                               str(onnx_rel))
    inputs = {str(i["name"]): [d if isinstance(d, int) else None for d in i.get("shape", [])]
              for i in (manifest.model or {}).get("inputs", []) if isinstance(i, dict) and "name" in i}
    return EngineClaim(target, inputs, profile, None, (manifest.model or {}).get("name"), onnx_rel or "")


# --- the comparison -------------------------------------------------------------------------------

def layer_names(layer: str, onnx_names: dict[str, list[str]]) -> list[str]:
    """The ONNX node or tensor names a TensorRT layer name carries (``Conv_0 + Relu_1``,
    ``PWN(Sigmoid_5, Mul_6)``, ``Reformatting CopyNode for Input Tensor 0 to Conv_3``,
    ``node_of_x``) and TensorRT 10 keeps in its metadata (``[ONNX Layer: ...]``); [] for a layer
    TensorRT made up (a Myelin region) without metadata."""
    parts = list(onnx_names.get(layer, []))
    name = re.sub(r"^Reformatting CopyNode for (?:Input|Output) Tensor \d+ to ", "", layer)
    if _GENERATED.match(name):
        return parts
    for part in re.split(r" \+ |, ", re.sub(r"PWN\(|\{ForeignNode\[|\.\.\.|\]\}|\)", " + ", name)):
        part = part.strip()
        if part:
            parts.append(part[len("node_of_"):] if part.startswith("node_of_") else part)
    return parts


def overlap(layers: list[str], names: set[str], onnx_names: dict[str, list[str]]) -> tuple[int, int, str | None]:
    """(layers carrying at least one of ``names``, layers carrying any name, the first that carries none)."""
    hit = total = 0
    first_miss = None
    for layer in layers:
        parts = layer_names(layer, onnx_names)
        if not parts:
            continue
        total += 1
        if any(p in names for p in parts):
            hit += 1
        elif first_miss is None:
            first_miss = layer
    return hit, total, first_miss


def _facts(values: list[tuple[str, str]], key: Any = lambda v: v) -> tuple[str | None, str]:
    """The one value the files agree on and where it came from; disagreement is an error."""
    if not values:
        return None, ""
    distinct = {key(v) for v, _ in values}
    if len(distinct) > 1:
        raise BadInputError("the files of these results disagree: " + ", ".join(f"{src} says {v}" for v, src in values)
                            + "; they come from different machines or TensorRT versions")
    return values[0][0], ", ".join(sorted({src for _, src in values}))


def check_provenance(record: EngineRecord, claim: EngineClaim, where: str) -> Provenance:
    """Compare what the results record with what the bundle claims; mismatches raise
    ``BadInputError`` (naming both sides), missing records make the results unverified."""
    t = claim.target
    checks: list[dict[str, str]] = []
    reasons: list[str] = []
    mismatches: list[str] = []
    ours = f"{claim.model or 'the model'} for {t.name}"

    def ok(check: str, recorded: str, expected: str, source: str) -> None:
        checks.append({"check": check, "result": "match", "recorded": recorded, "expected": expected, "from": source})

    def missing(check: str, why: str) -> None:
        checks.append({"check": check, "result": "missing", "recorded": "", "expected": "", "from": ""})
        reasons.append(why)

    # files of different engines
    if record.profiled and record.described:
        shared = len(set(record.profiled) & set(record.described))
        if shared < MIN_LAYER_OVERLAP * len(set(record.profiled)):
            mismatches.append(f"the per-layer profile and the layer info come from different engines: {shared} of "
                              f"{len(set(record.profiled))} profiled layers are in the layer info")
    gpu = record.gpu[0][0] if record.gpu else None  # names differ between tools ("Orin", the board); the SM decides
    sm, sm_from = _facts(record.sm)
    if sm is None:
        missing("gpu", "the GPU and its SM are not recorded (no device.txt, trtexec log device section or Engine "
                       "Explorer metadata)")
    elif t.sm and sm != t.sm:
        mismatches.append(f"GPU: the results were measured on {gpu or 'a GPU'} ({sm}, {sm_from}); {t.name} is {t.sm}")
    else:
        ok("gpu", f"{gpu or '?'} ({sm})", t.sm or "any", sm_from)
    version, v_from = _facts(record.tensorrt, key=lambda v: ".".join(v.split(".")[:2]))
    if version is None:
        missing("tensorrt", "the TensorRT version is not recorded (no trtexec banner in device.txt or the log, no "
                            "machine.txt package)")
    elif not t.tensorrt_version_ok(version):
        mismatches.append(f"TensorRT: the results record TensorRT {version} ({v_from}); {t.name} takes "
                          f"{t.tensorrt_versions}")
    else:
        ok("tensorrt", version, t.tensorrt_versions or "any", v_from)
    engine_inputs: dict[str, list[int | None]] = dict(record.inputs) or {k: [*v] for k, v in record.timed.items()}
    inputs_from = record.inputs_from or record.timed_from
    if record.inputs and record.timed:
        for name, dims in record.timed.items():
            have = record.inputs.get(name)
            if have is None or any(a is not None and a != b for a, b in zip(have, dims)) or len(have) != len(dims):
                mismatches.append(f"the layer info and the trtexec log come from different engines: input {name!r} is "
                                  f"{_dims(have)} in {record.inputs_from}, timed as {_dims(dims)} in {record.timed_from}")
    if not engine_inputs:
        missing("inputs", "the engine's inputs are not recorded (no layer info with --profilingVerbosity=detailed, "
                          "no 'Input inference shape' in a trtexec log or metadata)")
    elif not claim.inputs:
        missing("inputs", f"the inputs of {ours} are not known (no ONNX graph beside the results)")
    elif set(engine_inputs) != set(claim.inputs):
        mismatches.append(f"inputs: the engine's are {_names(engine_inputs)} ({inputs_from}); {claim.onnx or 'the ONNX'}"
                          f" of {ours} has {_names(claim.inputs)}")
    else:
        bad = [n for n in claim.inputs if not _fits(engine_inputs[n], claim.inputs[n], claim.profile.get(n))]
        if bad:
            n = bad[0]
            mismatches.append(f"input shapes: {n!r} is {_dims(engine_inputs[n])} in the engine ({inputs_from}); "
                              f"{claim.onnx or 'the ONNX'} of {ours} has {_dims(claim.inputs[n])}"
                              + (f" with the profile {claim.profile[n]['min']}..{claim.profile[n]['max']}"
                                 if claim.profile.get(n) else ""))
        else:
            ok("inputs", _names(engine_inputs), _names(claim.inputs), inputs_from)
    timed = record.timed or {k: [d or 0 for d in v] for k, v in record.inputs.items()}
    recorded_batch = next((dims[0] for dims in timed.values() if dims and dims[0]), None)
    expected_batch = claim.batch()
    if recorded_batch is None or expected_batch is None:
        missing("batch", "the batch is not known: " + ("the results record no input shape" if recorded_batch is None
                                                       else f"{ours} leaves the batch dynamic and records no profile"))
    elif recorded_batch != expected_batch:
        mismatches.append(f"batch: the results timed batch {recorded_batch} ({record.timed_from or inputs_from}); "
                          f"{ours} is built for batch {expected_batch}")
    else:
        ok("batch", str(recorded_batch), str(expected_batch), record.timed_from or inputs_from)
    layers = record.profiled or record.described
    if not layers:
        missing("layers", "no layer names to compare with the model (no per-layer profile or layer info)")
    elif claim.names is None:
        missing("layers", f"the node names of {ours} are not known (its ONNX graph is not beside the results)")
    else:
        hit, total, miss = overlap(layers, claim.names, record.onnx_names)
        if total == 0:
            missing("layers", "the layer names are all TensorRT's own (no ONNX node name in them)")
        elif hit < MIN_LAYER_OVERLAP * total:
            mismatches.append(f"layers: {hit} of {total} profiled layers carry a node or tensor name of "
                              f"{claim.onnx or 'the ONNX'} of {ours} (first that does not: {miss!r}); the results are "
                              "of another model")
        else:
            ok("layers", f"{hit} of {total} layers carry an ONNX name", claim.onnx or "the ONNX", "layer names")
    if mismatches:
        raise BadInputError(f"refusing the results in {where} for {ours}: " + "; ".join(mismatches))
    return Provenance(status="unverified" if reasons else "verified", checks=checks, reasons=reasons)


def _fits(engine: list[int | None], onnx_dims: list[int | None], prof: dict[str, list[int]] | None) -> bool:
    if len(engine) != len(onnx_dims):
        return False
    for i, (e, o) in enumerate(zip(engine, onnx_dims)):
        if e is None:
            continue
        if o is not None and e != o:
            return False
        if o is None and prof and not prof["min"][i] <= e <= prof["max"][i]:
            return False
    return True


def _dims(d: Sequence[int | None] | None) -> str:
    return "?" if d is None else "x".join("?" if x is None else str(x) for x in d)


def _names(inputs: dict[str, Any]) -> str:
    return ", ".join(f"{k} {_dims(v)}" for k, v in inputs.items())
