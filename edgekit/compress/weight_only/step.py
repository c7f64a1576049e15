"""Weight-only low-bit quantization (the ``weight-only`` step): GPTQ, AWQ or RTN, then real packing.

``apply`` quantizes every ``nn.Linear`` inside the model's transformer blocks (or of the
whole model when it has none) to ``bits`` with per-group scales and zero points, replaces
them by packed ``QuantLinear`` modules (``packing.py`` documents the layout) and, for a
causal LM, quantizes the LM head and its tied embedding table (``head``, 8 bits by default).

Calibrated methods walk the model **block by block** (``blocks.BlockWalker``): each group
of linears sharing one input is handed, with its calibration inputs, to the method's
callback (``gptq.gptq_visit``, ``awq.awq_visit``), which quantizes it in place before the
walk moves on. transformers' ``Conv1D`` layers (GPT-2) are first swapped for the
``nn.Linear`` they compute (``families.linearize``, checked on the spot).

>>> from edgekit.compress import compress
>>> compress("smollm2-135m", [("weight-only", WeightOnlyConfig())], "out/w4")  # doctest: +SKIP
"""
from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from edgekit.compress import WEIGHT_ONLY_STEP, Step, StepContext, config_to_dict, step_rewrite
from edgekit.compress.families import embedding_scale, linearize
from edgekit.compress.quality import BOUNDS_4BIT, BOUNDS_8BIT
from edgekit.compress.weight_only.awq import awq_visit
from edgekit.compress.weight_only.blocks import (
    BlockWalker,
    Quantized,
    check_blocks,
    expert_routers,
    find_blocks,
    head_layers,
    linear_at,
    quantizable_linears,
    replace_module,
    submodule,
    upcast_half,
    value_projection,
)
from edgekit.compress.weight_only.config import DEVICES, GPTQ_METHODS, HIGH_BITS, WeightOnlyConfig
from edgekit.compress.weight_only.gptq import gptq_visit, one_thread
from edgekit.compress.weight_only.gptq_config import GptqConfig
from edgekit.compress.weight_only.mixed import allocate, layer_bytes, make_units, sensitivities
from edgekit.compress.weight_only.packing import QuantEmbedding, QuantLinear, packed_bytes
from edgekit.compress.weight_only.rtn import dequantize_groups, rtn_quantize
from edgekit.compress.weight_only.rtn_config import RtnConfig
from edgekit.errors import BadInputError, CheckFailedError, UnavailableError
from edgekit.evaluate import perplexity
from edgekit.export.lm import rewrite_packed_graph
from edgekit.memory import drop_file_pages, float32_compute, release_memory
from edgekit.sources.data import load_samples, random_token_windows, resolve_samples
from edgekit.sources.handle import ModelHandle, StepRecord

log = logging.getLogger(__name__)

# Export parity of MatMulNBits (fp32 compute) against the PyTorch packed model: the same codes, but ONNX
# Runtime dequantizes and accumulates blockwise in another order; through SmolLM2's 30 blocks the logits
# (magnitude ~30) differ by up to 1.7e-4, over the plain export's 1e-4.
PARITY_TOLERANCE = (2e-3, 2e-3)

# --- calibration data -----------------------------------------------------------------------------


def calibration_inputs(handle: ModelHandle, config: WeightOnlyConfig, ctx: StepContext) -> list[torch.Tensor]:
    """Calibration samples as one tensor per model input (axis 0 = sample)."""
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
        more = random_token_windows(handle.tokenizer, samples.text, int(samples.meta["seqlen"]), extra,
                                    seed=ctx.seed, prefix=samples.meta.get("prefix", ()))
        inputs["input_ids"] = np.concatenate([inputs["input_ids"], more])
        if "attention_mask" in inputs:
            inputs["attention_mask"] = np.concatenate([inputs["attention_mask"], np.ones_like(more)])
    return [torch.from_numpy(np.ascontiguousarray(inputs[k])) for k in names]


# --- apply / rebuild ------------------------------------------------------------------------------



def _check_layers(linears: dict[str, nn.Linear], config: WeightOnlyConfig) -> None:
    for name, lin in linears.items():
        if config.group_size != -1 and config.group_size > lin.in_features:
            raise BadInputError(f"group size {config.group_size} is larger than layer {name!r}'s {lin.in_features} "
                                "input features (choose a smaller group size or -1 for per-channel)")


def mixed_bits(module: nn.Module, linears: dict[str, nn.Linear], config: WeightOnlyConfig,
               calib: list[torch.Tensor]) -> tuple[dict[str, int], dict[str, Any]]:
    """Mixed precision (``mixed.py``): the bit width of each block linear within the config's size
    budget, and the choice as step metadata. ``module`` is a causal LM; ``calib[0]`` its token windows."""
    groups = BlockWalker(module, [t[:1] for t in calib], progress=False).groups(linears)
    units = make_units(module, groups, config.bits, config.group_size)
    units = sensitivities(module, units, calib[0][:config.sensitivity_windows], config.bits, config.group_size,
                          config.sym)
    weights = sum(u.weights for u in units)
    if config.avg_bits is not None:
        budget, fixed, what = config.avg_bits * weights / 8, 0.0, f"{config.avg_bits:g} bits per weight"
    else:
        budget, fixed = float(config.max_size_mb or 0) * 1e6, float(_other_bytes(module, linears, config))
        what = f"{config.max_size_mb:g} MB"
    try:
        high = allocate(units, budget, fixed)
    except BadInputError as e:
        low = sum(u.low_bytes for u in units)
        raise BadInputError(f"{e}: {what} is below the smallest {config.bits}-bit model ("
                            f"{8 * low / weights:.2f} bits per weight, {(fixed + low) / 1e6:.2f} MB in all)") from None
    bits = {n: (HIGH_BITS if h else config.bits) for u, h in zip(units, high, strict=True) for n in u.names}
    unit_bytes = sum(u.high_bytes if h else u.low_bytes for u, h in zip(units, high, strict=True))
    meta = {"budget": what, "sensitivity_windows": int(min(config.sensitivity_windows, calib[0].shape[0])),
            "high_bits": HIGH_BITS, "high_units": int(sum(high)), "units_total": len(units),
            "avg_bits": round(8 * unit_bytes / weights, 4), "predicted_bytes": int(fixed + unit_bytes),
            "units": [{"names": list(u.names), "bits": HIGH_BITS if h else config.bits,
                       "sensitivity": u.sensitivity, "low_bytes": u.low_bytes, "high_bytes": u.high_bytes}
                      for u, h in zip(units, high, strict=True)]}
    return bits, meta


def _other_bytes(module: nn.Module, linears: dict[str, nn.Linear], config: WeightOnlyConfig) -> int:
    """Bytes of everything but the block linears once packed: the head and its tied or own embedding
    table at the head's bit width (``config.head``), the rest (norms, ...) as it is."""
    total = packed_bytes(module) - sum(packed_bytes(lin) for lin in linears.values())
    head, emb = head_layers(module)
    if head is None or config.head == "none":
        return total
    hbits = 8 if config.head == "int8" else 4
    lin = linear_at(module, head)
    total += layer_bytes(lin.out_features, lin.in_features, hbits, config.group_size, lin.bias is not None) - \
        packed_bytes(lin)
    if emb is not None:
        e = _embedding_at(module, emb)
        if e.weight.data_ptr() != lin.weight.data_ptr():  # untied: its own packed table
            total += layer_bytes(e.num_embeddings, e.embedding_dim, hbits, config.group_size) - packed_bytes(e)
    return total


def quantize_module(module: nn.Module, config: WeightOnlyConfig, calib: list[torch.Tensor] | None = None,
                    progress: bool = False, bits: dict[str, int] | None = None,
                    after_block: Callable[[Quantized], None] | None = None) -> tuple[Quantized, dict[str, Any]]:
    """Quantize the block linears of ``module`` in place (weights set to their dequantized
    values) and return their codes. ``calib`` is needed by GPTQ and AWQ. transformers' ``Conv1D``
    layers (GPT-2) first become the ``nn.Linear`` they compute (``families.linearize``).
    ``bits``: a bit width per linear where it is not ``config.bits`` (``mixed_bits``).
    ``after_block(codes)``: called with a block's codes once its linears are final (``apply`` packs
    them there, so a model stored in half precision holds one block in float32 at a time); the codes
    it was handed are then dropped from the returned dict: one byte per weight kept for the whole
    model would be half the size of its bfloat16 weights."""
    converted = linearize(module)
    prefix, blocks, linears = quantizable_linears(module)
    check_blocks(module, prefix, blocks)
    if not linears:
        raise BadInputError("the model has no linear layers to quantize (weight-only quantization "
                            "acts on nn.Linear layers)")
    _check_layers(linears, config)
    device = config.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UnavailableError("device 'cuda' asked for but CUDA is not available here (use --device cpu)")
    results: Quantized = {}
    info: dict[str, Any] = {"blocks": len(blocks), "block_prefix": prefix}
    routers = expert_routers(module)
    if routers:
        info["routers_in_float"] = routers
    # matrices of the blocks that are no nn.Linear (Llama 4's experts: one (experts, in, out) tensor):
    # left in float, said in the report rather than silently
    in_linears = {id(lin.weight) for lin in linears.values()}
    unpacked = [f"{prefix}.{b_i}.{n}" for b_i, b in enumerate(blocks) for n, p in b.named_parameters()
                if p.dim() >= 2 and id(p) not in in_linears and not n.endswith(tuple(f"{r.rpartition('.')[2]}.weight"
                                                                                          for r in routers))]
    if unpacked:
        info["float_matrices"] = unpacked
        log.warning("%d weight tensors of the blocks are not nn.Linear layers and stay in float (%s)", len(unpacked),
                    ", ".join(unpacked[:4]) + (" ..." if len(unpacked) > 4 else ""))
    if converted:
        info["conv1d_as_linear"] = len(converted)
    def hand_over(names: list[str]) -> None:  # a final block's codes to after_block, then out of memory
        if after_block is not None:
            after_block({n: results[n] for n in names})
            for n in names:  # after_block replaced the layers: their float weights go with the last reference
                del results[n]
                linears.pop(n, None)

    t0, c0 = time.perf_counter(), time.process_time()
    method = config.method_config()  # what the method's algorithm reads, and nothing else
    if isinstance(method, RtnConfig):
        for block in blocks:
            upcast_half(block)
            names = [n for n, lin in linears.items() if any(lin is m for m in block.modules())]
            for name in names:
                lin = linears[name]
                b = bits.get(name, method.bits) if bits else method.bits
                q, s, z = rtn_quantize(lin.weight.detach().to(device), b, method.group_size, method.sym)
                results[name] = (q.cpu(), s.cpu(), z.cpu())
                _set_weight(lin, q, s, z, method.group_size)
            if after_block is not None:
                hand_over(names)
    else:
        if calib is None:
            raise BadInputError(f"method {config.method!r} needs calibration data")
        module.to(device)
        # AWQ folds its scales into the layer before each group, which a replayed pass would not see
        walker = BlockWalker(module, calib, device=device, progress=progress,
                             track_float=isinstance(method, GptqConfig) and method.gptaq_alpha > 0,
                             reuse_factor=0.0 if config.method.startswith("awq") else 4.0,
                             float_samples=config.gptaq_windows)
        experts: dict[str, Any] = {}  # mixture of experts: routed rows, experts no calibration token reached
        visit = gptq_visit(module, method, results, bits, experts) if isinstance(method, GptqConfig) else \
            awq_visit(module, method, results, bits)
        walker.walk(linears, visit, None if after_block is None else hand_over)
        if experts:
            info["experts"] = experts
        unseen = experts.get("without_calibration_tokens", [])
        if unseen:
            log.warning("%d layers of experts saw no calibration token and were rounded to nearest (RTN): %s",
                        len(unseen), ", ".join(unseen[:6]) + (" ..." if len(unseen) > 6 else ""))
        module.to("cpu")
        info["calib_windows"] = int(calib[0].shape[0])
        info["calib_tokens"] = int(calib[0].numel())
    info["seconds"] = round(time.perf_counter() - t0, 2)
    info["cpu_seconds"] = round(time.process_time() - c0, 2)  # wall time lies on a shared machine
    return results, info


def _set_weight(lin: nn.Linear, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int) -> None:
    lin.weight.data.copy_(dequantize_groups(q, s, z, group_size).to(lin.weight.device, lin.weight.dtype))


def pack_layers(module: nn.Module, results: Quantized, config: WeightOnlyConfig,
                bits: dict[str, int] | None = None) -> dict[str, Any]:
    """Replace the quantized ``nn.Linear`` layers named in ``results`` by ``QuantLinear``; returns
    their records (``meta.layers``). ``bits``: a bit width per linear where it is not ``config.bits``.
    Every replacement is checked on the spot (``check_replacement``)."""
    layers: dict[str, Any] = {}
    for name, (q, s, z) in results.items():
        lin = linear_at(module, name)
        b = bits.get(name, config.bits) if bits else config.bits
        qlin = QuantLinear.from_quantized(q, s, z, b, config.group_size, lin.bias)
        check_replacement(name, lin, qlin)
        replace_module(module, name, qlin)
        layers[name] = {"in": lin.in_features, "out": lin.out_features, "bits": b,
                        "group_size": config.group_size, "bias": lin.bias is not None}
    return layers


def pack_module(module: nn.Module, results: Quantized, config: WeightOnlyConfig,
                bits: dict[str, int] | None = None) -> dict[str, Any]:
    """Replace quantized ``nn.Linear`` layers by ``QuantLinear`` (``pack_layers``) and quantize the head.

    Every replacement is checked on the spot (``check_replacement``): on a small probe it must
    compute what the original module computes with the dequantized weight (its own forward:
    a scaled embedding's factor, a bias, a custom forward), else ``CheckFailedError``."""
    return pack_head(module, config, pack_layers(module, results, config, bits))


def pack_head(module: nn.Module, config: WeightOnlyConfig, layers: dict[str, Any]) -> dict[str, Any]:
    """Quantize the LM head and its tied or own embedding table (``config.head``); the step meta
    with the packed ``layers``."""
    meta: dict[str, Any] = {"layers": layers, "head": None, "embedding": None, "tied": False}
    head, emb = head_layers(module)
    if head is not None and config.head != "none":
        hbits = 8 if config.head == "int8" else 4
        hgroup = config.group_size
        lin = linear_at(module, head)
        e = _embedding_at(module, emb) if emb is not None else None
        tied = e is not None and e.weight.data_ptr() == lin.weight.data_ptr()
        # a memory-mapped half-precision head (or tied table: 272 MB at Qwen2.5-0.5B's 151,936 x 896) lets its
        # pages go as each block of rows is rounded, not all at once at the end (the compress peak was here)
        q, s, z = rtn_quantize(lin.weight.detach(), hbits, hgroup, config.sym,
                               done_with=lambda rows: drop_file_pages([rows]))
        qhead = QuantLinear.from_quantized(q, s, z, hbits, hgroup, lin.bias)
        check_replacement(head, lin, qhead)
        qemb = None
        if emb is not None and e is not None:
            qemb = QuantEmbedding(e.num_embeddings, e.embedding_dim, hbits, hgroup, e.padding_idx,
                                  scale=embedding_scale(e))
            if tied:
                qemb.tie_to(qhead)
            else:
                qemb.set_quantized(*rtn_quantize(e.weight.detach(), hbits, hgroup, config.sym,
                                                 done_with=lambda rows: drop_file_pages([rows])))
            check_replacement(emb, e, qemb)
        replace_module(module, head, qhead)
        drop_file_pages([lin.weight, *([e.weight] if e is not None and not tied else [])])  # replaced: unread from now
        meta["head"] = {"name": head, "in": lin.in_features, "out": lin.out_features, "bits": hbits,
                        "group_size": hgroup, "bias": lin.bias is not None}
        if emb is not None and qemb is not None:
            replace_module(module, emb, qemb)
            meta["embedding"] = {"name": emb, "rows": qemb.num_embeddings, "dim": qemb.embedding_dim, "bits": hbits,
                                 "group_size": hgroup, "padding_idx": qemb.padding_idx, "scale": qemb.scale}
            meta["tied"] = tied
        _untie_config(module)
    return meta


def _embedding_at(module: nn.Module, name: str) -> nn.Embedding:
    m = submodule(module, name)
    if not isinstance(m, nn.Embedding):
        raise TypeError(f"{name!r} is a {type(m).__name__}, not nn.Embedding")
    return m


PROBE_ROWS = 64  # output rows / table rows a replacement is checked on


@torch.no_grad()
def check_replacement(name: str, original: nn.Module, packed: QuantLinear | QuantEmbedding) -> None:
    """Raise ``CheckFailedError`` unless ``packed`` computes what ``original`` computes with the
    dequantized weight, on a tiny probe (a few inputs, ``PROBE_ROWS`` rows of the weight): the
    original's own forward runs (``torch.func.functional_call``), so whatever it does besides
    the matrix product or lookup (a scale, a bias, a custom op) must be reproduced."""
    w = getattr(original, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise CheckFailedError(f"cannot check the packed replacement of {name!r} ({type(original).__name__}): "
                               "it has no weight tensor")
    if isinstance(packed, QuantEmbedding):
        rows = min(PROBE_ROWS, packed.num_embeddings)
        ids = torch.linspace(0, packed.num_embeddings - 1, rows).long()
        table = torch.cat([packed.dequantize_rows(int(i), int(i) + 1) for i in ids]).float()
        probe: Any = copy.copy(original)  # a shallow copy of the original module; padding_idx changes gradients only, and may lie beyond the probe's rows
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
        # in float32 (what the packed layer computes in), also for an original stored in half precision
        x = torch.randn(2, packed.in_features, generator=torch.Generator().manual_seed(0))
        params = {"weight": packed.dequantize_rows(0, rows).float()}
        bias = getattr(original, "bias", None)
        if isinstance(bias, torch.Tensor):
            params["bias"] = bias[:rows].float()
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


_paper_gptq_told: list[bool] = []  # whether this process said what "gptq" now means


def apply(handle: ModelHandle, config: WeightOnlyConfig, ctx: StepContext) -> ModelHandle:
    """Quantize ``handle.module`` (in place) and pack it; records the layers in the step meta."""
    if handle.module is None:
        raise BadInputError(f"{handle.name} is an ONNX-only model; weight-only quantization needs the PyTorch model")
    if config.method == "gptq" and not _paper_gptq_told:
        _paper_gptq_told.append(True)  # one line per process: a sweep or recipe may run it many times
        log.warning("weight-only: method 'gptq' is the paper's GPTQ (min-max grids, columns in order, the input "
                    "Hessian); the default 'gptq-plus' adds act-order, MSE grids, refit, GPTAQ and the value "
                    "Hessian (SmolLM2-135M W4 g128 perplexity 25.73 against 33.76, RTN 29.98); before this "
                    "release 'gptq' meant gptq-plus")
    module = handle.module
    module.eval()
    device = config.device if config.device != "cpu" else (ctx.device if ctx.device in DEVICES else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu" if config.device == "cpu" else device
    if device != config.device:
        config = replace(config, device=device)
    if config.mixed and (handle.kind != "causal-lm" or [i.name for i in handle.inputs][:1] != ["input_ids"]):
        raise BadInputError(f"mixed precision (--max-size-mb, --avg-bits) measures each layer's cost on the "
                            f"language-model loss; {handle.name} is a {handle.kind} model, not a causal LM")
    calib = calibration_inputs(handle, config, ctx) if config.method != "rtn" or config.mixed else None
    windows = _eval_windows(handle, config, ctx)
    float_bytes = packed_bytes(module)
    with float32_compute(module):
        ppl_float = _perplexity(handle, windows, ctx) if windows is not None else None
    bits: dict[str, int] | None = None
    mixed: dict[str, Any] | None = None
    if config.mixed and calib is not None:
        upcast_half(module)  # its backward pass needs the float32 model (mixed.sensitivities)
        linearize(module)
        bits, mixed = mixed_bits(module, quantizable_linears(module)[2], config, calib)
    layers: dict[str, Any] = {}

    def pack_block(codes: Quantized) -> None:  # as each block is final: a half-stored model stays so
        with one_thread():  # small copies and a probe per layer: a second thread only waits (gptq.one_thread)
            layers.update(pack_layers(module, codes, config, bits))
        # the block's float32 weights and codes are freed, but glibc keeps the pages for reuse and later
        # blocks' tensors do not fit the holes: measured at 0.5B, the heap grew by ~0.75 GB over the walk
        # without this, by the packed layers' ~7 MB a block with it. Those tensors go by reference count: no
        # garbage collection here (measured on SmolLM2-135M RTN: 18.0 -> 6.8 CPU s, peak 1,286 -> 1,254 MB)
        release_memory(collect=False)

    _, info = quantize_module(module, config, calib, progress=ctx.progress, bits=bits, after_block=pack_block)
    meta = pack_head(module, config, layers)
    upcast_half(module)  # what is left in half precision (norms, an unquantized head) computes in float32
    release_memory()  # the head's codes and float32 blocks of rows
    meta.update(info)
    meta["packed_bytes"] = packed_bytes(module)
    if mixed is not None:
        meta["mixed"] = mixed
        if config.max_size_mb is not None and meta["packed_bytes"] > config.max_size_mb * 1e6:
            raise CheckFailedError(f"mixed precision planned {mixed['predicted_bytes'] / 1e6:.2f} MB within "
                                   f"{config.max_size_mb:g} MB, but the packed model is "
                                   f"{meta['packed_bytes'] / 1e6:.2f} MB")
    meta["parity"] = dict(zip(("atol", "rtol"), PARITY_TOLERANCE))
    report = ctx.metrics[WEIGHT_ONLY_STEP] = {
        "method": config.method, "bits": config.bits, "group_size": config.group_size,
        # GPTQ's options as they ran (the config records None for "the method's own setting")
        **({"gptq": {**config.gptq_options(), "mse_grid": config.grid_search,
                     "value_query_stride": config.value_query_stride}} if config.method in GPTQ_METHODS else {}),
        "seconds": info["seconds"], "layers": len(layers), "packed_bytes": meta["packed_bytes"],
        "float_bytes": float_bytes,
        **({"mixed": {k: mixed[k] for k in ("budget", "avg_bits", "high_units", "units_total")}}
           if mixed is not None else {}),
        **({"calib_windows": info["calib_windows"]} if "calib_windows" in info else {}),
        # what stayed in float and which experts calibration missed: in the report, not silent
        **{k: info[k] for k in ("routers_in_float", "float_matrices", "experts") if k in info}}
    if windows is not None and ppl_float is not None:
        ppl = _perplexity(handle, windows, ctx)
        report.update({"perplexity_float": round(ppl_float, 4), "perplexity": round(ppl, 4),
                       "eval": f"{windows.source} eval split, {len(windows)} x {windows.inputs['input_ids'].shape[1]} tokens"})
        meta["perplexity"] = {"float": ppl_float, "quantized": ppl, "windows": len(windows)}
    handle.steps.append(StepRecord(WEIGHT_ONLY_STEP, config_to_dict(config), meta))
    handle.step_rewrites = step_rewrite  # export applies the steps' graph rewrites
    return handle


def _eval_windows(handle: ModelHandle, config: WeightOnlyConfig, ctx: StepContext) -> Any:
    """The first ``eval_windows`` windows of the eval split, for a causal LM that has eval data."""
    if config.eval_windows == 0 or handle.kind != "causal-lm" or not (ctx.eval or handle.default_eval):
        return None
    if ctx.quality_reference is not None:  # compress() measures against the float model itself
        return None
    samples = resolve_samples(ctx.eval or handle.default_eval, handle, "eval", config.eval_windows, config.seqlen,
                              ctx.seed)
    if "input_ids" not in samples.inputs:
        return None
    return samples.subset(slice(0, config.eval_windows)) if len(samples) > config.eval_windows else samples


def _perplexity(handle: ModelHandle, windows: Any, ctx: StepContext) -> float:
    return perplexity(handle, windows, progress=ctx.progress)


def rebuild(handle: ModelHandle, config: WeightOnlyConfig, record: StepRecord) -> ModelHandle:
    """Recreate the packed modules named in ``record.meta`` (placeholders; weights load next)."""
    module = handle.module
    meta = record.meta or {}
    try:
        for name, spec in meta.get("layers", {}).items():
            replace_module(module, name, QuantLinear(int(spec["in"]), int(spec["out"]), int(spec["bits"]),
                                           int(spec["group_size"]), bool(spec["bias"])))
        head = meta.get("head")
        if head:
            qhead = QuantLinear(int(head["in"]), int(head["out"]), int(head["bits"]), int(head["group_size"]),
                                bool(head["bias"]))
            replace_module(module, head["name"], qhead)
            emb = meta.get("embedding")
            if emb:
                qemb = QuantEmbedding(int(emb["rows"]), int(emb["dim"]), int(emb["bits"]), int(emb["group_size"]),
                                      emb.get("padding_idx"), scale=float(emb.get("scale", 1.0)))
                if meta.get("tied"):
                    qemb.tie_to(qhead)
                replace_module(module, emb["name"], qemb)
            _untie_config(module)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise BadInputError(f"the {WEIGHT_ONLY_STEP} step record does not fit model {handle.name}: {e}") from None
    return handle


def rewrite_onnx(model: Any, handle: ModelHandle, record: StepRecord) -> Any:
    """Replace the exported dequantize-then-matmul of each packed layer by ``MatMulNBits``
    (and the packed embedding lookup by ``GatherBlockQuantized``); see ``export/lm.py``."""
    # fp32 compute, exact against PyTorch (the plain export's parity is strict); the causal-LM export
    # with the KV cache (``export_causal_lm``, ``edgekit export --kv-cache``) defaults to int8 compute
    return rewrite_packed_graph(model, handle.module, fmt="matmulnbits")


STEP = Step(
    name=WEIGHT_ONLY_STEP,
    config=WeightOnlyConfig,
    apply=apply,
    description="weight-only low-bit quantization (GPTQ, AWQ or RTN) with real packing of the low-bit codes",
    rebuild=rebuild,
    rewrite_onnx=rewrite_onnx,
    transitions={"float": "packed"},
    bounds=lambda config: BOUNDS_4BIT if config.bits <= 4 else BOUNDS_8BIT,
    half_storage=True,
)

__all__ = ["STEP", "WeightOnlyConfig", "apply", "rebuild", "rewrite_onnx", "quantize_module", "pack_module",
           "pack_layers", "pack_head", "mixed_bits",
           "find_blocks", "BlockWalker", "quantizable_linears", "value_projection", "check_blocks", "head_layers"]
