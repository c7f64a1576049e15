"""Per-layer sensitivity and float fallback under a maximum accuracy drop.

``layer_sensitivity`` scores each quantized layer by how much the model's output error
(mean KL, or 1 - cosine for encoders) falls when only that layer goes back to float
weights, on a small subset of the evaluation data, and also reports the layer's weight
SQNR. ``fall_back`` then returns layers to float, most sensitive first, in growing
steps, until the metric drop against FP32 is within the budget, and reports the float
layers with their share of the model's multiply-accumulates (what their latency cost
scales with; the build/profile report shows the measured time of the float nodes).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from edgekit.compress import qdq


def _error(outputs: np.ndarray, ref: np.ndarray, evaluator: str | None) -> float:
    from edgekit.evaluate import agreement_metrics, cosine_metrics

    if evaluator == "cosine":
        return 1.0 - cosine_metrics(outputs, ref)["mean_cosine"]
    return agreement_metrics(outputs, ref)["mean_kl"]


def layer_macs(gm: fx.GraphModule, plan: Any, example: tuple[torch.Tensor, ...]) -> dict[str, int]:
    """Multiply-accumulates per quantized layer for one sample."""
    from torch.fx.passes.shape_prop import ShapeProp

    from edgekit.compress.equalize import _param_paths, _wq_node

    modes = {m: m.mode for m in qdq.act_quants(gm)}
    qdq.set_mode(gm, "float")
    try:
        ShapeProp(gm).propagate(*[e[:1] for e in example])
    finally:
        for m, mode in modes.items():
            m.mode = mode
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if not (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) or _wq_node(n) is None:
            continue
        meta = n.meta.get("tensor_meta")
        if meta is None:
            continue
        wpath, _ = _param_paths(gm, n)
        w = qdq._get_attr(gm, wpath)
        per_out = int(np.prod(w.shape[1:]))
        out[qdq._layer_name(wpath)] = int(np.prod(meta.shape)) * per_out
    return out


def weight_sqnr(gm: fx.GraphModule, plan: Any) -> dict[str, float]:
    out = {}
    for name, qname in plan.layers.items():
        w = qdq._get_attr(gm, name + ".weight").detach()
        m = gm.get_submodule(qname)
        was = m.enabled
        m.enabled = True
        err = m(w) - w
        m.enabled = was
        out[name] = float(10 * torch.log10(w.pow(2).sum() / err.pow(2).sum().clamp_min(1e-20)))
    return out


class _Unit:
    """One thing fallback can return to float: a layer's weights, or one activation tensor."""

    def __init__(self, name: str, module: Any) -> None:
        self.name, self.module = name, module

    @property
    def is_float(self) -> bool:
        m = self.module
        return (not m.enabled) if isinstance(m, qdq.WeightQuant) else m.mode == "float"

    def set_float(self, flag: bool) -> None:
        m = self.module
        if isinstance(m, qdq.WeightQuant):
            m.enabled = not flag
        else:
            m.mode = "float" if flag else "quant"


def fallback_units(gm: fx.GraphModule, plan: Any) -> list[_Unit]:
    units = [_Unit(name, gm.get_submodule(q)) for name, q in plan.layers.items()]
    units += [_Unit(f"act:{tensor}", gm.get_submodule(q)) for q, tensor in plan.activations.items()]
    return units


def layer_sensitivity(gm: fx.GraphModule, units: list[_Unit], samples: Any, names: list[str], ref: np.ndarray,
                      evaluator: str | None, subset: int = 32) -> dict[str, float]:
    """Error reduction when each unit alone returns to float (bigger = more sensitive)."""
    from edgekit.compress.int8 import run_module
    from edgekit.progress import progress_bar

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


def fall_back(gm: fx.GraphModule, plan: Any, samples: Any, names: list[str], ref: np.ndarray,
              fp32: dict[str, float], max_drop: float, evaluator: str | None) -> dict[str, Any]:
    """Return the most sensitive layers (weights) and activations to float until the
    quality drop is <= ``max_drop``."""
    from edgekit.compress.int8 import quality, run_module, score

    def measure() -> dict[str, float]:
        return score(run_module(gm, samples, names), ref, samples.labels, evaluator)

    def ok(m: dict[str, float]) -> bool:
        return q0 - quality(m) <= max_drop + 1e-12

    q0 = quality(fp32)
    current = measure()
    report: dict[str, Any] = {"max_accuracy_drop": max_drop, "fp32_quality": q0,
                              "all_int8": current, "float_layers": [], "float_activations": [], "met": True}
    if ok(current):
        report["final"] = current
        report["float_mac_share"] = 0.0
        return report
    units = {u.name: u for u in fallback_units(gm, plan)}
    sens = layer_sensitivity(gm, list(units.values()), samples, names, ref, evaluator)
    order = sorted(sens, key=lambda k: -sens[k])
    steps = []
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
    if ok(current) and chosen <= 16:  # give back to int8 what turned out not to be needed
        for name in reversed(order[:chosen - 1]):
            units[name].set_float(False)
            trial = measure()
            if ok(trial):
                current = trial
            else:
                units[name].set_float(True)
    float_units = [n for n in order if units[n].is_float]
    float_layers = [n for n in float_units if not n.startswith("act:")]
    sqnr = weight_sqnr(gm, plan)
    example = tuple(torch.from_numpy(np.ascontiguousarray(samples.inputs[n][:1])) for n in names)
    macs = layer_macs(gm, plan, example)
    total = max(sum(macs.values()), 1)
    report.update({
        "final": current, "float_layers": float_layers,
        "float_activations": [n[4:] for n in float_units if n.startswith("act:")], "steps": steps,
        "met": ok(current),
        "sensitivity": {n: round(sens[n], 6) for n in order[:20]},
        "weight_sqnr_db": {n: round(sqnr[n], 2) for n in float_layers},
        "float_mac_share": round(sum(macs.get(n, 0) for n in float_layers) / total, 4),
        "float_layer_macs": {n: macs.get(n, 0) for n in float_layers},
    })
    if not math.isfinite(report["float_mac_share"]):
        report["float_mac_share"] = None
    return report
