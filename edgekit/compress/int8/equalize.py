"""Cross-layer equalization and bias correction (Nagel et al., "Data-Free Quantization
Through Weight Equalization and Bias Correction", ICCV 2019), on the fake-quant graph.

Equalization: for two layers ``a -> act -> b`` where ``act`` is positively homogeneous
(none, or ReLU), ``b(act(a(x)))`` is unchanged when output channel ``i`` of ``a`` is
divided by ``s_i`` and input channel ``i`` of ``b`` multiplied by it. With
``s_i = sqrt(r_a_i / r_b_i)`` (``r``: the channel's weight range) both layers end with
equal per-channel ranges, which is what per-tensor activation and per-channel weight
grids like. ReLU6 is *not* homogeneous (the clip at 6 moves), so pairs across ReLU6 are
left alone unless the model's ReLU6 were replaced by ReLU (``relu6_to_relu``), which
changes the float model and is therefore opt-in.

Bias correction: weight quantization shifts each output channel's mean by
``E[conv(x, W_q - W)]``; with the per-channel means of the layer's (quantized) input,
``E[x_i]``, the shift is ``sum_i sum_k (W_q - W)[c, i, k] E[x_i]`` (exact for linear
layers, up to border effects for padded convolutions) and is subtracted from the bias.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from edgekit.compress.int8 import qdq
from edgekit.compress.int8.calibration import tensor_batches
from edgekit.sources.data import Samples


def _is_relu(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))) is nn.ReLU
    return n.op == "call_function" and n.target in (F.relu, torch.relu)


def equalize_pairs(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """Layer pairs ``a -> [ReLU] -> b`` (through activation quantizers and padding) where
    ``a``'s output reaches only ``b``."""
    pairs = []
    for b in gm.graph.nodes:
        if not (qdq.is_conv(gm, b) or qdq.is_linear(gm, b)) or qdq.weight_quant_node(b) is None:
            continue
        n = b.args[0]
        ok = True
        seen_act = False
        while isinstance(n, fx.Node):
            if len(n.users) != 1:
                ok = False
                break
            if n.op == "call_module" and str(n.target).startswith("aq_"):
                n = n.args[0]
            elif qdq.is_passthrough(gm, n) and not (n.op == "call_module" and isinstance(
                    gm.get_submodule(str(n.target)), (nn.ZeroPad2d, nn.ConstantPad2d))):
                n = n.args[0]
            elif isinstance(n, fx.Node) and n.op == "call_module" and isinstance(
                    gm.get_submodule(str(n.target)), nn.ZeroPad2d):
                n = n.args[0]  # zero padding commutes with per-channel positive scaling
            elif not seen_act and _is_relu(gm, n):
                seen_act = True
                n = n.args[0]
            else:
                break
        if not ok or not isinstance(n, fx.Node):
            continue
        if (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) and qdq.weight_quant_node(n) is not None and len(n.users) == 1:
            pairs.append((n, b))
    return pairs


def equalize(gm: fx.GraphModule, plan: qdq.QuantPlan, iterations: int = 3) -> list[str]:
    """Equalize every eligible pair in place; returns "a -> b" names of the pairs."""
    pairs = equalize_pairs(gm)
    done = []
    for _ in range(iterations):
        for a, b in pairs:
            wa_path, ba_path = qdq.param_paths(gm, a)
            wb_path, _ = qdq.param_paths(gm, b)
            wa = qdq.get_attr(gm, wa_path).detach()
            wb = qdq.get_attr(gm, wb_path).detach()
            ga, gb = qdq.conv_groups(a), qdq.conv_groups(b)
            c = wa.shape[0]
            if ga != 1 and ga != c:  # grouped (not depthwise) convs: skip
                continue
            if gb == 1:
                if wb.shape[1] != c:
                    continue
                rb = wb.abs().transpose(0, 1).reshape(c, -1).amax(1)
            elif wb.shape[0] == c and wb.shape[1] == 1 and gb == c:
                rb = wb.abs().reshape(c, -1).amax(1)
            else:
                continue
            ra = wa.abs().reshape(c, -1).amax(1)
            s = torch.sqrt(ra / rb.clamp_min(1e-12)).clamp(1e-3, 1e3)
            s = torch.where((ra > 1e-12) & (rb > 1e-12), s, torch.ones_like(s))
            shape_a = (-1,) + (1,) * (wa.dim() - 1)
            qdq.set_param(gm, wa_path, wa / s.reshape(shape_a))
            if ba_path:
                qdq.set_param(gm, ba_path, qdq.get_attr(gm, ba_path).detach() / s)
            if gb == 1:
                shape_b = (1, -1) + (1,) * (wb.dim() - 2)
            else:
                shape_b = (-1,) + (1,) * (wb.dim() - 1)
            qdq.set_param(gm, wb_path, wb * s.reshape(shape_b))
    for a, b in pairs:
        done.append(f"{qdq.layer_name(qdq.param_paths(gm, a)[0])} -> {qdq.layer_name(qdq.param_paths(gm, b)[0])}")
    return done


def equalize_activation(gm: fx.GraphModule, consumers: list[str] | tuple[str, ...], samples: Samples,
                        names: list[str], limit: int = 32, batch_size: int = 16,
                        channels_last: bool = False) -> dict[str, float]:
    """Activation-aware rescaling of the tensor between a pair ``a -> [ReLU] -> b`` of
    ``equalize_pairs`` (b named in ``consumers``), exact in float as equalization is: output channel
    ``c`` of ``a`` divided by ``s_c``, input channel ``c`` of ``b`` multiplied by it, with
    ``s_c = r_c / max(r)`` (``r_c``: the channel's largest |value| in the float model over ``limit``
    calibration samples), so every channel of the tensor spans the range of the widest one and uses
    the whole per-tensor activation grid; ``b``'s weights take the narrow channels' shrink (give ``b``
    exact 8-bit weights, ``qdq.promote_u8u8``). Where equalization already ran, this overrides it for
    the pair. Call before weight scales and calibration. Returns, per pair "a -> b", the ratio of
    the widest channel range to the median one before (1.0 after)."""
    wanted = set(consumers)
    pairs = [(a, b) for a, b in equalize_pairs(gm)
             if qdq.layer_name(qdq.param_paths(gm, b)[0]) in wanted and qdq.conv_groups(b) == 1]
    if not pairs:
        return {}
    ranges: dict[fx.Node, torch.Tensor] = {}

    class _Ranges(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            out = super().run_node(n)
            if n in producers:
                axis = 1 if qdq.is_conv(gm, n) else -1
                r = out.detach().abs().movedim(axis, 0).reshape(out.shape[axis], -1).amax(1)
                ranges[n] = r if n not in ranges else torch.maximum(ranges[n], r)
            return out

    producers = {a for a, _ in pairs}
    sub = samples.subset(slice(0, min(limit, len(samples))))
    gm.eval()
    with torch.no_grad(), qdq.float_model(gm):
        for args in tensor_batches(sub, names, batch_size, channels_last):
            _Ranges(gm).run(*args)
    spread = {}
    for a, b in pairs:
        r = ranges[a].double()
        s = (r / r.max()).clamp_min(1e-3).float()  # a dead channel: at most 1000x (as equalize)
        wa_path, ba_path = qdq.param_paths(gm, a)
        wb_path, _ = qdq.param_paths(gm, b)
        wa, wb = qdq.get_attr(gm, wa_path).detach(), qdq.get_attr(gm, wb_path).detach()
        if wb.shape[1] != s.shape[0]:
            continue
        qdq.set_param(gm, wa_path, wa / s.reshape((-1,) + (1,) * (wa.dim() - 1)))
        if ba_path:
            qdq.set_param(gm, ba_path, qdq.get_attr(gm, ba_path).detach() / s)
        qdq.set_param(gm, wb_path, wb * s.reshape((1, -1) + (1,) * (wb.dim() - 2)))
        key = f"{qdq.layer_name(wa_path)} -> {qdq.layer_name(wb_path)}"
        spread[key] = round(float(r.max() / r.median().clamp_min(1e-12)), 3)
    return spread


def relu6_to_relu(module: nn.Module) -> int:
    """Replace every nn.ReLU6 by nn.ReLU (makes equalization exact; changes the model)."""
    count = 0
    for _, child in list(module.named_modules()):
        for cname, c in list(child.named_children()):
            if type(c) is nn.ReLU6:
                setattr(child, cname, nn.ReLU())
                count += 1
    return count


def _ensure_bias(gm: fx.GraphModule, n: fx.Node, channels: int) -> str:
    wpath, bpath = qdq.param_paths(gm, n)
    if bpath:
        return bpath
    qdq.ensure_bias(gm, n, wpath, channels)
    gm.recompile()
    new_bpath = qdq.param_paths(gm, n)[1]
    if new_bpath is None:  # internal invariant: _ensure_bias just attached one
        raise RuntimeError(f"could not attach a bias to {n.name}")
    return new_bpath


def _recorder(gm: fx.GraphModule, name: str) -> _MeanRecorder:
    m = gm.get_submodule(name)
    if not isinstance(m, _MeanRecorder):  # internal invariant: correct_bias added it
        raise RuntimeError(f"{name} is not a mean recorder")
    return m


class _MeanRecorder(nn.Module):
    """Identity that accumulates the per-channel sum of what flows through it (axis 1 for
    conv inputs, the last axis for linear inputs)."""

    def __init__(self, axis: int) -> None:
        super().__init__()
        self.axis = axis
        self.sum: torch.Tensor | None = None
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.detach()
        axis = self.axis if self.axis >= 0 else d.dim() + self.axis
        s = d.sum(dim=[i for i in range(d.dim()) if i != axis]).double()  # per batch in float32, then float64
        self.sum = s if self.sum is None else self.sum + s
        self.count += d.numel() // d.shape[axis]
        return x


def correct_bias(gm: fx.GraphModule, plan: qdq.QuantPlan, float_module: nn.Module, samples: Samples, names: list[str],
                 batch_size: int = 16, max_samples: int = 64, channels_last: bool = False) -> int:
    """Empirical bias correction from the quantized inputs' per-channel means (one pass over
    at most ``max_samples`` calibration samples). Returns the number of layers corrected."""
    if len(samples) > max_samples:
        samples = samples.subset(slice(0, max_samples))
    targets = []
    added: list[tuple[fx.Node, str]] = []
    x_of: dict[fx.Node, fx.Node] = {}  # recorder call -> the input it records
    g = gm.graph
    for n in list(g.nodes):
        if not (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) or qdq.weight_quant_node(n) is None:
            continue
        x = n.args[0]
        if not isinstance(x, fx.Node):
            continue
        name = f"bc_rec_{len(added)}"
        gm.add_submodule(name, _MeanRecorder(1 if qdq.is_conv(gm, n) else -1))
        with g.inserting_before(n):
            rec = g.call_module(name, (x,))
        n.replace_input_with(x, rec)
        added.append((rec, name))
        x_of[rec] = x
        targets.append((n, name))
    gm.recompile()
    gm.eval()
    try:
        with torch.no_grad():
            for args in tensor_batches(samples, names, batch_size, channels_last):
                gm(*args)
        recorders = {name: _recorder(gm, name) for _, name in added}
    finally:
        for rec, name in added:
            rec.replace_all_uses_with(x_of[rec])
            g.erase_node(rec)
            delattr(gm, name)
        gm.recompile()
    corrected = 0
    for n, key in targets:
        hook = recorders[key]
        if hook.sum is None or hook.count == 0:
            continue
        mean_x = (hook.sum / hook.count).float()
        wpath, _ = qdq.param_paths(gm, n)
        w = qdq.get_attr(gm, wpath).detach()
        wq_mod = qdq.layer_weight_quant(gm, n)
        if wq_mod is None or not wq_mod.enabled:
            continue
        # before GPTQ rounding; under GPTAQ rounding what it aimed at (its shift toward the float output stays)
        reference = wq_mod.rounding_target or wq_mod.float_weight
        w_float = reference[1] if reference is not None else w
        dw = wq_mod(w) - w_float  # (out, in/groups, k...)
        g_ = qdq.conv_groups(n) if qdq.is_conv(gm, n) else 1
        dsum = dw.reshape(dw.shape[0], dw.shape[1], -1).sum(-1)  # (out, in/groups)
        if g_ == 1:
            if dsum.shape[1] != mean_x.shape[0]:
                continue
            shift = dsum @ mean_x
        elif g_ == dw.shape[0] and dsum.shape[1] == 1 and mean_x.shape[0] == g_:
            shift = dsum[:, 0] * mean_x
        else:
            continue
        bpath = _ensure_bias(gm, n, w.shape[0])
        qdq.set_param(gm, bpath, qdq.get_attr(gm, bpath).detach() - shift)
        # kept so that a layer returned to float weights (fallback) gets its own bias back
        wq_mod.bias_shift = (bpath, shift.detach().clone())
        corrected += 1
    return corrected
