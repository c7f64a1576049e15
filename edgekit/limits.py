"""Sizes a user or a file controls, checked against this machine before anything is allocated.

A batch of a million samples, a 6 GiB ``tokenizer.json``, a grid of a million points or
100,000 worker processes would exhaust memory (or the disk) long after the command
started, or take the machine down with it. Each such size is checked here first, and a
refusal is one line that names the value, what it would take and the limit:

* ``available_memory()``: what this process may still allocate: the kernel's
  ``MemAvailable``, lowered by a cgroup memory limit (containers, CI runners) and by
  ``RLIMIT_AS`` where they are set;
* ``require_memory(nbytes, what)``: ``what`` fits in a share of it;
* ``require_disk(path, nbytes, what)``: the file system that ``path`` goes to has that
  much free space (an output checked before the work that fills it);
* ``check_file_size(path, max_bytes, what)``: a file read whole (a tokenizer, a text
  corpus) is at most ``max_bytes`` on disk and, times ``expansion`` (what parsing it
  takes in memory), within the available memory;
* ``MAX_DIM``: the largest batch or dimension any option takes (``--batch``, ``--shapes``,
  ``--dim``, recipes), 2^20.

>>> require_memory(1 << 20, "a 1 MiB buffer")  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import os
import resource
import shutil
from pathlib import Path

from edgekit.errors import BadInputError, shown_path

MAX_DIM = 1 << 20  # a batch or one dimension of an input: beyond this it is a typo, not a model
# The share of the available memory one allocation a user sized may take: the rest is for
# the model, the runtime's activations and outputs, and everything else on the machine.
MEMORY_SHARE = 0.25


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``640 MiB``, ``12 KiB``, ``0 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:  # not Linux: the free physical pages
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """What the process's cgroup (v2, else v1) still allows, where a limit is set."""
    pairs = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
             ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
    for limit_file, usage_file in pairs:
        with contextlib.suppress(OSError, ValueError):
            text = Path(limit_file).read_text().strip()
            if text == "max":
                return None
            limit = int(text)
            if limit >= 1 << 60:  # v1 writes a huge number for "no limit"
                return None
            return max(0, limit - int(Path(usage_file).read_text().strip()))
    return None


def _address_space_room() -> int | None:
    """What ``RLIMIT_AS`` (``ulimit -v``) still allows this process to map."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, soft - int(line.split()[1]) * 1024)
    return soft


def available_memory() -> int | None:
    """Bytes this process may still allocate (None where the system does not say)."""
    known = [v for v in (_meminfo_available(), _cgroup_room(), _address_space_room()) if v is not None]
    return min(known) if known else None


def require_memory(nbytes: float, what: str, hint: str = "", share: float = MEMORY_SHARE) -> None:
    """BadInputError unless ``nbytes`` fits in ``share`` of the available memory:
    ``a batch of 1500000 samples of the inputs needs 4.29 GiB; edgekit lets one allocation
    take at most a quarter of the 6.1 GiB of memory available here; lower --batch``."""
    available = available_memory()
    if available is None or nbytes <= share * available:
        return
    part = {0.25: "a quarter", 0.5: "half", 1.0: "all"}.get(share, f"{share:.0%}")
    raise BadInputError(f"{what} needs {format_bytes(nbytes)}; edgekit lets it take at most {part} of the "
                        f"{format_bytes(available)} of memory available here" + (f"; {hint}" if hint else ""))


def free_space(path: str | os.PathLike[str]) -> tuple[Path, int] | None:
    """(the nearest existing folder at or above ``path``, its file system's free bytes)."""
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        p = p.parent
    try:
        return p, shutil.disk_usage(p).free
    except OSError:
        return None


def require_disk(path: str | os.PathLike[str], nbytes: float, what: str) -> None:
    """BadInputError unless the file system ``path`` goes to has ``nbytes`` free: checked
    before long work whose output would not fit (a full disk found at the end costs the
    whole run)."""
    found = free_space(path)
    if found is None or nbytes <= found[1]:
        return
    folder, free = found
    raise BadInputError(f"cannot write {shown_path(path)}: {what} needs about {format_bytes(nbytes)} and "
                        f"{shown_path(folder)} has {format_bytes(free)} free; free some space or choose another folder")


def check_file_size(path: str | os.PathLike[str], max_bytes: int, what: str, expansion: float = 1.0) -> int:
    """The size of ``path`` (a file read whole), refused beyond ``max_bytes`` or when
    ``expansion`` times it (the memory that reading and parsing it takes) does not fit in
    the available memory. Sparse files count at their apparent size: that is what a
    reader allocates."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return 0  # the reader names the missing or unreadable file itself
    if size > max_bytes:
        raise BadInputError(f"{what} {shown_path(path)} is {format_bytes(size)}; edgekit reads at most "
                            f"{format_bytes(max_bytes)}")
    require_memory(size * expansion, f"reading {what} {shown_path(path)} ({format_bytes(size)})", share=0.5)
    return size
