"""Frame-level measurement: frames run through the chained stages as deployed.

Each frame enters the first stage; every stage's real output feeds the next; every stage
is timed inside every frame and so is the frame as a whole. The end-to-end percentiles
are those of the measured frame times, a stage's percentiles come from the same frames,
and a stage's share is its mean time over the mean frame time. Stages declared
``parallel_with`` an earlier stage run concurrently with it (threads), so the frame time
is the critical path as it happened, not a sum.

Binding: a stage takes its ``feeds:`` (``input: frame.NAME | STAGE | STAGE.OUTPUT``)
and, for the inputs it does not list, the outputs of the stage(s) before it: by name
where the names match, otherwise in order. The first stage takes the frame. A stage
parallel with another takes what that stage takes. A model stage's inputs are its
engine's inputs; a Python stage's are its function's required parameters (the first
stage's are its declared ``inputs:``); a Python stage's return value is one output named
``output`` (a tuple: ``output0``, ``output1``, ...).

Before any timing one frame runs through every stage with every hand-over checked: a
count, name, shape or dtype that does not fit is one line naming both stages and the
shapes (``BadInputError``, exit 2).
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError
from edgekit.profiling import LatencyStats, ProfileConfig, repeat_while_noisy
from edgekit.runtimes.base import Engine, check_feeds
from edgekit.schema import read_json
from edgekit.sources.handle import InputSpec

FRAME = "frame"


@dataclass
class FrameStage:
    """One stage as deployed: a callable of named arrays -> list of arrays."""

    name: str
    run: Callable[[dict[str, np.ndarray]], list[np.ndarray]]
    inputs: list[Any]  # InputSpec-like: .name, .shape, .dtype (shape () and dtype "" = unchecked)
    outputs: list[str]
    feeds: dict[str, str] = field(default_factory=dict)
    parallel_with: tuple[str, ...] = ()
    model: bool = False  # a model engine: inputs checked against its declared shapes and dtypes


@dataclass
class FrameMeasurement:
    """What ``measure_frames`` returns (and the run caches as ``frames.json``)."""

    total_ms: list[float]
    stage_ms: dict[str, list[float]]
    start_ms: dict[str, float]  # mean start of each stage inside the frame
    frames: int  # distinct frames cycled through
    attempts: int = 1
    noisy: bool = False
    cv_threshold: float = 0.0
    attempt_cvs: list[float] = field(default_factory=list)

    def total(self) -> LatencyStats:
        return LatencyStats.from_samples(self.total_ms)

    def stage(self, name: str) -> LatencyStats:
        return LatencyStats.from_samples(self.stage_ms[name])

    def share(self, name: str) -> float:
        mean = float(np.mean(self.total_ms))
        return float(np.mean(self.stage_ms[name])) / mean if mean > 0 else 0.0


def load_frames(path: Path) -> FrameMeasurement:
    """A cached frame measurement (``frames.json``)."""
    data = read_json(path, "frame measurement", 256 << 20)
    try:
        return FrameMeasurement(**data)
    except TypeError as e:
        raise BadInputError(f"{path} is not a frame measurement: {e}") from None


def callable_stage(name: str, fn: Callable[..., Any], declared: dict[str, dict[str, Any]] | None = None,
                   feeds: dict[str, str] | None = None, parallel_with: Sequence[str] = ()) -> FrameStage:
    """A Python stage: inputs are ``declared`` (the first stage's ``inputs:``) or the
    function's required parameters."""
    if declared:
        specs = [InputSpec(n, tuple(s.get("shape", ())), str(s.get("dtype", "float32"))) for n, s in declared.items()]
    else:
        params = inspect.signature(fn).parameters.values()
        specs = [InputSpec(p.name, (), "") for p in params
                 if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def run(values: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = fn(**values)
        return [np.asarray(o) for o in out] if isinstance(out, (list, tuple)) else [np.asarray(out)]

    return FrameStage(name=name, run=run, inputs=specs, outputs=["output"], feeds=dict(feeds or {}),
                      parallel_with=tuple(parallel_with))


def engine_stage(name: str, engine: Engine, feeds: dict[str, str] | None = None,
                 parallel_with: Sequence[str] = ()) -> FrameStage:
    """A built engine: inputs and outputs as the engine declares them. The frame runner checks
    every hand-over before timing, so the stage runs without a per-call feed check."""
    return FrameStage(name=name, run=engine.run_unchecked, inputs=list(engine.inputs), outputs=list(engine.outputs),
                      feeds=dict(feeds or {}), parallel_with=tuple(parallel_with), model=True)


def _groups(stages: list[FrameStage]) -> list[list[int]]:
    """Stage indices grouped by start: a stage parallel with another starts in its group."""
    groups: list[list[int]] = []
    where: dict[str, int] = {}
    for i, s in enumerate(stages):
        if s.parallel_with:
            g = where[s.parallel_with[0]]
            if g != len(groups) - 1:
                raise BadInputError(f"stage {s.name!r} is parallel with {s.parallel_with[0]!r}, but stages run "
                                    "between them; frame-level timing starts a parallel stage with the stage it "
                                    "names, so list it right after that stage")
            groups[g].append(i)
        else:
            groups.append([i])
        where[s.name] = len(groups) - 1
    return groups


def _describe(a: np.ndarray) -> str:
    return f"{tuple(a.shape)} {a.dtype}"


class FrameRunner:
    """Binds, checks and runs frames through ``stages``; ``run(frame)`` -> (total ms, stage ms, start ms)."""

    def __init__(self, stages: list[FrameStage]):
        self.stages = stages
        self.groups = _groups(stages)
        self.index = {s.name: i for i, s in enumerate(stages)}
        self.group_of = {i: g for g, members in enumerate(self.groups) for i in members}
        workers = max(len(g) for g in self.groups)
        self.pool = ThreadPoolExecutor(max_workers=workers) if workers > 1 else None
        self.plan: list[dict[str, tuple[str, str]]] | None = None  # per stage: input -> (source, output)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    # ----- binding -----

    def _upstream(self, i: int) -> list[tuple[str, str]]:
        """(stage, output name) pairs that feed stage ``i`` by default."""
        s = self.stages[i]
        if s.parallel_with:
            return self._upstream(self.index[s.parallel_with[0]])
        g = self.group_of[i]
        if g == 0:
            return [(FRAME, "")]
        return [(self.stages[j].name, o) for j in self.groups[g - 1] for o in self.stages[j].outputs]

    def bind(self, frame: dict[str, np.ndarray]) -> None:
        """Work out where each stage's inputs come from (feeds, then upstream by name, then in order)."""
        self.plan = []
        for i in range(len(self.stages)):
            self.plan.append(self._bind_one(i, frame))

    def _bind_one(self, i: int, frame: dict[str, np.ndarray]) -> dict[str, tuple[str, str]]:
        s = self.stages[i]
        names = [spec.name for spec in s.inputs]
        bound: dict[str, tuple[str, str]] = {}
        for inp, src in s.feeds.items():
            if inp not in names:
                raise BadInputError(f"stage {s.name!r} feeds: no input {inp!r} (its inputs: {', '.join(names)})")
            bound[inp] = self._source(s, src, frame)
        rest = [n for n in names if n not in bound]
        up = self._upstream(i)
        if up == [(FRAME, "")]:
            pool = [(FRAME, k) for k in frame]
        else:
            pool = [(st, o) for st, o in up]
        unused = [p for p in pool if p not in bound.values()]
        by_name = {o: (st, o) for st, o in unused}
        if rest and all(n in by_name for n in rest):
            for n in rest:
                bound[n] = by_name[n]
        elif rest:
            if len(rest) != len(unused):
                given = ", ".join(f"{self._label(st, o)}" for st, o in unused) or "nothing"
                raise BadInputError(
                    f"stage {s.name!r} takes {len(rest)} input(s) ({', '.join(rest)}) but "
                    f"{self._from(i)} gives {len(unused)} ({given}): they do not fit; name the sources with "
                    f"feeds: on {s.name!r} (input: frame.NAME, STAGE or STAGE.OUTPUT)")
            for n, p in zip(rest, unused):
                bound[n] = p
        return bound

    def _label(self, stage: str, output: str) -> str:
        return f"frame input {output!r}" if stage == FRAME else f"{stage}.{output}"

    def _from(self, i: int) -> str:
        up = {st for st, _ in self._upstream(i)}
        return "the frame" if up == {FRAME} else "stage " + ", ".join(repr(u) for u in sorted(up))

    def _source(self, s: FrameStage, src: str, frame: dict[str, np.ndarray]) -> tuple[str, str]:
        head, _, tail = src.partition(".")
        if head == FRAME:
            if tail not in frame:
                raise BadInputError(f"stage {s.name!r} feeds: no frame input {tail!r} (frame inputs: "
                                    f"{', '.join(frame)})")
            return FRAME, tail
        if head not in self.index or self.index[head] >= self.index[s.name]:
            earlier = [x.name for x in self.stages[:self.index[s.name]]]
            raise BadInputError(f"stage {s.name!r} feeds: {src!r} names no earlier stage (earlier: "
                                f"{', '.join([FRAME] + earlier)})")
        if self.group_of[self.index[head]] == self.group_of[self.index[s.name]]:
            raise BadInputError(f"stage {s.name!r} feeds: {src!r} runs in parallel with {s.name!r}, so its output "
                                "is not there when it starts; feed it from an earlier stage")
        producer = self.stages[self.index[head]]
        if not tail:
            return head, producer.outputs[0]
        if tail not in producer.outputs:
            raise BadInputError(f"stage {s.name!r} feeds: stage {head!r} has no output {tail!r} (outputs: "
                                f"{', '.join(producer.outputs)})")
        return head, tail

    # ----- running -----

    def _values(self, i: int, frame: dict[str, np.ndarray], outputs: dict[str, dict[str, np.ndarray]]
                ) -> dict[str, np.ndarray]:
        assert self.plan is not None
        return {n: (frame[o] if st == FRAME else outputs[st][o]) for n, (st, o) in self.plan[i].items()}

    def check(self, frame: dict[str, np.ndarray]) -> None:
        """One frame through every stage, each hand-over checked (before any timing)."""
        self.plan = []
        outputs: dict[str, dict[str, np.ndarray]] = {}
        for i, s in enumerate(self.stages):
            self.plan.append(self._bind_one(i, frame))  # outputs of the stages before are known by now
            values = self._values(i, frame, outputs)
            where = {n: self._label(*self.plan[i][n]) for n in values}
            if s.model:
                try:
                    check_feeds(s.inputs, values)
                except BadInputError as e:
                    got = "; ".join(f"{where[n]} {_describe(v)} -> {n}" for n, v in values.items())
                    want = "; ".join(f"{spec.name} {tuple(spec.shape)} {spec.dtype}" for spec in s.inputs)
                    raise BadInputError(f"{self._from(i)} does not fit stage {s.name!r}: {e} (given {got}; "
                                        f"{s.name!r} takes {want})") from None
            try:
                result = s.run(values)
            except (BadInputError, ValueError, TypeError, IndexError, RuntimeError) as e:  # RuntimeError: ORT's
                got = "; ".join(f"{where[n]} {_describe(v)} -> {n}" for n, v in values.items()) or "no inputs"
                raise BadInputError(f"{self._from(i)} does not fit stage {s.name!r} (given {got}): "
                                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            if len(result) != len(s.outputs):
                s.outputs = [f"output{k}" for k in range(len(result))] if not s.model else s.outputs
            outputs[s.name] = dict(zip(s.outputs, result))

    def run(self, frame: dict[str, np.ndarray]) -> tuple[float, dict[str, float], dict[str, float]]:
        outputs: dict[str, dict[str, np.ndarray]] = {}
        times: dict[str, float] = {}
        starts: dict[str, float] = {}
        t_frame = time.perf_counter()
        for group in self.groups:
            if len(group) == 1 or self.pool is None:
                for i in group:
                    self._run_one(i, frame, outputs, times, starts, t_frame)
            else:
                futures = [self.pool.submit(self._run_one, i, frame, outputs, times, starts, t_frame) for i in group]
                for f in futures:
                    f.result()
        total = (time.perf_counter() - t_frame) * 1e3
        return total, times, starts

    def _run_one(self, i: int, frame: dict[str, np.ndarray], outputs: dict[str, dict[str, np.ndarray]],
                 times: dict[str, float], starts: dict[str, float], t_frame: float) -> None:
        s = self.stages[i]
        values = self._values(i, frame, outputs)
        t0 = time.perf_counter()
        result = s.run(values)
        t1 = time.perf_counter()
        outputs[s.name] = dict(zip(s.outputs, result))
        times[s.name] = (t1 - t0) * 1e3
        starts[s.name] = (t0 - t_frame) * 1e3


def measure_frames(stages: list[FrameStage], frames: Sequence[dict[str, np.ndarray]], config: ProfileConfig,
                   progress: Any = None) -> FrameMeasurement:
    """Check the chain on the first frame, then time frames (cycling through ``frames``)
    with the trtexec method: warm-up by time, then at least ``iterations`` frames and
    ``duration_s``; repeated while the frame times' coefficient of variation is above
    ``config.noise_cv`` (at most ``config.max_repeats`` more times), the least noisy attempt kept.

    ``progress``: called with the number of frames timed so far.
    """
    if not frames:
        raise BadInputError("no frames to measure")
    runner = FrameRunner(stages)
    try:
        runner.check(frames[0])  # before any timing: a hand-over that does not fit is exit 2 now
        counter = [0]

        def attempt() -> FrameMeasurement:
            t_end = time.perf_counter() + config.warmup_ms / 1e3
            while time.perf_counter() < t_end:
                runner.run(frames[counter[0] % len(frames)])
                counter[0] += 1
            totals: list[float] = []
            per_stage: dict[str, list[float]] = {s.name: [] for s in stages}
            start_sum: dict[str, float] = {s.name: 0.0 for s in stages}
            t_stop = time.perf_counter() + config.duration_s
            while (len(totals) < config.iterations or time.perf_counter() < t_stop) \
                    and len(totals) < config.max_iterations:
                total, times, starts = runner.run(frames[counter[0] % len(frames)])
                counter[0] += 1
                totals.append(total)
                for name, v in times.items():
                    per_stage[name].append(v)
                    start_sum[name] += starts[name]
                if progress is not None:
                    progress(len(totals))
            n = len(totals)
            return FrameMeasurement(total_ms=totals, stage_ms=per_stage,
                                    start_ms={k: v / n for k, v in start_sum.items()}, frames=len(frames))

        best, cvs = repeat_while_noisy(attempt, lambda m: m.total().cv, config)
    finally:
        runner.close()
    best.attempts, best.attempt_cvs = len(cvs), cvs
    best.cv_threshold = config.noise_cv
    best.noisy = best.total().cv > config.noise_cv
    return best


def to_frames(raw: Any, first_inputs: list[str], where: str) -> list[dict[str, np.ndarray]]:
    """What a ``frames:`` function returned -> a list of frames (name -> array): a list of
    arrays (one input) or of mappings."""
    if isinstance(raw, np.ndarray):
        raw = list(raw)
    if not isinstance(raw, (list, tuple)) or not raw:
        raise BadInputError(f"{where} must return a non-empty list of frames, got {type(raw).__name__}")
    frames = []
    for k, item in enumerate(raw[:10_000]):
        if isinstance(item, dict):
            frames.append({str(n): np.asarray(v) for n, v in item.items()})
        elif len(first_inputs) == 1:
            frames.append({first_inputs[0]: np.asarray(item)})
        else:
            raise BadInputError(f"{where}: frame {k} is one array but the first stage takes "
                                f"{len(first_inputs)} inputs ({', '.join(first_inputs)}); return mappings")
    return frames
