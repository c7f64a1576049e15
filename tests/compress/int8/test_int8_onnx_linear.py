"""INT8 from an ONNX graph with the transformer-aware "linear" placement (int8/onnx_graph.py):
Q/DQ only around MatMul/Gemm nodes with a weight initializer; LayerNorm, Softmax, the
activation x activation MatMuls and residual Adds stay float."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.compress.int8 import pairs
from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.onnx_graph import quantize_onnx_file, resolve_placement, weight_linear_nodes
from edgekit.compress.int8.step import resolve_scheme
from edgekit.errors import BadInputError
from edgekit.sources.data import Samples

D, F, C = 16, 32, 8  # hidden, FFN, classes
HOST_SCHEME = resolve_scheme(Int8Config(), None)  # what this machine's integer kernels compute exactly
WEIGHT_NODES = {"q_proj", "k_proj", "v_proj", "o_proj", "ffn_up", "ffn_down", "head"}
FLOAT_OPS = {"LayerNormalization", "Softmax", "Add", "Sigmoid", "Mul", "Transpose", "ReduceMean"}


def _tiny_encoder(path: Path) -> Path:
    """One post-LN transformer block (BERT's layout) + mean pooling + a Gemm head (transB=1)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def w(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [w("ln0.g", D, scale=0.1), w("ln0.b", D, scale=0.1), w("Wq", D, D), w("Wk", D, D), w("Wv", D, D),
             w("bq", D), w("Wo", D, D), w("bo", D), w("ln1.g", D, scale=0.1), w("ln1.b", D, scale=0.1),
             w("W1", D, F), w("b1", F), w("W2", F, D), w("b2", D), w("Wc", C, D), w("bc", C),
             numpy_helper.from_array(np.array(D ** -0.5, np.float32), "att_scale"),
             numpy_helper.from_array(np.array(1.702, np.float32), "gelu_k")]
    for i in inits[:2] + inits[8:10]:
        if i.name.endswith(".g"):
            i.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(i) + 1.0, i.name))
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln0.g", "ln0.b"], ["ln0"], name="ln0", axis=-1),
        n("MatMul", ["ln0", "Wq"], ["q0"], name="q_proj"), n("Add", ["q0", "bq"], ["q"], name="q_bias"),
        n("MatMul", ["ln0", "Wk"], ["k"], name="k_proj"),
        n("MatMul", ["ln0", "Wv"], ["v"], name="v_proj"),
        n("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s0"], name="scores"), n("Mul", ["s0", "att_scale"], ["s"], name="scale"),
        n("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["a"], name="context"),
        n("MatMul", ["a", "Wo"], ["o0"], name="o_proj"), n("Add", ["o0", "bo"], ["o"], name="o_bias"),
        n("Add", ["ln0", "o"], ["h"], name="residual1"),  # ln0 feeds Q/K/V and the residual
        n("LayerNormalization", ["h", "ln1.g", "ln1.b"], ["ln1"], name="ln1", axis=-1),
        n("MatMul", ["ln1", "W1"], ["f0"], name="ffn_up"), n("Add", ["f0", "b1"], ["f1"], name="ffn_bias"),
        n("Mul", ["f1", "gelu_k"], ["f2"], name="gelu_scale"), n("Sigmoid", ["f2"], ["f3"], name="gelu_sig"),
        n("Mul", ["f1", "f3"], ["g"], name="gelu"),
        n("MatMul", ["g", "W2"], ["f4"], name="ffn_down"), n("Add", ["f4", "b2"], ["f5"], name="ffn_down_bias"),
        n("Add", ["ln1", "f5"], ["y"], name="residual2"),
        n("ReduceMean", ["y"], ["pooled"], name="pool", axes=[1], keepdims=0),
        n("Gemm", ["pooled", "Wc", "bc"], ["logits"], name="head", transB=1),
    ]
    graph = helper.make_graph(
        nodes, "tiny-encoder", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", D])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", C])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_encoder(tmp_path_factory.mktemp("enc") / "encoder.onnx")


def _samples(n: int, seed: int) -> Samples:
    x = np.random.default_rng(seed).standard_normal((n, 6, D)).astype(np.float32)
    return Samples("random", "calib", {"x": x})


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.fixture(scope="module")
def quantized(encoder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    dst = tmp_path_factory.mktemp("q") / "encoder.int8.onnx"
    info = quantize_onnx_file(encoder, dst, _samples(32, 1), ["x"], None, 99.99, HOST_SCHEME)  # placement "auto"
    return dst, info


def test_auto_placement_is_linear_without_conv(quantized):
    _, info = quantized
    calibration = info.pop("calibration")
    assert info == {"placement": "linear", "calib_method": "mse", "calibrated_tensors": 5, "quantized_nodes": 7}
    # an ONNX file of no known kind: every value into the histograms (the sample is for causal LMs)
    assert calibration["tensors"] == 5 and calibration["hist_sample"] is None and calibration["values_observed"] > 0


def test_qdq_only_around_weight_matmuls(quantized):
    import onnx

    g = onnx.load(str(quantized[0])).graph
    producer = {o: n for n in g.node for o in n.output}
    dq_out = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
    consumers = {n.name for n in g.node if any(i in dq_out for i in n.input)}
    assert consumers == WEIGHT_NODES  # every DQ feeds a weight MatMul/Gemm, nothing else
    for n in g.node:
        if n.name in WEIGHT_NODES:  # both operands dequantized
            assert [producer[i].op_type for i in n.input[:2]] == ["DequantizeLinear", "DequantizeLinear"]
        if n.op_type in FLOAT_OPS or n.name in ("scores", "context"):
            assert not set(n.input) & dq_out, n.name
    q_inputs = sorted(n.input[0] for n in g.node if n.op_type == "QuantizeLinear")
    assert q_inputs == ["a", "g", "ln0", "ln1", "pooled"]  # one Q per activation, shared by Q/K/V
    residual = next(n for n in g.node if n.name == "residual1")
    assert list(residual.input) == ["ln0", "o"]  # the residual reads the float LayerNorm output
    assert not any(i.name in ("Wq", "W1", "Wc") for i in g.initializer)  # weights stored as int8 only


def test_weights_are_per_channel_int8(quantized):
    import onnx
    from onnx import numpy_helper

    g = onnx.load(str(quantized[0])).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    dqs = {n.input[0]: n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
           and inits[n.input[0]].ndim == 2}
    assert len(dqs) == 7
    for name, n in dqs.items():
        q, scale = inits[name], inits[n.input[1]]
        axis = next(a.i for a in n.attribute if a.name == "axis")
        assert q.dtype == np.int8 and np.abs(q).max() > 64  # 8-bit codes; where sums saturate, pair-safe ones
        assert pairs.violations(np.moveaxis(q, axis, 0)) == 0 or HOST_SCHEME == "u8s8"
        assert scale.shape == (q.shape[axis],)
        assert axis == (0 if name.startswith("Wc") else 1)  # Gemm transB: (out, in)


def test_output_close_to_float_and_engine_runs_integer_matmuls(encoder, quantized, tmp_path):
    import onnx
    import onnxruntime as ort

    x = _samples(16, 2).inputs["x"]  # not the calibration data
    ref, y = _run(encoder, x), _run(quantized[0], x)
    cos = (ref * y).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(y, axis=-1))
    assert cos.min() > 0.995
    assert np.abs(y - ref).max() < 0.05 * np.abs(ref).max()
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(quantized[0]), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node]
    assert ops.count("MatMulIntegerToFloat") >= 6
    assert "QLinearSoftmax" not in ops and "QLinearAdd" not in ops


@pytest.mark.parametrize("target", ["cpu-avx2", "cpu-avx512-vnni"])
def test_each_cpu_kind_runs_its_own_scheme_close_to_float(encoder, tmp_path, target):
    """The scheme each CPU kind gets, on that kind's integer kernels (this machine's or their model):
    within cosine 0.995 of the float graph; the 8-bit weights of the VNNI scheme on kernels without
    VNNI are not."""
    from edgekit.onnx_int8_kernels import semantics_for_target, session_for
    from edgekit.targets import load_target

    tgt = load_target(target)
    x = _samples(16, 2).inputs["x"]
    ref = _run(encoder, x)

    def cosine(path: Path, semantics: str) -> float:
        y = session_for(path, semantics).run(None, {"x": x})[0]
        return float(((ref * y).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(y, axis=-1))).min())

    dst = tmp_path / f"{target}.onnx"
    quantize_onnx_file(encoder, dst, _samples(32, 1), ["x"], None, 99.99, resolve_scheme(Int8Config(), tgt))
    assert cosine(dst, semantics_for_target(tgt)) > 0.995
    if target == "cpu-avx512-vnni":
        assert cosine(dst, "int16-pairs") < 0.99  # this graph on an AVX2 CPU


def test_all_placement_quantizes_more_than_linear(encoder, tmp_path):
    import onnx

    dst = tmp_path / "all.onnx"
    info = quantize_onnx_file(encoder, dst, _samples(16, 1), ["x"], "minmax", 99.99, "u8s8", placement="all")
    g = onnx.load(str(dst)).graph
    dq_out = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
    assert info["placement"] == "all"
    assert any(n.op_type == "Add" and set(n.input) & dq_out for n in g.node)


def test_trt_scheme_is_symmetric_int8(encoder, tmp_path):
    import onnx
    from onnx import numpy_helper

    dst = tmp_path / "trt.onnx"
    quantize_onnx_file(encoder, dst, _samples(16, 1), ["x"], "minmax", 99.99, "trt", placement="linear")
    g = onnx.load(str(dst)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    zps = [inits[n.input[2]] for n in g.node if n.op_type == "QuantizeLinear"]
    assert zps and all(z.dtype == np.int8 and int(z) == 0 for z in zps)


def test_no_weight_matmul_is_bad_input(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"], name="mm")], "aa",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
                               helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 2])],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert weight_linear_nodes(model) == []
    path = tmp_path / "aa.onnx"
    onnx.save(model, str(path))
    with pytest.raises(BadInputError, match="no MatMul or Gemm with a weight initializer"):
        quantize_onnx_file(path, tmp_path / "q.onnx", Samples("s", "calib", {"a": np.ones((8, 2, 3), np.float32)}),
                           ["a"], None, 99.99, "u8s8", placement="linear")


BAD = "unknown INT8 placement 'everything' (choose from 'all', 'auto', 'linear')"


def test_bad_placement_is_one_line_error(encoder, tmp_path):
    import onnx

    with pytest.raises(BadInputError) as e:
        Int8Config(placement="everything")
    assert str(e.value) == BAD
    with pytest.raises(BadInputError) as e:
        resolve_placement(onnx.load(str(encoder)), "everything")
    assert str(e.value) == BAD


def test_cli_bad_placement_exits_2(encoder, tmp_path):
    from click.testing import CliRunner

    from edgekit.cli import cli

    r = CliRunner().invoke(cli, ["compress", str(encoder), "--bits", "8", "--placement", "everything",
                                 "-o", str(tmp_path / "out")])
    assert r.exit_code == 2
    assert r.output.strip() == f"error: {BAD}"


@pytest.mark.slow
def test_minilm_linear_int8_keeps_sentence_embeddings(tmp_path):
    """Real model: MiniLM-L6 through the ONNX path (torch.fx cannot trace the BERT wrapper)."""
    from edgekit.compress import StepContext
    from edgekit.compress.int8.step import apply
    from edgekit.loading import load_model
    from edgekit.sources.data import load_samples

    h = load_model("minilm-l6")
    calib = load_samples(None, h, split="calib", limit=16)
    ev = load_samples(None, h, split="eval", limit=16)
    ctx = StepContext(calib=calib, eval=ev, work_dir=tmp_path / "w", progress=False)
    q = apply(h, Int8Config(calib_samples=16), ctx)
    m = ctx.metrics["int8"]
    assert q.module is None and m["placement"] == "linear" and m["calib_method"] == "mse"
    assert m["quantized_nodes"] == 36
    assert m["int8"]["mean_cosine"] > 0.98 and m["int8"]["min_cosine"] > 0.97  # measured 0.994 / 0.987


# --- a causal LM: compared with its float graph token by token, on a bounded number of windows -------------


def _tiny_bigram_lm(path: Path, vocab: int = 260, hidden: int = 32) -> Path:
    """A bigram causal LM over the byte vocabulary: embedding, a ReLU MLP, the LM head (logits (b, t, vocab))."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name)
             for name, shape, s in (("embed", (vocab, hidden), 1.0), ("W1", (hidden, 4 * hidden), 0.3),
                                    ("W2", (4 * hidden, hidden), 0.3), ("head", (hidden, vocab), 0.05))]
    n = helper.make_node
    nodes = [n("Gather", ["embed", "input_ids"], ["e"], name="embed", axis=0),
             n("MatMul", ["e", "W1"], ["h0"], name="up"), n("Relu", ["h0"], ["h1"], name="relu"),
             n("MatMul", ["h1", "W2"], ["h2"], name="down"), n("Add", ["e", "h2"], ["h"], name="residual"),
             n("MatMul", ["h", "head"], ["logits"], name="lm_head")]
    ids = [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "sequence"])
           for name in ("input_ids", "attention_mask")]
    graph = helper.make_graph(nodes, "bigram-lm", ids, [helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, ["batch", "sequence", vocab])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _bigram_handle(tmp_path: Path, seqlen: int):
    """The tiny bigram LM as an ONNX-only causal-LM handle (byte tokenizer, windows of ``seqlen`` tokens)."""
    import sys

    from edgekit.sources.handle import InputSpec, ModelHandle

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tiny_models import byte_tokenizer

    path = _tiny_bigram_lm(tmp_path / "lm.onnx")
    seq = ("batch", "sequence")
    return ModelHandle("bigram-lm", str(path), kind="causal-lm", onnx_path=path, outputs=["logits"],
                       inputs=[InputSpec("input_ids", seq, "int64"), InputSpec("attention_mask", seq, "int64")],
                       tokenizer=byte_tokenizer(), evaluator="perplexity", extra={"seqlen": seqlen})


@pytest.mark.parametrize("eval_samples,windows", [(None, 8), (3, 3)])
def test_a_causal_lm_is_compared_token_by_token_on_a_bounded_number_of_windows(tmp_path, eval_samples, windows):
    """The eval split holds thousands of 32-token Wikipedia windows: by default the first 8 (the compress
    gate's) are compared, one at a time, with per-token metrics (not one argmax over a whole window)."""
    import json

    from edgekit.compress import StepContext, compress, make_config
    from edgekit.compress.quality import EVAL_WINDOWS

    handle = _bigram_handle(tmp_path, seqlen=32)
    cfg = make_config("int8", {"calib_samples": 16, **({} if eval_samples is None else {"eval_samples": eval_samples})})
    out = compress(handle, [("int8", cfg)], tmp_path / "int8", StepContext(calib="lee-news", eval="wikipedia",
                                                                             progress=False))
    manifest = json.loads((out / "manifest.json").read_text())
    metrics = manifest["metrics"]["int8"]
    # a causal LM keeps its feed-forward down projection in float by default (W2: 128 -> 32), and says so
    assert manifest["steps"][-1]["meta"]["keep_float"] == ["ffn-down"]
    assert manifest["steps"][-1]["meta"]["float_layers"] == ["down"] and metrics["quantized_nodes"] == 2
    assert EVAL_WINDOWS == 8 and metrics["compared_on"]["data"] == "eval data"
    assert metrics["compared_on"]["samples"] == windows and "integer kernels" in metrics["compared_on"]["kernels"]
    int8 = metrics["int8"]
    assert int8["windows"] == windows and int8["tokens"] == windows * 32
    assert 0.5 < int8["top1_agreement"] <= int8["top5_agreement"] <= 1.0 and 0 <= int8["mean_kl"] < 0.1
    assert int8["perplexity_reference"] > 1 and 0.9 < int8["perplexity_ratio"] < 1.1
    drift = metrics["outputs"]["logits"]
    assert 0.95 < drift["min_cosine"] <= drift["mean_cosine"] <= 1.0 and drift["max_abs_diff"] == int8["max_abs_diff"]
    # the linears' inputs were observed (3 tensors, 32 tokens x 16 windows each), not the logits
    assert metrics["calibration"]["tensors"] == 3 and metrics["calibration"]["values_observed"] == 16 * 32 * (32 + 128 + 32)


def _token_windows(split: str, n: int, seqlen: int, seed: int) -> Samples:
    ids = np.random.default_rng(seed).integers(0, 260, (n, seqlen)).astype(np.int64)
    return Samples("random tokens", split, {"input_ids": ids, "attention_mask": np.ones_like(ids)})


def test_the_step_and_the_gate_share_one_run_of_the_int8_graph_with_the_numbers_of_two(tmp_path, monkeypatch):
    """With the gate's float reference measured on the step's own eval windows (what compress() does), the
    step runs no float model and the INT8 graph once: its per-token figures are compare_lm's against the float
    graph, its drift figures those of the same rows of the full logits, and the gate's report from the step's
    statistics is the one of running the graph again, to the last digit."""
    import onnxruntime as ort

    from edgekit.compress import StepContext, quality
    from edgekit.compress.int8 import onnx_graph
    from edgekit.compress.int8.step import apply
    from edgekit.evaluate import compare_lm
    from edgekit.onnx_int8_kernels import host_semantics, session_for

    handle = _bigram_handle(tmp_path, seqlen=32)
    ev = _token_windows("eval", 8, 32, seed=1)
    ctx = StepContext(calib=_token_windows("calib", 16, 32, seed=0), eval=ev, progress=False)  # type: ignore[arg-type]
    ctx.quality_reference = reference = quality.measure_reference(handle, ctx)
    float_runs: list[int] = []
    monkeypatch.setattr(onnx_graph, "reference_on", lambda *a: float_runs.append(1) or quality.reference_on(*a))
    q = apply(handle, Int8Config(calib_samples=16), ctx)
    m = ctx.metrics["int8"]
    assert float_runs == [] and m["compared_on"]["reference"] == "the quality gate's float reference"
    measured = q.extra[quality.MEASURED]
    assert measured.reference is reference and len(measured.stats) == 8
    shared = quality.compare(q, reference)
    q.extra = {k: v for k, v in q.extra.items() if k != quality.MEASURED}
    assert shared == quality.compare(q, reference) and 0.9 < shared["perplexity_ratio"] < 1.1  # ran the graph

    # the per-token figures: compare_lm's of the INT8 graph against the float graph, all 8 x 32 tokens
    int8 = session_for(q.onnx_path, host_semantics())
    flt = ort.InferenceSession(str(handle.onnx_path), providers=["CPUExecutionProvider"])
    before = compare_lm(lambda f: int8.run(None, f), lambda f: flt.run(None, f), ev)
    got = m["int8"]
    assert got["windows"] == 8 and got["tokens"] == 8 * 32
    for k in ("top1_agreement", "top5_agreement", "perplexity", "perplexity_reference", "perplexity_ratio"):
        assert got[k] == pytest.approx(before[k], rel=1e-6), k
    assert got["perplexity"] == pytest.approx(shared["perplexity"], rel=1e-6)
    # the drift figures: over the float reference's kept rows of the full logits (8 a window)
    rows = [(w, int(i)) for w, idx in enumerate(reference.row_index) for i in idx]
    full_q = [int8.run(None, ev.subset(slice(w, w + 1)).inputs)[0].reshape(-1, 260) for w in range(8)]
    full_f = [flt.run(None, ev.subset(slice(w, w + 1)).inputs)[0].reshape(-1, 260) for w in range(8)]
    g = np.stack([full_q[w][i] for w, i in rows]).astype(np.float64)
    r = np.stack([full_f[w][i] for w, i in rows]).astype(np.float64)
    cos = (g * r).sum(1) / (np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1))

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    lg, lr = log_softmax(g), log_softmax(r)
    drift = m["outputs"]["logits"]
    assert drift["rows"] == len(rows) == 64
    assert drift["mean_cosine"] == pytest.approx(cos.mean(), rel=1e-5)
    assert drift["min_cosine"] == pytest.approx(cos.min(), rel=1e-5)
    assert drift["max_abs_diff"] == pytest.approx(np.abs(g - r).max(), rel=1e-5) == got["max_abs_diff"]
    assert drift["mean_abs_diff"] == pytest.approx(np.abs(g - r).mean(), rel=1e-5)
    assert got["mean_kl"] == pytest.approx((np.exp(lr) * (lr - lg)).sum(1).mean(), rel=1e-4, abs=1e-9)


def test_other_windows_than_the_gates_get_a_float_reference_of_their_own(tmp_path):
    """eval_samples 3 against the gate's 8 windows: the step measures the float graph on its 3 windows, and
    leaves the gate nothing to report from (it runs the graph on its own windows)."""
    from edgekit.compress import StepContext, quality
    from edgekit.compress.int8.step import apply

    handle = _bigram_handle(tmp_path, seqlen=32)
    ctx = StepContext(calib=_token_windows("calib", 16, 32, seed=0), eval=_token_windows("eval", 8, 32, seed=1),
                      progress=False)  # type: ignore[arg-type]
    ctx.quality_reference = quality.measure_reference(handle, ctx)
    q = apply(handle, Int8Config(calib_samples=16, eval_samples=3), ctx)
    m = ctx.metrics["int8"]
    assert m["int8"]["windows"] == 3 and m["compared_on"]["reference"] != "the quality gate's float reference"
    assert m["outputs"]["logits"]["rows"] == 3 * (quality.COSINE_ROWS // 3)
    assert quality.MEASURED not in q.extra and 0.9 < quality.compare(q, ctx.quality_reference)["perplexity_ratio"] < 1.1


# --- layers kept in float, the observation graph, the histogram sample ---------------------------------------


def _dequantized(model, tensor: str) -> bool:
    return any(n.op_type == "DequantizeLinear" and tensor in n.output for n in model.graph.node)


def test_layers_kept_in_float_stay_float_in_the_graph(encoder, tmp_path):
    """``keep_float`` names layers (or "first" / "last"): their weights stay float initializers and the
    inputs only they read get no Q/DQ; every other weight MatMul is quantized as before."""
    import onnx

    dst = tmp_path / "q.onnx"
    info = quantize_onnx_file(encoder, dst, _samples(32, 1), ["x"], None, 99.99, HOST_SCHEME, placement="linear",
                              keep_float=("ffn_down", "last"))
    model = onnx.load(str(dst))
    nodes = {n.name: n for n in model.graph.node}
    floats = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    for name in ("ffn_down", "head"):
        assert nodes[name].input[1] in floats and not _dequantized(model, nodes[name].input[0])
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "ffn_up"):
        assert _dequantized(model, nodes[name].input[0]) and _dequantized(model, nodes[name].input[1])
    assert info["float_layers"] == ["ffn_down", "head"] and info["quantized_nodes"] == 5
    x = _samples(8, 7).inputs["x"]
    ref, got = _run(encoder, x), _run(dst, x)
    cos = (ref * got).sum(-1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))
    assert cos.min() > 0.99


def test_an_unknown_float_layer_is_refused_before_calibration(encoder, tmp_path, monkeypatch):
    from edgekit.compress.int8 import onnx_graph as int8_onnx

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before the layer names were checked")

    monkeypatch.setattr(int8_onnx, "_observe", no_calibration)
    with pytest.raises(BadInputError) as e:
        quantize_onnx_file(encoder, tmp_path / "q.onnx", _samples(16, 1), ["x"], None, 99.99, HOST_SCHEME,
                           placement="linear", keep_float=("down_proj",))
    msg = str(e.value)
    assert "\n" not in msg and "no layer 'down_proj'" in msg and "ffn_down" in msg and "first, last" in msg
    assert not (tmp_path / "q.onnx").exists()
    with pytest.raises(BadInputError, match="needs placement 'linear'"):
        quantize_onnx_file(encoder, tmp_path / "q.onnx", _samples(16, 1), ["x"], None, 99.99, HOST_SCHEME,
                           placement="all", keep_float=("last",))


def test_ffn_down_finds_the_feed_forward_down_projection_by_its_shape(encoder, tmp_path):
    """"ffn-down" names the linears that narrow the widest input back (here ffn_down: 32 -> 16; the Gemm
    head reads 16), whatever the family calls them; "none" keeps nothing in float."""
    info = quantize_onnx_file(encoder, tmp_path / "q.onnx", _samples(16, 1), ["x"], None, 99.99, HOST_SCHEME,
                              placement="linear", keep_float=("ffn-down",))
    assert info["float_layers"] == ["ffn_down"] and info["quantized_nodes"] == 6
    info = quantize_onnx_file(encoder, tmp_path / "q.onnx", _samples(16, 1), ["x"], None, 99.99, HOST_SCHEME,
                              placement="linear", keep_float=("none",))
    assert "float_layers" not in info and info["quantized_nodes"] == 7


def test_layers_are_named_by_the_exporters_module_paths():
    """The dynamo exporter records each node's module path (``pkg.torch.onnx.name_scopes``): "down_proj"
    names every block's, a longer path one block's, and nodes without it go by their own name."""
    import onnx
    from onnx import helper

    from edgekit.compress.int8.onnx_graph import layer_names, resolve_float_layers

    def linear(name: str, path: str | None) -> object:
        n = helper.make_node("MatMul", ["x", "w"], [name + "_out"], name=name)
        if path is not None:
            p = n.metadata_props.add()
            p.key, p.value = "pkg.torch.onnx.name_scopes", repr(["", "model", path, name])
        return n

    nodes = [linear("node_linear", "model.model.layers.0.mlp.down_proj"),
             linear("node_linear_1", "model.model.layers.1.mlp.down_proj"),
             linear("node_linear_2", "model.lm_head"), linear("plain", None)]
    assert layer_names(nodes)["node_linear_2"] == "model.lm_head" and layer_names(nodes)["plain"] == "plain"
    src, model = Path("m.onnx"), onnx.ModelProto()
    assert resolve_float_layers(model, nodes, ("down_proj",), src) == ["node_linear", "node_linear_1"]
    assert resolve_float_layers(model, nodes, ("layers.1.mlp.down_proj", "lm_head"), src) == ["node_linear_1",
                                                                                              "node_linear_2"]
    assert resolve_float_layers(model, nodes, ("first", "plain"), src) == ["node_linear", "plain"]
    assert resolve_float_layers(model, nodes, ("none",), src) == []
    with pytest.raises(BadInputError, match="no layer 'proj'.*: down_proj, lm_head, plain$"):
        resolve_float_layers(model, nodes, ("proj",), src)


def test_the_observed_graph_computes_only_the_calibrated_tensors(tmp_path):
    """Calibration runs the graph with the calibrated tensors as its only outputs: a causal LM's
    vocabulary-sized head (after the last calibrated tensor) is not computed, and the graph being
    quantized is left as it was."""
    import onnx

    from edgekit.compress.int8.onnx_graph import _save_observed

    model = onnx.load(str(_tiny_bigram_lm(tmp_path / "lm.onnx")))
    before = model.SerializeToString()
    _save_observed(model, ["e", "h1", "h"], tmp_path / "observed.onnx")
    observed = onnx.load(str(tmp_path / "observed.onnx"))
    assert [o.name for o in observed.graph.output] == ["e", "h1", "h"]
    assert [n.name for n in observed.graph.node] == ["embed", "up", "relu", "down", "residual"]  # no lm_head
    assert model.SerializeToString() == before


def test_a_tied_lm_head_can_be_kept_in_float(tmp_path):
    """A tied head reads the embedding through a Transpose: a weight only after constant folding. Naming
    it passes the check made before calibration, and it stays float in the written graph."""
    import onnx
    from onnx import helper

    model = onnx.load(str(_tiny_bigram_lm(tmp_path / "lm.onnx", hidden=32)))
    head = next(n for n in model.graph.node if n.name == "lm_head")
    model.graph.node.insert(len(model.graph.node) - 1, helper.make_node("Transpose", ["embed"], ["embed_t"],
                                                                        name="tie", perm=[1, 0]))
    head.input[1] = "embed_t"
    onnx.save(model, str(tmp_path / "tied.onnx"))
    ids = np.random.default_rng(0).integers(0, 260, (16, 12)).astype(np.int64)
    samples = Samples("random", "calib", {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    info = quantize_onnx_file(tmp_path / "tied.onnx", tmp_path / "q.onnx", samples, ["input_ids", "attention_mask"],
                              None, 99.99, HOST_SCHEME, placement="linear", keep_float=("lm_head",))
    assert info["float_layers"] == ["lm_head"] and info["quantized_nodes"] == 2
    written = onnx.load(str(tmp_path / "q.onnx"))
    head = next(n for n in written.graph.node if n.name == "lm_head")
    assert not _dequantized(written, head.input[0]) and not _dequantized(written, head.input[1])


def test_a_calib_split_smaller_than_asked_is_used_whole_and_said(tmp_path):
    """SmolLM2's lee-news calib split holds 90 windows of 512 tokens and the default asks 128: the
    default command calibrates on all of them and says so, instead of refusing."""
    import json

    from edgekit.compress import StepContext, compress, make_config
    from edgekit.sources.data import load_samples

    handle = _bigram_handle(tmp_path, seqlen=8192)
    held = len(load_samples("lee-news", handle, split="calib"))
    with pytest.raises(BadInputError, match="asked for"):
        load_samples("lee-news", handle, split="calib", limit=held + 1)
    cfg = make_config("int8", {"calib_samples": held + 1, "eval_samples": 1})
    out = compress(handle, [("int8", cfg)], tmp_path / "int8", StepContext(calib="lee-news", eval="wikipedia",
                                                                             progress=False))
    metrics = json.loads((out / "manifest.json").read_text())["metrics"]["int8"]
    assert metrics["calib_samples"] == held >= 2
    assert metrics["calib_note"] == f"the calib split holds {held} samples, fewer than the {held + 1} asked: all used"


def test_a_causal_lm_calibrates_on_32_windows_unless_told_and_records_the_number(tmp_path):
    """Not given, ``calib_samples`` is the model kind's: 32 token windows for a causal LM (chosen on validation
    windows, benchmarks/RESULTS.md issue 31), 128 for other models; the step records the number it used."""
    import json

    from edgekit.compress import StepContext, compress, make_config
    from edgekit.compress.int8.config import DEFAULT_CALIB_SAMPLES, LM_CALIB_WINDOWS, Int8Config

    assert (LM_CALIB_WINDOWS, DEFAULT_CALIB_SAMPLES) == (32, 128)
    assert Int8Config().calibration_config().samples == 128  # outside the step: the general default
    handle = _bigram_handle(tmp_path, seqlen=32)  # thousands of 32-token windows in the calib split
    out = compress(handle, [("int8", make_config("int8", {"eval_samples": 1}))], tmp_path / "int8",
                   StepContext(calib="lee-news", eval="wikipedia", progress=False))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["metrics"]["int8"]["calib_samples"] == 32 and "calib_note" not in manifest["metrics"]["int8"]
    assert manifest["steps"][-1]["config"]["calib_samples"] == 32
