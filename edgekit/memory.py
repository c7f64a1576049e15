"""Give memory back to the operating system between the phases of a command.

* ``release_memory``: tensors and ONNX protos freed by Python stay in the C allocator's heap
  (glibc keeps freed chunks for reuse), so a command's resident memory only grows; this runs the
  garbage collector and, on glibc, ``malloc_trim(0)``, which returns the free pages.
* ``own_memory(module)``: a model loaded from a memory-mapped safetensors file keeps the whole
  file resident while any of its tensors still points into it: after a compression step replaced
  the large weights, the few float tensors left (norms, biases) hold the float model's file in
  memory. This copies those tensors out (Linux: read from ``/proc/self/maps``), so the mapping goes.

>>> release_memory()  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from functools import cache
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


def release_memory() -> None:
    """Collect garbage and return the allocator's free pages to the system (glibc)."""
    gc.collect()
    lib = _libc()
    if lib is not None:
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


__all__ = ["own_memory", "release_memory"]
