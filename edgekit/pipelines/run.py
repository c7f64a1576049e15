"""Run a recipe: every stage compressed, exported, built, profiled and evaluated per
target, with content-addressed caching, per-stage budgets and CI outputs.

Caching: each sub-step (compress, export, build, profile, evaluate) writes a folder under
``<cache>/<kind>-<key>`` whose key hashes its inputs (the model's identity, the step
configs, the data specs, the seed, the previous sub-step's key and the package
versions). A folder that exists is complete (it was renamed into place only after it
succeeded), so an unchanged sub-step is reused, a changed one and everything after it
is rebuilt, and an interrupted run resumes where it stopped. Each stage's key also
includes the previous stage's, so a changed stage rebuilds every stage after it.

Timing: on a target edgekit can measure here, frames run through the chained stages as
deployed (``frames.py``): every stage inside every frame and the frame as a whole are
timed, so the end-to-end percentiles are measured (p99s do not add) and each stage's
figures and share come from the same frames. Stages declared ``parallel_with`` an earlier
stage run concurrently with it, so the frame time is the critical path as it happened.
Model stages are also profiled alone (their node tables). Targets edgekit cannot measure
here (a Jetson without TensorRT) get a roofline estimate per stage and a TensorRT build
bundle; their total adds the stage estimates along the critical path and says so:
"estimate (sum of stages)".

Build and measurement are cached separately: ``remeasure`` times the cached engines
again (stage profiles and frames) without compressing, exporting or building anything.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import (
    Manifest,
    atomic_write_json,
    atomic_write_text,
    check_work_folder,
    claim_work_folder,
    file_lock,
    machine_info,
    now_iso,
    own_hidden_entry,
    package_versions,
    read_manifest,
    sha256_json,
    sha256_tree,
    staged_dir,
    write_manifest,
)
from edgekit.build import build_engine, load_engine, load_engine_inputs
from edgekit.compress import StepContext, compress, get_step
from edgekit.errors import BadInputError, EdgekitError
from edgekit.estimate import estimate
from edgekit.evaluate import evaluate
from edgekit.export.onnx import ExportConfig
from edgekit.loading import export_onnx, load_model
from edgekit.measure import engine_latency
from edgekit.pipelines.frames import (
    FrameMeasurement,
    callable_stage,
    engine_stage,
    load_frames,
    measure_frames,
    to_frames,
)
from edgekit.pipelines.html import render_run_html
from edgekit.pipelines.recipe import Recipe, StageSpec, validate_recipe

# The run's tables, as the CLI prints them (declared in results.py, with the records).
# STAGE_COLUMNS, stage_table, target_verdict: the run's tables as the CLI prints them (from results.py).
from edgekit.pipelines.results import STAGE_COLUMNS as STAGE_COLUMNS
from edgekit.pipelines.results import (
    RunResult,
    StageResult,
    junit_xml,
    markdown_summary,
)
from edgekit.pipelines.results import stage_table as stage_table
from edgekit.pipelines.results import target_verdict as target_verdict
from edgekit.profiling import ProfileConfig, ProfileResult, device_measurement, measure, profile_engine
from edgekit.progress import StepProgress
from edgekit.runtimes import RUNTIMES, get_runtime
from edgekit.runtimes.base import BuildOptions, NodeTiming
from edgekit.sources.data import load_samples
from edgekit.sources.handle import InputSpec
from edgekit.sources.inputs import shapes_only
from edgekit.targets import Target, load_target

RESULTS = "results.json"


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # pragma: no cover
        pass


# What a run cache holds: one folder per sub-step (``KIND-KEY``, compress checkpoints
# ``work-KEY``) and the per-entry locks.
_CACHE_ENTRY = re.compile(r"[a-z]+-[0-9a-f]{16}|\.locks")


def check_cache_folder(root: str | os.PathLike[str]) -> Path:
    """``--cache DIR``: new, empty or a run cache (every entry one the cache writes), so a
    run never writes its entries beside a user's files; not a link, a file or the working
    directory. BadInputError otherwise."""
    given = Path(root)
    if os.path.islink(given):
        raise BadInputError(f"cache folder {str(given)!r} is a symbolic link; give the folder it points to")
    real = Path(os.path.realpath(given))
    if real == Path(os.path.realpath(os.getcwd())):
        raise BadInputError(f"cache folder {str(given)!r} is the working directory; choose a new folder")
    if os.path.lexists(real) and not real.is_dir():
        raise BadInputError(f"cache folder {str(given)!r} is not a folder; choose a new folder")
    if real.is_dir():
        foreign = sorted(e for e in os.listdir(real) if not _CACHE_ENTRY.fullmatch(e) and not own_hidden_entry(e))
        if foreign:
            raise BadInputError(f"cache folder {str(given)!r} holds {foreign[0]!r}"
                                + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")
                                + ", which is not a run cache entry; give a new or empty folder, or an edgekit run cache")
    return real


def check_run_folders(recipe: Recipe, run_dir: str | os.PathLike[str],
                      cache_dir: str | os.PathLike[str] | None = None) -> None:
    """The folders a run writes, checked as the run checks them: ``edgekit run --dry-run``
    refuses what the real run would refuse."""
    check_work_folder(run_dir, "run", protect=(recipe.path,))
    if cache_dir is not None:
        check_cache_folder(cache_dir)


class _Cache:
    """Content-addressed sub-step folders: ``get(kind, key_parts, build)``."""

    MEASUREMENTS = ("profile", "frames")  # what --remeasure redoes (never compress, export, build)

    def __init__(self, root: Path, force: bool = False, remeasure: bool = False):
        self.root = check_cache_folder(root)
        self.force = force
        self.remeasure = remeasure
        self.root.mkdir(parents=True, exist_ok=True)
        self.rebuilt: set[str] = set()

    def key(self, parts: dict[str, Any]) -> str:
        return sha256_json(parts)[:16]

    def folder(self, kind: str, key: str) -> Path:
        return self.root / f"{kind}-{key}"

    def get(self, kind: str, key: str, build: Any) -> tuple[Path, bool]:
        folder = self.folder(kind, key)
        if self._reusable(kind, folder, key):
            return folder, True
        with file_lock(self.root / ".locks" / f"{kind}-{key}"):  # runs sharing the cache build an entry once
            if self._reusable(kind, folder, key):
                return folder, True
            build(folder)
        self.rebuilt.add(key)
        return folder, False

    def _reusable(self, kind: str, folder: Path, key: str) -> bool:
        stale = self.force or (self.remeasure and kind in self.MEASUREMENTS)
        return (folder / "manifest.json").is_file() and not (stale and key not in self.rebuilt)


def _model_identity(spec: str) -> str:
    p = Path(spec)
    if p.exists():
        return f"{p.name}:{sha256_tree(p)}"
    return spec


def _import(spec: str) -> Any:
    if ":" not in spec:
        raise BadInputError(f"callable {spec!r} must be 'package.module:function'")
    mod, attr = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise BadInputError(f"cannot load callable {spec!r}: {e}") from None


class CallableEngine:
    """A Python stage (preprocessing, postprocessing) behind the Engine protocol."""

    runtime = "python"

    def __init__(self, fn: Any, inputs: dict[str, dict[str, Any]]):
        self.fn = fn
        self.inputs = [InputSpec(n, tuple(s.get("shape", ())), str(s.get("dtype", "float32"))) for n, s in inputs.items()]
        self.outputs = ["output"]

    def sample_feeds(self, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        feeds = {}
        for s in self.inputs:
            shape = tuple(int(d) for d in s.shape)
            dt = np.dtype(s.dtype)
            feeds[s.name] = (rng.integers(0, 256, size=shape).astype(dt) if dt.kind in "iu"
                             else rng.standard_normal(shape).astype(dt))
        return feeds

    @property
    def path(self) -> None:
        return None  # a Python function, no model file

    @property
    def settings(self) -> dict[str, Any]:
        return {"runtime": self.runtime, "callable": getattr(self.fn, "__qualname__", repr(self.fn))}

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.fn(**feeds)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def run_unchecked(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.run(feeds)

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        t0 = time.perf_counter()
        self.run(feeds)
        return (time.perf_counter() - t0) * 1e3

    def node_profile(self, feeds: dict[str, np.ndarray], iterations: int) -> list[NodeTiming]:
        return []

    def token_decoder(self, max_length: int) -> None:
        return None

    def close(self) -> None:
        pass


def _profile_config(recipe: Recipe) -> ProfileConfig:
    return ProfileConfig(**{k: v for k, v in recipe.profile.items()})


def plan(recipe: Recipe) -> list[dict[str, Any]]:
    """The resolved plan, for ``--dry-run``: what each stage will do on each target."""
    rows = []
    for t in recipe.targets:
        target = load_target(t)
        for s in recipe.stages:
            if s.callable:
                actions = [f"time {s.callable}" + (" in every frame" if _measurable(target) else "")]
            else:
                actions = [f"load {s.model}"] + [f"{st.name}({_kv(st.config)})" for st in s.steps]
                actions += ["export onnx"] + ([f"build {_runtime_for(target)}", "profile (measured, in every frame)"]
                                              if _measurable(target)
                                              else ["estimate (roofline)", "TensorRT build bundle"])
                if s.evaluate:
                    actions.append(f"evaluate {s.evaluate.get('metric', 'default')}")
            rows.append({"target": target.name, "stage": s.name, "actions": actions, "budget_ms": s.budget_ms,
                         "parallel_with": list(s.parallel_with)})
    return rows


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def _measurable(target: Target) -> bool:
    """Can edgekit build and time an engine for ``target`` on this machine (with any of
    the target's runtimes)?"""
    for name in target.runtimes:
        try:
            if name in RUNTIMES and get_runtime(name).measures_here(target):
                return True
        except (ImportError, EdgekitError):
            continue  # a runtime that cannot load here measures nothing
    return False


def _runtime_for(target: Target) -> str:
    return target.runtimes[0]  # a target names at least one runtime (checked as it loads)


def run_recipe(recipe: Recipe, run_dir: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
               force: bool = False, progress: bool = True, wait: bool = False, remeasure: bool = False) -> RunResult:
    """Run every stage of ``recipe`` on every target; write results, JUnit, Markdown, HTML.

    The run folder is locked for the whole run: a second run on it exits with an error
    naming the first one's PID, or with ``wait`` waits for it (and then reuses what it
    cached). It must be new, empty or a run folder.

    >>> result = run_recipe(load_recipe("examples/perception.yaml"), "runs/perception")  # doctest: +SKIP
    >>> result.passed  # doctest: +SKIP
    True
    """
    recipe = validate_recipe(recipe)  # the dry run's validation, whoever built the Recipe; before any write
    check_run_folders(recipe, run_dir, cache_dir)  # as the dry run checks them
    with claim_work_folder(run_dir, "run", wait=wait, protect=(recipe.path,),
                           hint=" (edgekit run --wait waits for it)"):
        return _run_locked(recipe, run_dir, cache_dir, force, progress, remeasure)


def _run_locked(recipe: Recipe, run_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None,
                force: bool, progress: bool, remeasure: bool = False) -> RunResult:
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = _Cache(Path(cache_dir) if cache_dir else run_dir / "cache", force=force, remeasure=remeasure)
    set_seed(recipe.seed)
    versions = package_versions()
    pconfig = _profile_config(recipe)
    all_stages: list[StageResult] = []
    per_target: dict[str, dict[str, Any]] = {}
    phases = StepProgress(f"run {recipe.name}", total=len(recipe.targets) * (len(recipe.stages) + 1),
                          enabled=None if progress else False)
    with phases:
        for t in recipe.targets:
            target = load_target(t)
            frame_mode = _measurable(target)
            prev_key = ""
            keys: list[str] = []
            results: list[StageResult] = []
            for stage in recipe.stages:
                phases.phase(f"{target.name} / {stage.name}: "
                             + ("a Python stage, timed in every frame" if stage.callable and frame_mode else
                                "compress, export, build, evaluate" if frame_mode else "compress, export, estimate, evaluate"))
                res, prev_key = _run_stage(stage, target, recipe, cache, pconfig, versions, prev_key, progress,
                                           frame_mode)
                results.append(res)
                keys.append(prev_key)
                phases.update(phases.done + 1, f"{target.name} / {stage.name}")
            if frame_mode:
                phases.phase(f"{target.name}: frames through the chained stages")
                summary = _measure_frames(recipe, target, results, keys, cache, pconfig, versions, progress)
                for r, key in zip(results, keys):
                    if r.kind == "model":
                        phases.phase(f"{target.name} / {r.stage}: profile alone (node table)")
                        _profile_model_stage(r, recipe, target, cache, pconfig, key)
            else:
                summary = _critical_path(results, recipe)
            phases.update(phases.done + 1, f"{target.name}: {summary['method']}")
            per_target[target.name] = summary
            all_stages.extend(results)
    passed = all(v["passed"] is not False for v in per_target.values()) and all(
        r.passed is not False and all(g["passed"] for g in r.gates) for r in all_stages)
    result = RunResult(recipe=recipe.to_dict(), run_dir=str(run_dir), percentile=recipe.percentile, seed=recipe.seed,
                       targets=per_target, passed=passed, versions=versions,
                       seconds=round(time.perf_counter() - t_start, 2), stages=all_stages)
    write_outputs(result, run_dir)
    return result


def _run_stage(stage: StageSpec, target: Target, recipe: Recipe, cache: _Cache, pconfig: ProfileConfig,
               versions: dict[str, str], prev_key: str, progress: bool,
               frame_mode: bool = False) -> tuple[StageResult, str]:
    base = {"prev": prev_key, "versions": versions, "seed": recipe.seed}
    if stage.callable and frame_mode:  # timed inside every frame (_measure_frames)
        _import(stage.callable)  # a callable that cannot be loaded fails now, before any model is built
        key = cache.key({**base, "callable": stage.callable, "inputs": stage.inputs, "feeds": stage.feeds,
                         "target": target.name})
        return StageResult(stage=stage.name, target=target.name, kind="callable", source="measured", latency_ms=0.0,
                           p50_ms=0.0, p99_ms=0.0, budget_ms=stage.budget_ms,
                           parallel_with=list(stage.parallel_with)), key
    if stage.callable:
        key = cache.key({**base, "callable": stage.callable, "inputs": stage.inputs, "profile": recipe.profile,
                         "target": target.name})
        fn = _import(stage.callable)
        needed = [spec.name for spec in callable_stage(stage.name, fn).inputs]
        if not stage.inputs and needed:
            raise BadInputError(f"stage {stage.name!r}: {target.name} cannot be measured here, so this Python stage "
                                f"is timed alone on sample inputs; declare inputs: for {', '.join(needed)}")
        engine = CallableEngine(fn, stage.inputs)

        def build_profile(folder: Path) -> None:
            result = measure(engine, engine.sample_feeds(recipe.seed), dataclasses.replace(pconfig, node_profile=False),
                             engine_name=stage.callable or "", runtime="python", target=target.name, model=stage.name)
            with staged_dir(folder) as tmp:
                result.save(tmp / "profile.json")
                write_manifest(tmp, Manifest(kind="profile", files={"profile": "profile.json"},
                                             config={"callable": stage.callable, "inputs": stage.inputs},
                                             target=target.name))

        pfolder, preused = cache.get("profile", key, build_profile)
        alone = ProfileResult.load(pfolder / "profile.json")
        host_note = [] if target.kind == "cpu" else [f"Python stage timed on this host, not on {target.name}"]
        return _stage_result(stage, target, "callable", alone, recipe, {"profile": str(pfolder)},
                             {"profile": preused}, {}, [], None, host_note), key

    # A model stage: compress -> export -> build -> profile (or estimate) -> evaluate.
    model_id = _model_identity(str(stage.model))
    estimated_ms: float | None = None
    target_aware = any(get_step(s.name).target_aware for s in stage.steps)
    artifacts: dict[str, str] = {}
    reused: dict[str, bool] = {}
    source_for_export: str = str(stage.model)
    io = stage.input_options()  # shapes and image preprocessing (edgekit.sources.inputs)
    io_key = {"shapes": stage.shapes, "preprocess": stage.preprocess} if io else {}
    key = cache.key({**base, "model": model_id, **io_key})
    if stage.steps:
        key = cache.key({**base, "model": model_id, "steps": [[s.name, s.config] for s in stage.steps],
                         "calib": stage.calib, "train": stage.train,
                         "target": target.identity if target_aware else None, **io_key})

        def build_model(folder: Path) -> None:
            ctx = StepContext(target=target, calib=stage.calib, train=stage.train, seed=recipe.seed,
                              progress=progress, work_dir=cache.root / f"work-{key}", inputs=io,
                              latency=engine_latency)
            set_seed(recipe.seed)
            compress(str(stage.model), [(s.name, dict(s.config)) for s in stage.steps], folder, ctx)

        folder, reused["compress"] = cache.get("model", key, build_model)
        artifacts["model"] = str(folder)
        source_for_export = str(folder)
    key = cache.key({"prev": key, "export": stage.export})
    folder, reused["export"] = cache.get("onnx", key, lambda f: export_onnx(source_for_export, f, ExportConfig(**stage.export),
                                                                        shapes_only(io)))
    artifacts["onnx"] = str(folder)
    onnx_folder = folder
    size_mb = _onnx_size_mb(onnx_folder)
    warnings: list[str] = []
    prof: ProfileResult | None
    if _measurable(target):
        bkey = cache.key({"prev": key, "target": target.name, "build": stage.build})
        folder, reused["build"] = cache.get(
            "engine", bkey, lambda f: build_engine(str(onnx_folder), target, f, BuildOptions(**stage.build),
                                                   shapes_only(io)))
        artifacts["engine"] = str(folder)
        engine_folder = folder
        prof = None  # measured in every frame (_measure_frames), profiled alone afterwards (_profile_model_stage)
        eval_key = bkey  # build and measurement are cached separately
        # The roofline estimate of the same graph, beside the measurement (best effort).
        try:
            ekey = cache.key({"prev": key, "target": target.to_dict(), "estimate": True})
            efolder, _ = cache.get("estimate", ekey, lambda f: _estimate_folder(onnx_folder, target, f))
            artifacts["estimate"] = str(efolder)
            estimated_ms = ProfileResult.load(efolder / "profile.json").latency_ms.p50
        except (EdgekitError, ImportError) as e:
            warnings.append(f"no roofline estimate: {e}")
    else:
        ekey = cache.key({"prev": key, "target": target.to_dict(), "estimate": True})
        folder, reused["estimate"] = cache.get("estimate", ekey, lambda f: _estimate_folder(onnx_folder, target, f))
        artifacts["estimate"] = str(folder)
        prof = ProfileResult.load(folder / "profile.json")
        prof.model = stage.name
        estimated_ms = prof.latency_ms.p50
        bundle, why = _try_bundle(onnx_folder, target, cache, ekey, stage)
        if bundle:
            artifacts["bundle"] = bundle
            measured = device_measurement(bundle, pconfig.top_k)  # build.sh ran on the device: prefer it
            if measured is not None:
                prof = measured
                prof.model = stage.name
            else:  # say that nothing was built or measured on the target
                status = (read_manifest(Path(bundle)).config.get("status") or {}).get("summary")
                if status:
                    warnings.append(f"{status} ({bundle})")
        else:
            warnings.append(f"no TensorRT build bundle for {target.name}: {why}")
        eval_key = ekey
        engine_folder = None
    metrics: dict[str, Any] = {}
    gates: list[dict[str, Any]] = []
    if stage.evaluate:
        vkey = cache.key({"prev": eval_key, "evaluate": stage.evaluate})
        folder, reused["evaluate"] = cache.get(
            "evaluate", vkey, lambda f: _evaluate_folder(stage, source_for_export, onnx_folder, engine_folder, f))
        metrics = json.loads((folder / "metrics.json").read_text())
        gates = _gates(stage, metrics)
    if prof is None:
        result = StageResult(stage=stage.name, target=target.name, kind="model", source="measured", latency_ms=0.0,
                             p50_ms=0.0, p99_ms=0.0, budget_ms=stage.budget_ms, metrics=metrics, gates=gates,
                             artifacts=artifacts, reused=reused, size_mb=size_mb, parallel_with=list(stage.parallel_with),
                             warnings=warnings)
    else:
        result = _stage_result(stage, target, "model", prof, recipe, artifacts, reused, metrics, gates, size_mb,
                               warnings)
    result.estimated_ms = estimated_ms
    return result, eval_key


def _profile_model_stage(r: StageResult, recipe: Recipe, target: Target, cache: _Cache, pconfig: ProfileConfig,
                         key: str) -> None:
    """A model stage alone on its built engine (after the frames): its node table, the
    engine's own latency and noise, cached apart from the build."""
    engine_folder = Path(r.artifacts["engine"])
    pkey = cache.key({"prev": key, "profile": recipe.profile})

    def build_profile(f: Path) -> None:
        with staged_dir(f) as tmp:
            profile_engine(engine_folder, pconfig, out_json=tmp / "profile.json")
            write_manifest(tmp, Manifest(kind="profile", files={"profile": "profile.json"},
                                         config=dict(recipe.profile), target=target.name))

    folder, r.reused["profile"] = cache.get("profile", pkey, build_profile)
    r.artifacts["profile"] = str(folder)
    prof = ProfileResult.load(folder / "profile.json")
    r.profile = prof.engine
    r.warnings = [f"alone: {w}" for w in prof.warnings] + r.warnings


FRAMES = "frames.json"


def _measure_frames(recipe: Recipe, target: Target, results: list[StageResult], keys: list[str], cache: _Cache,
                    pconfig: ProfileConfig, versions: dict[str, str], progress: bool) -> dict[str, Any]:
    """Frames through the chained stages (cached as ``frames-<key>``); the stage results get
    their figures from the same frames; returns the target's summary."""
    fkey = cache.key({"stages": keys, "specs": [s.to_dict() for s in recipe.stages], "profile": recipe.profile,
                      "frames": recipe.frames, "seed": recipe.seed, "target": target.name, "versions": versions})

    def build(folder: Path) -> None:
        measured = _time_frames(recipe, results, pconfig, progress)
        with staged_dir(folder) as tmp:
            atomic_write_json(tmp / FRAMES, dataclasses.asdict(measured))
            write_manifest(tmp, Manifest(kind="profile", files={"frames": FRAMES}, target=target.name,
                                         config={"profile": dict(recipe.profile), "frames": recipe.frames,
                                                 "stages": [s.name for s in recipe.stages]}))

    folder, reused = cache.get("frames", fkey, build)
    m = load_frames(folder / FRAMES)
    pct = recipe.percentile
    total = m.total()
    for r in results:
        st = m.stage(r.stage)
        r.latency_ms, r.p50_ms, r.p99_ms, r.cv = st.get(pct), st.p50, st.p99, st.cv
        r.noisy = st.cv > m.cv_threshold
        r.share = m.share(r.stage)
        r.start_ms = m.start_ms[r.stage]
        r.end_ms = r.start_ms + st.mean
        r.passed = None if r.budget_ms is None else r.latency_ms <= r.budget_ms
        r.reused["frames"] = reused
        r.artifacts["frames"] = str(folder)
        r.source = "measured"
    at = total.get(pct)
    budget = recipe.budget_ms
    sum_of_stages = sum(r.latency_ms for r in results)
    return {"total_ms": at, "budget_ms": budget, "margin_ms": None if budget is None else budget - at,
            "passed": None if budget is None else at <= budget, "estimated": False, "method": "measured frames",
            "p50_ms": total.p50, "p99_ms": total.p99, "mean_ms": total.mean, "cv": total.cv, "noisy": m.noisy,
            "attempts": m.attempts, "cv_threshold": m.cv_threshold, "frames": total.count, "distinct_frames": m.frames,
            "sum_of_stage_ms": sum_of_stages, "frames_dir": str(folder), "stages": [r.stage for r in results]}


def _time_frames(recipe: Recipe, results: list[StageResult], pconfig: ProfileConfig, progress: bool
                 ) -> FrameMeasurement:
    stages = []
    engines = []
    try:
        for spec, r in zip(recipe.stages, results):
            if spec.callable:
                stages.append(callable_stage(spec.name, _import(spec.callable), spec.inputs or None, spec.feeds,
                                             spec.parallel_with))
            else:
                engine = load_engine(r.artifacts["engine"], threads=pconfig.threads)
                engines.append(engine)
                stages.append(engine_stage(spec.name, engine, spec.feeds, spec.parallel_with))
        first = stages[0]
        if recipe.frames:
            frames = to_frames(_import(recipe.frames)(), [s.name for s in first.inputs], f"frames {recipe.frames}")
        elif recipe.stages[0].callable:
            frames = [CallableEngine(None, recipe.stages[0].inputs).sample_feeds(recipe.seed)]
        else:
            frames = [load_engine_inputs(results[0].artifacts["engine"], batch=1)]
        with StepProgress("frames", total=pconfig.iterations, enabled=None if progress else False) as bar:
            return measure_frames(stages, frames, pconfig, progress=lambda n: bar.update(n))
    finally:
        for e in engines:
            e.close()


def _onnx_size_mb(onnx_folder: Path) -> float | None:
    try:
        m = read_manifest(onnx_folder)
        path = m.path_of(onnx_folder, "onnx")
        extra = path.with_name(path.name + ".data")
        return (path.stat().st_size + (extra.stat().st_size if extra.exists() else 0)) / 1e6
    except (EdgekitError, OSError):
        return None


def _estimate_folder(onnx_folder: Path, target: Target, folder: Path) -> None:
    """A roofline estimate as a ProfileResult (source "estimated")."""
    m = read_manifest(onnx_folder)
    est = estimate(str(m.path_of(onnx_folder, "onnx")), target)
    prof = est.to_profile()  # labelled an estimate, with its range and the range's basis
    prof.engine, prof.model = str(onnx_folder), m.model.get("name") or prof.model
    prof.machine, prof.created = machine_info(), now_iso()
    with staged_dir(folder) as tmp:
        prof.save(tmp / "profile.json")
        write_manifest(tmp, Manifest(kind="estimate", files={"profile": "profile.json"}, target=target.name,
                                     metrics={"total_ms": float(est.total_ms), "low_ms": float(est.low_ms),
                                              "high_ms": float(est.high_ms), "basis": est.basis}))


def _try_bundle(onnx_folder: Path, target: Target, cache: _Cache, key: str, stage: StageSpec) -> tuple[str | None, str]:
    """A build bundle (what the device needs to build and time the engine itself) for a
    target edgekit cannot measure here, from the target's preferred runtime (best effort):
    (folder, why not)."""
    try:
        opts = {"precision": "best" if "int8" in target.precisions else "fp16", **stage.build}
        folder, _ = cache.get("bundle", cache.key({"prev": key, "bundle": opts}),
                              lambda f: build_engine(str(onnx_folder), target, f, BuildOptions(**opts)))
        if read_manifest(folder).kind != "bundle":
            return None, f"the target's runtime {read_manifest(folder).config.get('runtime')!r} writes no build bundle"
        return str(folder), ""
    except (EdgekitError, ImportError) as e:
        if (stage.build.get("extra") or {}).get("remote"):
            raise  # a build the recipe sends to a device failed: not a verdict to pass on an estimate
        return None, str(e)


def _evaluate_folder(stage: StageSpec, model_source: str, onnx_folder: Path, engine_folder: Path | None,
                     folder: Path) -> None:
    spec = stage.evaluate or {}
    reference = load_model(str(stage.model), stage.input_options())
    samples = load_samples(spec.get("data"), reference, split="eval", limit=spec.get("limit"))
    if engine_folder is not None:
        engine = load_engine(engine_folder)
        try:
            metrics = evaluate(engine, samples, reference=reference)
        finally:
            engine.close()
    else:
        metrics = evaluate(load_model(model_source, stage.input_options()), samples, reference=reference)
    with staged_dir(folder) as tmp:
        atomic_write_json(tmp / "metrics.json", metrics)
        write_manifest(tmp, Manifest(kind="report", files={"metrics": "metrics.json"}, metrics=metrics,
                                     config={"evaluate": spec}))


def _gates(stage: StageSpec, metrics: dict[str, Any]) -> list[dict[str, Any]]:
    spec = stage.evaluate or {}
    name = spec.get("metric") or next((k for k, v in metrics.items() if isinstance(v, (int, float))), None)
    gates: list[dict[str, Any]] = []
    if name is None:
        return gates
    if name not in metrics:
        raise BadInputError(f"stage {stage.name!r}: evaluation has no metric {name!r} "
                            f"(it has: {', '.join(sorted(metrics))})")
    value = float(metrics[name])
    if spec.get("min") is not None:
        gates.append({"stage": stage.name, "metric": name, "value": value, "min": spec["min"],
                      "passed": value >= float(spec["min"])})
    if spec.get("max") is not None:
        gates.append({"stage": stage.name, "metric": name, "value": value, "max": spec["max"],
                      "passed": value <= float(spec["max"])})
    return gates


def _stage_result(stage: StageSpec, target: Target, kind: str, prof: ProfileResult, recipe: Recipe,
                  artifacts: dict[str, str], reused: dict[str, bool], metrics: dict[str, Any],
                  gates: list[dict[str, Any]], size_mb: float | None, warnings: list[str] | None = None) -> StageResult:
    lat = prof.latency_ms.get(recipe.percentile)
    passed = None if stage.budget_ms is None else lat <= stage.budget_ms
    return StageResult(stage=stage.name, target=target.name, kind=kind, source=prof.source, latency_ms=lat,
                       p50_ms=prof.latency_ms.p50, p99_ms=prof.latency_ms.p99, budget_ms=stage.budget_ms,
                       passed=passed, metrics=metrics, gates=gates, artifacts=artifacts, reused=reused,
                       size_mb=size_mb, profile=prof.engine, parallel_with=list(stage.parallel_with),
                       warnings=list(prof.warnings) + list(warnings or []), cv=prof.latency_ms.cv, noisy=prof.noisy,
                       range_ms=_estimate_range(prof),
                       provenance=prof.provenance.status if prof.provenance is not None else None)


def _estimate_range(prof: ProfileResult) -> list[float] | None:
    rng = prof.settings.get("estimate_range_ms") if prof.source == "estimated" else None
    return [float(rng[0]), float(rng[1])] if isinstance(rng, (list, tuple)) and len(rng) == 2 else None


def _path_total(results: list[StageResult], latency: Any) -> float:
    """The end of the last stage along the critical path, with ``latency(stage result)`` per stage."""
    starts: dict[str, float] = {}
    latest = 0.0
    for r in results:
        start = min(starts[p] for p in r.parallel_with) if r.parallel_with else latest
        starts[r.stage] = start
        latest = max(latest, start + latency(r))
    return latest


def _critical_path(results: list[StageResult], recipe: Recipe) -> dict[str, Any]:
    starts: dict[str, float] = {}
    latest = 0.0
    for r in results:
        start = min(starts[p] for p in r.parallel_with) if r.parallel_with else latest
        r.start_ms, r.end_ms = start, start + r.latency_ms
        starts[r.stage] = r.start_ms
        latest = max(latest, r.end_ms)
    total = latest
    for r in results:
        r.share = r.latency_ms / total if total > 0 else 0.0
    budget = recipe.budget_ms
    estimated = any(r.source == "estimated" for r in results)
    return {"total_ms": total, "budget_ms": budget, "margin_ms": None if budget is None else budget - total,
            "passed": None if budget is None else total <= budget, "estimated": estimated,
            "method": "estimate (sum of stages)" if estimated else "sum of stages",
            "p50_ms": None, "p99_ms": None, "cv": None, "noisy": any(r.noisy for r in results), "frames": None,
            "sum_of_stage_ms": total, "stages": [r.stage for r in results],
            # the estimate's range: each estimated stage at its low / high end (the errors taken to add up)
            "range_ms": [_path_total(results, lambda r: r.range_ms[0] if r.range_ms else r.latency_ms),
                         _path_total(results, lambda r: r.range_ms[1] if r.range_ms else r.latency_ms)]
            if estimated else None}


# ----- outputs -----

def write_outputs(result: RunResult, run_dir: Path) -> None:
    atomic_write_json(run_dir / RESULTS, result.to_dict())
    atomic_write_text(run_dir / "junit.xml", junit_xml(result))
    atomic_write_text(run_dir / "summary.md", markdown_summary(result))
    try:
        render_run_html(result, run_dir / "report.html")
    except ImportError:  # pragma: no cover - matplotlib missing
        pass
