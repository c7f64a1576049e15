"""Turn ``edgekit compress`` flags into the ordered step chain.

The flags are the step configs' own (``edgekit.compress.options``): each sets its field in
every step of the chain that has it, and ``selects`` flags (``--prune RATIO``) put their step
in the chain. The plan adds the two choices no single step owns: ``--bits``/``--method``
pick INT8 (ptq, qat: weights and activations) or weight-only quantization (gptq-plus, gptq, awq,
awq-gptq, rtn), and ``--distill`` recovers a pruned model from its unpruned self. Steps run
in registry order (prune -> distill -> quantize). Only options the user set are passed on,
so each step's config keeps its own defaults.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from edgekit.compress import (
    DISTILL_STEP,
    INT8_STEP,
    PRUNE_STEP,
    QUANTIZING_STEPS,
    STEPS,
    WEIGHT_ONLY_STEP,
    StepContext,
    compress,
    default_bounds,
    make_config,
)
from edgekit.compress.int8.config import QAT_METHODS
from edgekit.compress.options import compress_options, step_values
from edgekit.compress.quality import QualityBounds
from edgekit.compress.weight_only.config import METHODS as WEIGHT_ONLY_METHODS
from edgekit.errors import BadInputError
from edgekit.export.config import SUPPORTED_BITS
from edgekit.sources.handle import ModelHandle
from edgekit.sources.inputs import InputOptions
from edgekit.targets import load_target

# the steps the plan's own choices name: the quantizers --bits/--method pick from, and --distill's
INT8, WEIGHT_ONLY, DISTILL, PRUNE = INT8_STEP, WEIGHT_ONLY_STEP, DISTILL_STEP, PRUNE_STEP


def plan_steps(**flags: Any) -> list[tuple[str, dict[str, Any]]]:
    """The chain for the compress flags, by their names (``group_size``, ``keep_float``, ...;
    None or ``()``: not given), and ``distill``.

    >>> plan_steps(bits=4, group_size=64)
    [('weight-only', {'method': 'gptq-plus', 'bits': 4, 'group_size': 64})]
    >>> plan_steps(prune=0.3, distill=True, epochs=2)
    [('prune', {'ratio': 0.3}), ('distill', {'epochs': 2})]
    """
    options = compress_options()
    known = {o.dest for o in options}
    unknown = sorted(set(flags) - known - {"distill"})
    if unknown:
        raise TypeError(f"plan_steps() got unknown flags {unknown} (known: {sorted(known | {'distill'})})")
    chosen: dict[str, dict[str, Any]] = {}
    for o in options:
        if flags.get(o.dest) is not None:
            for name, _, flag in o.fields:
                if flag.selects:
                    chosen[name] = {}
    if flags.get("distill"):
        if PRUNE not in chosen:
            raise BadInputError("--distill recovers a pruned model: give --prune RATIO too "
                                "(or use `edgekit distill --teacher T --student S`)")
        chosen[DISTILL] = {}
    quantizer = quantize_step(flags.get("bits"), flags.get("method"))
    if quantizer is not None:
        chosen[quantizer[0]] = quantizer[1]
    return [(name, step_values(options, flags, name, chosen[name])) for name in STEPS if name in chosen]


QUANTIZE_STEPS = QUANTIZING_STEPS  # the steps --bits chooses between


def quantize_step(bits: int | None, method: str | None) -> tuple[str, dict[str, Any]] | None:
    """The quantize step for --bits/--method, with the method (and bit width) it runs.

    >>> quantize_step(4, None)
    ('weight-only', {'method': 'gptq-plus', 'bits': 4})
    """
    choices = ", ".join(map(str, SUPPORTED_BITS))
    if bits is None:
        if method is not None:
            raise BadInputError(f"--method {method} needs --bits (choose from {choices})")
        return None
    if bits not in SUPPORTED_BITS:
        raise BadInputError(f"unsupported bit width {bits} (choose from {choices})")
    if method is None:
        method = QAT_METHODS[0] if bits == 8 else WEIGHT_ONLY_METHODS[0]
    if method in QAT_METHODS:
        if bits != 8:
            raise BadInputError(f"--method {method} quantizes weights and activations to 8 bits; got --bits {bits} "
                                f"(use --method {'|'.join(WEIGHT_ONLY_METHODS)} for {bits}-bit weights)")
        return INT8, {"method": method}
    if method in WEIGHT_ONLY_METHODS:
        return WEIGHT_ONLY, {"method": method, "bits": bits}
    raise BadInputError(f"unknown method {method!r} (choose from {', '.join(QAT_METHODS + WEIGHT_ONLY_METHODS)})")


def compress_from_flags(model: str, out: str | os.PathLike[str], flags: Mapping[str, Any], *, distill: bool = False,
                        calib: str | None = None, train: str | None = None, target: str | None = None, seed: int = 0,
                        inputs: InputOptions | None = None, accept_quality_loss: bool = False,
                        max_ppl_ratio: float | None = None,
                        latency: Callable[[ModelHandle, Any], Mapping[str, Any]] | None = None) -> Path:
    """``edgekit compress``: plan the chain from the step flags, then ``compress`` it.
    ``max_ppl_ratio`` replaces the perplexity bound of the chain's quality gate; ``latency``
    times an engine for steps that report their latency effect (``StepContext.latency``)."""
    steps = plan_steps(**flags, distill=distill)
    if not steps:
        chooser = ["--bits"] + [o.decls[0] for o in compress_options() if any(f.selects for _, _, f in o.fields)]
        raise BadInputError(f"no compression step given (use {', '.join(chooser)} or a recipe)")
    bounds = None
    if max_ppl_ratio is not None:
        base = default_bounds([(n, make_config(n, c)) for n, c in steps]) or QualityBounds()
        bounds = dataclasses.replace(base, max_ppl_ratio=max_ppl_ratio)
    ctx = StepContext(target=load_target(target) if target else None, calib=calib, train=train, seed=seed,
                      device=flags.get("device") or "cpu", inputs=inputs, accept_quality_loss=accept_quality_loss,
                      quality_bounds=bounds, latency=latency)
    return compress(model, steps, out, ctx)
