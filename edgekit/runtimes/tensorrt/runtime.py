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
built engines are cached by ``engine_cache.EngineKey``.

What was verified: (a) against a fake ``tensorrt`` module implementing exactly the calls
made here; (b) against a fake ``trtexec`` script (locally and over a loopback sshd); (c)
by its contents and command line. None of it has run on real TensorRT (it cannot be
installed on the machines this was written on); see docs/tensorrt.md.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import onnx

from edgekit.artifact import Manifest, atomic_write_bytes, atomic_write_text, sha256_file
from edgekit.errors import BadInputError, CheckFailedError, UnavailableError, bad_choice
from edgekit.runtimes.base import (
    MAX_DEVICE_NOTE_BYTES,
    BuildOptions,
    NoResultsYet,
    Provenance,
    RecordedRun,
    read_device_file,
    read_device_text,
    resolve_onnx,
)
from edgekit.runtimes.tensorrt import device
from edgekit.runtimes.tensorrt.api import UNSUPPORTED_OP, TensorRTEngine, build_with_api
from edgekit.runtimes.tensorrt.bundle import bundle_readme, bundle_script
from edgekit.runtimes.tensorrt.device import JETSON_TRTEXEC, DeviceInfo, parse_probe, probe_remote
from edgekit.runtimes.tensorrt.engine_cache import EngineCache, EngineKey, check_compatible
from edgekit.runtimes.tensorrt.int8 import DEFAULT_SAMPLES, Int8Graph, prepare_int8_graph
from edgekit.runtimes.tensorrt.lint import lint_onnx
from edgekit.runtimes.tensorrt.parsers import (
    LAYERS_JSON,
    PROFILE_JSON,
    TIMES_JSON,
    recorded_run_from_folder,
    trtexec_outputs,
)
from edgekit.runtimes.tensorrt.provenance import check_provenance, claim_for, expectation, exports_of, read_record
from edgekit.runtimes.tensorrt.results import read_machine_state, results_dir_of
from edgekit.runtimes.tensorrt.settings import (
    BUILD_SCRIPT,
    DEVICE_FILE,
    ENGINE_FILE,
    PATHS,
    README,
    RESULTS_DIR,
    TIMING_CACHE_FILE,
    TrtSettings,
    onnx_facts,
    settings_for,
    trtexec_argv,
)
from edgekit.sources.handle import InputSpec, ModelHandle
from edgekit.ssh import RemoteHost
from edgekit.targets import Target

# --- the runtime --------------------------------------------------------------------------

def _relative_onnx(onnx_path: Path, out_dir: Path) -> tuple[str, Path]:
    """The ONNX file as a path relative to ``out_dir`` (copied in, with external data, if outside)."""
    onnx_path = Path(onnx_path).resolve()
    out_dir = Path(out_dir).resolve()
    try:
        return str(onnx_path.relative_to(out_dir)), onnx_path
    except ValueError:
        pass
    dst_dir = out_dir / "onnx"
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(onnx_path, dst_dir / onnx_path.name)
    m = onnx.load(str(onnx_path), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location" and (onnx_path.parent / e.value).is_file() and not (dst_dir / e.value).exists():
                shutil.copy2(onnx_path.parent / e.value, dst_dir / e.value)
    return f"onnx/{onnx_path.name}", dst_dir / onnx_path.name


def choose_path(target: Target, extra: dict[str, Any]) -> tuple[str, DeviceInfo | None, str]:
    """(path, local device info, why). Local paths only when this GPU has the target's SM."""
    forced = extra.get("trt_path")
    if forced is not None and forced not in PATHS:
        raise bad_choice("TensorRT build path", forced, PATHS)
    if extra.get("remote"):
        if forced not in (None, "trtexec"):
            raise BadInputError(f"--remote builds with trtexec on the device; it cannot take path {forced!r}")
        return "trtexec", None, f"trtexec on {extra['remote']}"
    if forced == "bundle":
        return "bundle", None, "asked for a build bundle"
    trtexec = device.find_trtexec(extra)
    info = device.probe_local(trtexec)
    has_api = device.import_tensorrt() is not None
    same_gpu = bool(info.sm) and info.sm == target.sm
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
        return "bundle", info, f"{where}; target {target.name!r} needs {target.sm or '?'}"
    if has_api:
        return "api", info, "tensorrt Python API, same GPU architecture as the target"
    if trtexec is not None:
        info.trtexec = trtexec
        return "trtexec", info, "trtexec, same GPU architecture as the target"
    return "bundle", info, f"{where} but neither the tensorrt package nor trtexec is installed"


def _version_to_check(info: DeviceInfo | None, target: Target) -> str | None:
    """The TensorRT the engine will be built with: the probed one where known, else the target's."""
    if info is not None and info.tensorrt_version:
        return ".".join(info.tensorrt_version.split(".")[:2])
    return None


def bundle_status(target: Target, why: str) -> dict[str, Any]:
    """What a bundle is and is not: nothing built, nothing measured, nothing verified on TensorRT."""
    here = device.import_tensorrt() is not None or device.find_trtexec({}) is not None
    reason = (f"{why}, so nothing was built" if here else "TensorRT is not installed here, nothing was built")
    return {"built": False, "measured": False, "verified_on_tensorrt": False, "reason": why,
            "summary": f"wrote a TensorRT build bundle for {target.name}: {reason}; run build.sh on the device"}


class TensorRTRuntime:
    """The ``tensorrt`` runtime (the Runtime protocol)."""

    name = "tensorrt"
    input_format = "onnx"
    int8_scheme: str | None = "trt"  # explicit quantization: symmetric int8, Q/DQ where TensorRT fuses them

    def available(self) -> tuple[bool, str]:
        # Always: without TensorRT here, build writes a bundle for the device.
        if device.import_tensorrt() is not None:
            return True, "tensorrt Python API"
        if device.find_trtexec({}) is not None:
            return True, "trtexec"
        return True, "no TensorRT here: builds write a build bundle for the device"

    def measures_here(self, target: Target) -> bool:
        """True when this machine can build and time the engine itself (its GPU has the
        target's SM, with the tensorrt package or trtexec); otherwise build writes a bundle."""
        if target.kind == "cpu":
            return False
        return choose_path(target, {})[0] in ("api", "trtexec")

    def build(self, model: Path | ModelHandle, target: Target, out_dir: Path, options: BuildOptions) -> dict[str, Any]:
        hosts: list[RemoteHost] = []
        try:
            return self._build(model, target, out_dir, options, hosts)
        finally:
            for h in hosts:
                h.close()

    def _build(self, model: Any, target: Target, out_dir: Path, options: BuildOptions,
               hosts: list[RemoteHost]) -> dict[str, Any]:
        out_dir = Path(out_dir)
        rel_onnx, onnx_path = _relative_onnx(resolve_onnx(model), out_dir)
        int8 = None
        if onnx_facts(onnx_path)[1]:  # Q/DQ in the graph: TensorRT's flavour, or a refusal with the reason
            int8 = prepare_int8_graph(onnx_path, options.extra.get("feeds"),
                                      int(options.extra.get("accuracy_samples", DEFAULT_SAMPLES)))
            rel_onnx = str(Path(rel_onnx).with_name(int8.onnx.name))
            onnx_path = int8.onnx
        settings = settings_for(onnx_path, target, options)
        path, info, why = choose_path(target, options.extra)
        warnings: list[str] = []
        check = None
        if options.extra.get("check", True):
            check = lint_onnx(onnx_path, target, tensorrt_version=_version_to_check(info, target),
                              dla_core=settings.dla_core, shapes=settings.shapes, precision=settings.precision)
            check.model = rel_onnx
            if check.errors:
                first = check.errors[0]
                raise CheckFailedError(
                    f"{Path(rel_onnx).name} would fail on {target.name}'s TensorRT {check.tensorrt_version}: "
                    f"{first.op_type} {first.node!r}: {first.why}; {first.fix}"
                    + (f" (and {len(check.errors) - 1} more: `edgekit lint` lists them)" if len(check.errors) > 1 else ""))
            warnings += [f.line() for f in check.warnings]
        if not settings.has_qdq and settings.precision in ("int8", "best"):
            warnings.append("the graph has no Q/DQ nodes: TensorRT's INT8 without calibration uses placeholder "
                            "ranges (fine for timing, wrong outputs); quantize first (`edgekit compress --bits 8`) "
                            "for explicit quantization")
        remote = options.extra.get("remote")
        trtexec_cmd = options.extra.get("trtexec") or (info.trtexec if info and info.trtexec else "trtexec")
        argv = trtexec_argv(settings, onnx=rel_onnx, trtexec="trtexec")
        config: dict[str, Any] = {
            "path": path, "path_reason": why, "settings": settings.to_dict(),
            "expect": expectation(onnx_path),  # what results must match (inputs, node names): provenance
            "trtexec": {"argv": argv, "command": shlex.join(argv), "cwd": "the engine folder"},
            "target_sm": target.sm, "target_tensorrt_versions": target.tensorrt_versions,
            "session": {"engine": ENGINE_FILE},
        }
        extra_files: dict[str, str] = {}
        extra_metrics: dict[str, Any] = {}
        if check is not None:
            extra_metrics["tensorrt_check"] = {"summary": check.summary(), "tensorrt_version": check.tensorrt_version,
                                               "table": check.table, "warnings": len(check.warnings)}
        if int8 is not None:
            extra_metrics["int8_for_tensorrt"] = int8.to_dict()
            config["messages"] = [int8.message()]
            if int8.conversion.changed:
                extra_files["onnx_tensorrt"] = rel_onnx
        if path == "bundle":
            result = self._bundle(out_dir, rel_onnx, argv, settings, target, config, warnings, why, int8)
            result["files"].update(extra_files)
            result["metrics"].update(extra_metrics)
            return result
        if remote:
            host = RemoteHost.from_options(remote, options.extra)
            hosts.append(host)
            info = probe_remote(host, trtexec=options.extra.get("trtexec"))
            if not info.trtexec:
                raise UnavailableError(f"{remote} has no TensorRT: no trtexec on PATH or at {JETSON_TRTEXEC} "
                                       "(install JetPack / TensorRT there)")
            trtexec_cmd = info.trtexec
        if info is None:  # choose_path probes for every path but the bundle, handled above
            raise RuntimeError(f"TensorRT path {path!r} chosen without probing the machine")
        if info.sm and target.sm and info.sm != target.sm:
            raise BadInputError(f"{'the remote ' + remote if remote else 'this machine'} has {info.gpu} ({info.sm}); "
                                f"target {target.name!r} is {target.sm}: an engine built there would not run on the target")
        if info.tensorrt_version and not target.tensorrt_version_ok(info.tensorrt_version):
            warnings.append(f"TensorRT {info.tensorrt_version} is outside the target's range "
                            f"{target.tensorrt_versions} (JetPack pins TensorRT; is the target file right?)")
        config["device"] = {"gpu": info.gpu, "sm": info.sm, "tensorrt_version": info.tensorrt_version}
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
                trt = device.import_tensorrt()
                if trt is None:  # choose_path picks the API only where it imports
                    raise UnavailableError("the tensorrt Python package cannot be imported here")
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
        files = {"model": ENGINE_FILE, **extra_files}
        metrics.update(extra_metrics)
        config["status"] = {"built": True, "measured": "times" in trtexec_outputs(out_dir),
                            "where": f"{remote} over SSH" if remote else "this machine",
                            "summary": f"built a TensorRT engine for {target.name} with {path} on "
                                       f"{remote + ' over SSH' if remote else 'this machine'} ({info.gpu}, "
                                       f"TensorRT {info.tensorrt_version})"}
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

    def _remote_trtexec(self, host: RemoteHost, out_dir: Path, rel_onnx: str, settings: TrtSettings, trtexec: str,
                        timing_cache: Path) -> dict[str, Any]:
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
            atomic_write_bytes(timing_cache, read_device_file(out_dir / RESULTS_DIR / TIMING_CACHE_FILE,
                                                              "timing cache from the device"))
            (out_dir / RESULTS_DIR / TIMING_CACHE_FILE).unlink()
        return {"build_seconds": round(time.perf_counter() - t0, 3), "remote": host.spec,
                "fetched": sorted(got), "verified_sha256": True}

    def _bundle(self, out_dir: Path, rel_onnx: str, argv: list[str], settings: TrtSettings, target: Target,
                config: dict[str, Any], warnings: list[str], why: str, int8: Int8Graph | None) -> dict[str, Any]:
        status = bundle_status(target, why)
        script = bundle_script(argv, target, settings)
        atomic_write_text(out_dir / BUILD_SCRIPT, script)
        os.chmod(out_dir / BUILD_SCRIPT, 0o755)
        notes = [int8.message()] if int8 is not None else []
        atomic_write_text(out_dir / README, bundle_readme(argv, target, settings, rel_onnx, warnings, status, notes))
        config = {**config, "session": {"engine": ENGINE_FILE, "built": False}, "status": status}
        metrics: dict[str, Any] = {"status": status["summary"]}
        if warnings:
            metrics["warnings"] = warnings
        return {"kind": "bundle", "files": {"script": BUILD_SCRIPT, "readme": README}, "config": config,
                "metrics": metrics}

    # -- load and profile --

    def load(self, engine_dir: Path, manifest: Manifest, threads: int | None = None) -> TensorRTEngine:
        engine_dir = Path(engine_dir)
        plan = engine_dir / ENGINE_FILE
        if not plan.is_file():
            raise BadInputError(f"{engine_dir} holds no {ENGINE_FILE}: it is a build bundle; run its {BUILD_SCRIPT} "
                                f"on the device, copy the folder back, then `edgekit profile {engine_dir}`")
        trt = device.import_tensorrt()
        recorded = dict(manifest.config.get("device") or {})
        device_txt = engine_dir / RESULTS_DIR / DEVICE_FILE
        if not recorded and device_txt.is_file():
            d = parse_probe(read_device_text(device_txt, "device record", MAX_DEVICE_NOTE_BYTES))
            recorded = {"gpu": d.gpu, "sm": d.sm, "tensorrt_version": d.tensorrt_version}
        local = device.probe_local()
        check_compatible(recorded, {"gpu": local.gpu, "sm": local.sm, "tensorrt_version": local.tensorrt_version},
                         what=f"engine {engine_dir}")
        if trt is None:
            raise UnavailableError(f"running {engine_dir} here needs the tensorrt Python package and an NVIDIA GPU; "
                                   "for an engine built by trtexec, `edgekit profile` reads trtexec's results instead")
        inputs = [InputSpec.from_dict(s) for s in manifest.model.get("inputs", [])]
        outputs = list(manifest.model.get("outputs", []))
        return TensorRTEngine(trt, plan, inputs, outputs)

    def recorded_run(self, folder: Path, manifest: Manifest | None) -> RecordedRun | None:
        """trtexec's exports in the folder (or its ``results/``), or None when there are none;
        a bundle without results is an error (nothing was built or timed yet).

        The results are checked against what the manifest claims (``provenance``: GPU/SM and
        TensorRT version against the target, the engine's inputs, batch and layer names against
        the bundle's ONNX, the files against each other): a mismatch is ``BadInputError`` naming
        both sides, facts no file records leave the run ``unverified`` with a warning. A manifest
        with ``config.imported`` describes trtexec exports made by hand (``edgekit profile
        --trtexec DIR --onnx MODEL --target T``)."""
        folder = Path(folder)
        found = exports_of(folder)
        if "times" not in found:
            if manifest is not None and manifest.kind == "bundle":
                raise NoResultsYet(f"{folder} is a build bundle without results: run its {BUILD_SCRIPT} on the "
                                   f"device (it writes {RESULTS_DIR}/{TIMES_JSON}), copy the folder back, then profile it")
            return None
        run = recorded_run_from_folder(folder, manifest, found=found)
        results = results_dir_of(folder)
        imported = manifest is not None and bool(manifest.config.get("imported"))
        if results is not None:  # written by a bundle's build.sh: measured on the device itself
            state, warnings = read_machine_state(results)
            run.source, run.machine = "device", {**run.machine, **state}
            run.warnings = warnings + run.warnings
            run.settings["measured_by"] = "trtexec on the device (build.sh of an edgekit bundle)"
        elif imported:
            run.source = "device"
            run.settings["measured_by"] = "trtexec exports brought in by hand (edgekit profile --trtexec)"
        record = read_record(found, manifest)
        if manifest is None:
            run.provenance = Provenance("unverified", reasons=["no manifest says which model and target these "
                                                               "results are for"])
        else:
            run.provenance = check_provenance(record, claim_for(folder, manifest), str(folder))
        sm = next((v for v, _ in record.sm), None)
        if sm:
            run.machine.setdefault("sm", sm)
        if record.gpu:
            run.machine.setdefault("gpu", record.gpu[0][0])
        if record.tensorrt:
            run.machine.setdefault("tensorrt_version", record.tensorrt[0][0])
        if run.provenance.status == "unverified":
            run.warnings.insert(0, "provenance unverified: " + "; ".join(run.provenance.reasons)
                                + " (check --require-verified fails on it)")
        return run


def _check_trtexec(rc: int, log: str, engine: Path) -> None:
    if rc == 0 and engine.is_file():
        return
    m = UNSUPPORTED_OP.search(log)
    if m:
        raise BadInputError(f"TensorRT's ONNX parser rejects the model: unsupported op {m.group(1).rstrip('.:')!r}")
    tail = [ln for ln in log.strip().splitlines() if "error" in ln.lower()][-3:] or log.strip().splitlines()[-3:]
    raise BadInputError(f"trtexec failed (exit {rc}): {' | '.join(tail)[:500] or 'no output'}")


