"""The fake-quantized PyTorch model and its QDQ ONNX form.

``prepare_qdq(module, scheme)`` traces a float model with ``torch.fx``, folds batch
norms into the convolutions before them, and inserts quantizers where an INT8 engine
quantizes tensors:

* weights of every convolution and linear layer: ``WeightQuant``, per output channel,
  symmetric int8 in [-127, 127];
* activations, per tensor (``ActQuant``), *on the tensor* so that every consumer reads
  the same quantized value (what ONNX Runtime needs to fuse ``DQ -> Conv -> Q`` into
  ``QLinearConv`` and TensorRT to fuse residual adds): the output of each conv/linear
  (after its ReLU/ReLU6 when that is its only consumer), and every activation input of a
  conv, linear, matmul, add or pooling node that is not already quantized.

Exported to ONNX, ``ActQuant`` and ``WeightQuant`` become QuantizeLinear/DequantizeLinear
pairs (uint8 activations for "u8s8", int8 for "s8s8" and "trt"); ``qdq_onnx.rewrite_qdq``
then stores weights as int8 initializers (DQ only), biases as int32 on the
``input_scale * weight_scale`` grid (as ONNX Runtime's and TensorRT's integer convs use
them), and folds weight transposes into the initializers, so the graph is the one the
fake-quant model computes and the engines fuse.
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from edgekit.compress.int8 import pairs
from edgekit.compress.int8.calibration import HistogramObserver, choose_range, qparams, run_module
from edgekit.compress.int8.config import SCHEMES
from edgekit.compress.int8.qdq_onnx import WEIGHT_7BIT
from edgekit.errors import BadInputError, bad_choice
from edgekit.sources.data import Samples


def _register_meta_kernels() -> None:
    """torch.export with a dynamic batch runs ops on meta tensors; torch 2.13 has no meta
    kernel for the fake-quantize ops (they export fine to QuantizeLinear/DequantizeLinear
    otherwise). Shape-only kernels, registered once."""
    global _META_LIB
    if _META_LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")

    def per_tensor(x: torch.Tensor, scale: Any, zp: Any, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)

    def per_channel(x: torch.Tensor, scale: Any, zp: Any, axis: int, qmin: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool)

    for op, fn in (("fake_quantize_per_tensor_affine_cachemask", per_tensor),
                   ("fake_quantize_per_channel_affine_cachemask", per_channel)):
        try:
            lib.impl(op, fn, "Meta")
        except RuntimeError:  # a later torch ships its own
            pass
    _META_LIB = lib


_META_LIB: torch.library.Library | None = None
_register_meta_kernels()


@dataclass(frozen=True)
class ActFormat:
    qmin: int
    qmax: int
    symmetric: bool


ACT_FORMATS = {
    "u8s8": ActFormat(0, 255, False),   # ONNX Runtime x86: uint8 activations (VNNI u8 x s8)
    # x86 without VNNI: the same activations; the weights that run the u8 x s8 GEMM kernel on a 7-bit
    # grid, so no pair of products overflows the kernel's int16 sums (``weight_grid``)
    "u8s7": ActFormat(0, 255, False),
    # the same kernels, with 8-bit weights on the pair-safe grid instead (``pairs``): the default there
    "u8s8p": ActFormat(0, 255, False),
    "s8s8": ActFormat(-128, 127, False),
    "trt": ActFormat(-128, 127, True),  # TensorRT explicit quantization: symmetric int8
}
WEIGHT_QMIN, WEIGHT_QMAX = -128, 127  # scales use 127: values stay in [-127, 127]


@dataclass(frozen=True)
class WeightGrid:
    """A layer's int8 weight grid: codes in [qmin, qmax]; with ``pairs``, every same-sign pair of
    adjacent codes within ``pairs.PAIR_BOUND`` as well (the pair-safe grid of scheme "u8s8p")."""

    qmin: int = WEIGHT_QMIN
    qmax: int = WEIGHT_QMAX
    pairs: bool = False

    @property
    def full(self) -> bool:
        return (self.qmin, self.qmax) == (WEIGHT_QMIN, WEIGHT_QMAX) and not self.pairs


# Schemes for x86 CPUs without VNNI, whose u8 x s8 kernels sum pairs of products in int16
SATURATION_SAFE = ("u8s8p", "u8s7")


def weight_grid(scheme: str, depthwise: bool, u8u8: bool = False) -> WeightGrid:
    """A layer's weight grid under ``scheme``: the pair-safe grid for "u8s8p" (``pairs``), the 7-bit
    grid for "u8s7", except in depthwise convolutions (their kernels multiply and sum in 32 bits on
    every x86 CPU) and in layers given exact 8-bit weights (``u8u8``: stored as uint8, see
    ``U8_WEIGHT_ZERO_POINT``)."""
    if scheme in SATURATION_SAFE and not depthwise and not u8u8:
        return WeightGrid(pairs=True) if scheme == "u8s8p" else WeightGrid(*WEIGHT_7BIT)
    return WeightGrid()


def act_format(scheme: str) -> ActFormat:
    """The activation grid of a Q/DQ scheme (``BadInputError`` naming the valid ones)."""
    if scheme not in ACT_FORMATS:
        raise bad_choice("quantization scheme", scheme, SCHEMES)
    return ACT_FORMATS[scheme]


class ActQuant(nn.Module):
    """Per-tensor fake quantizer of one activation. ``mode``: "observe" (collect a
    histogram, pass through), "quant" (fake-quantize; the default so a rebuilt model
    exports quantized) or "float" (pass through)."""

    scale: torch.Tensor  # a buffer; an nn.Parameter once ``make_learnable``
    zero_point: torch.Tensor

    def __init__(self, name: str, qmin: int, qmax: int, symmetric: bool) -> None:
        super().__init__()
        self.qname = name
        self.qmin, self.qmax, self.symmetric = qmin, qmax, symmetric
        self.register_buffer("scale", torch.tensor(1.0))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int32))
        self.mode = "quant"
        self.observer: HistogramObserver | None = None
        self.learnable = False
        self._scale_f, self._zp_i = 1.0, 0  # Python copies: export bakes them in as constants
        self._inv_f32 = 1.0  # float32(1) / float32(scale), as torch's fake-quant kernel computes it
        self.fast = False  # set by ``fast_fake_quant`` for edgekit's own inference passes

    def set_range(self, lo: float, hi: float) -> None:
        s, zp = qparams(lo, hi, self.qmin, self.qmax, self.symmetric)
        with torch.no_grad():
            self.scale.copy_(torch.tensor(s))
            self.zero_point.copy_(torch.tensor(zp, dtype=torch.int32))
        self.refresh()

    def refresh(self) -> None:
        """Sync the Python copies of scale and zero point with the tensors."""
        self._scale_f = float(self.scale.detach().abs().clamp_min(1e-8))
        self._zp_i = int(self.zero_point)
        self._inv_f32 = float(np.float32(1.0) / np.float32(self._scale_f))

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.refresh()

    def make_learnable(self) -> None:
        """LSQ-style learnable scale for QAT (the zero point stays fixed)."""
        if not self.learnable:
            s = self.scale.detach().clone()
            del self.scale
            self.scale = nn.Parameter(s)
            self.learnable = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "observe":
            if self.observer is None:
                self.observer = HistogramObserver(self.qname)
            self.observer.update(x)
            return x
        if self.mode == "float":
            return x
        if self.learnable and self.training:
            scale = self.scale.abs() + 1e-8
            grad_factor = 1.0 / float(max(x.numel() // max(x.shape[0], 1), 1) * self.qmax) ** 0.5
            return torch._fake_quantize_learnable_per_tensor_affine(
                x, scale.reshape(1), self.zero_point.float().reshape(1), self.qmin, self.qmax, grad_factor)
        if self.fast and x.dtype == torch.float32 and not (x.requires_grad and torch.is_grad_enabled()):
            # round(x / s) + zp clamped to [qmin, qmax], minus zp, times s: the same float32 operations
            # as torch's kernel (bit-identical), as three vectorized in-place passes (~3x faster on CPU)
            y = torch.mul(x, self._inv_f32)
            y.round_().clamp_(self.qmin - self._zp_i, self.qmax - self._zp_i)
            return y.mul_(float(np.float32(self._scale_f)))
        return torch.fake_quantize_per_tensor_affine(x, self._scale_f, self._zp_i, self.qmin, self.qmax)


@contextmanager
def fast_fake_quant(gm: nn.Module) -> Iterator[None]:
    """Activation fake-quant on the fast path (see ``ActQuant.forward``), and each layer's quantized
    weight computed once while it does not change (``WeightQuant.cache``), inside the block: for
    edgekit's own inference passes over calibration data (calibration, bias correction, GPTQ
    Hessians, sensitivity, evaluation), never around export or training with gradients."""
    quants = act_quants(gm)
    weights = weight_quants(gm)
    for m in quants:
        m.fast = True
    for w in weights:
        w.cache = True
    try:
        yield
    finally:
        for m in quants:
            m.fast = False
        for w in weights:
            w.cache, w._cached = False, None


@contextmanager
def float_model(gm: fx.GraphModule) -> Iterator[None]:
    """Inside the block, ``gm`` computes the float model: activation quantizers pass through, weight
    quantizers are off, rounded weights swapped for their float ones (biases stay: for passes before
    bias correction)."""
    acts = [(m, m.mode) for m in act_quants(gm)]
    weights = [(m, m.enabled) for m in weight_quants(gm)]
    rounded = [m.float_weight for m in weight_quants(gm) if m.float_weight is not None]
    swapped = []
    try:
        for m, _ in acts:
            m.mode = "float"
        for w, _ in weights:
            w.enabled = False
        for wpath, w_float in rounded:
            swapped.append((wpath, get_attr(gm, wpath).detach().clone()))
            set_param(gm, wpath, w_float)
        yield
    finally:
        for m, mode in acts:
            m.mode = mode
        for w, enabled in weights:
            w.enabled = enabled
        for wpath, w_rounded in swapped:
            set_param(gm, wpath, w_rounded)


class WeightQuant(nn.Module):
    """Per-output-channel symmetric int8 fake quantizer of one weight (axis 0).
    The scale follows the weight (max |w| per channel); in training (QAT) it is
    recomputed each step. ``enabled=False`` keeps the layer in floating point."""

    scale: torch.Tensor  # (channels,) buffer

    def __init__(self, name: str, channels: int, grid: WeightGrid | None = None, u8u8: bool = False) -> None:
        super().__init__()
        self.qname = name
        self.set_grid(grid or WeightGrid())  # set by the scheme at prepare time, not stored
        self.register_buffer("scale", torch.ones(channels))
        self.enabled = True
        # exact 8-bit weights stored as uint8 (zero point ``qdq_onnx.U8_WEIGHT_ZERO_POINT``) under "u8s7", "u8s8p"
        self.u8u8 = u8u8
        # (bias path, shift) that bias correction subtracted for this layer's weight error;
        # fallback adds it back when the layer returns to float weights
        self.bias_shift: tuple[str, torch.Tensor] | None = None
        # (weight path, float weight) when the stored weight was rounded by rounding.py (GPTQ on the int8 grid)
        self.float_weight: tuple[str, torch.Tensor] | None = None
        # (weight path, W̃) when that rounding aimed at the float model's output (GPTAQ, ``rounding.py``):
        # the weight bias correction measures the rounding's mean shift against
        self.rounding_target: tuple[str, torch.Tensor] | None = None
        # set by ``fast_fake_quant``: the quantized weight is kept between passes while neither the
        # weight nor the scale changes (every inference pass over calibration data quantized it again)
        self.cache = False
        self._cached: tuple[torch.Tensor, int, int, torch.Tensor] | None = None

    def set_grid(self, grid: WeightGrid) -> None:
        self.grid = grid
        self.qmin, self.qmax = grid.qmin, grid.qmax

    def update_scale(self, w: torch.Tensor, search: bool = False) -> None:
        """Scale per channel from max |w|; with ``search``, the clip (50-100% of max |w|)
        that minimises the channel's squared rounding error."""
        with torch.no_grad():
            flat = w.detach().float().reshape(w.shape[0], -1)
            amax = flat.abs().amax(1).clamp_min(1e-8)
            best = amax / self.qmax
            if search:
                best_err = torch.full_like(amax, float("inf"))
                for a in torch.linspace(0.5, 1.0, 26):
                    s = (amax * a / self.qmax)[:, None]
                    err = ((torch.clamp(torch.round(flat / s), self.qmin, self.qmax) * s - flat) ** 2).sum(1)
                    better = err < best_err
                    best = torch.where(better, s[:, 0], best)
                    best_err = torch.where(better, err, best_err)
            if self.grid.pairs:  # never finer than round-to-nearest keeps within the pair bound
                best = torch.maximum(best, torch.from_numpy(pairs.safe_scale(w.detach().float().cpu().numpy()))
                                     .to(best))
            self.scale.copy_(best)

    @property
    def reduced(self) -> bool:
        """A grid narrower than int8's (schemes "u8s7", "u8s8p")."""
        return not self.grid.full

    def codes(self, w: torch.Tensor) -> torch.Tensor:
        """The integer codes of ``w`` on this grid (float tensor of integers)."""
        s = self.scale.reshape(-1, *([1] * (w.dim() - 1)))
        codes = torch.clamp(torch.round(w / s), self.qmin, self.qmax)
        if self.grid.pairs:
            found = codes.detach().cpu().numpy()
            if pairs.violations(found):  # not after update_scale or GPTQ: weights changed since
                codes = torch.from_numpy(pairs.trim(found, (w / s).detach().cpu().numpy())).to(codes)
        return codes

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return w
        if self.training:
            self.update_scale(w)
        if self.cache and not self.training and not (w.requires_grad and torch.is_grad_enabled()):
            got = self._cached  # the same tensor object (held here, so never another one at its address)
            if got is not None and got[0] is w and got[1] == w._version and got[2] == self.scale._version:
                return got[3]
            out = self._quantize(w)
            self._cached = (w, w._version, self.scale._version, out)
            return out
        return self._quantize(w)

    def _quantize(self, w: torch.Tensor) -> torch.Tensor:
        zp = torch.zeros(w.shape[0], dtype=torch.int32, device=w.device)
        if self.reduced and not (torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()):
            # ONNX's QuantizeLinear knows only the int8 range: a narrower grid is stored as weights already
            # on it (``clip_weights_to_grid``) behind the int8 one; here the grid itself, straight-through
            deq = self.codes(w.detach()) * self.scale.reshape(-1, *([1] * (w.dim() - 1)))
            return w + (deq - w).detach() if w.requires_grad else deq
        return torch.fake_quantize_per_channel_affine(w, self.scale, zp, 0, WEIGHT_QMIN, WEIGHT_QMAX)


# ------------------------------------------------------------------------------------------
# Graph classification

_CONV_FNS = {F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d}
_LINEAR_FNS = {F.linear}
_MATMUL_FNS = {torch.matmul, operator.matmul, torch.bmm}
_ACT_MODULES = (nn.ReLU, nn.ReLU6, nn.Hardtanh)
_ACT_FNS = {F.relu, torch.relu, F.relu6, F.hardtanh, torch.nn.functional.relu_}
_ADD_FNS = {operator.add, torch.add, operator.iadd}
_POOL_MODULES = (nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AvgPool1d, nn.AdaptiveAvgPool1d)
_POOL_FNS = {F.avg_pool2d, F.adaptive_avg_pool2d, F.avg_pool1d, F.adaptive_avg_pool1d}
# Ops that only move or select data: a quantized tensor stays on its grid through them, so the
# tensor after them reuses the same quantizer (same scale and zero point: engines drop the pair).
_PASS_MODULES = (nn.ZeroPad2d, nn.Identity, nn.Flatten, nn.Dropout, nn.MaxPool2d, nn.MaxPool1d)
_PASS_FNS = {torch.flatten, F.dropout, F.max_pool2d, F.max_pool1d}
_PASS_METHODS = {"view", "reshape", "flatten", "contiguous"}


def _mod(gm: fx.GraphModule, n: fx.Node) -> nn.Module | None:
    return gm.get_submodule(n.target) if n.op == "call_module" else None  # type: ignore[arg-type]


def is_conv(gm: fx.GraphModule, n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _CONV_FNS) or isinstance(_mod(gm, n), nn.modules.conv._ConvNd)


def is_linear(gm: fx.GraphModule, n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _LINEAR_FNS) or isinstance(_mod(gm, n), nn.Linear)


def is_act(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in _ACT_FNS:
        return True
    if n.op == "call_method" and n.target in ("relu", "relu_"):
        return True
    return isinstance(_mod(gm, n), _ACT_MODULES)


def is_add(n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in _ADD_FNS or n.op == "call_method" and n.target == "add":
        return len(n.args) >= 2 and all(isinstance(a, fx.Node) for a in n.args[:2])
    return False


def is_pool(gm: fx.GraphModule, n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target in _POOL_FNS) or isinstance(_mod(gm, n), _POOL_MODULES)


def is_passthrough(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_function" and n.target in _PASS_FNS:
        return True
    if n.op == "call_method" and n.target in _PASS_METHODS:
        return True
    return isinstance(_mod(gm, n), _PASS_MODULES)


def _weight_source(gm: fx.GraphModule, n: fx.Node) -> tuple[str, str | None]:
    """(weight attribute path, bias attribute path) of a functional conv/linear node."""
    w = n.args[1] if len(n.args) > 1 else n.kwargs.get("weight")
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    if not (isinstance(w, fx.Node) and w.op == "get_attr"):
        raise _NotQuantizable
    bias = b.target if isinstance(b, fx.Node) and b.op == "get_attr" else None
    return str(w.target), (str(bias) if bias is not None else None)


class _NotQuantizable(Exception):
    pass


# ------------------------------------------------------------------------------------------
# Preparation


def get_attr(gm: nn.Module, path: str) -> torch.Tensor:
    """The parameter or buffer at ``path`` (``"features.0.weight"``) of ``gm``."""
    obj: Any = gm
    for part in path.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):  # internal invariant: paths come from get_attr nodes
        raise RuntimeError(f"{path} is not a tensor of the model")
    return obj


def weight_quant(gm: nn.Module, qname: str) -> WeightQuant:
    """The weight quantizer submodule ``qname`` (a value of ``QuantPlan.layers``)."""
    m = gm.get_submodule(qname)
    if not isinstance(m, WeightQuant):  # internal invariant: prepare_qdq named it
        raise RuntimeError(f"{qname} is not a weight quantizer")
    return m


def act_quant(gm: nn.Module, qname: str) -> ActQuant:
    """The activation quantizer submodule ``qname`` (a key of ``QuantPlan.activations``)."""
    m = gm.get_submodule(qname)
    if not isinstance(m, ActQuant):  # internal invariant: prepare_qdq named it
        raise RuntimeError(f"{qname} is not an activation quantizer")
    return m


def set_param(gm: fx.GraphModule, path: str, value: torch.Tensor) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = gm.get_submodule(parent_path) if parent_path else gm
    setattr(parent, name, nn.Parameter(value.detach().clone()))


def _functionalize_layers(gm: fx.GraphModule) -> None:
    """call_module Conv/Linear -> F.conv/F.linear on get_attr weights, so weight
    quantizers and batch-norm folding work on one form."""
    g = gm.graph
    for n in list(g.nodes):
        m = _mod(gm, n)
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.padding_mode == "zeros" and type(m).forward in (
                nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward):
            fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(m.kernel_size)]
            padding = m.padding if isinstance(m.padding, str) else tuple(m.padding)
            with g.inserting_before(n):
                w = g.get_attr(f"{n.target}.weight")
                b = g.get_attr(f"{n.target}.bias") if m.bias is not None else None
                new = g.call_function(fn, (n.args[0], w, b, tuple(m.stride), padding, tuple(m.dilation), m.groups))
            n.replace_all_uses_with(new)
            g.erase_node(n)
        elif isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward:
            with g.inserting_before(n):
                w = g.get_attr(f"{n.target}.weight")
                b = g.get_attr(f"{n.target}.bias") if m.bias is not None else None
                new = g.call_function(F.linear, (n.args[0], w, b))
            n.replace_all_uses_with(new)
            g.erase_node(n)
    g.lint()
    gm.recompile()


def _fold_batchnorms(gm: fx.GraphModule) -> list[str]:
    """Fold eval-mode BatchNorm modules into the convolution before them."""
    g = gm.graph
    folded = []
    for n in list(g.nodes):
        bn = _mod(gm, n)
        if not isinstance(bn, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            continue
        conv = n.args[0]
        if not (isinstance(conv, fx.Node) and is_conv(gm, conv) and conv.op == "call_function"
                and len(conv.users) == 1 and bn.track_running_stats and bn.running_var is not None
                and bn.running_mean is not None):
            continue
        try:
            wpath, bpath = _weight_source(gm, conv)
        except _NotQuantizable:
            continue
        w = get_attr(gm, wpath).detach()
        b = get_attr(gm, bpath).detach() if bpath else torch.zeros(w.shape[0])
        inv = (bn.running_var + bn.eps).rsqrt()
        gamma = bn.weight.detach() if bn.weight is not None else torch.ones_like(inv)
        beta = bn.bias.detach() if bn.bias is not None else torch.zeros_like(inv)
        factor = gamma * inv
        set_param(gm, wpath, w * factor.reshape(-1, *([1] * (w.dim() - 1))))
        new_bpath = bpath or (wpath.rpartition(".")[0] + ".bias" if "." in wpath else "bias")
        set_param(gm, new_bpath, (b - bn.running_mean) * factor + beta)
        if bpath is None:
            _set_bias_arg(gm, conv, new_bpath)
        n.replace_all_uses_with(conv)
        g.erase_node(n)
        folded.append(str(n.target))
    g.lint()
    gm.recompile()
    return folded


def ensure_bias(gm: fx.GraphModule, n: fx.Node, wpath: str, channels: int) -> None:
    """Give a bias-free conv/linear a zero bias (bias correction writes into it; a
    rebuilt model has the same parameters whether or not it was corrected)."""
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    if b is not None:
        return
    bpath = wpath[: -len("weight")] + "bias" if wpath.endswith("weight") else wpath + "_bias"
    set_param(gm, bpath, torch.zeros(channels, dtype=get_attr(gm, wpath).dtype))
    _set_bias_arg(gm, n, bpath)


def _set_bias_arg(gm: fx.GraphModule, n: fx.Node, bpath: str) -> None:
    """Make the conv/linear call ``n`` read its bias (third argument) from parameter ``bpath``."""
    with gm.graph.inserting_before(n):
        bnode = gm.graph.get_attr(bpath)
    args = list(n.args)
    while len(args) < 3:
        args.append(None)
    args[2] = bnode
    n.args = tuple(args)
    n.kwargs = {k: v for k, v in n.kwargs.items() if k != "bias"}


def _producer(gm: fx.GraphModule, n: fx.Node) -> fx.Node:
    """Walk back through data-movement ops to the node that computed a tensor."""
    while is_passthrough(gm, n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def layer_name(wpath: str) -> str:
    """The layer a weight belongs to: ``"features.0.weight"`` -> ``"features.0"``."""
    return wpath[:-len(".weight")] if wpath.endswith(".weight") else wpath


def weight_quant_node(n: fx.Node) -> fx.Node | None:
    """The weight quantizer call (``wq_*``) feeding the prepared conv/linear node ``n``, or None."""
    w = n.args[1] if len(n.args) > 1 else None
    return w if isinstance(w, fx.Node) and w.op == "call_module" and str(w.target).startswith("wq_") else None


def param_paths(gm: fx.GraphModule, n: fx.Node) -> tuple[str, str | None]:
    """(weight path, bias path or None) of a prepared conv/linear node with a weight quantizer."""
    wq = weight_quant_node(n)
    if wq is None:  # callers pass only layers with a weight quantizer
        raise RuntimeError(f"{n.name} has no weight quantizer")
    wget = wq.args[0]
    if not isinstance(wget, fx.Node):  # prepare_qdq feeds every weight quantizer a get_attr node
        raise RuntimeError(f"{n.name}: the weight quantizer reads no parameter")
    b = n.args[2] if len(n.args) > 2 else None
    return str(wget.target), (str(b.target) if isinstance(b, fx.Node) and b.op == "get_attr" else None)


def layer_weight_quant(gm: nn.Module, n: fx.Node) -> WeightQuant | None:
    """The weight quantizer module of the prepared conv/linear node ``n``, or None."""
    wq = weight_quant_node(n)
    return weight_quant(gm, str(wq.target)) if wq is not None else None


def conv_groups(n: fx.Node) -> int:
    """The ``groups`` argument of a functional conv node (1 when absent)."""
    groups = n.args[6] if len(n.args) > 6 else n.kwargs.get("groups", 1)
    if not isinstance(groups, (int, float)):  # a traced conv's groups are a Python number
        raise RuntimeError(f"{n.name}: groups {groups!r} is not a number")
    return int(groups)


def quantized_layers(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Every prepared conv/linear node with a weight quantizer -> its layer name, in graph order."""
    return {n: layer_name(param_paths(gm, n)[0]) for n in gm.graph.nodes
            if (is_conv(gm, n) or is_linear(gm, n)) and weight_quant_node(n) is not None}


@dataclass
class QuantPlan:
    """What ``prepare_qdq`` inserted: layer name -> weight quantizer name, and the
    activation quantizers in graph order (name -> the node they follow)."""

    scheme: str
    layers: dict[str, str]
    activations: dict[str, str]
    folded_bn: list[str]


def _trace(module: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(module)
    except Exception as e:
        raise TraceError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


class TraceError(Exception):
    pass


def prepare_qdq(module: nn.Module, scheme: str, float_layers: tuple[str, ...] = (),
                u8u8_layers: tuple[str, ...] = ()) -> tuple[fx.GraphModule, QuantPlan]:
    """Trace ``module`` and return (fake-quant GraphModule, plan). Raises BadInputError
    when the model has no convolution or linear layer to quantize. ``u8u8_layers``: layers given exact
    8-bit weights under schemes "u8s7" and "u8s8p" (``promote_u8u8``); ignored under every other scheme."""
    fmt = act_format(scheme)
    module = module.eval()
    gm = _trace(module)
    _functionalize_layers(gm)
    folded = _fold_batchnorms(gm)
    g = gm.graph

    layers: dict[str, str] = {}
    quant_nodes: list[fx.Node] = []  # tensors to quantize, in graph order
    tied: dict[fx.Node, fx.Node] = {}  # tensor -> the tensor whose quantizer it reuses
    seen: set[fx.Node] = set()

    def want(n: fx.Node, tie: fx.Node | None = None) -> None:
        if n not in seen and n.op != "get_attr":
            seen.add(n)
            if tie is not None:
                tied[n] = tie
            else:
                quant_nodes.append(n)

    outputs = {a for n in g.nodes if n.op == "output" for a in _flatten_args(n.args)}
    # 1. weights, and the outputs of conv/linear layers (after a sole ReLU/ReLU6)
    for n in list(g.nodes):
        if not (is_conv(gm, n) or is_linear(gm, n)):
            continue
        try:
            wpath, _ = _weight_source(gm, n)
        except _NotQuantizable:
            continue
        w = get_attr(gm, wpath)
        name = layer_name(wpath)
        ensure_bias(gm, n, wpath, w.shape[0])
        qname = "wq_" + name.replace(".", "_")
        depthwise = is_conv(gm, n) and w.dim() > 2 and w.shape[1] == 1 and conv_groups(n) > 1
        u8u8 = scheme in SATURATION_SAFE and not depthwise and name in u8u8_layers
        gm.add_submodule(qname, WeightQuant(name, w.shape[0], weight_grid(scheme, depthwise, u8u8), u8u8))
        wnode = n.args[1]
        with g.inserting_after(wnode):
            qw = g.call_module(qname, (wnode,))
        n.replace_input_with(wnode, qw)
        layers[name] = qname
        out = n
        users = list(out.users)
        if len(users) == 1 and is_act(gm, users[0]):
            out = users[0]
        if out not in outputs:
            want(out)
    if not layers:
        raise BadInputError("model has no quantizable layers (no convolution or linear layer with constant "
                            "weights was found); INT8 quantization needs at least one")
    # 2. activation inputs of conv / linear / matmul / add / pool nodes
    quantized_producers = {_producer(gm, q) for q in quant_nodes}
    for n in list(g.nodes):
        if is_conv(gm, n) or is_linear(gm, n):
            ins = [n.args[0]]
        elif (n.op == "call_function" and n.target in _MATMUL_FNS) or is_add(n):
            ins = list(n.args[:2])
        elif is_pool(gm, n):
            ins = [n.args[0]]
        else:
            continue
        for a in ins:
            if not isinstance(a, fx.Node) or a.op == "get_attr":
                continue
            if a in seen:
                continue
            p = _producer(gm, a)
            if p in quantized_producers and not (is_conv(gm, n) or is_linear(gm, n) or n.target in _MATMUL_FNS):
                continue  # a quantized tensor reshaped on the way: adds and pools read it as is
            if p in quantized_producers and p is not a and _only_passthrough_path(gm, p, a):
                # conv/linear reading a padded / pooled / flattened quantized tensor: the same quantizer
                # again right at its input, so the engine sees DQ -> Conv with no extra rounding
                want(a, tie=p)
                continue
            want(a)
    activations: dict[str, str] = {}
    qname_of: dict[fx.Node, str] = {}
    for i, q in enumerate(quant_nodes):
        qname = f"aq_{i}_{q.name}"
        gm.add_submodule(qname, ActQuant(q.name, fmt.qmin, fmt.qmax, fmt.symmetric))
        qname_of[q] = qname
        activations[qname] = q.name
    for q in quant_nodes + list(tied):
        qname = qname_of[q] if q in qname_of else qname_of[_producer(gm, tied[q])]
        with g.inserting_after(q):
            qn = g.call_module(qname, (q,))
        q.replace_all_uses_with(qn, delete_user_cb=_user_other_than(qn))
    g.lint()
    gm.recompile()
    gm.delete_all_unused_submodules()
    for name in float_layers:
        if name in layers:
            weight_quant(gm, layers[name]).enabled = False
    return gm, QuantPlan(scheme, layers, activations, folded)


def _user_other_than(qn: fx.Node) -> Callable[[fx.Node], bool]:
    """``replace_all_uses_with`` filter: every user of a tensor except its new quantizer call."""
    return lambda u: u is not qn


def _only_passthrough_path(gm: fx.GraphModule, p: fx.Node, a: fx.Node) -> bool:
    n = a
    while n is not p:
        if not is_passthrough(gm, n):
            return False
        n = n.args[0]  # type: ignore[assignment]
    return True


def _flatten_args(args: Any) -> list[Any]:
    out: list[Any] = []
    if isinstance(args, (tuple, list)):
        for a in args:
            out.extend(_flatten_args(a))
    elif isinstance(args, dict):
        for a in args.values():
            out.extend(_flatten_args(a))
    else:
        out.append(args)
    return out


def act_quants(gm: nn.Module) -> list[ActQuant]:
    return [m for m in gm.modules() if isinstance(m, ActQuant)]


def weight_quants(gm: nn.Module) -> list[WeightQuant]:
    return [m for m in gm.modules() if isinstance(m, WeightQuant)]


def channels_last_ok(gm: fx.GraphModule, samples: Samples, names: list[str]) -> bool:
    """Whether ``gm`` computes the same on NHWC-ordered inputs (``tensor_batches(channels_last=True)``),
    tried on one sample with the quantizers passing values through: it has 2-D convolutions, runs
    (``view`` is the one tensor op that can fail on that memory order) and gives the same output to float
    rounding. PyTorch's CPU convolutions then run their NHWC kernels and keep that order: measured on
    EfficientNet-Lite0, 1.6x less CPU per pass."""
    if not any((n.op == "call_function" and n.target in (F.conv2d, torch.conv2d)) or isinstance(_mod(gm, n), nn.Conv2d)
               for n in gm.graph.nodes):
        return False
    one = samples.subset(slice(0, 1))
    quants = act_quants(gm)
    modes = [m.mode for m in quants]
    try:
        set_mode(gm, "float")
        want = run_module(gm, one, names, 1)
        got = run_module(gm, one, names, 1, channels_last=True)
    except RuntimeError:
        return False
    finally:
        for m, mode in zip(quants, modes):
            m.mode = mode
    scale = max(float(np.abs(want).max()), 1e-6)
    return got.shape == want.shape and bool(np.abs(got - want).max() <= 1e-4 * scale)


def set_mode(gm: nn.Module, mode: str) -> None:
    for m in act_quants(gm):
        m.mode = mode


def finish_calibration(gm: nn.Module, method: str, percentile: float) -> dict[str, tuple[float, float]]:
    """Turn every observer's histogram into a range; quantizers go to "quant" mode."""
    ranges = {}
    for m in act_quants(gm):
        if m.observer is None or m.observer.count == 0:
            raise BadInputError(f"activation {m.qname!r} saw no calibration data")
        lo, hi = choose_range(m.observer, method, percentile, m.qmin, m.qmax, m.symmetric)
        m.set_range(lo, hi)
        ranges[m.qname] = (lo, hi)
        m.mode = "quant"
    return ranges


def fit_bias_range(gm: fx.GraphModule) -> int:
    """Engines store a conv/linear bias as int32 on the ``input_scale * weight_scale`` grid; a
    channel with (near-)zero weights and a real bias would overflow int32 there and lose its
    bias. Raise such channels' weight scales so the bias fits (2^30 steps of headroom).
    Returns the number of channels changed."""
    changed = 0
    for n in gm.graph.nodes:
        if not (is_conv(gm, n) or is_linear(gm, n)) or len(n.args) < 3:
            continue
        x, wq, b = n.args[0], n.args[1], n.args[2]
        if not (isinstance(x, fx.Node) and x.op == "call_module" and isinstance(wq, fx.Node)
                and wq.op == "call_module" and isinstance(b, fx.Node) and b.op == "get_attr"):
            continue
        aq, wmod = gm.get_submodule(str(x.target)), gm.get_submodule(str(wq.target))
        if not isinstance(aq, ActQuant) or not isinstance(wmod, WeightQuant) or aq.mode != "quant":
            continue
        bias = get_attr(gm, str(b.target)).detach().abs()
        need = bias / (aq._scale_f * 2.0**30)
        too_small = wmod.scale < need
        if bool(too_small.any()):
            with torch.no_grad():
                wmod.scale.copy_(torch.where(too_small, need, wmod.scale))
            changed += int(too_small.sum())
    return changed


def clip_weights_to_grid(gm: nn.Module, plan: QuantPlan) -> int:
    """Put the weights of layers on a narrower grid than int8's (schemes "u8s7", "u8s8p") on that grid
    exactly, so the exported QuantizeLinear (int8 range only) stores what the fake-quant model computes.
    No change to the model's outputs. Returns the number of layers changed."""
    clipped = 0
    for name, qname in plan.layers.items():
        wq = weight_quant(gm, qname)
        if not (wq.enabled and wq.reduced):
            continue
        w = get_attr(gm, name + ".weight")
        with torch.no_grad():
            w.copy_(wq.codes(w) * wq.scale.reshape(-1, *([1] * (w.dim() - 1))))
        clipped += 1
    return clipped


def u8u8_candidates(gm: nn.Module, plan: QuantPlan) -> list[str]:
    """The layers ``promote_u8u8`` can promote: quantized, on the 7-bit or the pair-safe grid (schemes
    "u8s7", "u8s8p"; depthwise convolutions are on the 8-bit grid already), in graph order."""
    wqs = {name: weight_quant(gm, q) for name, q in plan.layers.items()}
    return [name for name, wq in wqs.items() if wq.enabled and wq.reduced and not wq.u8u8]


def promote_u8u8(gm: fx.GraphModule, plan: QuantPlan, names: list[str] | tuple[str, ...]) -> list[str]:
    """Give ``names`` exact 8-bit weights (schemes "u8s7", "u8s8p"): per-channel scales on the 8-bit grid
    (clip search). Before calibration (``int8.apply``) that is all, and GPTQ rounding and bias correction
    then work on that grid; after them (the fallback) the layer's float weights and uncorrected bias come
    back first (both were for the narrower grid) and it is rounded to nearest. Exported, the weights are
    stored as uint8 (``qdq_onnx.rewrite_qdq``) and run on exact u8 x u8 kernels. Returns the layers promoted (those
    in ``u8u8_candidates``); no change to any other layer, nothing under another scheme."""
    if plan.scheme not in SATURATION_SAFE:
        return []
    can = set(u8u8_candidates(gm, plan))
    done = []
    for name in names:
        if name not in can:
            continue
        wq = weight_quant(gm, plan.layers[name])
        with torch.no_grad():
            if wq.bias_shift is not None:  # bias correction subtracted the 7-bit weights' mean error
                bpath, shift = wq.bias_shift
                set_param(gm, bpath, get_attr(gm, bpath).detach() + shift)
                wq.bias_shift = None
            if wq.float_weight is not None:  # GPTQ rounded the weights in place on the 7-bit grid
                wpath, w = wq.float_weight
                set_param(gm, wpath, w)
                wq.float_weight = wq.rounding_target = None
            wq.set_grid(WeightGrid())
            wq.u8u8 = True
            wq._cached = None
            wq.update_scale(get_attr(gm, name + ".weight"), search=True)
        done.append(name)
    return done


def u8u8_layers(gm: nn.Module, plan: QuantPlan) -> list[str]:
    """The layers with exact 8-bit (uint8-stored) weights, in graph order."""
    return [name for name, q in plan.layers.items() if weight_quant(gm, q).u8u8 and weight_quant(gm, q).enabled]


def update_weight_scales(gm: fx.GraphModule, plan: QuantPlan, search: bool = True) -> None:
    for name, qname in plan.layers.items():
        weight_quant(gm, qname).update_scale(get_attr(gm, name + ".weight"), search=search)
