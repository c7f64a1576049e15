"""Round-to-nearest quantization (edgekit/compress/weight_only/rtn.py)."""
from __future__ import annotations

import pytest
import torch

from edgekit.compress.weight_only import rtn
from edgekit.compress.weight_only.rtn import rtn_quantize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sym", [False, True])
def test_rows_rounded_a_block_at_a_time_give_the_codes_of_the_whole_matrix(dtype, sym, monkeypatch):
    """A half-precision head is cast to float32 a block of rows at a time (never whole): rows are
    independent, so the codes, scales and zero points are those of one pass over the matrix, also
    with a last, shorter block of rows and a last, shorter group of columns."""
    w = torch.randn(50, 72, generator=torch.Generator().manual_seed(0)).to(dtype)
    clip = torch.rand(50, 3, generator=torch.Generator().manual_seed(1)) * 0.2 + 0.8
    whole = rtn_quantize(w, 4, 32, sym, clip)
    monkeypatch.setattr(rtn, "ROW_BLOCK_ELEMENTS", 7 * 72)  # 7 rows a pass: 8 passes, the last of 1 row
    blocked = rtn_quantize(w, 4, 32, sym, clip)
    for a, b in zip(whole, blocked, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    q, s, z = blocked
    assert q.shape == (50, 72) and s.shape == (50, 3) and int(q.max()) <= 15 and int(z.max()) <= 15
    assert bool((s > 0).all())
