"""Rotary position embeddings as transformers computes them, for the causal-LM exporters.

transformers' rotary types (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``) are of two kinds:

* fixed (``default``, ``linear``, ``yarn``, ``llama3``): ``inv_freq`` and the attention scaling are
  computed once, from the config; every position gets its rotation from the same table;
* chosen by position (``dynamic``, ``longrope``): before each forward, transformers' ``dynamic_rope_update``
  looks at ``max(position_ids) + 1`` (the sequence length) and picks ``inv_freq`` in Python: dynamic NTK
  grows the rotary base once the sequence is longer than ``max_position_embeddings``, longrope
  switches from its short to its long factors past ``original_max_position_embeddings``.

A trace records the branch its example input took, so a graph traced from a short input rotates every
position as the short context does: right up to the threshold, silently wrong beyond it.
``traceable_rope(model)`` replaces the Python branch by tensor operations for the time of a trace
(``torch.where`` on the sequence length for longrope, the NTK base as a function of it for dynamic), so
the traced graph follows the branch at run time; ``lm_graph`` writes the same in ONNX operators. Both
compute what transformers computes for a generation from an empty cache: the keys keep the rotation they
were cached with, the new tokens get the one their position selects.

``rope_spec(config)`` describes a config's rotary: its type, the positions where its rotation changes
(``threshold``), the context it was pretrained for (``original``) and the longest context the config
declares (``context``, what ``profile`` and the fused graph's rotary tables cover). A type edgekit does
not know is refused with the reason, never exported with a guessed rotation.

>>> spec = rope_spec(config)  # doctest: +SKIP
>>> spec.rope_type, spec.threshold, spec.context  # doctest: +SKIP
('longrope', 4096, 131072)
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from edgekit.errors import BadInputError

FIXED_TYPES = ("default", "linear", "yarn", "llama3")
POSITION_TYPES = ("dynamic", "longrope")  # the rotation depends on the positions of each forward
ROPE_TYPES = FIXED_TYPES + POSITION_TYPES


@dataclass(frozen=True)
class RopeSpec:
    """A rotary embedding's type and the positions that matter to it.

    ``threshold``: the sequence length beyond which a position-dependent rotation changes (dynamic:
    ``max_position_embeddings``; longrope: ``original_max_position_embeddings``); None for fixed types.
    ``original``: the context the model was pretrained for (the config's
    ``original_max_position_embeddings`` where it declares one, else ``max_position_embeddings``).
    ``context``: the longest context the config declares: ``max_position_embeddings``, or ``factor``
    times the original context where the scaling declares a factor and that is longer.
    """

    rope_type: str
    threshold: int | None
    original: int
    context: int

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise BadInputError(f"rope type {self.rope_type!r} is not one edgekit exports (known: "
                                f"{', '.join(ROPE_TYPES)}): its rotation is not known, so no graph is written")
        if self.original < 1 or self.context < self.original:
            raise BadInputError(f"rotary contexts must satisfy 1 <= original <= context, got {self.original} "
                                f"and {self.context}")

    @property
    def by_position(self) -> bool:
        """Whether the rotation is chosen at run time from the positions (dynamic, longrope)."""
        return self.rope_type in POSITION_TYPES

    @property
    def thresholds(self) -> tuple[int, ...]:
        """The positions a check must cross, inside the declared context: where the rotation changes
        (``threshold``) and the end of the pretrained context when scaling extends it."""
        found = {t for t in (self.threshold, self.original) if t is not None and 0 < t < self.context}
        return tuple(sorted(found))


def _scaling(config: Any) -> dict[str, Any]:
    scaling = getattr(config, "rope_scaling", None)
    return scaling if isinstance(scaling, dict) else {}


def config_rope_type(config: Any) -> str:
    """The rotary type a config declares (``rope_scaling.rope_type``, or its older name ``type``)."""
    scaling = _scaling(config)
    return str(scaling.get("rope_type", scaling.get("type", "default")) or "default")


def rope_spec(config: Any, rope_type: str | None = None) -> RopeSpec:
    """The ``RopeSpec`` of a transformers config (``rope_type``: the rotary module's own, where it
    overrides the config's, as Gemma 3's local rotary does)."""
    kind = rope_type or config_rope_type(config)
    scaling = _scaling(config) if kind != "default" else {}
    max_pos = getattr(config, "max_position_embeddings", None)
    if not isinstance(max_pos, int) or max_pos < 1:
        raise BadInputError(f"the model's config declares no max_position_embeddings (got {max_pos!r}): "
                            "the positions its rotary embedding covers are unknown")
    threshold = None
    if kind == "dynamic":  # dynamic_rope_update compares with max_position_embeddings, whatever else is declared
        threshold = original = max_pos
    elif kind == "longrope":  # ... and longrope with the config's original_max_position_embeddings, else max_pos
        top = getattr(config, "original_max_position_embeddings", None)
        threshold = original = min(int(top), max_pos) if isinstance(top, int) and top > 0 else max_pos
    else:
        declared = scaling.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        original = int(declared) if isinstance(declared, int) and 0 < declared <= max_pos else max_pos
    factor = scaling.get("factor")
    context = max_pos
    if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
        context = max(context, int(factor * original))
    return RopeSpec(rope_type=kind, threshold=threshold, original=original, context=context)


def rotary_modules(model: Any) -> list[tuple[str, Any]]:
    """The rotary-embedding modules of a transformers model: (name, module) with ``rope_init_fn``
    and an ``inv_freq`` buffer, as every ``*RotaryEmbedding`` built on ``ROPE_INIT_FUNCTIONS`` has."""
    return [(n, m) for n, m in model.named_modules() if callable(getattr(m, "rope_init_fn", None))
            and getattr(m, "inv_freq", None) is not None and getattr(m, "config", None) is not None]


def module_spec(rotary: Any) -> RopeSpec:
    """The ``RopeSpec`` of one rotary module (its own config and type)."""
    return rope_spec(rotary.config, getattr(rotary, "rope_type", None))


def model_rope(model: Any) -> RopeSpec | None:
    """The spec of a model's global rotary embedding (the first rotary module; ``model.rotary_emb`` in
    transformers' decoders), None for a model without one (learned positions: GPT-2, OPT). Every
    rotary module's type must be one edgekit exports (``BadInputError`` otherwise)."""
    specs = [module_spec(m) for _, m in rotary_modules(model)]
    return specs[0] if specs else None


def declared_context(model: Any) -> dict[str, Any] | None:
    """What an exported causal LM records of its positions (``model.context`` in its manifest, which
    ``profile`` reads): ``max_position_embeddings``, the longest context the config declares
    (``tokens``), and for a rotary model its type and thresholds. None where the config declares no
    ``max_position_embeddings``."""
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(max_pos, int) or max_pos < 1:
        return None
    record: dict[str, Any] = {"max_position_embeddings": max_pos, "tokens": max_pos}
    spec = model_rope(model)
    if spec is not None:
        record.update({"tokens": spec.context, "rope_type": spec.rope_type, "original": spec.original,
                       "thresholds": list(spec.thresholds)})
    return record


def _updated_by_transformers(rotary: Any) -> bool:
    """Whether the module's forward goes through ``dynamic_rope_update`` (the only position-dependent
    rotation edgekit knows how to reproduce)."""
    from transformers import modeling_rope_utils

    fn = type(rotary).forward
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_filename == modeling_rope_utils.__file__:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def fixed_inv_freq(rotary: Any) -> tuple[Any, float]:
    """(``inv_freq`` float32 tensor (rotary_dim / 2,), attention scaling) of a fixed-type rotary, from its
    config (not the module's buffer, which a position-dependent update may have replaced)."""
    import torch

    inv_freq, scale = rotary.rope_init_fn(rotary.config, torch.device("cpu"))
    return inv_freq.detach().float(), float(scale)


def longrope_inv_freqs(rotary: Any) -> tuple[Any, Any, float]:
    """(short ``inv_freq``, long ``inv_freq``, attention scaling) of a longrope rotary, as
    ``dynamic_rope_update`` computes them (the long one for a sequence one past the threshold)."""
    import torch

    spec = module_spec(rotary)
    assert spec.threshold is not None  # a longrope spec always has one
    cpu = torch.device("cpu")
    short, scale = rotary.rope_init_fn(rotary.config, cpu)
    long, _ = rotary.rope_init_fn(rotary.config, cpu, seq_len=spec.threshold + 1)
    return short.detach().float(), long.detach().float(), float(scale)


def dynamic_ntk_constants(rotary: Any) -> tuple[float, float, int, float, Any]:
    """(base, factor, max_position_embeddings, exponent dim / (dim - 2), ``arange(0, dim, 2) / dim``)
    of a dynamic-NTK rotary: ``inv_freq(L) = 1 / (base * (factor * L / max_pos - (factor - 1)) **
    exponent) ** steps`` for ``L = max(sequence length, max_pos)`` (transformers'
    ``_compute_dynamic_ntk_parameters``, in the same float32 operations)."""
    import torch

    cfg = rotary.config
    head_dim = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    dim = int(head_dim * getattr(cfg, "partial_rotary_factor", 1.0))
    steps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return float(cfg.rope_theta), float(cfg.rope_scaling["factor"]), int(cfg.max_position_embeddings), \
        dim / (dim - 2), steps


def inv_freq_at(rotary: Any, position_ids: Any) -> Any:
    """The ``inv_freq`` transformers uses for a forward at ``position_ids``, in tensor operations only
    (so a trace keeps the choice): longrope's short or long factors by ``max(position_ids) + 1``,
    dynamic NTK's base for that length, a fixed type's table."""
    import torch

    spec = module_spec(rotary)
    seq_len = position_ids.max() + 1
    if spec.rope_type == "longrope":
        short, long, _ = longrope_inv_freqs(rotary)
        return torch.where(seq_len > spec.threshold, long.to(position_ids.device), short.to(position_ids.device))
    if spec.rope_type == "dynamic":
        inv_freq, _ = rotary.rope_init_fn(rotary.config, position_ids.device, seq_len=seq_len)
        return inv_freq
    return fixed_inv_freq(rotary)[0].to(position_ids.device)


def check_exportable(model: Any) -> None:
    """Refuse (``BadInputError``, with the reason) a model whose rotary rotation edgekit cannot
    reproduce in a graph: an unknown type, or a position-dependent type whose module does not
    choose its rotation the way transformers' ``dynamic_rope_update`` does."""
    for name, rotary in rotary_modules(model):
        spec = module_spec(rotary)
        if spec.by_position and not _updated_by_transformers(rotary):
            raise BadInputError(f"{name} ({type(rotary).__name__}) uses {spec.rope_type!r} rope scaling but does not "
                                "choose its rotation through transformers' dynamic_rope_update: edgekit cannot tell "
                                "which rotation a position gets, so no graph is written")


@contextlib.contextmanager
def traceable_rope(model: Any) -> Iterator[Any]:
    """For the time of a trace, make every position-dependent rotary module compute its ``inv_freq``
    from the positions in tensor operations (``inv_freq_at``) instead of choosing it in Python, so
    the traced graph selects the rotation at run time. Fixed types are left as they are."""
    check_exportable(model)
    patched = []
    for _, rotary in rotary_modules(model):
        if not module_spec(rotary).by_position:
            continue
        raw = inspect.unwrap(type(rotary).forward)  # the forward without dynamic_rope_update

        def forward(x: Any, position_ids: Any, _rotary: Any = rotary, _raw: Any = raw) -> Any:
            saved = _rotary.inv_freq
            _rotary.inv_freq = inv_freq_at(_rotary, position_ids)
            try:
                return _raw(_rotary, x, position_ids)
            finally:
                _rotary.inv_freq = saved

        rotary.forward = forward
        patched.append(rotary)
    try:
        yield model
    finally:
        for rotary in patched:
            del rotary.forward
        reset_rope_state(model)


def reset_rope_state(model: Any) -> None:
    """Forget what earlier forwards left in the rotary modules: transformers' dynamic NTK keeps the
    longest sequence it has seen (``max_seq_len_cached``) and its ``inv_freq``, so a shorter sequence
    afterwards gets another rotation than it would from a fresh model."""
    for _, rotary in rotary_modules(model):
        original = getattr(rotary, "original_inv_freq", None)
        if original is not None and rotary.inv_freq is not original:
            rotary.inv_freq = original
        if hasattr(rotary, "original_max_seq_len"):
            rotary.max_seq_len_cached = rotary.original_max_seq_len


def check_starts(spec: RopeSpec, prefill: int, decode: int) -> list[int]:
    """First positions of the parity checks of a rotary model: for each threshold, a prefill that ends
    at it (the decode steps cross it) and one that starts at it (the prefill is beyond it), and a
    prefill whose decode steps reach the end of the declared context."""
    span = prefill + decode
    last = max(spec.context - span, 0)
    starts = {last}
    for t in spec.thresholds:
        starts.update((min(max(t - prefill, 0), last), min(t, last)))
    return sorted(starts)


__all__ = ["FIXED_TYPES", "POSITION_TYPES", "ROPE_TYPES", "RopeSpec", "check_exportable", "check_starts",
           "config_rope_type", "declared_context", "dynamic_ntk_constants", "fixed_inv_freq", "inv_freq_at", "longrope_inv_freqs",
           "model_rope", "module_spec", "reset_rope_state", "rope_spec", "rotary_modules", "traceable_rope"]
