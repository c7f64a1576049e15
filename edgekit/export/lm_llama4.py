"""Llama 4 text layers of the fused decoder graph (``lm_graph``): what ``Llama4ForCausalLM`` computes
beyond the Llama layer, written in standard ops around GroupQueryAttention.

Attention (``llama4_attention_inputs``):

* **rotary on interleaved pairs** (``apply_rotary_emb`` multiplies ``(x[2i], x[2i+1])`` as a complex
  number), applied before GroupQueryAttention by ``com.microsoft::RotaryEmbedding`` with ``interleaved=1``,
  because Llama 4's L2 norm of q and k (``use_qk_norm``: ``x / sqrt(mean(x^2) + eps)`` per head, no
  weight) comes *after* the rotation; GroupQueryAttention then runs with ``do_rotary=0``;
* **NoPE layers** (``no_rope_layers[i] == 0``): no rotation and no q/k norm; with
  ``attn_temperature_tuning`` the query is scaled by ``1 + attn_scale * log(1 + floor((p + 1) /
  floor_scale))`` at position ``p`` (Nakanishi, 2025: "Scalable-Softmax");
* **chunked attention** (``layer_types[i] == "chunked_attention"``): a query at position ``p`` sees only
  the keys of its own chunk, ``floor(k / C) == floor(p / C)`` with ``C = attention_chunk_size``: the
  causal mask of GroupQueryAttention plus an additive bias of ``-inf`` outside the chunk
  (``attention_bias``), computed once per forward from the positions.

Mixture of experts (``write_llama4_moe``): the router's top-k logits pass a sigmoid and *scale the
expert's input* (not its output), every expert is one slice of two 3-d weights (``gate_up_proj``
``(E, H, 2I)``, ``down_proj`` ``(E, I, H)``), and a shared expert runs on every token. ONNX Runtime's
MoE nodes weight the experts' outputs, which differs from scaling their inputs through a SiLU, so the
layer is written as transformers computes it: every expert on every token (a token's input is zero for
the experts it did not choose, and an expert without biases maps zero to zero), as two batched MatMuls.
Exact, at ``E / k`` times the routed work; the experts stay float (compress keeps 3-d expert weights
float and lists them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import TensorProto

from edgekit.export.lm_moe import GraphWriter

LLAMA4 = "llama4_text"
MS = "com.microsoft"


@dataclass(frozen=True)
class Llama4Positions:
    """What every layer reads of the positions, written once per graph: the chunked layers' attention
    bias and the NoPE layers' query scale (None where no layer needs it)."""

    chunk_bias: str | None
    temperature: str | None


def write_llama4_positions(w: GraphWriter, cfg: Any) -> Llama4Positions:
    """``chunk_bias``: (1, 1, sequence, total), 0 where a key is in the query's chunk of
    ``attention_chunk_size`` cache places, -inf elsewhere. ``temperature``: (sequence, 1),
    ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` at cache place ``p``."""
    i64 = lambda name, v: w.init(f"llama4/{name}", np.array(v, np.int64), shared=True)  # noqa: E731
    f32 = lambda name, v: w.init(f"llama4/{name}", np.array(v, np.float32), shared=True)  # noqa: E731
    layers = range(int(cfg.num_hidden_layers))
    types = list(getattr(cfg, "layer_types", None) or [])
    chunk = getattr(cfg, "attention_chunk_size", None)
    chunked = bool(chunk) and any(i < len(types) and types[i] == "chunked_attention" for i in layers)
    tempered = bool(getattr(cfg, "attn_temperature_tuning", False)) and not all(cfg.no_rope_layers[i] for i in layers)
    if not (chunked or tempered):
        return Llama4Positions(None, None)
    # transformers computes both from the cache positions (cache_position), not position_ids: the new
    # tokens' places in the cache, total - sequence .. total - 1
    seq = w.node("Shape", ["input_ids"], ["llama4/seq_len"], "llama4/seq_len", start=1, end=2)[0]
    seq = w.node("Squeeze", [seq], ["llama4/seq_len0"], "llama4/seq_len0")[0]
    first = w.node("Sub", ["total_i64", seq], ["llama4/first"], "llama4/first")[0]
    queries = w.node("Range", [first, "total_i64", i64("one", 1)], ["llama4/queries"], "llama4/queries")[0]
    bias = None
    if chunked:
        c = i64("chunk", chunk)
        q = w.node("Div", [queries, c], ["llama4/q_chunk"], "llama4/q_chunk")[0]  # non-negative: floor
        q = w.node("Unsqueeze", [q, i64("last_axis", [-1])], ["llama4/q_chunk2"], "llama4/q_chunk2")[0]
        keys = w.node("Range", [i64("zero", 0), "total_i64", i64("one", 1)], ["llama4/keys"], "llama4/keys")[0]
        k = w.node("Div", [keys, c], ["llama4/k_chunk"], "llama4/k_chunk")[0]  # (total,)
        same = w.node("Equal", [q, k], ["llama4/same_chunk"], "llama4/same_chunk")[0]  # (sequence, total)
        b2 = w.node("Where", [same, f32("seen", 0.0), f32("unseen", -np.inf)], ["llama4/chunk_bias2"],
                    "llama4/chunk_bias2")[0]
        bias = w.node("Unsqueeze", [b2, i64("batch_head_axes", [0, 1])], ["llama4/chunk_bias"], "llama4/chunk_bias")[0]
    temperature = None
    if tempered:
        x = w.node("Cast", [queries], ["llama4/queries_f"], "llama4/queries_f", to=TensorProto.FLOAT)[0]
        x = w.node("Add", [x, f32("t_one", 1.0)], ["llama4/t_next"], "llama4/t_next")[0]
        x = w.node("Div", [x, f32("t_floor_scale", float(cfg.floor_scale))], ["llama4/t_ratio"], "llama4/t_ratio")[0]
        x = w.node("Floor", [x], ["llama4/t_floor"], "llama4/t_floor")[0]
        x = w.node("Add", [x, f32("t_one1", 1.0)], ["llama4/t_1p"], "llama4/t_1p")[0]
        x = w.node("Log", [x], ["llama4/t_log"], "llama4/t_log")[0]
        x = w.node("Mul", [x, f32("t_attn_scale", float(cfg.attn_scale))], ["llama4/t_scaled"], "llama4/t_scaled")[0]
        x = w.node("Add", [x, f32("t_one2", 1.0)], ["llama4/t_scale"], "llama4/t_scale")[0]
        temperature = w.node("Unsqueeze", [x, i64("t_axis", [-1])], ["llama4/temperature"], "llama4/temperature")[0]
    return Llama4Positions(bias, temperature)


def _l2_norm(w: GraphWriter, x: str, n_heads: int, head_dim: int, eps: float, name: str) -> str:
    """Llama4TextL2Norm per head: ``x / sqrt(mean(x^2) + eps)`` (RMSNorm without a weight)."""
    split = w.node("Reshape", [x, w.init(f"{name}/heads", np.array([0, 0, n_heads, head_dim], np.int64))],
                   [f"{name}/split"], f"{name}/split")[0]
    normed = w.rms_norm(split, None, eps, f"{name}/normed")
    return w.node("Reshape", [normed, w.init(f"{name}/flat", np.array([0, 0, n_heads * head_dim], np.int64))],
                  [f"{name}/out"], f"{name}/merge")[0]


def llama4_attention_inputs(w: GraphWriter, p: str, q: str, k: str, cfg: Any, layer: int, heads: int,
                            kv_heads: int, head_dim: int, positions: Llama4Positions) -> tuple[str, str, str | None]:
    """(query, key, attention bias or None) for layer ``layer``'s GroupQueryAttention (``do_rotary=0``):
    rotated on interleaved pairs and L2-normed in rope layers, temperature-scaled in NoPE layers."""
    if cfg.no_rope_layers[layer]:
        rotated = []
        for x, n, kind in ((q, heads, "q"), (k, kv_heads, "k")):
            rotated.append(w.node("RotaryEmbedding", [x, "position_ids", "cos_cache", "sin_cache"],
                                  [f"{p}/{kind}_rotated"], f"{p}/attn/{kind}_rotary", MS, interleaved=1,
                                  num_heads=n)[0])
        q, k = rotated
        if getattr(cfg, "use_qk_norm", False):
            eps = float(cfg.rms_norm_eps)
            q = _l2_norm(w, q, heads, head_dim, eps, f"{p}/q_l2norm")
            k = _l2_norm(w, k, kv_heads, head_dim, eps, f"{p}/k_l2norm")
    elif positions.temperature is not None:
        q = w.node("Mul", [q, positions.temperature], [f"{p}/q_tempered"], f"{p}/q_temper")[0]
    types = getattr(cfg, "layer_types", None) or []
    chunked = layer < len(types) and types[layer] == "chunked_attention"
    return q, k, positions.chunk_bias if chunked else None


def is_llama4_moe(layer: Any) -> bool:
    return bool(getattr(layer, "is_moe_layer", False))


def _mlp(w: GraphWriter, x: str, mlp: Any, name: str) -> str:
    """Llama4TextMLP: ``down(silu(gate(x)) * up(x))``."""
    if w.config.fuse_gate_up:
        gu = w.linear(x, [mlp.gate_proj, mlp.up_proj], f"{name}.gate_up_proj")
        w.node("Split", [gu], [f"{name}/gate", f"{name}/up"], f"{name}/split", axis=-1, num_outputs=2)
        gate, up = f"{name}/gate", f"{name}/up"
    else:
        gate, up = w.linear(x, [mlp.gate_proj], f"{name}.gate_proj"), w.linear(x, [mlp.up_proj], f"{name}.up_proj")
    w.node("QuickGelu", [gate], [f"{name}/act"], f"{name}/silu", MS, alpha=1.0)
    w.node("Mul", [f"{name}/act", up], [f"{name}/gated"], f"{name}/mul")
    return w.linear(f"{name}/gated", [mlp.down_proj], f"{name}.down_proj")


def write_llama4_moe(w: GraphWriter, x: str, moe: Any, name: str) -> str:
    """Llama4TextMoe on ``x`` (batch, sequence, hidden); returns its output's name (see the module docstring)."""
    experts = moe.experts
    E, k = int(moe.num_experts), int(moe.top_k)
    H, inter = int(experts.hidden_size), int(experts.expert_dim)
    shared = _mlp(w, x, moe.shared_expert, f"{name}.shared_expert")
    logits = w.linear(x, [moe.router], f"{name}.router")  # (batch, sequence, experts)
    w.node("TopK", [logits, w.init(f"{name}/k", np.array([k], np.int64))], [f"{name}/top_v", f"{name}/top_i"],
           f"{name}/topk", axis=-1)
    top = w.node("Sigmoid", [f"{name}/top_v"], [f"{name}/top_scores"], f"{name}/sigmoid")[0]
    shape = w.node("Shape", [logits], [f"{name}/logits_shape"], f"{name}/logits_shape")[0]
    zeros = w.node("ConstantOfShape", [shape], [f"{name}/no_route"], f"{name}/no_route")[0]
    route = w.node("ScatterElements", [zeros, f"{name}/top_i", top], [f"{name}/route"], f"{name}/route",
                   axis=-1)[0]  # sigmoid of the chosen logits, 0 elsewhere (sigmoid(-inf) in transformers)
    route = w.node("Unsqueeze", [route, w.init(f"{name}/route_axis", np.array([-1], np.int64))],
                   [f"{name}/route4"], f"{name}/route4")[0]  # (b, s, E, 1)
    x4 = w.node("Unsqueeze", [x, w.init(f"{name}/x_axis", np.array([2], np.int64))], [f"{name}/x4"],
                f"{name}/x4")[0]  # (b, s, 1, H)
    routed_in = w.node("Mul", [x4, route], [f"{name}/routed_in"], f"{name}/routed_in")[0]  # (b, s, E, H)
    per_expert = w.node("Transpose", [routed_in], [f"{name}/per_expert"], f"{name}/per_expert",
                        perm=[2, 0, 1, 3])[0]  # (E, b, s, H)
    rows = w.node("Reshape", [per_expert, w.init(f"{name}/rows_shape", np.array([E, -1, H], np.int64))],
                  [f"{name}/rows"], f"{name}/rows")[0]  # (E, tokens, H)
    gate_up = experts.gate_up_proj.detach().float().numpy()  # (E, H, 2I): gate columns first
    if gate_up.shape != (E, H, 2 * inter):
        raise ValueError(f"{name}: gate_up_proj {gate_up.shape} is not (experts, hidden, 2 x intermediate)")
    gu = w.node("MatMul", [rows, w.init(f"{name}.experts.gate_up_proj", gate_up)], [f"{name}/gu"],
                f"{name}.experts.gate_up_proj")[0]
    w.node("Split", [gu], [f"{name}/gate", f"{name}/up"], f"{name}/gu_split", axis=-1, num_outputs=2)
    w.node("QuickGelu", [f"{name}/gate"], [f"{name}/act"], f"{name}/silu", MS, alpha=1.0)
    h = w.node("Mul", [f"{name}/act", f"{name}/up"], [f"{name}/gated"], f"{name}/gated")[0]  # (E, tokens, I)
    down = experts.down_proj.detach().float().numpy()  # (E, I, H)
    out = w.node("MatMul", [h, w.init(f"{name}.experts.down_proj", down)], [f"{name}/expert_out"],
                 f"{name}.experts.down_proj")[0]
    summed = w.node("ReduceSum", [out, w.init(f"{name}/expert_axis", np.array([0], np.int64))], [f"{name}/summed"],
                    f"{name}/sum_experts", keepdims=0)[0]  # (tokens, H)
    routed = w.node("Reshape", [summed, w.node("Shape", [x], [f"{name}/x_shape"], f"{name}/x_shape")[0]],
                    [f"{name}/routed"], f"{name}/routed")[0]
    return w.node("Add", [shared, routed], [f"{name}/out"], f"{name}/add_shared")[0]


__all__ = ["LLAMA4", "Llama4Positions", "is_llama4_moe", "llama4_attention_inputs", "write_llama4_moe",
           "write_llama4_positions"]
