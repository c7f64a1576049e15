"""Mixture-of-experts layers of the fused decoder graph (``lm_graph``): Mixtral and Qwen2-MoE.

A layer's routed experts become one ONNX Runtime contrib node, which routes each token on the
CPU itself (softmax over the router's logits, top-k, the k experts' SwiGLU MLPs weighted and
summed) and computes only the k experts a token chose:

* ``com.microsoft::MoE`` for float experts;
* ``com.microsoft::QMoE`` for packed 4-bit experts: the codes, scales and zero points of each
  expert's linears as compress stored them (dequantized as ``(q - z) * s`` per block along the
  input features, like MatMulNBits: no re-quantization), ``accuracy_level`` as the dense
  MatMulNBits nodes have it (0: fp32 activations, exact; 4: int8 activations).

Both take the gate and up projections as one matrix with their rows interleaved (``g0, u0, g1,
u1, ...``, ``swiglu_fusion=1``, the only SwiGLU layout ONNX Runtime 1.31's CPU kernels accept)
and compute ``silu(g) * u`` as SwiGLU with ``alpha = 1``, ``beta = 0`` and no clamp. The router
stays the model's own linear (float: compress keeps routers in float) and feeds its logits.

Routing as the families compute it: Mixtral normalizes the top-k softmax weights to sum to one
(``normalize_routing_weights=1``); Qwen2-MoE does so only with ``norm_topk_prob`` and adds a shared
expert scaled by ``sigmoid(shared_expert_gate(x))``, written in standard ops and MatMul(NBits).

8-bit experts do not go to QMoE: its CPU kernel computes them only with int8 activations, so the
graph could not be checked exactly against the model. They are routed in standard ops instead
(softmax, TopK, the chosen experts' weights scattered over all experts) with every expert computed
by two MatMulNBits (all gate/up rows in one, all down columns stacked along K in the other): exact,
at E/k times the routed work (``benchmarks/bench_moe_decode.py`` measures both ways on one layer).

Not written (``moe_support`` says why, and ``export`` takes the traced graph or refuses): experts
with biases or of mixed bit widths, Qwen2-MoE's sliding-window layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from edgekit.errors import BadInputError
from edgekit.export.packing import QuantLinear, pack_codes, storage_bits

MS = "com.microsoft"
# QMoE blocks (a power of two >= 16 dividing the hidden and the expert's intermediate size)
EXPERT_BLOCKS = (16, 32, 64, 128, 256)
QMOE_BITS = (4,)  # packed expert widths with an fp32-compute QMoE kernel on the CPU
EXPERT_BITS = (4, 8)  # 8-bit experts: every expert computed by MatMulNBits, routing in standard ops
# model type -> (the layer attribute holding the block, the expert's gate / up / down linears)
MOE_LAYOUTS: dict[str, tuple[str, tuple[str, str, str]]] = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


class GraphWriter(Protocol):
    """What the fused graph's writer (``lm_graph._Writer``) offers this module."""

    config: Any  # FusedGraphConfig: block_size, accuracy_level, fuse_gate_up

    def init(self, name: str, arr: np.ndarray, shared: bool = False) -> str: ...

    def node(self, op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "",
             **attrs: Any) -> list[str]: ...

    def linear(self, x: str, layers: list[Any], name: str) -> str: ...

    def rms_norm(self, x: str, gamma: str | None, eps: float, out: str) -> str: ...


@dataclass(frozen=True)
class MoEBlock:
    """One layer's mixture of experts, read from its modules. ``experts``: (gate, up, down) per
    expert; ``shared``: the shared expert's (gate, up, down) and its gate linear (Qwen2-MoE)."""

    router: nn.Module
    experts: tuple[tuple[nn.Module, nn.Module, nn.Module], ...]
    top_k: int
    normalize: bool
    shared: tuple[nn.Module, nn.Module, nn.Module] | None = None
    shared_gate: nn.Module | None = None


def moe_block(layer: nn.Module, model_type: str) -> MoEBlock | None:
    """The layer's mixture of experts, or None for a dense layer (Qwen2-MoE's ``mlp_only_layers``)."""
    if model_type not in MOE_LAYOUTS:
        return None
    attr, (g, u, d) = MOE_LAYOUTS[model_type]
    block = getattr(layer, attr, None)
    experts = getattr(block, "experts", None)
    if block is None or experts is None:
        return None
    shared = getattr(block, "shared_expert", None)
    return MoEBlock(
        router=block.gate, experts=tuple((getattr(e, g), getattr(e, u), getattr(e, d)) for e in experts),
        top_k=int(block.top_k), normalize=bool(getattr(block, "norm_topk_prob", True)),
        shared=None if shared is None else (shared.gate_proj, shared.up_proj, shared.down_proj),
        shared_gate=getattr(block, "shared_expert_gate", None))


def _width(m: nn.Module) -> int | None:
    """Bits of a packed linear, None for a float one."""
    return storage_bits(m.bits) if isinstance(m, QuantLinear) else None


def moe_support(hf_model: Any) -> tuple[bool, str]:
    """(whether every mixture-of-experts layer of the model can be written, why not); True for a
    model without experts (or a config alone: nothing to check)."""
    cfg = getattr(hf_model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type == "qwen2_moe" and getattr(cfg, "use_sliding_window", False):
        return False, "Qwen2-MoE's sliding-window layers (use_sliding_window) are not written"
    layers = getattr(getattr(hf_model, "model", None), "layers", None) or []
    for i, layer in enumerate(layers):
        moe = moe_block(layer, str(model_type))
        if moe is None:
            continue
        mats = [m for e in moe.experts for m in e]
        if any(getattr(m, "bias", None) is not None for m in mats):
            return False, f"the experts of layer {i} have biases (not written)"
        widths = {_width(m) for m in mats}
        if len(widths) > 1:
            return False, (f"the experts of layer {i} mix bit widths {sorted(widths, key=str)} "
                           "(one MoE node takes one width)")
        (bits,) = widths
        if bits is not None and bits not in EXPERT_BITS:
            return False, (f"layer {i} has {bits}-bit experts (the fused graph writes float or "
                           f"{'/'.join(map(str, EXPERT_BITS))}-bit experts)")
        if bits is not None and not _blocks(mats):
            return False, f"the experts of layer {i} have no block (16..256) dividing their groups and sizes"
    return True, ""


def _blocks(mats: list[Any]) -> list[int]:
    """QMoE blocks valid for every packed linear of ``mats``: dividing its input size and its group."""
    return [b for b in EXPERT_BLOCKS
            if all(m.in_features % b == 0 and (m.group_size == -1 or m.group_size % b == 0) for m in mats)]


def _choose_block(mats: list[Any], requested: int | None) -> int:
    valid = _blocks(mats)
    if requested is not None:
        if requested not in valid:
            raise BadInputError(f"MatMulNBits block size {requested} does not fit the experts (their sizes and "
                                f"quantization groups take {valid})")
        return requested
    return max(valid)


def _packed(m: QuantLinear, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """QMoE's per-expert arrays of one packed linear at ``block``: codes (N, K*bits/8), scales
    (N, K/block), zero points (N, ceil(K/block*bits/8)); a group's scale repeats over its blocks."""
    bits = storage_bits(m.bits)
    K = m.in_features
    group = K if m.group_size == -1 else m.group_size
    gidx = torch.arange(K // block) * block // group
    return (pack_codes(m.codes(), bits).numpy(), m.scales[:, gidx].float().numpy(),
            pack_codes(m.zeros()[:, gidx], bits).numpy())


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """(E, I, ...) gate and up rows -> (E, 2I, ...) as g0, u0, g1, u1, ... (swiglu_fusion=1)."""
    return np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], *gate.shape[2:])


def _shared_expert(w: GraphWriter, x: str, moe: MoEBlock, name: str) -> str | None:
    """Qwen2-MoE's shared expert (every token runs it), scaled by its own sigmoid gate; None without one."""
    if moe.shared is None:
        return None
    s_gate, s_up, s_down = moe.shared
    s = f"{name}.shared_expert"
    if w.config.fuse_gate_up:
        gu = w.linear(x, [s_gate, s_up], f"{s}.gate_up_proj")
        w.node("Split", [gu], [f"{s}/gate", f"{s}/up"], f"{s}/split", axis=-1, num_outputs=2)
        gate, up = f"{s}/gate", f"{s}/up"
    else:
        gate, up = w.linear(x, [s_gate], f"{s}.gate_proj"), w.linear(x, [s_up], f"{s}.up_proj")
    w.node("QuickGelu", [gate], [f"{s}/act"], f"{s}/silu", MS, alpha=1.0)
    w.node("Mul", [f"{s}/act", up], [f"{s}/gated"], f"{s}/mul")
    shared = w.linear(f"{s}/gated", [s_down], f"{s}.down_proj")
    if moe.shared_gate is not None:
        g = w.linear(x, [moe.shared_gate], f"{name}.shared_expert_gate")
        w.node("Sigmoid", [g], [f"{s}/weight"], f"{s}/sigmoid")
        shared = w.node("Mul", [f"{s}/weight", shared], [f"{s}/scaled"], f"{s}/scale")[0]
    return shared


def _every_expert(w: GraphWriter, x: str, logits: str, moe: MoEBlock, name: str) -> str:
    """8-bit experts (QMoE's 8-bit CPU kernel has int8 activations only, so nothing exact to check it
    against): every expert computed by MatMulNBits and weighted by its routing weight, zero where the
    router did not choose it. Exact, at E/k times the routed work (``bench_moe_decode.py``): the gate
    and up rows of all experts in one matmul, the down columns of all experts stacked along K in another
    (a block never straddles two experts: blocks divide the intermediate size)."""
    E, k = len(moe.experts), moe.top_k
    gates, ups, downs = (list(t) for t in zip(*moe.experts, strict=True))
    inter = gates[0].out_features
    gu = w.linear(x, [m for e in moe.experts for m in e[:2]], f"{name}.experts.gate_up_proj")  # (b, s, E*2*I)
    gu = w.node("Reshape", [gu, w.init(f"{name}/gu_shape", np.array([0, 0, E, 2, inter], np.int64))],
                [f"{name}/gu_experts"], f"{name}/gu_experts")[0]
    w.node("Split", [gu], [f"{name}/gate", f"{name}/up"], f"{name}/gu_split", axis=3, num_outputs=2)
    w.node("QuickGelu", [f"{name}/gate"], [f"{name}/act"], f"{name}/silu", MS, alpha=1.0)
    h = w.node("Mul", [f"{name}/act", f"{name}/up"], [f"{name}/gated"], f"{name}/gated")[0]  # (b, s, E, 1, I)
    # routing weights as transformers computes them: softmax over all experts, top-k, optionally renormalized
    probs = w.node("Softmax", [logits], [f"{name}/probs"], f"{name}/softmax", axis=-1)[0]
    w.node("TopK", [probs, w.init(f"{name}/k", np.array([k], np.int64))], [f"{name}/top_w", f"{name}/top_i"],
           f"{name}/topk", axis=-1)
    top = f"{name}/top_w"
    if moe.normalize:
        total = w.node("ReduceSum", [top, w.init(f"{name}/last", np.array([-1], np.int64))], [f"{name}/top_sum"],
                       f"{name}/top_sum", keepdims=1)[0]
        top = w.node("Div", [top, total], [f"{name}/top_norm"], f"{name}/top_norm")[0]
    shape = w.node("Shape", [probs], [f"{name}/probs_shape"], f"{name}/probs_shape")[0]
    zeros = w.node("ConstantOfShape", [shape], [f"{name}/no_route"], f"{name}/no_route")[0]
    route = w.node("ScatterElements", [zeros, f"{name}/top_i", top], [f"{name}/route"], f"{name}/route",
                   axis=-1)[0]  # (b, s, E): the chosen experts' weights, zeros elsewhere
    route = w.node("Unsqueeze", [route, w.init(f"{name}/route_axes", np.array([3, 4], np.int64))],
                   [f"{name}/route5"], f"{name}/route5")[0]
    h = w.node("Mul", [h, route], [f"{name}/weighted"], f"{name}/weighted")[0]
    h = w.node("Reshape", [h, w.init(f"{name}/flat", np.array([0, 0, E * inter], np.int64))], [f"{name}/flat_h"],
               f"{name}/flat_h")[0]
    block = _choose_block(gates + ups + downs, w.config.block_size)
    parts = [_packed(m, block) for m in downs]  # per expert: (H, I) codes, (H, I/block) scales and zeros
    hidden = downs[0].out_features
    qweight = np.concatenate([p[0].reshape(hidden, -1, block) for p in parts], axis=1)  # 8-bit: a byte per code
    scales = np.concatenate([p[1] for p in parts], axis=1)
    zeros_ = np.concatenate([p[2] for p in parts], axis=1)
    attrs: dict[str, Any] = {"K": E * inter, "N": hidden, "bits": 8, "block_size": block}
    if w.config.accuracy_level:
        attrs["accuracy_level"] = w.config.accuracy_level
    out = f"{name}.experts.down_proj/out"
    w.node("MatMulNBits", [h, w.init(f"{name}.experts.down_proj.qweight", qweight),
                           w.init(f"{name}.experts.down_proj.scales", scales.reshape(-1)),
                           w.init(f"{name}.experts.down_proj.qzeros", zeros_.reshape(-1))], [out],
           f"{name}.experts.down_proj", MS, **attrs)
    return out


def write_moe(w: GraphWriter, x: str, moe: MoEBlock, name: str) -> str:
    """The layer's mixture of experts on ``x`` (batch, sequence, hidden); returns its output's name."""
    # the shared expert's nodes first: ONNX Runtime runs nodes in the order written here, and its
    # MoE kernels write their output into a buffer the planner may give them from a tensor that is
    # read later (measured on 1.31.1: the shared expert then read overwritten inputs)
    shared = _shared_expert(w, x, moe, name)
    logits = w.linear(x, [moe.router], f"{name}.gate")  # (batch, sequence, experts)
    attrs: dict[str, Any] = {"k": moe.top_k, "normalize_routing_weights": int(moe.normalize),
                             "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0,
                             "activation_beta": 0.0}
    routed = f"{name}/experts"
    gates, ups, downs = (list(t) for t in zip(*moe.experts, strict=True))
    if all(isinstance(m, QuantLinear) and storage_bits(m.bits) not in QMOE_BITS for m in gates + ups + downs):
        routed = _every_expert(w, x, logits, moe, name)
        return routed if shared is None else w.node("Add", [routed, shared], [f"{name}/out"], f"{name}/add_shared")[0]
    # the contrib nodes take the router's logits as (tokens, experts)
    probs = w.node("Reshape", [logits, w.init(f"{name}/router_shape", np.array([-1, len(moe.experts)], np.int64))],
                   [f"{name}/router_logits"], f"{name}/router_rows")[0]
    if all(isinstance(m, QuantLinear) for m in gates + ups + downs):
        block = _choose_block(gates + ups + downs, w.config.block_size)
        fc1 = [_packed(m, block) for m in gates], [_packed(m, block) for m in ups]
        fc2 = [_packed(m, block) for m in downs]
        inputs = [x, probs]
        for (part, label) in ((0, "qweight"), (1, "scales")):
            inputs.append(w.init(f"{name}.fc1.{label}", _interleave(np.stack([p[part] for p in fc1[0]]),
                                                                    np.stack([p[part] for p in fc1[1]]))))
        inputs.append("")
        inputs += [w.init(f"{name}.fc2.qweight", np.stack([p[0] for p in fc2])),
                   w.init(f"{name}.fc2.scales", np.stack([p[1] for p in fc2])), "", "", "", ""]
        inputs += [w.init(f"{name}.fc1.qzeros", _interleave(np.stack([p[2] for p in fc1[0]]),
                                                            np.stack([p[2] for p in fc1[1]]))),
                   w.init(f"{name}.fc2.qzeros", np.stack([p[2] for p in fc2]))]
        if not moe.normalize:  # the top-k softmax weights as they are (Qwen2-MoE without norm_topk_prob)
            # given as router_weights: QMoE's CPU kernel mixes wrongly with normalize_routing_weights=0 alone
            # (ONNX Runtime 1.31.1, measured: 0.14 off on outputs of 0.5); the float MoE kernel is right
            softmax = w.node("Softmax", [probs], [f"{name}/router_weights"], f"{name}/router_softmax", axis=-1)[0]
            inputs += ["", softmax]
        attrs.update(expert_weight_bits=storage_bits(gates[0].bits), block_size=block)
        if w.config.accuracy_level:
            attrs["accuracy_level"] = w.config.accuracy_level
        w.node("QMoE", inputs, [routed], f"{name}/experts", MS, **attrs)
    elif all(isinstance(m, nn.Linear) for m in gates + ups + downs):
        def weights(ms: list[Any]) -> np.ndarray:  # (E, out, in), as nn.Linear stores them
            return np.stack([m.weight.detach().float().numpy() for m in ms])

        w.node("MoE", [x, probs, w.init(f"{name}.fc1.weight", _interleave(weights(gates), weights(ups))), "",
                       w.init(f"{name}.fc2.weight", weights(downs))], [routed], f"{name}/experts", MS, **attrs)
    else:
        raise BadInputError(f"{name}: the experts mix packed and float linears")
    if shared is None:
        return routed
    return w.node("Add", [routed, shared], [f"{name}/out"], f"{name}/add_shared")[0]


__all__ = ["EXPERT_BITS", "MOE_LAYOUTS", "MoEBlock", "moe_block", "moe_support", "write_moe"]
