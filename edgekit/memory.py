"""Give freed memory back to the operating system between the phases of a command.

Large tensors and ONNX protos freed by Python stay in the C allocator's heap (glibc keeps freed
chunks for reuse), so a command's resident memory only grows: the float model loaded after an
export's graph was built and freed lands on top of the freed graph. ``release_memory`` runs the
garbage collector and, on glibc, ``malloc_trim(0)``, which returns the free pages; elsewhere it
only collects.

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


__all__ = ["release_memory"]
