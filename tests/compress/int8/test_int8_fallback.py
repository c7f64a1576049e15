"""INT8 fallback (issue 3): layers kept float on request (``keep_float``), the
calibration-split-only sensitivity scan (output SQNR ranking, one pass per unit), and
the bias-correction shift that goes back with a layer's weights. Tiny models, seconds."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from edgekit.compress import StepContext, compress, load_compressed
from edgekit.compress.int8 import qdq
from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.equalize import correct_bias
from edgekit.compress.int8.sensitivity import fallback_units, output_sqnr
from edgekit.compress.int8.step import apply, calibrate
from edgekit.errors import BadInputError
from edgekit.sources.data import Samples
from edgekit.sources.handle import InputSpec, ModelHandle


def _images(n: int, seed: int, split: str = "calib") -> Samples:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3, 16, 16)).astype(np.float32)
    x = (x + np.roll(x, 1, -1) + np.roll(x, 1, -2)) / 2
    return Samples("synthetic", split, {"input": x.astype(np.float32)})


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.mid = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.mid(torch.relu(self.stem(x))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _handle(noisy_mid: bool = False, fragile: bool = False) -> ModelHandle:
    torch.manual_seed(0)
    m = _Net().eval()
    with torch.no_grad():
        if noisy_mid:  # one huge weight per output channel: int8 rounds the rest to a few levels
            m.mid.weight[:, 0, 0, 0] = 40.0
        if fragile:  # classes 0 and 1 nearly tied: int8 noise flips some top-1 predictions
            m.fc.weight[1] = m.fc.weight[0] + 1e-3 * torch.randn(8)
            m.fc.bias[:2] = 5.0
    return ModelHandle(name="tiny-net", source="tests.compress.int8.test_int8_fallback:net_model", kind="image-classifier", module=m,
                       inputs=[InputSpec("input", ("batch", 3, 16, 16), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def _ort_ops(handle: ModelHandle, out) -> dict[str, int]:
    """Conv / Gemm op types in ONNX Runtime's optimized graph of the exported handle."""
    import onnx
    import onnxruntime as ort

    from edgekit.export.onnx import ExportConfig, export_onnx

    export_onnx(handle, out, ExportConfig(skip_parity=True))
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(out / "opt.onnx")
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(out / "model.onnx"), so, providers=["CPUExecutionProvider"])
    ops: dict[str, int] = {}
    for n in onnx.load(str(out / "opt.onnx")).graph.node:
        if n.op_type in ("Conv", "FusedConv", "QLinearConv", "Gemm", "QGemm", "MatMul"):
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


def net_model() -> ModelHandle:
    """Entry point ``tests.compress.int8.test_int8_fallback:net_model`` (load_compressed reloads the base from it)."""
    return _handle()


def test_keep_float_first_and_last_layers_stay_float_and_survive_reload(tmp_path):
    ctx = StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False)
    cfg = Int8Config(calib_samples=16, keep_float=("first", "last"))
    q = apply(_handle(), cfg, ctx)
    meta = q.steps[-1].meta
    assert meta["float_layers"] == ["stem", "fc"]
    enabled = {m.qname: m.enabled for m in qdq.weight_quants(q.module)}
    assert enabled == {"stem": False, "mid": True, "fc": False}
    # a float layer computes with its float weights: same output as the float conv on the same input
    x = torch.from_numpy(_images(2, 3).inputs["input"])
    w = q.module.get_parameter("stem.weight")
    assert torch.equal(q.module.get_submodule("wq_stem")(w), w)
    # their input quantizers go too: else ONNX Runtime would quantize the float weights itself
    assert meta["float_activations"] == ["x", "flatten"]
    assert _ort_ops(q, tmp_path / "onnx") == {"Conv": 1, "QLinearConv": 1, "Gemm": 1}
    # saved and reloaded: the same layers stay float, the outputs are identical
    out = compress(_handle(), [("int8", cfg)], tmp_path / "m",
                   StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False))
    r = load_compressed(out)
    enabled = {m.qname: m.enabled for m in qdq.weight_quants(r.module)}
    assert enabled == {"stem": False, "mid": True, "fc": False}
    with torch.no_grad():
        assert torch.allclose(r.module(x), q.module(x), atol=1e-5)


@pytest.mark.parametrize("scheme, keep, stem_float", [
    ("u8s8p", (), True),  # the default without VNNI: the RGB stem runs faster on float kernels there
    ("u8s8p", ("none",), False),
    ("u8s8", (), False),  # VNNI / AMX: every layer integer, as before
    ("u8s7", (), False),
    ("u8s8p", ("last",), False),  # named layers replace the default
])
def test_image_stem_stays_float_by_default_without_vnni_only(scheme, keep, stem_float, tmp_path):
    ctx = StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False)
    q = apply(_handle(), Int8Config(calib_samples=16, scheme=scheme, keep_float=keep), ctx)
    meta = q.steps[-1].meta
    enabled = {m.qname: m.enabled for m in qdq.weight_quants(q.module)}
    assert enabled["stem"] is (not stem_float) and enabled["mid"] is True
    assert ("stem" in meta["float_layers"]) is stem_float
    assert ("x" in meta["float_activations"]) is stem_float  # the input image is not quantized either
    assert ("keep_float_reason" in meta) is (stem_float and not keep)
    if stem_float:
        assert "--keep-float none" in meta["keep_float_reason"]
        assert _ort_ops(q, tmp_path / "onnx") == {"Conv": 1, "QLinearConv": 1, "QGemm": 1}


class _DepthwiseNet(nn.Module):
    """A MobileNet-like start: stem, ReLU6, an explicit zero pad, a depthwise conv, a pointwise conv."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.pad = nn.ZeroPad2d(1)
        self.dw = nn.Conv2d(8, 8, 3, groups=8)
        self.pw = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.relu6(self.dw(self.pad(nn.functional.relu6(self.stem(x)))))
        x = torch.relu(self.pw(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _depthwise_handle() -> ModelHandle:
    torch.manual_seed(0)
    return ModelHandle(name="tiny-dw", source="tests", kind="image-classifier", module=_DepthwiseNet().eval(),
                       inputs=[InputSpec("input", ("batch", 3, 16, 16), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})


def test_image_stem_is_a_conv_over_at_most_four_channels_and_the_depthwise_conv_reading_it():
    from edgekit.compress.int8.step import image_stem

    gm, plan = qdq.prepare_qdq(copy.deepcopy(_handle().module), "u8s8p")
    assert image_stem(gm, plan) == ["stem"]  # followed by a full conv: the stem alone
    gm, plan = qdq.prepare_qdq(copy.deepcopy(_depthwise_handle().module), "u8s8p")
    assert image_stem(gm, plan) == ["stem", "dw"]
    wide = _Net()
    wide.stem = nn.Conv2d(5, 8, 3, padding=1)
    gm, plan = qdq.prepare_qdq(wide, "u8s8p")
    assert image_stem(gm, plan) == []


def test_stem_and_depthwise_conv_float_with_their_inputs_through_the_pad(tmp_path):
    ctx = StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False)
    q = apply(_depthwise_handle(), Int8Config(calib_samples=16, scheme="u8s8p"), ctx)
    meta = q.steps[-1].meta
    assert meta["float_layers"] == ["stem", "dw"]
    # the image and the stem's output (quantized before and after the pad) are float too: a float conv
    # reading a DequantizeLinear would get per-tensor int8 weights from ONNX Runtime
    assert meta["float_activations"] == ["x", "relu6"]
    ops = _ort_ops(q, tmp_path / "onnx")
    assert ops.get("Conv", 0) + ops.get("FusedConv", 0) == 2 and ops["QLinearConv"] == 1 and ops["QGemm"] == 1


def test_a_kept_float_layer_behind_a_pad_loses_its_input_quantizer(tmp_path):
    ctx = StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False)
    q = apply(_depthwise_handle(), Int8Config(calib_samples=16, scheme="u8s8", keep_float=("dw",)), ctx)
    assert q.steps[-1].meta["float_activations"] == ["relu6"]
    # one integer conv, the pointwise one: the depthwise conv keeps its float weights (per-tensor int8 from
    # ONNX Runtime would make it a second QLinearConv), and the stem, whose output it reads in float, runs its
    # int8-grid weights on a float conv
    ops = _ort_ops(q, tmp_path / "onnx")
    assert ops.get("Conv", 0) + ops.get("FusedConv", 0) == 2 and ops["QLinearConv"] == 1 and ops["QGemm"] == 1


def test_keep_float_rejects_unknown_layer_names():
    ctx = StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False)
    with pytest.raises(BadInputError, match=r"unknown layer to keep in float 'nope' \(choose from .*'first'.*'none'.*'stem'"):
        apply(_handle(), Int8Config(calib_samples=16, keep_float=("nope",)), ctx)
    with pytest.raises(BadInputError, match="keep_float must be a list of layer names"):
        Int8Config(keep_float="first")  # type: ignore[arg-type]


def test_fallback_measures_on_calibration_samples_held_out_of_calibration():
    # 16 calibration + 24 held-out samples of the calib split; the eval split is only evaluated
    ctx = StepContext(calib=_images(40, 1), eval=_images(16, 2, "eval"), progress=False)
    # the scheme fixed: which samples flip depends on the weight grid, and the host's would choose it
    q = apply(_handle(fragile=True), Int8Config(calib_samples=16, fallback_samples=24, max_accuracy_drop=0.0,
                                                equalize=False, scheme="u8s8"), ctx)
    m = ctx.metrics["int8"]
    fb = m["fallback"]
    assert m["calib_samples"] == 16 and fb["samples"] == 24 and fb["held_out_of_calibration"] is True
    assert fb["all_int8"]["top1_agreement"] == pytest.approx(21 / 24)  # 3 of 24 flipped
    assert fb["met"] and fb["final"]["top1_agreement"] == 1.0  # budget 0 met on the held-out samples
    assert fb["float_layers"] or fb["float_activations"]
    assert q.steps[-1].meta["float_layers"] == fb["float_layers"]
    # every layer's weights were scanned, plus the activations (3 layers + 4 activations here)
    assert fb["scanned_units"] == 3 + 4
    assert "int8_fake_quant" in m  # the eval split is still reported, after the fallback


def test_output_sqnr_finds_the_noisy_layer_in_one_pass():
    h = _handle(noisy_mid=True)
    gm, plan = qdq.prepare_qdq(copy.deepcopy(h.module), "u8s8")
    qdq.update_weight_scales(gm, plan, search=False)
    calibrate(gm, _images(16, 1), ["input"], Int8Config(calib_samples=16, calib_method="minmax").calibration_config())
    sq = output_sqnr(gm, plan, _images(8, 4), ["input"])
    layers = {k: v for k, v in sq.items() if not k.startswith("act:")}
    assert set(layers) == {"stem", "mid", "fc"} and len(sq) == 3 + len(plan.activations)
    assert all(np.isfinite(v) for v in sq.values())
    assert min(layers, key=layers.get) == "mid"
    # dB (measured 33.5 against 48.1 without the outliers): the outlier weights cost the others their bits
    assert layers["mid"] < 38 and layers["stem"] > 45 and layers["fc"] > 45


def _calibrated():
    """The tiny model, its fake-quant graph and 16 calibration images, ranges calibrated."""
    h = _handle()
    gm, plan = qdq.prepare_qdq(copy.deepcopy(h.module), "u8s8")
    qdq.update_weight_scales(gm, plan)
    calib = _images(16, 1)
    calibrate(gm, calib, ["input"], Int8Config(calib_samples=16).calibration_config())
    return h, gm, plan, calib


def test_fallback_gives_a_layer_its_uncorrected_bias_back():
    h, gm, plan, calib = _calibrated()
    before = gm.get_parameter("mid.bias").detach().clone()
    assert correct_bias(gm, plan, h.module, calib, ["input"]) == 3
    corrected = gm.get_parameter("mid.bias").detach().clone()
    assert not torch.equal(corrected, before)
    unit = {u.name: u for u in fallback_units(gm, plan)}["mid"]
    unit.set_float(True)
    assert torch.allclose(gm.get_parameter("mid.bias"), before, atol=1e-6)
    unit.set_float(True)  # idempotent: the shift goes back once
    assert torch.allclose(gm.get_parameter("mid.bias"), before, atol=1e-6)
    unit.set_float(False)
    assert torch.allclose(gm.get_parameter("mid.bias"), corrected, atol=1e-6)


# ----------------------------------------------------------------------------- GPTQ rounding (rounding.py)


def test_gptq_round_stays_on_the_grid_and_beats_round_to_nearest():
    from edgekit.compress.int8.rounding import gptq_round, output_error

    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 24, generator=g) @ torch.randn(24, 24, generator=g)  # correlated inputs
    H = X.t() @ X / X.shape[0]
    W = torch.randn(6, 24, generator=g)
    s = W.abs().amax(1) / 127
    rtn = torch.clamp(torch.round(W / s[:, None]), -128, 127) * s[:, None]
    Q = gptq_round(W, s, H)
    codes = Q / s[:, None]
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 128
    assert output_error(W, Q, H) < 0.8 * output_error(W, rtn, H)  # measured 0.64x
    # one H per row (depthwise convolutions): the same math row by row
    Hr = torch.stack([H] * 6)
    assert torch.allclose(gptq_round(W, s, Hr), Q, atol=1e-6)


def test_gptq_rounding_in_apply_lowers_output_error_and_exports_int8(tmp_path):
    ctx = StepContext(calib=_images(16, 1), eval=_images(16, 2, "eval"), progress=False)
    q = apply(_handle(), Int8Config(calib_samples=16, rounding="gptq", keep_float=("none",)), ctx)  # any CPU
    rep = q.steps[-1].meta["gptq"]
    assert rep["layers"] >= 2 and rep["output_error_ratio"] < 0.9
    for name, qname in [("stem", "wq_stem"), ("mid", "wq_mid")]:
        w = q.module.get_parameter(f"{name}.weight")
        wq = q.module.get_submodule(qname)
        if wq.float_weight is not None:  # rounded: the stored weights are on their int8 grid
            assert torch.allclose(wq(w), w, atol=1e-6)
    assert _ort_ops(q, tmp_path / "onnx") == {"QLinearConv": 2, "QGemm": 1}
    with pytest.raises(BadInputError, match=r"unknown weight rounding 'adaround' \(choose from 'gptq', 'nearest'\)"):
        Int8Config(rounding="adaround")


def test_cli_flags_map_onto_the_config():
    from click.testing import CliRunner

    from edgekit.cli import cli
    from edgekit.compress.plan import plan_steps

    steps = plan_steps(bits=8, keep_float=("first", "_fc"), rounding="nearest", calib_method=None)
    assert steps == [("int8", {"method": "ptq", "keep_float": ("first", "_fc"), "rounding": "nearest"})]
    cfg = Int8Config(**{k: v for k, v in steps[0][1].items()})
    assert cfg.keep_float == ("first", "_fc") and cfg.rounding == "nearest"
    assert Int8Config().rounding == "gptq" and Int8Config().keep_float == ()
    res = CliRunner().invoke(cli, ["compress", "x", "-o", "y", "--bits", "8", "--rounding", "stochastic"])
    assert res.exit_code == 2 and "unknown weight rounding 'stochastic'" in res.output


def test_fallback_of_a_gptq_rounded_layer_restores_its_float_weights():
    from edgekit.compress.int8.rounding import round_model

    h, gm, plan, calib = _calibrated()
    w_float = gm.get_parameter("mid.weight").detach().clone()
    assert round_model(gm, plan, calib, ["input"])["layers"] >= 1
    w_rounded = gm.get_parameter("mid.weight").detach().clone()
    assert gm.get_submodule("wq_mid").float_weight is not None and not torch.equal(w_rounded, w_float)
    unit = {u.name: u for u in fallback_units(gm, plan)}["mid"]
    unit.set_float(True)
    assert torch.equal(gm.get_parameter("mid.weight"), w_float)
    unit.set_float(False)
    assert torch.equal(gm.get_parameter("mid.weight"), w_rounded)


def test_output_sqnr_after_gptq_rounding_compares_against_the_float_weights():
    """GPTQ rounding stores on-grid weights in place; the SQNR reference is the float weight kept
    aside, so a rounded layer is as noisy as with nearest rounding (not ~300 dB, i.e. no noise)."""
    from edgekit.compress.int8.rounding import round_model

    h = _handle(noisy_mid=True)
    gm, plan = qdq.prepare_qdq(copy.deepcopy(h.module), "u8s8")
    qdq.update_weight_scales(gm, plan, search=False)
    calibrate(gm, _images(16, 1), ["input"], Int8Config(calib_samples=16, calib_method="minmax").calibration_config())
    nearest = output_sqnr(gm, plan, _images(8, 4), ["input"])
    round_model(gm, plan, _images(16, 1), ["input"])
    rounded = output_sqnr(gm, plan, _images(8, 4), ["input"])
    for layer in ("stem", "mid", "fc"):
        assert 20 < rounded[layer] < 80, (layer, rounded[layer])
        assert abs(rounded[layer] - nearest[layer]) < 12
