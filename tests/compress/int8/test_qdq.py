"""Exact 8-bit weights for chosen layers under schemes "u8s8p" and "u8s7" (qdq.promote_u8u8): stored as uint8 with zero
point 128 in the exported graph, run by ONNX Runtime as integer u8 x u8 convolutions, exact where int8
8-bit weights would overflow the int16 pair sums of x86 CPUs without VNNI; never under scheme "u8s8";
rebuilt identically from a saved artifact."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from edgekit.compress import StepContext, compress, load_compressed
from edgekit.compress.int8 import pairs as pair_grid
from edgekit.compress.int8 import qdq
from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.step import apply
from edgekit.errors import BadInputError
from edgekit.export.onnx import ExportConfig, export_onnx
from edgekit.onnx_int8_kernels import fused_graph, session_for
from edgekit.sources.data import Samples
from edgekit.sources.handle import ModelHandle
from edgekit.targets import load_target
from tests.conftest import make_tiny_cnn

AVX2 = "cpu-avx2"  # x86 without VNNI: scheme "u8s8p"
VNNI = "cpu-avx512-vnni"  # scheme "u8s8"


def tiny_cnn_model() -> ModelHandle:
    """Entry point ``tests.compress.int8.test_qdq:tiny_cnn_model`` (load_compressed reloads the base from it):
    stem conv (0), depthwise conv (3), pointwise conv (5), classifier (9)."""
    h = make_tiny_cnn()
    h.source = "tests.compress.int8.test_qdq:tiny_cnn_model"
    return h


def _images(n: int, seed: int) -> Samples:
    x = np.random.default_rng(seed).standard_normal((n, 3, 32, 32)).astype(np.float32)
    return Samples("synthetic", "calib", {"input": x})


def _ctx(target: str) -> StepContext:
    return StepContext(calib=_images(32, 1), eval=_images(32, 2), progress=False, target=load_target(target))


def _weights(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """Conv / Gemm layer (by its weight DequantizeLinear's consumer) -> (stored weight, its zero point)."""
    m = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    dq_of = {n.output[0]: n for n in m.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for n in m.graph.node:
        if n.op_type in ("Conv", "Gemm", "MatMul") and len(n.input) > 1 and n.input[1] in dq_of:
            dq = dq_of[n.input[1]]
            if dq.input[0] in inits:
                out[n.name] = (inits[dq.input[0]], inits.get(dq.input[2]) if len(dq.input) > 2 else None)
    return out


def test_promoted_layers_store_uint8_weights_at_zero_point_128_and_run_exact_integer_convs(tmp_path):
    q = apply(tiny_cnn_model(), Int8Config(calib_method="minmax", u8u8_layers=("first", "5")), _ctx(AVX2))
    meta = q.steps[-1].meta
    assert meta["scheme"] == "u8s8p" and meta["u8u8_layers"] == ["0", "5"] and "u8 x u8" in meta["u8u8_reason"]
    assert meta["float_layers"] == []  # the stem asked for u8 x u8: the default float stem gives way
    export_onnx(q, tmp_path / "onnx", ExportConfig(skip_parity=True))
    path = tmp_path / "onnx" / "model.onnx"
    stored = list(_weights(path).values())
    u8 = [(w, z) for w, z in stored if w.dtype == np.uint8]
    s8 = [w for w, _ in stored if w.dtype == np.int8]
    assert len(u8) == 2 and len(s8) == 2  # the two promoted convs; the depthwise conv and the classifier
    for w, z in u8:
        assert z is not None and z.dtype == np.uint8 and z.shape == (w.shape[0],) and np.all(z == 128)
        codes = w.astype(np.int16) - 128
        assert np.abs(codes).max() >= 127  # the full 8-bit grid, beyond the 7-bit one
    classifier = next(w for w in s8 if w.ndim == 2)
    # not promoted: the pair-safe grid, 8-bit codes with no same-sign pair beyond 128
    assert np.abs(classifier.astype(np.int16)).max() > 64 and pair_grid.violations(classifier) == 0
    # ONNX Runtime fuses all three convolutions into integer QLinearConv, two of them with uint8 weights
    fused = fused_graph(path).graph
    inits = {i.name: numpy_helper.to_array(i) for i in fused.initializer}
    convs = [n for n in fused.node if n.op_type in ("QLinearConv", "ConvInteger", "Conv")]
    assert [n.op_type for n in convs] == ["QLinearConv"] * 3
    assert sum(inits[n.input[3]].dtype == np.uint8 for n in convs) == 2
    # exact on the int16-pair kernels of x86 without VNNI (modelled, or this machine's own): the same
    # outputs as exact int32 sums and as the fake-quant model
    x = _images(16, 3).inputs["input"]
    with torch.no_grad():
        ref = q.module(torch.from_numpy(x)).numpy()
    pairs = session_for(path, "int16-pairs").run(None, {"input": x})[0]
    exact = session_for(path, "int32").run(None, {"input": x})[0]
    assert np.abs(pairs - exact).max() <= 1e-5 * np.abs(exact).max()
    assert np.linalg.norm(pairs - ref) / np.linalg.norm(ref) < 1e-3


def test_the_same_8bit_weights_as_int8_would_overflow_the_pair_sums(tmp_path):
    """Promoted layers stored as int8 instead (what scheme "u8s8" writes): the int16 pair sums saturate."""
    q = apply(tiny_cnn_model(), Int8Config(calib_method="minmax", u8u8_layers=("first", "5")), _ctx(AVX2))
    export_onnx(q, tmp_path / "onnx", ExportConfig(skip_parity=True))
    m = onnx.load(str(tmp_path / "onnx" / "model.onnx"))
    for t in m.graph.initializer:  # the same codes back as int8 with zero point 0
        a = numpy_helper.to_array(t)
        if t.name.endswith("_zp_u8"):
            t.CopyFrom(numpy_helper.from_array(np.zeros(a.shape, np.int8), t.name))
        elif a.dtype == np.uint8 and a.ndim == 4:
            t.CopyFrom(numpy_helper.from_array((a.astype(np.int16) - 128).astype(np.int8), t.name))
    path = tmp_path / "as_int8.onnx"
    onnx.save(m, str(path))
    x = (np.abs(_images(16, 3).inputs["input"]) * 3).astype(np.float32)  # large inputs: high uint8 codes
    pairs = session_for(path, "int16-pairs").run(None, {"input": x})[0]
    exact = session_for(path, "int32").run(None, {"input": x})[0]
    assert np.abs(pairs - exact).max() > 1e-3 * np.abs(exact).max()  # saturated pair sums: other logits
    u8 = tmp_path / "onnx" / "model.onnx"  # the uint8 storage of the same codes: exact on those kernels
    got = session_for(u8, "int16-pairs").run(None, {"input": x})[0]
    want = session_for(u8, "int32").run(None, {"input": x})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_no_promotion_under_the_vnni_scheme(tmp_path):
    """Scheme "u8s8": the option changes nothing, the graph is byte for byte today's."""
    paths = []
    for i, layers in enumerate(((), ("first", "5"))):
        q = apply(tiny_cnn_model(), Int8Config(calib_method="minmax", u8u8_layers=layers), _ctx(VNNI))
        assert q.steps[-1].meta["scheme"] == "u8s8" and q.steps[-1].meta["u8u8_layers"] == []
        assert not any(w.u8u8 for w in qdq.weight_quants(q.module))
        export_onnx(q, tmp_path / f"v{i}", ExportConfig(skip_parity=True))
        paths.append(tmp_path / f"v{i}" / "model.onnx")
    a, b = (_weights(p) for p in paths)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k][0].dtype == np.int8 and np.array_equal(a[k][0], b[k][0])
    gm, plan = qdq.prepare_qdq(make_tiny_cnn().module, "u8s8")
    assert qdq.u8u8_candidates(gm, plan) == [] and qdq.promote_u8u8(gm, plan, ["0"]) == []


def test_reload_rebuilds_the_promoted_layers_with_identical_outputs(tmp_path):
    ctx = _ctx(AVX2)
    config = Int8Config(calib_method="minmax", u8u8_layers=("5",))
    out = compress(tiny_cnn_model(), [("int8", config)], tmp_path / "int8", ctx)
    back = load_compressed(out)
    assert back.steps[-1].meta["u8u8_layers"] == ["5"]
    assert [w.qname for w in qdq.weight_quants(back.module) if w.u8u8] == ["5"]
    direct = apply(tiny_cnn_model(), config, _ctx(AVX2))
    x = torch.from_numpy(_images(8, 4).inputs["input"])
    with torch.no_grad():
        assert torch.equal(back.module(x), direct.module(x))
    export_onnx(back, tmp_path / "onnx", ExportConfig(skip_parity=True))
    assert sum(w.dtype == np.uint8 for w, _ in _weights(tmp_path / "onnx" / "model.onnx").values()) == 1


def test_fallback_promotes_to_8bit_weights_before_float():
    ctx = _ctx(AVX2)
    q = apply(tiny_cnn_model(), Int8Config(max_accuracy_drop=0.0, equalize=False, bias_correction=False,
                                           u8u8_layers=()), ctx)
    fb = ctx.metrics["int8"]["fallback"]
    meta = q.steps[-1].meta
    assert fb["met"] and fb["final"]["top1_agreement"] == 1.0
    promoted = fb.get("u8u8_layers", [])
    assert meta["u8u8_layers"] == promoted and not set(promoted) & set(meta["float_layers"])
    assert fb["all_int8"]["top1_agreement"] < 1.0  # the budget (no drop at all) needs fallback here
    # exact 8-bit weights first, one layer, then growing steps; float only after (promoted layers included)
    assert fb["steps"][0] == {"u8u8_layers": 1, "quality": fb["steps"][0]["quality"]}
    promotions = [s for s in fb["steps"] if "u8u8_layers" in s]
    assert fb["steps"][:len(promotions)] == promotions


def test_u8u8_layers_are_checked():
    with pytest.raises(BadInputError, match="u8u8_layers must be a list"):
        Int8Config(u8u8_layers="first")  # type: ignore[arg-type]
    with pytest.raises(BadInputError, match="layer for exact 8-bit weights 'nope'.*'first'"):
        apply(tiny_cnn_model(), Int8Config(u8u8_layers=("nope",)), _ctx(AVX2))



def test_u8u8_layers_resolve_only_under_the_schemes_without_vnni():
    from edgekit.compress.int8.step import resolve_u8u8_layers

    gm, plan = qdq.prepare_qdq(make_tiny_cnn().module, "u8s7")
    assert resolve_u8u8_layers(Int8Config(), plan, "u8s7") == []  # none by default
    assert resolve_u8u8_layers(Int8Config(u8u8_layers=("first", "5", "0")), plan, "u8s7") == ["0", "5"]
    assert resolve_u8u8_layers(Int8Config(u8u8_layers=("first", "5", "0")), plan, "u8s8p") == ["0", "5"]
    assert resolve_u8u8_layers(Int8Config(u8u8_layers=("5",)), plan, "u8s8") == []


def test_u8u8_layers_are_refused_for_a_model_quantized_from_its_onnx_graph(tiny_onnx):
    from edgekit.sources.models import load_onnx_file

    with pytest.raises(BadInputError, match="u8u8_layers applies to models quantized through their PyTorch graph"):
        apply(load_onnx_file(tiny_onnx), Int8Config(u8u8_layers=("conv",)), _ctx(AVX2))
