"""Run a recipe: every stage compressed, exported, built, profiled and evaluated per
target, with content-addressed caching, per-stage budgets and CI outputs.

Caching: each sub-step (compress, export, build, profile, evaluate) writes a folder under
``<cache>/<kind>-<key>`` whose key hashes its inputs (the model's identity, the step
configs, the data specs, the seed, the previous sub-step's key and the package
versions). A folder that exists is complete (it was renamed into place only after it
succeeded), so an unchanged sub-step is reused, a changed one and everything after it
is rebuilt, and an interrupted run resumes where it stopped. Each stage's key also
includes the previous stage's, so a changed stage rebuilds every stage after it.

Timing: stages run in sequence unless a stage declares ``parallel_with`` an earlier
stage, in which case it starts with that stage; the total is the critical path (the
latest end). Targets edgekit cannot measure here (a Jetson without TensorRT) get a
roofline estimate, labelled as such, and a TensorRT build bundle for the device.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import (
    atomic_write_json,
    atomic_write_text,
    claim_work_folder,
    file_lock,
    package_versions,
    read_manifest,
    sha256_json,
    sha256_tree,
    staged_dir,
)
from edgekit.errors import BadInputError, EdgekitError, UnavailableError
from edgekit.pipelines.recipe import Recipe, StageSpec, validate_recipe
from edgekit.profiling import LatencyStats, ProfileConfig, ProfileResult, device_measurement
from edgekit.runtimes import RUNTIMES, get_runtime
from edgekit.sources.inputs import shapes_only

RESULTS = "results.json"


@dataclass
class StageResult:
    stage: str
    target: str
    kind: str  # "model" | "callable"
    source: str  # "measured" | "estimated"
    latency_ms: float  # at the recipe's percentile
    p50_ms: float
    p99_ms: float
    start_ms: float = 0.0
    end_ms: float = 0.0
    budget_ms: float | None = None
    passed: bool | None = None  # None when the stage has no budget
    share: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    gates: list[dict[str, Any]] = field(default_factory=list)  # accuracy thresholds
    artifacts: dict[str, str] = field(default_factory=dict)
    reused: dict[str, bool] = field(default_factory=dict)
    size_mb: float | None = None
    profile: str | None = None
    parallel_with: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    estimated_ms: float | None = None  # roofline estimate of the same graph on the target


@dataclass
class RunResult:
    recipe: dict[str, Any]
    run_dir: str
    percentile: str
    seed: int
    targets: dict[str, dict[str, Any]]
    passed: bool
    versions: dict[str, str]
    seconds: float
    stages: list[StageResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # pragma: no cover
        pass


class _Cache:
    """Content-addressed sub-step folders: ``get(kind, key_parts, build)``."""

    def __init__(self, root: Path, force: bool = False):
        self.root = root
        self.force = force
        self.root.mkdir(parents=True, exist_ok=True)
        self.rebuilt: set[str] = set()

    def key(self, parts: dict[str, Any]) -> str:
        return sha256_json(parts)[:16]

    def folder(self, kind: str, key: str) -> Path:
        return self.root / f"{kind}-{key}"

    def get(self, kind: str, key: str, build: Any) -> tuple[Path, bool]:
        folder = self.folder(kind, key)
        if self._reusable(folder, key):
            return folder, True
        with file_lock(self.root / ".locks" / f"{kind}-{key}"):  # runs sharing the cache build an entry once
            if self._reusable(folder, key):
                return folder, True
            build(folder)
        self.rebuilt.add(key)
        return folder, False

    def _reusable(self, folder: Path, key: str) -> bool:
        return (folder / "manifest.json").is_file() and not (self.force and key not in self.rebuilt)


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
        from edgekit.sources.handle import InputSpec

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

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = self.fn(**feeds)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def timed_run(self, feeds: dict[str, np.ndarray]) -> float:
        t0 = time.perf_counter()
        self.run(feeds)
        return (time.perf_counter() - t0) * 1e3

    def node_profile(self, feeds: dict[str, np.ndarray], iterations: int) -> list[Any]:
        return []

    def close(self) -> None:
        pass


def _profile_config(recipe: Recipe) -> ProfileConfig:
    return ProfileConfig(**{k: v for k, v in recipe.profile.items()})


def plan(recipe: Recipe) -> list[dict[str, Any]]:
    """The resolved plan, for ``--dry-run``: what each stage will do on each target."""
    from edgekit.targets import load_target

    rows = []
    for t in recipe.targets:
        target = load_target(t)
        for s in recipe.stages:
            if s.callable:
                actions = [f"time {s.callable}"]
            else:
                actions = [f"load {s.model}"] + [f"{st.name}({_kv(st.config)})" for st in s.steps]
                actions += ["export onnx"] + ([f"build {_runtime_for(target)}", "profile (measured)"] if _measurable(target)
                                              else ["estimate (roofline)", "TensorRT build bundle"])
                if s.evaluate:
                    actions.append(f"evaluate {s.evaluate.get('metric', 'default')}")
            rows.append({"target": target.name, "stage": s.name, "actions": actions, "budget_ms": s.budget_ms,
                         "parallel_with": list(s.parallel_with)})
    return rows


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def _measurable(target: Any) -> bool:
    """Can edgekit build and time an engine for ``target`` on this machine (with any of
    the target's runtimes)?"""
    for name in target.runtimes:
        try:
            if name in RUNTIMES and get_runtime(name).measures_here(target):
                return True
        except (ImportError, EdgekitError):
            continue  # a runtime that cannot load here measures nothing
    return False


def _runtime_for(target: Any) -> str:
    return target.runtimes[0] if target.runtimes else "onnxruntime"


def run_recipe(recipe: Recipe, run_dir: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
               force: bool = False, progress: bool = True, wait: bool = False) -> RunResult:
    """Run every stage of ``recipe`` on every target; write results, JUnit, Markdown, HTML.

    The run folder is locked for the whole run: a second run on it exits with an error
    naming the first one's PID, or with ``wait`` waits for it (and then reuses what it
    cached). It must be new, empty or a run folder.

    >>> result = run_recipe(load_recipe("examples/perception.yaml"), "runs/perception")  # doctest: +SKIP
    >>> result.passed
    True
    """
    recipe = validate_recipe(recipe)  # the dry run's validation, whoever built the Recipe; before any write
    with claim_work_folder(run_dir, "run", wait=wait, hint=" (edgekit run --wait waits for it)"):
        return _run_locked(recipe, run_dir, cache_dir, force, progress)


def _run_locked(recipe: Recipe, run_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None,
                force: bool, progress: bool) -> RunResult:
    from edgekit.targets import load_target

    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cache = _Cache(Path(cache_dir) if cache_dir else run_dir / "cache", force=force)
    set_seed(recipe.seed)
    versions = package_versions()
    pconfig = _profile_config(recipe)
    all_stages: list[StageResult] = []
    per_target: dict[str, dict[str, Any]] = {}
    for t in recipe.targets:
        target = load_target(t)
        prev_key = ""
        results: list[StageResult] = []
        for stage in recipe.stages:
            res, prev_key = _run_stage(stage, target, recipe, cache, pconfig, versions, prev_key, progress)
            results.append(res)
        summary = _critical_path(results, recipe)
        per_target[target.name] = summary
        all_stages.extend(results)
    passed = all(v["passed"] is not False for v in per_target.values()) and all(
        r.passed is not False and all(g["passed"] for g in r.gates) for r in all_stages)
    result = RunResult(recipe=recipe.to_dict(), run_dir=str(run_dir), percentile=recipe.percentile, seed=recipe.seed,
                       targets=per_target, passed=passed, versions=versions,
                       seconds=round(time.perf_counter() - t_start, 2), stages=all_stages)
    write_outputs(result, run_dir)
    return result


def _run_stage(stage: StageSpec, target: Any, recipe: Recipe, cache: _Cache, pconfig: ProfileConfig,
               versions: dict[str, str], prev_key: str, progress: bool) -> tuple[StageResult, str]:
    base = {"prev": prev_key, "versions": versions, "seed": recipe.seed}
    if stage.callable:
        key = cache.key({**base, "callable": stage.callable, "inputs": stage.inputs, "profile": recipe.profile,
                         "target": target.name})
        fn = _import(stage.callable)
        engine = CallableEngine(fn, stage.inputs)

        def build_profile(folder: Path) -> None:
            from edgekit.artifact import Manifest, write_manifest
            from edgekit.profiling import measure

            result = measure(engine, engine.sample_feeds(recipe.seed), dataclasses.replace(pconfig, node_profile=False),
                             engine_name=stage.callable or "", runtime="python", target=target.name, model=stage.name)
            with staged_dir(folder) as tmp:
                result.save(tmp / "profile.json")
                write_manifest(tmp, Manifest(kind="profile", files={"profile": "profile.json"},
                                             config={"callable": stage.callable, "inputs": stage.inputs},
                                             target=target.name))

        folder, reused = cache.get("profile", key, build_profile)
        prof = ProfileResult.load(folder / "profile.json")
        host_note = [] if target.kind == "cpu" else [f"Python stage timed on this host, not on {target.name}"]
        return _stage_result(stage, target, "callable", prof, recipe, {"profile": str(folder)}, {"profile": reused},
                             {}, [], None, host_note), key

    # A model stage: compress -> export -> build -> profile (or estimate) -> evaluate.
    from edgekit.compress import StepContext, compress
    from edgekit.export.onnx import ExportConfig, export_onnx

    model_id = _model_identity(str(stage.model))
    estimated_ms: float | None = None
    target_aware = any(s.name == "int8" for s in stage.steps)
    artifacts: dict[str, str] = {}
    reused: dict[str, bool] = {}
    source_for_export: str = str(stage.model)
    io = stage.input_options()  # shapes and image preprocessing (edgekit.sources.inputs)
    io_key = {"shapes": stage.shapes, "preprocess": stage.preprocess} if io else {}
    key = cache.key({**base, "model": model_id, **io_key})
    if stage.steps:
        key = cache.key({**base, "model": model_id, "steps": [[s.name, s.config] for s in stage.steps],
                         "calib": stage.calib, "train": stage.train,
                         "target": target.name if target_aware else None, **io_key})

        def build_model(folder: Path) -> None:
            ctx = StepContext(target=target, calib=stage.calib, train=stage.train, seed=recipe.seed,
                              progress=progress, work_dir=cache.root / f"work-{key}", inputs=io)
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
    if _measurable(target):
        from edgekit.build import build_engine
        from edgekit.profiling import profile_engine
        from edgekit.runtimes.base import BuildOptions

        bkey = cache.key({"prev": key, "target": target.name, "build": stage.build})
        folder, reused["build"] = cache.get(
            "engine", bkey, lambda f: build_engine(str(onnx_folder), target, f, BuildOptions(**stage.build),
                                                   shapes_only(io)))
        artifacts["engine"] = str(folder)
        engine_folder = folder
        pkey = cache.key({"prev": bkey, "profile": recipe.profile})

        def build_profile(f: Path) -> None:
            from edgekit.artifact import Manifest, write_manifest

            with staged_dir(f) as tmp:
                profile_engine(engine_folder, pconfig, out_json=tmp / "profile.json")
                write_manifest(tmp, Manifest(kind="profile", files={"profile": "profile.json"},
                                             config=dict(recipe.profile), target=target.name))

        folder, reused["profile"] = cache.get("profile", pkey, build_profile)
        artifacts["profile"] = str(folder)
        prof = ProfileResult.load(folder / "profile.json")
        prof.model = stage.name
        eval_key = pkey
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
    result = _stage_result(stage, target, "model", prof, recipe, artifacts, reused, metrics, gates, size_mb, warnings)
    result.estimated_ms = estimated_ms
    return result, eval_key


def _onnx_size_mb(onnx_folder: Path) -> float | None:
    try:
        m = read_manifest(onnx_folder)
        path = m.path_of(onnx_folder, "onnx")
        extra = path.with_name(path.name + ".data")
        return (path.stat().st_size + (extra.stat().st_size if extra.exists() else 0)) / 1e6
    except (EdgekitError, OSError):
        return None


def _estimate_folder(onnx_folder: Path, target: Any, folder: Path) -> None:
    """A roofline estimate as a ProfileResult (source "estimated")."""
    from edgekit.artifact import Manifest, machine_info, now_iso, write_manifest

    try:
        from edgekit.estimate import estimate
    except ImportError as e:
        raise UnavailableError(f"cannot measure on {target.name} here and the estimator is unavailable: {e}") from None
    m = read_manifest(onnx_folder)
    est = estimate(str(m.path_of(onnx_folder, "onnx")), target)
    total = float(est.total_ms)
    stats = LatencyStats(min=total, mean=total, p50=total, p90=total, p95=total, p99=total, max=total, std=0.0,
                         cv=0.0, count=1)
    prof = ProfileResult(engine=str(onnx_folder), runtime="estimate", target=target.name, model=m.model.get("name"),
                         settings={"estimate": True}, latency_ms=stats, throughput_per_s=1e3 / total if total else 0.0,
                         machine=machine_info(), source="estimated", created=now_iso(),
                         warnings=[f"estimate, not a measurement: roofline on {target.name}"])
    with staged_dir(folder) as tmp:
        prof.save(tmp / "profile.json")
        write_manifest(tmp, Manifest(kind="estimate", files={"profile": "profile.json"}, target=target.name,
                                     metrics={"total_ms": total}))


def _try_bundle(onnx_folder: Path, target: Any, cache: _Cache, key: str, stage: StageSpec) -> tuple[str | None, str]:
    """A build bundle (what the device needs to build and time the engine itself) for a
    target edgekit cannot measure here, from the target's preferred runtime (best effort):
    (folder, why not)."""
    try:
        from edgekit.build import build_engine
        from edgekit.runtimes.base import BuildOptions

        opts = {"precision": "best" if "int8" in target.precisions else "fp16", **stage.build}
        folder, _ = cache.get("bundle", cache.key({"prev": key, "bundle": opts}),
                              lambda f: build_engine(str(onnx_folder), target, f, BuildOptions(**opts)))
        if read_manifest(folder).kind != "bundle":
            return None, f"the target's runtime {read_manifest(folder).config.get('runtime')!r} writes no build bundle"
        return str(folder), ""
    except (EdgekitError, ImportError) as e:
        return None, str(e)


def _evaluate_folder(stage: StageSpec, model_source: str, onnx_folder: Path, engine_folder: Path | None,
                     folder: Path) -> None:
    from edgekit.artifact import Manifest, write_manifest
    from edgekit.evaluate import evaluate
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    spec = stage.evaluate or {}
    reference = load_model(str(stage.model), stage.input_options())
    samples = load_samples(spec.get("data"), reference, split="eval", limit=spec.get("limit"))
    if engine_folder is not None:
        from edgekit.build import load_engine

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
    gates = []
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


def _stage_result(stage: StageSpec, target: Any, kind: str, prof: ProfileResult, recipe: Recipe,
                  artifacts: dict[str, str], reused: dict[str, bool], metrics: dict[str, Any],
                  gates: list[dict[str, Any]], size_mb: float | None, warnings: list[str] | None = None) -> StageResult:
    lat = prof.latency_ms.get(recipe.percentile)
    passed = None if stage.budget_ms is None else lat <= stage.budget_ms
    return StageResult(stage=stage.name, target=target.name, kind=kind, source=prof.source, latency_ms=lat,
                       p50_ms=prof.latency_ms.p50, p99_ms=prof.latency_ms.p99, budget_ms=stage.budget_ms,
                       passed=passed, metrics=metrics, gates=gates, artifacts=artifacts, reused=reused,
                       size_mb=size_mb, profile=prof.engine, parallel_with=list(stage.parallel_with),
                       warnings=list(prof.warnings) + list(warnings or []))


def _critical_path(results: list[StageResult], recipe: Recipe) -> dict[str, Any]:
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    latest = 0.0
    for r in results:
        start = min(starts[p] for p in r.parallel_with) if r.parallel_with else latest
        r.start_ms, r.end_ms = start, start + r.latency_ms
        starts[r.stage], ends[r.stage] = r.start_ms, r.end_ms
        latest = max(latest, r.end_ms)
    total = latest
    for r in results:
        r.share = r.latency_ms / total if total > 0 else 0.0
    budget = recipe.budget_ms
    return {"total_ms": total, "budget_ms": budget, "margin_ms": None if budget is None else budget - total,
            "passed": None if budget is None else total <= budget,
            "estimated": any(r.source == "estimated" for r in results),
            "stages": [r.stage for r in results]}


# ----- outputs -----

def write_outputs(result: RunResult, run_dir: Path) -> None:
    atomic_write_json(run_dir / RESULTS, result.to_dict())
    atomic_write_text(run_dir / "junit.xml", junit_xml(result))
    atomic_write_text(run_dir / "summary.md", markdown_summary(result))
    try:
        from edgekit.pipelines.html import render_run_html

        render_run_html(result, run_dir / "report.html")
    except ImportError:  # pragma: no cover - matplotlib missing
        pass


def stage_table(result: RunResult) -> list[list[str]]:
    rows = []
    for r in result.stages:
        rows.append([r.target, r.stage, f"{r.latency_ms:.3f}", f"{r.p50_ms:.3f}", f"{r.p99_ms:.3f}", f"{r.share:.0%}",
                     "-" if r.budget_ms is None else f"{r.budget_ms:g}",
                     "-" if r.budget_ms is None else f"{r.budget_ms - r.latency_ms:+.3f}",
                     "-" if r.passed is None else ("PASS" if r.passed else "FAIL"),
                     r.source + (" (reused)" if r.reused and all(r.reused.values()) else "")])
    return rows


STAGE_COLUMNS = ["target", "stage", "latency ms", "p50", "p99", "share", "budget", "margin", "verdict", "source"]


def target_verdict(t: dict[str, Any], markdown: bool = False) -> str:
    """``total 13.839 ms against 33 ms: PASS, margin +19.161 ms`` for one target's summary."""
    est = " (estimate)" if t["estimated"] else ""
    if t["budget_ms"] is None:
        return f"total {t['total_ms']:.3f} ms{est} (no end-to-end budget)"
    verdict = "PASS" if t["passed"] else "FAIL"
    verdict = f"**{verdict}**" if markdown else verdict
    return f"total {t['total_ms']:.3f} ms{est} against {t['budget_ms']:g} ms: {verdict}, margin {t['margin_ms']:+.3f} ms"


def markdown_summary(result: RunResult) -> str:
    lines = [f"# edgekit run: {result.recipe['name']}", "",
             f"{'PASS' if result.passed else 'FAIL'}; latency at {result.percentile}; seed {result.seed}; "
             f"{result.seconds:.1f} s", ""]
    lines += ["| " + " | ".join(STAGE_COLUMNS) + " |", "|" + "---|" * len(STAGE_COLUMNS)]
    for row in stage_table(result):
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for name, t in result.targets.items():
        lines.append(f"- **{name}**: {target_verdict(t, markdown=True)}")
    gates = [g for r in result.stages for g in r.gates]
    if gates:
        lines += ["", "| stage | metric | value | threshold | verdict |", "|---|---|---|---|---|"]
        for g in gates:
            thr = f">= {g['min']}" if "min" in g else f"<= {g['max']}"
            lines.append(f"| {g['stage']} | {g['metric']} | {g['value']:.4f} | {thr} | {'PASS' if g['passed'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def junit_xml(result: RunResult) -> str:
    from xml.sax.saxutils import quoteattr

    cases = []
    for name, t in result.targets.items():
        if t["budget_ms"] is not None:
            ok = t["passed"]
            msg = f"total {t['total_ms']:.3f} ms vs budget {t['budget_ms']:g} ms"
            cases.append((f"{name}.total_budget", ok, msg, t["total_ms"] / 1e3))
    for r in result.stages:
        if r.budget_ms is not None:
            cases.append((f"{r.target}.{r.stage}.budget", r.passed,
                          f"{result.percentile} {r.latency_ms:.3f} ms vs budget {r.budget_ms:g} ms ({r.source})",
                          r.latency_ms / 1e3))
        for g in r.gates:
            thr = f">= {g['min']}" if "min" in g else f"<= {g['max']}"
            cases.append((f"{r.target}.{r.stage}.{g['metric']}", g["passed"], f"{g['metric']} {g['value']:.4f} {thr}", 0.0))
    failures = sum(1 for c in cases if not c[1])
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name="edgekit" tests="{len(cases)}" failures="{failures}">',
           f'  <testsuite name={quoteattr("edgekit." + str(result.recipe["name"]))} tests="{len(cases)}" '
           f'failures="{failures}" time="{result.seconds:.3f}">']
    for name, ok, msg, secs in cases:
        out.append(f'    <testcase classname="edgekit" name={quoteattr(name)} time="{secs:.6f}">')
        if not ok:
            out.append(f"      <failure message={quoteattr(msg)}/>")
        else:
            out.append(f"      <system-out>{_xml_text(msg)}</system-out>")
        out.append("    </testcase>")
    out += ["  </testsuite>", "</testsuites>"]
    return "\n".join(out) + "\n"


def _xml_text(s: str) -> str:
    from xml.sax.saxutils import escape

    return escape(s)
