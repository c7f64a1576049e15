"""Recipes: a YAML description of a multi-stage pipeline, validated before anything runs.

```yaml
name: perception
targets: [cpu]                 # or `target: cpu`; names or YAML files
budget_ms: 33                  # end-to-end budget on the critical path
percentile: p99
seed: 0
profile: {duration_s: 1, iterations: 50}
stages:
  - name: preprocess
    callable: edgekit.pipelines.examples:preprocess   # a Python stage, timed the same way
    inputs: {image: {shape: [480, 640, 3], dtype: uint8}}
    budget_ms: 4
  - name: backbone
    model: efficientnet-lite0
    steps:
      - prune: {ratio: 0.3}
      - int8: {method: ptq}
    evaluate: {metric: agreement, min: 0.9}
    budget_ms: 20
  - name: head
    model: edgekit.pipelines.examples:classification_head
    parallel_with: [other-head]   # runs concurrently: the total is the critical path
```

Every key is checked: unknown keys, unknown step names (the registry lists the known),
steps in an impossible order, non-positive budgets and cyclic parallel declarations are
errors that name what is valid.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError

RECIPE_KEYS = ("name", "target", "targets", "budget_ms", "percentile", "seed", "profile", "stages", "description",
               "max_jitter")
STAGE_KEYS = ("name", "model", "callable", "inputs", "steps", "export", "build", "evaluate", "budget_ms",
              "parallel_with", "after", "calib", "train", "description")
PROFILE_KEYS = ("warmup_ms", "duration_s", "iterations", "threads", "node_profile")
EVALUATE_KEYS = ("data", "metric", "min", "max", "limit")


@dataclass(frozen=True)
class StepSpec:
    name: str
    config: dict[str, Any]


@dataclass(frozen=True)
class StageSpec:
    name: str
    model: str | None = None
    callable: str | None = None
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    steps: tuple[StepSpec, ...] = ()
    export: dict[str, Any] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)
    evaluate: dict[str, Any] | None = None
    budget_ms: float | None = None
    parallel_with: tuple[str, ...] = ()
    calib: str | None = None
    train: str | None = None
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["steps"] = [{s.name: s.config} for s in self.steps]
        d["parallel_with"] = list(self.parallel_with)
        return d


@dataclass(frozen=True)
class Recipe:
    name: str
    targets: tuple[str, ...]
    stages: tuple[StageSpec, ...]
    budget_ms: float | None = None
    percentile: str = "p99"
    max_jitter: float | None = None
    seed: int = 0
    profile: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "targets": list(self.targets), "budget_ms": self.budget_ms,
                "percentile": self.percentile, "max_jitter": self.max_jitter, "seed": self.seed,
                "profile": self.profile, "description": self.description,
                "stages": [s.to_dict() for s in self.stages]}

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise BadInputError(f"no stage {name!r} (stages: {', '.join(s.name for s in self.stages)})")


def _check_keys(what: str, data: dict[str, Any], known: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise BadInputError(f"{what} must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise BadInputError(f"{what} has unknown key(s) {', '.join(unknown)} (known: {', '.join(known)})")


def _positive(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadInputError(f"{what} must be a positive number of milliseconds, got {value!r}")
    return float(value)


def parse_steps(stage: str, raw: Any) -> tuple[StepSpec, ...]:
    from edgekit.compress import STEPS, check_order, make_config

    if raw in (None, []):
        return ()
    if not isinstance(raw, list):
        raise BadInputError(f"stage {stage!r}: steps must be a list like [{{int8: {{method: ptq}}}}]")
    steps = []
    for item in raw:
        if isinstance(item, str):
            name, config = item, {}
        elif isinstance(item, dict) and len(item) == 1:
            name, config = next(iter(item.items()))
            config = config or {}
        else:
            raise BadInputError(f"stage {stage!r}: each step is `name` or `name: {{options}}`, got {item!r}")
        if name not in STEPS:
            raise BadInputError(f"stage {stage!r}: unknown step {name!r} (known: {', '.join(STEPS)})")
        if not isinstance(config, dict):
            raise BadInputError(f"stage {stage!r}: options of step {name!r} must be a mapping")
        make_config(name, config)  # validates option names and values now, before any work
        steps.append(StepSpec(name, dict(config)))
    try:
        check_order([s.name for s in steps])
    except BadInputError as e:
        raise BadInputError(f"stage {stage!r}: {e}") from None
    return tuple(steps)


def parse_recipe(data: dict[str, Any], path: str | None = None) -> Recipe:
    from edgekit.profiling import normalize_percentile
    from edgekit.targets import load_target

    _check_keys("recipe", data, RECIPE_KEYS)
    if "target" in data and "targets" in data:
        raise BadInputError("recipe has both 'target' and 'targets'; use one")
    targets = data.get("targets", data.get("target", "cpu"))
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    if not targets:
        raise BadInputError("recipe names no target")
    base = Path(path).parent if path else Path.cwd()
    resolved = []
    for t in targets:
        t = str(t)
        if t.endswith((".yaml", ".yml")) and not Path(t).is_absolute():
            t = str(base / t)
        load_target(t)  # unknown target -> error listing known ones
        resolved.append(t)
    budget = _positive("budget_ms", data["budget_ms"]) if data.get("budget_ms") is not None else None
    percentile = normalize_percentile(data.get("percentile", "p99"))
    profile = data.get("profile") or {}
    _check_keys("profile", profile, PROFILE_KEYS)
    raw_stages = data.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise BadInputError("recipe needs a non-empty list of stages")
    stages: list[StageSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_stages):
        _check_keys(f"stage {i + 1}", raw, STAGE_KEYS)
        name = str(raw.get("name") or f"stage{i + 1}")
        if name in seen:
            raise BadInputError(f"stage name {name!r} is used twice")
        seen.add(name)
        if bool(raw.get("model")) == bool(raw.get("callable")):
            raise BadInputError(f"stage {name!r} needs exactly one of 'model' or 'callable'")
        steps = parse_steps(name, raw.get("steps"))
        if raw.get("callable") and steps:
            raise BadInputError(f"stage {name!r} is a Python callable; compression steps need a model")
        evaluate = raw.get("evaluate")
        if evaluate is not None:
            _check_keys(f"stage {name!r} evaluate", evaluate, EVALUATE_KEYS)
        stage_budget = _positive(f"stage {name!r} budget_ms", raw["budget_ms"]) if raw.get("budget_ms") is not None else None
        parallel = raw.get("parallel_with") or []
        parallel = (parallel,) if isinstance(parallel, str) else tuple(parallel)
        model = raw.get("model")
        if model and str(model).endswith((".onnx", ".pt2", ".gguf")) and not Path(str(model)).is_absolute():
            model = str(base / str(model))
        stages.append(StageSpec(
            name=name, model=model, callable=raw.get("callable"), inputs=raw.get("inputs") or {}, steps=steps,
            export=raw.get("export") or {}, build=raw.get("build") or {}, evaluate=evaluate,
            budget_ms=stage_budget, parallel_with=parallel, calib=raw.get("calib"), train=raw.get("train"),
            description=str(raw.get("description") or "")))
    names = {s.name for s in stages}
    for s in stages:
        for other in s.parallel_with:
            if other not in names:
                raise BadInputError(f"stage {s.name!r} runs parallel with unknown stage {other!r} "
                                    f"(stages: {', '.join(sorted(names))})")
            if other == s.name:
                raise BadInputError(f"stage {s.name!r} cannot run parallel with itself")
    _check_parallel_cycles(stages)
    return Recipe(name=str(data.get("name") or (Path(path).stem if path else "recipe")), targets=tuple(resolved),
                  stages=tuple(stages), budget_ms=budget, percentile=percentile,
                  max_jitter=data.get("max_jitter"), seed=int(data.get("seed", 0)), profile=profile,
                  description=str(data.get("description") or ""), path=path)


def _check_parallel_cycles(stages: list[StageSpec]) -> None:
    """``parallel_with`` is a declaration from a later stage to earlier ones (it starts with
    them instead of after them). A stage declaring a later stage, or two stages declaring
    each other, is a cycle: neither could start first."""
    order = {s.name: i for i, s in enumerate(stages)}
    for s in stages:
        for other in s.parallel_with:
            if order[other] > order[s.name]:
                back = stages[order[other]]
                if s.name in back.parallel_with:
                    raise BadInputError(f"cyclic parallel declaration: {s.name!r} <-> {other!r} "
                                        "(declare it on the later stage only)")
                raise BadInputError(f"stage {s.name!r} declares parallel_with {other!r}, which comes later; "
                                    f"declare it on {other!r} instead (parallel_with names earlier stages)")


def load_recipe(path: str | os.PathLike[str], overrides: dict[str, Any] | None = None) -> Recipe:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise BadInputError(f"recipe file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise BadInputError(f"recipe {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise BadInputError(f"recipe {p} must be a mapping at the top level")
    if overrides:
        from edgekit.pipelines.sweep import apply_overrides

        data = apply_overrides(data, overrides)
    return parse_recipe(data, str(p))
