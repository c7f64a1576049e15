"""What ``edgekit profile`` is asked, whose fields declare its flags (``edgekit.options``):
``ProfileConfig`` (how latency is timed), ``GenerationConfig`` (which generation metrics of a
causal LM, and how long) and ``ProfileOptions`` (whether generation is measured; the trtexec
exports read in place of an engine, as ``profiling.profile_exports`` takes them). Light (no
PyTorch or ONNX): the command line reads it to build its options; ``profiling`` and
``profiling_lm`` re-export the configs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from edgekit.errors import BadInputError
from edgekit.limits import MAX_DIM
from edgekit.options import option
from edgekit.schema import check_fields

TRTEXEC_USAGE = "--trtexec DIR --onnx MODEL.onnx --target TARGET"

MAX_WARMUP_MS = 600_000.0  # 10 minutes
MAX_DURATION_S = 3600.0
MAX_ITERATIONS = 10_000_000
# Above this coefficient of variation a measurement is repeated (at most max_repeats more
# times) and, if every attempt stays above it, reported as noisy: a budget verdict says so.
NOISE_CV = 0.10
MAX_REPEATS = 5


@dataclass(frozen=True)
class ProfileConfig:
    warmup_ms: float = field(default=200.0, metadata=option("--warmup-ms", help="Untimed runs first, for this long."))
    duration_s: float = field(default=3.0, metadata=option(
        "--duration-s", help="Time inferences for at least this long."))
    iterations: int = field(default=100, metadata=option("--iterations", help="Minimum timed inferences."))
    max_iterations: int = 100_000
    threads: int | None = field(default=None, metadata=option("--threads", help="Intra-op threads (default: all "
                                                                                  "cores)."))
    batch: int = field(default=1, metadata=option("--batch", basic=True, bounds=(1, MAX_DIM),
                                                         help="Batch of the timed inputs."))
    node_profile: bool = field(default=True, metadata=option(
        "--nodes/--no-nodes", help="Also time each node (a second, profiled run)."))
    node_iterations: int = 20
    top_k: int = field(default=15, metadata=option("--top-k", help="Nodes in the table."))
    noise_cv: float = NOISE_CV  # coefficient of variation above which a measurement is repeated, then noisy
    max_repeats: int = 2  # further attempts when noisy

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if not (0 < self.noise_cv <= 10 and math.isfinite(self.noise_cv)):
            raise BadInputError(f"noise_cv is a coefficient of variation, 0 < noise_cv <= 10, got {self.noise_cv}")
        if not 0 <= self.max_repeats <= MAX_REPEATS:
            raise BadInputError(f"max_repeats must be 0 to {MAX_REPEATS}, got {self.max_repeats}")
        # Upper bounds: a profile that would time for days is a typo (or a hostile recipe).
        if not (0 <= self.warmup_ms <= MAX_WARMUP_MS and math.isfinite(self.warmup_ms)):
            raise BadInputError(f"warm-up must be 0 to {MAX_WARMUP_MS:g} ms, got {self.warmup_ms}")
        if not (0 <= self.duration_s <= MAX_DURATION_S and math.isfinite(self.duration_s)):
            raise BadInputError(f"duration must be 0 to {MAX_DURATION_S:g} s, got {self.duration_s}")
        if not 1 <= self.max_iterations <= MAX_ITERATIONS:
            raise BadInputError(f"max_iterations must be 1 to {MAX_ITERATIONS}, got {self.max_iterations}")
        if self.iterations < 1:
            raise BadInputError(f"iterations must be >= 1, got {self.iterations}")
        if self.iterations > self.max_iterations:
            raise BadInputError(f"iterations ({self.iterations}) exceeds max_iterations ({self.max_iterations})")
        if self.node_iterations < 1:
            raise BadInputError(f"node_iterations must be >= 1, got {self.node_iterations}")
        if self.top_k < 0:
            raise BadInputError(f"top_k must be >= 0 (0: every node), got {self.top_k}")
        if self.threads is not None and not 1 <= self.threads <= 4096:
            raise BadInputError(f"threads must be >= 1, got {self.threads}" if self.threads < 1 else
                                f"threads must be at most 4096, got {self.threads}")
        if not 1 <= self.batch <= MAX_DIM:
            raise BadInputError(f"batch must be 1 to {MAX_DIM}, got {self.batch}")


DEFAULT_PROMPT_LENGTHS = (128, 512)
DEFAULT_CONTEXTS = (128, 1024)
DEFAULT_NEW_TOKENS = 128


@dataclass(frozen=True)
class GenerationConfig:
    """Which generation metrics to measure, and how long.

    ``prompt_lengths``, ``contexts``, ``new_tokens``: None takes the defaults (prompts of 128 and 512
    tokens, 128 new tokens after contexts of 128 and 1024), cut to the context the model declares
    (``within_context``); lengths given explicitly must fit in it.
    """

    prompt_lengths: tuple[int, ...] | None = field(default=None, metadata=option(
        "--prompt-lengths", sep=",", metavar="N,...", help="Causal LMs: prompt lengths whose prefill (time to first "
        "token) is timed (default 128,512, cut to the context the model declares; longer ones are refused)."))
    contexts: tuple[int, ...] | None = field(default=None, metadata=option(
        "--contexts", sep=",", metavar="N,...", help="Causal LMs: context lengths after which decode tokens/s is "
        "measured (default 128,1024, cut to leave room for the new tokens within the model's context)."))
    new_tokens: int | None = field(default=None, metadata=option(
        "--new-tokens", help="Causal LMs: tokens generated per run (default 128, at most a quarter of the model's "
        "context)."))
    # the same flags as a profile's (ProfileConfig above), which carries their help
    warmup_ms: float = field(default=200.0, metadata=option("--warmup-ms"))
    duration_s: float = field(default=3.0, metadata=option("--duration-s"))
    iterations: int = 5  # minimum timed prefills per prompt length
    decode_runs: int = 2  # minimum timed generations per context
    threads: int | None = field(default=None, metadata=option("--threads"))
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_lengths", "contexts"):
            values = getattr(self, name)
            if values is not None and (not values or any(not isinstance(v, int) or v < 1 for v in values)):
                raise BadInputError(f"{name.replace('_', ' ')} must be whole numbers >= 1, got {values!r}")
            if values is not None and max(values) > MAX_DIM:  # tokens, like any dimension: beyond it a typo
                raise BadInputError(f"{name.replace('_', ' ')} must be at most {MAX_DIM} tokens, got {max(values)}")
        if self.new_tokens is not None and not 1 <= self.new_tokens <= MAX_DIM:
            raise BadInputError(f"new tokens must be >= 1, got {self.new_tokens}" if self.new_tokens < 1 else
                                f"new tokens must be at most {MAX_DIM}, got {self.new_tokens}")
        if not (self.warmup_ms >= 0 and math.isfinite(self.warmup_ms)):
            raise BadInputError(f"warm-up must be >= 0 ms, got {self.warmup_ms}")
        if not (self.duration_s >= 0 and math.isfinite(self.duration_s)):
            raise BadInputError(f"duration must be >= 0 s, got {self.duration_s}")
        if self.iterations < 1 or self.decode_runs < 1:
            raise BadInputError(f"iterations and decode runs must be >= 1, got {self.iterations} and {self.decode_runs}")
        if self.threads is not None and self.threads < 1:
            raise BadInputError(f"threads must be >= 1, got {self.threads}")

    @property
    def max_length(self) -> int:
        """The longest sequence the measurement runs (prompt, or context plus new tokens)."""
        prompts = self.prompt_lengths or DEFAULT_PROMPT_LENGTHS
        return max(max(prompts), max(self.contexts or DEFAULT_CONTEXTS) + (self.new_tokens or DEFAULT_NEW_TOKENS))

    def within_context(self, tokens: int | None, model: str = "the model") -> tuple[GenerationConfig, list[str]]:
        """This config with every length set, fitting a model that declares ``tokens`` positions (None:
        unknown, the defaults as they are), and what was cut. Defaults are cut to the context with a
        warning (new tokens to a quarter of it, prompts to it, contexts to what leaves room for the new
        tokens); a length given explicitly beyond it is ``BadInputError``: timings of positions the model
        was never defined for describe no use of it."""
        new = self.new_tokens or DEFAULT_NEW_TOKENS
        prompts = self.prompt_lengths or DEFAULT_PROMPT_LENGTHS
        contexts = self.contexts or DEFAULT_CONTEXTS
        warnings: list[str] = []
        if tokens is not None:
            declared = f"the {tokens} positions {model} declares"
            if self.new_tokens is None:
                new = min(new, max(1, tokens // 4))
            if self.prompt_lengths is not None and max(prompts) > tokens:
                raise BadInputError(f"--prompt-lengths {_csv(prompts)} exceeds {declared}; choose prompt lengths "
                                    f"up to {tokens}")
            room = tokens - new
            if room < 1:
                raise BadInputError(f"--new-tokens {new} leaves no context within {declared}; choose fewer than "
                                    f"{tokens}")
            if self.contexts is not None and max(contexts) > room:
                raise BadInputError(f"--contexts {_csv(contexts)} with {new} new tokens runs {max(contexts) + new} "
                                    f"tokens, beyond {declared}; choose contexts up to {room} (or fewer new tokens)")
            fitted = (tuple(sorted({min(p, tokens) for p in prompts})), tuple(sorted({min(c, room) for c in contexts})))
            if (fitted[0], fitted[1], new) != (prompts, contexts, self.new_tokens or DEFAULT_NEW_TOKENS):
                warnings.append(f"the default lengths are cut to {declared}: prompts {_csv(fitted[0])}, contexts "
                                f"{_csv(fitted[1])}, {new} new tokens")
            prompts, contexts = fitted
        resolved = GenerationConfig(**{**asdict(self), "prompt_lengths": prompts, "contexts": contexts,
                                       "new_tokens": new})
        return resolved, warnings


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)



@dataclass(frozen=True)
class ProfileOptions:
    """generation: causal LMs: also measure generation (time to first token, decode tokens/s).
    trtexec / onnx / target: a folder of trtexec exports made by hand, the ONNX file its engine was
    built from and the target the results claim; given together, they are read instead of timing
    an engine here."""

    generation: bool = field(default=True, metadata=option(
        "--generation/--no-generation",
        help="Causal LMs: also measure generation (time to first token, decode tokens/s)."))
    trtexec: str | None = field(default=None, metadata=option(
        "--trtexec", metavar="DIR",
        help="A folder of trtexec exports made by hand (--exportTimes, --exportProfile, --exportLayerInfo, log; any "
             "names): read as a device profile, checked against --onnx and --target."))
    onnx: str | None = field(default=None, metadata=option(
        "--onnx", metavar="MODEL.onnx", help="With --trtexec: the ONNX file the engine was built from."))
    target: str | None = field(default=None, metadata=option(
        "--target", help="With --trtexec: the target the results claim (name or YAML file)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.target is not None and self.trtexec is None and self.onnx is None:
            raise BadInputError("--target applies with --trtexec (an engine folder records its target)")
        given = {"--trtexec": self.trtexec, "--onnx": self.onnx, "--target": self.target}
        missing = [flag for flag, v in given.items() if v is None]
        if 0 < len(missing) < len(given):
            raise BadInputError(f"trtexec exports are read with {TRTEXEC_USAGE} (missing {', '.join(missing)})")

    @property
    def reads_exports(self) -> bool:
        """True when the profile is read from trtexec exports instead of timed here."""
        return self.trtexec is not None
