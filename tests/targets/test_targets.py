"""Targets as data: every built-in YAML loads, carries its published numbers with
their provenance, unknown targets/keys/precisions are clear
errors, a user's YAML works, and `edgekit targets` lists and shows them."""
from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from edgekit.errors import BadInputError
from edgekit.targets import list_targets, load_target, version_in_range

CPU_KINDS = {"cpu-avx2": ("x86_64", "avx2", True), "cpu-avx512-vnni": ("x86_64", "avx512-vnni", False),
             "cpu-amx": ("x86_64", "amx", False), "cpu-cortex-a78ae": ("arm64", "arm-dotprod", False),
             "cpu-neoverse-n1": ("arm64", "arm-dotprod", False), "cpu-cortex-a76": ("arm64", "arm-dotprod", False)}
EXPECTED = {"cpu", "jetson-agx-orin-64", "jetson-agx-orin-32", "jetson-orin-nx-16", "jetson-orin-nx-8",
            "jetson-orin-nano-8", "jetson-orin-nano-8-super", "h100-sxm", "h100-pcie", "h200", "a100-80", "l4",
            *CPU_KINDS}


def test_all_targets_load_with_provenance():
    assert set(list_targets()) == EXPECTED
    for name in EXPECTED:
        t = load_target(name)
        assert t.name == name and t.sources, name
        if t.kind == "cpu":
            continue
        assert t.sm and t.sm.startswith("sm_") and t.runtimes[0] == "tensorrt", name
        assert {"int8", "fp16"} <= set(t.peak_tops) and t.memory_bandwidth_gbs > 0 and t.memory_gb > 0, name
        assert "TensorrtExecutionProvider" in t.execution_providers, name
        for key in t.peak_tops:  # every peak says where it comes from
            assert any(k in (f"peak_tops.{key}", "peak_tops") for k in t.provenance), (name, key)
        assert all(v.startswith(("facts", "recalled", "derived")) for v in t.provenance.values()), name


@pytest.mark.parametrize("name", sorted(CPU_KINDS))
def test_named_cpu_targets_say_their_cpu_and_its_integer_kernels(name):
    arch, kernel, saturates = CPU_KINDS[name]
    t = load_target(name)
    assert (t.arch, t.int8_kernel.name, t.int8_kernel.saturates) == (arch, kernel, saturates)
    # figures are one core's (CPU estimates are for one thread); cores, where given, are the device's
    assert "per core" in t.description and {"fp32", "int8"} <= set(t.peak_tops)
    assert t.cores == {"cpu-cortex-a76": 4}.get(name)  # a Raspberry Pi 5's; the others name a class of CPUs
    assert t.peak_tops["int8"] >= t.peak_tops["fp32"] and t.memory_bandwidth_gbs > 0 and t.cache_mb > 0
    for key in t.peak_tops:  # every peak says where it comes from
        assert any(k in (f"peak_tops.{key}", "peak_tops") for k in t.provenance), (name, key)


def test_the_cpu_target_is_this_machine():
    from edgekit.targets.cpu_isa import cpu_features, host_int8_kernel

    t = load_target("cpu")
    arch, isa, _ = cpu_features()
    assert (t.arch, t.isa, t.is_this_machine) == (arch, isa, True)
    assert t.int8_kernel == host_int8_kernel()
    # a named target stands for this machine exactly when its integer kernels are this machine's
    for name in CPU_KINDS:
        named = load_target(name)
        assert named.is_this_machine == (named.arch == arch and named.int8_kernel.name == host_int8_kernel().name)
    assert not load_target("jetson-agx-orin-64").is_this_machine


@pytest.mark.parametrize("name,int8,fp16,bw,mem", [
    ("jetson-agx-orin-64", 85.0, 42.5, 204.8, 64), ("h100-sxm", 1979.0, 989.0, 3350.0, 80),
    ("h200", 1979.0, 989.0, 4800.0, 141), ("a100-80", 624.0, 312.0, 2000.0, 80), ("l4", 242.5, 121.0, 300.0, 24),
])
def test_numbers_from_facts(name, int8, fp16, bw, mem):
    t = load_target(name)
    assert (t.peak_tops["int8"], t.peak_tops["fp16"], t.memory_bandwidth_gbs, t.memory_gb) == (int8, fp16, bw, mem)


def test_jetson_specifics():
    agx = load_target("jetson-agx-orin-64")
    assert (agx.sm, agx.dla_cores, agx.dla_precisions, agx.jetpack) == ("sm_87", 2, ("int8", "fp16"), "6.2")
    assert agx.tensorrt_version_ok("10.3.0.30") and not agx.tensorrt_version_ok("8.6.2")
    nano, sup = load_target("jetson-orin-nano-8"), load_target("jetson-orin-nano-8-super")
    assert nano.dla_cores == sup.dla_cores == 0 and nano.sm == sup.sm
    assert (nano.memory_bandwidth_gbs, sup.memory_bandwidth_gbs) == (68.0, 102.0)
    assert sup.peak_tops["int8"] / nano.peak_tops["int8"] == pytest.approx(67 / 40)  # facts: 40 vs 67 TOPS sparse
    assert "fp8" not in agx.precisions and "fp8" in load_target("h100-sxm").precisions
    assert "fp8" not in load_target("a100-80").precisions and "fp8" in load_target("l4").precisions


def test_unknown_target_lists_known():
    with pytest.raises(BadInputError) as e:
        load_target("jetson-thor")
    msg = str(e.value)
    assert msg.startswith("unknown target 'jetson-thor' (choose from ") and "'jetson-agx-orin-64'" in msg and "'l4'" in msg


def test_user_yaml_and_bad_keys(tmp_path):
    data = {"name": "my-board", "description": "a custom Orin carrier", "kind": "jetson",
            "runtimes": ["tensorrt", "onnxruntime"], "precisions": ["fp16", "int8"], "sm": "sm_87",
            "peak_tops": {"int8": 40.0}, "dla_cores": 1, "tensorrt_versions": ">=10.3,<10.4"}
    p = tmp_path / "my-board.yaml"
    p.write_text(yaml.safe_dump(data))
    t = load_target(str(p))
    assert (t.name, t.dla_cores, t.path) == ("my-board", 1, str(p))
    p.write_text(yaml.safe_dump({**data, "peak_tflops": 1}))
    with pytest.raises(BadInputError, match=r"my-board.yaml' peak_tflops: unknown key \(known: .*did you mean 'peak_tops'\?\)"):
        load_target(str(p))
    with pytest.raises(BadInputError, match="does not exist"):
        load_target(str(tmp_path / "missing.yaml"))


def test_precisions():
    t = load_target("jetson-orin-nx-16")
    with pytest.raises(BadInputError, match=r"target 'jetson-orin-nx-16' does not support precision 'fp8' "
                                            r"\(choose from fp32, tf32, fp16, bf16, int8\)"):
        t.require_precision("fp8")
    t.require_precision("best")  # fp16 + int8 available
    with pytest.raises(BadInputError, match="does not support precision 'best'"):
        load_target("cpu").require_precision("best")  # no fp16 on the CPU target


@pytest.mark.parametrize("version,spec,ok", [
    ("10.3.0", ">=10.3,<10.4", True), ("10.4.0", ">=10.3,<10.4", False), ("8.6.2", ">=10.0", False),
    ("10.3.1.2", "==10.3", True), ("10.13", ">=10.0", True), ("10.3", None, True),
])
def test_version_in_range(version, spec, ok):
    assert version_in_range(version, spec) is ok


def test_cli_targets():
    from edgekit.cli import cli

    runner = CliRunner()
    r = runner.invoke(cli, ["targets"])
    assert r.exit_code == 0 and all(name in r.output for name in EXPECTED)
    r = runner.invoke(cli, ["targets", "show", "h200", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["memory_bandwidth_gbs"] == 4800.0
    r = runner.invoke(cli, ["targets", "show", "jetson-agx-orin-64"])
    assert r.exit_code == 0 and "facts: ~85 TOPS GPU dense" in r.output
    r = runner.invoke(cli, ["targets", "show", "nope"])
    assert r.exit_code == 2 and "unknown target 'nope'" in r.output
