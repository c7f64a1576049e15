"""INT8 weight rounding towards the float model's output (GPTAQ, ``rounding.round_model(alpha=)``) and the
activation-aware rescaling across a linear bottleneck (``equalize.equalize_activation``), issue 26:
the asymmetric objective's output error against the float output is lower than the symmetric one's when
the layer's input is coarsely quantized; the rescaling is exact in float and equalizes the channel
ranges. Tiny tensors and models, seconds."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from edgekit.compress.int8 import qdq
from edgekit.compress.int8.calibration import run_module
from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.equalize import equalize_activation
from edgekit.compress.int8.rounding import (
    conv_windows,
    gptq_round,
    input_hessians,
    probe_batch_size,
    round_model,
    rounding_target,
)
from edgekit.compress.int8.step import calibrate
from edgekit.sources.data import Samples


def _coarse(x: torch.Tensor, step: float) -> torch.Tensor:
    """A clipped activation grid (a calibrated range narrower than the tensor's, as on a linear bottleneck)."""
    return torch.clamp(torch.round(x / step) * step, -4 * step, 4 * step)


def _grid(W: torch.Tensor, qmax: int = 63) -> torch.Tensor:
    return W.abs().amax(1) / qmax


def test_asymmetric_rounding_lowers_the_error_against_the_float_output_of_a_dense_layer():
    g = torch.Generator().manual_seed(0)
    X_fp = torch.randn(512, 24, generator=g).double()
    X_q = _coarse(X_fp, 0.25)  # the layer's input after a coarse activation grid
    W = torch.randn(8, 24, generator=g).double()
    H = 2 * X_q.t() @ X_q / len(X_q)
    dXXT = 2 * (X_fp - X_q).t() @ X_q / len(X_q)
    scale = _grid(W)
    Q_sym = gptq_round(W, scale, H, -64, 63).double()
    Q_asym = gptq_round(rounding_target(W, H, dXXT, 1.0), scale, H, -64, 63).double()
    assert torch.allclose(Q_asym / scale[:, None], torch.round(Q_asym / scale[:, None]), atol=1e-4)  # on the grid

    def err(Q: torch.Tensor) -> float:
        return float(((X_fp @ W.t() - X_q @ Q.t()) ** 2).mean())

    assert err(Q_asym) < 0.85 * err(Q_sym), (err(Q_asym), err(Q_sym))


def test_asymmetric_rounding_of_a_depthwise_conv_uses_each_channel_s_own_inputs():
    g = torch.Generator().manual_seed(1)
    C, kk, n = 6, 9, 400
    X_fp = torch.randn(C, n, kk, generator=g).double()
    X_q = _coarse(X_fp, 0.25)
    W = torch.randn(C, kk, generator=g).double()
    H = 2 * X_q.transpose(1, 2) @ X_q / n  # (C, kk, kk)
    dXXT = 2 * (X_fp - X_q).transpose(1, 2) @ X_q / n
    scale = _grid(W, 127)
    Q_sym = gptq_round(W, scale, H, -128, 127).double()
    Q_asym = gptq_round(rounding_target(W, H, dXXT, 1.0), scale, H, -128, 127).double()

    def err(Q: torch.Tensor) -> float:
        return float(((torch.einsum("cnk,ck->cn", X_fp, W) - torch.einsum("cnk,ck->cn", X_q, Q)) ** 2).mean())

    assert err(Q_asym) < 0.85 * err(Q_sym), (err(Q_asym), err(Q_sym))
    assert torch.equal(rounding_target(W, H, dXXT, 0.0).double(), W.float().double())  # alpha 0: today's target


class _Bottleneck(nn.Module):
    """stem -> ReLU -> projection (linear bottleneck: no activation) -> expand -> pooled classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.project = nn.Conv2d(8, 6, 1)
        self.expand = nn.Conv2d(6, 12, 1)
        self.fc = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.expand(self.project(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(torch.relu(x), 1), 1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = _Bottleneck().eval()
    with torch.no_grad():
        m.project.weight[:3] *= 0.05  # three narrow channels in the bottleneck tensor
    return m


def _images(n: int, seed: int) -> Samples:
    x = np.random.default_rng(seed).standard_normal((n, 3, 12, 12)).astype(np.float32)
    return Samples("synthetic", "calib", {"input": x})


def test_activation_rescaling_is_exact_in_float_and_equalizes_the_bottleneck_channels():
    m = _net()
    gm, plan = qdq.prepare_qdq(copy.deepcopy(m), "u8s7")
    calib = _images(8, 0)
    spread = equalize_activation(gm, ["expand"], calib, ["input"])
    assert list(spread) == ["project -> expand"] and spread["project -> expand"] > 1
    ev = _images(4, 1)
    with qdq.float_model(gm):
        out = run_module(gm, ev, ["input"])
    ref = run_module(m, ev, ["input"])
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
    # every channel of the bottleneck tensor now spans the widest one's range on the calibration images
    with torch.no_grad():
        x = torch.relu(nn.functional.conv2d(torch.from_numpy(calib.inputs["input"]), m.stem.weight, m.stem.bias,
                                            padding=1))
        y = nn.functional.conv2d(x, gm.get_parameter("project.weight"), gm.get_parameter("project.bias"))
    r = y.abs().amax((0, 2, 3))
    assert float(r.max() / r.min()) < 1.0001
    assert equalize_activation(gm, ["stem"], calib, ["input"]) == {}  # not the consumer of a pair


@pytest.mark.parametrize("reference", ["model", "input"])
def test_round_model_with_alpha_matches_the_float_output_better_on_a_clipped_input(reference):
    m = _net()
    calib, ev = _images(16, 2), _images(16, 3)
    errors = {}
    for alpha in (0.0, 1.0):
        gm, plan = qdq.prepare_qdq(copy.deepcopy(m), "u8s7")
        qdq.update_weight_scales(gm, plan)
        calibrate(gm, calib, ["input"], Int8Config(calib_samples=16, calib_method="minmax").calibration_config())
        aq = qdq.act_quant(gm, plan_input_of(gm, plan, "expand"))
        lo, hi = float(-aq.zero_point) * float(aq.scale), float(255 - aq.zero_point) * float(aq.scale)
        aq.set_range(0.3 * lo, 0.3 * hi)  # expand's input clipped to 30% of its range
        hs = input_hessians(gm, plan, calib, ["input"], reference=reference if alpha > 0 else None)
        assert all((d is None) == (alpha == 0) for _, d in hs.values())
        report = round_model(gm, plan, calib, ["input"], alpha=alpha, reference=reference)
        assert report["layers"] >= 1
        wq = qdq.weight_quant(gm, plan.layers["expand"])
        assert (wq.rounding_target is not None) == (alpha > 0)
        # expand's output against the float model's, from its quantized input, on held-out images
        with torch.no_grad():
            x = torch.from_numpy(ev.inputs["input"])
            h = m.project(torch.relu(m.stem(x)))
            want = m.expand(h)
            got = nn.functional.conv2d(aq(h), wq(gm.get_parameter("expand.weight")), gm.get_parameter("expand.bias"))
        errors[alpha] = float(((got - want) ** 2).mean())
    assert errors[1.0] < 0.9 * errors[0.0], errors


def plan_input_of(gm: torch.fx.GraphModule, plan: qdq.QuantPlan, layer: str) -> str:
    """The activation quantizer feeding ``layer``'s conv."""
    for n in gm.graph.nodes:
        if (qdq.is_conv(gm, n) or qdq.is_linear(gm, n)) and qdq.layer_name(qdq.param_paths(gm, n)[0]) == layer:
            x = n.args[0]
            assert isinstance(x, torch.fx.Node) and str(x.target).startswith("aq_")
            return str(x.target)
    raise AssertionError(layer)


@pytest.mark.parametrize("kernel,stride,padding,dilation", [
    (3, 1, 1, 1), (3, 2, 1, 1), (5, 2, 2, 1), ((3, 1), (2, 1), (1, 0), 1), (3, 1, 2, 2), (1, 2, 0, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_windows_reshape_to_unfold_s_im2col(kernel, stride, padding, dilation, channels_last):
    x = torch.randn(2, 5, 11, 9, generator=torch.Generator().manual_seed(3))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    k = kernel if isinstance(kernel, tuple) else (kernel, kernel)
    v = conv_windows(x, k, stride, padding, dilation)
    want = torch.nn.functional.unfold(x, k, dilation=dilation, padding=padding, stride=stride)
    assert torch.equal(v.reshape(2, -1, v.shape[4] * v.shape[5]), want)
    per_channel = v.permute(1, 2, 3, 0, 4, 5).reshape(5, k[0] * k[1], -1)  # (C, kk, B*L), the depthwise form
    assert torch.equal(per_channel, want.reshape(2, 5, k[0] * k[1], -1).permute(1, 2, 0, 3).reshape(5, k[0] * k[1], -1))


class _Depthwise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Conv2d(3, 8, 1)
        self.dw = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dw(torch.relu(self.expand(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_hessian_is_each_channel_s_own_input_second_moment(channels_last):
    """``2/n Σ x xᵀ`` per channel over every window of every image, whatever the batch and memory order."""
    torch.manual_seed(0)
    gm, plan = qdq.prepare_qdq(_Depthwise().eval(), "u8s8")
    calib = _images(6, 4)
    qdq.update_weight_scales(gm, plan)
    calibrate(gm, calib, ["input"], Int8Config().calibration_config())
    got = {}
    for batch in (1, 4):
        with qdq.fast_fake_quant(gm):
            got[batch] = input_hessians(gm, plan, calib, ["input"], batch_size=batch, channels_last=channels_last)
    # the depthwise conv's quantized input, recomputed from the graph's own modules
    inputs = []

    def keep(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        inputs.append(args[0].detach())

    dw_node = next(n for n in gm.graph.nodes if qdq.is_conv(gm, n) and qdq.conv_groups(n) == 8)
    feeding = gm.get_submodule(str(dw_node.args[0].target)) if dw_node.args[0].op == "call_module" else None
    assert feeding is not None  # the activation quantizer in front of the depthwise conv
    handle = feeding.register_forward_hook(lambda m, a, out: inputs.append(out.detach()))
    with torch.no_grad(), qdq.fast_fake_quant(gm):
        gm(torch.from_numpy(calib.inputs["input"]))
    handle.remove()
    cols = torch.nn.functional.unfold(inputs[0], 3, padding=1, stride=2)  # (B, 8*9, L)
    X = cols.reshape(6, 8, 9, -1).permute(1, 0, 3, 2).reshape(8, -1, 9)  # (C, B*L, 9)
    want = 2 * X.transpose(1, 2) @ X / X.shape[1]
    name = qdq.layer_name(qdq.param_paths(gm, dw_node)[0])
    for batch in (1, 4):
        H, shift = got[batch][name]
        assert shift is None and H.shape == (8, 9, 9)
        torch.testing.assert_close(H, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,want", [((3, 224, 224), 8), ((3, 352, 480), 2), ((3, 608, 800), 1), ((1, 28, 28), 8)])
def test_the_hessian_probe_takes_as_many_images_as_eight_224_rgb_ones_hold(shape, want):
    samples = Samples("synthetic", "calib", {"input": np.zeros((3, *shape), np.float32)})
    assert probe_batch_size(samples, ["input"]) == want
