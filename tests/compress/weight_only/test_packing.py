"""Packed low-bit layers: layout, round trips, on-the-fly dequantization (issue 4)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from edgekit.compress.weight_only.packing import QuantEmbedding, QuantLinear, pack_codes, quantize_linear, unpack_codes
from edgekit.compress.weight_only.rtn import dequantize_groups, qparams, rtn_quantize


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 2**bits, (5, 37), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_codes(q, bits)
    expect_cols = {2: 10, 3: 19, 4: 19, 8: 37}[bits]
    assert packed.dtype == torch.uint8 and packed.shape == (5, expect_cols)
    assert torch.equal(unpack_codes(packed, bits, 37), q)


def test_nibble_order_is_low_first():
    q = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_codes(q, 4).tolist() == [[0x21, 0x43]]
    assert pack_codes(q[:, :3], 4).tolist() == [[0x21, 0x03]]
    assert pack_codes(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[0b00111001]]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packing_in_uint8_gives_the_bytes_of_wide_integer_packing(bits):
    """``pack_codes`` packs in uint8 (no int32 copy of an LM head's codes): each byte is the low 8 bits of
    the codes shifted and OR-ed in wide integers, for in-range codes, the padded last byte, and codes
    too large for the width alike; the input is left as it was."""
    import numpy as np

    per = 8 // (4 if bits == 3 else bits)
    width = 8 // per
    g = torch.Generator().manual_seed(bits)
    for high in (2**width, 256):
        q = torch.randint(0, high, (1, 7), generator=g, dtype=torch.int64).to(torch.uint8)
        before = q.clone()
        wide = np.pad(q.numpy().astype(np.int64), ((0, 0), (0, (-7) % per))).reshape(1, -1, per)
        want = (np.bitwise_or.reduce([wide[..., i] << (width * i) for i in range(per)]) & 0xFF).astype(np.uint8)
        got = pack_codes(q, bits)
        assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want) and torch.equal(q, before)


def test_rtn_grid_asym_and_sym():
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    s, z = qparams(w, 4, sym=False)
    assert s.item() == pytest.approx(3.0 / 15) and z.item() == 5
    s, z = qparams(w, 4, sym=True)
    assert s.item() == pytest.approx(4.0 / 15) and z.item() == 8
    q, sc, zs = rtn_quantize(w, 4, -1, False)
    assert (dequantize_groups(q, sc, zs, -1) - w).abs().max() <= sc.max() / 2 + 1e-6


@pytest.mark.parametrize("group_size,sym", [(128, False), (128, True), (-1, False), (64, False)])
def test_quant_linear_matches_fake_quant(group_size, sym):
    torch.manual_seed(0)
    lin = nn.Linear(320, 48)  # 320 = 2.5 groups of 128: a partial last group
    ql = quantize_linear(lin, bits=4, group_size=group_size, sym=sym)
    q, s, z = rtn_quantize(lin.weight.detach(), 4, group_size, sym)
    ref = dequantize_groups(q, s, z, group_size)
    assert torch.equal(ql.dequantize(), ref)
    x = torch.randn(3, 7, 320)
    torch.testing.assert_close(ql(x), nn.functional.linear(x, ref, lin.bias), rtol=1e-5, atol=1e-5)
    rel = (ref - lin.weight).norm() / lin.weight.norm()
    assert rel < 0.15
    assert ql.qweight.shape == (48, 160) and ql.qweight.dtype == torch.uint8
    assert ql.scales.dtype == torch.float32


def test_quant_linear_state_dict_round_trip_and_grad_flows_to_input():
    torch.manual_seed(1)
    ql = quantize_linear(nn.Linear(64, 16, bias=True), bits=3, group_size=32)
    fresh = QuantLinear(64, 16, bits=3, group_size=32, bias=True)
    fresh.load_state_dict(ql.state_dict(), strict=True)
    x = torch.randn(2, 64, requires_grad=True)
    y = fresh(x)
    assert torch.equal(y, ql(x))
    y.sum().backward()
    assert x.grad is not None and not any(p.requires_grad for p in fresh.parameters())


def test_quant_embedding_tied_gathers_rows():
    torch.manual_seed(2)
    head = quantize_linear(nn.Linear(32, 50, bias=False), bits=8, group_size=16)
    emb = QuantEmbedding(50, 32, bits=8, group_size=16)
    emb.tie_to(head)
    ids = torch.tensor([[0, 7, 49], [3, 3, 1]])
    torch.testing.assert_close(emb(ids), head.dequantize()[ids])
    assert emb.qweight is head.qweight


def test_dequantized_once_gives_the_same_outputs_without_dequantizing_per_forward(monkeypatch):
    """Inside ``dequantized_once`` each kept layer computes with the weight dequantized on entry: outputs
    equal to the bit to dequantizing on every forward, for a whole weight and for a large table that
    ``forward`` dequantizes a block of rows at a time (``FORWARD_CHUNK`` shrunk to 3 blocks of 20 rows);
    no dequantization per forward; layers beyond ``max_bytes`` stay as before; nothing kept after exit."""
    from edgekit.export import packing

    monkeypatch.setattr(packing, "FORWARD_CHUNK", 20 * 64)
    torch.manual_seed(3)
    small = quantize_linear(nn.Linear(64, 16, bias=True), bits=4, group_size=32)
    table = quantize_linear(nn.Linear(64, 50, bias=False), bits=4, group_size=32)  # rows 0-19, 20-39, 40-49
    model = nn.ModuleList([small, table])
    assert small._row_blocks() == [(0, 16)] and table._row_blocks() == [(0, 20), (20, 40), (40, 50)]
    x = torch.randn(2, 5, 64)

    def run() -> torch.Tensor:
        return torch.cat([small(x), table(x)], -1)

    want = run()
    calls: list[str] = []
    for name, layer in (("small", small), ("table", table)):
        for fn in ("dequantize", "dequantize_rows"):
            real = getattr(layer, fn)
            monkeypatch.setattr(layer, fn, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    with packing.dequantized_once(model) as kept:
        assert kept == (16 + 50) * 64 * 4 and calls == ["small", "table", "table", "table"]
        for _ in range(3):
            assert torch.equal(run(), want)
        assert len(calls) == 4  # none per forward
    assert small._kept is None and table._kept is None
    calls.clear()
    with packing.dequantized_once(model, max_bytes=16 * 64 * 4) as kept:  # room for the small layer only
        assert kept == 16 * 64 * 4 and small._kept is not None and table._kept is None
        assert torch.equal(run(), want)
        assert calls == ["small", "table", "table", "table"]  # the table: its 3 blocks, per forward
    assert torch.equal(run(), want) and small._kept is None


def test_the_gate_keeps_dequantized_weights_only_within_the_memory_goal(monkeypatch):
    """``keep_dequantized_budget``: 1.5x the model's weights in bfloat16, less what it stores and the gate's
    reserve, capped; a tied head and embedding count once; a small model keeps nothing."""
    from edgekit.export import packing

    torch.manual_seed(0)
    head = quantize_linear(nn.Linear(64, 96, bias=False), bits=4, group_size=32)
    emb = QuantEmbedding(96, 64, bits=4, group_size=32)
    emb.tie_to(head)
    model = nn.ModuleDict({"head": head, "emb": emb, "norm": nn.LayerNorm(64)})
    # stored once: 4-bit codes 96 x 64 / 2, float32 scales 96 x 2, 4-bit zero points 96 x 2 / 2, the norm's 2 x 64 float32
    stored = 96 * 64 // 2 + 96 * 2 * 4 + 96 * 2 // 2 + 2 * 64 * 4
    weights = 96 * 64 + 96 * 2 + 2 * 64  # the table once, its float scales, the norm
    assert packing.keep_dequantized_budget(model) == 0  # a real gate's 1 GiB reserve is far beyond this model
    monkeypatch.setattr(packing, "GATE_RESERVE_BYTES", 0)
    assert packing.keep_dequantized_budget(model) == int(1.5 * 2 * weights) - stored
    monkeypatch.setattr(packing, "KEEP_DEQUANTIZED_BYTES", 1000)
    assert packing.keep_dequantized_budget(model) == 1000
