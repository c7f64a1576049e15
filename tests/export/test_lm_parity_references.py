"""The causal-LM export's parity checks compare with PyTorch logits computed once, before any ONNX
Runtime session opens (``lm_references``): the same numbers as each check computing its own, the
packed model's forwards never beside a session, and the fp32 twin, the int8-compute graph and the
check against the float model sharing one set of forwards."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from edgekit.export import lm
from edgekit.export.lm import (
    INT8_COMPUTE_RTOL,
    check_against_float,
    check_lm_parity,
    export_causal_lm,
    lm_references,
    lm_session,
    onnx_logits,
    torch_logits,
    weights_on_disk,
)
from edgekit.export.lm_graph import FusedGraphConfig, build_fused_decoder
from tests.export.test_decode import _packed


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """A packed tiny Llama, its fused graph with fp32 compute and with int8 compute."""
    h = _packed(32)
    folder = tmp_path_factory.mktemp("refs")
    paths = {}
    for level in (None, 4):
        paths[level] = folder / f"model-{level}.onnx"
        onnx.save(build_fused_decoder(h.module.model, FusedGraphConfig(accuracy_level=level)), str(paths[level]))
    return h, paths


def test_shared_references_give_the_numbers_of_a_check_computing_its_own(graphs):
    h, paths = graphs
    refs = lm_references(h)
    assert refs.ids.shape == (1, 18) and refs.short.shape == (1, 17, 256) and list(refs.long) == [110]
    for level, rtol in ((None, 2e-3), (4, INT8_COMPUTE_RTOL)):
        shared = check_lm_parity(h, paths[level], atol=2e-3, rtol=rtol, references=refs)
        own = check_lm_parity(h, paths[level], atol=2e-3, rtol=rtol)
        assert shared == own and shared["passed"] and shared["long_context"]["starts"] == [110]
    assert check_against_float(h, paths[None], references=refs) == check_against_float(h, paths[None])


def test_the_report_holds_the_differences_of_the_session_opened_before_pytorch(graphs):
    """The order before: the session first, PyTorch's forwards beside it; the report's numbers are those."""
    h, paths = graphs
    sess = lm_session(paths[None], threads=2, fp32_compute=True)
    ids = h.sample_inputs(1, sequence=18)["input_ids"][:, :18]
    got = onnx_logits(sess, ids[:, :17], 16, True)
    with torch.no_grad():
        ref = h.module(torch.from_numpy(ids[:, :17]), torch.ones(1, 17, dtype=torch.int64)).float().numpy()
    far = np.abs(onnx_logits(sess, ids, 16, True, 110) - torch_logits(h.module.model, ids, 16, 110)).max()
    del sess
    report = check_lm_parity(h, paths[None], atol=2e-3, rtol=2e-3, references=lm_references(h))
    assert report["max_abs_diff"] == float(np.abs(got - ref).max()) < 1e-5
    assert report["largest_logit"] == float(np.abs(ref).max())
    assert report["long_context"]["max_abs_diff"] == float(far) < 1e-5


def test_references_for_another_prompt_length_are_refused(graphs):
    h, paths = graphs
    with pytest.raises(ValueError, match="references for a 8-token prompt, parity asked for 16"):
        check_lm_parity(h, paths[None], references=lm_references(h, prompt_len=8))


def test_export_runs_the_packed_model_once_per_reference_and_never_beside_a_session(tmp_path, monkeypatch):
    """Each parity check used to run the packed model itself, with its session open: 4 forwards each
    (a prefill, and a prefill and two decode steps far into the context) for the fp32 twin and the
    int8-compute graph, one more for the check against float: 9. Now 4, all before the first session
    (the float model's forward, after the sessions, is another module's)."""
    h = _packed(32)
    before = {k: v.clone() for k, v in h.module.state_dict().items()}
    events: list[str] = []
    # every tensor of the tiny model on disk during the checks (by default only those of 64 KiB and more)
    on_disk = lm.weights_on_disk
    monkeypatch.setattr(lm, "weights_on_disk", lambda module, folder: on_disk(module, folder, min_bytes=0))
    hf_forward = h.module.model.forward
    monkeypatch.setattr(h.module.model, "forward", lambda *a, **k: (events.append("torch"), hf_forward(*a, **k))[1])
    session = lm.lm_session
    monkeypatch.setattr(lm, "lm_session", lambda *a, **k: (events.append("session"), session(*a, **k))[1])
    out = export_causal_lm(h, tmp_path / "onnx")
    metrics = json.loads((out / "manifest.json").read_text())["metrics"]
    assert metrics["parity"]["passed"] and metrics["parity_int8_compute"]["passed"] and metrics["parity_float"]["passed"]
    assert events == ["torch"] * 4 + ["session"] * 3
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.onnx"]  # the weights' file is gone
    after = h.module.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_weights_on_disk_empties_every_storage_and_reads_it_back_bit_for_bit(tmp_path):
    h = _packed(32)
    module = h.module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    ids = torch.from_numpy(h.sample_inputs(1, sequence=9)["input_ids"])
    with torch.no_grad():
        want = module(ids, torch.ones_like(ids))
    tensors = [*module.parameters(), *module.buffers()]
    stored = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    head, embed = module.model.lm_head, module.model.model.embed_tokens
    with weights_on_disk(module, tmp_path, min_bytes=0) as moved:
        assert moved == stored > 50_000 and all(t.untyped_storage().nbytes() == 0 for t in tensors)
        assert (tmp_path / "offloaded-weights.bin").stat().st_size == moved
    assert not (tmp_path / "offloaded-weights.bin").exists()
    after = module.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert embed.qweight.data_ptr() == head.qweight.data_ptr()  # the tied table is one storage again
    with torch.no_grad():
        assert torch.equal(module(ids, torch.ones_like(ids)), want)


def test_weights_on_disk_reads_the_weights_back_when_the_work_inside_fails(tmp_path):
    h = _packed(32)
    qweight = h.module.model.model.layers[0].mlp.down_proj.qweight
    saved = qweight.clone()
    with pytest.raises(RuntimeError, match="parity failed"), weights_on_disk(h.module, tmp_path, min_bytes=0):
        raise RuntimeError("parity failed")
    assert torch.equal(qweight, saved)
