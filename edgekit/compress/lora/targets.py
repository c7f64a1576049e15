"""Which modules LoRA adapts: the base's kind, the candidates, and the user's targets resolved."""
from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

from edgekit.compress.families import is_conv1d
from edgekit.compress.lora.nf4 import is_nf4
from edgekit.compress.lora.packed import LoraQuantLinear
from edgekit.compress.weight_only.packing import QuantLinear
from edgekit.errors import BadInputError
from edgekit.sources.handle import ModelHandle

# Default targets for transformer models (Llama/SmolLM2 names); CNNs and other models take
# every nn.Linear, transformers' Conv1D (GPT-2's transposed linears, which peft adapts as such)
# and (non-depthwise) nn.Conv2d instead.
TRANSFORMER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LM_HEADS = ("lm_head", "embed_out", "output")


def base_kind(module: nn.Module) -> str:
    """What the model's linear layers are: "packed", "nf4" or "float"."""
    for m in module.modules():
        if isinstance(m, (QuantLinear, LoraQuantLinear)):
            return "packed"
        if is_nf4(m):
            return "nf4"
    return "float"


def adaptable(m: nn.Module, base: str) -> bool:
    """Whether LoRA can adapt ``m`` over a base of that kind."""
    if base == "packed":
        return isinstance(m, QuantLinear)
    if base == "nf4":
        return is_nf4(m) or isinstance(m, nn.Linear)
    if isinstance(m, nn.Conv2d):
        return m.groups == 1  # peft's LoRA does not split grouped/depthwise convolutions
    return isinstance(m, nn.Linear) or is_conv1d(m)


def is_head(name: str, handle: ModelHandle) -> bool:
    """A causal LM's output head (left out of the default targets)."""
    return handle.kind == "causal-lm" and name.split(".")[-1] in LM_HEADS


def candidate_modules(handle: ModelHandle, base: str | None = None) -> list[str]:
    """Names of the modules LoRA can adapt in this model (for messages and defaults)."""
    base = base or base_kind(handle.module)
    return [n for n, m in handle.module.named_modules() if n and adaptable(m, base)]


def resolve_targets(handle: ModelHandle, targets: Iterable[str], base: str) -> list[str]:
    """Full module names to adapt. Each target is a full name, a suffix or a regex.

    Raises BadInputError when a target matches nothing adaptable, naming the candidates.
    """
    cands = candidate_modules(handle, base)
    if not cands:
        kinds = {"packed": "packed 4-bit linear (QuantLinear)", "nf4": "linear",
                 "float": "nn.Linear, Conv1D or nn.Conv2d"}[base]
        raise BadInputError(f"model {handle.name!r} has no {kinds} layers for LoRA to adapt")
    targets = list(targets)
    if not targets:
        if handle.kind == "causal-lm" or any(n.split(".")[-1] in TRANSFORMER_TARGETS for n in cands):
            chosen = [n for n in cands if n.split(".")[-1] in TRANSFORMER_TARGETS]
            if chosen:
                return chosen
        return [n for n in cands if not is_head(n, handle)]
    picked: dict[str, None] = {}
    all_names = [n for n, _ in handle.module.named_modules() if n]
    for t in targets:
        hits = [n for n in cands if _matches(n, t)]
        if not hits:
            other = [n for n in all_names if _matches(n, t)]
            why = (f" (it names {type(handle.module.get_submodule(other[0])).__name__}, not an adaptable layer)"
                   if other else "")
            shown = _short_names(cands)
            raise BadInputError(
                f"LoRA target {t!r} matches no adaptable module{why}; candidates: "
                f"{', '.join(shown[:20])}{' ...' if len(shown) > 20 else ''}")
        for n in hits:
            picked.setdefault(n, None)
    return list(picked)


def _matches(name: str, target: str) -> bool:
    if name == target or name.endswith("." + target):
        return True
    try:  # a regex: the whole name, or its trailing dotted components
        return re.fullmatch(target, name) is not None or re.search(rf"(?:^|\.)(?:{target})$", name) is not None
    except re.error:
        return False


def _short_names(names: list[str]) -> list[str]:
    """Distinct last name components, in order (``q_proj``, ``k_proj``, ``0``...)."""
    seen: dict[str, None] = {}
    for n in names:
        seen.setdefault(n.split(".")[-1], None)
    return list(seen)
