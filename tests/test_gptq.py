"""GPTQ math on tiny layers with synthetic Hessians (issue 4)."""
from __future__ import annotations

import pytest
import torch

from edgekit.compress.gptq import HessianAccumulator, gptq_quantize, quantization_error
from edgekit.compress.rtn import dequantize_groups, rtn_quantize


def _correlated_inputs(n: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, cols // 4, generator=g)
    mix = torch.randn(cols // 4, cols, generator=g)
    scale = torch.rand(cols, generator=g) * 3 + 0.1  # outlier-ish channels
    return (base @ mix + 0.1 * torch.randn(n, cols, generator=g)) * scale


def test_hessian_accumulator_matches_closed_form():
    x = _correlated_inputs(300, 16)
    acc = HessianAccumulator(16)
    for chunk in x.split(70):
        acc.add_batch(chunk.reshape(7, -1, 16) if chunk.shape[0] % 7 == 0 else chunk)
    torch.testing.assert_close(acc.H, 2 * x.t() @ x / 300, rtol=1e-4, atol=1e-4)
    assert acc.nsamples == 300


@pytest.mark.parametrize("bits,group_size,sym,act_order,static", [
    (4, 32, False, False, False), (4, -1, False, False, False), (4, 32, True, False, False),
    (3, 32, False, True, False), (4, 32, False, False, True), (2, -1, False, True, False),
])
def test_gptq_beats_rtn_on_the_layer_objective(bits, group_size, sym, act_order, static):
    torch.manual_seed(0)
    W = torch.randn(24, 128)
    X = _correlated_inputs(512, 128)
    H = 2 * X.t() @ X / X.shape[0]
    q, s, z = gptq_quantize(W, H, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                            static_groups=static, block_size=32)
    assert q.dtype == torch.uint8 and int(q.max()) <= 2**bits - 1
    ng = 1 if group_size == -1 else 128 // group_size
    assert s.shape == (24, ng) and z.shape == (24, ng)
    if sym:
        assert (z == 2 ** (bits - 1)).all()
    Wq = dequantize_groups(q, s, z, group_size)
    rq, rs, rz = rtn_quantize(W, bits, group_size, sym)
    Wr = dequantize_groups(rq, rs, rz, group_size)
    e_gptq, e_rtn = quantization_error(W, Wq, H), quantization_error(W, Wr, H)
    assert e_gptq < 0.8 * e_rtn, (e_gptq, e_rtn)


def test_gptq_with_identity_hessian_is_rtn():
    """No input correlation and no damping effect: nothing to compensate, GPTQ = RTN."""
    torch.manual_seed(3)
    W = torch.randn(8, 64)
    q, s, z = gptq_quantize(W, torch.eye(64), bits=4, group_size=-1, damp=0.0)
    rq, rs, rz = rtn_quantize(W, 4, -1, False)
    assert torch.equal(q, rq) and torch.equal(z, rz)
    torch.testing.assert_close(s, rs)


def test_dead_inputs_and_partial_last_group():
    torch.manual_seed(4)
    W = torch.randn(6, 80)  # 80 = 2.5 groups of 32
    X = _correlated_inputs(200, 80)
    X[:, 5] = 0  # a dead input channel
    H = 2 * X.t() @ X / 200
    q, s, z = gptq_quantize(W, H, bits=4, group_size=32, block_size=16)
    assert s.shape == (6, 3)
    Wq = dequantize_groups(q, s, z, 32)
    assert torch.isfinite(Wq).all()
    assert Wq[:, 5].abs().max() <= s.max()  # dead column quantized from zero


def test_mse_grid_fits_each_group_no_worse_than_minmax():
    from edgekit.compress.gptq import mse_qparams
    from edgekit.compress.rtn import fake_quantize, qparams

    torch.manual_seed(0)
    w = torch.randn(64, 128) * torch.linspace(0.5, 2, 128)
    w[:, 7] *= 6  # an outlier column: min-max wastes the grid on it
    s0, z0 = qparams(w, 4, False)
    s1, z1 = mse_qparams(w, 4, False)
    e0 = (w - fake_quantize(w, s0[:, None], z0[:, None], 4)).abs().pow(2.4).sum(1)
    e1 = (w - fake_quantize(w, s1[:, None], z1[:, None], 4)).abs().pow(2.4).sum(1)
    assert bool((e1 <= e0 + 1e-6).all()) and float(e1.sum()) < 0.97 * float(e0.sum())
    assert bool((s1 <= s0 + 1e-9).all())  # only ever shrinks the range
    H = torch.eye(128)
    q, s, z = gptq_quantize(w, H, bits=4, group_size=32, mse_grid=True)
    assert q.shape == (64, 128) and s.shape == (64, 4) and int(q.max()) <= 15
