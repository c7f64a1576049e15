"""The fused decoder graph of Gemma 2 and 3 (``export/lm_graph.py``): written by default for both,
and matching transformers on a prefill longer than the sliding window and on decode steps after
it, float and 4-bit (tied embedding and head stored once); Mistral's window on every layer; the
file written a tensor at a time."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from edgekit.compress import StepContext, compress, load_compressed, make_config
from edgekit.export.lm import export_causal_lm
from edgekit.export.lm_graph import FusedGraphConfig, build_fused_decoder, fused_decoder_parts, save_parts
from edgekit.loading import load_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from lm_decode import decode_logits, reference_logits, rel_error, token_ids  # noqa: E402
from tiny_models import build, save_tiny  # noqa: E402

WINDOW = 8  # sliding window of the tiny models' local layers: the prompt runs past it
PROMPT, STEPS = 20, 6
FLOAT_REL = 1e-4  # fp32 graph against fp32 PyTorch
PACKED_REL = 1e-3  # the packed model's dequantized weights, fp32 compute


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_gemma_exports_the_fused_graph_and_matches_transformers(family, tmp_path):
    h = load_model(str(save_tiny(family, tmp_path, sliding_window=WINDOW)))
    out = export_causal_lm(h, tmp_path / "onnx")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["graph"] == "fused" and manifest["metrics"]["parity"]["passed"]
    graph = onnx.load(str(out / "model.onnx")).graph
    attn = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attn) == 2
    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), -1) for n in attn]
    assert windows == [WINDOW, -1]  # layer 0 slides, layer 1 is global
    ops = {n.op_type for n in graph.node}
    assert "FastGelu" in ops and ("Tanh" in ops) == (family == "gemma2")  # Gemma 2 soft-caps its logits
    if family == "gemma3":  # the sliding layer reads its own rotary base
        inits = {i.name for i in graph.initializer}
        assert {"rotary.inv_freq", "rotary_local.inv_freq"} <= inits
        assert [n.input[7] for n in attn] == ["cos_cache_local", "cos_cache"]
    tables = [i.name for i in graph.initializer if 260 in i.dims and int(np.prod(i.dims)) >= 260 * 64]
    assert tables == ["lm_head.weight"]  # the tied table once: the head's (hidden, vocab), gathered by column
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(h, ids)) < FLOAT_REL


def test_every_norm_of_the_gemma_graph_runs_fused(tmp_path):
    """ONNX Runtime fuses every RMSNorm the graph writes in standard ops (the first input norm, the
    post-attention and post-MLP norms, the q/k norms) into SimplifiedLayerNormalization."""
    import onnxruntime as ort

    h = load_model(str(save_tiny("gemma3", tmp_path)))
    out = export_causal_lm(h, tmp_path / "onnx", parity=False)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(out / "model.onnx"), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert ops.count("SimplifiedLayerNormalization") == 1 + 2 * 4 and "ReduceMean" not in ops


def test_4bit_gemma3_fused_graph_stores_the_tied_table_once_and_matches_the_packed_model(tmp_path):
    h = load_model(str(save_tiny("gemma3", tmp_path, sliding_window=WINDOW)))
    cfg = make_config("weight-only", {"method": "rtn", "bits": 4, "group_size": 32, "head": "int4", "eval_windows": 0})
    w4 = load_compressed(compress(h, [("weight-only", cfg)], tmp_path / "w4", StepContext(calib="lee-news", eval="wikipedia",
                                                                                   progress=False)))
    out = export_causal_lm(w4, tmp_path / "onnx", accuracy_level=None)
    assert json.loads((out / "manifest.json").read_text())["config"]["graph"] == "fused"
    graph = onnx.load(str(out / "model.onnx")).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2 and "GatherBlockQuantized" in ops
    assert ops.count("MatMulNBits") == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
    tables = [i.name for i in graph.initializer if i.dims and i.dims[0] == 260 and int(np.prod(i.dims)) * 2 >= 260 * 64]
    assert tables == ["lm_head.qweight"], tables  # 4-bit codes of (vocab, hidden): the embedding reads the head's
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(w4, ids)) < PACKED_REL


def test_graph_written_a_tensor_at_a_time_loads_as_the_assembled_graph(tmp_path):
    """``save_parts`` (the export's writer: the graph, then one initializer at a time) gives the file
    ``onnx.save`` gives for the assembled model, read back as the same model."""
    model = build("gemma3")
    skeleton, tensors = fused_decoder_parts(model, FusedGraphConfig())
    save_parts(skeleton, tensors, tmp_path / "parts.onnx")
    whole = build_fused_decoder(model, FusedGraphConfig())
    onnx.save(whole, str(tmp_path / "whole.onnx"))
    assert len(tensors) == len(whole.graph.initializer) > 0
    assert onnx.load(str(tmp_path / "parts.onnx")) == onnx.load(str(tmp_path / "whole.onnx"))


def test_graph_with_external_data_written_a_tensor_at_a_time_loads_as_the_assembled_graph(tmp_path, monkeypatch):
    """``save_parts_external`` (the export's writer past 2 GB: each initializer's bytes appended to
    ``model.onnx.data``, the graph with their headers) reads back as the assembled model, with large
    tensors at page boundaries, and ONNX Runtime computes the same logits from it."""
    import edgekit.export.lm_graph as lm_graph
    from edgekit.export.lm_graph import save_parts_external

    monkeypatch.setattr(lm_graph, "EXTERNAL_ALIGN_FROM", 1024)  # align the tiny model's larger tables too
    model = build("gemma3")
    skeleton, tensors = fused_decoder_parts(model, FusedGraphConfig())
    before = skeleton.SerializeToString()
    (tmp_path / "ext").mkdir()
    save_parts_external(skeleton, tensors, tmp_path / "ext" / "model.onnx")
    assert skeleton.SerializeToString() == before  # the caller's graph is left as it was (the twin is written next)
    whole = build_fused_decoder(model, FusedGraphConfig())
    onnx.save(whole, str(tmp_path / "whole.onnx"))
    headers = onnx.load(str(tmp_path / "ext" / "model.onnx"), load_external_data=False).graph.initializer
    sizes = dict((n, a.nbytes) for n, a in tensors)
    assert len(headers) == len(tensors) > 0
    assert all((h.data_location == onnx.TensorProto.EXTERNAL) == (sizes[h.name] >= 1024) for h in headers)
    where = {h.name: {e.key: e.value for e in h.external_data} for h in headers if sizes[h.name] >= 1024}
    assert where  # the tiny model's tables and layers
    assert all(w["location"] == "model.onnx.data" and int(w["length"]) == sizes[n] for n, w in where.items())
    aligned = [n for n, w in where.items() if sizes[n] >= 1024]
    assert aligned and all(int(where[n]["offset"]) % 4096 == 0 for n in aligned)
    assert (tmp_path / "ext" / "model.onnx.data").stat().st_size >= sum(sizes[n] for n in where)
    got, want = onnx.load(str(tmp_path / "ext" / "model.onnx")), onnx.load(str(tmp_path / "whole.onnx"))
    assert list(got.graph.node) == list(want.graph.node) and list(got.graph.input) == list(want.graph.input)
    assert [(t.name, list(t.dims), t.data_type) for t in got.graph.initializer] == \
        [(t.name, list(t.dims), t.data_type) for t in want.graph.initializer]
    for a, b in zip(got.graph.initializer, want.graph.initializer, strict=True):
        assert np.array_equal(onnx.numpy_helper.to_array(a), onnx.numpy_helper.to_array(b)), a.name
    ids = token_ids(PROMPT + STEPS)
    assert np.array_equal(decode_logits(tmp_path / "ext" / "model.onnx", ids, PROMPT),
                          decode_logits(tmp_path / "whole.onnx", ids, PROMPT))


def test_mistral_fused_graph_slides_its_window_on_every_layer(tmp_path):
    """Mistral's config has a window and no layer types: every layer slides (before, the fused graph
    attended to the whole past, 0.93 relative error on the logits past the window)."""
    h = load_model(str(save_tiny("mistral", tmp_path, sliding_window=WINDOW)))
    out = export_causal_lm(h, tmp_path / "onnx")
    attn = [n for n in onnx.load(str(out / "model.onnx")).graph.node if n.op_type == "GroupQueryAttention"]
    assert [next(a.i for a in n.attribute if a.name == "local_window_size") for n in attn] == [WINDOW, WINDOW]
    ids = token_ids(PROMPT + STEPS)
    assert rel_error(decode_logits(out / "model.onnx", ids, PROMPT), reference_logits(h, ids)) < FLOAT_REL


def test_weights_spilled_as_each_layer_is_made_write_the_same_files(tmp_path, monkeypatch):
    """``fused_decoder_parts(spill=...)`` writes every initializer of ``SPILL_FROM`` bytes and more to the
    spill file as it is made (the export then never holds a second copy of the packed model): the graph's
    file, single or with external data, is byte for byte the one written from arrays in memory, the tied
    table (read back from the spill file to check it) stored once."""
    import edgekit.export.lm_graph as lm_graph
    from edgekit.export.lm_graph import SpilledArray, save_parts_external

    monkeypatch.setattr(lm_graph, "SPILL_FROM", 1024)
    model = build("gemma3")
    skeleton, tensors = fused_decoder_parts(model, FusedGraphConfig())
    spilled_skeleton, spilled = fused_decoder_parts(model, FusedGraphConfig(), spill=tmp_path / "weights.bin")
    assert [n for n, _ in spilled] == [n for n, _ in tensors]
    assert all(isinstance(t, SpilledArray) == (a.nbytes >= 1024) for (_, t), (_, a) in zip(spilled, tensors, strict=True))
    assert sum(isinstance(t, SpilledArray) for _, t in spilled) >= 10 and "lm_head.weight" in dict(spilled)
    assert (tmp_path / "weights.bin").stat().st_size == sum(a.nbytes for _, a in tensors if a.nbytes >= 1024)
    for sub, write in (("single", save_parts), ("external", save_parts_external)):
        for kind, (sk, ts) in (("memory", (skeleton, tensors)), ("spilled", (spilled_skeleton, spilled))):
            (tmp_path / sub / kind).mkdir(parents=True)
            write(sk, ts, tmp_path / sub / kind / "model.onnx")
        for f in (tmp_path / sub / "memory").iterdir():
            assert f.read_bytes() == (tmp_path / sub / "spilled" / f.name).read_bytes(), (sub, f.name)
