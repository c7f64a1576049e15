"""Which norm or linear feeds which projections, measured on the model itself (AWQ's fold pairs).

AWQ divides a group's input by per-channel scales ``s`` and folds ``1/s`` into the op producing
that input; that is exact only where the producer's output reaches the group and nothing else,
through ops that commute with a positive per-channel scale. ``families.py`` describes this by
hand for the families edgekit knows; for any other Hugging Face decoder this module finds it from
the structure and proves it numerically, on the first block of each kind:

1. One forward on a few token ids with hooks: the linears that read the same input tensor form a
   group (q/k/v, gate/up, ...); the module that returned that tensor is its producer candidate
   (a norm with a 1-d weight, or a linear). A group whose input no module returned (``o_proj``
   after attention, ``down_proj`` after ``act(gate) * up``) takes as candidates the linears
   beside it (same parent module) whose output width is the group's input width.
2. Each candidate is kept only if the model's logits are unchanged (relative error < 1e-4) when
   the producer's output channels are divided by random scales and the group's weight columns
   multiplied by them, and changed (> 1e-3) when only the producer is scaled: the path is real and
   the fold exact. A norm is tried as ``x_hat * w`` and as ``x_hat * (1 + w)`` (Gemma).

The result is a ``Family`` like the hand-written ones (``probed=True`` in its name); tests check
that the probe finds every pair of the hand table on the families it describes.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from edgekit.compress.families import Family, ScalePair, hf_model
from edgekit.errors import BadInputError

PROBE_TOKENS = 12
EXACT = 1e-4  # relative logit change allowed for a fold that must be exact (float32 rounding)
REAL = 1e-3  # relative logit change that shows the producer's output reaches the logits
OFFSETS = (0.0, 1.0)  # norms computing x_hat * (offset + w)


@torch.no_grad()
def probe_family(module: nn.Module, blocks: list[nn.Module], prefix: str) -> Family:
    """The AWQ fold pairs of ``module`` (a Hugging Face causal LM whose repeated blocks are
    ``blocks``, found at ``prefix``), measured as the module docstring says. ``BadInputError`` when
    the model cannot be probed or no pair folds exactly."""
    hf = hf_model(module)
    config = getattr(hf, "config", None)
    model_type = str(getattr(config, "model_type", type(module).__name__))
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 2:
        raise BadInputError(f"AWQ cannot probe how model type {model_type!r} wires its norms and projections: "
                            "its config declares no vocabulary size; use --method gptq-plus, gptq or rtn")
    ids = torch.randint(vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    ids = ids.to(device)

    mask = torch.ones_like(ids)

    def logits() -> torch.Tensor:
        out = module(input_ids=ids, attention_mask=mask)
        y = out.logits if hasattr(out, "logits") else out[0]
        return y.float()

    try:
        base = logits()
    except Exception as e:  # noqa: BLE001 - any failure of the user's forward ends the probe with its reason
        raise BadInputError(f"AWQ cannot probe how model type {model_type!r} wires its norms and projections "
                            f"(its forward on {PROBE_TOKENS} token ids failed: {type(e).__name__}: {e}); "
                            "use --method gptq-plus, gptq or rtn") from None
    pairs: list[ScalePair] = []
    offsets: set[float] = set()
    seen_kinds: set[type] = set()
    for block in blocks:
        if type(block) in seen_kinds:
            continue
        seen_kinds.add(type(block))
        for pair, offset in _probe_block(block, logits, base):
            if pair not in pairs:
                pairs.append(pair)
            if offset is not None:
                offsets.add(offset)
    if not pairs:
        raise BadInputError(f"AWQ found no norm or linear in model type {model_type!r} whose output scales fold "
                            "exactly into the projections it feeds; use --method gptq-plus, gptq or rtn")
    if len(offsets) > 1:
        raise BadInputError(f"model type {model_type!r} has norms computing x * w and x * (1 + w); AWQ folds into "
                            "one kind per model; use --method gptq-plus, gptq or rtn")
    return Family(f"{model_type} (probed)", (model_type,), tuple(pairs), norm_offset=offsets.pop() if offsets else 0.0)


def _probe_block(block: nn.Module, logits: Callable[[], torch.Tensor],
                 base: torch.Tensor) -> list[tuple[ScalePair, float | None]]:
    produced: dict[int, str] = {}  # id of an output tensor -> the module path that returned it
    read: dict[str, torch.Tensor] = {}  # linear path -> the input tensor it read
    kept: list[torch.Tensor] = []  # holds the tensors alive so that their ids stay unique
    handles = []
    for path, m in block.named_modules():
        if not path:
            continue

        def hook(mod: nn.Module, args: tuple, out: object, path: str = path) -> None:
            if isinstance(out, torch.Tensor):
                produced.setdefault(id(out), path)
                kept.append(out)
            if isinstance(mod, nn.Linear) and args and isinstance(args[0], torch.Tensor) and path not in read:
                read[path] = args[0]
                kept.append(args[0])

        handles.append(m.register_forward_hook(hook))
    try:
        logits()
    finally:
        for h in handles:
            h.remove()
    groups: dict[int, list[str]] = {}
    for path, x in read.items():
        if x.numel():
            groups.setdefault(id(x), []).append(path)
    found: list[tuple[ScalePair, float | None]] = []
    for key, consumers in groups.items():
        first = block.get_submodule(consumers[0])
        assert isinstance(first, nn.Linear)
        candidates: list[str] = []
        if key in produced:
            candidates = [produced[key]]
        else:
            parent = consumers[0].rpartition(".")[0]
            candidates = [p for p, m in block.named_modules()
                          if isinstance(m, nn.Linear) and p.rpartition(".")[0] == parent and p not in consumers
                          and m.out_features == first.in_features and p in read and read[p].numel()]
        for producer in candidates:
            offset = _folds(block, producer, consumers, logits, base)
            if offset is not False:
                found.append((ScalePair(producer, tuple(consumers)), offset if isinstance(offset, float) else None))
                break
    return found


def _folds(block: nn.Module, producer: str, consumers: list[str], logits: Callable[[], torch.Tensor],
           base: torch.Tensor) -> float | None | bool:
    """False when ``1/s`` does not fold exactly into ``producer``; else the norm's offset (a norm)
    or None (a linear)."""
    prod = block.get_submodule(producer)
    w = getattr(prod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() not in (1, 2):
        return False
    linears = [m for m in (block.get_submodule(c) for c in consumers) if isinstance(m, nn.Linear)]
    cols = linears[0].weight.shape[1]
    if (w.shape[0] != cols) or any(lin.weight.shape[1] != cols for lin in linears):
        return False
    s = torch.exp(0.5 * torch.randn(cols, generator=torch.Generator().manual_seed(1))).to(w.device)
    for offset in (OFFSETS if w.dim() == 1 else (None,)):
        if _relative(_scaled(prod, linears, s, offset, logits), base) > EXACT:
            continue
        if _relative(_scaled(prod, [], s, offset, logits), base) < REAL:
            return False  # the producer's output does not reach the logits here: nothing is proven
        return offset
    return False


def _scaled(prod: nn.Module, linears: list[nn.Linear], s: torch.Tensor, offset: float | None,
            logits: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The logits with ``prod``'s output channels divided by ``s`` and ``linears``' columns
    multiplied by it (weights restored afterwards)."""
    saved = [(t, t.data.clone()) for m in (prod, *linears) for t in (getattr(m, "weight", None), getattr(m, "bias", None))
             if isinstance(t, torch.Tensor)]
    try:
        w, b = getattr(prod, "weight", None), getattr(prod, "bias", None)
        assert isinstance(w, torch.Tensor)  # _folds checked it
        if offset is not None:  # a norm: x_hat * (offset + w) -> x_hat * (offset + w) / s
            w.data.copy_((w.data.float() + offset) / s - offset)
        else:  # a linear: its output rows
            w.data.div_(s[:, None].to(w.dtype))
        if isinstance(b, torch.Tensor):
            b.data.div_(s.to(b.dtype))
        for lin in linears:
            lin.weight.data.mul_(s[None, :].to(lin.weight.dtype))
        return logits()
    finally:
        for t, data in saved:
            t.data.copy_(data)


def _relative(y: torch.Tensor, ref: torch.Tensor) -> float:
    denom = float(ref.norm())
    return float((y - ref).norm()) / denom if denom > 0 and math.isfinite(denom) else float("inf")
