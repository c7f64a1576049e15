"""Per-layer sensitivity and float fallback under a maximum accuracy drop.

All of it runs on calibration-split data (never on the evaluation split): ``fall_back``
gets the samples that ``int8.apply`` held out of range calibration.

1. ``output_sqnr`` ranks every fallback unit (a layer's weights, or one activation tensor)
   in ONE forward pass: the SQNR of the layer's output with quantized versus float
   weights on the same input, and of each quantized activation against its float value.
2. ``layer_sensitivity`` measures every layer's weights and the ``candidates`` lowest-SQNR
   activations: how much the model's output error (mean KL, or 1 - cosine for encoders)
   falls when that unit alone returns to float, on a small subset (one pass of ``subset``
   samples per unit; EfficientNet-Lite0: 50 layers + 12 activations, ~2-4 min on 2 cores).
3. ``fall_back`` returns units to float, most sensitive first, in growing steps, until the
   metric drop against FP32 is within the budget, gives back what was not needed, and
   reports the float layers with their share of the model's multiply-accumulates (what
   their latency cost scales with; the build/profile report shows the float nodes' time).

A layer returned to float weights also gets back the bias shift that bias correction
had subtracted for its (now absent) weight rounding error.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

from edgekit.compress.int8 import qdq
from edgekit.compress.int8.calibration import quality, run_module, score, tensor_batches
from edgekit.compress.int8.technique_configs import FallbackConfig
from edgekit.evaluate import agreement_metrics, cosine_metrics
from edgekit.progress import progress_bar
from edgekit.sources.data import Samples

MAX_SCANNED_LAYERS = 64  # above this, only the lowest-SQNR candidates are scanned


def _error(outputs: np.ndarray, ref: np.ndarray, evaluator: str | None) -> float:
    if evaluator == "cosine":
        return 1.0 - cosine_metrics(outputs, ref)["mean_cosine"]
    return agreement_metrics(outputs, ref)["mean_kl"]


def layer_macs(gm: fx.GraphModule, plan: qdq.QuantPlan, example: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Multiply-accumulates per quantized layer for one sample."""

    modes = {m: m.mode for m in qdq.act_quants(gm)}
    qdq.set_mode(gm, "float")
    try:
        ShapeProp(gm).propagate(*[e[:1] for e in example])
    finally:
        for m, mode in modes.items():
            m.mode = mode
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if not (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) or qdq.weight_quant_node(n) is None:
            continue
        meta = n.meta.get("tensor_meta")
        if meta is None:
            continue
        wpath, _ = qdq.param_paths(gm, n)
        w = qdq.get_attr(gm, wpath)
        per_out = int(np.prod(w.shape[1:]))
        out[qdq.layer_name(wpath)] = int(np.prod(meta.shape)) * per_out
    return out


def weight_sqnr(gm: fx.GraphModule, plan: qdq.QuantPlan) -> dict[str, float]:
    out = {}
    for name, qname in plan.layers.items():
        w = qdq.get_attr(gm, name + ".weight").detach()
        m = qdq.weight_quant(gm, qname)
        was = m.enabled
        m.enabled = True
        err = m(w) - w
        m.enabled = was
        out[name] = float(10 * torch.log10(w.pow(2).sum() / err.pow(2).sum().clamp_min(1e-20)))
    return out


def exclusive_input_quants(gm: fx.GraphModule, layers: set[str]) -> list[str]:
    """Activation quantizers (module names) whose every use is the input of one of ``layers``.

    A layer kept in float must lose these too: ONNX Runtime (1.20+, its WeightBiasQuantization
    transformer) quantizes the float weight of a Conv / Gemm that reads a DequantizeLinear
    and writes a QuantizeLinear (per-tensor, without edgekit's bias correction), so a float
    weight alone would run in int8 anyway, and worse."""

    layer_of = qdq.quantized_layers(gm)
    calls: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), qdq.ActQuant):
            calls.setdefault(str(n.target), []).append(n)

    def reads_only_layers(n: fx.Node, q: str) -> bool:
        # every use is a kept layer's input, directly or through ops that only move values (a zero pad
        # before a convolution, a flatten before a linear; the same quantizer again after a pad), which
        # then run on the float values too
        if not n.users:
            return False
        for u in n.users:
            if layer_of.get(u) in layers and u.args[0] is n:
                continue
            moves = qdq.is_passthrough(gm, u) or (u.op == "call_module" and str(u.target) == q)
            if not (moves and u.args[0] is n and reads_only_layers(u, q)):
                return False
        return True

    return [q for q, nodes in calls.items() if all(reads_only_layers(c, q) for c in nodes)]


class FallbackUnit:
    """One thing fallback can return to float: a layer's weights (with the activation
    quantizers that only feed it), or one activation tensor."""

    def __init__(self, name: str, module: qdq.WeightQuant | qdq.ActQuant, gm: fx.GraphModule | None = None) -> None:
        self.name, self.module, self.gm = name, module, gm
        self.inputs: list[qdq.ActQuant] = []
        if isinstance(module, qdq.WeightQuant) and gm is not None:
            self.inputs = [qdq.act_quant(gm, q) for q in exclusive_input_quants(gm, {name})]

    @property
    def is_float(self) -> bool:
        m = self.module
        return (not m.enabled) if isinstance(m, qdq.WeightQuant) else m.mode == "float"

    def set_float(self, flag: bool) -> None:
        m = self.module
        if isinstance(m, qdq.WeightQuant):
            if flag != self.is_float and self.gm is not None:
                if m.bias_shift is not None:
                    bpath, shift = m.bias_shift  # undo / redo bias correction with the weights
                    b = qdq.get_attr(self.gm, bpath).detach()
                    qdq.set_param(self.gm, bpath, b + shift if flag else b - shift)
                if m.float_weight is not None:  # GPTQ-rounded weights: swap with the float ones
                    wpath, other = m.float_weight
                    current = qdq.get_attr(self.gm, wpath).detach().clone()
                    qdq.set_param(self.gm, wpath, other)
                    m.float_weight = (wpath, current)
            m.enabled = not flag
            for a in self.inputs:
                a.mode = "float" if flag else "quant"
        else:
            m.mode = "float" if flag else "quant"


def fallback_units(gm: fx.GraphModule, plan: qdq.QuantPlan) -> list[FallbackUnit]:
    units = [FallbackUnit(name, qdq.weight_quant(gm, q), gm) for name, q in plan.layers.items()]
    units += [FallbackUnit(f"act:{tensor}", qdq.act_quant(gm, q)) for q, tensor in plan.activations.items()]
    return units


def _sqnr_db(signal: float, noise: float) -> float:
    return float(10 * math.log10(max(signal, 1e-30) / max(noise, 1e-30)))


def output_sqnr(gm: fx.GraphModule, plan: qdq.QuantPlan, samples: Samples, names: list[str], limit: int = 16,
                batch_size: int = 8) -> dict[str, float]:
    """SQNR in dB of every fallback unit, from one pass over ``limit`` samples of the
    quantized model: for a layer, its output with quantized against float weights (same,
    quantized input); for an activation, its fake-quantized against its float value.
    Lower = noisier = a fallback candidate."""
    layer_of = {}  # conv/linear node -> layer name
    for n in gm.graph.nodes:
        if (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) and qdq.weight_quant_node(n) is not None:
            layer_of[n] = qdq.layer_name(qdq.param_paths(gm, n)[0])
    act_of = {q: t for q, t in plan.activations.items()}
    acc: dict[str, list[float]] = {}

    def add(key: str, ref: torch.Tensor, got: torch.Tensor) -> None:
        r, d = ref.double(), (got - ref).double()
        a = acc.setdefault(key, [0.0, 0.0])
        a[0] += float((r * r).sum())
        a[1] += float((d * d).sum())

    class _Probe(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if n in layer_of:
                mod = qdq.layer_weight_quant(gm, n)
                if mod is not None and mod.enabled:
                    args_t, kwargs = self.fetch_args_kwargs_from_env(n)
                    args = list(args_t)
                    wpath = qdq.param_paths(gm, n)[0]
                    # The float weight; GPTQ rounding stores the rounded one in place and keeps
                    # the float one aside (comparing against it measured 308-343 dB: noise 0).
                    fw = mod.float_weight
                    args[1] = fw[1] if fw is not None and fw[0] == wpath else qdq.get_attr(gm, wpath)
                    if n.op == "call_module":
                        fn = gm.get_submodule(str(n.target))
                        ref = fn(*args, **kwargs)
                    elif callable(n.target):
                        ref = n.target(*args, **kwargs)
                    else:  # layer_of holds conv/linear calls only
                        raise RuntimeError(f"{n.name} calls no function")
                    add(layer_of[n], ref, out)
            elif n.op == "call_module" and str(n.target) in act_of:
                aq = qdq.act_quant(gm, str(n.target))
                x = n.args[0]
                if aq.mode == "quant" and isinstance(x, fx.Node):
                    add("act:" + act_of[str(n.target)], self.env[x], out)
            return out

    sub = samples.subset(slice(0, min(limit, len(samples))))
    gm.eval()
    with torch.no_grad():
        for args in tensor_batches(sub, names, batch_size):
            _Probe(gm).run(*args)
    return {k: _sqnr_db(v[0], v[1]) for k, v in acc.items()}


def layer_sensitivity(gm: fx.GraphModule, units: list[FallbackUnit], samples: Samples, names: list[str], ref: np.ndarray,
                      evaluator: str | None, subset: int = 32) -> dict[str, float]:
    """Error reduction when each unit alone returns to float (bigger = more sensitive):
    one pass over ``subset`` samples per unit."""
    n = min(subset, len(samples))
    sub = samples.subset(slice(0, n))
    base = _error(run_module(gm, sub, names), ref[:n], evaluator)
    scores = {}
    for u in progress_bar(units, "int8 sensitivity"):
        if u.is_float:
            continue
        u.set_float(True)
        scores[u.name] = base - _error(run_module(gm, sub, names), ref[:n], evaluator)
        u.set_float(False)
    return scores


def fall_back(gm: fx.GraphModule, plan: qdq.QuantPlan, samples: Samples, names: list[str], ref: np.ndarray,
              fp32: dict[str, float], config: FallbackConfig, evaluator: str | None, subset: int = 32,
              promote: bool = False) -> dict[str, Any]:
    """Return the most sensitive layers (weights) and activations to float until the
    quality drop on ``samples`` (calibration-split data held out of range calibration;
    ``ref``: the FP32 outputs on them) is <= ``config.max_accuracy_drop`` percentage points.
    ``config.candidates``: how many of the lowest-SQNR activations the scan measures besides every
    layer's weights (None: all of them; one pass of ``subset`` samples each).
    ``promote`` (schemes "u8s8p", "u8s7"): first give the sensitive layers on the narrower grid exact
    8-bit weights (``qdq.promote_u8u8``: integer u8 x u8 kernels, far cheaper than float), most sensitive first, in
    growing steps; float units only if that is not enough. Promotions are kept (not given back)."""
    max_drop = config.max_accuracy_drop / 100.0  # a fraction: 0.01 = 1 point
    candidates = config.candidates

    def measure() -> dict[str, float]:
        return score(run_module(gm, samples, names), ref, samples.labels, evaluator)

    def ok(m: dict[str, float]) -> bool:
        return q0 - quality(m) <= max_drop + 1e-12

    q0 = quality(fp32)
    current = measure()
    report: dict[str, Any] = {"max_accuracy_drop": max_drop, "fp32_quality": q0, "samples": len(samples),
                              "all_int8": current, "float_layers": [], "float_activations": [], "met": True}
    if ok(current):
        report["final"] = current
        report["float_mac_share"] = 0.0
        return report
    units = {u.name: u for u in fallback_units(gm, plan)}
    sqnr_out = output_sqnr(gm, plan, samples, names, limit=min(subset, 16))
    ranked = sorted((k for k in sqnr_out if k in units), key=lambda k: sqnr_out[k])
    # the scan: every layer's weights (their local SQNR misses e.g. a CNN's stem conv, which
    # measured as the most sensitive layer of EfficientNet-Lite0), or only the lowest-SQNR
    # ``candidates`` layers in a model with more than MAX_SCANNED_LAYERS; and the lowest-SQNR
    # ``candidates`` activations (None: all)
    layers = [k for k in units if not k.startswith("act:") and not units[k].is_float]
    acts = [k for k in ranked if k.startswith("act:")]
    if candidates is not None:
        acts = acts[:candidates]
        if len(layers) > MAX_SCANNED_LAYERS:
            layers = [k for k in ranked if not k.startswith("act:")][:candidates]
    scan = layers + acts
    sens = layer_sensitivity(gm, [units[k] for k in scan], samples, names, ref, evaluator, subset=subset)
    order = sorted((k for k in sens if sens[k] > 0), key=lambda k: -sens[k])  # only units that helped
    steps = []
    promoted: list[str] = []
    if promote:
        can = set(qdq.u8u8_candidates(gm, plan))
        wide = [k for k in order if k in can]
        done = 0
        while done < len(wide) and not ok(current):
            k = max(1, done)  # 1, 1, 2, 4, ... layers at a time
            promoted += qdq.promote_u8u8(gm, plan, wide[done:done + k])
            done = min(len(wide), done + k)
            current = measure()
            steps.append({"u8u8_layers": len(promoted), "quality": quality(current)})
        if ok(current):
            order = []  # float units only where exact 8-bit weights were not enough (promoted ones too)
    chosen = 0
    while chosen < len(order):
        k = max(1, chosen)  # 1, 1, 2, 4, 8, ... units at a time
        for name in order[chosen:chosen + k]:
            units[name].set_float(True)
        chosen = min(len(order), chosen + k)
        current = measure()
        steps.append({"float_units": chosen, "quality": quality(current)})
        if ok(current):
            break
    if ok(current) and 1 < chosen <= 8:  # give back to int8 what turned out not to be needed
        for name in reversed(order[:chosen - 1]):
            units[name].set_float(False)
            trial = measure()
            if ok(trial):
                current = trial
            else:
                units[name].set_float(True)
    if promote:
        report["u8u8_layers"] = [n for n in promoted if not units[n].is_float]
    float_units = [n for n in order if units[n].is_float]
    float_layers = [n for n in float_units if not n.startswith("act:")]
    # the activation tensors now in float: the units chosen, and the inputs of float layers
    float_acts = [t for q, t in plan.activations.items() if qdq.act_quant(gm, q).mode == "float"]
    sqnr = weight_sqnr(gm, plan)
    example = tuple(torch.from_numpy(np.ascontiguousarray(samples.inputs[n][:1])) for n in names)
    macs = layer_macs(gm, plan, example)
    total = max(sum(macs.values()), 1)
    report.update({
        "final": current, "float_layers": float_layers,
        "float_activations": float_acts, "steps": steps,
        "met": ok(current),
        "sensitivity": {n: round(sens[n], 6) for n in order[:20]},
        "output_sqnr_db": {n: round(sqnr_out[n], 2) for n in ranked[:20]},
        "scanned_units": len(scan),
        "weight_sqnr_db": {n: round(sqnr[n], 2) for n in float_layers},
        "float_mac_share": round(sum(macs.get(n, 0) for n in float_layers) / total, 4),
        "float_layer_macs": {n: macs.get(n, 0) for n in float_layers},
    })
    if not math.isfinite(report["float_mac_share"]):
        report["float_mac_share"] = None
    return report
