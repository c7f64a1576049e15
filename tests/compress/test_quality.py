"""The quality gate's causal-LM statistics a block of positions at a time (``edgekit.compress.quality``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from edgekit.compress import quality
from edgekit.compress.quality import lm_head, lm_statistics
from edgekit.evaluate import window_nll
from edgekit.memory import float32_compute
from tests.tiny_models import build


def _whole(model: torch.nn.Module, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(NLL, argmax, logits rows) from the model's whole output, as the gate computed them before."""
    with torch.no_grad():
        logits = model(torch.from_numpy(ids)).logits.float()
    flat = logits.reshape(-1, logits.shape[-1])
    return window_nll(logits.numpy(), ids), flat.argmax(-1).numpy(), flat.numpy()


@pytest.mark.parametrize("family,softcap", [("llama", None), ("gemma2", 30.0), ("qwen2", None)])
def test_blocks_of_positions_give_the_whole_windows_statistics(family, softcap, monkeypatch):
    """Logits computed 5 positions at a time (``LOGITS_BLOCK`` shrunk to 5 rows of the vocabulary), with
    their NLL, argmax and kept rows taken per block: the numbers of the whole window's logits (float
    tolerance), Gemma 2's final soft-capping included; the head's forward runs on blocks, never the window."""
    model = build(family, **({"final_logit_softcapping": softcap} if family == "gemma2" else {}))
    head, cap = lm_head(model)
    assert head is model.lm_head and cap == softcap
    monkeypatch.setattr(quality, "LOGITS_BLOCK", 5 * head.out_features)
    ids = np.random.default_rng(0).integers(0, 256, (2, 23)).astype(np.int64)
    seen: list[int] = []
    head.register_forward_hook(lambda _m, a, _o: seen.append(a[0].shape[1]))
    index = np.array([0, 7, 22, 23, 40, 45])
    got = lm_statistics(model, head, cap, {"input_ids": ids}, ["input_ids"], index)
    assert got is not None and seen == [5, 5, 5, 5, 3] * 2  # two windows of 23 positions, 5 at a time
    nll, top, flat = _whole(model, ids)
    assert got.nll is not None and got.nll.shape == (2, 22) and got.rows.shape == (6, head.out_features)
    np.testing.assert_allclose(got.nll, nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.top, top)
    np.testing.assert_allclose(got.rows, flat[index], rtol=1e-5, atol=1e-5)


def test_half_stored_model_blocks_match_its_float32_copy(monkeypatch):
    """A bfloat16 model under ``float32_compute(drop_pages=True)``: the blocked statistics equal those of
    the same weights stored in float32, and the weights are stored as before afterwards."""
    model = build("llama").to(torch.bfloat16)
    full = build("llama").to(torch.bfloat16).float()
    head, cap = lm_head(model)
    monkeypatch.setattr(quality, "LOGITS_BLOCK", 4 * head.out_features)
    ids = np.random.default_rng(1).integers(0, 256, (1, 17)).astype(np.int64)
    with float32_compute(model, drop_pages=True):
        got = lm_statistics(model, head, cap, {"input_ids": ids}, ["input_ids"], np.arange(17))
    assert got is not None and all(p.dtype == torch.bfloat16 for p in model.parameters())
    nll, top, flat = _whole(full, ids)
    np.testing.assert_allclose(got.nll, nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.top, top)
    np.testing.assert_allclose(got.rows, flat, rtol=1e-5, atol=1e-5)


def test_unknown_family_is_measured_whole():
    """A family edgekit does not describe may transform its logits after the head: no blocked path."""
    assert lm_head(build("mixtral")) is None
    assert lm_head(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None


def test_gate_dequantizes_a_packed_model_once_for_all_windows_with_the_same_report(monkeypatch, tmp_path):
    """``compare`` on a 4-bit model (tiny Llama, RTN, 4 windows): its packed layers are dequantized once
    for all the windows, not on every forward, and the report (perplexity, agreement, cosine, error) is
    the one of dequantizing on every forward, to the last digit; nothing stays dequantized afterwards."""
    from contextlib import nullcontext

    from edgekit.compress import StepContext
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import apply
    from edgekit.export.packing import QuantLinear
    from tests.compress.weight_only.test_weight_only import tiny_llama

    ids = np.random.default_rng(2).integers(0, 128, (4, 32)).astype(np.int64)
    np.savez(tmp_path / "held_out.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    ctx = StepContext(eval=f"{tmp_path / 'held_out.npz'}@all", quality_windows=4, progress=False)
    handle = tiny_llama()
    reference = quality.measure_reference(handle, ctx)
    assert len(reference.feeds) == 4
    packed = apply(handle, WeightOnlyConfig(method="rtn", bits=4, group_size=32, eval_windows=0), ctx)
    layers = [m for m in packed.module.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 15  # 14 block linears and the tied head
    calls: list[int] = []
    real = QuantLinear.dequantize
    monkeypatch.setattr(QuantLinear, "dequantize", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    within_goal = quality.compare(packed, reference)  # a real gate's 1 GiB reserve leaves a tiny model nothing
    assert len(calls) == 4 * len(layers)
    calls.clear()
    monkeypatch.setattr(quality, "keep_dequantized_budget", lambda _m: 1 << 30)  # as a model with room for them
    once = quality.compare(packed, reference)
    assert len(calls) == len(layers) and all(m._kept is None for m in layers)
    calls.clear()
    monkeypatch.setattr(quality, "dequantized_once", lambda _m, **_: nullcontext(0))  # the gate as it was
    every = quality.compare(packed, reference)
    assert len(calls) == 4 * len(layers)
    assert once == every == within_goal and 1.0 < once["perplexity_ratio"] < 1.5


def test_the_gate_reports_from_a_steps_statistics_only_for_that_graph_and_reference(monkeypatch, tmp_path):
    """``Measured`` statistics stand for one graph file on one reference's feeds: the gate reports from them
    without running anything, and runs the graph itself for another reference or another file."""
    import copy

    from edgekit.sources.handle import ModelHandle

    ids = np.random.default_rng(3).integers(0, 5, (1, 8)).astype(np.int64)
    logits = np.random.default_rng(4).standard_normal((1, 8, 5)).astype(np.float32)
    feeds, index = [{"input_ids": ids}], [np.array([0, 7])]
    flat = logits.reshape(-1, 5)
    ref = quality.Reference("held out", feeds, [window_nll(logits, ids)], [flat.argmax(-1)], flat[index[0]], index)
    stats = [quality.output_statistics(torch.from_numpy(logits), feeds[0], index[0], lm=True)]
    handle = ModelHandle("lm", str(tmp_path / "int8.onnx"), kind="causal-lm", onnx_path=tmp_path / "int8.onnx")
    handle.extra[quality.MEASURED] = quality.Measured(ref, str(handle.onnx_path), stats)
    runs: list[str] = []
    monkeypatch.setattr(quality, "_runner", lambda h: runs.append(str(h.onnx_path)) or (lambda f: torch.from_numpy(logits)))
    report = quality.compare(handle, ref)
    assert runs == [] and report["perplexity_ratio"] == 1.0 and report["agreement"] == 1.0 and report["cosine"] == 1.0
    other = copy.copy(ref)  # the same numbers, another reference: measured anew
    assert quality.compare(handle, other) == report and runs == [str(handle.onnx_path)]
    handle.onnx_path = tmp_path / "rewritten.onnx"  # a later step's graph: measured anew
    assert quality.compare(handle, ref) == report and runs[-1] == str(tmp_path / "rewritten.onnx")
