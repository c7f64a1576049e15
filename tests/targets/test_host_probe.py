"""This machine's probe as data (targets/host_probe.py): the record's sanity bounds, the cache key
and file, and the ``cpu`` target taking its figures from a cached probe (a user's YAML does not)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from edgekit.errors import BadInputError
from edgekit.targets import apply_probe, load_target
from edgekit.targets.cpu_isa import cpu_caches, size_bytes
from edgekit.targets.host_probe import RATE_KEYS, HostProbe, load_probe, probe_key, probe_path

RATES = {"matmul:fp32": 0.075, "matmul-m16:fp32": 0.038, "conv:fp32": 0.083, "depthwise-conv:fp32": 0.027, "depthwise-conv-5x5:fp32": 0.03,
         "matmul:int8": 0.133, "conv:int8": 0.149, "depthwise-conv:int8": 0.014, "depthwise-conv-5x5:int8": 0.02}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))


def make_probe(**changes: object) -> HostProbe:
    fields = dict(key=probe_key(), cpu="Test CPU", arch="x86_64", isa=("avx2", "fma"), cores=2,
                  runtime="onnxruntime 1.31.1", threads=1, int8_kernel="avx2", int8_weights="7-bit",
                  kernel_rates=dict(RATES), kernels={k: f"kernel {k}" for k in RATES}, memory_bandwidth_gbs=12.5,
                  cache_bandwidth_gbs=60.0, cache_bytes=8 << 20, caches={"L1d": 32768, "L2": 524288, "L3": 33554432},
                  kernel_overhead_us=0.8, seconds=9.5, cpu_seconds=2.7, created="2026-11-27T10:00:00+00:00")
    fields.update(changes)
    return HostProbe(**fields)  # type: ignore[arg-type]


def write(probe: HostProbe) -> Path:
    path = probe_path(probe.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(probe.to_dict()))
    return path


def test_the_record_refuses_figures_beyond_their_sanity_bounds() -> None:
    assert make_probe().fp32_tops == 0.083 and make_probe().int8_tops == 0.149
    with pytest.raises(BadInputError, match=r"kernel_rates.matmul:fp32: 1000000.0 TOPS is outside the sane range 0.0001-50 TOPS"):
        make_probe(kernel_rates={**RATES, "matmul:fp32": 1e6})
    with pytest.raises(BadInputError, match=r"kernel_rates.gemv:fp32: unknown kernel \(known: matmul:fp32"):
        make_probe(kernel_rates={"gemv:fp32": 0.1})
    with pytest.raises(BadInputError, match=r"memory_bandwidth_gbs: must be a finite number, got nan"):
        make_probe(memory_bandwidth_gbs=float("nan"))
    with pytest.raises(BadInputError, match=r"memory_bandwidth_gbs: 5000.0 GB/s is outside the sane range 0.1-2000"):
        make_probe(memory_bandwidth_gbs=5000.0)
    assert set(RATE_KEYS) == set(RATES)


def test_a_cached_probe_is_this_machines_only() -> None:
    assert load_probe() is None  # nothing cached yet
    probe = make_probe()
    path = write(probe)
    assert path.name == f"cpu-{probe_key()}.json" and load_probe() == probe
    write(make_probe(key="another-machine"))  # another key's file is never read as this machine's
    path.write_text(json.dumps({**probe.to_dict(), "key": "another-machine"}))
    assert load_probe() is None
    path.write_text(json.dumps({**probe.to_dict(), "memory_bandwidth_gbs": -1}))  # broken: measured again later
    assert load_probe() is None
    path.write_text("{not json")
    assert load_probe() is None


def test_the_cpu_target_carries_the_cached_probe(tmp_path: Path) -> None:
    plain = load_target("cpu")
    assert plain.probe is None and plain.kernel_rates == {}
    assert plain.provenance["peak_tops.fp32"].startswith("assumed (until probed)")
    path = write(make_probe())
    t = load_target("cpu")
    assert t.probe == str(path) and t.kernel_rates == RATES
    assert t.peak_tops == {"fp32": 0.083, "int8": 0.149, "int4": 0.149, "bf16": 0.083}  # no bf16 instructions
    assert (t.memory_bandwidth_gbs, t.cache_bandwidth_gbs, t.kernel_overhead_us) == (12.5, 60.0, 0.8)
    assert t.cache_mb == pytest.approx(8.3886, abs=1e-4)  # the cache roof the probe found, in MB
    assert t.provenance["peak_tops.fp32"].startswith("measured: `edgekit targets --probe` 2026-11-27")
    assert "7-bit weights" in t.provenance["peak_tops.int8"] and "measured on this machine" in t.sources[0]
    assert t.cores is not None and t.arch is not None  # still detected
    # a CPU with bf16 instructions runs bf16 at twice the fp32 rate
    bf16 = apply_probe(plain, make_probe(isa=("avx2", "avx512_bf16")))
    assert bf16.peak_tops["bf16"] == pytest.approx(0.166)
    # a user's YAML named "cpu" is detected but keeps its own figures
    mine = tmp_path / "cpu.yaml"
    mine.write_text("name: cpu\ndescription: my box\nkind: cpu\nruntimes: [onnxruntime]\nprecisions: [fp32]\n"
                    "peak_tops: {fp32: 1.0}\n")
    user = load_target(str(mine))
    assert user.probe is None and user.peak_tops == {"fp32": 1.0} and user.arch is not None


def test_kernel_rates_in_a_target_file_are_checked(tmp_path: Path) -> None:
    p = tmp_path / "board.yaml"
    base = "name: board\ndescription: d\nkind: cpu\nruntimes: [onnxruntime]\nprecisions: [fp32]\n"
    p.write_text(base + "kernel_rates: {matmul:fp32: 0.1}\n")
    assert load_target(str(p)).kernel_rates == {"matmul:fp32": 0.1}
    p.write_text(base + "kernel_rates: {gemm:fp32: 0.1}\n")
    with pytest.raises(BadInputError, match=r"kernel_rates.gemm:fp32: unknown kernel \(choose from matmul:fp32"):
        load_target(str(p))
    p.write_text(base + "kernel_rates: {conv:int8: 0}\n")
    with pytest.raises(BadInputError, match=r"kernel_rates.conv:int8: must be > 0 TOPS, got 0"):
        load_target(str(p))


def test_cache_sizes_of_this_machine_and_their_spellings() -> None:
    caches = cpu_caches()
    if Path("/sys/devices/system/cpu/cpu0/cache").is_dir():
        assert caches.get("L2", 0) >= 64 << 10 and caches.get("L1d", 0) >= 8 << 10
    assert size_bytes("512K") == 512 << 10 and size_bytes("1 MiB") == 1 << 20 and size_bytes("32 MB") == 32 << 20
    with pytest.raises(ValueError, match="not a cache size"):
        size_bytes("big")
    assert dataclasses.is_dataclass(make_probe())
