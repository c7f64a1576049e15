"""Weight-only low-bit quantization (the ``int4`` step): GPTQ, AWQ or RTN, then real packing.

``apply`` quantizes every ``nn.Linear`` inside the model's transformer blocks (or of the
whole model when it has none) to ``bits`` with per-group scales and zero points, replaces
them by packed ``QuantLinear`` modules (``packing.py`` documents the layout) and, for a
causal LM, quantizes the LM head and its tied embedding table (``head``, 8 bits by default).

Calibrated methods walk the model **block by block** (``BlockWalker``): the inputs of
block 0 are captured once for all calibration windows; then, for each block, its linear
layers are visited in execution order, grouped by shared input (q/k/v, o, gate/up, down
for a Llama block), each group seeing inputs produced by the already-quantized groups
before it (the forward stops right after the group's input is seen); finally the
quantized block is re-run to produce the next block's inputs. Memory holds one block's
activations for all windows, never the whole model's.

>>> from edgekit.compress import compress
>>> compress("smollm2-135m", [("int4", WeightOnlyConfig())], "out/w4")  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from edgekit.compress import Step, StepContext, config_to_dict
from edgekit.compress.families import embedding_scale, family_of, linearize
from edgekit.compress.options import option
from edgekit.compress.packing import SUPPORTED_BITS, QuantEmbedding, QuantLinear
from edgekit.compress.rtn import rtn_quantize
from edgekit.errors import BadInputError, CheckFailedError, bad_choice
from edgekit.schema import check_fields
from edgekit.sources.handle import ModelHandle, StepRecord

METHODS = ("gptq", "awq", "awq-gptq", "rtn")
HEAD_CHOICES = ("int8", "int4", "none")
DEVICES = ("cpu", "cuda")
VALUE_HESSIANS = ("attention", "input")
# Export parity of MatMulNBits (fp32 compute) against the PyTorch packed model: the same codes, but ONNX
# Runtime dequantizes and accumulates blockwise in another order; through SmolLM2's 30 blocks the logits
# (magnitude ~30) differ by up to 1.7e-4, over the plain export's 1e-4.
PARITY_TOLERANCE = (2e-3, 2e-3)


@dataclass(frozen=True)
class WeightOnlyConfig:
    """Options of the ``int4`` step (the CLI's ``compress --bits``).

    method: "gptq" | "awq" | "awq-gptq" (AWQ's scales, then GPTQ on the scaled weights) | "rtn". bits: 2, 3, 4 or 8. group_size: input columns per
    scale/zero point, a power of two >= 16, or -1 for one per output channel; a last,
    shorter group is allowed when it does not divide a layer's width (SmolLM2's 576 at 128).
    sym: symmetric grid (zero point 2**(bits-1)). act_order / static_groups / damp /
    block_size: GPTQ's options; act-order (columns by decreasing Hessian diagonal) is on by
    default: with groups it uses static groups, so the packed layout and the engine speed
    are unchanged, and it measured better on SmolLM2 (RESULTS.md). mse_grid: GPTQ fits each
    group's grid by an Lp-error search over range shrink ratios instead of min-max. None
    (default) = on with groups (SmolLM2 W4 g128 27.29 -> 27.09), off per channel, where
    clipping a whole row's outliers measured far worse (W4 per-channel 29.19 -> 34.97). refit: once GPTQ fixed the codes, re-solve each row's
    group scales by least squares under the layer's Hessian (default; 27.09 -> 26.57).
    gptaq_alpha: GPTAQ's asymmetric calibration (Li et al., 2025): each layer is solved to
    reproduce the *float* model's output from its (quantized-upstream) inputs, moved ``alpha``
    of the way from the paper's target; costs one more forward of each block on the float
    model's activations, whose group inputs are kept while the block is solved (default 0.25,
    as in GPTAQ; 27.09 -> 26.24, with refit 26.22; 0 = the paper's GPTQ).
    true_sequential: each linear group sees inputs from the already-quantized groups of
    its block. value_hessian: GPTQ's Hessian for attention value projections (Llama family):
    "attention" (default) from the attention-mixed inputs ``P X`` of each key/value head,
    i.e. the error measured where the values are used; "input" from the layer's inputs
    ``X`` as in the paper. Measured on SmolLM2 (W4 g128): the paper's Hessian weights every
    token alike, so GPTQ moves the value error onto the attention-sink token's massive
    channels, which nearly every query reads: perplexity worse than RTN; see RESULTS.md. calib_samples / seqlen: calibration windows (seqlen None: the model's): the
    text's first non-overlapping windows, topped up, when it holds fewer, with windows at
    random offsets (seeded; the GPTQ reference samples all its windows so).
    awq_grid / awq_clip: AWQ's scale-exponent grid points and clipping search.
    head: the LM head and tied embedding: "int8" (default; 4 bits there cost ~6 PPL on
    SmolLM2), "int4" or "none" (kept float). device: where the solver runs.
    eval_windows: for a causal LM, perplexity before and after on this many windows of the
    eval split (the model's default eval text, e.g. Wikipedia; 0: skip), in the step metrics,
    when the step is applied on its own (``compress`` measures against the float model itself).
    """

    method: str = field(default="gptq", metadata=option(
        "--method", help="ptq | qat (8-bit), gptq | awq | awq-gptq | rtn (weight-only)."))
    bits: int = field(
        default=4, metadata=option("--bits", help="8: INT8 (ptq/qat); 2, 3, 4, 8 weight-only (gptq/awq/rtn)."))
    group_size: int = field(
        default=128, metadata=option("--group-size", help="Weight-only: group size (-1 = per channel)."))
    sym: bool = field(default=False, metadata=option("--sym/--asym", help="Weight-only: symmetric or asymmetric grid."))
    act_order: bool = field(default=True, metadata=option(
        "--act-order/--no-act-order", help="GPTQ: quantize columns by decreasing Hessian diagonal (default on; "
        "static groups keep the packed layout)."))
    static_groups: bool = False
    damp: float = 0.01
    block_size: int = 128
    mse_grid: bool | None = None
    refit: bool = field(default=True, metadata=option(
        "--refit/--no-refit", help="GPTQ: re-solve the group scales by least squares once the codes are "
        "fixed (default on)."))
    gptaq_alpha: float = field(default=0.25, metadata=option(
        "--gptaq-alpha", help="GPTQ: how far each layer matches the float model's output instead of its "
        "own on quantized inputs (GPTAQ's alpha, 0-1; default 0.25; 0 = the paper's GPTQ)."))
    true_sequential: bool = True
    value_hessian: str = "attention"
    calib_samples: int = field(default=128, metadata=option("--calib-samples"))
    seqlen: int | None = field(default=512, metadata=option(
        "--seqlen", help="Token window for language models: calibration (GPTQ/AWQ) and distillation."))
    awq_grid: int = 20
    awq_clip: bool = True
    head: str = "int8"
    device: str = field(default="cpu", metadata=option("--device", help="cpu | cuda (GPTQ/AWQ)."))
    eval_windows: int = 8

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before the range checks below
        if self.method not in METHODS:
            raise bad_choice("weight-only method", self.method, METHODS)
        if self.bits not in SUPPORTED_BITS:
            raise BadInputError(f"unsupported bit width {self.bits!r} (choose from {', '.join(map(str, SUPPORTED_BITS))})")
        gs = self.group_size
        if not (gs == -1 or (isinstance(gs, int) and gs >= 16 and gs & (gs - 1) == 0)):
            raise BadInputError(f"unsupported group size {gs!r} (choose -1 for per-channel, or a power of two "
                                "from 16: 16, 32, 64, 128, 256, ...)")
        if not 0 <= self.damp < 1:
            raise BadInputError(f"damp must be in [0, 1), got {self.damp!r}")
        if not 0 <= self.gptaq_alpha <= 1:
            raise BadInputError(f"gptaq_alpha must be in [0, 1], got {self.gptaq_alpha!r}")
        if self.block_size < 1:
            raise BadInputError(f"block_size must be positive, got {self.block_size!r}")
        if self.calib_samples < 1:
            raise BadInputError(f"calib_samples must be at least 1, got {self.calib_samples!r}")
        if self.seqlen is not None and self.seqlen < 2:
            raise BadInputError(f"seqlen must be at least 2, got {self.seqlen!r}")
        if self.value_hessian not in VALUE_HESSIANS:
            raise bad_choice("value-projection Hessian", self.value_hessian, VALUE_HESSIANS)
        if self.awq_grid < 1:
            raise BadInputError(f"awq_grid must be at least 1, got {self.awq_grid!r}")
        if self.head not in HEAD_CHOICES:
            raise bad_choice("head quantization", self.head, HEAD_CHOICES)
        if self.device not in DEVICES:
            raise bad_choice("device", self.device, DEVICES)
        if not isinstance(self.eval_windows, int) or self.eval_windows < 0:
            raise BadInputError(f"eval_windows must be a whole number >= 0, got {self.eval_windows!r}")

    @property
    def grid_search(self) -> bool:
        """Whether GPTQ searches each group's range (``mse_grid``, resolved for the group size)."""
        return self.group_size != -1 if self.mse_grid is None else self.mse_grid


# --- finding the layers -------------------------------------------------------------------------


def _get(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name) if name else module


def _set(module: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(_get(module, parent), child, new)


def find_blocks(module: nn.Module) -> tuple[str, list[nn.Module]]:
    """The repeated blocks to walk: the ``nn.ModuleList`` holding the most linear layers
    (a transformer's layers); else the whole model as one block. Returns (prefix, blocks)."""
    best, best_n = None, 0
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1:
            n = sum(isinstance(x, nn.Linear) for x in m.modules())
            if n > best_n:
                best, best_n = name, n
    if best is None:
        return "", [module]
    return best, list(_get(module, best))


def check_blocks(module: nn.Module, prefix: str, blocks: list[nn.Module]) -> None:
    """The walked blocks must be the model's layers as its config counts them (a Hugging Face model);
    anything else is a structure the walk would only guess at."""
    from edgekit.compress.families import hf_model

    hf = hf_model(module)
    n = getattr(getattr(hf, "config", None), "num_hidden_layers", None)
    if isinstance(n, int) and prefix and len(blocks) != n:
        raise BadInputError(f"the block walk found {len(blocks)} blocks in {prefix!r}, but the model's config declares "
                            f"{n} layers; edgekit does not know this model's structure")


def head_layers(module: nn.Module) -> tuple[str | None, str | None]:
    """(LM head name, input embedding name) of a Hugging Face causal LM inside ``module``."""
    for _name, m in module.named_modules():
        if hasattr(m, "get_output_embeddings") and hasattr(m, "get_input_embeddings"):
            try:
                out, inp = m.get_output_embeddings(), m.get_input_embeddings()
            except (NotImplementedError, AttributeError):
                continue
            if isinstance(out, nn.Linear):
                names = {id(x): n for n, x in module.named_modules()}
                return names.get(id(out)), names.get(id(inp)) if isinstance(inp, nn.Embedding) else None
    return None, None


def quantizable_linears(module: nn.Module) -> tuple[str, list[nn.Module], dict[str, nn.Linear]]:
    prefix, blocks = find_blocks(module)
    head, _ = head_layers(module)
    names = {id(m): n for n, m in module.named_modules()}
    linears: dict[str, nn.Linear] = {}
    for b in blocks:
        for m in b.modules():
            if isinstance(m, nn.Linear) and names[id(m)] != head:
                linears[names[id(m)]] = m
    return prefix, blocks, linears


# --- calibration data -----------------------------------------------------------------------------


def calibration_inputs(handle: ModelHandle, config: WeightOnlyConfig, ctx: StepContext) -> list[torch.Tensor]:
    """Calibration samples as one tensor per model input (axis 0 = sample)."""
    from edgekit.sources.data import load_samples

    spec = ctx.calib or handle.default_calib
    samples = load_samples(spec, handle, split="calib", seqlen=config.seqlen, seed=ctx.seed)
    names = [s.name for s in handle.inputs]
    if not len(samples) or any(n not in samples.inputs for n in names):
        raise BadInputError(f"calibration data {spec!r} gives no complete sample for {handle.name} "
                            f"(inputs {names}); for a causal LM the text must hold at least one "
                            f"{config.seqlen}-token window")
    n = min(config.calib_samples, len(samples))
    inputs = {k: samples.inputs[k][:n] for k in names}
    extra = config.calib_samples - n
    if extra > 0 and samples.meta.get("kind") == "token-windows" and samples.text and set(names) <= {"input_ids", "attention_mask"}:
        # The text holds fewer non-overlapping windows than asked: top up with windows at random
        # offsets, as the GPTQ reference samples all of its calibration windows.
        from edgekit.sources.data import random_token_windows

        more = random_token_windows(handle.tokenizer, samples.text, int(samples.meta["seqlen"]), extra,
                                    seed=ctx.seed, prefix=samples.meta.get("prefix", ()))
        inputs["input_ids"] = np.concatenate([inputs["input_ids"], more])
        if "attention_mask" in inputs:
            inputs["attention_mask"] = np.concatenate([inputs["attention_mask"], np.ones_like(more)])
    return [torch.from_numpy(np.ascontiguousarray(inputs[k])) for k in names]


class _Stop(Exception):
    pass


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class BlockWalker:
    """Runs the calibration set through the model one block at a time.

    ``walk(visit_group)`` calls ``visit_group(block_index, names, inputs)`` for each group of
    linears sharing one input, in execution order; ``inputs`` (a ``GroupInputs``) is an
    iterator factory yielding that group's input activations batch by batch (computed on
    demand through the block's already-quantized layers). ``visit_group`` quantizes the group in place (float
    weights on the quantized grid) before the walk moves on.
    """

    def __init__(self, module: nn.Module, calib: list[torch.Tensor], device: str = "cpu",
                 batch_size: int = 8, progress: bool = True, track_float: bool = False) -> None:
        self.module = module
        self.calib = calib
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.progress = progress
        # also carry the float model's activations: one forward of each block before it is quantized
        # keeps every group's float inputs (one block's worth of activations) for GroupInputs.paired()
        self.track_float = track_float
        self.prefix, self.blocks = find_blocks(module)
        self.names = {id(m): n for n, m in module.named_modules()}

    def _capture_block0(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        if not self.prefix:  # the whole model is the block: its inputs are the samples
            n = self.calib[0].shape[0]
            return [(tuple(t[i:i + self.batch_size].to(self.device) for t in self.calib), {})
                    for i in range(0, n, self.batch_size)]
        captured: list[tuple[Any, dict[str, Any]]] = []

        def grab(_m, args, kwargs):
            kw = dict(kwargs)
            for cache in ("past_key_values", "past_key_value", "layer_past"):  # GPT-NeoX: layer_past
                if cache in kw:
                    kw[cache] = None
            if "use_cache" in kw:
                kw["use_cache"] = False
            # a KV cache passed positionally (GPT-2's blocks take it as their 2nd argument): none
            args = tuple(None if hasattr(a, "get_seq_length") else a for a in args)
            captured.append((tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kw))
            raise _Stop

        h = self.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            n = self.calib[0].shape[0]
            for i in range(0, n, self.batch_size):
                try:
                    self.module(*[t[i:i + self.batch_size].to(self.device) for t in self.calib])
                except _Stop:
                    pass
        finally:
            h.remove()
        return captured

    def _input_groups(self, block: nn.Module, batch: tuple[Any, dict[str, Any]]) -> list[list[str]]:
        """Linears of ``block`` in execution order, grouped by identical input tensor."""
        order: list[tuple[str, int]] = []
        hooks = []
        for m in block.modules():
            if isinstance(m, nn.Linear) and self.names[id(m)] in self.linears:
                name = self.names[id(m)]
                hooks.append(m.register_forward_pre_hook(
                    lambda _m, args, name=name: order.append((name, args[0]))))
        try:
            args, kw = batch
            block(*tuple(a[:1] if isinstance(a, torch.Tensor) else a for a in args), **_slice_kwargs(kw, 1))
        finally:
            for h in hooks:
                h.remove()
        groups: list[list[str]] = []
        last = None
        for name, x in order:  # tensors kept alive here, so identity is reliable
            if any(name in g for g in groups):
                continue
            if groups and x is last:
                groups[-1].append(name)
            else:
                groups.append([name])
            last = x
        return groups

    @torch.no_grad()
    def walk(self, linears: dict[str, nn.Linear],
             visit_group: Callable[[int, list[str], Callable[[], Any]], None]) -> None:
        from edgekit.progress import progress_bar

        self.linears = linears
        data = self._capture_block0()
        data_fp = data if self.track_float else None  # the blocks before the first are not quantized
        for bi in progress_bar(range(len(self.blocks)), "quantize blocks", enabled=self.progress):
            block = self.blocks[bi]
            if any(isinstance(m, nn.Linear) and self.names[id(m)] in linears for m in block.modules()):
                groups = self._input_groups(block, data[0])
                float_inputs: dict[str, list[torch.Tensor]] = {}
                if data_fp is not None:
                    # The float block never changes, so one forward gives every group's float
                    # inputs (and the next block's float input) before this block is touched.
                    data_fp, float_inputs = self._run_capturing(block, data_fp, [g[0] for g in groups])
                for names in groups:
                    inputs = GroupInputs(block, _get(self.module, names[0]), data)
                    inputs.float_inputs = float_inputs.get(names[0])
                    visit_group(bi, names, inputs)
            elif data_fp is not None:
                data_fp = [((self._run(block, b),) + tuple(b[0][1:]), b[1]) for b in data_fp]
            data = [((self._run(block, b),) + tuple(b[0][1:]), b[1]) for b in data]

    def _run(self, block: nn.Module, batch: tuple[Any, dict[str, Any]]) -> torch.Tensor:
        args, kw = batch
        return _first(block(*args, **kw)).detach()

    def _run_capturing(self, block: nn.Module, data: list[tuple[Any, dict[str, Any]]], names: list[str]):
        """``block`` over ``data``: its outputs as the next block's data, and the inputs of the
        named layers, per batch."""
        captured: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        hooks = [_get(self.module, n).register_forward_pre_hook(
            lambda _m, args, n=n: captured[n].append(args[0].detach())) for n in names]
        try:
            out = [((self._run(block, b),) + tuple(b[0][1:]), b[1]) for b in data]
        finally:
            for h in hooks:
                h.remove()
        return out, captured


class GroupInputs:
    """The inputs of one group of linears, recomputed on demand from the block's inputs.

    ``inputs()`` yields the group's input activations batch by batch (the block's forward
    stops right at the group's first layer). ``attention_mixed(attn, v_proj)`` yields, per
    batch, the attention probabilities ``P`` (batch, heads, queries, keys) of ``attn`` and
    the inputs ``X`` (batch, keys, features) of its value projection: a value projection's
    output only matters through ``P @ (X Wᵀ)``, so its GPTQ objective uses ``P X``.
    """

    def __init__(self, block: nn.Module, first: nn.Module, data: list[tuple[Any, dict[str, Any]]]) -> None:
        self.block, self.first, self.data = block, first, data
        self.float_inputs: list[torch.Tensor] | None = None  # per batch, in the float model (track_float)

    def __call__(self):
        return _group_inputs(self.block, self.first, self.data)

    def paired(self):
        """``(x, x_float)`` per batch: the group's input here and in the unquantized model
        (needs a walker with ``track_float``)."""
        if self.float_inputs is None:
            raise RuntimeError("paired inputs need BlockWalker(track_float=True)")
        return zip(self(), self.float_inputs, strict=True)

    def attention_mixed(self, attn: nn.Module, v_proj: nn.Module):
        """(P, X) per batch, with the attention run eagerly (the probabilities are its 2nd output)."""
        config = attn.config
        saved = config._attn_implementation
        xs: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []

        def grab_x(_m, args):
            xs.append(args[0].detach())

        def grab_p(_m, _args, out):
            probs.append(out[1].detach())
            raise _Stop

        hooks = [v_proj.register_forward_pre_hook(grab_x), attn.register_forward_hook(grab_p)]
        config._attn_implementation = "eager"
        try:
            for args, kw in self.data:
                xs.clear()
                probs.clear()
                kw = dict(kw)
                if kw.get("attention_mask") is None:  # sdpa ran causal without a mask; eager needs one
                    n = args[0].shape[1]
                    causal = torch.full((n, n), torch.finfo(args[0].dtype).min, device=args[0].device).triu(1)
                    kw["attention_mask"] = causal[None, None].expand(args[0].shape[0], 1, n, n)
                try:
                    self.block(*args, **kw)
                except _Stop:
                    pass
                if probs and probs[0] is not None and xs:
                    yield probs[0], xs[0]
        finally:
            config._attn_implementation = saved
            for h in hooks:
                h.remove()


def _group_inputs(block: nn.Module, first: nn.Module, data: list[tuple[Any, dict[str, Any]]]):
    """Per batch of ``data``, the input of ``first``, running ``block`` only up to it."""
    box: list[torch.Tensor] = []

    def grab(_m, args):
        box.append(args[0].detach())
        raise _Stop

    h = first.register_forward_pre_hook(grab)
    try:
        for args, kw in data:
            box.clear()
            try:
                block(*args, **kw)
            except _Stop:
                pass
            if box:
                yield box[0]
    finally:
        h.remove()


def value_projection(module: nn.Module, names: list[str]) -> tuple[str, nn.Module, int, int] | None:
    """(name, attention module, heads per key/value head, head dim) of the value projection
    among ``names``, for the families whose description names one (``families.py``: Llama,
    Gemma, ...: ``v_proj`` inside a module with ``head_dim``, ``num_key_value_groups`` and a
    config); None otherwise."""
    value = family_of(module).value_proj
    if value is None:
        return None
    for name in names:
        parent_name, _, child = name.rpartition(".")
        if not name.endswith("." + value) and name != value:
            continue
        attn = _get(module, parent_name)
        if all(hasattr(attn, a) for a in ("head_dim", "num_key_value_groups", "config")) and \
                hasattr(attn.config, "_attn_implementation"):
            return name, attn, int(attn.num_key_value_groups), int(attn.head_dim)
    return None


def _slice_kwargs(kw: dict[str, Any], n: int) -> dict[str, Any]:
    out = {}
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] > 1 and k != "cache_position":
            out[k] = v[:n]
        elif isinstance(v, tuple) and all(isinstance(t, torch.Tensor) for t in v):
            out[k] = tuple(t[:n] if t.dim() > 0 and t.shape[0] > 1 else t for t in v)
        else:
            out[k] = v
    return out


# --- apply / rebuild ------------------------------------------------------------------------------

Quantized = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # name -> (q, scales, zeros)


def _check_layers(linears: dict[str, nn.Linear], config: WeightOnlyConfig) -> None:
    for name, lin in linears.items():
        if config.group_size != -1 and config.group_size > lin.in_features:
            raise BadInputError(f"group size {config.group_size} is larger than layer {name!r}'s {lin.in_features} "
                                "input features (choose a smaller group size or -1 for per-channel)")


def quantize_module(module: nn.Module, config: WeightOnlyConfig, calib: list[torch.Tensor] | None = None,
                    progress: bool = False) -> tuple[Quantized, dict[str, Any]]:
    """Quantize the block linears of ``module`` in place (weights set to their dequantized
    values) and return their codes. ``calib`` is needed by GPTQ and AWQ. transformers' ``Conv1D``
    layers (GPT-2) first become the ``nn.Linear`` they compute (``families.linearize``)."""
    converted = linearize(module)
    prefix, blocks, linears = quantizable_linears(module)
    check_blocks(module, prefix, blocks)
    if not linears:
        raise BadInputError("the model has no linear layers to quantize (weight-only quantization "
                            "acts on nn.Linear layers)")
    _check_layers(linears, config)
    device = config.device
    if device == "cuda" and not torch.cuda.is_available():
        from edgekit.errors import UnavailableError

        raise UnavailableError("device 'cuda' asked for but CUDA is not available here (use --device cpu)")
    results: Quantized = {}
    info: dict[str, Any] = {"blocks": len(blocks), "block_prefix": prefix}
    if converted:
        info["conv1d_as_linear"] = len(converted)
    t0, c0 = time.perf_counter(), time.process_time()
    if config.method == "rtn":
        for name, lin in linears.items():
            q, s, z = rtn_quantize(lin.weight.detach().to(device), config.bits, config.group_size, config.sym)
            results[name] = (q.cpu(), s.cpu(), z.cpu())
            _set_weight(lin, q, s, z, config.group_size)
    else:
        if calib is None:
            raise BadInputError(f"method {config.method!r} needs calibration data")
        module.to(device)
        walker = BlockWalker(module, calib, device=device, progress=progress,
                             track_float=config.method == "gptq" and config.gptaq_alpha > 0)
        if config.method == "gptq":
            from edgekit.compress.gptq import gptq_visit

            visit = gptq_visit(module, config, results)
        else:
            from edgekit.compress.awq import awq_visit

            visit = awq_visit(module, config, results)
        walker.walk(linears, visit)
        module.to("cpu")
        info["calib_windows"] = int(calib[0].shape[0])
        info["calib_tokens"] = int(calib[0].numel())
    info["seconds"] = round(time.perf_counter() - t0, 2)
    info["cpu_seconds"] = round(time.process_time() - c0, 2)  # wall time lies on a shared machine
    return results, info


def _set_weight(lin: nn.Linear, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int) -> None:
    from edgekit.compress.rtn import dequantize_groups

    lin.weight.data.copy_(dequantize_groups(q, s, z, group_size).to(lin.weight.device, lin.weight.dtype))


def pack_module(module: nn.Module, results: Quantized, config: WeightOnlyConfig) -> dict[str, Any]:
    """Replace quantized ``nn.Linear`` layers by ``QuantLinear`` and quantize the head.

    Every replacement is checked on the spot (``check_replacement``): on a small probe it must
    compute what the original module computes with the dequantized weight (its own forward:
    a scaled embedding's factor, a bias, a custom forward), else ``CheckFailedError``."""
    layers: dict[str, Any] = {}
    for name, (q, s, z) in results.items():
        lin = _get(module, name)
        qlin = QuantLinear.from_quantized(q, s, z, config.bits, config.group_size, lin.bias)
        check_replacement(name, lin, qlin)
        _set(module, name, qlin)
        layers[name] = {"in": lin.in_features, "out": lin.out_features, "bits": config.bits,
                        "group_size": config.group_size, "bias": lin.bias is not None}
    meta: dict[str, Any] = {"layers": layers, "head": None, "embedding": None, "tied": False}
    head, emb = head_layers(module)
    if head is not None and config.head != "none":
        hbits = 8 if config.head == "int8" else 4
        hgroup = config.group_size
        lin = _get(module, head)
        tied = emb is not None and _get(module, emb).weight.data_ptr() == lin.weight.data_ptr()
        q, s, z = rtn_quantize(lin.weight.detach(), hbits, hgroup, config.sym)
        qhead = QuantLinear.from_quantized(q, s, z, hbits, hgroup, lin.bias)
        check_replacement(head, lin, qhead)
        qemb = None
        if emb is not None:
            e = _get(module, emb)
            qemb = QuantEmbedding(e.num_embeddings, e.embedding_dim, hbits, hgroup, e.padding_idx,
                                  scale=embedding_scale(e))
            if tied:
                qemb.tie_to(qhead)
            else:
                qemb.set_quantized(*rtn_quantize(e.weight.detach(), hbits, hgroup, config.sym))
            check_replacement(emb, e, qemb)
        _set(module, head, qhead)
        meta["head"] = {"name": head, "in": lin.in_features, "out": lin.out_features, "bits": hbits,
                        "group_size": hgroup, "bias": lin.bias is not None}
        if emb is not None and qemb is not None:
            _set(module, emb, qemb)
            meta["embedding"] = {"name": emb, "rows": qemb.num_embeddings, "dim": qemb.embedding_dim, "bits": hbits,
                                 "group_size": hgroup, "padding_idx": qemb.padding_idx, "scale": qemb.scale}
            meta["tied"] = tied
        _untie_config(module)
    return meta


PROBE_ROWS = 64  # output rows / table rows a replacement is checked on


@torch.no_grad()
def check_replacement(name: str, original: nn.Module, packed: nn.Module) -> None:
    """Raise ``CheckFailedError`` unless ``packed`` computes what ``original`` computes with the
    dequantized weight, on a tiny probe (a few inputs, ``PROBE_ROWS`` rows of the weight): the
    original's own forward runs (``torch.func.functional_call``), so whatever it does besides
    the matrix product or lookup (a scale, a bias, a custom op) must be reproduced."""
    from torch.func import functional_call

    w = original.weight
    if isinstance(packed, QuantEmbedding):
        rows = min(PROBE_ROWS, packed.num_embeddings)
        ids = torch.linspace(0, packed.num_embeddings - 1, rows).long()
        table = torch.cat([packed.dequantize_rows(int(i), int(i) + 1) for i in ids]).to(w.dtype)
        probe = copy.copy(original)  # padding_idx changes gradients only, and may lie beyond the probe's rows
        if getattr(probe, "padding_idx", None) is not None:
            probe.padding_idx = None
        try:
            want = functional_call(probe, {"weight": table}, (torch.arange(rows)[None],))
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise CheckFailedError(f"cannot check the packed replacement of {name!r} ({type(original).__name__}): "
                                   f"{e}") from None
        got = packed(ids[None])
    else:
        rows = min(PROBE_ROWS, packed.out_features)
        x = torch.randn(2, packed.in_features, generator=torch.Generator().manual_seed(0)).to(w.dtype)
        params = {"weight": packed.dequantize_rows(0, rows).to(w.dtype)}
        if getattr(original, "bias", None) is not None:
            params["bias"] = original.bias[:rows]
        try:
            want = functional_call(original, params, (x,))
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise CheckFailedError(f"cannot check the packed replacement of {name!r} ({type(original).__name__}): "
                                   f"{e}") from None
        got = packed(x)[..., :rows]
    scale = float(want.abs().max()) if want.numel() else 0.0
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5 * max(scale, 1.0)):
        diff = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else float("nan")
        raise CheckFailedError(f"packing {name!r} would change what the model computes: {type(original).__name__}'s "
                               f"forward differs from the packed layer's by up to {diff:.3g} (output magnitude "
                               f"{scale:.3g}) on a probe input; edgekit does not replace modules it cannot reproduce")


def _untie_config(module: nn.Module) -> None:
    """Stop transformers from re-tying (replacing) the packed head and embedding."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False


def apply(handle: ModelHandle, config: WeightOnlyConfig, ctx: StepContext) -> ModelHandle:
    """Quantize ``handle.module`` (in place) and pack it; records the layers in the step meta."""
    if handle.module is None:
        raise BadInputError(f"{handle.name} is an ONNX-only model; weight-only quantization needs the PyTorch model")
    module = handle.module
    module.eval()
    device = config.device if config.device != "cpu" else (ctx.device if ctx.device in DEVICES else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu" if config.device == "cpu" else device
    if device != config.device:
        from dataclasses import replace

        config = replace(config, device=device)
    calib = calibration_inputs(handle, config, ctx) if config.method != "rtn" else None
    windows = _eval_windows(handle, config, ctx)
    float_bytes = packed_bytes(module)
    ppl_float = _perplexity(handle, windows, ctx) if windows is not None else None
    results, info = quantize_module(module, config, calib, progress=ctx.progress)
    meta = pack_module(module, results, config)
    meta.update(info)
    meta["packed_bytes"] = packed_bytes(module)
    meta["parity"] = dict(zip(("atol", "rtol"), PARITY_TOLERANCE))
    ctx.metrics["int4"] = {"method": config.method, "bits": config.bits, "group_size": config.group_size,
                           "seconds": info["seconds"], "layers": len(results), "packed_bytes": meta["packed_bytes"],
                           "float_bytes": float_bytes,
                           **({"calib_windows": info["calib_windows"]} if "calib_windows" in info else {})}
    if windows is not None:
        ppl = _perplexity(handle, windows, ctx)
        ctx.metrics["int4"].update({"perplexity_float": round(ppl_float, 4), "perplexity": round(ppl, 4),
                                    "eval": f"{windows.source} eval split, {len(windows)} x {windows.inputs['input_ids'].shape[1]} tokens"})
        meta["perplexity"] = {"float": ppl_float, "quantized": ppl, "windows": len(windows)}
    handle.steps.append(StepRecord("int4", config_to_dict(config), meta))
    return handle


def _eval_windows(handle: ModelHandle, config: WeightOnlyConfig, ctx: StepContext) -> Any:
    """The first ``eval_windows`` windows of the eval split, for a causal LM that has eval data."""
    if config.eval_windows == 0 or handle.kind != "causal-lm" or not (ctx.eval or handle.default_eval):
        return None
    if ctx.quality_reference is not None:  # compress() measures against the float model itself
        return None
    from edgekit.sources.data import resolve_samples

    samples = resolve_samples(ctx.eval or handle.default_eval, handle, "eval", config.eval_windows, config.seqlen,
                              ctx.seed)
    if "input_ids" not in samples.inputs:
        return None
    return samples.subset(slice(0, config.eval_windows)) if len(samples) > config.eval_windows else samples


def _perplexity(handle: ModelHandle, windows: Any, ctx: StepContext) -> float:
    from edgekit.evaluate import perplexity

    return perplexity(handle, windows, progress=ctx.progress)


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the model's tensors as stored (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def rebuild(handle: ModelHandle, config: WeightOnlyConfig, record: StepRecord) -> ModelHandle:
    """Recreate the packed modules named in ``record.meta`` (placeholders; weights load next)."""
    module = handle.module
    meta = record.meta or {}
    try:
        for name, spec in meta.get("layers", {}).items():
            _set(module, name, QuantLinear(int(spec["in"]), int(spec["out"]), int(spec["bits"]),
                                           int(spec["group_size"]), bool(spec["bias"])))
        head = meta.get("head")
        if head:
            qhead = QuantLinear(int(head["in"]), int(head["out"]), int(head["bits"]), int(head["group_size"]),
                                bool(head["bias"]))
            _set(module, head["name"], qhead)
            emb = meta.get("embedding")
            if emb:
                qemb = QuantEmbedding(int(emb["rows"]), int(emb["dim"]), int(emb["bits"]), int(emb["group_size"]),
                                      emb.get("padding_idx"), scale=float(emb.get("scale", 1.0)))
                if meta.get("tied"):
                    qemb.tie_to(qhead)
                _set(module, emb["name"], qemb)
            _untie_config(module)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"the int4 step record does not fit model {handle.name}: {e}") from None
    return handle


def validate_packed(module: nn.Module) -> None:
    """Raise BadInputError when a loaded packed layer's buffers are inconsistent."""
    for name, m in module.named_modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            try:
                m.check(name)
                if int(m.zeros().max()) > 2**m.bits - 1:
                    raise ValueError(f"{name}.qzeros holds codes beyond {m.bits} bits")
            except ValueError as e:
                raise BadInputError(f"corrupt packed checkpoint: {e}") from None


def rewrite_onnx(model: Any, handle: ModelHandle, record: StepRecord) -> Any:
    """Replace the exported dequantize-then-matmul of each packed layer by ``MatMulNBits``
    (and the packed embedding lookup by ``GatherBlockQuantized``); see ``export/lm.py``."""
    from edgekit.export.lm import rewrite_packed_graph

    # fp32 compute, exact against PyTorch (the plain export's parity is strict); the causal-LM export
    # with the KV cache (``export_causal_lm``, ``edgekit export --kv-cache``) defaults to int8 compute
    return rewrite_packed_graph(model, handle.module, fmt="matmulnbits")


STEP = Step(
    name="int4",
    config=WeightOnlyConfig,
    apply=apply,
    description="weight-only low-bit quantization (GPTQ, AWQ or RTN) with real int4 packing",
    rebuild=rebuild,
    rewrite_onnx=rewrite_onnx,
    transitions={"float": "packed"},
)

__all__ = ["STEP", "WeightOnlyConfig", "apply", "rebuild", "rewrite_onnx", "quantize_module", "pack_module",
           "find_blocks", "BlockWalker"]
