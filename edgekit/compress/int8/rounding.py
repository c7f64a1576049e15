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

``alpha > 0`` (``round_model(..., alpha=, reference=)``) rounds for an asymmetric objective: each
layer matches its output on a *reference* input ``x_ref`` from its quantized input ``x``, so it absorbs
part of its input's quantization error (on EfficientNet-Lite0: the stem's ReLU6 output, block 0's
linear-bottleneck output). The probe pass adds ``dXXT = 2 E[(x_ref - x) xᵀ]`` (one per channel for a
depthwise conv); the rounding then aims at ``W̃ = W + alpha · W dXXT H⁻¹`` (``gptq.asymmetric_target``)
on the same grid, and bias correction measures against ``W̃`` (``WeightQuant.rounding_target``).
``reference="model"`` is GPTAQ's (Li et al., 2025): ``x_ref`` is the float model's input of the layer
(a float pass beside the fake-quant one). GPTAQ probes layer by layer, each on the already-rounded layers
before it; this one pass probes every layer on round-to-nearest upstream, so each layer also corrects
errors the layers before it have already corrected, and on EfficientNet-Lite0 that compounds (top-1
agreement 84% -> 62% at alpha 0.25, benchmarks/RESULTS.md, issue 26). ``reference="input"``: ``x_ref``
is the layer's input before its own activation quantizer (in the same fake-quant pass): a layer absorbs
only the rounding and clipping of the activation it reads, which no other layer corrects.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn.functional as F

from edgekit.compress.int8 import pairs, qdq
from edgekit.compress.int8.calibration import tensor_batches
from edgekit.compress.weight_only.gptq import (
    HessianAccumulator,
    asymmetric_target,
    gptq_solve,
    gptq_solve_fixed,
    one_thread,
)
from edgekit.sources.data import Samples

DAMP = 0.01  # fraction of the mean diagonal added to H (the GPTQ reference's percdamp)
# What an asymmetric rounding's layer matches: the float model's output ("model", GPTAQ's), or its own
# output on its input before that input's activation quantizer ("input")
REFERENCES = ("model", "input")


def _conv_args(n: fx.Node, env_args: list[Any]) -> tuple[Any, Any, Any, int]:
    """(stride, padding, dilation, groups) of a functional conv node's evaluated args."""
    def arg(i: int, key: str, default: Any) -> Any:
        if len(env_args) > i:
            return env_args[i]
        return n.kwargs.get(key, default)

    return arg(3, "stride", 1), arg(4, "padding", 0), arg(5, "dilation", 1), int(arg(6, "groups", 1))


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def conv_windows(x: torch.Tensor, kernel: tuple[int, ...], stride: Any, padding: Any, dilation: Any) -> torch.Tensor:
    """The windows a convolution reads from ``x`` (B, C, H, W), zero-padded as it pads: a view
    (B, C, kh, kw, Ho, Wo) whose reshapes are ``F.unfold``'s im2col matrix (B, C·kh·kw, Ho·Wo) or a
    depthwise convolution's per-channel one (C, kh·kw, B·Ho·Wo). On NCHW memory (``x`` is copied so
    if it is channels-last) each reshape copies whole rows: 1.3-1.6x faster than ``F.unfold``."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _pair(kernel), _pair(stride), _pair(padding), _pair(dilation)
    xp = F.pad(x.contiguous(), (pw, pw, ph, ph))
    B, C, H, W = xp.shape
    Ho, Wo = (H - dh * (kh - 1) - 1) // sh + 1, (W - dw * (kw - 1) - 1) // sw + 1
    sb, sc, sy, sx = xp.stride()
    return xp.as_strided((B, C, kh, kw, Ho, Wo), (sb, sc, sy * dh, sx * dw, sy * sh, sx * sw))


# Input values a probe batch may hold: eight 224x224 RGB images. Fewer, larger batches run fewer
# interpreted passes (EfficientNet-Lite0: GPTQ 1.1-1.6 CPU s less at 8 than at 2 images); the bound keeps
# a large detector's activations and im2col matrices (several GB at 800x608 and 8 images) to one image.
PROBE_VALUES = 8 * 3 * 224 * 224


def probe_batch_size(samples: Samples, names: list[str]) -> int:
    """Samples per batch of the Hessian probe: as many as hold ``PROBE_VALUES`` input values, 1 to 8."""
    per_sample = sum(int(np.prod(samples.inputs[n].shape[1:])) for n in names)
    return max(1, min(8, PROBE_VALUES // max(per_sample, 1)))


def input_hessians(gm: fx.GraphModule, plan: qdq.QuantPlan, samples: Samples, names: list[str], limit: int = 32,
                   batch_size: int | None = None, channels_last: bool = False, reference: str | None = None
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """layer name -> (``2 E[x xᵀ]`` of its inputs (``gptq.HessianAccumulator``), and with a
    ``reference`` ``2 E[(x_ref - x) xᵀ]``, else None): ``x_ref`` the same layer's input in the float
    model ("model") or before its own activation quantizer ("input"); see the module docstring. One
    pass (with "model", a float pass beside it)."""
    if reference is not None and reference not in REFERENCES:
        raise ValueError(f"unknown rounding reference {reference!r}; valid: {', '.join(REFERENCES)}")
    targets: dict[fx.Node, str] = {}
    for n in gm.graph.nodes:
        if (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) and n.op == "call_function":
            wq = qdq.layer_weight_quant(gm, n)
            if wq is not None and wq.enabled:
                targets[n] = qdq.layer_name(qdq.param_paths(gm, n)[0])
    acc: dict[str, HessianAccumulator] = {}
    shift: dict[str, torch.Tensor] = {}  # layer name -> Σ (x_fp - x) xᵀ over the rows seen

    def hessian(name: str, columns: int, groups: int | None = None) -> HessianAccumulator:
        if name not in acc:
            acc[name] = HessianAccumulator(columns, groups=groups)
        return acc[name]

    def add_shift(name: str, dxxt: torch.Tensor) -> None:
        shift[name] = dxxt if name not in shift else shift[name] + dxxt

    def im2col(n: fx.Node, x: torch.Tensor, args: list[Any], depthwise: bool) -> torch.Tensor | None:
        """The conv input's im2col matrix (B, Cin*kk, L), or a depthwise conv's per-channel one
        (C, kk, B*L); None for a string padding."""
        stride, padding, dilation, _ = _conv_args(n, args)
        k = tuple(qdq.get_attr(gm, qdq.param_paths(gm, n)[0]).shape[2:])
        if isinstance(padding, str):
            return None
        if k == (1, 1) and stride in (1, (1, 1)) and padding in (0, (0, 0)) and not depthwise:
            return x.flatten(2)  # a pointwise conv's im2col is the input itself
        v = conv_windows(x, k, stride, padding, dilation)  # (B, C, kh, kw, Ho, Wo)
        if depthwise:
            return v.permute(1, 2, 3, 0, 4, 5).reshape(v.shape[1], -1, v.shape[0] * v.shape[4] * v.shape[5])
        return v.reshape(v.shape[0], -1, v.shape[4] * v.shape[5])

    float_inputs: dict[fx.Node, torch.Tensor] = {}  # this batch's inputs of the targets in the float model

    class _FloatProbe(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n in targets:
                float_inputs[n] = self.fetch_args_kwargs_from_env(n)[0][0].detach().float()
            return super().run_node(n)

    class _Probe(fx.Interpreter):
        def __init__(self, module: fx.GraphModule) -> None:
            super().__init__(module)
            self.before_quant: dict[fx.Node, torch.Tensor] = {}  # an activation quantizer's node -> its input

        def unquantized_input(self, n: fx.Node) -> torch.Tensor | None:
            """``n``'s input with its activation quantizer skipped (the ops between replayed), or None."""
            path, p = [], n.args[0]
            while isinstance(p, fx.Node) and p not in self.before_quant and qdq.is_passthrough(gm, p):
                path.append(p)
                p = p.args[0]
            if not isinstance(p, fx.Node) or p not in self.before_quant:
                return None
            x = self.before_quant[p]
            for q in reversed(path):  # padding, reshapes: the same ops on the unquantized tensor
                args, kwargs = self.fetch_args_kwargs_from_env(q)
                x = getattr(self, q.op)(q.target, (x, *args[1:]), kwargs)
            return x.detach().float()

        def run_node(self, n: fx.Node) -> Any:
            if reference == "input" and n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), qdq.ActQuant):
                self.before_quant[n] = self.fetch_args_kwargs_from_env(n)[0][0]
            if n in targets:
                args = list(self.fetch_args_kwargs_from_env(n)[0])
                x = args[0].detach().float()
                x_fp = float_inputs.pop(n, None) if reference == "model" else (
                    self.unquantized_input(n) if reference == "input" else None)
                w = qdq.get_attr(gm, qdq.param_paths(gm, n)[0])
                if qdq.is_linear(gm, n):
                    hessian(targets[n], x.shape[-1]).add_batch(x)
                    if x_fp is not None:
                        xr = x.reshape(-1, x.shape[-1])
                        add_shift(targets[n], (x_fp.reshape(-1, x.shape[-1]) - xr).t() @ xr)
                elif x.dim() == 4:
                    groups = _conv_args(n, args)[3]
                    depthwise = groups == x.shape[1] == w.shape[0] and w.shape[1] == 1
                    if groups == 1 and (cols := im2col(n, x, args, False)) is not None:  # (B, Cin*kk, L)
                        cols_fp = None if x_fp is None else im2col(n, x_fp, args, False)
                        # one sample at a time, as transposed views of its im2col matrix: no copies
                        for i, cb in enumerate(cols):  # (Cin*kk, L)
                            hessian(targets[n], cols.shape[1]).add_batch(cb.t())
                            if cols_fp is not None:
                                add_shift(targets[n], (cols_fp[i] - cb) @ cb.t())
                    elif depthwise and (cols := im2col(n, x, args, True)) is not None:  # (C, kk, B*L)
                        # the whole batch in one product per channel
                        hessian(targets[n], cols.shape[1], groups).add_batch(cols.transpose(1, 2))
                        if x_fp is not None and (cols_fp := im2col(n, x_fp, args, True)) is not None:
                            add_shift(targets[n], torch.bmm(cols_fp - cols, cols.transpose(1, 2)))
            return super().run_node(n)

    sub = samples.subset(slice(0, min(limit, len(samples))))
    batch_size = batch_size or probe_batch_size(sub, names)
    gm.eval()
    with torch.no_grad():
        for args in tensor_batches(sub, names, batch_size, channels_last):
            if reference == "model":
                with qdq.float_model(gm):
                    _FloatProbe(gm).run(*args)
            _Probe(gm).run(*args)
    return {k: (a.H, shift[k] * (2.0 / a.nsamples) if k in shift else None) for k, a in acc.items()}


def gptq_round(W: torch.Tensor, scale: torch.Tensor, H: torch.Tensor, qmin: int = qdq.WEIGHT_QMIN,
               qmax: int = qdq.WEIGHT_QMAX, damp: float = DAMP,
               pair_partners: list[list[int]] | None = None) -> torch.Tensor:
    """Round ``W`` (rows, K) onto the per-row grid ``scale`` (rows,) minimising
    ``(W - Q) H (W - Q)ᵀ`` column by column (``gptq.gptq_solve``, in float64). ``H``: (K, K)
    shared, or (rows, K, K) one per row. Returns ``Q`` (rows, K), float, every value
    ``scale * integer`` in [qmin, qmax]. ``pair_partners`` (``pairs.partners``, shared ``H`` only):
    the pair-safe grid, every same-sign pair of codes kept within ``pairs.PAIR_BOUND``."""
    s = scale.detach().double().reshape(-1)
    if H.dim() == 2:  # one H for all rows: the in-place solve on the transposed weight, the grid inlined
        rows, cols = W.shape
        zero = torch.full((rows, cols), float(-qmin), dtype=torch.float64)
        codes = gptq_solve_fixed(W.detach().double(), H.detach().double(), s[:, None].expand(rows, cols),
                                 zero, qmax - qmin, damp=damp, pair_partners=pair_partners,
                                 pair_bound=pairs.PAIR_BOUND)
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
                limit: int = 32, channels_last: bool = False, alpha: float = 0.0,
                reference: str = "model") -> dict[str, Any]:
    """GPTQ-round every enabled layer's weights in place (grid unchanged). ``alpha > 0``: towards
    the output on ``reference`` inputs (``REFERENCES``; see the module docstring). Returns per-layer
    output errors of round-to-nearest and GPTQ (same H, same objective), and their total ratio."""
    hs = input_hessians(gm, plan, samples, names, limit=limit, channels_last=channels_last,
                        reference=reference if alpha > 0 else None)
    before = after = 0.0
    layers: dict[str, list[float]] = {}
    with one_thread():  # thousands of small operations: see gptq.one_thread
        for name, (H, dXXT) in hs.items():
            _round_layer(gm, plan, name, H, dXXT, alpha, layers)
    for e0, e1 in layers.values():
        before, after = before + e0, after + e1
    return {"layers": len(layers), "output_error_ratio": round(after / before, 4) if before > 0 else None,
            "per_layer": {k: round(v[1] / v[0], 4) for k, v in layers.items() if v[0] > 0}}


def rounding_target(W: torch.Tensor, H: torch.Tensor, dXXT: torch.Tensor, alpha: float,
                    damp: float = DAMP) -> torch.Tensor:
    """GPTAQ's ``W̃ = W + alpha · W dXXT H⁻¹`` for ``W`` (rows, K): ``H``, ``dXXT`` (K, K) shared
    (``gptq.asymmetric_target``) or (rows, K, K) one per row (a depthwise conv's channels)."""
    if H.dim() == 2:
        return asymmetric_target(W.float(), H.float(), dXXT.float(), alpha, damp)
    Hd = H.double().clone()
    diag = Hd.diagonal(dim1=1, dim2=2)
    diag.masked_fill_(diag == 0, 1.0)  # a dead input: no shift through it
    diag.add_(damp * diag.mean(1, keepdim=True))
    L = torch.linalg.cholesky(Hd)
    Wd = W.double()
    shift = torch.cholesky_solve(torch.bmm(Wd[:, None, :], dXXT.double()).transpose(1, 2), L)  # (rows, K, 1)
    return (Wd + alpha * shift[:, :, 0]).float()


def _round_layer(gm: fx.GraphModule, plan: qdq.QuantPlan, name: str, H: torch.Tensor, dXXT: torch.Tensor | None,
                 alpha: float, layers: dict[str, list[float]]) -> None:
    """GPTQ-round one layer in place where that lowers its output error; ``layers[name] = [rtn, gptq]``.
    With ``dXXT``, the error is against the float model's output (the objective's target ``W̃``)."""
    wq = qdq.weight_quant(gm, plan.layers[name])
    wpath = name + ".weight"
    w = qdq.get_attr(gm, wpath).detach()
    W2 = w.reshape(w.shape[0], -1).float()
    if H.shape[-1] != W2.shape[1] or not torch.isfinite(H).all():
        return
    target = W2
    if dXXT is not None and alpha > 0 and bool(torch.isfinite(dXXT).all()):
        target = rounding_target(W2, H, dXXT, alpha)
    rtn = wq(w).reshape(W2.shape)
    Q = gptq_round(target, wq.scale, H, wq.qmin, wq.qmax,
                   pair_partners=pairs.partners(tuple(w.shape)) if wq.grid.pairs else None)
    e0, e1 = output_error(target, rtn, H), output_error(target, Q, H)
    if not e1 < e0:  # keep round-to-nearest where the solve did not help
        return
    wq.float_weight = (wpath, w.clone())
    if target is not W2:  # bias correction then measures the shift against what the rounding aimed at
        wq.rounding_target = (wpath, target.reshape(w.shape).to(w.dtype))
    qdq.set_param(gm, wpath, Q.reshape(w.shape).to(w.dtype))
    layers[name] = [e0, e1]
