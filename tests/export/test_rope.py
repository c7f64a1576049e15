"""Rotary embeddings for the causal-LM exporters (``edgekit/export/rope.py``): what each rope type
declares, the refusal of what cannot be reproduced, the trace-time patch, and the export's parity far
into the context (its gate, and the fused graph's reach)."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from edgekit.errors import BadInputError, CheckFailedError
from edgekit.export import lm
from edgekit.export.lm import check_lm_parity, export_causal_lm, lm_session, onnx_logits, torch_logits
from edgekit.export.lm_graph import supports_fused_graph
from edgekit.export.rope import (
    ROPE_TYPES,
    RopeSpec,
    check_exportable,
    check_starts,
    declared_context,
    model_rope,
    reset_rope_state,
    rope_spec,
    traceable_rope,
)
from edgekit.loading import load_model

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tiny_models import ROPE_SCALING, build, save_tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


# (threshold, original, context) of each tiny config: pretrained for 64 positions, scaled 4x
EXPECTED = {"default": (None, 256, 256), "linear": (None, 64, 256), "dynamic": (64, 64, 256),
            "yarn": (None, 64, 256), "longrope": (64, 64, 256), "llama3": (None, 64, 256)}


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_each_rope_type_declares_its_threshold_and_context(rope_type):
    model = build("llama", **ROPE_SCALING[rope_type])
    spec = model_rope(model)
    assert spec is not None and spec.rope_type == rope_type
    assert (spec.threshold, spec.original, spec.context) == EXPECTED[rope_type]
    assert spec.by_position == (rope_type in ("dynamic", "longrope"))
    assert spec.thresholds == (() if rope_type == "default" else (64,))
    record = declared_context(model)
    assert record is not None and record["tokens"] == 256 and record["rope_type"] == rope_type


def test_a_model_without_rotary_declares_its_positions():
    gpt2 = build("gpt2")
    assert model_rope(gpt2) is None
    assert declared_context(gpt2) == {"max_position_embeddings": 128, "tokens": 128}


def test_configs_of_real_models():
    """Phi-3.5-mini (longrope, 4k pretrained, 128k declared), Llama 3.1 (llama3), Qwen2.5 with yarn 4x."""
    phi = LlamaConfig(max_position_embeddings=131072, rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                                                    "long_factor": [2.0] * 48}, head_dim=96)
    phi.original_max_position_embeddings = 4096
    assert rope_spec(phi) == RopeSpec("longrope", 4096, 4096, 131072)
    llama31 = LlamaConfig(max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert rope_spec(llama31) == RopeSpec("llama3", None, 8192, 131072)
    qwen = LlamaConfig(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 32768})
    assert rope_spec(qwen) == RopeSpec("yarn", None, 32768, 131072)


def test_an_unknown_rope_type_is_refused_with_the_known_ones(tmp_path):
    h = load_model(str(save_tiny("llama", tmp_path, **ROPE_SCALING["linear"])))
    h.module.model.model.rotary_emb.rope_type = "mystery"  # what a newer transformers might define
    message = ("rope type 'mystery' is not one edgekit exports (known: default, linear, yarn, llama3, dynamic, "
               "longrope): its rotation is not known, so no graph is written")
    assert supports_fused_graph(h.module.model) == (False, message)
    with pytest.raises(BadInputError, match=r"rope type 'mystery' is not one edgekit exports \(known: "):
        export_causal_lm(h, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_a_position_dependent_rotary_outside_transformers_update_is_refused():
    model = build("llama", **ROPE_SCALING["dynamic"])
    rotary = model.model.rotary_emb

    class OwnRotary(type(rotary)):  # type: ignore[misc]
        def forward(self, x, position_ids):  # chooses its rotation some other way
            return super().forward.__wrapped__(self, x, position_ids)

    rotary.__class__ = OwnRotary
    with pytest.raises(BadInputError, match="model.rotary_emb \\(OwnRotary\\) uses 'dynamic' rope scaling but does "
                                            "not choose its rotation through transformers' dynamic_rope_update"):
        check_exportable(model)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_traceable_rope_computes_what_transformers_computes_and_restores_the_module(rope_type):
    model = build("llama", **ROPE_SCALING[rope_type])
    rotary = model.model.rotary_emb
    original = rotary.inv_freq
    x = torch.zeros(1, 1, 64)
    for start, n in ((0, 16), (56, 16), (200, 4)):  # within, crossing, beyond the threshold of 64
        positions = torch.arange(start, start + n)[None]
        reset_rope_state(model)
        with torch.no_grad():
            want = rotary(x, positions)
        reset_rope_state(model)
        with traceable_rope(model), torch.no_grad():
            got = rotary(x, positions)
        assert all(torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want, strict=True)), (start, n)
    assert "forward" not in vars(rotary) and rotary.inv_freq is original


def test_reset_forgets_what_dynamic_ntk_kept():
    model = build("llama", **ROPE_SCALING["dynamic"])
    rotary = model.model.rotary_emb
    with torch.no_grad():
        rotary(torch.zeros(1, 1, 64), torch.arange(200)[None])
    assert rotary.max_seq_len_cached == 200 and rotary.inv_freq is not rotary.original_inv_freq
    reset_rope_state(model)
    assert rotary.max_seq_len_cached == 64 and rotary.inv_freq is rotary.original_inv_freq


def test_check_starts_cross_each_threshold_and_reach_the_end_of_the_context():
    spec = RopeSpec("longrope", 64, 64, 256)
    assert check_starts(spec, prefill=16, decode=2) == [48, 64, 238]  # ends at 64; starts at 64; ends at 255
    assert check_starts(RopeSpec("default", None, 10, 10), prefill=16, decode=2) == [0]
    assert check_starts(RopeSpec("yarn", None, 4096, 131072), 16, 2) == [4080, 4096, 131054]


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_the_fused_graph_reaches_the_declared_context_beyond_4096_positions(rope_type, tmp_path):
    """max_position_embeddings 2048, scaled 4x: positions up to 8191 (the fused graph's fixed tables once
    stopped at max(max_position_embeddings, 4096) and GroupQueryAttention refused the rest). Dynamic NTK's
    tables are computed for the positions of each forward, so even positions past the declared context
    rotate as transformers rotates them."""
    config = {**ROPE_SCALING[rope_type], "max_position_embeddings": 2048}
    h = load_model(str(save_tiny("llama", tmp_path, **config)))
    out = export_causal_lm(h, tmp_path / "onnx", graph="fused")
    parity = json.loads((out / "manifest.json").read_text())["metrics"]["parity"]
    assert parity["long_context"]["starts"] == [2032, 2048, 8174] and parity["long_context"]["passed"]
    sess = lm_session(out / "model.onnx", fp32_compute=True)
    ids = h.sample_inputs(1, sequence=18)["input_ids"][:, :18]
    starts = [8174] + ([20000] if rope_type == "dynamic" else [])
    for start in starts:
        got = onnx_logits(sess, ids, 16, True, start=start)
        want = torch_logits(h.module.model, ids, 16, start=start)
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max(), start


def test_export_parity_catches_a_graph_stuck_on_the_short_context_rotation(tmp_path, monkeypatch):
    """The exporter as it was (no trace-time patch): the traced graph takes the short factors for every
    position; parity far into the context sees it, and nothing is written."""
    h = load_model(str(save_tiny("phi3", tmp_path, **ROPE_SCALING["longrope"])))
    monkeypatch.setattr(lm, "traceable_rope", lambda model: contextlib.nullcontext(model))
    with pytest.raises(CheckFailedError, match=r"the exported graph of phi3 does not compute what the PyTorch model "
                                               r"computes: far into the context \(longrope rotary, thresholds \[64\], "
                                               r"checked from positions \[48, 64, 238\]\) the logits differ by"):
        export_causal_lm(h, tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()


def test_parity_report_records_the_long_context_check(tmp_path):
    h = load_model(str(save_tiny("llama", tmp_path, **ROPE_SCALING["longrope"])))
    out = export_causal_lm(h, tmp_path / "onnx", graph="fused", parity=False)
    report = check_lm_parity(h, out / "model.onnx", atol=1e-4, rtol=1e-4)
    long = report["long_context"]
    assert report["passed"] and long["passed"] and long["rope_type"] == "longrope" and long["thresholds"] == [64]
    assert long["starts"] == [48, 64, 238] and long["tokens_each"] == 18 and long["argmax_agreement"] == 1.0
    assert long["max_rel_diff"] < 1e-5
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["context"] == {"max_position_embeddings": 256, "tokens": 256, "rope_type": "longrope",
                                            "original": 64, "thresholds": [64]}


@pytest.mark.slow  # the dynamo export of a Hugging Face decoder takes ~20 s of CPU even at this size
@pytest.mark.parametrize("rope_type", [pytest.param("dynamic", marks=pytest.mark.matrix), "longrope"])  # CI: one
def test_plain_export_follows_the_rotation_past_the_threshold(rope_type, tmp_path):
    """The export without the KV cache (what INT8 quantizes): the trace keeps both rotations (without
    the patch the dynamo and TorchScript exporters both failed on these models), and parity compares
    one sequence past the threshold besides the sample inputs."""
    import onnxruntime as ort

    from edgekit.export.onnx import export_onnx

    h = load_model(str(save_tiny("llama", tmp_path, **ROPE_SCALING[rope_type])))
    out = export_onnx(h, tmp_path / "onnx")
    parity = json.loads((out / "manifest.json").read_text())["metrics"]["parity"]
    assert parity["passed"] and "logits at 72 tokens" in parity["outputs"]
    assert parity["notes"] == [f"{rope_type} rotary: compared on 72 tokens, past its threshold of 64"]
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.tile(h.sample_inputs(1)["input_ids"], (1, 8))[:, :200]
    got = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    reset_rope_state(h.module)
    with torch.no_grad():
        want = h.module(torch.from_numpy(ids), torch.ones_like(torch.from_numpy(ids))).numpy()
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
