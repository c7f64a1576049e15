"""Half-precision storage computed in float32 a layer at a time (``edgekit.memory``)."""
from __future__ import annotations

import copy
import os
import sys

import numpy as np
import pytest
import torch
from torch import nn

from edgekit import memory
from edgekit.memory import drop_file_pages, float32_compute, half_stored, reuse_freed_memory


def test_float32_compute_runs_half_weights_in_float32_and_puts_them_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)).to(torch.bfloat16)
    reference = copy.deepcopy(model).float()  # the same (bfloat16) values, stored in float32
    seen: list[torch.dtype] = []
    model[1].register_forward_hook(lambda m, _a, _o: seen.append(m.weight.dtype))  # runs before the cast back
    ids = torch.arange(10)[None]
    assert half_stored(model) and not half_stored(reference)
    storage = [p.data_ptr() for p in model.parameters()]
    with torch.no_grad(), float32_compute(model):
        out = model(ids)
        out = model(ids)  # twice: the second forward finds the tensors the first one put back
    assert seen == [torch.float32] * 2  # cast up for its own forward, each time
    assert out.dtype == torch.float32 and torch.equal(out, reference(ids))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # stored as before
    # the very tensors it had, not cast-back copies: a weight memory-mapped from its file stays there
    assert [p.data_ptr() for p in model.parameters()] == storage
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


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on a file mapping: Linux")
def test_pages_of_a_mapped_weight_go_back_to_the_kernel_and_read_back_from_the_file(tmp_path):
    """``drop_file_pages`` on a tensor memory-mapped from a ``.safetensors`` file: its whole pages leave
    the process's resident memory (the file stays mapped), and reading it again gives the same bytes
    (they come back from the file); tensors outside such a file are left alone."""
    data = np.random.default_rng(0).integers(0, 256, 16 * 2**20, dtype=np.uint8)
    path = tmp_path / "weights.safetensors"
    data.tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=data.size, dtype=torch.uint8)
    weight = mapped[4096 + 100: 12 * 2**20 + 7]  # not page-aligned at either end
    assert int(weight.sum()) == int(data[4096 + 100: 12 * 2**20 + 7].sum())  # read: resident now
    before = _rss_file_kib()
    dropped = drop_file_pages([weight, torch.ones(2**20)])  # the second is heap memory: not touched
    page = os.sysconf("SC_PAGE_SIZE")
    assert dropped == ((4096 + 100 + weight.numel()) // page - -(-(4096 + 100) // page)) * page
    assert dropped >= 12 * 2**20 - 2 * page - 4096
    assert before - _rss_file_kib() >= dropped // 1024 * 0.9  # (other files may page in meanwhile)
    assert np.array_equal(weight.numpy(), data[4096 + 100: 12 * 2**20 + 7])  # read back from the file
    assert drop_file_pages([]) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on a file mapping: Linux")
def test_written_pages_of_a_private_mapping_are_never_dropped(tmp_path):
    """A tensor of a private file mapping the process wrote to holds copy-on-write pages that are no
    longer the file's: dropping them would undo the write, so ``drop_file_pages`` leaves it whole."""
    data = np.zeros(4 * 2**20, dtype=np.uint8)
    path = tmp_path / "weights.safetensors"
    data.tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=data.size, dtype=torch.uint8)
    written, clean = mapped[: 2 * 2**20], mapped[2 * 2**20:]
    written[5 * 4096 + 3] = 7  # one page copied on write
    assert int(clean.sum()) == 0  # read: resident, still the file's
    assert drop_file_pages([written]) == 0 and int(written[5 * 4096 + 3]) == 7
    assert drop_file_pages([clean]) == 2 * 2**20 and int(clean.sum()) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise on a file mapping: Linux")
def test_float32_compute_can_let_each_layers_mapped_pages_go(tmp_path):
    """``float32_compute(drop_pages=True)``: a layer whose bfloat16 weight is memory-mapped from a
    ``.safetensors`` file computes in float32 as before, and its weight's pages leave resident memory
    once its forward returns (read again from the file on the next forward: the same output)."""
    rows, cols = 1024, 2048  # 4 MiB of bfloat16
    w = torch.randn(rows, cols).to(torch.bfloat16)
    path = tmp_path / "layer.safetensors"
    w.view(torch.uint8).numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=rows * cols, dtype=torch.bfloat16).view(rows, cols)
    layer = nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
    layer.weight.data = mapped
    x = torch.randn(3, cols)
    want = x @ w.float().T
    for _ in range(2):
        with torch.no_grad(), float32_compute(layer, drop_pages=True):
            before = _rss_file_kib()
            out = layer(x)
        assert torch.equal(out, want) and layer.weight.data_ptr() == mapped.data_ptr()
        assert _rss_file_kib() - before < 1024  # the 4 MiB read for the forward went back




# Run in a fresh process: whether glibc maps a block depends on what the process freed before (a large free
# chunk left in its heap by an earlier test serves the next block without a fault)
_FAULTS = """
import os, resource, sys, torch
from edgekit.memory import reuse_freed_memory

def faults(count=8, floats=10 << 20):  # 40 MB tensors: above the 32 MB glibc's own adjustment stops at
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(count):
        torch.ones(floats)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

outside = faults()
with reuse_freed_memory():
    faults()  # the heap grows to hold them
    inside = faults()
print(outside, inside)
"""


@pytest.mark.skipif(memory._libc() is None, reason="glibc's allocator only")
@pytest.mark.parametrize("user_setting", [None, "MALLOC_ARENA_MAX"])
def test_reuse_freed_memory_keeps_a_freed_tensor_s_pages_for_the_next_one(user_setting):
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if user_setting:
        env[user_setting] = "2"  # the user tuned glibc's allocator: left alone
    out = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True)
    outside, inside = (int(v) for v in out.stdout.split())
    pages = (10 << 20) * 4 // os.sysconf("SC_PAGE_SIZE")  # one tensor's pages
    assert outside >= 6 * pages  # glibc maps and unmaps each one
    if user_setting:
        assert inside >= 6 * pages
    else:
        assert inside < pages // 4

class _Mallopt:
    """A stand-in for glibc's mallopt / malloc_trim that records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.trims = 0

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1

    def malloc_trim(self, _pad: int) -> int:
        self.trims += 1
        return 1


def test_reuse_freed_memory_sets_glibc_s_thresholds_once_and_leaves_them_where_glibc_would(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k)
    fake = _Mallopt()
    monkeypatch.setattr(memory, "_libc", lambda: fake)
    with reuse_freed_memory():
        with reuse_freed_memory():  # nested: nothing more set, nothing undone at its end
            pass
        assert fake.calls == [(memory.M_TRIM_THRESHOLD, 1 << 30), (memory.M_TOP_PAD, 64 << 20),
                              (memory.M_MMAP_THRESHOLD, 256 << 20)] and fake.trims == 0
    # glibc's own adjustment for large blocks: mmap threshold 32 MB, trim threshold twice that
    assert fake.calls[3:] == [(memory.M_TRIM_THRESHOLD, 64 << 20), (memory.M_TOP_PAD, 128 << 10),
                              (memory.M_MMAP_THRESHOLD, 32 << 20)] and fake.trims == 1
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # the user tuned glibc's allocator: left alone
    with reuse_freed_memory():
        pass
    assert len(fake.calls) == 6 and fake.trims == 1
