"""GPTQ math on tiny layers with synthetic Hessians (issue 4)."""
from __future__ import annotations

import pytest
import torch

from edgekit.compress.weight_only.gptq import HessianAccumulator, gptq_quantize, quantization_error
from edgekit.compress.weight_only.rtn import dequantize_groups, rtn_quantize


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
    from edgekit.compress.weight_only.gptq import mse_qparams
    from edgekit.compress.weight_only.rtn import fake_quantize, qparams

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


@pytest.mark.parametrize("group_size,act_order", [(32, False), (32, True), (-1, False)])
def test_refit_lowers_the_objective_and_keeps_codes_and_zero_points(group_size, act_order):
    from edgekit.compress.weight_only.gptq import refit_scales

    torch.manual_seed(0)
    W = torch.randn(24, 128)
    X = _correlated_inputs(512, 128)
    H = 2 * X.t() @ X / X.shape[0]
    q0, s0, z0 = gptq_quantize(W, H, bits=4, group_size=group_size, act_order=act_order, mse_grid=True)
    q1, s1, z1 = gptq_quantize(W, H, bits=4, group_size=group_size, act_order=act_order, mse_grid=True, refit=True)
    assert torch.equal(q0, q1) and torch.equal(z0, z1)
    e0 = quantization_error(W, dequantize_groups(q0, s0, z0, group_size), H)
    e1 = quantization_error(W, dequantize_groups(q1, s1, z1, group_size), H)
    assert e1 < 0.995 * e0, (e0, e1)
    assert bool((s1 > 0).all())
    # a row whose codes all sit on the zero point has nothing to fit: its scales stay
    q0[3] = z0[3].repeat_interleave(q0.shape[1] // z0.shape[1], dim=-1)
    s2 = refit_scales(W, H, q0.float(), s0, z0, group_size)
    assert torch.equal(s2[3], s0[3]) and torch.isfinite(s2).all()


def test_asymmetric_target_matches_the_float_output_in_least_squares():
    from edgekit.compress.weight_only.gptq import AsymmetricAccumulator, asymmetric_target

    torch.manual_seed(0)
    W = torch.randn(8, 32)
    X_fp = _correlated_inputs(400, 32)
    # the upstream layers' quantization error: mostly a function of the input, plus noise
    X = X_fp @ (torch.eye(32) + 0.05 * torch.randn(32, 32)) + 0.01 * torch.randn_like(X_fp)
    acc = AsymmetricAccumulator(32)
    for a, b in zip(X.split(100), X_fp.split(100), strict=True):
        acc.add_pair(a, b)
    torch.testing.assert_close(acc.H, 2 * X.t() @ X / 400, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(acc.dXXT, 2 * (X_fp - X).t() @ X / 400, rtol=1e-4, atol=1e-4)
    W_t = asymmetric_target(W, acc.H, acc.dXXT, alpha=1.0, damp=0.0)
    lstsq = torch.linalg.lstsq(X.double(), (X_fp @ W.t()).double()).solution.t().float()
    torch.testing.assert_close(W_t, lstsq, rtol=0, atol=2e-2)  # float32 sums of an ill-conditioned X
    # its output on the noisy inputs is closer to the float output than W's own
    err = lambda M: float(((X @ M.t()) - X_fp @ W.t()).pow(2).mean())  # noqa: E731
    assert err(W_t) < 0.1 * err(W)
    torch.testing.assert_close(asymmetric_target(W, acc.H, acc.dXXT, alpha=0.0), W)
    torch.testing.assert_close(asymmetric_target(W, acc.H, acc.dXXT, alpha=0.5, damp=0.0), (W + W_t) / 2,
                               rtol=1e-4, atol=1e-4)


def test_one_solver_takes_the_grid_and_a_hessian_per_row():
    from edgekit.compress.weight_only.gptq import gptq_solve

    torch.manual_seed(0)
    W = torch.randn(6, 64)
    X = _correlated_inputs(256, 64)
    H = 2 * X.t() @ X / X.shape[0]
    seen: list[int] = []

    def grid(col, w, ahead):  # a fixed step of 0.25; records the solve order
        seen.append(col)
        assert ahead(3).shape == (6, min(3, 64 - len(seen) + 1))
        return torch.round(w * 4) / 4

    Q, loss = gptq_solve(W, H, grid, block_size=16)
    assert torch.equal(Q * 4, torch.round(Q * 4)) and loss > 0
    assert seen == list(range(64))
    rtn = torch.round(W * 4) / 4
    assert quantization_error(W, Q, H) < 0.8 * quantization_error(W, rtn, H)
    seen.clear()
    Q_ao, _ = gptq_solve(W, H, grid, block_size=16, act_order=True)
    assert seen == torch.argsort(torch.diag(H), descending=True).tolist()
    # one Hessian per row gives the same rows as the shared one
    seen.clear()
    Q_rows, _ = gptq_solve(W, torch.stack([H] * 6), grid, block_size=16)
    torch.testing.assert_close(Q_rows, Q, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="act_order needs one Hessian"):
        gptq_solve(W, torch.stack([H] * 6), grid, act_order=True)


def test_grouped_hessians_match_per_group_closed_forms():
    x = _correlated_inputs(300, 12).reshape(300, 3, 4)  # 3 groups of 4 columns
    acc = HessianAccumulator(4, groups=3)
    for chunk in x.split(100):
        acc.add_batch(chunk.transpose(0, 1))  # (groups, rows, columns)
    for g in range(3):
        torch.testing.assert_close(acc.H[g], 2 * x[:, g].t() @ x[:, g] / 300, rtol=1e-4, atol=1e-4)
    assert acc.nsamples == 300


@pytest.mark.parametrize("cols", [48, 200, 576])
def test_symmetric_products_give_the_full_product(cols):
    """``add_gram_`` computes the blocks on and above the diagonal and mirrors the rest; the
    symmetric accumulator equals the plain one to float rounding."""
    from edgekit.compress.weight_only.gptq import add_gram_

    x = _correlated_inputs(400, cols).double()
    H = torch.zeros(cols, cols, dtype=torch.float64)
    add_gram_(H, x[:300])
    add_gram_(H, x[300:])
    torch.testing.assert_close(H, x.t() @ x, rtol=1e-12, atol=1e-9)
    plain, sym = HessianAccumulator(cols), HessianAccumulator(cols, symmetric=True)
    for chunk in x.float().split(130):
        plain.add_batch(chunk)
        sym.add_batch(chunk)
    assert torch.equal(sym.H, sym.H.t()) and sym.nsamples == 400
    torch.testing.assert_close(sym.H, plain.H, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_mixed_hessians_per_key_value_head(causal):
    """Each key/value head's Hessian sums ``(P_h X)ᵀ(P_h X)`` over the query heads reading it; a
    causal ``P`` is multiplied a block of queries at a time, with the same result."""
    from edgekit.compress.weight_only.gptq import add_attention_mixed

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 6, 40, 40, generator=g)
    if causal:
        scores = scores.masked_fill(torch.ones(40, 40).triu(1).bool(), float("-inf"))
    P, X = scores.softmax(-1), torch.randn(2, 40, 32, generator=g)
    accs = [HessianAccumulator(32, symmetric=True) for _ in range(3)]
    add_attention_mixed(accs, P, X, rep=2, query_blocks=3)
    for kv, acc in enumerate(accs):
        Y = torch.cat([(P[:, h] @ X).reshape(-1, 32) for h in (2 * kv, 2 * kv + 1)])
        torch.testing.assert_close(acc.H, 2 * Y.t() @ Y / Y.shape[0], rtol=1e-5, atol=1e-5)
        assert acc.nsamples == 2 * 2 * 40


@pytest.mark.parametrize("act_order", [False, True])
def test_fixed_grid_solve_gives_the_callback_solve_codes(act_order):
    """``gptq_solve_fixed`` is ``gptq_solve`` with the grid inlined: the same codes (float64, where
    the order of the sums cannot flip a rounding) and what ``gptq_quantize`` returns with static groups."""
    from edgekit.compress.weight_only.gptq import gptq_solve, gptq_solve_fixed
    from edgekit.compress.weight_only.rtn import quantize_int

    torch.manual_seed(0)
    W = torch.randn(12, 96, dtype=torch.float64)
    X = _correlated_inputs(512, 96).double()
    H = 2 * X.t() @ X / X.shape[0]
    S = torch.rand(12, 96, dtype=torch.float64) * 0.1 + 0.2
    Z = torch.randint(0, 16, (12, 96)).double()
    want = torch.zeros(12, 96, dtype=torch.float64)

    def grid(col, w, ahead):
        q = quantize_int(w, S[:, col], Z[:, col], 4)
        want[:, col] = q
        return (q - Z[:, col]) * S[:, col]

    gptq_solve(W, H, grid, block_size=32, act_order=act_order)
    got = gptq_solve_fixed(W, H, S, Z, 15, block_size=32, act_order=act_order)
    assert torch.equal(got, want)


def test_one_thread_inside_and_the_callers_threads_restored_after():
    from edgekit.compress.weight_only.gptq import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError), one_thread():
            raise ValueError("a failed solve")
        assert torch.get_num_threads() == 2  # restored on the way out of an error too
    finally:
        torch.set_num_threads(before)


def test_the_walk_solves_on_one_thread_with_the_codes_of_gptq_quantize(monkeypatch):
    """With two torch threads, every GPTQ solve and GPTAQ target of the block walk runs on one, the
    walk's forward passes keep two, and each group's codes are ``gptq_quantize``'s on the group's
    (GPTAQ-shifted) weight and Hessian solved directly on one thread: whatever the caller's thread count,
    the walk's solves give the codes of a one-thread solve."""
    import sys
    from pathlib import Path

    from edgekit.compress.weight_only import gptq
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import quantize_module

    tests = str(Path(__file__).resolve().parents[2])
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from tiny_models import build

    solves: list[tuple[int, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]] = []
    targets: list[int] = []
    real_quantize, real_target = gptq.gptq_quantize, gptq.asymmetric_target

    def spy_quantize(W, H, **kw):
        out = real_quantize(W, H, **kw)
        solves.append((torch.get_num_threads(), W.clone(), H.clone(), out))
        return out

    def spy_target(*a, **kw):
        targets.append(torch.get_num_threads())
        return real_target(*a, **kw)

    monkeypatch.setattr(gptq, "gptq_quantize", spy_quantize)
    monkeypatch.setattr(gptq, "asymmetric_target", spy_target)
    model = build("llama")
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    config = WeightOnlyConfig(method="gptq-plus", bits=4, group_size=32, calib_samples=4, seqlen=24)
    method = config.method_config()
    assert method.gptaq_alpha > 0 and method.value_hessian == "attention" and method.act_order
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results, _ = quantize_module(model, config, [ids])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    # per block: q/k, v's key/value heads one by one, o, gate/up, down
    heads = model.config.num_key_value_heads
    blocks = model.config.num_hidden_layers
    assert len(solves) == blocks * (4 + heads)
    assert {s[0] for s in solves} == {1} and set(targets) == {1} and len(targets) == len(results)  # one per linear
    torch.set_num_threads(1)
    try:
        for _, W, H, (q, s, z) in solves:
            q2, s2, z2 = real_quantize(W, H, bits=4, group_size=32, sym=False, act_order=True, static_groups=False,
                                       damp=config.damp, block_size=config.block_size,
                                       mse_grid=config.grid_search, refit=True)
            assert torch.equal(q, q2) and torch.equal(s, s2) and torch.equal(z, z2)
    finally:
        torch.set_num_threads(before)
    assert all(r[0].dtype == torch.uint8 and int(r[0].max()) <= 15 for r in results.values())


def test_the_papers_gptq_in_the_walk_lowers_its_objective_below_rtn_on_every_layer(monkeypatch):
    """``--method gptq`` is the paper's algorithm: every group (the value projection with q/k, on the
    input Hessian) solved with a min-max grid, columns in order, no refit and no GPTAQ target; and on
    each Hessian the walk gave it, its codes cost less of what GPTQ minimises, ``tr(ΔW H ΔWᵀ)``,
    than rounding to nearest on the same grid."""
    import sys
    from pathlib import Path

    from edgekit.compress.weight_only import gptq
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import quantize_module

    tests = str(Path(__file__).resolve().parents[2])
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from tiny_models import build

    solves: list[tuple[torch.Tensor, torch.Tensor, dict, tuple[torch.Tensor, ...]]] = []
    real_quantize = gptq.gptq_quantize

    def spy_quantize(W, H, **kw):
        out = real_quantize(W, H, **kw)
        solves.append((W.clone(), H.clone(), kw, out))
        return out

    def no_target(*a, **kw):
        raise AssertionError("the paper's GPTQ has no GPTAQ target")

    monkeypatch.setattr(gptq, "gptq_quantize", spy_quantize)
    monkeypatch.setattr(gptq, "asymmetric_target", no_target)
    model = build("llama")
    ids = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(0))
    quantize_module(model, WeightOnlyConfig(method="gptq", bits=3, group_size=32, calib_samples=4, seqlen=24), [ids])
    assert len(solves) == model.config.num_hidden_layers * 4  # q/k/v, o, gate/up, down: one solve each
    for W, H, kw, (q, s, z) in solves:
        assert (kw["act_order"], kw["mse_grid"], kw["refit"], kw["damp"], kw["block_size"]) == (False, False, False,
                                                                                               0.01, 128)
        rq, rs, rz = rtn_quantize(W, 3, 32, False)
        gptq_error = quantization_error(W, dequantize_groups(q, s, z, 32), H)
        rtn_error = quantization_error(W, dequantize_groups(rq, rs, rz, 32), H)
        assert gptq_error < rtn_error, (W.shape, gptq_error, rtn_error)
