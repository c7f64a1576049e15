"""A fused ONNX decoder graph for Llama-, Gemma- and Falcon-family causal LMs, written from the model's own weights.

The traced graph of a causal LM (``export_causal_lm`` with ``graph="optimum"``) holds about a
thousand small nodes (RMSNorm as Pow/ReduceMean/Sqrt/Div/Mul, rotary embeddings as Slice/Neg/
Concat, attention as MatMul/Softmax/Where, the KV cache as Concat). On a CPU each node costs a
few microseconds of dispatch whatever its size, and the cache is copied every step. This module
writes the graph ONNX Runtime's GenAI model builder writes, from edgekit's packed weights:

* ``com.microsoft::SkipSimplifiedLayerNormalization`` (RMSNorm fused with the residual add; the
  first layer's norm, which has no residual, is written in standard ops that ONNX Runtime fuses
  into ``SimplifiedLayerNormalization``);
* one ``com.microsoft::MatMulNBits`` for q, k and v together, one for gate and up together
  (packed rows concatenated: exact, no re-quantization), one each for o and down;
* ``com.microsoft::GroupQueryAttention`` with the rotary embedding inside (``do_rotary``) and the
  KV cache as ``past``/``present`` (BNSH); fed a past buffer of the maximum length and bound to
  the same memory as its present output, it appends in place (no copy per step). Its cos/sin
  tables come from the model's rotary module (``rope.py``): a fixed type's tables cover the
  context the config declares and are folded as the session loads; dynamic NTK and longrope
  choose their ``inv_freq`` from ``max(position_ids) + 1`` in the graph each forward, as
  transformers does, and compute the rows of that forward's positions;
* ``com.microsoft::QuickGelu`` with ``alpha = 1`` (x * sigmoid(x): SiLU) for the gate, or
  ``com.microsoft::FastGelu`` (the tanh approximation) for Gemma's ``gelu_pytorch_tanh``;
* the LM head as ``MatMulNBits`` (the packed 8-bit or 4-bit head) or a float MatMul, the
  embedding as ``com.microsoft::GatherBlockQuantized`` or a float Gather.

Inputs and outputs keep the names of the traced graph (``input_ids``, ``attention_mask``,
``past_key_values.{i}.key/value`` -> ``logits``, ``present.{i}.key/value``), so every caller of
an exported causal LM runs either graph (``position_ids`` feeds the rotary embedding inside the
attention; sequences are left-aligned, without padding inside a row).

Gemma 2 and 3 (``ARCHS``) add what their layers compute: the embedding scaled by sqrt(hidden),
RMSNorm by ``(1 + w)`` (the weight written as ``1 + w``), four norms per layer (the outputs of
attention and MLP normed before each residual add), per-head q/k norms before the rotary
embedding (Gemma 3: the attention then takes q, k and v apart), sliding-window layers
(``local_window_size``) with their own rotary base, ``query_pre_attn_scalar`` as the attention
scale, and logit soft-capping where the config sets it (``softcap``; Tanh on the final logits).

Falcon (``lm_falcon``) keeps the graph's inputs, embedding, rotary tables and head, and writes its
own layers: the fused q/k/v projection reordered from Falcon's head layout, LayerNorm with bias,
attention and MLP in parallel, GELU.

Float ``nn.Linear`` layers (an FP32 model) become float MatMuls in the same layout, so the FP32
baseline gets the same fusions. ``block_size`` chooses the MatMulNBits block (16..256, dividing
the quantization group: a group's scale repeats over its blocks, exact); ``accuracy_level=4``
lets the CPU kernel quantize activations to int8 per block and run integer dot products.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from onnx import ModelProto, TensorProto, helper, numpy_helper
from torch import nn

from edgekit.errors import BadInputError
from edgekit.export.lm_falcon import FALCON, falcon_kv_heads, falcon_unsupported, write_falcon_layers, write_layer_norm
from edgekit.export.lm_llama4 import (
    LLAMA4,
    is_llama4_moe,
    llama4_attention_inputs,
    write_llama4_moe,
    write_llama4_positions,
)
from edgekit.export.lm_moe import moe_block, moe_support, write_moe
from edgekit.export.packing import QuantEmbedding, QuantLinear, pack_codes, storage_bits
from edgekit.export.rope import (
    RopeSpec,
    check_exportable,
    dynamic_ntk_constants,
    fixed_inv_freq,
    longrope_inv_freqs,
    module_spec,
)
from edgekit.kv_cache import KV_CACHE_METADATA, KV_SHARED_BUFFER


@dataclass(frozen=True)
class Arch:
    """What a family's decoder computes beyond the Llama layer, as the fused graph writes it.

    ``norm_offset``: RMSNorm multiplies by ``offset + w``. ``sandwich_norms``: attention and MLP
    outputs are normed before their residual adds (``post_attention_layernorm`` then
    ``pre_feedforward_layernorm``, ``post_feedforward_layernorm``). ``qk_norm``: per-head RMSNorm
    of q and k before the rotary embedding. ``embed_normalizer``: the model (not its embedding
    module) multiplies the embeddings by sqrt(hidden). ``local_rotary``: sliding-window layers
    read ``model.rotary_emb_local``. ``activations``: the MLP activations written (HF names).
    """

    norm_offset: float = 0.0
    sandwich_norms: bool = False
    qk_norm: bool = False
    embed_normalizer: bool = False
    local_rotary: bool = False
    activations: tuple[str, ...] = ("silu",)


LLAMA = Arch()
GEMMA2 = Arch(norm_offset=1.0, sandwich_norms=True, embed_normalizer=True,
              activations=("gelu_pytorch_tanh",))
GEMMA3 = Arch(norm_offset=1.0, sandwich_norms=True, qk_norm=True, local_rotary=True,
              activations=("gelu_pytorch_tanh",))
# Falcon's layers are written by ``lm_falcon`` (fused q/k/v in its own order, LayerNorm, parallel MLP)
FALCON_ARCH = Arch(activations=("gelu", "gelu_new", "gelu_pytorch_tanh"))
# Architectures this builder writes (HF ``model_type``); others use the traced graph.
ARCHS: dict[str, Arch] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma2": GEMMA2,
                          "gemma3_text": GEMMA3, FALCON: FALCON_ARCH, "mixtral": LLAMA, "qwen2_moe": LLAMA,
                          LLAMA4: LLAMA}  # MoE layers: lm_moe; Llama 4's attention and experts: lm_llama4
ARCHITECTURES = tuple(ARCHS)
BLOCK_SIZES = (16, 32, 64, 128, 256)
KERNEL_BITS = (4, 8)  # MatMulNBits bit widths with fast CPU kernels
MS = "com.microsoft"
MIN_ROTARY_POSITIONS = 4096  # rows of fixed cos/sin tables for models declaring shorter contexts
# Longer declared contexts get their rows computed each forward instead (``_runtime_rotary``): Llama 4
# declares 10M positions, 5 GB of folded fixed tables at head_dim 128.
MAX_FIXED_ROTARY_POSITIONS = 1 << 18


@dataclass(frozen=True)
class FusedGraphConfig:
    """How the fused decoder graph is written.

    ``block_size``: MatMulNBits block (None: the group size when it is a valid block, else the
    largest valid block dividing it). ``accuracy_level``: MatMulNBits compute (4: int8, 0/None:
    fp32). ``fuse_qkv`` / ``fuse_gate_up``: one matmul for q/k/v and for gate/up.
    """

    block_size: int | None = None
    accuracy_level: int | None = 4
    fuse_qkv: bool = True
    fuse_gate_up: bool = True
    opset: int = 21

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise BadInputError(f"MatMulNBits block size {self.block_size} is not one of {BLOCK_SIZES}")
        if self.accuracy_level not in (None, 0, 1, 2, 3, 4):
            raise BadInputError(f"accuracy level {self.accuracy_level!r} is not one of 0, 1, 2, 3, 4")
        if self.opset < 18:
            raise BadInputError(f"the fused graph needs opset >= 18 (Split with num_outputs), got {self.opset}")


def supports_fused_graph(hf_model: Any) -> tuple[bool, str]:
    """(whether ``build_fused_decoder`` can write this model, why not)."""
    cfg = getattr(hf_model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in ARCHITECTURES:
        return False, f"architecture {model_type!r} has no fused graph (fused: {', '.join(ARCHITECTURES)})"
    arch = ARCHS[model_type]
    act = _activation(cfg)
    if act not in arch.activations:
        return False, f"activation {act!r} is not {' or '.join(_ACT_NAMES[a] for a in arch.activations)}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return False, "bidirectional attention is not causal"
    if model_type == FALCON and (why := falcon_unsupported(cfg)):
        return False, why
    body = getattr(hf_model, "model", None)
    if arch.local_rotary and getattr(body, "rotary_emb_local", None) is None:
        return False, "the model has no local rotary embedding (model.rotary_emb_local)"
    try:  # every rotary type transformers defines is written (position-dependent ones chosen in the graph)
        check_exportable(hf_model)
    except BadInputError as e:
        return False, str(e)
    for name, m in hf_model.named_modules():
        if isinstance(m, QuantLinear) and storage_bits(m.bits) not in KERNEL_BITS:
            return False, f"{name} has {m.bits}-bit weights (the fused graph takes {KERNEL_BITS})"
    return moe_support(hf_model)


_ACT_NAMES = {"silu": "SiLU", "gelu_pytorch_tanh": "GELU (tanh)", "gelu": "GELU", "gelu_new": "GELU (tanh)"}


def _activation(cfg: Any) -> str:
    """The MLP activation's HF name (Gemma's configs call it ``hidden_activation``, Falcon's ``activation``)."""
    return str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
               or getattr(cfg, "activation", None) or "silu")


def _window(cfg: Any, layer: int) -> int | None:
    """The sliding window of decoder layer ``layer`` (keys within ``window`` positions of the query,
    itself included), None for a global layer."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return None
    if not types:  # Mistral: every layer slides when the config sets a window
        return int(window)
    return int(window) if types[layer] == "sliding_attention" else None


def _choose_block(layer: QuantLinear, requested: int | None) -> int:
    group = layer.in_features if layer.group_size == -1 else layer.group_size
    if requested is not None:
        if layer.group_size != -1 and group % requested:
            raise BadInputError(f"MatMulNBits block size {requested} does not divide the quantization group "
                                f"{group} of a {layer.in_features}-input layer (choose one of "
                                f"{[b for b in BLOCK_SIZES if group % b == 0]})")
        return requested
    valid = [b for b in BLOCK_SIZES if group % b == 0] if layer.group_size != -1 else list(BLOCK_SIZES)
    if not valid:
        raise BadInputError(f"quantization group {group} has no MatMulNBits block (a power of two in 16..256 "
                            "dividing it)")
    return group if group in valid else max(valid)


def blocked_weights(layer: QuantLinear, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits ``B`` (N, blocks, block*bits/8), ``scales`` (N, blocks), ``zero_points`` (N, zp bytes)
    of a packed layer at ``block`` (a divisor of its group, or any block for per-channel layers);
    the last block is padded with zero codes when ``block`` does not divide K (the kernel reads K)."""
    bits = storage_bits(layer.bits)
    K = layer.in_features
    group = K if layer.group_size == -1 else layer.group_size
    nb = -(-K // block)
    codes = torch.nn.functional.pad(layer.codes(), (0, nb * block - K))
    B = pack_codes(codes, bits).reshape(codes.shape[0], nb, block * bits // 8)
    gidx = torch.arange(nb) * block // group
    scales = layer.scales[:, gidx].float()
    zeros = pack_codes(layer.zeros()[:, gidx], bits)
    return B.numpy(), scales.numpy(), zeros.numpy()


SPILL_FROM = 2**20  # bytes: an initializer this large goes to the spill file as it is made (``fused_decoder_parts``)


@dataclass(frozen=True)
class SpilledArray:
    """An initializer's values written to a spill file as the graph was built: read back (memory-mapped,
    one tensor at a time) only when the graph's file is written."""

    path: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def load(self) -> np.ndarray:
        """The values, memory-mapped read-only from the spill file (unmapped once dropped)."""
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", offset=self.offset, shape=self.shape)


Initializer = np.ndarray | SpilledArray  # a (name, Initializer) pair: what the writers take


def _values(t: Initializer) -> np.ndarray:
    return t.load() if isinstance(t, SpilledArray) else np.ascontiguousarray(t)


class _Writer:
    """Nodes and initializers of the graph being written. With a ``spill`` file (opened for binary
    writing), initializers of ``SPILL_FROM`` bytes and more are written to it as they are made, each
    layer's weights leaving memory before the next layer's are made."""

    def __init__(self, config: FusedGraphConfig, spill: Any = None) -> None:
        self.config = config
        self.nodes: list[Any] = []
        self.inits: list[tuple[str, Initializer]] = []  # (name, values): TensorProtos only as they are written
        self.shared: dict[str, Initializer] = {}
        self.spill = spill

    def init(self, name: str, arr: np.ndarray, shared: bool = False) -> str:
        """An initializer. ``shared``: a table another node reads too (a tied embedding and LM
        head); writing that name again with the same values reuses it, so it is stored once."""
        if name in self.shared:
            if self.spill is not None:
                self.spill.flush()  # a spilled table is read back from the file
            kept = self.shared[name]
            if not np.array_equal(kept.load() if isinstance(kept, SpilledArray) else kept, arr):
                raise ValueError(f"initializer {name} written twice with different values")
            return name
        dense = np.ascontiguousarray(arr)
        values: Initializer = dense
        if self.spill is not None and dense.nbytes >= SPILL_FROM:
            offset = self.spill.tell()
            self.spill.write(dense.reshape(-1).view(np.uint8).data)
            values = SpilledArray(self.spill.name, offset, dense.dtype.str, tuple(dense.shape))
        if shared:
            self.shared[name] = values if isinstance(values, SpilledArray) else arr
        self.inits.append((name, values))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "", **attrs: Any) -> list[str]:
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def linear(self, x: str, layers: list[Any], name: str) -> str:
        """One matmul over ``layers`` stacked along their outputs (q/k/v, gate/up)."""
        out = f"{name}/out"
        if all(isinstance(m, QuantLinear) for m in layers):
            first = layers[0]
            if any((m.bits, m.group_size, m.in_features) != (first.bits, first.group_size, first.in_features)
                   for m in layers):
                return self._concat([self.linear(x, [m], f"{name}_{i}") for i, m in enumerate(layers)], name)
            block = _choose_block(first, self.config.block_size)
            parts = [blocked_weights(m, block) for m in layers]
            B, S, Z = (np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
            N = B.shape[0]
            attrs: dict[str, Any] = {"K": first.in_features, "N": N, "bits": storage_bits(first.bits),
                                     "block_size": block}
            if self.config.accuracy_level:
                attrs["accuracy_level"] = self.config.accuracy_level
            ins = [x, self.init(f"{name}.qweight", B), self.init(f"{name}.scales", S.reshape(-1)),
                   self.init(f"{name}.qzeros", Z.reshape(-1))]
            bias = [m.bias for m in layers]
            if any(b is not None for b in bias):
                ins += ["", self.init(f"{name}.bias", np.concatenate(
                    [(b if b is not None else torch.zeros(m.out_features)).detach().float().numpy()
                     for b, m in zip(bias, layers, strict=True)]))]
            self.node("MatMulNBits", ins, [out], name, MS, **attrs)
            return out
        if all(isinstance(m, nn.Linear) for m in layers):
            W = torch.cat([m.weight.detach().float() for m in layers], 0).T.contiguous().numpy()  # (K, N)
            mm = self.node("MatMul", [x, self.init(f"{name}.weight", W)], [out if layers[0].bias is None else
                                                                           f"{name}/mm"], name)[0]
            if layers[0].bias is not None:
                b = torch.cat([m.bias.detach().float() for m in layers]).numpy()
                self.node("Add", [mm, self.init(f"{name}.bias", b)], [out], f"{name}/bias")
            return out
        if len(layers) > 1:  # mixed packed and float layers: one matmul each
            return self._concat([self.linear(x, [m], f"{name}_{i}") for i, m in enumerate(layers)], name)
        raise BadInputError(f"{name}: {type(layers[0]).__name__} is neither nn.Linear nor a packed QuantLinear")

    def rms_norm(self, x: str, gamma: str | None, eps: float, out: str) -> str:
        """RMSNorm in standard ops (a norm without a residual to fuse with: the first layer's, Gemma's
        post-attention, post-MLP and q/k norms), as Pow, ReduceMean, Add, Sqrt, Div, Mul: the pattern
        ONNX Runtime's optimizer fuses into SimplifiedLayerNormalization (Mul(x, x) or Reciprocal
        and Mul it leaves unfused), in ops the ONNX checker knows. ``gamma`` None: no weight (Llama 4's
        L2 norm of q and k), the Div is the output."""
        sq = self.node("Pow", [x, self.init(f"{out}/two", np.array(2.0, np.float32))], [f"{out}/sq"], f"{out}/sq")[0]
        ms = self.node("ReduceMean", [sq, self.init(f"{out}/axes", np.array([-1], np.int64))], [f"{out}/ms"],
                       f"{out}/mean", keepdims=1)[0]
        var = self.node("Add", [ms, self.init(f"{out}/eps", np.array(eps, np.float32))], [f"{out}/var"], f"{out}/eps")[0]
        std = self.node("Sqrt", [var], [f"{out}/std"], f"{out}/sqrt")[0]
        if gamma is None:
            return self.node("Div", [x, std], [out], f"{out}/normed")[0]
        normed = self.node("Div", [x, std], [f"{out}/normed"], f"{out}/normed")[0]
        return self.node("Mul", [normed, gamma], [out], f"{out}/gamma")[0]

    def _concat(self, parts: list[str], name: str) -> str:
        return self.node("Concat", parts, [f"{name}/out"], f"{name}/concat", axis=-1)[0]


def _tied_packed(emb: nn.Module, head: nn.Module, config: FusedGraphConfig) -> bool:
    """Whether the packed embedding shares the packed LM head's table (tied weights) in a layout
    the head's MatMulNBits weight can also feed the embedding lookup with (stored once)."""
    return (isinstance(emb, QuantEmbedding) and isinstance(head, QuantLinear)
            and emb.qweight.data_ptr() == head.qweight.data_ptr())


def _tied_float(emb: nn.Module, head: nn.Module) -> bool:
    """Whether a float embedding and a float bias-free LM head share one table (tied weights)."""
    return (isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear) and head.bias is None and emb.weight.shape == head.weight.shape
            and emb.weight.data_ptr() == head.weight.data_ptr())


def _shared_embedding(w: _Writer, emb: QuantEmbedding, head: QuantLinear, out: str) -> None:
    """The embedding lookup reading the LM head's MatMulNBits weight ``(vocab, blocks, block bytes)``:
    ``GatherBlockQuantized`` quantized along the last axis of that 3-D table (the same bytes: rows
    of codes, two 4-bit codes a byte, low nibble first), then the blocks reshaped into the hidden
    axis (cut to the hidden size where the head's last block is padded). The table is written once,
    where the head's weight is (``lm_head.qweight``)."""
    bits = storage_bits(head.bits)
    if bits not in KERNEL_BITS:
        raise BadInputError(f"{head.bits}-bit embedding tables have no GatherBlockQuantized kernel")
    block = _choose_block(head, w.config.block_size)
    group = head.in_features if head.group_size == -1 else head.group_size
    D = emb.embedding_dim
    nb = -(-D // block)
    gidx = torch.arange(nb) * block // group
    B, _, _ = blocked_weights(head, block)
    w.init("lm_head.qweight", B, shared=True)  # the head's MatMulNBits reuses it
    scales = head.scales[:, gidx].float().numpy().reshape(-1, nb, 1)
    zeros = head.zeros()[:, gidx].to(torch.uint8).numpy().reshape(-1, nb, 1)  # one code per block: low nibble
    w.node("GatherBlockQuantized", ["lm_head.qweight", "input_ids", w.init("embed.scales", scales),
                                    w.init("embed.qzeros", zeros)],
           ["embed/blocks"], "embed", MS, gather_axis=0, quantize_axis=2, block_size=block, bits=bits)
    padded = nb * block != D
    w.node("Reshape", ["embed/blocks", w.init("embed/shape", np.array([0, 0, nb * block], np.int64))],
           ["embed/padded" if padded else out], "embed/reshape")
    if padded:  # the head's last block carries zero codes past the hidden size
        w.node("Slice", ["embed/padded", w.init("embed/start", np.array([0], np.int64)),
                         w.init("embed/end", np.array([D], np.int64)), w.init("embed/axis", np.array([-1], np.int64))],
               [out], "embed/slice")


def _rotary_caches(w: _Writer, rotary: Any, suffix: str = "") -> None:
    """``cos_cache{suffix}`` / ``sin_cache{suffix}`` (rows, rotary_dim / 2) for GroupQueryAttention, from the
    model's own rotary embedding: a fixed type's tables, or a position-dependent type's computed each
    forward (``_runtime_rotary``)."""
    spec = module_spec(rotary)
    if spec.by_position or spec.context > MAX_FIXED_ROTARY_POSITIONS:
        _runtime_rotary(w, rotary, spec, suffix)
        return
    inv_freq, scale = fixed_inv_freq(rotary)
    # every position of the declared context (and the traced graph's reach on short-context models)
    _fixed_rotary(w, inv_freq.numpy(), scale, max(spec.context, MIN_ROTARY_POSITIONS), suffix)


def _fixed_rotary(w: _Writer, inv_freq: np.ndarray, scale: float, rows: int, suffix: str) -> None:
    """The tables of a fixed rotary, computed in the graph as the model computes them (float32 positions
    times ``inv_freq``, cos and sin, times the attention scaling): ONNX Runtime folds them once as the
    session loads, and the file carries ``inv_freq`` instead of two tables per rotary base."""
    n = f"rotary{suffix}"
    positions = w.init(f"rotary.positions{rows}", np.arange(rows, dtype=np.float32)[:, None], shared=True)
    freqs = w.node("Mul", [positions, w.init(f"{n}.inv_freq", inv_freq)], [f"{n}/freqs"], f"{n}/freqs")[0]
    _cos_sin(w, freqs, scale, suffix)


def _cos_sin(w: _Writer, freqs: str, scale: float, suffix: str, out: str = "cache") -> list[str]:
    n = f"rotary{suffix}"
    made = []
    for fn in ("Cos", "Sin"):
        name = f"{fn.lower()}_{out}{suffix}"
        raw = w.node(fn, [freqs], [name if scale == 1.0 else f"{n}/{fn.lower()}"], f"{n}/{fn.lower()}")[0]
        if scale != 1.0:
            raw = w.node("Mul", [raw, w.init(f"{n}/scale", np.array(scale, np.float32), shared=True)], [name],
                         f"{n}/{fn.lower()}_scale")[0]
        made.append(raw)
    return made


def _runtime_rotary(w: _Writer, rotary: Any, spec: RopeSpec, suffix: str) -> None:
    """The tables of a position-dependent rotary (dynamic NTK, longrope), chosen each forward as
    transformers' ``dynamic_rope_update`` chooses them: from ``L = max(position_ids) + 1``, longrope's
    long factors where ``L`` exceeds its threshold (else the short ones), dynamic NTK's base grown for
    ``max(L, max_position_embeddings)``; or of a fixed rotary whose declared context is too long for
    tables (``MAX_FIXED_ROTARY_POSITIONS``). Only the rows of this forward's positions are computed (a few
    per decode step); the rows below them, which GroupQueryAttention does not read, are zeros, and the
    tables are as long as the attention requires (the sequence, the KV buffer), so any position works."""
    n = f"rotary{suffix}"
    i64 = lambda name, v: w.init(f"{n}/{name}", np.array(v, np.int64), shared=True)  # noqa: E731
    f32 = lambda name, v: w.init(f"{n}/{name}", np.array(v, np.float32), shared=True)  # noqa: E731
    low = w.node("ReduceMin", ["position_ids"], [f"{n}/low"], f"{n}/low", keepdims=0)[0]
    top = w.node("ReduceMax", ["position_ids"], [f"{n}/top"], f"{n}/top", keepdims=0)[0]
    seq_len = w.node("Add", [top, i64("one", 1)], [f"{n}/seq_len"], f"{n}/seq_len")[0]
    if not spec.by_position:
        fixed, scale = fixed_inv_freq(rotary)
        inv_freq = w.init(f"{n}.inv_freq", fixed.numpy())
    elif spec.rope_type == "longrope":
        short, long, scale = longrope_inv_freqs(rotary)
        is_long = w.node("Greater", [seq_len, i64("threshold", spec.threshold)], [f"{n}/is_long"], f"{n}/is_long")[0]
        inv_freq = w.node("Where", [is_long, w.init(f"{n}.long_inv_freq", long.numpy()),
                                    w.init(f"{n}.short_inv_freq", short.numpy())], [f"{n}/inv_freq"],
                          f"{n}/inv_freq")[0]
    else:  # dynamic NTK, in the float32 operations of transformers' _compute_dynamic_ntk_parameters
        base, factor, max_pos, exponent, steps = dynamic_ntk_constants(rotary)
        scale = 1.0
        length = w.node("Max", [seq_len, i64("max_pos", max_pos)], [f"{n}/length"], f"{n}/length")[0]
        x = w.node("Cast", [length], [f"{n}/length_f"], f"{n}/length_f", to=TensorProto.FLOAT)[0]
        x = w.node("Mul", [x, f32("factor", factor)], [f"{n}/scaled"], f"{n}/scaled")[0]
        x = w.node("Div", [x, f32("max_pos_f", max_pos)], [f"{n}/ratio"], f"{n}/ratio")[0]
        x = w.node("Sub", [x, f32("factor_m1", factor - 1)], [f"{n}/stretch"], f"{n}/stretch")[0]
        x = w.node("Pow", [x, f32("exponent", exponent)], [f"{n}/growth"], f"{n}/growth")[0]
        x = w.node("Mul", [f32("theta", base), x], [f"{n}/grown_base"], f"{n}/grown_base")[0]
        x = w.node("Pow", [x, w.init(f"{n}.steps", steps.numpy())], [f"{n}/wavelength"], f"{n}/wavelength")[0]
        inv_freq = w.node("Div", [f32("one_f", 1.0), x], [f"{n}/inv_freq"], f"{n}/inv_freq")[0]
    # this forward's rows: positions low .. L - 1
    rng = w.node("Range", [low, seq_len, i64("one", 1)], [f"{n}/range"], f"{n}/range")[0]
    pos = w.node("Cast", [rng], [f"{n}/range_f"], f"{n}/range_f", to=TensorProto.FLOAT)[0]
    pos = w.node("Unsqueeze", [pos, w.init(f"{n}/col", np.array([1], np.int64))], [f"{n}/positions"],
                 f"{n}/positions")[0]
    freqs = w.node("Mul", [pos, inv_freq], [f"{n}/freqs"], f"{n}/freqs")[0]
    cos, sin = _cos_sin(w, freqs, scale, suffix, out="rows")
    # rows needed: every position (L), the sequence (total) and the KV buffer (past) GroupQueryAttention checks
    shape1 = i64("shape1", [1])
    lens = [w.node("Reshape", [seq_len, shape1], [f"{n}/seq_len1"], f"{n}/seq_len1")[0],
            w.node("Reshape", ["total_i64", shape1], [f"{n}/total1"], f"{n}/total1")[0],
            w.node("Shape", ["past_key_values.0.key"], [f"{n}/past1"], f"{n}/past1", start=2, end=3)[0]]
    lens_all = w.node("Concat", lens, [f"{n}/lens"], f"{n}/lens", axis=0)[0]
    rows = w.node("ReduceMax", [lens_all], [f"{n}/rows"], f"{n}/rows", keepdims=1)[0]
    after = w.node("Sub", [rows, lens[0]], [f"{n}/after"], f"{n}/after")[0]
    low1 = w.node("Reshape", [low, shape1], [f"{n}/low1"], f"{n}/low1")[0]
    zero1 = i64("zero1", [0])
    pads = w.node("Concat", [low1, zero1, after, zero1], [f"{n}/pads"], f"{n}/pads", axis=0)[0]
    for table, fn in ((cos, "cos"), (sin, "sin")):
        w.node("Pad", [table, pads], [f"{fn}_cache{suffix}"], f"{n}/{fn}_pad", mode="constant")


def _embedding_scale(emb: Any, cfg: Any, arch: Arch) -> float:
    """The factor the model applies to the rows its embedding looks up, in float32: a packed
    embedding's ``scale``, Gemma 3's ``embed_scale`` (in the table's dtype), Gemma 2's normalizer."""
    dtype = torch.float32 if isinstance(emb, QuantEmbedding) else emb.weight.dtype
    scale = torch.tensor(1.0)
    if isinstance(emb, QuantEmbedding):
        scale = torch.tensor(emb.scale, dtype=torch.float32)
    elif isinstance(getattr(emb, "embed_scale", None), torch.Tensor):
        scale = emb.embed_scale.to(dtype)
    if arch.embed_normalizer:  # hidden * sqrt(hidden), the factor in the hidden states' dtype
        scale = scale.float() * torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype).float()
    return float(scale.float())


def _norm_weight(norm: Any, arch: Arch) -> np.ndarray:
    """An RMSNorm's weight as SimplifiedLayerNormalization takes it: ``offset + w`` in float32."""
    return (arch.norm_offset + norm.weight.detach().float()).numpy()


def build_fused_decoder(hf_model: Any, config: FusedGraphConfig | None = None) -> ModelProto:
    """The fused with-past ONNX graph of a Llama-, Gemma- or Falcon-family causal LM (packed or float weights).

    >>> proto = build_fused_decoder(load_compressed("out/w4").module.model)  # doctest: +SKIP
    """
    model, tensors = fused_decoder_parts(hf_model, config)
    for k, (name, arr) in enumerate(tensors):  # one at a time: the weights are never held twice
        model.graph.initializer.append(numpy_helper.from_array(_values(arr), name))
        tensors[k] = ("", np.empty(0))
    return model


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, length: int) -> bytes:
    """The key and length of a length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(length)


# field numbers: ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def save_parts(model: ModelProto, tensors: list[tuple[str, Initializer]], path: str | os.PathLike[str]) -> None:
    """Write ``model`` with ``tensors`` ((name, array) pairs) as its initializers to one ONNX file,
    the arrays' bytes straight from their memory.

    Protobuf merges repeated occurrences of an embedded message field and appends repeated fields,
    so the file is ``model``'s bytes followed by one ``ModelProto{graph{initializer: [t]}}`` per
    tensor, ``t`` written as its header (dims, type, name) then its ``raw_data``: what ``onnx.load``
    and ONNX Runtime read as the model ``build_fused_decoder`` returns, written without a
    ``TensorProto`` or a serialized copy of any weight (``onnx.save_model`` holds the model twice).
    """
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
        for name, t in tensors:
            arr = _values(t)  # a spilled one: mapped for its write only
            header = TensorProto(name=name, dims=arr.shape, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype))
            head = header.SerializeToString() + _field(_TENSOR_RAW_DATA, arr.nbytes)
            tensor_len = len(head) + arr.nbytes
            inner = _field(_GRAPH_INITIALIZER, tensor_len)
            f.write(_field(_MODEL_GRAPH, len(inner) + tensor_len) + inner + head)
            f.write(arr.reshape(-1).view(np.uint8).data)


EXTERNAL_ALIGN = 4096  # a large tensor's offset in the data file: a page boundary, where ONNX Runtime maps it
EXTERNAL_ALIGN_FROM = 2**20  # bytes from which a tensor is aligned (as onnx's own external-data writer does)
EXTERNAL_FROM = 1024  # smaller tensors stay inside the graph (onnx's default size threshold)


def save_parts_external(model: ModelProto, tensors: list[tuple[str, Initializer]], path: str | os.PathLike[str],
                        location: str = "model.onnx.data") -> None:
    """``save_parts`` for a model past protobuf's 2 GB limit: each array's bytes are appended, one
    tensor at a time and straight from its memory, to ``location`` beside ``path`` (large ones at a
    page boundary; those under ``EXTERNAL_FROM`` bytes stay in the graph), and ``path`` holds the
    graph with an external-data header per initializer: what
    ``onnx.save_model(..., save_as_external_data=True)`` writes, without assembling the model's
    initializers in memory first (``onnx`` holds them as ``TensorProto`` copies and serializes them)."""
    headers = []
    with open(os.path.join(os.path.dirname(os.fspath(path)), location), "wb") as f:
        for name, t in tensors:
            arr = _values(t)
            if arr.nbytes < EXTERNAL_FROM:  # a shape or axes input: ONNX Runtime reads those from the graph only
                headers.append(numpy_helper.from_array(arr, name))
                continue
            if arr.nbytes >= EXTERNAL_ALIGN_FROM and f.tell() % EXTERNAL_ALIGN:
                f.write(b"\0" * (EXTERNAL_ALIGN - f.tell() % EXTERNAL_ALIGN))
            offset = f.tell()
            f.write(arr.reshape(-1).view(np.uint8).data)
            header = TensorProto(name=name, dims=arr.shape, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype),
                                 data_location=TensorProto.EXTERNAL)
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(arr.nbytes))):
                entry = header.external_data.add()
                entry.key, entry.value = key, value
            headers.append(header)
    with open(path, "wb") as f:  # the graph without weights is small: serialized whole, the caller's left as it was
        f.write(model.SerializeToString())
        f.write(_field(_MODEL_GRAPH, sum(len(_field(_GRAPH_INITIALIZER, h.ByteSize())) + h.ByteSize()
                                         for h in headers)))
        for h in headers:
            f.write(_field(_GRAPH_INITIALIZER, h.ByteSize()) + h.SerializeToString())


def fused_decoder_parts(hf_model: Any, config: FusedGraphConfig | None = None, spill: str | os.PathLike[str] | None = None,
                        ) -> tuple[ModelProto, list[tuple[str, Initializer]]]:
    """``build_fused_decoder``'s graph without its initializers, and the initializers as
    (name, array) pairs, for ``save_parts`` to write the file without assembling the model.
    ``spill``: a file path; initializers of ``SPILL_FROM`` bytes and more are written there as each
    layer is made (``SpilledArray`` in the pairs), so memory never holds the whole packed graph beside
    the model it is made from."""
    if spill is None:
        return _fused_decoder_parts(hf_model, config, None)
    with open(spill, "wb") as f:
        return _fused_decoder_parts(hf_model, config, f)


def _fused_decoder_parts(hf_model: Any, config: FusedGraphConfig | None, spill: Any,
                         ) -> tuple[ModelProto, list[tuple[str, Initializer]]]:
    config = config or FusedGraphConfig()
    ok, why = supports_fused_graph(hf_model)
    if not ok:
        raise BadInputError(f"no fused graph for this model: {why}")
    cfg = hf_model.config
    arch = ARCHS[cfg.model_type]
    falcon = cfg.model_type == FALCON
    body = hf_model.transformer if falcon else hf_model.model
    n_layers = cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = falcon_kv_heads(cfg) if falcon else (getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    eps = float(cfg.layer_norm_epsilon if falcon else cfg.rms_norm_eps)
    w = _Writer(config, spill)
    b, s, past, total = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [b, s]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [b, total]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [b, s])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [b, s, cfg.vocab_size])]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT,
                                                        [b, kv_heads, past, head_dim]))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT,
                                                         [b, kv_heads, total, head_dim]))

    # sequence lengths for GroupQueryAttention: seqlens_k = tokens seen - 1 (per row), total length
    w.node("ReduceSum", ["attention_mask", w.init("one_axis", np.array([1], np.int64))], ["mask_sum"],
           "seqlens/sum", keepdims=0)
    w.node("Sub", ["mask_sum", w.init("one_i64", np.array(1, np.int64))], ["seqlens_minus1"], "seqlens/sub")
    w.node("Cast", ["seqlens_minus1"], ["seqlens_k"], "seqlens/cast", to=TensorProto.INT32)
    w.node("Shape", ["attention_mask"], ["mask_shape"], "total/shape")
    w.node("Gather", ["mask_shape", w.init("one_idx", np.array(1, np.int64))], ["total_i64"], "total/gather", axis=0)
    w.node("Cast", ["total_i64"], ["total_seq_len"], "total/cast", to=TensorProto.INT32)

    # embedding
    emb = hf_model.get_input_embeddings()
    head = hf_model.lm_head
    embed_scale = _embedding_scale(emb, cfg, arch)
    rows = "embeddings" if embed_scale == 1.0 else "embed/rows"
    if _tied_packed(emb, head, config):
        _shared_embedding(w, emb, head, rows)
    elif isinstance(emb, QuantEmbedding):
        if storage_bits(emb.bits) not in KERNEL_BITS:
            raise BadInputError(f"{emb.bits}-bit embedding tables have no GatherBlockQuantized kernel")
        D = emb.embedding_dim
        group = D if emb.group_size == -1 else emb.group_size
        block = max(bs for bs in BLOCK_SIZES if group % bs == 0 and D % bs == 0)
        gidx = np.arange(D // block) * block // group
        data = emb.qweight.numpy() if storage_bits(emb.bits) == 8 else pack_codes(emb.codes(), 4).numpy()
        w.node("GatherBlockQuantized", [w.init("embed.qweight", data), "input_ids",
                                        w.init("embed.scales", emb.scales.float().numpy()[:, gidx]),
                                        w.init("embed.qzeros", pack_codes(emb.zeros()[:, gidx], emb.bits).numpy())],
               [rows], "embed", MS, gather_axis=0, quantize_axis=1, block_size=block,
               bits=storage_bits(emb.bits))
    elif _tied_float(emb, head):  # one (hidden, vocab) table: the head's MatMul weight, gathered by column
        table = w.init("lm_head.weight", emb.weight.detach().float().T.contiguous().numpy())
        w.node("Gather", [table, "input_ids"], ["embed/columns"], "embed", axis=1)  # (hidden, batch, sequence)
        w.node("Transpose", ["embed/columns"], [rows], "embed/transpose", perm=[1, 2, 0])
    else:
        w.node("Gather", [w.init("embed.weight", emb.weight.detach().float().numpy()), "input_ids"], [rows],
               "embed", axis=0)
    if rows != "embeddings":  # Gemma: sqrt(hidden), rounded to the model's dtype as the model rounds it
        w.node("Mul", [rows, w.init("embed.scale", np.array(embed_scale, np.float32))], ["embeddings"], "embed/scale")

    rotary = getattr(body, "rotary_emb", None)
    if rotary is None:
        raise BadInputError("the model has no rotary embedding module (model.rotary_emb)")
    _rotary_caches(w, rotary)
    if arch.local_rotary and any(_window(cfg, i) for i in range(n_layers)):  # sliding layers: their own base
        _rotary_caches(w, body.rotary_emb_local, "_local")
    attn_softcap = getattr(cfg, "attn_logit_softcapping", None)
    final_softcap = getattr(cfg, "final_logit_softcapping", None)

    llama4 = cfg.model_type == LLAMA4
    positions = write_llama4_positions(w, cfg) if llama4 else None  # chunk mask, NoPE temperature: once
    hidden = "embeddings"
    residual: str | None = None
    if falcon:  # its own layer layout (lm_falcon.py); the loop below writes the Llama and Gemma layers
        hidden, residual = write_falcon_layers(w, body.h, cfg, config.fuse_qkv, hidden)
    for i, layer in enumerate(() if falcon else body.layers):
        p = f"layers.{i}"
        attn = layer.self_attn
        # Mixtral's experts are its block_sparse_moe (lm_moe), Llama 4's MLP its feed_forward
        mlp: Any = getattr(layer, "mlp", None) or getattr(layer, "feed_forward", None)
        gamma = w.init(f"{p}.input_layernorm.weight", _norm_weight(layer.input_layernorm, arch))
        if residual is None:
            w.rms_norm(hidden, gamma, eps, f"{p}/ln1")
            residual = hidden
        else:
            w.node("SkipSimplifiedLayerNormalization", [hidden, residual, gamma], [f"{p}/ln1", "", "", f"{p}/res1"],
                   f"{p}/input_layernorm", MS, epsilon=eps)
            residual = f"{p}/res1"
        qkv_layers = [attn.q_proj, attn.k_proj, attn.v_proj]
        if config.fuse_qkv:
            qkv = w.linear(f"{p}/ln1", qkv_layers, f"{p}.attn.qkv_proj")
            if arch.qk_norm or llama4:
                sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
                gqa_in = w.node("Split", [qkv, w.init(f"{p}/qkv_sizes", np.array(sizes, np.int64))],
                                [f"{p}/q", f"{p}/k", f"{p}/v"], f"{p}/attn/split", axis=-1)
            else:
                gqa_in = [qkv, "", ""]
        else:
            gqa_in = [w.linear(f"{p}/ln1", [m], f"{p}.attn.{n}") for m, n in zip(qkv_layers, "qkv", strict=True)]
        if arch.qk_norm:  # per-head RMSNorm of q and k, before the rotary embedding GroupQueryAttention applies
            for j, (norm, n_heads, kind) in enumerate(((attn.q_norm, heads, "q"), (attn.k_norm, kv_heads, "k"))):
                g = w.init(f"{p}.attn.{kind}_norm.weight", _norm_weight(norm, arch))
                split = w.node("Reshape", [gqa_in[j], w.init(f"{p}/{kind}_heads", np.array([0, 0, n_heads, head_dim],
                                                                                            np.int64))],
                               [f"{p}/{kind}_split"], f"{p}/attn/{kind}_split")[0]
                normed = w.rms_norm(split, g, eps, f"{p}/{kind}_norm")
                gqa_in[j] = w.node("Reshape", [normed, w.init(f"{p}/{kind}_flat", np.array([0, 0, n_heads * head_dim],
                                                                                           np.int64))],
                                   [f"{p}/{kind}_normed"], f"{p}/attn/{kind}_merge")[0]
        bias = None
        if positions is not None:  # Llama 4: rotary and q/k norm before the attention node
            gqa_in[0], gqa_in[1], bias = llama4_attention_inputs(w, p, gqa_in[0], gqa_in[1], cfg, i, heads, kv_heads,
                                                                 head_dim, positions)
        scale = float(getattr(attn, "scaling", 1.0 / math.sqrt(head_dim)))
        window = _window(cfg, i)
        local = window is not None and arch.local_rotary
        attrs: dict[str, Any] = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": scale,
                                 "do_rotary": int(positions is None), "rotary_interleaved": 0}
        if window is not None:  # the last `window` keys, the query's own included
            attrs["local_window_size"] = window
        if attn_softcap:
            attrs["softcap"] = float(attn_softcap)
        cache = "_local" if local else ""
        rotary_in = [f"cos_cache{cache}", f"sin_cache{cache}", "position_ids"] if positions is None else ["", "", ""]
        w.node("GroupQueryAttention", [*gqa_in, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                                       "seqlens_k", "total_seq_len", *rotary_in, *([bias] if bias else [])],
               [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"], f"{p}/attn", MS, **attrs)
        o = w.linear(f"{p}/attn", [attn.o_proj], f"{p}.attn.o_proj")
        if arch.sandwich_norms:  # the attention output normed, then added; the MLP reads its own norm
            o = w.rms_norm(o, w.init(f"{p}.post_attention_layernorm.weight",
                                     _norm_weight(layer.post_attention_layernorm, arch)), eps, f"{p}/attn_normed")
            gamma2 = w.init(f"{p}.pre_feedforward_layernorm.weight", _norm_weight(layer.pre_feedforward_layernorm, arch))
        else:
            gamma2 = w.init(f"{p}.post_attention_layernorm.weight", _norm_weight(layer.post_attention_layernorm, arch))
        w.node("SkipSimplifiedLayerNormalization", [o, residual, gamma2], [f"{p}/ln2", "", "", f"{p}/res2"],
               f"{p}/post_attention_layernorm", MS, epsilon=eps)
        residual = f"{p}/res2"
        if llama4 and is_llama4_moe(layer):  # sigmoid-scaled inputs, 3-d experts, a shared expert (lm_llama4)
            hidden = write_llama4_moe(w, f"{p}/ln2", layer.feed_forward, f"{p}.moe")
            continue
        moe = moe_block(layer, cfg.model_type)
        if moe is not None:  # mixture of experts: routed in one MoE / QMoE node (lm_moe)
            hidden = write_moe(w, f"{p}/ln2", moe, f"{p}.moe")
            continue
        if config.fuse_gate_up:
            gu = w.linear(f"{p}/ln2", [mlp.gate_proj, mlp.up_proj], f"{p}.mlp.gate_up_proj")
            w.node("Split", [gu], [f"{p}/gate", f"{p}/up"], f"{p}/mlp/split", axis=-1, num_outputs=2)
            gate, up = f"{p}/gate", f"{p}/up"
        else:
            gate = w.linear(f"{p}/ln2", [mlp.gate_proj], f"{p}.mlp.gate_proj")
            up = w.linear(f"{p}/ln2", [mlp.up_proj], f"{p}.mlp.up_proj")
        if _activation(cfg) == "silu":
            w.node("QuickGelu", [gate], [f"{p}/act"], f"{p}/mlp/silu", MS, alpha=1.0)
        else:  # gelu_pytorch_tanh
            w.node("FastGelu", [gate], [f"{p}/act"], f"{p}/mlp/gelu", MS)
        w.node("Mul", [f"{p}/act", up], [f"{p}/gated"], f"{p}/mlp/mul")
        hidden = w.linear(f"{p}/gated", [mlp.down_proj], f"{p}.mlp.down_proj")
        if arch.sandwich_norms:
            hidden = w.rms_norm(hidden, w.init(f"{p}.post_feedforward_layernorm.weight",
                                               _norm_weight(layer.post_feedforward_layernorm, arch)), eps,
                                f"{p}/mlp_normed")

    if residual is None:
        raise BadInputError("the model has no decoder layers (model.layers is empty)")
    if falcon:
        write_layer_norm(w, body.ln_f, hidden, residual, "final_norm", "ln_f")
    else:
        gamma = w.init("norm.weight", _norm_weight(body.norm, arch))
        w.node("SkipSimplifiedLayerNormalization", [hidden, residual, gamma], ["final_norm", "", "", "final_res"],
               "norm", MS, epsilon=eps)
    if _tied_float(emb, head):
        logits = w.node("MatMul", ["final_norm", "lm_head.weight"], ["lm_head/out"], "lm_head")[0]
    else:
        logits = w.linear("final_norm", [head], "lm_head")
    if final_softcap:  # softcap * tanh(logits / softcap)
        cap = w.init("final_softcap", np.array(final_softcap, np.float32))
        w.node("Div", [logits, cap], ["logits/capped"], "softcap/div")
        w.node("Tanh", ["logits/capped"], ["logits/tanh"], "softcap/tanh")
        logits = w.node("Mul", ["logits/tanh", cap], ["logits/softcapped"], "softcap/mul")[0]
    w.node("Identity", [logits], ["logits"], "logits")

    model = helper.make_model(helper.make_graph(w.nodes, "edgekit-fused-decoder", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", config.opset), helper.make_opsetid(MS, 1)],
                              producer_name="edgekit")
    model.ir_version = min(model.ir_version, 10)
    helper.set_model_props(model, {KV_CACHE_METADATA: KV_SHARED_BUFFER})
    return model, w.inits


__all__ = ["ARCHITECTURES", "ARCHS", "Arch", "BLOCK_SIZES", "FusedGraphConfig", "blocked_weights", "build_fused_decoder",
           "fused_decoder_parts", "save_parts", "save_parts_external", "SpilledArray", "Initializer",
           "supports_fused_graph"]
