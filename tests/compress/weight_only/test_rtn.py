"""Round-to-nearest quantization (edgekit/compress/weight_only/rtn.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from edgekit.compress.weight_only import rtn
from edgekit.compress.weight_only.rtn import rtn_quantize
from edgekit.memory import drop_file_pages


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on a file mapping: Linux")
def test_a_mapped_table_rounded_block_by_block_lets_each_block_s_pages_go(tmp_path, monkeypatch):
    """``done_with`` receives each block of rows once, in order, right after it is rounded: the LM head
    of a half-precision checkpoint hands its memory-mapped pages back block by block
    (``drop_file_pages``), and the codes are those of a pass that keeps every page."""
    rows, cols = 256, 2048  # 1 MiB of bfloat16: 256 pages
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    path = tmp_path / "head.safetensors"  # the files whose mappings drop_file_pages touches
    w.view(torch.int16).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=rows * cols, dtype=torch.bfloat16).view(rows, cols)
    whole = rtn_quantize(w, 8, 128, False)
    monkeypatch.setattr(rtn, "ROW_BLOCK_ELEMENTS", 64 * cols)  # 4 blocks of 64 rows (256 KiB each)
    blocks: list[tuple[int, int]] = []
    dropped: list[int] = []

    def done_with(block: torch.Tensor) -> None:
        start = (block.data_ptr() - mapped.data_ptr()) // (cols * 2)
        blocks.append((start, block.shape[0]))
        dropped.append(drop_file_pages([block]))

    got = rtn_quantize(mapped, 8, 128, False, done_with=done_with)
    assert blocks == [(0, 64), (64, 64), (128, 64), (192, 64)]
    page = os.sysconf("SC_PAGE_SIZE")
    assert all(d >= 64 * cols * 2 - 2 * page for d in dropped)  # every block's whole pages went
    for a, b in zip(whole, got, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(mapped, w)  # read back from the file
