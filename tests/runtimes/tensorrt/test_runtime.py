"""TensorRT runtime: precision checks, the exact trtexec command line, build bundles, the engine
cache, the Python-API path against a FAKE ``tensorrt`` module, the trtexec path against a FAKE
``trtexec`` script, the device loop (bundle -> build.sh on a fake Orin -> results folder ->
profile, check, report, run).

Nothing here ran real TensorRT: it cannot be installed on these machines. The fake ``tensorrt``
module implements exactly the calls edgekit makes (and records them); the fake trtexec writes
the hand-written fixtures of tests/fixtures/trtexec, and the fake Orin's trtexec the real
exports of tests/fixtures/trtexec/real. Tests that need real TensorRT are marked ``tensorrt``
and skip without it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from edgekit.errors import BadInputError, CheckFailedError
from edgekit.runtimes import tensorrt as trtrt
from edgekit.runtimes.base import BuildOptions
from edgekit.runtimes.tensorrt import device as trtdev
from edgekit.runtimes.tensorrt.device import DeviceInfo
from edgekit.targets import load_target

FIX = Path(__file__).parents[2] / "fixtures" / "trtexec"
H100 = DeviceInfo(gpu="NVIDIA H100 80GB HBM3", sm="sm_90", tensorrt_version="10.3.0")
ORIN = DeviceInfo(gpu="Jetson AGX Orin", sm="sm_87", tensorrt_version="10.3.0")


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGEKIT_TRTEXEC", raising=False)
    return tmp_path / "cache"


def _onnx(path: Path, op: str = "Relu", qdq: bool = False, seq: bool = False) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits = [], [numpy_helper.from_array(np.ones((4, 4), np.float32), "w")]
    x = "input"
    if qdq:
        inits += [numpy_helper.from_array(np.array(0.1, np.float32), "s"), numpy_helper.from_array(np.array(0, np.int8), "z")]
        nodes += [helper.make_node("QuantizeLinear", [x, "s", "z"], ["q"], name="q0"),
                  helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="dq0")]
        x = "dq"
    custom = "" if onnx.defs.has(op) else "com.example"  # a plugin's op: valid ONNX in its own domain
    nodes += [helper.make_node("MatMul", [x, "w"], ["m"], name="mm"),
              helper.make_node(op, ["m"], ["out"], name="act", domain=custom)]
    dims = ["batch", "sequence", 4] if seq else ["batch", 4]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, dims)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]
                          + ([helper.make_opsetid(custom, 1)] if custom else []))
    m.ir_version = 8
    onnx.save_model(m, str(path))
    return path


def _cnn_onnx(path: Path) -> Path:
    """The small CNN the hand-written trtexec exports (fixtures/trtexec/int8_*.json) describe: their
    input (1x3x224x224) and the ONNX node and weight names their layer names carry."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.ones(s, np.float32), n) for n, s in
             (("conv1.weight", (8, 3, 3, 3)), ("conv2.weight", (8, 8, 3, 3)), ("conv3.weight", (8, 8, 3, 3)),
              ("fc.weight", (8, 10)))]
    nodes = [helper.make_node("Conv", ["input", "conv1.weight"], ["c1"], name="Conv_5", strides=[2, 2]),
             helper.make_node("Relu", ["c1"], ["r1"], name="Relu_6"),
             helper.make_node("Conv", ["r1", "conv2.weight"], ["c2"], name="Conv_11", strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"], name="Relu_12"),
             helper.make_node("Conv", ["r2", "conv3.weight"], ["c3"], name="Conv_15"),
             helper.make_node("GlobalAveragePool", ["c3"], ["p"], name="GlobalAveragePool_16"),
             helper.make_node("Flatten", ["p"], ["f"], name="Flatten_19"),
             helper.make_node("MatMul", ["f", "fc.weight"], ["logits"], name="MatMul_22")]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 224, 224])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save_model(m, str(path))
    return path


def onnx_of_engine(layers_json: Path, path: Path) -> Path:
    """An ONNX graph standing in for the one a real engine was built from (Engine Explorer's
    repository does not keep it): the engine's inputs, and one node per ONNX name its layer
    names carry, so the results' provenance (inputs, batch, layer names) can be checked."""
    import onnx
    from onnx import TensorProto, helper

    from edgekit.runtimes.tensorrt.provenance import layer_names, read_record

    rec = read_record({"layers": layers_json})
    names = list(dict.fromkeys(p for layer in rec.described for p in layer_names(layer, rec.onnx_names)))
    (first, dims), = rec.inputs.items()
    nodes, x = [], first
    for i, name in enumerate(names):  # element-wise nodes: something to estimate, nothing lint refuses
        nodes.append(helper.make_node("Relu", [x], [f"t{i}"], name=name))
        x = f"t{i}"
    graph = helper.make_graph(nodes, "engine", [helper.make_tensor_value_info(first, TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, dims)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save_model(m, str(path))
    return path


# --- build bundle (this machine: no GPU, no TensorRT) ------------------------------------------

def test_bundle_contents_and_profile_after_device_run(tmp_path, cache_env, monkeypatch):
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine
    from edgekit.profiling import ProfileConfig, profile_engine

    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    onnx_path = _cnn_onnx(tmp_path / "m.onnx")
    out = build_engine(onnx_path, "jetson-agx-orin-64", tmp_path / "bundle", BuildOptions("int8", extra={"dla_core": 0}))
    m = read_manifest(out)
    assert m.kind == "bundle" and m.config["path"] == "bundle" and m.target == "jetson-agx-orin-64"
    assert {"onnx", "script", "readme"} <= set(m.files)
    assert (out / m.files["onnx"]).is_file() and os.access(out / "build.sh", os.X_OK)
    argv = m.config["trtexec"]["argv"]
    assert argv[:4] == ["trtexec", f"--onnx={m.files['onnx']}", "--saveEngine=model.plan", "--int8"]
    assert "--useDLACore=0" in argv and "--allowGPUFallback" in argv
    script = (out / "build.sh").read_text()
    assert "\n  ".join(argv[1:]).replace("\n  ", " \\\n  ") in script.replace("'", "")
    readme = (out / "README.md").read_text()
    assert m.config["trtexec"]["command"] in readme and "no Q/DQ nodes" in readme
    with pytest.raises(BadInputError, match="is a build bundle without results: run its build.sh"):
        profile_engine(out, ProfileConfig())
    # "the device": run build.sh with a fake trtexec that writes the hand-written fixtures
    fake = _fake_trtexec(tmp_path)
    proc = subprocess.run(["bash", str(out / "build.sh")], env={**os.environ, "TRTEXEC": str(fake)},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "trtexec_argv.json").read_text()) == argv[1:]  # exactly the recorded command
    result = profile_engine(out, ProfileConfig(), out_json=tmp_path / "p.json")
    assert result.source == "device" and result.latency_ms.count == 60 and result.quantized_nodes == 3
    assert result.machine["measured_on"] == "device"
    from edgekit.check import check_budget

    assert check_budget(tmp_path / "p.json", 33.0, "p99", None).passed


def test_bundle_script_refuses_other_gpu(tmp_path, cache_env, monkeypatch):
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    onnx_path = _onnx(tmp_path / "m.onnx")
    out = tmp_path / "b"
    out.mkdir()
    trtrt.RUNTIME.build(onnx_path, load_target("jetson-orin-nx-16"), out, BuildOptions("fp16"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\ncase \"$*\" in *compute_cap*) echo 9.0;; *) echo H100;; esac\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", str(out / "build.sh")], capture_output=True, text=True,
                          env={**os.environ, "TRTEXEC": str(_fake_trtexec(tmp_path)),
                               "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 2 and "this GPU is sm_90 but the bundle is for jetson-orin-nx-16 (sm_87)" in proc.stderr


def _user_target(tmp_path: Path, **fields: str) -> Path:
    """A user's target file: the AGX Orin 64's with ``fields`` replaced."""
    import yaml

    data = yaml.safe_load((Path(trtrt.__file__).parents[2] / "targets" / "jetson-agx-orin-64.yaml").read_text())
    path = tmp_path / "my-orin.yaml"
    path.write_text(yaml.safe_dump({**data, "name": "my-orin", **fields}))
    return path


@pytest.mark.parametrize("field, value", [
    ("tensorrt_versions", '>=10.3,<10.4"; touch PWNED; "'),  # the first clause decided before: the rest went unread
    ("tensorrt_versions", ">=10.3$(touch PWNED)"),
    ("description", "Orin\ntouch PWNED"),  # a second line of build.sh's opening comment
])
def test_a_target_file_cannot_write_a_command_into_build_sh(tmp_path, field, value):
    with pytest.raises(BadInputError, match=f"{field}: .*(bad version range|must be one line)"):
        load_target(str(_user_target(tmp_path, **{field: value})))


def test_build_sh_runs_shell_characters_of_a_target_as_text(tmp_path, cache_env, monkeypatch):
    from edgekit.build import build_engine

    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    target = _user_target(tmp_path, description="Orin `touch PWNED` $(touch PWNED) ' \" ;|&")
    out = build_engine(_onnx(tmp_path / "m.onnx"), str(target), tmp_path / "b", BuildOptions("fp16"))
    proc = subprocess.run(["bash", str(out / "build.sh")], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "TRTEXEC": str(_fake_trtexec(tmp_path))})
    assert proc.returncode == 0, proc.stderr
    assert "(target expects TensorRT >=10.3,<10.4)" in proc.stdout
    assert not list(tmp_path.rglob("PWNED"))


# --- the trtexec path (fake trtexec) --------------------------------------------------------

FAKE_TRTEXEC = r'''#!{python}
"""A FAKE trtexec: records its argv, writes the hand-written fixtures where asked. Not TensorRT."""
import json, os, shutil, sys
fix = {fix!r}
args = sys.argv[1:]
if "--help" in args:
    print("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # trtexec --help")
    sys.exit(0)
opts = dict(a[2:].split("=", 1) for a in args if "=" in a)
if b"FancyCustomOp" in open(opts["onnx"], "rb").read():
    print("[E] [TRT] ModelImporter.cpp:949: While parsing node number 1 [FancyCustomOp -> out]:")
    print("[E] [TRT] No importer registered for op: FancyCustomOp. Attempting to import as plugin.")
    sys.exit(1)
json.dump(args, open("trtexec_argv.json", "w"))
with open(opts["saveEngine"], "wb") as f:
    f.write(b"FAKE-PLAN " + " ".join(args).encode())
tc = opts.get("timingCacheFile")
if tc:
    prev = open(tc, "rb").read() if os.path.exists(tc) else b""
    open(tc, "wb").write(prev + b"t")
for key, name in (("exportTimes", "int8_times.json"), ("exportProfile", "int8_profile.json"),
                  ("exportLayerInfo", "int8_layers.json")):
    if key in opts:
        os.makedirs(os.path.dirname(opts[key]) or ".", exist_ok=True)
        shutil.copy(os.path.join(fix, name), opts[key])
print("&&&& PASSED TensorRT.trtexec [TensorRT v100300]")
'''


def _fake_trtexec(tmp_path: Path) -> Path:
    path = tmp_path / "fake-bin" / "trtexec"
    path.parent.mkdir(exist_ok=True)
    path.write_text(FAKE_TRTEXEC.format(python=sys.executable, fix=str(FIX)))
    path.chmod(0o755)
    return path


def test_trtexec_path_builds_caches_and_reuses(tmp_path, cache_env, monkeypatch):
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine
    from edgekit.profiling import profile_engine

    fake = _fake_trtexec(tmp_path)
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo(**{**H100.to_dict(), "trtexec": trtexec}))
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    onnx_path = _cnn_onnx(tmp_path / "m.onnx")
    opts = BuildOptions("fp16", extra={"trtexec": str(fake)})
    out = build_engine(onnx_path, "h100-sxm", tmp_path / "e1", opts)
    m = read_manifest(out)
    assert m.kind == "engine" and m.config["path"] == "trtexec" and m.metrics["engine_cache"] == "miss"
    assert m.config["device"] == {"gpu": "NVIDIA H100 80GB HBM3", "sm": "sm_90", "tensorrt_version": "10.3.0"}
    assert (out / "model.plan").read_bytes().startswith(b"FAKE-PLAN")
    assert {"model", "trtexec_times", "trtexec_profile", "trtexec_layers"} <= set(m.files)
    timing_caches = list((cache_env / "tensorrt-engines" / "timing-caches").glob("*.cache"))
    assert len(timing_caches) == 1 and timing_caches[0].read_bytes() == b"t"  # saved
    # same settings: the cached engine is reused, trtexec does not run
    monkeypatch.setenv("PATH", "/nonexistent")
    out2 = build_engine(onnx_path, "h100-sxm", tmp_path / "e2", opts)
    assert read_manifest(out2).metrics["engine_cache"] == "hit"
    assert (out2 / "model.plan").read_bytes() == (out / "model.plan").read_bytes()
    # another precision: a different key, rebuilt (and the timing cache is reused: appended to)
    out3 = build_engine(onnx_path, "h100-sxm", tmp_path / "e3", BuildOptions("int8", extra={"trtexec": str(fake)}))
    assert read_manifest(out3).metrics["engine_cache"] == "miss"
    assert "--int8" in json.loads((out3 / "trtexec_argv.json").read_text())
    assert timing_caches[0].read_bytes() == b"tt"
    # profile reads trtexec's JSON, the same ProfileResult as every runtime
    r = profile_engine(out)
    assert r.source == "trtexec" and r.runtime == "tensorrt" and r.target == "h100-sxm"
    assert r.float_share == pytest.approx(1 - 0.19 / 0.38)
    # built and timed here: the probed GPU and TensorRT, the ONNX's input and layer names all match
    assert r.provenance is not None and r.provenance.status == "verified"
    assert [c["check"] for c in r.provenance.checks] == ["gpu", "tensorrt", "inputs", "batch", "layers"]


def test_trtexec_names_unsupported_op(tmp_path, cache_env, monkeypatch):
    fake = _fake_trtexec(tmp_path)
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo(**{**H100.to_dict(), "trtexec": trtexec}))
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    onnx_path = _onnx(tmp_path / "bad.onnx", op="FancyCustomOp")
    out = tmp_path / "o"
    out.mkdir()
    # the offline check refuses it before trtexec runs (exit 1: it would fail on the device) ...
    with pytest.raises(CheckFailedError, match=r"bad.onnx would fail on h100-sxm's TensorRT 10.3: "
                                               r"com.example::FancyCustomOp 'act': a com.example op, not standard "
                                               r"ONNX: TensorRT has no importer for it") as e:
        trtrt.RUNTIME.build(onnx_path, load_target("h100-sxm"), out, BuildOptions("fp16", extra={"trtexec": str(fake)}))
    assert e.value.exit_code == 1
    # ... and with the check off (a plugin the table cannot know), trtexec's parser error is named
    with pytest.raises(BadInputError, match="unsupported op 'FancyCustomOp'"):
        trtrt.RUNTIME.build(onnx_path, load_target("h100-sxm"), out,
                            BuildOptions("fp16", extra={"trtexec": str(fake), "check": False}))


def test_other_gpu_builds_bundle_and_engine_for_other_gpu_is_refused(tmp_path, cache_env, monkeypatch):
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine, load_engine

    fake = _fake_trtexec(tmp_path)
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    # an H100 here, an Orin target: no local engine (it would not run there) -> bundle
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo(**{**H100.to_dict(), "trtexec": trtexec}))
    onnx_path = _onnx(tmp_path / "m.onnx")
    b = build_engine(onnx_path, "jetson-agx-orin-64", tmp_path / "b", BuildOptions("fp16", extra={"trtexec": str(fake)}))
    assert read_manifest(b).kind == "bundle" and "needs sm_87" in read_manifest(b).config["path_reason"]
    # an engine built on an H100, loaded on an Orin: refused with a clear error
    e = build_engine(onnx_path, "h100-sxm", tmp_path / "e", BuildOptions("fp16", extra={"trtexec": str(fake)}))
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: ORIN)
    with pytest.raises(BadInputError, match=r"was built for GPU architecture sm_90 \(this machine: sm_87\)"):
        load_engine(e)


# --- the Python API path (fake tensorrt module) ---------------------------------------------

def make_fake_tensorrt(log: list, unsupported: frozenset = frozenset({"FancyCustomOp"}),
                       not_on_dla: frozenset = frozenset({"act"})) -> types.ModuleType:
    """A minimal FAKE of the TensorRT 10 Python API: exactly the calls edgekit makes."""
    import enum

    import onnx

    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.3.0.26"

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            log.append(("Logger", severity))

    class NetworkDefinitionCreationFlag(enum.IntEnum):
        STRONGLY_TYPED = 5

    class BuilderFlag(enum.IntEnum):
        FP16 = 0
        BF16 = 1
        INT8 = 2
        FP8 = 3
        TF32 = 4
        GPU_FALLBACK = 6

    class MemoryPoolType(enum.IntEnum):
        WORKSPACE = 0

    class ProfilingVerbosity(enum.IntEnum):
        DETAILED = 2

    class DeviceType(enum.IntEnum):
        GPU = 0
        DLA = 1

    class LayerInformationFormat(enum.IntEnum):
        JSON = 1

    class Layer:
        def __init__(self, name, op):
            self.name, self.op = name, op

    class Network:
        def __init__(self, flags):
            self.flags, self.layers = flags, []

        @property
        def num_layers(self):
            return len(self.layers)

        def get_layer(self, i):
            return self.layers[i]

    class ParserError:
        def __init__(self, node, op):
            self._node, self._op = node, op

        def desc(self):
            return f"No importer registered for op: {self._op}. Attempting to import as plugin."

        def node_name(self):
            return self._node

        def node_operator(self):
            return self._op

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.errors = network, []

        def parse_from_file(self, path):
            log.append(("parse_from_file", path))
            for n in onnx.load(path).graph.node:
                if n.op_type in unsupported:
                    self.errors.append(ParserError(n.name, n.op_type))
                self.network.layers.append(Layer(n.name, n.op_type))
            return not self.errors

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

    class TimingCache:
        def __init__(self, blob):
            self.blob = bytes(blob)

        def serialize(self):
            return self.blob + b"+"

    class BuilderConfig:
        def __init__(self):
            self.flags, self.cache = set(), None
            self.default_device_type, self.DLA_core = DeviceType.GPU, -1
            self.profiling_verbosity, self.builder_optimization_level = None, 3
            self.profiles = []

        def set_memory_pool_limit(self, pool, size):
            log.append(("set_memory_pool_limit", pool, size))

        def set_flag(self, flag):
            self.flags.add(flag)

        def clear_flag(self, flag):
            self.flags.discard(flag)

        def create_timing_cache(self, blob):
            log.append(("create_timing_cache", bytes(blob)))
            return TimingCache(blob)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

        def can_run_on_DLA(self, layer):
            return layer.name not in not_on_dla

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)
            return 0

    class OptimizationProfile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            log.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return BuilderConfig()

        def create_optimization_profile(self):
            return OptimizationProfile()

        def build_serialized_network(self, network, config):
            log.append(("build", sorted(f.name for f in config.flags), config.default_device_type, config.DLA_core,
                        [p.shapes for p in config.profiles], config.profiling_verbosity))
            return bytearray(b"FAKE-TRT-ENGINE")

    class Inspector:
        def get_engine_information(self, fmt):
            assert fmt == LayerInformationFormat.JSON
            return (FIX / "int8_layers.json").read_text()

    class Engine:
        def create_engine_inspector(self):
            return Inspector()

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, blob):
            return Engine() if bytes(blob) == b"FAKE-TRT-ENGINE" else None

    for obj in (Logger, NetworkDefinitionCreationFlag, BuilderFlag, MemoryPoolType, ProfilingVerbosity, DeviceType,
                LayerInformationFormat, OnnxParser, Builder, Runtime):
        setattr(trt, obj.__name__, obj)
    return trt


def test_python_api_path_with_fake_tensorrt(tmp_path, cache_env, monkeypatch):
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine

    log: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt(log))
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo(**{**ORIN.to_dict(), "tensorrt_version": "10.3.0.26"}))
    onnx_path = _onnx(tmp_path / "m.onnx")
    opts = BuildOptions("fp16", batch=1, extra={"dla_core": 0, "workspace_mb": 512, "max_batch": 4})
    out = build_engine(onnx_path, "jetson-agx-orin-64", tmp_path / "e", opts)
    m = read_manifest(out)
    assert m.kind == "engine" and m.config["path"] == "api" and (out / "model.plan").read_bytes() == b"FAKE-TRT-ENGINE"
    assert ("set_memory_pool_limit", 0, 512 << 20) in log
    assert ("create_network", 0) in log  # weakly typed: no Q/DQ in the graph
    build = next(e for e in log if e[0] == "build")
    assert build[1] == ["FP16", "GPU_FALLBACK"] and build[2].name == "DLA" and build[3] == 0
    assert build[4] == [{"input": ((1, 4), (1, 4), (4, 4))}] and build[5].name == "DETAILED"
    assert m.metrics["dla_fallback_layers"] == ["act"]
    assert json.loads((out / "results" / "trtexec_layers.json").read_text())["Layers"][0]["Name"] == "QuantizeLinear_0"
    tc = next((cache_env / "tensorrt-engines" / "timing-caches").glob("*.cache"))
    assert tc.read_bytes() == b"+"  # timing cache saved ...
    build_engine(onnx_path, "jetson-agx-orin-64", tmp_path / "e2", BuildOptions("int8", extra={"dla_core": 0}))
    assert [e[1] for e in log if e[0] == "create_timing_cache"] == [b"", b"+"]  # ... and reused


def test_python_api_strongly_typed_and_parser_error(tmp_path, cache_env, monkeypatch):
    log: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt(log))
    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: H100)
    out = tmp_path / "o"
    out.mkdir()
    trtrt.RUNTIME.build(_onnx(tmp_path / "q.onnx", qdq=True), load_target("h100-sxm"), out, BuildOptions("int8"))
    assert ("create_network", 1 << 5) in log  # STRONGLY_TYPED
    assert next(e for e in log if e[0] == "build")[1] == []  # no precision flags on a strongly typed network
    with pytest.raises(BadInputError, match=r"TensorRT's ONNX parser rejects bad.onnx: unsupported op 'FancyCustomOp' "
                                            r"\(FancyCustomOp node act: No importer registered"):
        trtrt.RUNTIME.build(_onnx(tmp_path / "bad.onnx", op="FancyCustomOp"), load_target("h100-sxm"), out,
                            BuildOptions("fp16", extra={"check": False}))


@pytest.mark.tensorrt
def test_real_tensorrt_builds_and_profiles(tmp_path, tiny_onnx, monkeypatch):
    """Only where real TensorRT and a GPU exist (never on the machines this was written on)."""
    pytest.importorskip("tensorrt")
    info = trtdev.probe_local()
    if not info.sm:
        pytest.skip("no NVIDIA GPU")
    from edgekit.build import build_engine
    from edgekit.profiling import ProfileConfig, profile_engine

    monkeypatch.setenv("EDGEKIT_CACHE", str(tmp_path / "cache"))
    targets = [t for t in ("h100-sxm", "h200", "a100-80", "l4", "jetson-agx-orin-64")
               if load_target(t).sm == info.sm]
    if not targets:
        pytest.skip(f"no built-in target has {info.sm}")
    out = build_engine(tiny_onnx, targets[0], tmp_path / "e", BuildOptions("fp16"))
    r = profile_engine(out, ProfileConfig(duration_s=0.5, iterations=20))
    assert r.latency_ms.p50 > 0 and r.nodes


# --- the device loop, on real trtexec exports ----------------------------------------------------
# A FAKE Orin: trtexec copies the real exports of NVIDIA's TensorRT Engine Explorer (ResNet-18 QAT on
# an A100, see fixtures/trtexec/README.md) where it is asked to write its JSON; nvpmodel,
# jetson_clocks, nvidia-smi and dpkg-query print what JetPack 6.2 prints. build.sh runs unchanged.

REAL_RESNET = FIX / "real" / "resnet-qat-a100" / "resnet-qat.onnx.engine"
# What trtexec on an AGX Orin prints as its device (the fake Orin's; the timings it writes are the A100's)
ORIN_LOG_DEVICE = {"Selected Device": "Orin", "Compute Capability": 8.7, "SMs": 16, "Device Global Memory": "62800 MiB"}

DEVICE_TRTEXEC = r'''#!{python}
"""A FAKE trtexec on a fake Orin: writes real trtexec exports where asked. Not TensorRT."""
import os, shutil, sys
real = {real!r}
args = sys.argv[1:]
if "--help" in args:
    print("&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # trtexec --help")
    sys.exit(0)
opts = dict(a[2:].split("=", 1) for a in args if "=" in a)
open(opts["saveEngine"], "wb").write(b"FAKE-PLAN")
for key, suffix in (("exportTimes", "timing"), ("exportProfile", "profile"), ("exportLayerInfo", "graph")):
    os.makedirs(os.path.dirname(opts[key]) or ".", exist_ok=True)
    shutil.copy(real + "." + suffix + ".json", opts[key])
sys.stdout.write(open(real + ".log").read())  # trtexec's log of that run, as its sections read
print("&&&& PASSED TensorRT.trtexec [TensorRT v100300]")
'''
DEVICE_TOOLS = {
    "nvpmodel": 'echo "NV Power Mode: MAXN"; echo 0',
    "jetson_clocks": 'echo "SOC family:tegra234  Machine:NVIDIA Jetson AGX Orin Developer Kit"\n'
                     'echo "cpu0: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 CurrentFreq=2201600"\n'
                     'echo "cpu1: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 CurrentFreq=2201600"\n'
                     'echo "GPU MinFreq={gpu_max} MaxFreq=1300500000 CurrentFreq={gpu_max}"\n'
                     'echo "EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=3199000000 FreqOverride=1"\n'
                     'echo "NV Power Mode: MAXN"',
    "nvidia-smi": 'case "$*" in *compute_cap*) echo 8.7;; *) echo Orin;; esac',
    "dpkg-query": 'case "$*" in *nvidia-jetpack*) printf 6.2+b77;; *tensorrt*) printf 10.3.0.30-1+cuda12.5;; *) exit 1;; esac',
}


def _fake_orin(tmp_path: Path, clocks_locked: bool = True) -> dict:
    bin_dir = tmp_path / "orin-bin"
    bin_dir.mkdir(exist_ok=True)
    from test_parsers import trtexec_log_from_metadata

    real = tmp_path / "real" / REAL_RESNET.name  # the exports, and the log their metadata describe
    real.parent.mkdir(exist_ok=True)
    for suffix in ("timing", "profile", "graph"):
        shutil.copy(f"{REAL_RESNET}.{suffix}.json", f"{real}.{suffix}.json")
    # the log of the fake Orin: its own device section and banner, the real run's options and summary
    Path(f"{real}.log").write_text(trtexec_log_from_metadata(Path(f"{REAL_RESNET}.build.metadata.json"),
                                                             Path(f"{REAL_RESNET}.profile.metadata.json"),
                                                             device=ORIN_LOG_DEVICE, banner="TensorRT v100300"))
    (bin_dir / "trtexec").write_text(DEVICE_TRTEXEC.format(python=sys.executable, real=str(real)))
    for name, body in DEVICE_TOOLS.items():
        body = body.replace("{gpu_max}", "1300500000" if clocks_locked else "306000000")
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "TRTEXEC": str(bin_dir / "trtexec")}


def test_device_loop_bundle_to_results_folder_to_check_and_report(tmp_path, cache_env, monkeypatch):
    from click.testing import CliRunner

    from edgekit.build import build_engine
    from edgekit.cli import cli
    from edgekit.profiling import profile_engine

    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    resnet = onnx_of_engine(Path(f"{REAL_RESNET}.graph.json"), tmp_path / "resnet18-qat.onnx")
    out = build_engine(resnet, "jetson-agx-orin-64", tmp_path / "bundle", BuildOptions("fp16"))
    proc = subprocess.run(["bash", str(out / "build.sh")], env=_fake_orin(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    results = out / "results"
    assert {"bundle_manifest.json", "device.txt", "machine.txt", "nvpmodel.txt", "jetson_clocks.txt", "trtexec.log",
            "trtexec_times.json", "trtexec_profile.json", "trtexec_layers.json"} <= {p.name for p in results.iterdir()}
    # the results folder alone (copied back without the bundle) is a device measurement
    alone = tmp_path / "copied-back"
    shutil.copytree(results, alone)
    r = profile_engine(alone)
    assert (r.source, r.runtime, r.target) == ("device", "tensorrt", "jetson-agx-orin-64")
    # what the results record matches what the bundle claims: the Orin's SM and TensorRT, the engine's input
    # (input.1 32x3x224x224), its batch and the ONNX names of its layers
    assert r.provenance is not None and r.provenance.status == "verified" and r.provenance.reasons == []
    checks = {c["check"]: c for c in r.provenance.checks}
    assert checks["gpu"]["recorded"] == "Orin (sm_87)" and checks["tensorrt"]["recorded"] == "10.3.0"
    assert checks["batch"]["recorded"] == "32" and checks["layers"]["recorded"] == "37 of 37 layers carry an ONNX name"
    assert r.machine["power_mode"] == "MAXN" and r.machine["power_mode_id"] == 0 and r.machine["clocks_locked"] is True
    assert r.machine["jetpack"] == "6.2+b77" and r.machine["tensorrt_version"] == "10.3.0" and r.machine["sm"] == "sm_87"
    assert r.machine["clocks"]["gpu"] == {"min_mhz": 1300.5, "max_mhz": 1300.5, "current_mhz": 1300.5}
    # the real ResNet-18 QAT export: the bundle's 200 ms warm-up drops 222 TensorRT 8 warm-up records
    assert r.latency_ms.count == 178 and r.latency_ms.p50 == pytest.approx(0.88269, abs=1e-6)
    assert (r.quantized_nodes, r.total_nodes) == (21, 37)
    assert [f["name"] for f in r.settings["precision_breakdown"]["fallbacks"]] == ["MaxPool_12", "GlobalAveragePool_246"]
    # trtexec's own summary (its log) sits beside edgekit's statistics of the same run
    log = r.settings["trtexec_log"]
    assert log["build_options"]["Precision"] == "FP32+FP16+INT8"
    assert log["performance_summary"]["GPU Compute Time"]["median"] == pytest.approx(r.latency_ms.p50, rel=0.001)
    # check, profile and report read it like any profile
    runner = CliRunner()
    res = runner.invoke(cli, ["profile", str(alone), "--json", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert ("measured on the device: Orin (sm_87), JetPack 6.2+b77, TensorRT 10.3.0, power mode MAXN, clocks locked"
            in res.output)
    assert runner.invoke(cli, ["check", str(alone), "--budget-ms", "1.0", "--require-verified"]).exit_code == 0
    miss = runner.invoke(cli, ["check", str(tmp_path / "p.json"), "--budget-ms", "0.5"])
    assert miss.exit_code == 1
    res = runner.invoke(cli, ["report", str(tmp_path / "p.json"), "--markdown", str(tmp_path / "r.md")])
    text = (tmp_path / "r.md").read_text()
    # per number, where it comes from: the device, with its provenance status
    assert res.exit_code == 0 and "(tensorrt, device (verified))" in text
    assert "/s | device (verified) |" in text and "Provenance: verified: gpu Orin (sm_87), tensorrt 10.3.0" in text
    assert "Measured on the device: Orin, JetPack 6.2+b77, TensorRT 10.3.0, power mode MAXN, clocks locked." in text
    # a report of a bundle that has not been run says that nothing was built
    fresh = build_engine(_onnx(tmp_path / "m2.onnx"), "jetson-agx-orin-64", tmp_path / "fresh", BuildOptions("fp16"))
    assert runner.invoke(cli, ["report", str(fresh), "--markdown", str(tmp_path / "f.md")]).exit_code == 0
    assert ("> .: wrote a TensorRT build bundle for jetson-agx-orin-64: TensorRT is not installed here, nothing was "
            "built; run build.sh on the device") in (tmp_path / "f.md").read_text()


def test_device_results_warn_when_clocks_are_not_locked(tmp_path, cache_env, monkeypatch):
    from edgekit.build import build_engine
    from edgekit.profiling import profile_engine

    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    resnet = onnx_of_engine(Path(f"{REAL_RESNET}.graph.json"), tmp_path / "resnet18-qat.onnx")
    out = build_engine(resnet, "jetson-agx-orin-64", tmp_path / "bundle", BuildOptions("fp16"))
    env = _fake_orin(tmp_path, clocks_locked=False)
    assert subprocess.run(["bash", str(out / "build.sh")], env=env, capture_output=True).returncode == 0
    r = profile_engine(out)  # the bundle folder itself: its results/ are found
    assert r.source == "device" and r.machine["clocks_locked"] is False
    assert r.warnings[0] == ("GPU clock 306.0 MHz is below its maximum 1300.5 MHz when the results were recorded: clocks "
                             "were not locked (`sudo jetson_clocks`), so latencies vary with DVFS")


def test_run_prefers_the_device_measurement_over_the_estimate(tmp_path, cache_env, monkeypatch):
    from edgekit.pipelines.recipe import parse_recipe
    from edgekit.pipelines.run import run_recipe, target_verdict

    monkeypatch.setattr(trtdev, "probe_local", lambda trtexec=None: DeviceInfo())
    monkeypatch.setattr(trtdev, "import_tensorrt", lambda: None)
    resnet = onnx_of_engine(Path(f"{REAL_RESNET}.graph.json"), tmp_path / "resnet18-qat.onnx")
    recipe = parse_recipe({"name": "orin", "target": "jetson-agx-orin-64", "budget_ms": 5, "seed": 0,
                           "stages": [{"name": "resnet", "model": str(resnet), "build": {"precision": "fp16"}}]})
    first = run_recipe(recipe, tmp_path / "run", progress=False)
    stage = first.stages[0]
    assert stage.source == "estimated" and "bundle" in stage.artifacts
    low, high = stage.range_ms  # the estimate carries its range, down to the target's summary
    assert low < stage.latency_ms < high
    summary = first.targets["jetson-agx-orin-64"]
    assert summary["method"] == "estimate (sum of stages)" and summary["range_ms"] == pytest.approx([low, high])
    assert f"range {low:.3f}-{high:.3f} ms" in target_verdict(summary)
    assert any(w.startswith("wrote a TensorRT build bundle for jetson-agx-orin-64: TensorRT is not installed here, "
                            "nothing was built; run build.sh on the device") for w in stage.warnings)
    bundle = Path(stage.artifacts["bundle"])
    assert subprocess.run(["bash", str(bundle / "build.sh")], env=_fake_orin(tmp_path), capture_output=True).returncode == 0
    second = run_recipe(recipe, tmp_path / "run", progress=False)
    stage = second.stages[0]
    assert stage.source == "device" and stage.estimated_ms == pytest.approx(first.stages[0].estimated_ms)
    assert stage.latency_ms == pytest.approx(0.884735, abs=1e-6)  # p99 of the device run (the recipe's percentile)
    assert stage.provenance == "verified"
    from edgekit.pipelines.results import stage_table

    assert stage_table(second)[0][-1] == "device (verified) (reused)"  # the bundle was reused, its results are new
    assert stage_table(first)[0][-1].startswith("estimated (")  # the first run's number was an estimate, with its range
    from edgekit.report import render_report

    html = render_report(tmp_path / "run").with_suffix(".html").read_text()
    # the stage's number is the device's; the nodes shown are those of the profile the run kept (the estimate's)
    assert "<td>device (verified) (reused)</td>" in html and "resnet alone (estimated)" in html
