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

    from edgekit.compress.equalize import _groups, _param_paths, _wq_node

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


def layer_sensitivity(gm: fx.GraphModule, plan: Any, samples: Any, names: list[str], ref: np.ndarray,
                      evaluator: str | None, subset: int = 64) -> dict[str, float]:
    """Error reduction when each layer alone returns to float (bigger = more sensitive)."""
    from edgekit.compress.int8 import run_module
    from edgekit.progress import progress_bar

    n = min(subset, len(samples))
    sub = samples.subset(slice(0, n))
    base = _error(run_module(gm, sub, names), ref[:n], evaluator)
    scores = {}
    for name in progress_bar(list(plan.layers), "int8 sensitivity"):
        m = gm.get_submodule(plan.layers[name])
        if not m.enabled:
            continue
        m.enabled = False
        scores[name] = base - _error(run_module(gm, sub, names), ref[:n], evaluator)
        m.enabled = True
    return scores


def fall_back(gm: fx.GraphModule, plan: Any, samples: Any, names: list[str], ref: np.ndarray,
              fp32: dict[str, float], max_drop: float, evaluator: str | None) -> dict[str, Any]:
    """Keep the most sensitive layers in float until the quality drop is <= ``max_drop``."""
    from edgekit.compress.int8 import quality, run_module, score

    def measure() -> dict[str, float]:
        return score(run_module(gm, samples, names), ref, samples.labels, evaluator)

    q0 = quality(fp32)
    current = measure()
    report: dict[str, Any] = {"max_accuracy_drop": max_drop, "fp32_quality": q0,
                              "all_int8": current, "float_layers": [], "met": True}
    if q0 - quality(current) <= max_drop + 1e-12:
        report["final"] = current
        report["float_mac_share"] = 0.0
        return report
    sens = layer_sensitivity(gm, plan, samples, names, ref, evaluator)
    order = sorted(sens, key=lambda k: -sens[k])
    sqnr = weight_sqnr(gm, plan)
    example = tuple(torch.from_numpy(np.ascontiguousarray(samples.inputs[n][:1])) for n in names)
    macs = layer_macs(gm, plan, example)
    total = max(sum(macs.values()), 1)
    steps = []
    k, chosen = 0, 0
    while chosen < len(order):
        k = max(1, chosen) if chosen else 1
        new = order[chosen:chosen + k]
        for name in new:
            gm.get_submodule(plan.layers[name]).enabled = False
        chosen += len(new)
        current = measure()
        steps.append({"float_layers": chosen, "quality": quality(current)})
        if q0 - quality(current) <= max_drop + 1e-12:
            break
    # trim: give back to int8 the last-added layers that are not needed
    for name in reversed(order[:chosen]):
        m = gm.get_submodule(plan.layers[name])
        m.enabled = True
        trial = measure()
        if q0 - quality(trial) <= max_drop + 1e-12:
            current = trial
        else:
            m.enabled = False
    float_layers = [n for n in order if not gm.get_submodule(plan.layers[n]).enabled]
    report.update({
        "final": current, "float_layers": float_layers, "steps": steps,
        "met": q0 - quality(current) <= max_drop + 1e-12,
        "sensitivity": {n: round(sens[n], 6) for n in order[:20]},
        "weight_sqnr_db": {n: round(sqnr[n], 2) for n in float_layers},
        "float_mac_share": round(sum(macs.get(n, 0) for n in float_layers) / total, 4),
        "float_layer_macs": {n: macs.get(n, 0) for n in float_layers},
    })
    if not math.isfinite(report["float_mac_share"]):
        report["float_mac_share"] = None
    return report
