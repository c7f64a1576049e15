"""INT8 PTQ/QAT (issue 3): calibration math, the fake-quant graph, QDQ export and ONNX
Runtime fusion, parity, fallback, QAT, external ONNX, bad input. Tiny models only,
except the few real-model smoke tests marked slow."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edgekit.compress import StepContext, compress, load_compressed
from edgekit.compress.int8 import pairs
from edgekit.compress.int8.calibration import BINS, HistogramObserver, choose_range, qparams
from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.step import apply, resolve_scheme
from edgekit.errors import BadInputError
from edgekit.sources.data import Samples
from edgekit.sources.handle import InputSpec, ModelHandle

# ----------------------------------------------------------------------------- helpers


def _images(n: int, shape: tuple[int, ...], seed: int) -> Samples:
    rng = np.random.default_rng(seed)
    # smooth, image-like inputs (a random field blurred by a box filter) rather than white noise
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    x = (x + np.roll(x, 1, -1) + np.roll(x, 1, -2) + np.roll(x, (1, 1), (-1, -2))) / 2
    return Samples("synthetic", "calib", {"input": x.astype(np.float32)})


class _Residual(nn.Module):
    """conv -> relu -> conv, plus the input: a residual add like EfficientNet's blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.a = nn.Conv2d(8, 16, 1)
        self.b = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.stem(x)))
        y = self.b(torch.relu(self.a(x)))
        x = x + y
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _residual_handle() -> ModelHandle:
    torch.manual_seed(0)
    m = _Residual().eval()
    with torch.no_grad():  # non-trivial batch-norm statistics
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return ModelHandle(name="tiny-residual", source="tests:residual", kind="image-classifier", module=m,
                       inputs=[InputSpec("input", ("batch", 3, 16, 16), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def _ctx(shape: tuple[int, ...], **kw) -> StepContext:
    return StepContext(calib=_images(32, shape, 1), eval=_images(32, shape, 2), progress=False, **kw)


def _export(handle: ModelHandle, out: Path) -> Path:
    from edgekit.export.onnx import ExportConfig, export_onnx

    # INT8 parity is checked by the tests below with explicit tolerances
    export_onnx(handle, out, ExportConfig(skip_parity=True))
    return out / "model.onnx"


def _ort(path: Path, x: np.ndarray, optimized: bool = True) -> tuple[np.ndarray, list[str]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimized
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opt_path = str(path) + (".opt.onnx" if optimized else ".raw.onnx")
    so.optimized_model_filepath = opt_path
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    y = sess.run(None, {sess.get_inputs()[0].name: x})[0]
    import onnx

    ops = [n.op_type for n in onnx.load(opt_path).graph.node]
    return y, ops


# ----------------------------------------------------------------------------- calibration math


def test_observer_streams_in_bounded_memory_and_keeps_counts():
    obs = HistogramObserver("t")
    rng = np.random.default_rng(0)
    data = [rng.standard_normal(1000).astype(np.float32) * s for s in (0.1, 1.0, 10.0, 3.0)]
    for d in data:
        obs.update(torch.from_numpy(d))
    assert obs.hist.numel() == BINS  # never grows with the data
    assert obs.hist.sum().item() == pytest.approx(4000)
    allv = np.concatenate(data)
    assert obs.min == pytest.approx(allv.min()) and obs.max == pytest.approx(allv.max())
    lo, hi = choose_range(obs, "percentile", percentile=99.0)
    want = np.percentile(np.abs(allv), 99.0)
    assert hi == pytest.approx(want, rel=0.05)


def test_observer_histograms_a_seeded_sample_of_large_batches():
    """Above ``sample`` values a batch goes into the histogram as a seeded uniform sample weighted by
    what it stands for: counts and extremes stay exact, ranges stay within a bin or two of the full
    histogram's, and the same seed gives the same histogram."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(40_000, generator=g) * s for s in (1.0, 3.0)] + [torch.rand(5_000, generator=g)]
    batches[0][7] = 25.0  # one outlier: seen by the extremes even if the sample misses it
    full, a, b = HistogramObserver("t", sample=None), HistogramObserver("t", sample=4096), HistogramObserver(
        "t", sample=4096)
    for x in batches:
        for obs in (full, a, b):
            obs.update(x.reshape(10, -1) if x.numel() == 40_000 else x)
    assert torch.equal(a.hist, b.hist) and a.R == full.R  # seeded: reproducible
    assert a.count == full.count == 85_000
    assert a.hist.sum().item() == pytest.approx(85_000, rel=1e-9)  # 4096 values per batch, weighted
    assert (a.min, a.max) == (full.min, full.max) and a.max == pytest.approx(25.0)
    bin_width = 2 * full.R / BINS
    for method, p in (("percentile", 99.9), ("mse", 99.99)):
        lo_f, hi_f = choose_range(full, method, p)
        lo_s, hi_s = choose_range(a, method, p)
        assert abs(hi_s - hi_f) <= 0.05 * hi_f and abs(lo_s - lo_f) <= 0.05 * abs(lo_f) + 2 * bin_width


def test_observer_reads_channels_last_tensors_without_a_copy_of_the_order():
    x = torch.randn(2, 3, 4, 5)
    obs, obs_cl = HistogramObserver("t", sample=None), HistogramObserver("t", sample=None)
    obs.update(x)
    obs_cl.update(x.contiguous(memory_format=torch.channels_last))
    assert torch.equal(obs.hist, obs_cl.hist) and (obs.min, obs.max) == (obs_cl.min, obs_cl.max)


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy", "mse"])
def test_every_method_gives_a_range_inside_the_extremes(method):
    obs = HistogramObserver("t")
    x = torch.randn(20000)
    x[0] = 40.0  # one outlier: everything but minmax should clip it
    obs.update(x)
    lo, hi = choose_range(obs, method, qmin=-128, qmax=127)
    assert lo < 0 < hi <= 40.0 + 1e-6
    if method == "minmax":
        assert hi == pytest.approx(40.0)
    elif method == "mse":  # one outlier costs more squared error clipped than rounded: kept (almost)
        assert hi < 40.0
    else:
        assert hi < 20.0


def test_relu_outputs_keep_a_useful_entropy_range():
    obs = HistogramObserver("relu")
    x = torch.relu(torch.randn(50000))  # half exact zeros
    obs.update(x)
    lo, hi = choose_range(obs, "entropy")
    assert lo == 0.0 and hi > 2.0


def test_qparams_u8_and_symmetric():
    s, zp = qparams(-1.0, 3.0, 0, 255, False)
    assert s == pytest.approx(4 / 255) and zp == round(1 / s)
    s, zp = qparams(-1.0, 3.0, -128, 127, True)
    assert zp == 0 and s == pytest.approx(3 / 127)


def test_non_finite_activation_names_the_layer():
    obs = HistogramObserver("blocks.3.relu")
    with pytest.raises(BadInputError, match=r"non-finite activations .* at layer 'blocks.3.relu'"):
        obs.update(torch.tensor([1.0, float("nan")]))


# ----------------------------------------------------------------------------- config


def test_config_validation_messages():
    with pytest.raises(BadInputError, match=r"unknown calibration method 'kl' \(choose from 'entropy', 'minmax'"):
        Int8Config(calib_method="kl")
    with pytest.raises(BadInputError, match="unknown quantization method 'awq'"):
        Int8Config(method="awq")
    with pytest.raises(BadInputError, match="unknown quantization scheme 'u8u8'"):
        Int8Config(scheme="u8u8")
    with pytest.raises(BadInputError, match="percentile must be in"):
        Int8Config(percentile=101)
    with pytest.raises(BadInputError, match="calib_samples must be at least 8"):
        Int8Config(calib_samples=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Int8Config().method = "qat"  # type: ignore[misc]


@pytest.mark.parametrize("scheme,depthwise,grid,pairs", [
    ("u8s8", False, (-128, 127), False), ("u8s8p", False, (-128, 127), True), ("u8s8p", True, (-128, 127), False),
    ("u8s7", False, (-64, 64), False), ("u8s7", True, (-128, 127), False), ("trt", False, (-128, 127), False),
])
def test_weight_grid_per_scheme_and_layer(scheme, depthwise, grid, pairs):
    from edgekit.compress.int8.qdq import weight_grid

    g = weight_grid(scheme, depthwise)
    assert (g.qmin, g.qmax, g.pairs) == (*grid, pairs) and g.full == (grid == (-128, 127) and not pairs)


def test_scheme_follows_the_target():
    from edgekit.targets import Target, load_target
    from edgekit.targets.cpu_isa import host_int8_kernel

    # the CPU's integer kernels decide: int32 sums (VNNI, AMX, arm64) keep 8-bit weights; the int16 pair
    # sums of x86 without VNNI get pair-safe 8-bit weights; this machine by its own kind, whatever it is;
    # a CPU nobody named gets 7-bit weights, exact however its kernels pair their products
    assert resolve_scheme(Int8Config(), load_target("cpu-avx2")) == "u8s8p"
    for name in ("cpu-avx512-vnni", "cpu-amx", "cpu-cortex-a78ae", "cpu-neoverse-n1", "cpu-cortex-a76"):
        assert resolve_scheme(Int8Config(), load_target(name)) == "u8s8", name
    host = "u8s8p" if host_int8_kernel().saturates else "u8s8"
    assert resolve_scheme(Int8Config(), load_target("cpu")) == host
    assert resolve_scheme(Int8Config(), None) == host
    unknown = dataclasses.replace(load_target("cpu-avx512-vnni"), arch=None)  # a user's file without its CPU
    assert resolve_scheme(Int8Config(), unknown) == "u8s7"
    orin = Target(name="orin", description="", kind="jetson", runtimes=("tensorrt", "onnxruntime"),
                  precisions=("fp16", "int8"))
    assert resolve_scheme(Int8Config(), orin) == "trt"
    assert resolve_scheme(Int8Config(scheme="s8s8"), orin) == "s8s8"
    # the scheme is the runtimes' declaration (Runtime.int8_scheme): the first runtime's, or on a
    # GPU target any runtime's; a CPU target whose first runtime runs any Q/DQ form gets "u8s8"
    gpu = dataclasses.replace(orin, kind="gpu", runtimes=("onnxruntime", "tensorrt"))
    assert resolve_scheme(Int8Config(), gpu) == "trt"
    assert resolve_scheme(Int8Config(), dataclasses.replace(gpu, kind="cpu", arch="x86_64",
                                                            isa=("avx2", "avx512_vnni"))) == "u8s8"
    assert resolve_scheme(Int8Config(), dataclasses.replace(gpu, kind="cpu", runtimes=("tensorrt",))) == "trt"


def test_every_runtime_declares_an_int8_scheme_the_int8_step_knows():
    from edgekit.compress.int8.config import SCHEMES
    from edgekit.runtimes import RUNTIMES, get_runtime

    declared = {name: get_runtime(name).int8_scheme for name in RUNTIMES}
    assert declared["tensorrt"] == "trt" and declared["onnxruntime"] is None
    assert all(s is None or s in SCHEMES for s in declared.values())


# ----------------------------------------------------------------------------- PTQ, export, parity


@pytest.mark.parametrize("target", ["cpu-avx2", "cpu-avx512-vnni"])
def test_ptq_tiny_cnn_exports_fused_qdq_with_parity(tiny_cnn, tmp_path, target):
    """On each CPU kind's integer kernels (this machine's, or their numerical model), whatever CPU runs
    the test: the scheme the target gets keeps the engine within a step or two of the fake-quant model."""
    from edgekit.onnx_int8_kernels import semantics_for_target, session_for
    from edgekit.targets import load_target

    tgt = load_target(target)
    ctx = _ctx((3, 32, 32), target=tgt)
    # every layer integer (--keep-float none: no float image stem under u8s8p), so every grid is checked
    q = apply(tiny_cnn, Int8Config(calib_method="minmax", keep_float=("none",)), ctx)
    meta = q.steps[-1].meta
    scheme = {"cpu-avx2": "u8s8p", "cpu-avx512-vnni": "u8s8"}[target]
    assert meta["scheme"] == scheme and meta["folded_bn"] == 1 and len(meta["layers"]) == 4
    assert meta["kernels"] == {"cpu-avx2": "int16-pairs", "cpu-avx512-vnni": "int32"}[target]
    m = ctx.metrics["int8"]
    assert m["int8_fake_quant"]["mean_kl"] < 0.01  # fake-quant stays close to FP32
    assert abs(m["int8_engine"]["drop_from_fake_quant"]) <= 0.1  # the engine as the target runs it, same data
    assert "Q/DQ computed in float" in m["int8_fake_quant"]["via"]  # the same exported graph, exported once
    assert {"calibrate", "evaluate_float", "export", "evaluate_fake_quant", "engine_check"} <= set(m["seconds"])
    path = _export(q, tmp_path / "onnx")
    import onnx
    from onnx import numpy_helper

    g = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    dqs = [n for n in g.node if n.op_type == "DequantizeLinear"]
    weights = [inits[n.input[0]] for n in dqs if n.input[0] in inits and inits[n.input[0]].ndim >= 2]
    assert len(weights) == 4 and all(w.dtype == np.int8 for w in weights)  # int8 weights, stored quantized
    depthwise = [w for w in weights if w.ndim == 4 and w.shape[1] == 1]
    gemm = [w for w in weights if not (w.ndim == 4 and w.shape[1] == 1)]
    wmax = max(int(np.abs(w.astype(np.int32)).max()) for w in gemm)
    assert len(depthwise) == 1 and int(np.abs(depthwise[0].astype(np.int32)).max()) == 127  # exact kernels: 8 bits
    overflowing = sum(pairs.violations(w) for w in gemm)  # same-sign pairs of codes beyond 128
    if scheme == "u8s8p":  # 8-bit codes on the pair-safe grid: no int16 pair sum can overflow
        assert wmax > 64 and overflowing == 0
    else:
        assert wmax == 127 and overflowing > 0
    qs = [n for n in g.node if n.op_type == "QuantizeLinear"]
    assert qs and all(inits.get(n.input[2], np.zeros((), np.uint8)).dtype == np.uint8 for n in qs if len(n.input) > 2)
    x = ctx.eval.inputs["input"][:4]
    _, ops = _ort(path, x)
    assert ops.count("QLinearConv") == 3, ops  # every conv runs in int8 after ORT's QDQ fusion
    y = session_for(path, semantics_for_target(tgt)).run(None, {"input": x})[0]
    with torch.no_grad():
        ref = q.module(torch.from_numpy(x)).numpy()
    # parity of the INT8 engine against the PyTorch fake-quant model: the engine requantizes with
    # integer arithmetic, so a value may land one quantization step away; the tolerance is 2% of the
    # output range plus 1e-3
    tol = 0.02 * np.abs(ref).max() + 1e-3
    assert np.abs(y - ref).max() <= tol
    # the unoptimized graph (plain Q/DQ semantics) matches the fake-quant model much more tightly
    y_raw, _ = _ort(path, x, optimized=False)
    assert np.abs(y_raw - ref).max() <= 0.005 * np.abs(ref).max() + 1e-4


_OV_AT_ISA = """
import sys, numpy as np, openvino as ov
x = np.load(sys.argv[2])
c = ov.Core().compile_model(sys.argv[1], "CPU", {"INFERENCE_NUM_THREADS": 1})
np.save(sys.argv[3], c({"input": x})[0])
kinds = [n.get_rt_info()["primitiveType"].astype(str) for n in c.get_runtime_model().get_ops()]
print(" ".join(sorted({k for k in kinds if "I8" in k})))
"""


@pytest.mark.slow
def test_openvino_limited_to_avx2_computes_what_the_scheme_assumes(tiny_cnn, tmp_path):
    """OpenVINO's CPU plugin limited to AVX2 (oneDNN's ONEDNN_MAX_CPU_ISA), whatever CPU runs the test:
    the AVX2 target's pair-safe graph (and its 7-bit one) stays at its fake-quant model; the VNNI target's 8-bit graph, run on
    the same int8 kernels without VNNI, moves far from it (int16 pair sums overflow)."""
    import os
    import subprocess
    import sys

    from edgekit.targets import load_target

    pytest.importorskip("openvino")
    x = _images(32, (3, 32, 32), 5).inputs["input"]
    np.save(tmp_path / "x.npy", x)
    errors = {}
    for scheme, target in (("u8s8p", "cpu-avx2"), ("u8s7", "cpu-avx2"), ("u8s8", "cpu-avx512-vnni")):
        config = Int8Config(calib_method="minmax", scheme="u8s7" if scheme == "u8s7" else None)
        q = apply(tiny_cnn, config, _ctx((3, 32, 32), target=load_target(target)))
        path = _export(q, tmp_path / scheme)
        run = subprocess.run([sys.executable, "-c", _OV_AT_ISA, str(path), str(tmp_path / "x.npy"),
                              str(tmp_path / f"{scheme}.npy")], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"})
        assert run.returncode == 0, run.stderr[-2000:]
        assert "avx512" not in run.stdout and "amx" not in run.stdout, run.stdout  # the limit held
        with torch.no_grad():
            ref = q.module(torch.from_numpy(x)).numpy()
        y = np.load(tmp_path / f"{scheme}.npy")
        errors[scheme] = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    assert max(errors["u8s8p"], errors["u8s7"]) < 0.02, errors  # requantization steps only
    assert errors["u8s8"] > 5 * errors["u8s8p"], errors


def test_8bit_weights_are_wrong_on_kernels_without_vnni(tiny_cnn, tmp_path):
    """The VNNI scheme (8-bit weights) on the int16-pair kernels of x86 without VNNI, through their
    numerical model: far outside the parity tolerance on any machine that runs the test; the 7-bit
    scheme of the same model stays inside it."""
    from edgekit.errors import CheckFailedError
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.onnx_int8_kernels import session_for
    from edgekit.targets import load_target

    errors = {}
    made_for = {"u8s8": load_target("cpu-avx512-vnni"), "u8s8p": load_target("cpu-avx2"),
                "u8s7": load_target("cpu-avx2")}
    compressed = {}
    for scheme in ("u8s8", "u8s8p", "u8s7"):
        config = Int8Config(calib_method="minmax", scheme="u8s7" if scheme == "u8s7" else None)
        q = compressed[scheme] = apply(tiny_cnn, config, _ctx((3, 32, 32), target=made_for[scheme]))
        assert q.steps[-1].meta["scheme"] == scheme
        path = _export(q, tmp_path / scheme)
        x = _images(32, (3, 32, 32), 5).inputs["input"]
        with torch.no_grad():
            ref = q.module(torch.from_numpy(x)).numpy()
        pairs = session_for(path, "int16-pairs").run(None, {"input": x})[0]
        exact = session_for(path, "int32").run(None, {"input": x})[0]
        errors[scheme] = [float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) for y in (pairs, exact)]
    # exact int32 sums: every scheme within 1e-3 of its fake-quant model (relative L2 error of the logits);
    # int16 pair sums: the pair-safe and the 7-bit schemes compute exactly the same, the 8-bit one is off by
    # orders of magnitude
    assert max(errors["u8s8"][1], errors["u8s8p"][1], errors["u8s7"][1]) < 1e-3, errors
    for safe in ("u8s8p", "u8s7"):
        assert errors[safe][0] == pytest.approx(errors[safe][1], rel=1e-3, abs=1e-7), errors
    assert errors["u8s8"][0] > 100 * errors["u8s8"][1] and errors["u8s8"][0] > 5 * errors["u8s8p"][0], errors
    # export parity judged on those kernels (at a tolerance this small model's logits resolve) refuses the
    # 8-bit graph, naming the cause, and keeps it where it says; the 7-bit graph passes the same check
    strict = {"logits": (2e-3, 0.0)}
    with pytest.raises(CheckFailedError, match="overflow the int16 pair sums") as err:
        export_onnx(compressed["u8s8"], tmp_path / "refused", ExportConfig(int8_kernels="int16-pairs",
                                                                           tolerances=strict))
    assert str(tmp_path / "refused.failed.onnx") in str(err.value)
    assert (tmp_path / "refused.failed.onnx").is_file() and not (tmp_path / "refused").exists()
    for safe in ("u8s8p", "u8s7"):
        export_onnx(compressed[safe], tmp_path / safe / "kept", ExportConfig(int8_kernels="int16-pairs",
                                                                             tolerances=strict))


def test_the_int8_step_stops_when_the_targets_kernels_compute_something_else(tiny_cnn):
    """The VNNI scheme forced onto an x86 target without VNNI: the engine as that CPU runs it (its own
    kernels or their model) falls far below the fake-quant model, and the step stops before anything is
    written, saying so."""
    from edgekit.errors import CheckFailedError
    from edgekit.targets import load_target

    ctx = _ctx((3, 32, 32), target=load_target("cpu-avx2"))
    with pytest.raises(CheckFailedError, match=r"loses \d+\.\d points against its fake-quant model on .*int16 pair|"
                                               r"loses \d+\.\d points against its fake-quant model on .*avx2"):
        apply(tiny_cnn, Int8Config(calib_method="minmax", scheme="u8s8"), ctx)
    ctx = _ctx((3, 32, 32), target=load_target("cpu-avx2"), accept_quality_loss=True)
    apply(tiny_cnn, Int8Config(calib_method="minmax", scheme="u8s8"), ctx)  # accepted: measured and reported
    assert ctx.metrics["int8"]["int8_engine"]["drop_from_fake_quant"] > 0.1


def test_trt_scheme_is_symmetric_int8_and_quantizes_residual_adds(tmp_path):
    h = _residual_handle()
    ctx = _ctx((3, 16, 16))
    q = apply(h, Int8Config(scheme="trt"), ctx)
    m = ctx.metrics["int8"]  # TensorRT computes Q/DQ in float: one evaluation is both figures
    assert m["int8_engine"]["top1_agreement"] == m["int8_fake_quant"]["top1_agreement"] >= 0.8
    assert m["int8_engine"]["drop_from_fake_quant"] == 0.0 and "float" in m["int8_engine"]["kernels"]
    path = _export(q, tmp_path / "onnx")
    import onnx
    from onnx import numpy_helper

    g = onnx.load(str(path)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    for n in g.node:
        if n.op_type == "QuantizeLinear":
            zp = inits[n.input[2]]
            assert zp.dtype == np.int8 and not zp.any()  # symmetric int8 activations
    producers = {o: n for n in g.node for o in n.output}
    adds = [n for n in g.node if n.op_type == "Add" and all(i not in inits for i in n.input)]
    assert adds and all(producers[i].op_type == "DequantizeLinear" for n in adds for i in n.input)
    convs = [n for n in g.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    assert convs and all(producers[n.input[0]].op_type == "DequantizeLinear" for n in convs)
    assert all(producers[n.input[1]].op_type == "DequantizeLinear" for n in convs)


def residual_model() -> ModelHandle:
    """Entry point ``tests.compress.int8.test_int8:residual_model`` (load_compressed reloads the base from it)."""
    h = _residual_handle()
    h.source = "tests.compress.int8.test_int8:residual_model"
    return h


def test_compress_load_export_build_profile_end_to_end(tmp_path):
    from edgekit.artifact import read_manifest
    from edgekit.build import build_engine
    from edgekit.profiling import ProfileConfig, profile_engine
    from edgekit.runtimes.base import BuildOptions

    h = residual_model()
    ctx = _ctx((3, 16, 16))
    out = compress(h, [("int8", Int8Config(calib_method="mse"))], tmp_path / "int8", ctx)
    man = read_manifest(out)
    assert man.metrics["int8"]["scheme"] == resolve_scheme(Int8Config(), None) and man.steps[-1]["name"] == "int8"
    if man.metrics["int8"]["scheme"] == "u8s8p":  # without VNNI: the image stem stays float
        assert man.steps[-1]["meta"]["float_layers"] and "keep_float_reason" in man.steps[-1]["meta"]
    else:
        assert man.steps[-1]["meta"]["float_layers"] == []
    back = load_compressed(out)  # base model + rebuilt fake-quant graph + saved weights and scales
    x = torch.from_numpy(ctx.eval.inputs["input"][:4])
    h2 = apply(residual_model(), Int8Config(calib_method="mse"), _ctx((3, 16, 16)))
    with torch.no_grad():
        assert torch.allclose(back.module(x), h2.module(x), atol=1e-6)
    tol = back.extra["parity_tolerance"]
    eng = build_engine(out, "cpu", tmp_path / "engine",
                       BuildOptions(threads=1, extra={"export": {"atol": tol[0], "rtol": tol[1]}}))
    prof = profile_engine(eng, ProfileConfig(warmup_ms=0, duration_s=0, iterations=3, node_iterations=2, threads=1))
    conv_nodes = [n for n in prof.nodes if n.op_type in ("QLinearConv", "Conv")]
    float_convs = [n for n in conv_nodes if not n.quantized]  # a float image stem's, none else
    assert len(float_convs) == len(man.steps[-1]["meta"]["float_layers"]) and all(n.precision == "fp32" for n in float_convs)
    assert len(conv_nodes) > len(float_convs) and all(n.precision == "int8" for n in conv_nodes if n.quantized)
    assert prof.quantized_nodes >= 2 and prof.float_share is not None and prof.float_share < 1.0


def test_no_quantizable_layers_and_bad_calibration_data():
    h = ModelHandle(name="relu-only", source="x", module=nn.Sequential(nn.ReLU()).eval(),
                    inputs=[InputSpec("input", ("batch", 4), "float32")])
    with pytest.raises(BadInputError, match="no quantizable layers"):
        apply(h, Int8Config(), StepContext(calib=Samples("s", "calib", {"input": np.ones((16, 4), np.float32)})))
    cnn_ctx = StepContext(calib=Samples("s", "calib", {"input": np.ones((16, 3, 8, 8), np.float32)}))
    from tests.conftest import make_tiny_cnn

    with pytest.raises(BadInputError, match="shape"):
        apply(make_tiny_cnn(), Int8Config(), cnn_ctx)
    bad_dtype = StepContext(calib=Samples("s", "calib", {"input": np.ones((16, 3, 32, 32), np.float64)}))
    with pytest.raises(BadInputError, match="dtype"):
        apply(make_tiny_cnn(), Int8Config(), bad_dtype)
    few = StepContext(calib=Samples("s", "calib", {"input": np.ones((3, 3, 32, 32), np.float32)}))
    with pytest.raises(BadInputError, match="has 3 samples; INT8 calibration needs at least 8"):
        apply(make_tiny_cnn(), Int8Config(), few)


def test_empty_calibration_folder(tmp_path, tiny_cnn):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInputError):
        apply(tiny_cnn, Int8Config(), StepContext(calib=str(tmp_path / "empty")))


def test_non_finite_calibration_activation_is_reported(tiny_mlp):
    x = np.ones((16, 16), np.float32)
    x[3, 2] = np.inf
    with pytest.raises(BadInputError, match="non-finite activations"):
        apply(tiny_mlp, Int8Config(), StepContext(calib=Samples("s", "calib", {"input": x})))


# ----------------------------------------------------------------------------- fallback, QAT, ONNX-only


def test_fallback_keeps_sensitive_layers_float_until_within_budget(tiny_cnn):
    ctx = _ctx((3, 32, 32))
    # budget 0 on top-1 agreement: some layers must go back to float (or all, in the worst case)
    q = apply(tiny_cnn, Int8Config(max_accuracy_drop=0.0, equalize=False, bias_correction=False, keep_float=("none",)),
              ctx)
    fb = ctx.metrics["int8"]["fallback"]
    assert fb["met"] and fb["final"]["top1_agreement"] == 1.0
    assert q.steps[-1].meta["float_layers"] == fb["float_layers"]
    if fb["float_layers"]:
        assert 0 < fb["float_mac_share"] <= 1 and set(fb["float_layers"]) <= set(q.steps[-1].meta["layers"])


def test_qat_trains_checkpoints_and_resumes(tiny_mlp, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16)).astype(np.float32)
    train = Samples("s", "train", {"input": x}, labels=(x[:, 0] > 0).astype(np.int64))
    ctx = StepContext(calib=Samples("s", "calib", {"input": x[:32]}), train=train, work_dir=tmp_path / "work",
                      progress=False)
    cfg = Int8Config(method="qat", qat_epochs=2, qat_batch_size=16, qat_lr=1e-3, learnable_scales=True)
    apply(tiny_mlp, cfg, ctx)
    info = ctx.metrics["int8"]["qat"]
    assert info["steps"] == 8 and not info["resumed"]
    assert list((tmp_path / "work").glob("int8_qat_*/state.json"))
    ctx2 = dataclasses.replace(ctx, metrics={})
    apply(tiny_mlp, cfg, ctx2)  # same config: resumes from the finished checkpoint
    assert ctx2.metrics["int8"]["qat"]["resumed"] and ctx2.metrics["int8"]["qat"]["steps"] == 0


def test_external_onnx_model_is_quantized_from_its_graph(tiny_onnx, tmp_path):
    from edgekit.loading import load_model

    h = load_model(str(tiny_onnx))
    ctx = StepContext(calib=_images(16, (3, 16, 16), 3), work_dir=tmp_path / "w", progress=False)
    out = compress(h, [("int8", Int8Config(calib_method="entropy"))], tmp_path / "q", ctx)
    import onnx

    g = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in g.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    y, opt_ops = _ort(out / "model.onnx", _images(2, (3, 16, 16), 4).inputs["input"])
    assert "QLinearConv" in opt_ops and y.shape == (2, 5)


def test_tiny_transformer_ptq_exports_and_stays_close(tiny_transformer, tmp_path):
    rng = np.random.default_rng(0)

    def tokens(n: int) -> Samples:
        ids = rng.integers(1, 50, size=(n, 8)).astype(np.int64)
        return Samples("s", "calib", {"input_ids": ids, "attention_mask": np.ones_like(ids)})

    ctx = StepContext(calib=tokens(16), eval=tokens(16), progress=False)
    q = apply(tiny_transformer, Int8Config(), ctx)
    assert len(q.steps[-1].meta["layers"]) >= 2
    path = _export(q, tmp_path / "onnx")
    import onnxruntime as ort

    feeds = {k: v[:4] for k, v in ctx.eval.inputs.items()}
    y = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with torch.no_grad():
        ref = tiny_transformer.module(*[torch.from_numpy(feeds[s.name]) for s in tiny_transformer.inputs]).numpy()
    cos = (y * ref).sum(-1) / (np.linalg.norm(y, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() > 0.98


@pytest.mark.slow
def test_fmnist_cnn_ptq_real_model(tmp_path):
    """The real Fashion-MNIST CNN: PTQ keeps accuracy within 0.5 points, every conv runs int8 but an image stem
    kept float (scheme u8s8p, on CPUs without VNNI)."""
    from edgekit.loading import load_model
    from edgekit.sources.data import load_samples

    h = load_model("fmnist-cnn")
    ev = load_samples(None, h, split="eval", limit=1000)
    ctx = StepContext(calib=load_samples(None, h, split="calib", limit=128), eval=ev, progress=False)
    q = apply(h, Int8Config(), ctx)
    m = ctx.metrics["int8"]
    assert m["fp32"]["accuracy"] - m["int8_fake_quant"]["accuracy"] <= 0.005
    path = _export(q, tmp_path / "onnx")
    y, ops = _ort(path, ev.inputs["input"][:256])
    stem = q.steps[-1].meta["float_layers"]
    assert len(stem) == (1 if m["scheme"] == "u8s8p" else 0)  # its stem: one conv over 1 channel, no depthwise
    assert ops.count("QLinearConv") == 3 - len(stem)
    assert (y.argmax(-1) == ev.labels[:256]).mean() >= m["fp32"]["accuracy"] - 0.03


def test_fast_fake_quant_is_bit_identical_to_torch_and_keeps_gradients():
    from torch import nn

    from edgekit.compress.int8.qdq import ActQuant, fast_fake_quant

    g = torch.Generator().manual_seed(0)
    for qmin, qmax, symmetric in [(0, 255, False), (-128, 127, True)]:
        q = ActQuant("a", qmin, qmax, symmetric)
        q.set_range(-3.1, 5.7)
        ties = (torch.arange(-400, 400) + 0.5) * q._scale_f  # halfway points: round half to even in both
        x = torch.cat([torch.randn(50_000, generator=g) * 4, ties, torch.tensor([1e9, -1e9, 0.0])])
        ref = q(x)
        with fast_fake_quant(nn.Sequential(q)):
            assert torch.equal(q(x), ref)
            xg = x.clone().requires_grad_(True)
            assert q(xg).grad_fn is not None  # training keeps torch's straight-through kernel
        assert not q.fast


def test_weight_quant_is_cached_while_neither_weight_nor_scale_changes():
    from edgekit.compress.int8.qdq import WeightGrid, WeightQuant, fast_fake_quant

    wq = WeightQuant("w", 4, WeightGrid(-64, 64)).eval()
    w = torch.nn.Parameter(torch.randn(4, 3, 3, 3), requires_grad=False)
    wq.update_scale(w)
    outside = wq(w)
    with fast_fake_quant(nn.Sequential(wq)):
        first = wq(w)
        assert torch.equal(first, outside) and wq(w) is first  # computed once
        with torch.no_grad():
            w.mul_(2.0)  # in place: the tensor's version moves on
        assert torch.equal(wq(w), wq.codes(w) * wq.scale.reshape(-1, 1, 1, 1)) and wq(w) is not first
        again = wq(w)
        wq.update_scale(w)  # a new scale: quantized again
        assert wq(w) is not again
        other = torch.randn(4, 3, 3, 3)  # another tensor (e.g. GPTQ's rounded weight set in its place)
        assert torch.equal(wq(other), wq.codes(other) * wq.scale.reshape(-1, 1, 1, 1))
    assert not wq.cache and wq._cached is None and wq(w) is not wq(w)  # nothing kept after the block


class _ViewsItsFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        return self.fc(y.view(y.shape[0], -1))  # fails on an NHWC-ordered tensor


def test_channels_last_only_where_the_model_computes_the_same(tiny_cnn, tiny_mlp):
    from edgekit.compress.int8 import qdq
    from edgekit.compress.int8.calibration import run_module

    data = _images(4, (3, 32, 32), 0)
    gm, _ = qdq.prepare_qdq(tiny_cnn.module.eval(), "u8s7")
    assert qdq.channels_last_ok(gm, data, ["input"])
    assert all(m.mode == "quant" for m in qdq.act_quants(gm))  # the trial leaves the quantizers as they were
    qdq.set_mode(gm, "float")
    want, got = run_module(gm, data, ["input"]), run_module(gm, data, ["input"], channels_last=True)
    assert got.shape == want.shape == (4, 10) and np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    views, _ = qdq.prepare_qdq(_ViewsItsFeatures().eval(), "u8s7")
    assert not qdq.channels_last_ok(views, _images(2, (3, 8, 8), 0), ["input"])
    mlp, _ = qdq.prepare_qdq(tiny_mlp.module.eval(), "u8s8")  # no 2-D convolution: nothing to gain
    assert not qdq.channels_last_ok(mlp, Samples("s", "calib", {"input": np.zeros((2, 16), np.float32)}), ["input"])


def test_gptq_dense_solve_matches_the_reference_solver_on_the_7bit_grid():
    from edgekit.compress.int8.rounding import gptq_round, output_error
    from edgekit.compress.weight_only.gptq import gptq_solve

    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 40, generator=g)
    X = torch.randn(400, 40, generator=g) @ torch.randn(40, 40, generator=g)
    H = X.t() @ X / 400
    scale = W.abs().amax(1) / 64
    Q = gptq_round(W, scale, H, -64, 64)
    s = scale.double()[:, None]
    ref, _ = gptq_solve(W.double(), H.double(), lambda c, w, a: torch.clamp(torch.round(w / s[:, 0]), -64, 64) * s[:, 0])
    codes = Q / scale[:, None]
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 64
    assert torch.allclose(Q, ref.float(), atol=1e-6)
    rtn = torch.clamp(torch.round(W / scale[:, None]), -64, 64) * scale[:, None]
    assert output_error(W, Q, H) < 0.8 * output_error(W, rtn, H)  # the point of the solve
