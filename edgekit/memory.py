"""Give memory back to the operating system between the phases of a command.

* ``release_memory``: tensors and ONNX protos freed by Python stay in the C allocator's heap
  (glibc keeps freed chunks for reuse), so a command's resident memory only grows; this runs the
  garbage collector and, on glibc, ``malloc_trim(0)``, which returns the free pages.
* ``reuse_freed_memory()``: inside it, glibc keeps the memory of freed tensors for the next ones
  instead of unmapping it and faulting fresh zeroed pages in at the next allocation; for passes that
  allocate and free activations of the same sizes batch after batch (INT8 calibration, GPTQ's Hessians,
  bias correction, the float reference).
* ``own_memory(module)``: a model loaded from a memory-mapped safetensors file keeps the whole
  file resident while any of its tensors still points into it: after a compression step replaced
  the large weights, the few float tensors left (norms, biases) hold the float model's file in
  memory. This copies those tensors out (Linux: read from ``/proc/self/maps``), so the mapping goes.
* ``drop_file_pages(tensors)``: the resident pages of memory-mapped weights nothing computes with any
  more (a block cast to float32, a layer packed), or that were read once and will be read again later
  (a layer's forward, the check for NaN at load), go back to the kernel while the file stays mapped;
  a later read finds them in the page cache (or the file). Pages the process wrote to (a private
  mapping's copy-on-write pages) are never dropped: that would undo the write.
* ``weights_on_disk(module, folder)``: for work that never runs the module (ONNX Runtime checking
  its exported graph), its large tensors wait in a file and come back bit for bit after.
* ``float32_compute(module)``: a model whose weights are stored in bfloat16 or float16 (to hold
  half the memory) runs in float32 all the same, one layer at a time: each module holding
  half-precision tensors of its own is cast to float32 right before its forward and its original
  tensors are put back right after (not cast back: a memory-mapped weight stays in its file rather
  than doubling into the heap), so at most one layer's float32 copy exists at a time
  (embedding tables and LM heads not even that: rows are looked up or multiplied a block at a time).
  With ``drop_pages=True`` each layer's memory-mapped weights also leave the process's resident memory
  once its forward returns, so a forward of the whole model holds one layer's pages at a time.

>>> release_memory()  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import Any


@cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") else None  # glibc only (not musl)


def release_memory(collect: bool = True) -> None:
    """Collect garbage and return the allocator's free pages to the system (glibc). ``collect=False``:
    only the pages, for a loop whose freed tensors went by reference count (a full collection walks every
    object of the process: 0.37 s each with transformers and a model loaded, 11 of SmolLM2 RTN's 18 s)."""
    if collect:
        gc.collect()
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
# After reuse_freed_memory: where glibc's own adjustment takes its thresholds for large blocks (mallopt(3): the
# mmap threshold rises to a freed block's size, at most 32 MB on 64-bit, the trim threshold to twice that);
# setting any of them turns that adjustment off for good, so the block leaves them where it would have led
_MALLOC_AFTER = {M_TRIM_THRESHOLD: 64 << 20, M_TOP_PAD: 128 << 10, M_MMAP_THRESHOLD: 32 << 20}
# Inside reuse_freed_memory: blocks up to 256 MB come from the heap, up to 1 GB of free memory at its top
# stays in the process, and the heap grows 64 MB at a time
_MALLOC_REUSE = {M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20, M_MMAP_THRESHOLD: 256 << 20}
_reusing = 0


@contextmanager
def reuse_freed_memory() -> Iterator[None]:
    """Serve large allocations from glibc's heap and keep freed memory for reuse inside the block.

    PyTorch's CPU tensors are plain ``malloc`` blocks. By default glibc maps every block above a
    threshold (128 KB, rising to at most 32 MB) with ``mmap`` and unmaps it on free, so a pass whose
    activations are megabytes gets fresh pages from the kernel, zeroed and faulted in one by one, for
    every tensor of every batch. On EfficientNet-Lite0's INT8 passes that was 18 of 48 CPU s spent in the
    kernel (benchmarks/RESULTS.md, issue 26). Inside the block blocks up to 256 MB come from the heap
    and freed memory stays there for the next batch; on exit the thresholds go where glibc's own
    adjustment takes them for large blocks (``_MALLOC_AFTER``) and ``malloc_trim`` returns the free
    pages. Re-entrant; a no-op off glibc, and where the user tuned glibc's allocator through its
    ``MALLOC_*_`` environment variables."""
    global _reusing
    lib = _libc()
    if lib is None or not hasattr(lib, "mallopt") or any(k.startswith("MALLOC_") for k in os.environ):
        yield
        return
    if _reusing == 0:
        for param, value in _MALLOC_REUSE.items():
            lib.mallopt(param, value)
    _reusing += 1
    try:
        yield
    finally:
        _reusing -= 1
        if _reusing == 0:
            for param, value in _MALLOC_AFTER.items():
                lib.mallopt(param, value)
            lib.malloc_trim(0)


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's file-backed mappings of data files (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[5].startswith("/") and parts[5].endswith(".safetensors"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi))
    return out


def own_memory(module: Any) -> int:
    """Copy the parameters and buffers of ``module`` that live in a memory-mapped safetensors file
    into memory of their own (shared tensors stay shared), for each file of which they use less than
    half (a model whose weights mostly still live there keeps it: copying would double it for a
    while); returns how many were copied."""
    ranges = _file_mappings()
    if not ranges:
        return 0
    inside: dict[tuple[int, int], list[Any]] = {}
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen or t.device.type != "cpu" or t.numel() == 0:
            continue
        seen.add(id(t))
        ptr = t.untyped_storage().data_ptr()
        for lo, hi in ranges:
            if lo <= ptr < hi:
                inside.setdefault((lo, hi), []).append(t)
                break
    copied = 0
    for (lo, hi), tensors in inside.items():
        if sum(t.numel() * t.element_size() for t in tensors) * 2 >= hi - lo:
            continue
        for t in tensors:
            t.data = t.data.clone()
            copied += 1
    if copied:
        release_memory()
    return copied


MADV_DONTNEED = 4  # Linux: the pages go; a later read of a file-backed page reads it from the file again


def drop_file_pages(tensors: list[Any]) -> int:
    """Let the kernel take back the resident pages of ``tensors`` that live in a memory-mapped
    safetensors file (a half-precision weight a float32 copy or a packed layer replaced, or one read
    now and read again later): while any tensor still points into the file, its mapping stays and
    every page once read counts in the process's memory. Only whole pages inside each tensor's bytes
    are dropped, so a neighbour's bytes stay where they are; read again, they come back from the
    unchanged file. A tensor with a page this process wrote to (copy-on-write: no longer the file's)
    is left whole. Returns the bytes dropped (0 off Linux/glibc)."""
    lib = _libc()
    ranges = _file_mappings() if lib is not None and tensors else []
    if not ranges:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    dropped = 0
    seen: set[tuple[int, int]] = set()
    for t in tensors:
        ptr, size = t.data_ptr(), t.numel() * t.element_size()
        if not any(lo <= ptr and ptr + size <= hi for lo, hi in ranges):
            continue
        start, end = -(-ptr // page) * page, (ptr + size) // page * page
        if end <= start or (start, end) in seen or _written_pages(start, end, page):
            continue
        seen.add((start, end))
        if lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            dropped += end - start
    return dropped


PAGEMAP_PRESENT, PAGEMAP_FILE = 1 << 63, 1 << 61  # /proc/self/pagemap entry bits (Linux >= 4.2)


def _written_pages(start: int, end: int, page: int) -> bool:
    """Whether a page in [start, end) of a private file mapping is resident but no longer the file's
    (written to: an anonymous copy); True when this cannot be read (nothing is dropped then)."""
    import numpy as np

    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(start // page * 8)
            entries = np.frombuffer(f.read((end - start) // page * 8), dtype=np.uint64)
    except OSError:
        return True
    if entries.size != (end - start) // page:
        return True
    present = (entries & np.uint64(PAGEMAP_PRESENT)) != 0
    return bool((present & ((entries & np.uint64(PAGEMAP_FILE)) == 0)).any())


def _own_tensors(module: Any) -> list[tuple[str, Any, str]]:
    """(kind, tensor, name) of the parameters and buffers ``module`` holds itself."""
    return ([("param", p, n) for n, p in module.named_parameters(recurse=False)]
            + [("buffer", b, n) for n, b in module.named_buffers(recurse=False) if b is not None])


def _cast_up(module: Any, names: set[str], kept: dict[str, Any]) -> None:
    """Cast the half-precision tensors of ``module`` named in ``names`` to float32, keeping each
    original in ``kept`` (name -> tensor) for ``_restore``."""
    import torch

    for kind, t, name in _own_tensors(module):
        if name not in names or t.dtype == torch.float32:
            continue
        if kind == "param":
            kept[name] = t.data
            t.data = t.data.float()
        else:
            kept[name] = t
            module._buffers[name] = t.float()


def _restore(module: Any, kept: dict[str, Any], drop_pages: bool = False) -> None:
    """Put back the tensors ``_cast_up`` replaced: the very same storage, not a cast-back copy (a
    weight memory-mapped from its safetensors file stays there instead of doubling into the heap);
    ``drop_pages``: and let their resident pages go (``drop_file_pages``)."""
    if drop_pages:
        drop_file_pages(list(kept.values()))
    for kind, t, name in _own_tensors(module):
        if name not in kept:
            continue
        if kind == "param":
            t.data = kept[name]
        else:
            module._buffers[name] = kept[name]
    kept.clear()


LARGE = 2**24  # elements: a table this large computes in float32 a block of rows at a time


@contextmanager
def float32_compute(module: Any, drop_pages: bool = False) -> Iterator[None]:
    """Within the block, every submodule of ``module`` holding bfloat16/float16 tensors of its own
    computes in float32: cast up right before its forward, its own half-precision tensors put back
    right after (the same storage: a memory-mapped weight is not copied into the heap). An
    embedding table looks its rows up as stored and casts them (exact); a linear layer larger than
    ``LARGE`` elements (an LM head) multiplies a block of output rows at a time, so neither is ever
    copied whole. A module stored in float32 throughout runs unchanged (no hook is installed).
    ``drop_pages``: once a layer's forward returns, its memory-mapped half-precision weights' pages go
    back to the kernel (``drop_file_pages``; embedding and large tables excepted: they are read a
    row block at a time, and a tied table is read again by the head)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    half = (torch.bfloat16, torch.float16)
    hooks, patched = [], []
    for m in module.modules():
        dtypes = {name: t.dtype for _k, t, name in _own_tensors(m) if t.dtype in half}
        if not dtypes:
            continue
        if type(m) is nn.Embedding:
            hooks.append(m.register_forward_hook(lambda _m, _a, out: out.float()))
        elif type(m) is nn.Linear and m.weight.numel() > LARGE:
            setattr(m, "forward", partial(_blocked_linear, F, weight=m.weight, bias=m.bias))  # noqa: B010 (an instance attribute)
            patched.append(m)
        else:
            kept: dict[str, Any] = {}
            hooks.append(m.register_forward_pre_hook(lambda mod, _a, n=set(dtypes), k=kept: _cast_up(mod, n, k)))
            hooks.append(m.register_forward_hook(lambda mod, _a, _o, k=kept: _restore(mod, k, drop_pages)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for m in patched:
            del m.forward


def _blocked_linear(F: Any, x: Any, *, weight: Any, bias: Any) -> Any:
    """``x @ weight.T + bias`` in float32, ``weight`` (stored in half precision) cast a block of rows at a time."""
    x = x.float()
    rows = max(1, LARGE // max(weight.shape[1], 1))
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    for lo in range(0, weight.shape[0], rows):
        hi = min(lo + rows, weight.shape[0])
        out[..., lo:hi] = F.linear(x, weight[lo:hi].float(), None if bias is None else bias[lo:hi].float())
    return out


def half_stored(module: Any) -> bool:
    """Whether ``module`` holds bfloat16 or float16 parameters (storage for ``float32_compute``)."""
    import torch

    return any(p.dtype in (torch.bfloat16, torch.float16) for p in module.parameters())


@contextmanager
def weights_on_disk(module: Any, folder: str | os.PathLike[str], min_bytes: int = 1 << 16) -> Iterator[int]:
    """Within: the tensors of ``module`` of at least ``min_bytes`` are in a file in ``folder``, not in
    memory, for work that never runs the module (ONNX Runtime's checks of its graph); on exit they are
    read back, bit for bit. Each storage is emptied in place (``resize_(0)``), so every tensor sharing it
    (a tied embedding and LM head) shares it again after; small tensors (norms, rotary tables) stay.
    Yields the bytes moved out.

    >>> with weights_on_disk(handle.module, tmp):  # doctest: +SKIP
    ...     check_lm_parity(handle, "out/model.onnx", references=refs)
    """
    storages: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        st = t.untyped_storage()
        if st.nbytes() >= min_bytes and st.resizable() and st.device.type == "cpu":
            storages.setdefault(st.data_ptr(), st)

    def as_bytes(st: Any) -> Any:  # the storage's memory, without a copy (numpy's view would pin its size)
        return (ctypes.c_char * st.nbytes()).from_address(st.data_ptr())

    path = Path(folder) / "offloaded-weights.bin"
    sizes: list[int] = []  # of the storages emptied so far, in order
    try:
        with open(path, "wb") as out:
            for st in storages.values():
                n = st.nbytes()
                out.write(as_bytes(st))
                st.resize_(0)
                sizes.append(n)
        yield sum(sizes)
    finally:
        if sizes:
            with open(path, "rb") as f:
                for st, n in zip(storages.values(), sizes):
                    st.resize_(n)
                    if f.readinto(as_bytes(st)) != n:
                        raise OSError(f"{path} ended before the module's weights were read back")
        path.unlink(missing_ok=True)


__all__ = ["drop_file_pages", "float32_compute", "half_stored", "own_memory", "release_memory", "weights_on_disk"]
