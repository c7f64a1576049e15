"""Recipes: a YAML description of a multi-stage pipeline, validated completely before anything runs.

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
    export: {opset: 18}
    build: {precision: int8, extra: {workspace_mb: 1024}}
    evaluate: {metric: top1_agreement, min: 0.9}
    budget_ms: 20
  - name: nsfw
    model: open_nsfw.onnx          # an NHWC image model: its layout is read from its input shape
    preprocess: {order: bgr, scale: 255, mean: [104, 117, 123]}
    shapes: {input_0: [1, 224, 224, 3]}
  - name: head
    model: edgekit.pipelines.examples:classification_head
    parallel_with: [backbone]   # starts with it: the total is the critical path
```

One schema covers every section, and it is the dataclasses themselves: the top level is
``Recipe``, a stage ``StageSpec``, ``profile:`` ``ProfileConfig``, ``export:``
``ExportConfig``, ``build:`` ``BuildOptions`` (its ``extra:`` ``BuildExtras``),
``evaluate:`` ``EvaluateSpec``, ``inputs:`` ``InputDecl``, ``preprocess:``
``sources.inputs.Preprocess`` (``shapes:`` maps input names to dims) and every step's options its
registered config class. Field names are the known keys, annotations the types, and each
class's ``__post_init__`` the ranges, so an option is declared once. A bad value is one
line naming its path and what is valid (``stage 'backbone' export.opst: unknown option
(known: ...)``). Beyond single values: steps in an order their declared weight states
forbid, a precision a target lacks, a model file that does not exist, cyclic parallel
declarations. ``edgekit run --dry-run`` runs exactly this validation (``load_recipe``), and
a real run starts with the same call.

Files are read by ``edgekit.schema.read_yaml``: at most 1 MiB, no YAML aliases or anchors
(a 400-byte alias bomb would expand to gigabytes), no tags, nesting bounded, duplicate
keys refused.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.compress import STEPS, canonical_step, check_order, initial_state, make_config
from edgekit.errors import BadInputError, bad_choice
from edgekit.export.onnx import ExportConfig
from edgekit.profiling import ProfileConfig, normalize_percentile
from edgekit.runtimes.base import BuildOptions
from edgekit.schema import FieldError, Loc, check_entries, check_fields, check_keys, check_value, read_yaml, show
from edgekit.sources.inputs import InputOptions, Preprocess, input_options, parse_shapes
from edgekit.sources.zoo import ZOO
from edgekit.targets import load_target

RECIPE_MAX_BYTES = 1 << 20
# A recipe's name names its run folder; a stage's name is part of sweep keys (STAGE.STEP.FIELD).
RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
ENTRY_POINT = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
MODEL_FILES = (".onnx", ".pt2", ".gguf")  # model files resolved against the recipe's folder
DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64")
MAX_INPUT_ELEMENTS = 1 << 26  # a Python stage's sample input: 64 Mi elements (256 MB of float32)
MAX_SEED = 2**32 - 1  # NumPy's legacy seeding takes 0 .. 2**32 - 1


@dataclass(frozen=True)
class InputDecl:
    """One input of a Python stage: its sample feeds are drawn with this shape and dtype."""

    shape: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_fields(self)
        object.__setattr__(self, "shape", tuple(self.shape))
        if len(self.shape) > 8 or any(d < 1 for d in self.shape):
            raise FieldError("shape", f"must be up to 8 dimensions, each >= 1, got {list(self.shape)}")
        if math.prod(self.shape) > MAX_INPUT_ELEMENTS:
            raise FieldError("shape", f"{list(self.shape)} has {math.prod(self.shape)} elements; "
                                      f"at most {MAX_INPUT_ELEMENTS} for a sample input")
        if self.dtype not in DTYPES:
            raise FieldError("dtype", f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")


@dataclass(frozen=True)
class EvaluateSpec:
    """A model stage's evaluation: data (spec; None = the model's eval default), the metric
    to gate on (None = the evaluator's first), its bounds, and how many samples."""

    data: str | None = None
    metric: str | None = None
    min: float | None = None
    max: float | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.limit is not None and self.limit < 1:
            raise FieldError("limit", f"must be >= 1 sample, got {self.limit}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise FieldError("", f"min {self.min} is above max {self.max}: no value could pass")


@dataclass(frozen=True)
class StepSpec:
    name: str
    config: dict[str, Any]


@dataclass(frozen=True)
class StageSpec:
    """One stage; its fields are the keys a stage of a recipe may set. The option sections
    are kept as the mappings the recipe wrote (validated against their ``schema``), which
    also key the run's cache."""

    name: str
    model: str | None = None
    callable: str | None = None
    inputs: dict[str, dict[str, Any]] = field(default_factory=dict, metadata={"schema": InputDecl, "each": True})
    steps: tuple[StepSpec, ...] = ()  # a list of `name` or `name: {options}`, through the step registry
    export: dict[str, Any] = field(default_factory=dict, metadata={"schema": ExportConfig})
    build: dict[str, Any] = field(default_factory=dict, metadata={"schema": BuildOptions})
    evaluate: dict[str, Any] | None = field(default=None, metadata={"schema": EvaluateSpec})
    budget_ms: float | None = None
    parallel_with: tuple[str, ...] = ()
    feeds: dict[str, str] = field(default_factory=dict)  # input -> frame.NAME | STAGE | STAGE.OUTPUT (frames.py)
    calib: str | None = None
    train: str | None = None
    # Model inputs (edgekit.sources.inputs): shapes as trtexec's --shapes ({input_ids: [1, 128]} or
    # {input_ids: 1x128}), and how images become inputs ({layout: nhwc, order: bgr, scale: 255, mean: [...]}).
    shapes: dict[str, tuple[int, ...] | str] = field(default_factory=dict)
    preprocess: dict[str, Any] | None = field(default=None, metadata={"schema": Preprocess})
    description: str = ""

    def input_options(self) -> InputOptions | None:
        """The stage's ``shapes`` and ``preprocess`` as the options export, build and compress take."""
        return input_options(shapes=self.shapes or None, preprocess=self.preprocess)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["steps"] = [{s.name: s.config} for s in self.steps]
        d["parallel_with"] = list(self.parallel_with)
        return d


@dataclass(frozen=True)
class Recipe:
    """A validated recipe; its fields (and ``target``, an alias of ``targets``) are the
    top-level keys."""

    name: str
    targets: tuple[str, ...]
    stages: tuple[StageSpec, ...]
    budget_ms: float | None = None
    percentile: str = "p99"
    max_jitter: float | None = None
    seed: int = 0
    profile: dict[str, Any] = field(default_factory=dict, metadata={"schema": ProfileConfig})
    frames: str | None = None  # pkg.module:function returning the frames the chained stages are timed on
    description: str = ""
    path: str | None = field(default=None, metadata={"internal": True})

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "targets": list(self.targets), "budget_ms": self.budget_ms,
                "percentile": self.percentile, "max_jitter": self.max_jitter, "seed": self.seed,
                "profile": self.profile, "frames": self.frames, "description": self.description,
                "stages": [s.to_dict() for s in self.stages]}

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise BadInputError(f"no stage {name!r} (stages: {', '.join(s.name for s in self.stages)})")


# Keys only a model stage uses, and only a Python stage uses: on the other kind they would be ignored.
MODEL_ONLY = ("steps", "export", "build", "evaluate", "calib", "train", "shapes", "preprocess")
CALLABLE_ONLY = ("inputs",)


def _positive_ms(loc: Loc, value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise FieldError(loc, f"must be a positive number of milliseconds, got {show(value)}")
    return None if value is None else float(value)


def parse_steps(loc: Loc, raw: object, start: str = "float") -> tuple[StepSpec, ...]:
    """A stage's ``steps:`` list through the registry: each step's options built into its
    config (types and ranges), then the order checked against the steps' declared weight
    states, from ``start`` (the state the stage's model loads in)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise FieldError(loc, f"must be a list like [{{int8: {{method: ptq}}}}], got {show(raw)}")
    steps: list[StepSpec] = []
    chain: list[tuple[str, Any]] = []
    for i, item in enumerate(raw):
        options: Any  # checked by make_config
        if isinstance(item, str):
            name, options = item, {}
        elif isinstance(item, Mapping) and len(item) == 1:
            name, options = next(iter(item.items()))
            options = {} if options is None else options
        else:
            raise FieldError(loc.at(i), f"each step is `name` or `name: {{options}}`, got {show(item)}")
        if isinstance(name, str):  # an old step name ("int4"): the current one, with a warning
            name = canonical_step(name, where=str(loc.at(i)))
        if not isinstance(name, str) or name not in STEPS:
            raise FieldError(loc.at(i), str(bad_choice("step", show(name) if not isinstance(name, str) else name,
                                                        STEPS)))
        config = make_config(name, options, str(Loc(loc.context)))  # options, types and ranges, now
        steps.append(StepSpec(name, dict(options)))
        chain.append((name, config))
    try:
        check_order(chain, start)
    except BadInputError as e:
        raise FieldError(loc, str(e)) from None
    return tuple(steps)


def _model_spec(loc: Loc, model: str, base: Path) -> str:
    """The model spec, with a relative model file resolved against the recipe's folder; a
    file that does not exist and a name that is no zoo model are errors now, not after the
    stages before it ran."""
    if model.endswith(MODEL_FILES) and not Path(model).is_absolute():
        model = str(base / model)
    if ENTRY_POINT.fullmatch(model):
        return model  # imported when the stage runs: importing runs code, which validation must not
    if model.endswith(MODEL_FILES) or "/" in model or os.sep in model or Path(model).exists():
        if not Path(model).exists():
            raise FieldError(loc, f"model file {model!r} does not exist")
        return model
    if model not in ZOO:
        raise FieldError(loc, str(bad_choice("model", model, ZOO)) + "; or give a file, folder or pkg.module:function")
    return model


def _parse_stage(raw: object, index: int, base: Path, targets: list[Any]) -> StageSpec:
    where = Loc(f"stage {index}")
    data = check_keys(StageSpec, raw, where, noun="key")
    name = check_value(data.get("name", f"stage{index}"), str, where / "name")
    if not STAGE_NAME.fullmatch(name):
        raise FieldError(where / "name", f"{name!r} must be letters, digits, '_' or '-' (at most 64), "
                                         "starting with a letter or digit")
    loc = Loc(f"stage {name!r}")
    values = check_entries(StageSpec, data, loc, skip=("name", "steps"))
    model, fn = values.get("model"), values.get("callable")
    if (model is None) == (fn is None):
        raise FieldError(loc, "needs exactly one of 'model' (a model to compress, export, build and profile) "
                              "or 'callable' (a Python stage, pkg.module:function)")
    wrong = [k for k in (CALLABLE_ONLY if model is not None else MODEL_ONLY) if data.get(k) not in (None, {}, [])]
    if wrong:
        kind = "a model stage" if model is not None else "a Python (callable) stage"
        raise FieldError(loc / wrong[0], f"{kind} does not use {wrong[0]!r}"
                         + (" (a model declares its own inputs)" if wrong[0] == "inputs" else
                            " (compression, export, build and evaluation need a model)"))
    if fn is not None and not ENTRY_POINT.fullmatch(fn):
        raise FieldError(loc / "callable", f"must be 'package.module:function', got {fn!r}")
    steps: tuple[StepSpec, ...] = ()
    if model is not None:
        model = _model_spec(loc / "model", model, base)
        steps = parse_steps(loc / "steps", data.get("steps"), initial_state(model))
        precision = values.get("build", {}).get("precision")
        for target in targets if precision is not None else []:
            try:
                target.require_precision(precision)
            except BadInputError as e:
                raise FieldError(loc / "build" / "precision", str(e)) from None
    shapes = values.get("shapes") or {}
    try:
        shapes = {k: list(v) for k, v in parse_shapes(shapes, "shapes").items()}
    except BadInputError as e:
        raise FieldError(loc, str(e)) from None
    parallel = values.get("parallel_with", ())
    return StageSpec(
        name=name, model=model, callable=fn, inputs=values.get("inputs", {}), steps=steps,
        export=values.get("export", {}), build=values.get("build", {}), evaluate=values.get("evaluate"),
        budget_ms=_positive_ms(loc / "budget_ms", values.get("budget_ms")),
        parallel_with=(parallel,) if isinstance(parallel, str) else tuple(parallel),
        feeds=values.get("feeds", {}), calib=values.get("calib"), train=values.get("train"), shapes=shapes,
        preprocess=values.get("preprocess"),
        description=values.get("description", ""))


def parse_recipe(data: object, path: str | None = None) -> Recipe:
    """Validate a recipe (plain data, e.g. from YAML) completely and return it; ``path``
    locates relative target and model files. Raises ``BadInputError`` naming the bad key."""
    top = Loc("recipe")
    raw = check_keys(Recipe, data, top, noun="key", extra=("target",))
    if "target" in raw and "targets" in raw:
        raise FieldError(top, "has both 'target' and 'targets'; use one")
    if isinstance(raw.get("percentile"), int) and not isinstance(raw.get("percentile"), bool):
        raw = {**raw, "percentile": str(raw["percentile"])}  # `percentile: 99`
    values = check_entries(Recipe, raw, top, skip=("stages", "targets"))
    base = Path(path).parent if path else Path.cwd()
    names = check_value(raw.get("targets", raw.get("target", "cpu")), tuple[str, ...],
                        top / ("targets" if "targets" in raw else "target"))
    names = (names,) if isinstance(names, str) else names
    if not names:
        raise FieldError(top / "targets", "names no target")
    resolved, targets = [], []
    for i, t in enumerate(names):
        if t.endswith((".yaml", ".yml")) and not Path(t).is_absolute():
            t = str(base / t)
        try:
            targets.append(load_target(t))  # unknown target -> error listing the known ones
        except BadInputError as e:
            raise FieldError((top / "targets").at(i), str(e)) from None
        resolved.append(t)
    if "name" in values:
        name = values["name"]
    else:  # the file's name, made a safe folder name
        name = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(path).stem if path else "").lstrip(".-_")[:64] or "recipe"
    if not RECIPE_NAME.fullmatch(name):
        raise FieldError(top / "name", f"{name!r} must be letters, digits, '_', '.' or '-' (at most 64), "
                                       "starting with a letter or digit: it names the run folder")
    try:
        percentile = normalize_percentile(values.get("percentile", "p99"))
    except BadInputError as e:
        raise FieldError(top / "percentile", str(e)) from None
    max_jitter = values.get("max_jitter")
    if max_jitter is not None and max_jitter < 1:
        raise FieldError(top / "max_jitter", f"is a p99/p50 ratio and must be >= 1, got {max_jitter}")
    seed = values.get("seed", 0)
    if not 0 <= seed <= MAX_SEED:
        raise FieldError(top / "seed", f"must be 0 to {MAX_SEED}, got {seed}")
    raw_stages = raw.get("stages")
    if not isinstance(raw_stages, list) or not raw_stages:
        raise FieldError(top / "stages", f"must be a non-empty list of stages, got {show(raw_stages)}")
    stages: list[StageSpec] = []
    for i, raw_stage in enumerate(raw_stages):
        stage = _parse_stage(raw_stage, i + 1, base, targets)
        if any(s.name == stage.name for s in stages):
            raise FieldError(Loc(f"stage {stage.name!r}"), "the name is used twice")
        stages.append(stage)
    _check_parallel(stages)
    _check_feeds(stages)
    frames = values.get("frames")
    if frames is not None and not ENTRY_POINT.fullmatch(frames):
        raise FieldError(top / "frames", f"must be 'package.module:function' returning a list of frames, got {frames!r}")
    return Recipe(name=name, targets=tuple(resolved), stages=tuple(stages),
                  budget_ms=_positive_ms(top / "budget_ms", values.get("budget_ms")), percentile=percentile,
                  max_jitter=max_jitter, seed=seed, profile=values.get("profile", {}),
                  frames=frames, description=values.get("description", ""), path=path)


def _check_parallel(stages: list[StageSpec]) -> None:
    """``parallel_with`` is a declaration from a later stage to earlier ones (it starts with
    them instead of after them). A stage declaring a later stage, or two stages declaring
    each other, is a cycle: neither could start first."""
    order = {s.name: i for i, s in enumerate(stages)}
    for s in stages:
        loc = Loc(f"stage {s.name!r}", "parallel_with")
        for other in s.parallel_with:
            if other not in order:
                raise FieldError(loc, f"unknown stage {other!r} (stages: {', '.join(sorted(order))})")
            if other == s.name:
                raise FieldError(loc, "a stage cannot run parallel with itself")
            if order[other] > order[s.name]:
                back = stages[order[other]]
                if s.name in back.parallel_with:
                    raise FieldError(loc, f"cyclic parallel declaration: {s.name!r} <-> {other!r} "
                                          "(declare it on the later stage only)")
                raise FieldError(loc, f"{other!r} comes later; declare parallel_with: [{s.name}] on {other!r} "
                                      "instead (parallel_with names earlier stages)")


def _check_feeds(stages: list[StageSpec]) -> None:
    """``feeds:`` sources name the frame or an earlier stage (outputs are checked when the
    stages are loaded, before any timing)."""
    earlier: list[str] = []
    for s in stages:
        for inp, src in s.feeds.items():
            head = src.partition(".")[0]
            if head != "frame" and head not in earlier:
                raise FieldError(Loc(f"stage {s.name!r}") / "feeds" / inp,
                                 f"{src!r} names no earlier stage (frame.NAME, or one of: "
                                 f"{', '.join(earlier) or 'none: this is the first stage'})")
        earlier.append(s.name)


def validate_recipe(recipe: Recipe) -> Recipe:
    """The same validation for a ``Recipe`` built in code: its plain form parsed again."""
    return parse_recipe(recipe.to_dict(), recipe.path)


def read_recipe_data(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plain data of a recipe file (at most 1 MiB; no aliases, anchors or tags),
    unvalidated: ``parse_recipe`` checks it."""
    data = read_yaml(path, "recipe", RECIPE_MAX_BYTES)
    if not isinstance(data, dict):
        raise BadInputError(f"recipe {str(path)!r} must be a mapping at the top level, got {show(data)}")
    return data


def load_recipe(path: str | os.PathLike[str]) -> Recipe:
    """Read and validate a recipe file: what ``edgekit run --dry-run`` runs, and what a real
    run starts with. Errors name the file and the path of the bad key.

    >>> load_recipe("examples/perception.yaml").stages[1].steps[0].name  # doctest: +SKIP
    'int8'
    """
    data = read_recipe_data(path)
    try:
        return parse_recipe(data, str(path))
    except BadInputError as e:
        raise BadInputError(f"{path}: {e}") from None
