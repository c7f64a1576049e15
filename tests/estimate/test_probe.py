"""Measuring this machine for the ``cpu`` target (estimate/probe.py): the real probe once, its cache,
the first ``cpu`` estimate probing by itself, the estimate scaling with the probe's figures,
named CPU targets on their datasheet figures, ranges that say on which CPU kinds they were
validated, and ``edgekit targets --probe``."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from edgekit.errors import CheckFailedError, UnavailableError
from edgekit.estimate import estimate
from edgekit.estimate import probe as probe_mod
from edgekit.estimate.efficiency import KERNEL_REACH, fitted_cpu_efficiency, roofs_for
from edgekit.estimate.probe import probe_machine, probed_target
from edgekit.estimate.uncertainty import estimate_range
from edgekit.targets import load_target
from edgekit.targets.host_probe import RATE_KEYS, HostProbe, load_probe, probe_key, probe_path

RATES = {"matmul:fp32": 0.075, "matmul-m16:fp32": 0.038, "conv:fp32": 0.083, "depthwise-conv:fp32": 0.027, "depthwise-conv-5x5:fp32": 0.03,
         "matmul:int8": 0.133, "conv:int8": 0.149, "depthwise-conv:int8": 0.014, "depthwise-conv-5x5:int8": 0.02}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))  # no probe cached: each test decides


def canned(**changes: object) -> HostProbe:
    fields = dict(key=probe_key(), cpu="Test CPU", arch="x86_64", isa=("avx2", "fma"), cores=2,
                  runtime="onnxruntime 1.31.1", threads=1, int8_kernel="avx2", int8_weights="7-bit",
                  kernel_rates=dict(RATES), kernels={k: f"kernel {k}" for k in RATES}, memory_bandwidth_gbs=12.5,
                  cache_bandwidth_gbs=60.0, cache_bytes=8 << 20, caches={"L1d": 32768, "L2": 524288}, kernel_overhead_us=0.8,
                  seconds=9.5, cpu_seconds=2.7, created="2026-11-27T10:00:00+00:00")
    fields.update(changes)
    return HostProbe(**fields)  # type: ignore[arg-type]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[HostProbe]:
    """measure_probe replaced by a canned probe; the list records each measurement."""
    calls: list[HostProbe] = []

    def measure(measure_s: float | None = None) -> HostProbe:
        calls.append(canned())
        return calls[-1]

    monkeypatch.setattr(probe_mod, "measure_probe", measure)
    return calls


def _conv_model(c: int = 32, hw: int = 28):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((c, c, 3, 3)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_the_real_probe_measures_sane_figures_and_is_cached() -> None:
    probed = probe_machine(measure_s=0.02)
    p = probed.probe
    assert probed.fresh and probed.path == probe_path() and probed.path.is_file()
    assert set(p.kernel_rates) == set(RATE_KEYS) and p.threads == 1 and p.key == probe_key()
    assert 0.1 < p.memory_bandwidth_gbs < 2000 and p.cache_bandwidth_gbs >= p.memory_bandwidth_gbs
    assert p.int8_tops >= 0.1 * p.fp32_tops and p.kernel_overhead_us > 0 and p.cpu_seconds > 0
    assert p.int8_weights == ("7-bit" if load_target("cpu").int8_kernel.saturates else "8-bit")
    again = probe_machine()
    assert not again.fresh and again.probe == p  # reused, not measured again
    assert load_target("cpu").probe == str(probed.path)


def test_first_cpu_estimate_probes_once_then_reuses(counted: list[HostProbe]) -> None:
    assert load_probe() is None
    est = estimate(_conv_model(), "cpu")
    assert len(counted) == 1 and load_probe() == counted[0]
    assert any("measured by its probe" in n and "one intra-op thread" in n for n in est.notes)
    assert est.peak_tops["fp32"] == 0.083 and est.memory_bandwidth_gbs == 12.5
    # a CPU engine copies nothing to a device: its timing is one run, not a GPU's kernels-alone time
    assert est.io_ms == 0 and est.gpu_compute_ms == est.end_to_end_ms == est.total_ms
    assert "timing: one session.run on this CPU" in est.render() and "GPU" not in est.render().splitlines()[2]
    assert estimate(_conv_model(), "jetson-agx-orin-64", "fp16").timing_text.startswith("GPU compute")
    estimate(_conv_model(), "cpu")
    assert len(counted) == 1
    probe_machine(refresh=True)  # --probe measures again
    assert len(counted) == 2
    estimate(_conv_model(), "cpu-avx2")  # a named target never probes
    assert len(counted) == 2


def test_estimate_scales_with_the_probed_kernel_rate(counted: list[HostProbe]) -> None:
    probe_machine()
    base = load_target("cpu")
    fast = dataclasses.replace(base, kernel_rates={**base.kernel_rates, "conv:fp32": 2 * base.kernel_rates["conv:fp32"]})
    slow_est, fast_est = estimate(_conv_model(), base), estimate(_conv_model(), fast)
    conv_slow = next(n for n in slow_est.nodes if n.name == "conv")
    conv_fast = next(n for n in fast_est.nodes if n.name == "conv")
    assert conv_slow.bound == "compute" and conv_fast.compute_ms == pytest.approx(conv_slow.compute_ms / 2)
    # compute = ops / (kernel rate x efficiency x shape factor)
    eff = roofs_for(base, calibrated=False).eff["conv"]
    assert conv_slow.compute_ms == pytest.approx(conv_slow.ops / (0.083e12 * conv_slow.efficiency) * 1e3)
    assert conv_slow.efficiency <= eff


def test_no_onnxruntime_keeps_the_generic_figures_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable(measure_s: float | None = None) -> HostProbe:
        raise UnavailableError("onnxruntime is not installed")

    monkeypatch.setattr(probe_mod, "measure_probe", unavailable)
    target, warning = probed_target(load_target("cpu"))
    assert target.probe is None and warning is not None and "could not be probed" in warning
    est = estimate(_conv_model(), "cpu")
    assert any("could not be probed (onnxruntime is not installed)" in w for w in est.warnings)
    assert est.peak_tops["fp32"] == 0.096  # cpu.yaml's stand-in: a generic AVX2 core


def test_an_impossible_measurement_is_an_error_and_nothing_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    from edgekit.estimate import ort_rates

    real = ort_rates.measure_kernel_rates

    def broken(seven_bit: bool, measure_s: float = 0.25) -> list[ort_rates.KernelRate]:
        return [dataclasses.replace(r, tops=r.tops * 1e6) for r in real(seven_bit, 0.01)]

    monkeypatch.setattr(ort_rates, "measure_kernel_rates", broken)
    with pytest.raises(CheckFailedError, match=r"the probe of this machine measured something impossible "
                                               r"\(kernel_rates.matmul:fp32: .* TOPS is outside the sane range"):
        probe_machine(measure_s=0.01)
    assert not probe_path().exists()


def test_named_cpu_targets_use_datasheet_peaks_and_the_shared_factors() -> None:
    t = load_target("cpu-avx2")
    roofs = roofs_for(t, calibrated=False)
    assert roofs.rates["matmul:fp32"] == pytest.approx(t.peak_tops["fp32"] * KERNEL_REACH["matmul:fp32"] * 1e12)
    assert roofs.rates["conv:int8"] == pytest.approx(t.peak_tops["int8"] * KERNEL_REACH["conv:int8"] * 1e12)
    fitted = fitted_cpu_efficiency()
    for name in ("cpu", "cpu-avx2", "cpu-amx", "cpu-cortex-a76"):  # one set of factors for every CPU kind
        assert {k: roofs_for(name, calibrated=False).eff[k] for k in fitted} == fitted
    assert roofs.rate("matmul", "int4") == roofs.rates["matmul:int8"]  # 4-bit weights in the int8 kernels
    assert roofs.rate("attention", "fp32") == roofs.peak("fp32")  # no kernel rate: the peak
    est = estimate(_conv_model(), "cpu-avx2")
    assert any("datasheet-derived figures" in n for n in est.notes)


VALIDATION = {"cpu": {"kind": "cpu", "basis": "held-out graphs", "cpu_kinds": {"avx2": "AMD EPYC (family 25 model 1)"},
                      "cases": [{"case": f"c{i}", "mix": "conv", "error": e, "cpu_kind": "avx2"}
                                for i, e in enumerate((-0.1, 0.05, 0.12))]}}


def test_depthwise_rate_is_a_cost_per_output_plus_one_per_tap() -> None:
    from edgekit.estimate.efficiency import Roofs

    # 3x3 at 18 G ops/s: 1 ns per output; 5x5 at 25 G: 2 ns per output -> 1/16 ns per tap, 7/16 ns per output
    roofs = Roofs("cpu", {"fp32": 0.1}, 10.0, 1.0, 20.0, 1.0, 1, {}, rates={"depthwise-conv:fp32": 18e9,
                                                                            "depthwise-conv-5x5:fp32": 25e9})
    assert roofs.rate("depthwise-conv", "fp32", 9) == pytest.approx(18e9)
    assert roofs.rate("depthwise-conv", "fp32", 25) == pytest.approx(25e9)
    assert roofs.rate("depthwise-conv", "fp32", 49) == pytest.approx(98 / (7 / 16 + 49 / 16) * 1e9)  # 7x7
    noisy = Roofs("cpu", {"fp32": 0.1}, 10.0, 1.0, 20.0, 1.0, 1, {}, rates={"depthwise-conv:fp32": 18e9,
                                                                            "depthwise-conv-5x5:fp32": 60e9})
    assert noisy.rate("depthwise-conv", "fp32", 25) == pytest.approx(50e9)  # no negative tap cost: per output
    assert noisy.rate("depthwise-conv", "bf16", 9) == pytest.approx(18e9)  # no bf16 peak: the fp32 rate


def test_the_range_says_on_which_cpu_kinds_it_was_validated() -> None:
    mine = estimate_range(1.0, "cpu", "cpu", "conv", VALIDATION, cpu_kind="avx2")
    assert mine.cases == 3 and "validated on CPU kind avx2 (AMD EPYC (family 25 model 1))" in mine.basis
    assert mine.low_ms == pytest.approx(1 / 1.15) and mine.high_ms == pytest.approx(1 / (1 - 0.15))
    other = estimate_range(1.0, "cpu", "cpu", "conv", VALIDATION, cpu_kind="amx")
    assert "not validated on CPU kind amx: errors measured on avx2 (AMD EPYC" in other.basis
    assert other.low_ms < mine.low_ms and other.high_ms > mine.high_ms  # widened as borrowed cases are
    named = estimate_range(1.0, "cpu-avx2", "cpu", "conv", VALIDATION, cpu_kind="avx2")
    assert "no validated cases for cpu-avx2" in named.basis and "validated on CPU kind avx2" in named.basis


def test_shipped_validation_names_its_cpu_kinds() -> None:
    from edgekit.estimate.uncertainty import load_validation

    entry = load_validation()["cpu"]
    assert entry["cases"] and all(c.get("cpu_kind") in entry["cpu_kinds"] for c in entry["cases"])


def test_cli_targets_probe(counted: list[HostProbe]) -> None:
    from edgekit.cli import cli

    r = CliRunner().invoke(cli, ["targets", "--probe"])
    assert r.exit_code == 0, r.output
    assert "kernel conv:int8" in r.output and "149.0 G ops/s" in r.output and "12.5 GB/s" in r.output
    r = CliRunner().invoke(cli, ["targets", "--probe", "--json"])
    doc = json.loads(r.output)
    assert r.exit_code == 0 and doc["kernel_rates"] == RATES and doc["path"] == str(probe_path())
    assert len(counted) == 2  # --probe always measures
    r = CliRunner().invoke(cli, ["targets", "--probe", "list"])
    assert r.exit_code == 2 and "--probe is an option of `edgekit targets` alone" in r.output
    r = CliRunner().invoke(cli, ["targets", "show", "cpu", "--json"])
    assert json.loads(r.output)["probe"] == str(probe_path())
