"""Trade-off sweeps: run a recipe over a grid of settings and find the Pareto frontier.

``--grid 'weight-only.group_size=32,128' --grid 'prune.ratio=0,0.3,0.5'`` runs every
combination (``--list`` gives explicit combinations instead), each as a cached run
sharing one cache, so unchanged sub-steps are computed once across the whole sweep.

Grid keys:
  * ``STEP.FIELD`` sets a field of that step in every stage that has the step;
  * ``STAGE.STEP.FIELD`` in one stage only;
  * ``bits`` / ``STAGE.bits``: 32 removes quantization, 8 means INT8 PTQ, 2/3/4 weight-only;
  * ``prune.ratio=0`` removes the prune step (the unpruned baseline).
A key that matches no step in the recipe is an error listing the valid keys.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from edgekit.artifact import atomic_write_json, atomic_write_text, claim_work_folder, sha256_json
from edgekit.compress import canonical_step, get_step
from edgekit.compress.plan import INT8, QUANTIZE_STEPS, WEIGHT_ONLY, quantize_step
from edgekit.errors import BadInputError, UnavailableError, bad_choice
from edgekit.limits import format_bytes, require_memory
from edgekit.markup import md
from edgekit.pipelines.html import render_sweep_html, sweep_plots
from edgekit.pipelines.recipe import Recipe, parse_recipe, read_recipe_data
from edgekit.pipelines.results import SWEEP_COLUMNS, RunResult, StageResult, SweepRow, sweep_table
from edgekit.pipelines.run import run_recipe
from edgekit.pipelines.sweep_options import DEFAULT_MAX_POINTS, EXECUTORS, parse_value
from edgekit.progress import progress_bar

JOB_MEMORY = 2**30  # what one local sweep process needs at least (torch, ONNX Runtime, a model)


def parse_grid(specs: list[str]) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        if "=" not in spec:
            raise BadInputError(f"grid {spec!r} must look like 'step.field=v1,v2'")
        key, values = spec.split("=", 1)
        vals = [parse_value(v) for v in values.split(",") if v.strip() != ""]
        if not key.strip() or not vals:
            raise BadInputError(f"grid {spec!r} needs a key and at least one value")
        grid[key.strip()] = vals
    return grid


def grid_size(grid: dict[str, list[Any]]) -> int:
    """How many points the grid has (its combinations), without making them."""
    return math.prod(len(v) for v in grid.values()) if grid else 0


def combinations(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def _step_list(stage: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A stage's steps as [{name: {options}}], or None when they are not in that form (the
    recipe's validation then names the problem; overrides leave such a stage alone)."""
    steps = stage.get("steps") or []
    if not isinstance(steps, list):
        return None
    out: list[dict[str, Any]] = []
    for s in steps:  # each under its step's current name (parsing the recipe warns about an old one)
        if isinstance(s, str):
            out.append({canonical_step(s, where="recipe", warn=False): {}})
        elif isinstance(s, dict) and len(s) == 1 and isinstance(next(iter(s.values())), (dict, type(None))):
            out.append({canonical_step(k, where="recipe", warn=False) if isinstance(k, str) else k: dict(v or {})
                        for k, v in s.items()})
        else:
            return None
    return out


def _stages(data: dict[str, Any]) -> list[dict[str, Any]]:
    stages = data.get("stages")
    return [s for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []


def valid_keys(data: dict[str, Any]) -> list[str]:
    keys: set[str] = {"bits"}
    for stage in _stages(data):
        if stage.get("callable"):
            continue
        keys.add(f"{stage.get('name')}.bits")
        for s in _step_list(stage) or []:
            name = next(iter(s))
            try:
                fields = [f.name for f in dataclasses.fields(get_step(name).config)]
            except BadInputError:
                continue
            for f in fields:
                keys.add(f"{name}.{f}")
                keys.add(f"{stage.get('name')}.{name}.{f}")
    return sorted(keys)


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the raw recipe with the overrides applied (see module doc for keys). The
    result is plain data again: ``parse_recipe`` validates it like any recipe, so an
    override value goes through the same schema as a value written in the file."""
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise BadInputError(f"overrides must map 'step.field' keys to values, got {overrides!r}")
    data = copy.deepcopy(data)
    stages = _stages(data)
    for key, value in overrides.items():
        parts = key.split(".")
        # an old step name in STEP.FIELD or STAGE.STEP.FIELD ("int4.group_size"): the current one, warned
        if len(parts) == 3 or (len(parts) == 2 and parts[-1] != "bits"):
            parts[-2] = canonical_step(parts[-2], where=f"grid key {key!r}")
            key = ".".join(parts)
        if parts[-1] == "bits" and len(parts) <= 2:
            targets = [s for s in stages if not s.get("callable") and (len(parts) == 1 or s.get("name") == parts[0])]
            if not targets:
                raise bad_choice("grid key", key, valid_keys(data))
            for s in targets:
                steps = _step_list(s)
                if steps is not None:  # malformed steps stay as written, for the validation to name
                    s["steps"] = _with_bits(steps, value, key)
            continue
        if len(parts) == 2:
            step_name, fld = parts
            chosen = [s for s in stages if any(step_name in st for st in _step_list(s) or [])]
        elif len(parts) == 3:
            stage_name, step_name, fld = parts
            chosen = [s for s in stages if s.get("name") == stage_name
                      and any(step_name in st for st in _step_list(s) or [])]
        else:
            chosen = []
        if not chosen or key not in valid_keys(data):
            raise bad_choice("grid key (no step has it)", key, valid_keys(data))
        for s in chosen:
            steps = _step_list(s) or []
            new_steps = []
            for st in steps:
                name = next(iter(st))
                if name == step_name:
                    unchanged = get_step(name).unchanged_at
                    if fld in unchanged and value == unchanged[fld]:
                        continue  # the step would leave the model as it is (prune ratio 0: the baseline)
                    st[name][fld] = value
                new_steps.append(st)
            s["steps"] = new_steps
    return data


def _with_bits(steps: list[dict[str, Any]], bits: Any, key: str) -> list[dict[str, Any]]:
    """The chain with its quantize step replaced by the one for ``bits`` (32/16: none). A sweep
    point runs RTN (4-bit) or PTQ (8-bit) unless the recipe's own quantize step names a method."""
    kept = [s for s in steps if next(iter(s)) not in QUANTIZE_STEPS]
    old = {next(iter(s)): s[next(iter(s))] for s in steps if next(iter(s)) in QUANTIZE_STEPS}
    if bits in (32, 16, None, "fp32", "none"):
        return kept
    if bits not in (2, 3, 4, 8):
        raise BadInputError(f"grid {key}={bits!r}: bits must be 32 (float), 8, 4, 3 or 2")
    weight_only = bits < 8 or WEIGHT_ONLY in old  # an 8-bit point of a weight-only recipe stays weight-only
    own = old.get(WEIGHT_ONLY if weight_only else INT8, {})
    chosen = quantize_step(bits, own.get("method", "rtn" if weight_only else "ptq"))
    if chosen is None:  # only without bits
        raise RuntimeError(f"no quantize step for bits {bits}")
    name, base = chosen
    return kept + [{name: {**own, **base}}]


def _pareto(rows: list[SweepRow], target: str) -> None:
    """Mark rows not dominated in (metric, latency on ``target``, size)."""
    def vec(r: SweepRow) -> tuple[float, float, float] | None:
        if r.value is None or target not in r.latency_ms:
            return None
        q = -r.value if r.higher_is_better else r.value
        return (q, r.latency_ms[target], r.size_mb if r.size_mb is not None else 0.0)

    pts = [(r, vec(r)) for r in rows]
    for r, v in pts:
        if v is None:
            continue
        dominated = any(w is not None and all(a <= b for a, b in zip(w, v)) and any(a < b for a, b in zip(w, v))
                        for o, w in pts if o is not r)
        r.pareto = not dominated


_LOWER_IS_BETTER = ("perplexity", "ppl", "kl", "mean_kl", "loss", "error")


def _row_from_result(params: dict[str, Any], result: Any, seconds: float) -> SweepRow:
    metric, value = None, None
    for r in reversed(result.stages):  # the last model stage's evaluation
        if r.gates:
            metric, value = r.gates[0]["metric"], float(r.gates[0]["value"])
            break
        nums = {k: v for k, v in r.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if nums:
            metric = next(iter(nums))
            value = float(nums[metric])
            break
    sizes = [r.size_mb for r in result.stages if r.size_mb is not None]
    latency = {t: v["total_ms"] for t, v in result.targets.items()}
    measured = {t: v for t, v in result.targets.items() if v.get("p50_ms") is not None}
    estimated: dict[str, float] = {}
    for r in result.stages:  # model stages' roofline estimates, summed (Python stages have none)
        if r.estimated_ms is not None:
            estimated[r.target] = estimated.get(r.target, 0.0) + float(r.estimated_ms)
    return SweepRow(params=params, run_dir=result.run_dir, passed=result.passed, metric=metric, value=value,
                    higher_is_better=not (metric or "").lower().startswith(_LOWER_IS_BETTER),
                    size_mb=sum(sizes) if sizes else None, latency_ms=latency, estimated_ms=estimated,
                    seconds=result.seconds, p50_ms={t: v["p50_ms"] for t, v in measured.items()},
                    p99_ms={t: v["p99_ms"] for t, v in measured.items()},
                    cv={t: v["cv"] for t, v in measured.items()}, budget_ms=result.recipe.get("budget_ms"),
                    percentile=result.percentile)


def _run_one(args: tuple[dict[str, Any], str, str, str | None, bool]) -> tuple[dict[str, Any], dict[str, Any], float]:
    """One configuration (a top-level function so process pools and Ray can ship it)."""
    data, run_dir, cache_dir, path, force = args
    t0 = time.perf_counter()
    recipe = parse_recipe(data, path)
    result = run_recipe(recipe, run_dir, cache_dir=cache_dir, force=force, progress=False)
    return data, result.to_dict(), time.perf_counter() - t0


def check_jobs(jobs: int) -> None:
    """``--jobs``: at least 1, at most this machine's cores (more processes only share them, and
    timings taken on an oversubscribed machine are wrong), and as many as fit in the memory."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise BadInputError(f"--jobs must be >= 1, got {jobs}")
    cores = os.cpu_count() or 1
    if jobs > cores:
        raise BadInputError(f"--jobs {jobs} is more than this machine's {cores} cores; at most {cores} "
                            "(each job compresses, builds and times models)")
    if jobs > 1:
        require_memory(jobs * JOB_MEMORY, f"--jobs {jobs} ({format_bytes(JOB_MEMORY)} per sweep process)",
                       "lower --jobs", share=1.0)


def run_sweep(recipe_path: str | os.PathLike[str], grid: list[str] | dict[str, list[Any]], out_dir: str | os.PathLike[str],
              *, combos: list[dict[str, Any]] | None = None, jobs: int = 1, executor: str = "local",
              address: str | None = None, force: bool = False, max_points: int = DEFAULT_MAX_POINTS,
              announce: Callable[[str], None] | None = None) -> list[SweepRow]:
    """Run every grid combination of a recipe; write sweep.json, sweep.md, plots and HTML.

    The number of points is known (and given to ``announce``) before anything is validated
    or run; more than ``max_points`` is refused at once.

    >>> rows = run_sweep("examples/fmnist-sweep.yaml", ["bits=32,8", "prune.ratio=0,0.5"], "runs/sweep")  # doctest: +SKIP
    """
    if executor not in EXECUTORS:
        raise bad_choice("executor", executor, EXECUTORS)
    if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 1:
        raise BadInputError(f"--max-points must be >= 1, got {max_points}")
    if executor != "ray":
        check_jobs(jobs)
    grid_map = parse_grid(grid) if isinstance(grid, list) else grid
    points = len(combos) if combos is not None else grid_size(grid_map)
    shape = " x ".join(f"{len(v)} {k}" for k, v in grid_map.items()) if combos is None else "--list"
    if announce is not None:
        announce(f"sweep: {points} point{'s' if points != 1 else ''} ({shape})")
    if points > max_points:
        raise BadInputError(f"the sweep has {points} points ({shape}), more than --max-points {max_points}; "
                            "narrow the grid or raise --max-points")
    path = Path(recipe_path)
    raw = read_recipe_data(path)  # the recipe reader: bounded, no YAML aliases
    try:
        base = parse_recipe(raw, str(path))
    except BadInputError as e:
        raise BadInputError(f"{path}: {e}") from None
    combos = combos if combos is not None else combinations(grid_map)
    if not combos:
        raise BadInputError("the sweep has no combinations (give --grid)")
    out = Path(out_dir)
    cache = out / "cache"
    tasks = []
    # Validate every configuration, overrides through the recipe's own schema, before any work starts.
    for params in progress_bar(combos, "validating the sweep's points"):
        data = apply_overrides(raw, params)
        try:
            parse_recipe(data, str(path))
        except BadInputError as e:
            given = ", ".join(f"{k}={v}" for k, v in params.items())
            raise BadInputError(f"{path} with {given}: {e}") from None
        run_dir = out / "runs" / sha256_json(params)[:12]
        tasks.append((data, str(run_dir), str(cache), str(path), force))
    with claim_work_folder(out, "sweep", protect=(path,)):  # one sweep at a time in a folder
        results = _execute(tasks, jobs, executor, address, _resources(base))
        rows = []
        for params, (_data, result_dict, seconds) in zip(combos, results):
            result_dict["stages"] = [StageResult(**s) for s in result_dict["stages"]]
            rows.append(_row_from_result(params, RunResult(**result_dict), seconds))
        targets = sorted({t for r in rows for t in r.latency_ms})
        for t in targets[:1]:
            _pareto(rows, t)
        write_sweep_outputs(rows, out, grid_map, str(path))
    return rows


def _resources(recipe: Recipe) -> dict[str, float]:
    return {ray_resource(Path(t).stem): 1.0 for t in recipe.targets}


def ray_resource(target: str) -> str:
    """The custom Ray resource a node advertises for a device: ``edgekit_target_<name>``."""
    return "edgekit_target_" + "".join(c if c.isalnum() else "_" for c in target)


def _execute(tasks: list[tuple[Any, ...]], jobs: int, executor: str, address: str | None,
             resources: dict[str, float]) -> list[tuple[dict[str, Any], dict[str, Any], float]]:
    if executor == "ray":
        return _execute_ray(tasks, address, resources)
    if executor == "process" or jobs > 1:
        with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(tasks)))) as pool:
            return list(pool.map(_run_one, tasks))
    return [_run_one(t) for t in progress_bar(tasks, "sweep")]


def _execute_ray(tasks: list[tuple[Any, ...]], address: str | None,
                 resources: dict[str, float]) -> list[tuple[dict[str, Any], dict[str, Any], float]]:
    try:
        import ray
    except ImportError:
        raise UnavailableError("the ray executor needs ray (pip install 'edgekit[ray]')") from None
    started = False
    if not ray.is_initialized():
        try:
            ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise BadInputError(f"cannot connect to the Ray cluster at {address!r}: {e}") from None
        started = True
    try:
        available = ray.cluster_resources()
        missing = [r for r in resources if r not in available]
        if missing:
            raise BadInputError(f"no Ray node advertises {', '.join(missing)}; start the device's node with "
                                f"--resources='{{\"{missing[0]}\": 1}}' (cluster has: {', '.join(sorted(available))})")
        # Each configuration asks for a sliver of its targets' resources, so it lands on a node that has them.
        remote = ray.remote(num_cpus=1, resources={r: 0.01 for r in resources})(_run_one)
        return ray.get([remote.remote(t) for t in tasks])
    finally:
        if started and address is None:
            ray.shutdown()


def write_sweep_outputs(rows: list[SweepRow], out: Path, grid: dict[str, list[Any]], recipe: str) -> None:
    atomic_write_json(out / "sweep.json", {"recipe": recipe, "grid": grid, "rows": [dataclasses.asdict(r) for r in rows]})
    lines = [f"# edgekit sweep: {md(recipe)}", "", "Pareto set marked \\*: not dominated in metric, latency and size "
             "together (each plot marks the Pareto set of its own two axes).", "",
             "| " + " | ".join(SWEEP_COLUMNS) + " |", "|" + "---|" * len(SWEEP_COLUMNS)]
    lines += ["| " + " | ".join(md(cell) for cell in row) + " |" for row in sweep_table(rows)]
    atomic_write_text(out / "sweep.md", "\n".join(lines) + "\n")
    plots = sweep_plots(rows, out, budget_ms=rows[0].budget_ms if rows else None,
                        percentile=rows[0].percentile if rows else "p99")
    render_sweep_html(rows, out / "sweep.html", plots, recipe)
