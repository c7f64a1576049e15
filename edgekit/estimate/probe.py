"""Measure this machine for the ``cpu`` target's estimate: ``edgekit targets --probe``, and the
first ``edgekit estimate --target cpu`` on a machine without a cached probe.

In a few seconds of CPU time (under 20 s of wall time on an idle machine) the probe measures, at
one thread:

* the rates of the kernels ONNX Runtime runs here (``estimate.ort_rates``): fp32 GEMM, 3x3 and
  depthwise convolution; INT8 GEMM (``MatMulIntegerToFloat``) and convolution (``QLinearConv``,
  also depthwise) in the forms the int8 step emits, with 7-bit weights where this CPU's int8
  kernels saturate;
* read bandwidth from memory (a 256 MiB buffer), and how much of its caches one thread reads
  fast (buffers from half the L2 up to the L3: the largest read at 1.5x the memory bandwidth or
  more, and its speed: the estimator's cache roof);
* the cache sizes (sysfs, else ``lscpu``);
* the runtime's time per node that does (almost) no work.

The result is cached per machine (``targets.host_probe``: CPU model and numbers, kernel
features, core count, ONNX Runtime version) and reused; ``probe_machine(refresh=True)``
(``--probe``) measures again. ``load_target("cpu")`` then carries these figures, and the
estimator's efficiency factors, fitted relative to kernel rates, apply to them unchanged.

>>> probed = probe_machine()  # doctest: +SKIP
>>> probed.probe.kernel_rates["matmul:fp32"]  # doctest: +SKIP
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.artifact import atomic_write_json, file_lock, now_iso
from edgekit.errors import CheckFailedError, UnavailableError
from edgekit.estimate import ort_rates
from edgekit.schema import FieldError
from edgekit.targets import HOST_TARGET, TARGETS_DIR, Target, apply_probe
from edgekit.targets.cpu_isa import cpu_caches, cpu_features, int8_kernel
from edgekit.targets.host_probe import HostProbe, load_probe, probe_key, probe_path, runtime_version

MEMORY_BYTES = 256 << 20  # far beyond any L3 a single thread sees
READ_REPEATS = 5


@dataclass(frozen=True)
class Probed:
    probe: HostProbe
    path: Path
    fresh: bool  # measured now (False: read from the cache)


def read_bandwidth_gbs(nbytes: int = MEMORY_BYTES, repeats: int = READ_REPEATS) -> float:
    """One thread reading ``nbytes``: the best of numpy's sum and max reductions over float32
    (both stream at memory speed in one thread), median of ``repeats`` runs each, GB/s."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    best = 0.0
    for reduce in (np.add.reduce, np.maximum.reduce):
        reduce(a)  # pages touched, code warm
        times = []
        for _ in range(repeats):
            t0 = time.process_time()
            reduce(a)
            times.append(time.process_time() - t0)
        best = max(best, a.nbytes / max(statistics.median(times), 1e-9) / 1e9)
    return best


def read_curve(sizes: tuple[int, ...], seconds: float = 0.03) -> dict[int, float]:
    """One thread reading buffers of ``sizes`` bytes again and again: GB/s per size (numpy's max
    reduction, the best of 3 rounds of ``seconds`` each)."""
    out = {}
    for size in sizes:
        a = np.ones(max(size // 4, 16), dtype=np.float32)
        np.maximum.reduce(a)
        best = 0.0
        for _ in range(3):
            n, t0 = 0, time.process_time()
            while n < 3 or time.process_time() - t0 < seconds:
                np.maximum.reduce(a)
                n += 1
            best = max(best, n * a.nbytes / max(time.process_time() - t0, 1e-9) / 1e9)
        out[size] = best
    return out


def cache_roof(caches: dict[str, int], memory_gbs: float) -> tuple[int, float]:
    """(bytes, GB/s) of the cache roof the estimator uses: the largest buffer, up to the last-level
    cache, that one thread still reads at 1.5x the memory bandwidth or more (what this thread gets
    of a shared L3 on a busy machine, measured rather than assumed), and the median speed up to it."""
    l2 = caches.get("L2", 512 << 10)
    top = max(caches.get("L3", 0), l2)
    sizes = tuple(sorted({l2 // 2, *(1 << p for p in range(19, 31) if l2 // 2 < 1 << p <= top)}))
    curve = read_curve(sizes)
    fast = [size for size in sizes if curve[size] >= 1.5 * memory_gbs]
    if not fast:
        return l2 // 2, curve[sizes[0]]
    return max(fast), statistics.median(curve[size] for size in fast)


def measure_probe(measure_s: float | None = None) -> HostProbe:
    """Measure this machine now (``targets.host_probe.HostProbe``); a figure beyond its sanity
    bound is a ``CheckFailedError`` naming it."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    arch, isa, model = cpu_features()
    kernel = int8_kernel(arch, isa)
    rates = ort_rates.measure_kernel_rates(seven_bit=kernel.saturates,
                                           measure_s=ort_rates.MEASURE_S if measure_s is None else measure_s)
    overhead = ort_rates.node_overhead_us()
    caches = cpu_caches()
    memory = read_bandwidth_gbs()
    cache_bytes, cache = cache_roof(caches, memory)
    try:
        probe = HostProbe(
            key=probe_key(), cpu=model or arch, arch=arch, isa=isa, cores=os.cpu_count() or 1,
            runtime=f"onnxruntime {runtime_version()}", threads=1, int8_kernel=kernel.name,
            int8_weights="7-bit" if kernel.saturates else "8-bit",
            kernel_rates={r.key: round(r.tops, 6) for r in rates}, kernels={r.key: r.kernel for r in rates},
            memory_bandwidth_gbs=round(memory, 3), cache_bandwidth_gbs=round(max(cache, memory), 3),
            cache_bytes=int(cache_bytes), caches=dict(caches), kernel_overhead_us=round(overhead, 4),
            seconds=round(time.perf_counter() - wall0, 2), cpu_seconds=round(time.process_time() - cpu0, 2),
            created=now_iso())
    except FieldError as e:
        raise CheckFailedError(f"the probe of this machine measured something impossible ({e}); nothing was "
                               "cached: run `edgekit targets --probe` again on a less busy machine") from None
    if probe.int8_tops < 0.1 * probe.fp32_tops:  # no int8 kernel family is that slow against its own fp32
        raise CheckFailedError(f"the probe of this machine measured int8 kernels at {probe.int8_tops * 1e3:.1f} G ops/s, "
                               f"under a tenth of fp32's {probe.fp32_tops * 1e3:.1f}: not a figure to estimate from; "
                               "nothing was cached: run `edgekit targets --probe` again")
    return probe


def probe_machine(refresh: bool = False, measure_s: float | None = None) -> Probed:
    """This machine's probe: the cached one, or measured now (and cached) where there is none
    or ``refresh`` asks. Two processes that both find none measure once, one after the other."""
    path = probe_path()
    if not refresh:
        cached = load_probe()
        if cached is not None:
            return Probed(cached, path, False)
    with file_lock(path.with_name(path.name + ".lock")):
        if not refresh:
            cached = load_probe()  # another process may have measured it meanwhile
            if cached is not None:
                return Probed(cached, path, False)
        probe = measure_probe(measure_s)
        atomic_write_json(path, probe.to_dict())
    return Probed(probe, path, True)


def is_host_target(target: Target) -> bool:
    """The built-in ``cpu`` target (this machine), not a user's YAML that happens to be named so."""
    return (target.kind == "cpu" and target.name == HOST_TARGET and target.path is not None
            and Path(target.path).resolve().parent == Path(TARGETS_DIR).resolve())


def probed_target(target: Target) -> tuple[Target, str | None]:
    """``target`` with this machine's measured figures where it is the built-in ``cpu`` target and
    carries none yet (probing now if nothing is cached): (target, a warning where the machine could
    not be probed and the YAML's generic figures stand)."""
    if not is_host_target(target) or target.probe is not None:
        return target, None
    try:
        probed = probe_machine()
    except UnavailableError as e:
        return target, (f"this machine could not be probed ({e}): the cpu target's generic figures "
                        "(an AVX2 core, edgekit/targets/cpu.yaml) stand in for it")
    return apply_probe(target, probed.probe, str(probed.path)), None


def describe(probed: Probed) -> list[tuple[str, str]]:
    """The probe as (figure, value) rows for people."""
    p = probed.probe
    rows = [("cpu", f"{p.cpu} ({p.arch}, {p.cores} cores; int8 kernels {p.int8_kernel})"),
            ("runtime", f"{p.runtime}, {p.threads} thread")]
    for key, tops in p.kernel_rates.items():
        rows.append((f"kernel {key}", f"{tops * 1e3:.1f} G ops/s: {p.kernels.get(key, '')}"))
    rows += [("memory read", f"{p.memory_bandwidth_gbs:.1f} GB/s (one thread, 256 MiB)"),
             ("cache read", f"{p.cache_bandwidth_gbs:.1f} GB/s up to {_size(p.cache_bytes)} (one thread: the "
                            "estimator's cache roof)"),
             ("caches", ", ".join(f"{k} {_size(v)}" for k, v in p.caches.items()) or "unknown"),
             ("per-node overhead", f"{p.kernel_overhead_us:.2f} us"),
             ("measured", f"{p.created} in {p.seconds:.1f} s ({p.cpu_seconds:.1f} s CPU)"
              + ("" if probed.fresh else ", cached")),
             ("cache file", str(probed.path))]
    return rows


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"
