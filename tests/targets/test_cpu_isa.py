"""A CPU's architecture and features (targets/cpu_isa.py): the integer kernel family its features
mean, the spellings of an architecture, and the cache sizes read from sysfs or lscpu."""
from __future__ import annotations

import pytest

from edgekit.errors import BadInputError
from edgekit.targets.cpu_isa import CACHE_LEVELS, FEATURES, cpu_caches, cpu_features, normalize_arch, size_bytes


def test_cpu_features_name_the_kernel_family():
    from edgekit.targets.cpu_isa import int8_kernel

    assert int8_kernel("x86_64", ("avx2", "fma")).saturates and int8_kernel("x86_64", ("avx2",)).name == "avx2"
    assert int8_kernel("x86_64", ("avx2", "avx512f", "avx512bw")).name == "avx512bw"  # AVX-512 without VNNI
    assert int8_kernel("x86_64", ("avx512bw", "avx512_vnni")).exact
    assert int8_kernel("x86_64", ("avx2", "avx_vnni")).name == "avx-vnni"  # Alder Lake's 256-bit VNNI
    assert int8_kernel("x86_64", ("avx512_vnni", "amx_int8")).name == "amx"
    assert int8_kernel("arm64", ("neon",)).exact and int8_kernel("arm64", ("neon", "dotprod", "i8mm")).name == "arm-i8mm"
    with pytest.raises(BadInputError, match=r"unknown CPU feature 'avx1024'"):
        from edgekit.targets import target_from_dict

        target_from_dict({"name": "x", "description": "d", "kind": "cpu", "runtimes": ["onnxruntime"],
                          "precisions": ["fp32"], "arch": "x86_64", "isa": ["avx2", "avx1024"]})


def test_architecture_spellings_and_cache_sizes():
    assert [normalize_arch(m) for m in ("AMD64", "x86_64", "aarch64", "arm64", "riscv64")] == \
        ["x86_64", "x86_64", "arm64", "arm64", "riscv64"]
    assert (size_bytes("512K"), size_bytes("1 MiB"), size_bytes("32 MB"), size_bytes("48")) == (512 << 10, 1 << 20, 32 << 20, 48)
    with pytest.raises(ValueError, match="not a cache size: '1 TB'"):
        size_bytes("1 TB")


def test_this_machine_is_read_as_known_names():
    arch, isa, _ = cpu_features()
    assert arch in ("x86_64", "arm64") or arch == normalize_arch(arch)
    assert all(f in FEATURES for f in isa)  # only the features edgekit knows, in FEATURES order
    assert list(isa) == [f for f in FEATURES if f in isa]
    caches = cpu_caches()
    assert set(caches) <= set(CACHE_LEVELS) and all(1 << 10 <= size <= 1 << 31 for size in caches.values())
