"""Falcon's decoder layers in the fused ONNX decoder graph (``lm_graph``).

What a Falcon layer computes beyond the Llama layer ``lm_graph`` writes, and how it is written:

* one fused ``query_key_value`` projection whose rows hold the heads in Falcon's own order
  (``FalconAttention._split_heads``): with ``new_decoder_architecture`` (Falcon-40B/180B) one group
  per KV head, its query heads then its key and its value; with ``multi_query`` (Falcon-7B) every
  query head, then the one key and the one value; otherwise (classic multi-head) q, k and v
  interleaved per head. The rows are reordered into q | k | v as the graph is written (whole rows
  of codes with their scales and zero points: exact for packed weights, no re-quantization), and
  ``GroupQueryAttention`` reads the grouped heads as they are: its KV cache holds ``num_kv_heads``
  heads (transformers broadcasts the grouped keys to every query head and caches them all);
* LayerNorm with a bias (ONNX ``LayerNormalization``; ``com.microsoft::SkipLayerNormalization``
  where the residual add comes first): one norm per layer, or ``ln_attn`` and ``ln_mlp`` with
  ``new_decoder_architecture`` and ``num_ln_in_parallel_attn = 2``;
* attention and MLP in parallel on the same residual (``parallel_attn`` or the new architecture):
  ``h + (mlp(x) + attn(x))``, summed in transformers' order; else one after the other;
* the MLP ``dense_4h_to_h(act(dense_h_to_4h(x)))`` with GELU (``com.microsoft::Gelu``, erf) or its
  tanh approximation (``com.microsoft::FastGelu``), and the biases the config declares.

ALiBi (Falcon-RW) is refused: ``GroupQueryAttention`` applies rotary embeddings, not a bias per head.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from edgekit.errors import BadInputError
from edgekit.export.packing import QuantLinear

FALCON = "falcon"
MS = "com.microsoft"
# Falcon's ``activation`` -> the contrib op computing it
ACTIVATION_OPS = {"gelu": "Gelu", "gelu_new": "FastGelu", "gelu_pytorch_tanh": "FastGelu"}


class GraphWriter(Protocol):
    """What ``lm_graph``'s writer offers a family's layers: initializers, nodes, (packed) matmuls."""

    def init(self, name: str, arr: np.ndarray, shared: bool = False) -> str: ...

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "",
             **attrs: Any) -> list[str]: ...

    def linear(self, x: str, layers: list[Any], name: str) -> str: ...


def falcon_unsupported(cfg: Any) -> str:
    """Why the fused graph cannot write this Falcon config ('' when it can)."""
    if getattr(cfg, "alibi", False):
        return "ALiBi position bias is not written (GroupQueryAttention applies rotary embeddings, not a bias per head)"
    act = str(getattr(cfg, "activation", "gelu"))
    if act not in ACTIVATION_OPS:
        return f"Falcon activation {act!r} is not one of {', '.join(ACTIVATION_OPS)}"
    return ""


def falcon_kv_heads(cfg: Any) -> int:
    """The key/value heads a Falcon layer computes (and the fused graph caches)."""
    if cfg.new_decoder_architecture:
        return int(cfg.num_kv_heads)
    return 1 if cfg.multi_query else int(cfg.num_attention_heads)


def qkv_rows(cfg: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``query_key_value``'s weight holding the query, key and value heads, each in head
    order (query head ``h`` reads key head ``h // (heads / kv_heads)``, as GroupQueryAttention does),
    from the layout ``FalconAttention._split_heads`` reads."""
    heads = int(cfg.num_attention_heads)
    head_dim = cfg.hidden_size // heads
    if cfg.new_decoder_architecture:  # per KV group: its query heads, its key, its value
        kv = int(cfg.num_kv_heads)
        slots = torch.arange(kv * (heads // kv + 2)).reshape(kv, -1)
        q, k, v = slots[:, :-2].reshape(-1), slots[:, -2], slots[:, -1]
    elif cfg.multi_query:  # every query head, then one key and one value
        q, k, v = torch.arange(heads), torch.tensor([heads]), torch.tensor([heads + 1])
    else:  # q, k, v interleaved per head
        slots = torch.arange(3 * heads).reshape(heads, 3)
        q, k, v = slots[:, 0], slots[:, 1], slots[:, 2]

    def rows(slot: torch.Tensor) -> torch.Tensor:
        return (slot[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)

    return rows(q), rows(k), rows(v)


def select_rows(layer: Any, index: torch.Tensor) -> Any:
    """A linear layer computing ``layer``'s output features ``index`` (packed: the same codes, scales
    and zero points, so the matmul written from it is exact)."""
    if isinstance(layer, QuantLinear):
        bias = None if layer.bias is None else layer.bias[index]
        return QuantLinear.from_quantized(layer.codes()[index], layer.scales[index], layer.zeros()[index],
                                          layer.bits, layer.group_size, bias)
    out = nn.Linear(layer.in_features, len(index), bias=layer.bias is not None)
    out.weight = nn.Parameter(layer.weight.detach()[index], requires_grad=False)
    if layer.bias is not None:
        out.bias = nn.Parameter(layer.bias.detach()[index], requires_grad=False)
    return out


def write_layer_norm(w: GraphWriter, norm: nn.LayerNorm, x: str, residual: str | None, out: str,
                     name: str) -> tuple[str, str]:
    """LayerNorm of ``x`` (after adding ``residual``, fused, where there is one): (normed, the sum)."""
    gamma = w.init(f"{name}.weight", norm.weight.detach().float().numpy())
    bias = norm.bias if norm.bias is not None else torch.zeros_like(norm.weight)
    beta = w.init(f"{name}.bias", bias.detach().float().numpy())
    eps = float(norm.eps)
    if residual is None:
        w.node("LayerNormalization", [x, gamma, beta], [out], name, axis=-1, epsilon=eps)
        return out, x
    total = f"{out}/sum"
    w.node("SkipLayerNormalization", [x, residual, gamma, beta], [out, "", "", total], name, MS, epsilon=eps)
    return out, total


def write_falcon_layers(w: GraphWriter, layers: Any, cfg: Any, fuse_qkv: bool, hidden: str) -> tuple[str, str]:
    """Falcon's decoder layers from ``hidden`` (the embeddings): (the last layer's output before its
    residual add, the residual), for the final norm to add and norm. ``cos_cache``/``sin_cache``,
    ``seqlens_k``, ``total_seq_len`` and the cache inputs are the graph's (``lm_graph``)."""
    heads = int(cfg.num_attention_heads)
    kv_heads = falcon_kv_heads(cfg)
    head_dim = cfg.hidden_size // heads
    parallel = bool(cfg.new_decoder_architecture or cfg.parallel_attn)
    two_norms = bool(cfg.new_decoder_architecture) and getattr(cfg, "num_ln_in_parallel_attn", None) in (None, 2)
    act_op = ACTIVATION_OPS[str(cfg.activation)]
    q_rows, k_rows, v_rows = qkv_rows(cfg)
    residual: str | None = None
    for i, layer in enumerate(layers):
        p = f"layers.{i}"
        attn, mlp = layer.self_attention, layer.mlp
        attn_in, residual = write_layer_norm(w, layer.ln_attn if two_norms else layer.input_layernorm, hidden,
                                             residual, f"{p}/ln_attn", f"{p}.ln_attn" if two_norms else
                                             f"{p}.input_layernorm")
        mlp_in = attn_in
        if two_norms:  # the MLP's own norm of the same sum
            mlp_in, _ = write_layer_norm(w, layer.ln_mlp, residual, None, f"{p}/ln_mlp", f"{p}.ln_mlp")
        parts = [select_rows(attn.query_key_value, rows) for rows in (q_rows, k_rows, v_rows)]
        if fuse_qkv:  # one matmul, its rows reordered into q | k | v
            gqa_in = [w.linear(attn_in, parts, f"{p}.attn.qkv_proj"), "", ""]
        else:
            gqa_in = [w.linear(attn_in, [m], f"{p}.attn.{n}_proj") for m, n in zip(parts, "qkv", strict=True)]
        w.node("GroupQueryAttention", [*gqa_in, f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                                       "seqlens_k", "total_seq_len", "cos_cache", "sin_cache", "position_ids"],
               [f"{p}/attn", f"present.{i}.key", f"present.{i}.value"], f"{p}/attn", MS,
               num_heads=heads, kv_num_heads=kv_heads, scale=float(head_dim ** -0.5), do_rotary=1,
               rotary_interleaved=0)
        attn_out = w.linear(f"{p}/attn", [attn.dense], f"{p}.attn.dense")
        if not parallel:  # attention's residual add first, then the MLP's norm of it
            mlp_in, residual = write_layer_norm(w, layer.post_attention_layernorm, attn_out, residual,
                                                f"{p}/ln_mlp", f"{p}.post_attention_layernorm")
        up = w.linear(mlp_in, [mlp.dense_h_to_4h], f"{p}.mlp.dense_h_to_4h")
        w.node(act_op, [up], [f"{p}/act"], f"{p}/mlp/act", MS)
        hidden = w.linear(f"{p}/act", [mlp.dense_4h_to_h], f"{p}.mlp.dense_4h_to_h")
        if parallel:  # transformers: mlp_output += attention_output, then the residual
            hidden = w.node("Add", [hidden, attn_out], [f"{p}/attn_mlp"], f"{p}/attn_mlp")[0]
    if residual is None:
        raise BadInputError("the model has no decoder layers (transformer.h is empty)")
    return hidden, residual


__all__ = ["ACTIVATION_OPS", "FALCON", "GraphWriter", "falcon_kv_heads", "falcon_unsupported", "qkv_rows",
           "select_rows", "write_falcon_layers", "write_layer_norm"]
