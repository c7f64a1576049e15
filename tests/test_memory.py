"""Half-precision storage computed in float32 a layer at a time (``edgekit.memory``)."""
from __future__ import annotations

import copy

import torch
from torch import nn

from edgekit.memory import float32_compute, half_stored


def test_float32_compute_runs_half_weights_in_float32_and_puts_them_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).to(torch.bfloat16)
    reference = copy.deepcopy(model).float()  # the same (bfloat16) values, stored in float32
    seen: list[torch.dtype] = []
    model[1].register_forward_hook(lambda m, _a, _o: seen.append(m.weight.dtype))  # runs before the cast back
    ids = torch.arange(10)[None]
    assert half_stored(model) and not half_stored(reference)
    with torch.no_grad(), float32_compute(model):
        out = model(ids)
    assert seen == [torch.float32]  # cast up for its own forward
    assert out.dtype == torch.float32 and torch.equal(out, reference(ids))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # stored as before
    with float32_compute(reference):  # a float32 model: nothing installed
        assert not any(m._forward_pre_hooks for m in reference.modules())


def test_large_tables_compute_a_block_of_rows_at_a_time(monkeypatch):
    """An embedding looks its rows up as stored; a linear layer above ``LARGE`` elements multiplies a
    block of output rows at a time: the same float32 result, and no float32 copy of either table."""
    import edgekit.memory as memory

    monkeypatch.setattr(memory, "LARGE", 64)  # 8 x 24 tables are "large" here: 3 rows at a time
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(24, 8), nn.Linear(8, 24)).to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    ids = torch.arange(24)[None]
    with torch.no_grad(), float32_compute(model):
        out = model(ids)
        assert model[0].weight.dtype == model[1].weight.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference(ids), rtol=1e-6, atol=1e-6)
    assert "forward" not in vars(model[1])  # restored
