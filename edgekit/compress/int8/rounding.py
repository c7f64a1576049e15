"""Second-order weight rounding for INT8 (``Int8Config(rounding="gptq")``).

Round-to-nearest puts every weight on its int8 grid independently. GPTQ (Frantar et al.,
2022; OBQ before it) rounds a layer's weight columns one at a time and spreads each
column's rounding error over the columns not yet rounded, weighted by the inverse of the
layer's input second moment ``H = E[x xᵀ]``, so the layer's *output* error on real inputs
shrinks, not the weight error. Here the grid is fixed (the per-channel int8 scales
edgekit already chose), so the result is int8 weights on the same grid: nothing changes
in the exported graph or the engine's speed.

* ``input_hessians`` accumulates ``H`` for every quantized conv / linear layer in ONE pass
  of the fake-quant model over calibration samples (each layer sees its real, quantized
  input): ``(K, K)`` shared by all output channels for a dense layer (``K = Cin·kh·kw``,
  im2col columns in the weight's order), ``(C, k·k, k·k)`` one per channel for a depthwise
  convolution.
* ``gptq_round(W, scale, H)`` is the solve: ``gptq.gptq_solve_fixed`` (the 4-bit path's solver
  for a grid fixed in advance, in place on the transposed weight) for a dense layer,
  ``gptq.gptq_solve`` with per-channel Hessians for a depthwise convolution.
* ``round_model`` writes the rounded weights into the model and keeps each layer's float
  weight on its quantizer (``float_weight``), for bias correction (which corrects the
  shift against the float weights) and for fallback (a layer returned to float gets them).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from edgekit.compress.int8 import qdq
from edgekit.compress.int8.calibration import tensor_batches
from edgekit.compress.weight_only.gptq import HessianAccumulator, gptq_solve, gptq_solve_fixed, one_thread
from edgekit.sources.data import Samples

DAMP = 0.01  # fraction of the mean diagonal added to H (the GPTQ reference's percdamp)


def _conv_args(n: fx.Node, env_args: list[Any]) -> tuple[Any, Any, Any, int]:
    """(stride, padding, dilation, groups) of a functional conv node's evaluated args."""
    def arg(i: int, key: str, default: Any) -> Any:
        if len(env_args) > i:
            return env_args[i]
        return n.kwargs.get(key, default)

    return arg(3, "stride", 1), arg(4, "padding", 0), arg(5, "dilation", 1), int(arg(6, "groups", 1))


def input_hessians(gm: fx.GraphModule, plan: qdq.QuantPlan, samples: Samples, names: list[str], limit: int = 32,
                   batch_size: int = 2, channels_last: bool = False) -> dict[str, torch.Tensor]:
    """layer name -> ``2 E[x xᵀ]`` of its inputs (``gptq.HessianAccumulator``; see the module
    docstring), one pass."""
    targets: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) and n.op == "call_function":
            wq = qdq.layer_weight_quant(gm, n)
            if wq is not None and wq.enabled:
                targets[n] = qdq.layer_name(qdq.param_paths(gm, n)[0])
    acc: dict[str, HessianAccumulator] = {}

    def hessian(name: str, columns: int, groups: int | None = None) -> HessianAccumulator:
        if name not in acc:
            acc[name] = HessianAccumulator(columns, groups=groups)
        return acc[name]

    class _Probe(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n in targets:
                args = list(self.fetch_args_kwargs_from_env(n)[0])
                x = args[0].detach().float()
                w = qdq.get_attr(gm, qdq.param_paths(gm, n)[0])
                if qdq.is_linear(gm, n):
                    hessian(targets[n], x.shape[-1]).add_batch(x)
                elif x.dim() == 4:
                    stride, padding, dilation, groups = _conv_args(n, args)
                    k = tuple(w.shape[2:])
                    if not isinstance(padding, str):
                        if k == (1, 1) and stride in (1, (1, 1)) and padding in (0, (0, 0)):
                            cols = x.flatten(2)  # a pointwise conv's im2col is the input itself
                        else:
                            cols = F.unfold(x, k, dilation=dilation, padding=padding, stride=stride)  # (B, Cin*kk, L)
                        # one sample at a time, as transposed views of its im2col matrix: no copies
                        if groups == 1:
                            for cb in cols:  # (Cin*kk, L)
                                hessian(targets[n], cols.shape[1]).add_batch(cb.t())
                        elif groups == x.shape[1] == w.shape[0] and w.shape[1] == 1:  # depthwise
                            kk = k[0] * k[1]
                            for cb in cols.reshape(x.shape[0], groups, kk, -1):  # (C, kk, L)
                                hessian(targets[n], kk, groups).add_batch(cb.transpose(1, 2))
            return super().run_node(n)

    sub = samples.subset(slice(0, min(limit, len(samples))))
    gm.eval()
    with torch.no_grad():
        for args in tensor_batches(sub, names, batch_size, channels_last):
            _Probe(gm).run(*args)
    return {k: a.H for k, a in acc.items()}


def gptq_round(W: torch.Tensor, scale: torch.Tensor, H: torch.Tensor, qmin: int = qdq.WEIGHT_QMIN,
               qmax: int = qdq.WEIGHT_QMAX, damp: float = DAMP) -> torch.Tensor:
    """Round ``W`` (rows, K) onto the per-row grid ``scale`` (rows,) minimising
    ``(W - Q) H (W - Q)ᵀ`` column by column (``gptq.gptq_solve``, in float64). ``H``: (K, K)
    shared, or (rows, K, K) one per row. Returns ``Q`` (rows, K), float, every value
    ``scale * integer`` in [qmin, qmax]."""
    s = scale.detach().double().reshape(-1)
    if H.dim() == 2:  # one H for all rows: the in-place solve on the transposed weight, the grid inlined
        rows, cols = W.shape
        zero = torch.full((rows, cols), float(-qmin), dtype=torch.float64)
        codes = gptq_solve_fixed(W.detach().double(), H.detach().double(), s[:, None].expand(rows, cols),
                                 zero, qmax - qmin, damp=damp)
        return ((codes + qmin) * s[:, None]).float()

    def grid(_col: int, w: torch.Tensor, _ahead: object) -> torch.Tensor:
        return torch.clamp(torch.round(w / s), qmin, qmax) * s

    Q, _ = gptq_solve(W.detach().double(), H.detach().double(), grid, damp=damp)
    return Q.float()


def output_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> float:
    """``Σ_rows (W - Q) H (W - Q)ᵀ``: the layer's mean squared output error per input row."""
    D = (W.double() - Q.double())
    if H.dim() == 3:
        return float(torch.einsum("ri,rij,rj->", D, H.double(), D))
    return float(torch.einsum("ri,ij,rj->", D, H.double(), D))


def round_model(gm: fx.GraphModule, plan: qdq.QuantPlan, samples: Samples, names: list[str],
                limit: int = 32, channels_last: bool = False) -> dict[str, Any]:
    """GPTQ-round every enabled layer's weights in place (grid unchanged). Returns per-layer
    output errors of round-to-nearest and GPTQ (same H), and their total ratio."""
    hs = input_hessians(gm, plan, samples, names, limit=limit, channels_last=channels_last)
    before = after = 0.0
    layers: dict[str, list[float]] = {}
    with one_thread():  # thousands of small operations: see gptq.one_thread
        for name, H in hs.items():
            _round_layer(gm, plan, name, H, layers)
    for e0, e1 in layers.values():
        before, after = before + e0, after + e1
    return {"layers": len(layers), "output_error_ratio": round(after / before, 4) if before > 0 else None,
            "per_layer": {k: round(v[1] / v[0], 4) for k, v in layers.items() if v[0] > 0}}


def _round_layer(gm: fx.GraphModule, plan: qdq.QuantPlan, name: str, H: torch.Tensor,
                 layers: dict[str, list[float]]) -> None:
    """GPTQ-round one layer in place where that lowers its output error; ``layers[name] = [rtn, gptq]``."""
    wq = qdq.weight_quant(gm, plan.layers[name])
    wpath = name + ".weight"
    w = qdq.get_attr(gm, wpath).detach()
    W2 = w.reshape(w.shape[0], -1).float()
    if H.shape[-1] != W2.shape[1] or not torch.isfinite(H).all():
        return
    rtn = wq(w).reshape(W2.shape)
    Q = gptq_round(W2, wq.scale, H, wq.qmin, wq.qmax)
    e0, e1 = output_error(W2, rtn, H), output_error(W2, Q, H)
    if not e1 < e0:  # keep round-to-nearest where the solve did not help
        return
    wq.float_weight = (wpath, w.clone())
    qdq.set_param(gm, wpath, Q.reshape(w.shape).to(w.dtype))
    layers[name] = [e0, e1]

