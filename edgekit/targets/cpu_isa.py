"""What a CPU's instruction set means for the integer kernels that run on it.

The INT8 GEMM and convolution kernels of ONNX Runtime (MLAS) and OpenVINO (oneDNN) on x86
multiply uint8 activations by int8 weights. With VNNI (``vpdpbusd``) or AMX the products are
summed in int32: exact. Without VNNI (AVX2, or AVX-512 without VNNI) they use ``vpmaddubsw``,
which adds each *pair* of u8 x s8 products into a saturating int16: two products of 255 x 127
(64,770) overflow it, so a graph whose weights use the whole int8 range computes something
else on such a CPU (measured here: 56.6% top-1 agreement instead of 90.6% on EfficientNet-Lite0).
The numerical model of that kernel is ``edgekit.onnx_int8_kernels``. Arm64 kernels
(``sdot``/``udot``, ``smmla``, or widening NEON multiplies) accumulate in 32 bits: exact.

``cpu_features`` reads this machine (x86 flags from ``/proc/cpuinfo``; arm64 features from
its ``Features`` line, named as the Arm architecture names them); ``int8_kernel`` names the
integer kernel family a CPU runs and whether it saturates; ``cpu_caches`` the sizes of one
core's caches (sysfs, else ``lscpu``).

>>> int8_kernel("x86_64", ("avx2", "fma")).saturates
True
>>> int8_kernel("x86_64", ("avx2", "avx512f", "avx512_vnni")).name
'avx512-vnni'
"""
from __future__ import annotations

import functools
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

ARCHS = ("x86_64", "arm64")
# x86 flags as /proc/cpuinfo spells them: the ones that decide float, int8 and bf16 kernels.
X86_FEATURES = ("sse4_1", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
# arm64: /proc/cpuinfo's feature name -> the architecture's name (what target files use).
ARM_FEATURES = {"asimd": "neon", "asimddp": "dotprod", "i8mm": "i8mm", "sve": "sve", "sve2": "sve2", "bf16": "bf16",
                "asimdhp": "fp16"}
FEATURES = (*X86_FEATURES, *dict.fromkeys(ARM_FEATURES.values()))


@dataclass(frozen=True)
class Int8Kernel:
    """The integer kernel family a CPU runs for u8 x s8 GEMMs and convolutions."""

    name: str  # "amx", "avx512-vnni", "avx-vnni", "avx512bw", "avx2", "sse4.1", "arm-i8mm", "arm-dotprod", "arm-neon"
    saturates: bool  # pairs of u8 x s8 products summed in a saturating int16 (x86 without VNNI)
    description: str

    @property
    def exact(self) -> bool:
        return not self.saturates


def int8_kernel(arch: str | None, isa: tuple[str, ...] | list[str]) -> Int8Kernel:
    """The int8 kernel family of a CPU from its architecture and features (``FEATURES`` names)."""
    have = set(isa)
    if arch == "arm64":
        if "i8mm" in have:
            return Int8Kernel("arm-i8mm", False, "Arm int8 matrix multiply (smmla/ummla), int32 sums")
        if "dotprod" in have:
            return Int8Kernel("arm-dotprod", False, "Arm dot product (sdot/udot), int32 sums")
        return Int8Kernel("arm-neon", False, "Arm NEON widening multiplies, int32 sums")
    if "amx_int8" in have:
        return Int8Kernel("amx", False, "AMX tiles, int32 sums")
    if "avx512_vnni" in have:
        return Int8Kernel("avx512-vnni", False, "AVX-512 VNNI vpdpbusd, int32 sums")
    if "avx_vnni" in have:
        return Int8Kernel("avx-vnni", False, "AVX-VNNI vpdpbusd, int32 sums")
    pairs = "u8 x s8 product pairs summed in saturating int16 (vpmaddubsw)"
    if "avx512bw" in have:
        return Int8Kernel("avx512bw", True, f"AVX-512BW without VNNI: {pairs}")
    if "avx2" in have:
        return Int8Kernel("avx2", True, f"AVX2 without VNNI: {pairs}")
    return Int8Kernel("sse4.1", True, f"SSE4.1: {pairs}")


def normalize_arch(machine: str) -> str:
    """``platform.machine()`` spellings -> ``ARCHS`` (aarch64 and arm64 are one)."""
    m = machine.lower()
    if m in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if m in ("aarch64", "arm64", "armv8", "armv8l"):
        return "arm64"
    return m


@functools.cache
def cpu_features() -> tuple[str, tuple[str, ...], str]:
    """(architecture, features in ``FEATURES`` order, model name) of this machine; features are
    empty where /proc/cpuinfo cannot be read."""
    arch = normalize_arch(platform.machine())
    flags: set[str] = set()
    model = ""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = set(value.split())
        elif key in ("model name", "cpu model") and not model:
            model = value.strip()
    if arch == "arm64":
        found = {ARM_FEATURES[f] for f in flags if f in ARM_FEATURES}
    else:
        found = {f for f in flags if f in X86_FEATURES}
    return arch, tuple(f for f in FEATURES if f in found), model


def host_int8_kernel() -> Int8Kernel:
    arch, isa, _ = cpu_features()
    return int8_kernel(arch, isa)


CACHE_LEVELS = ("L1d", "L2", "L3")


@functools.cache
def cpu_caches() -> dict[str, int]:
    """Bytes of each data cache level one core uses (``CACHE_LEVELS``; a level shared by several
    cores counts whole), from ``/sys/devices/system/cpu/cpu0/cache``, else ``lscpu``'s per-instance
    sizes; empty where neither says."""
    found: dict[str, int] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        name = "L1d" if level == "1" and kind == "Data" else f"L{level}" if kind == "Unified" else ""
        if name in CACHE_LEVELS and size:
            found[name] = size
    if found:
        return found
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    for line in text.splitlines():  # "L2 cache:  1 MiB (2 instances)"
        m = re.match(r"\s*(L1d|L2|L3) cache:\s*([\d.]+\s*[KMG]i?B)(?:\s*\((\d+) instances?\))?", line)
        if m:
            try:
                found[m.group(1)] = size_bytes(m.group(2)) // max(int(m.group(3) or 1), 1)
            except ValueError:
                continue
    return found


def size_bytes(text: str) -> int:
    """"512K" (sysfs), "1 MiB" or "32 MB" (lscpu) -> bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMG]?)(?:i?B)?\s*", text)
    if not m:
        raise ValueError(f"not a cache size: {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)])
