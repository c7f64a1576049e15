"""Generation metrics of causal-LM engines: time to first token, decode tokens/s, peak memory.

A causal LM exported with its KV cache is timed the way it is used: a prefill of the prompt
(time to first token, at each of ``prompt_lengths``), then one-token decode steps through the
IO-bound KV-cache loop (the engine's ``token_decoder``: in place where the graph allows it) for
``new_tokens`` tokens after a context of each of ``contexts`` tokens. The percentile method is
``profiling.py``'s: warm-up by time, then at least ``iterations`` (prefills) or ``decode_runs``
(generations) and at least ``duration_s``; min/mean/p50/p90/p95/p99/max, std and the coefficient
of variation, on wall time and, beside it, on this process's CPU time (the figure to trust on a
shared machine, where wall time includes waiting for a core).

``profile_with_generation`` is ``profile_engine`` plus these metrics under the profile JSON's
``generation`` key; ``check_generation`` gates them (``edgekit check --min-tokens-per-s``,
``--max-ttft-ms``).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import check_output_file, read_manifest
from edgekit.build import load_engine
from edgekit.check import load_profile
from edgekit.errors import BadInputError
from edgekit.profiling import (
    CV_WARNING,
    LatencyStats,
    ProfileConfig,
    ProfileResult,
    normalize_percentile,
    peak_rss_mb,
    profile_engine,
)
from edgekit.profiling_options import DEFAULT_CONTEXTS as DEFAULT_CONTEXTS
from edgekit.profiling_options import DEFAULT_NEW_TOKENS as DEFAULT_NEW_TOKENS
from edgekit.profiling_options import DEFAULT_PROMPT_LENGTHS as DEFAULT_PROMPT_LENGTHS
from edgekit.profiling_options import GenerationConfig as GenerationConfig
from edgekit.runtimes.base import TokenDecoder
from edgekit.sources.inputs import InputOptions
from edgekit.sources.models import DEFAULT_PAST

GENERATION_METHOD = ("prefill: warm-up by time, then >= iterations and >= duration; decode: greedy generations "
                     "of new_tokens one-token steps through the IO-bound KV cache after a context, >= decode_runs "
                     "and >= duration, every step a sample; wall and process CPU time")


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def _stats(wall: list[float], cpu: list[float]) -> dict[str, Any]:
    return {"wall_ms": asdict(LatencyStats.from_samples(wall)), "cpu_ms": asdict(LatencyStats.from_samples(cpu))}


def measure_generation(decoder: TokenDecoder, config: GenerationConfig) -> dict[str, Any]:
    """Time to first token and decode throughput of an engine's ``TokenDecoder`` (see the module doc)."""
    config, _ = config.within_context(None)  # every length set (defaults where None)
    prompt_lengths = config.prompt_lengths or DEFAULT_PROMPT_LENGTHS
    contexts = config.contexts or DEFAULT_CONTEXTS
    new_tokens = config.new_tokens or DEFAULT_NEW_TOKENS
    rng = np.random.default_rng(config.seed)
    vocab = decoder.vocab_size
    batch = decoder.batch
    warnings: list[str] = []

    def prompt(n: int) -> np.ndarray:
        return rng.integers(0, vocab, size=(batch, n)).astype(np.int64)

    ttft: dict[str, Any] = {}
    for n in prompt_lengths:
        ids = prompt(n)

        def prefill(ids: np.ndarray = ids) -> None:
            decoder.reset()
            decoder.forward(ids)

        t_end = time.perf_counter() + config.warmup_ms / 1e3
        prefill()
        while time.perf_counter() < t_end:
            prefill()
        wall: list[float] = []
        cpu: list[float] = []
        t_stop = time.perf_counter() + config.duration_s
        while len(wall) < config.iterations or time.perf_counter() < t_stop:
            w, c = _timed(prefill)
            wall.append(w)
            cpu.append(c)
        ttft[str(n)] = _stats(wall, cpu)

    decode: dict[str, Any] = {}
    for ctx in contexts:
        ids = prompt(ctx)
        step_wall: list[float] = []
        step_cpu: list[float] = []
        runs: list[dict[str, float]] = []
        t_end = time.perf_counter() + config.warmup_ms / 1e3
        warm = True
        t_stop = math.inf
        while warm or len(runs) < config.decode_runs or time.perf_counter() < t_stop:
            decoder.reset()
            token = decoder.forward(ids)[:, -1].argmax(-1)[:, None].astype(np.int64)
            run_wall: list[float] = []
            run_cpu: list[float] = []
            for _ in range(new_tokens):
                c0, t0 = time.process_time(), time.perf_counter()
                token = decoder.forward(token)[:, -1].argmax(-1)[:, None].astype(np.int64)
                run_wall.append((time.perf_counter() - t0) * 1e3)
                run_cpu.append((time.process_time() - c0) * 1e3)
            if warm:  # the first generation warms the caches; keep going until the warm-up time is over
                warm = time.perf_counter() < t_end
                if not warm:
                    t_stop = time.perf_counter() + config.duration_s
                continue
            step_wall += run_wall
            step_cpu += run_cpu
            runs.append({"tokens_per_s": 1e3 * new_tokens * batch / sum(run_wall),
                         "cpu_tokens_per_s": 1e3 * new_tokens * batch / max(sum(run_cpu), 1e-9)})
        stats = _stats(step_wall, step_cpu)
        if stats["wall_ms"]["cv"] > CV_WARNING:
            warnings.append(f"decode at context {ctx}: coefficient of variation {stats['wall_ms']['cv']:.1%} exceeds "
                            f"{CV_WARNING:.1%}: the machine may be busy or clocks unstable")
        decode[str(ctx)] = {
            "step": stats, "new_tokens": new_tokens, "runs": len(runs),
            "tokens_per_s": float(np.median([r["tokens_per_s"] for r in runs])),
            "cpu_tokens_per_s": float(np.median([r["cpu_tokens_per_s"] for r in runs])),
            "tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in runs],
        }
    kv_bytes = decoder.kv_cache_bytes(config.max_length) if decoder.shared else None
    return {"method": GENERATION_METHOD, "settings": asdict(config), "batch": batch,
            "kv_cache": "in place (shared buffer)" if decoder.shared else "bound presents (copied by the graph)",
            "kv_cache_mb": round(kv_bytes / 2**20, 2) if kv_bytes is not None else None,
            "time_to_first_token_ms": ttft, "decode": decode, "peak_memory_mb": peak_rss_mb(), "warnings": warnings}


def declared_tokens(engine_dir: str | os.PathLike[str]) -> int | None:
    """The context a causal-LM engine's model declares (recorded at export: ``model.context.tokens``,
    ``max_position_embeddings`` or what rotary scaling extends it to); None where not recorded."""
    context = read_manifest(Path(engine_dir)).model.get("context") or {}
    tokens = context.get("tokens") if isinstance(context, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else None


def profile_generation(engine_dir: str | os.PathLike[str], config: GenerationConfig | None = None) -> dict[str, Any]:
    """Generation metrics of a causal-LM engine folder (exported with the KV cache, on a runtime
    whose engines decode through it: ``Engine.token_decoder``), at lengths within the context its
    model declares (``GenerationConfig.within_context``)."""
    config, warnings = (config or GenerationConfig()).within_context(declared_tokens(engine_dir),
                                                                     f"{Path(engine_dir).name}'s model")
    engine = load_engine(engine_dir, threads=config.threads)
    try:
        decoder = engine.token_decoder(config.max_length)
        if decoder is None:
            raise BadInputError(f"{engine_dir} is not an ONNX Runtime engine of a causal LM exported with its KV "
                                "cache (export with `edgekit export MODEL --kv-cache`)")
        result = measure_generation(decoder, config)
    finally:
        engine.close()
    result["warnings"] = warnings + result["warnings"]
    return result


def is_causal_lm_engine(engine_dir: str | os.PathLike[str]) -> bool:
    """Whether an engine folder holds a causal LM with the KV cache (from its recorded inputs)."""
    manifest = read_manifest(Path(engine_dir))
    return bool(manifest.model.get("kv_cache")) or any(
        str(i.get("name", "")).startswith("past_key_values.") for i in manifest.model.get("inputs", []) or [])


def _reads_as_lm_engine(engine_dir: str | os.PathLike[str]) -> bool:
    """``is_causal_lm_engine`` of a folder with its own manifest; False for any other folder (a device's
    results, a bundle, trtexec exports), which ``profile_engine`` reads or refuses with its own message."""
    try:
        return is_causal_lm_engine(engine_dir)
    except BadInputError:
        return False


def profile_with_generation(engine_dir: str | os.PathLike[str], config: ProfileConfig | None = None,
                            generation: GenerationConfig | None = None,
                            out_json: str | os.PathLike[str] | None = None,
                            input_options: InputOptions | None = None) -> ProfileResult:
    """``profile_engine``, plus generation metrics (``result.generation``) for a causal-LM engine
    unless ``generation`` is None. The decode-step latency of ``profile_engine`` stays in
    ``latency_ms`` (one token after a 128-token past), so existing budgets keep their meaning.

    >>> r = profile_with_generation("out/engine", generation=GenerationConfig())  # doctest: +SKIP
    >>> r.generation["decode"]["128"]["tokens_per_s"]  # doctest: +SKIP
    """
    if out_json is not None:
        check_output_file(out_json, (engine_dir,))  # before the measurement
    lm = generation is not None and _reads_as_lm_engine(engine_dir)
    if generation is not None and lm:  # lengths beyond the model's context: refused before any timing
        generation.within_context(declared_tokens(engine_dir), f"{Path(engine_dir).name}'s model")
    result = profile_engine(engine_dir, config, out_json=None, input_options=input_options)
    # Generation is timed here, on engines this machine runs; a device's recorded run is summarized as it is.
    if generation is not None and result.source == "measured" and lm:
        threads = generation.threads if generation.threads is not None else (config.threads if config else None)
        gen = GenerationConfig(**{**asdict(generation), "threads": threads})
        result.generation = profile_generation(engine_dir, gen)
        tokens = declared_tokens(engine_dir)
        if tokens is not None and tokens <= DEFAULT_PAST:  # the engine's stored decode-step inputs
            result.warnings.append(f"latency_ms times a decode step after a {DEFAULT_PAST}-token past, beyond the "
                                   f"{tokens} positions the model declares")
        result.warnings.extend(result.generation["warnings"])
        result.peak_memory_mb = max(filter(None, [result.peak_memory_mb, result.generation["peak_memory_mb"]]),
                                    default=None)
    if out_json is not None:
        result.save(out_json, protect=(engine_dir,))
    return result


@dataclass(frozen=True)
class GenerationVerdict:
    """The generation gate: decode tokens/s (worst context) and time to first token (worst prompt)."""

    passed: bool
    tokens_per_s: float | None
    min_tokens_per_s: float | None
    context: str | None
    ttft_ms: float | None
    max_ttft_ms: float | None
    prompt_length: str | None
    percentile: str

    def message(self) -> str:
        parts = []
        if self.min_tokens_per_s is not None and self.tokens_per_s is not None:
            ok = self.tokens_per_s >= self.min_tokens_per_s
            parts.append(f"{'PASS' if ok else 'FAIL'}: decode {self.tokens_per_s:.1f} tokens/s at context {self.context} "
                         f"vs minimum {self.min_tokens_per_s:g} tokens/s")
        if self.max_ttft_ms is not None and self.ttft_ms is not None:
            ok = self.ttft_ms <= self.max_ttft_ms
            parts.append(f"{'PASS' if ok else 'FAIL'}: time to first token {self.percentile} {self.ttft_ms:.1f} ms "
                         f"at {self.prompt_length} prompt tokens vs budget {self.max_ttft_ms:g} ms")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_generation(profile: str | os.PathLike[str] | ProfileResult, min_tokens_per_s: float | None = None,
                     max_ttft_ms: float | None = None, percentile: str = "p50") -> GenerationVerdict:
    """Gate a causal-LM profile: decode tokens/s (median run, worst context) >= ``min_tokens_per_s``
    and time to first token (``percentile`` of wall time, longest prompt) <= ``max_ttft_ms``.

    >>> check_generation("out/profile.json", min_tokens_per_s=50).passed  # doctest: +SKIP
    True
    """
    for name, value in (("minimum tokens/s", min_tokens_per_s), ("time-to-first-token budget", max_ttft_ms)):
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise BadInputError(f"{name} must be a positive number, got {value!r}")
    if min_tokens_per_s is None and max_ttft_ms is None:
        raise BadInputError("give --min-tokens-per-s or --max-ttft-ms (or --budget-ms for the decode step)")
    key = normalize_percentile(percentile)
    folder = None if isinstance(profile, ProfileResult) else Path(profile)
    if folder is not None and folder.is_dir() and not (folder / "profile.json").is_file():  # an engine: profile it now
        result = profile_with_generation(folder, generation=GenerationConfig())
    else:
        result = load_profile(profile)
    gen = result.generation
    if not gen:
        raise BadInputError("the profile has no generation metrics (profile a causal-LM engine exported with "
                            "--kv-cache, without --no-generation)")
    tps, ctx, ttft, plen = None, None, None, None
    passed = True
    if min_tokens_per_s is not None:
        ctx, rec = min(gen["decode"].items(), key=lambda kv: kv[1]["tokens_per_s"])
        tps = float(rec["tokens_per_s"])
        passed &= tps >= min_tokens_per_s
    if max_ttft_ms is not None:
        plen, rec = max(gen["time_to_first_token_ms"].items(), key=lambda kv: int(kv[0]))
        ttft = float(rec["wall_ms"][key])
        passed &= ttft <= max_ttft_ms
    return GenerationVerdict(passed=bool(passed), tokens_per_s=tps, min_tokens_per_s=min_tokens_per_s, context=ctx,
                             ttft_ms=ttft, max_ttft_ms=max_ttft_ms, prompt_length=plen, percentile=key)


__all__ = ["GenerationConfig", "GenerationVerdict", "check_generation", "declared_tokens", "measure_generation",
           "profile_generation", "profile_with_generation", "is_causal_lm_engine"]
