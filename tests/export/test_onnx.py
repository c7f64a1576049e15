"""export_onnx: dynamo export of tiny models, parity, rewrites, fallback, external data, bad input."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest

from edgekit.artifact import read_manifest
from edgekit.errors import BadInputError, CheckFailedError
from edgekit.export import onnx as export_mod
from edgekit.export.onnx import ExportConfig, export_onnx
from edgekit.export.parity import compare
from edgekit.sources.handle import StepRecord

# The legacy exporter takes ~0.3 s on a tiny model (dynamo ~2 s): used where the exporter is not under test.
FAST = ExportConfig(dynamo=False)


def _ort_run(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _torch_run(handle, feeds):
    import torch

    with torch.inference_mode():
        out = handle.module(*[torch.from_numpy(feeds[s.name]) for s in handle.inputs])
    return out.numpy()


@pytest.mark.parametrize("fixture", ["tiny_mlp", "tiny_cnn", "tiny_transformer"])
def test_export_tiny_models_pass_parity_with_dynamic_batch(fixture, request, tmp_path):
    import onnx

    handle = request.getfixturevalue(fixture)
    out = export_onnx(handle, tmp_path / "onnx")
    m = read_manifest(out)
    assert m.kind == "onnx" and m.files == {"onnx": "model.onnx"}
    assert m.config["exporter"] == "dynamo"
    assert m.config["opset_used"] == 18
    parity = m.metrics["parity"]
    assert parity["passed"] is True and parity["batches"] == [1, 2]
    assert parity["max_abs_error"] < 1e-4
    assert set(parity["outputs"]) == set(handle.outputs)
    assert m.model["name"] == handle.name
    assert m.inputs["model"]["sha256"]
    assert m.metrics["export_seconds"] > 0
    graph = onnx.load(str(out / "model.onnx")).graph
    assert [o.name for o in graph.output] == handle.outputs
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    # no machine's source paths in a shipped graph: the exporter's stack traces are dropped, the module
    # paths per-layer profiles read are kept
    props = {p.key for n in graph.node for p in n.metadata_props}
    assert export_mod.STACK_TRACE_KEY not in props and "pkg.torch.onnx.name_scopes" in props
    assert str(Path(__file__).parent) not in (out / "model.onnx").read_bytes().decode("latin-1")
    feeds = handle.sample_inputs(3)  # a batch size never traced
    got = _ort_run(out / "model.onnx", feeds)[0]
    assert got.shape[0] == 3
    np.testing.assert_allclose(got, _torch_run(handle, feeds), atol=1e-4, rtol=1e-3)
    assert not Path(f"{out}.failed.onnx").exists()


def _add_one_rewrite(calls: list[str]):
    def rewrite(model, handle, record):
        """Deliberately break the graph: logits + 1."""
        from onnx import helper, numpy_helper

        calls.append(record.name)
        g = model.graph
        out = g.output[0].name
        for node in g.node:
            for i, n in enumerate(node.output):
                if n == out:
                    node.output[i] = out + "_pre"
        g.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "one"))
        g.node.append(helper.make_node("Add", [out + "_pre", "one"], [out], name="break_it"))
        return model
    return rewrite


def _patch_steps(handle, steps: dict):
    """``handle`` carries these test steps' graph rewrites (as a handle a compression step made does)."""
    handle.step_rewrites = steps.get


def test_parity_failure_names_worst_output_and_keeps_failed_graph(tiny_mlp, tmp_path):
    calls: list[str] = []
    _patch_steps(tiny_mlp, {"identity": lambda m, h, r: calls.append(r.name), "breaker": _add_one_rewrite(calls)})
    tiny_mlp.steps = [StepRecord("identity", {}), StepRecord("breaker", {})]
    out = tmp_path / "onnx"
    with pytest.raises(CheckFailedError) as err:
        export_onnx(tiny_mlp, out, FAST)
    msg = str(err.value)
    assert "parity failed" in msg and "'logits'" in msg and "max abs error 1 " in msg and "atol 0.0001" in msg
    assert f"{out}.failed.onnx" in msg
    assert calls == ["identity", "breaker"]  # each step's rewrite, in chain order
    assert not out.exists()  # no artifact when parity fails
    assert Path(f"{out}.failed.onnx").is_file()  # but the graph is kept for debugging
    assert err.value.exit_code == 1


def test_parity_tolerances_per_output_and_skip(tiny_mlp, tmp_path):
    calls: list[str] = []
    _patch_steps(tiny_mlp, {"breaker": _add_one_rewrite(calls)})
    tiny_mlp.steps = [StepRecord("breaker", {})]
    out = export_onnx(tiny_mlp, tmp_path / "loose", ExportConfig(dynamo=False, tolerances={"logits": (1.5, 0.0)}))
    assert read_manifest(out).metrics["parity"]["outputs"]["logits"]["max_abs_error"] == pytest.approx(1.0, abs=1e-5)
    out = export_onnx(tiny_mlp, tmp_path / "skipped", ExportConfig(dynamo=False, skip_parity=True))
    assert read_manifest(out).metrics["parity"] == {"skipped": True}
    assert read_manifest(out).steps[0]["name"] == "breaker"  # the chain is carried over


def test_step_record_loosens_parity_tolerance(tiny_mlp, tmp_path):
    calls: list[str] = []
    _patch_steps(tiny_mlp, {"breaker": _add_one_rewrite(calls)})
    tiny_mlp.steps = [StepRecord("breaker", {}, meta={"parity": {"atol": 1.01, "rtol": 0.0}})]
    out = export_onnx(tiny_mlp, tmp_path / "onnx", FAST)
    logits = read_manifest(out).metrics["parity"]["outputs"]["logits"]
    assert logits["atol"] == 1.01 and logits["passed"]


def test_compare_rule():
    ref = np.array([1.0, 100.0, 0.0], np.float32)
    e = compare("y", ref, ref + np.array([0, 0.05, 1e-5], np.float32), atol=1e-4, rtol=1e-3)
    assert e.passed and e.max_abs == pytest.approx(0.05, rel=1e-3)
    assert not compare("y", ref, ref + 1e-2, atol=1e-4, rtol=1e-3).passed
    assert not compare("y", ref, ref[:2], atol=1, rtol=1).shape_ok
    assert not compare("y", ref, np.array([1.0, np.nan, 0.0], np.float32), atol=1, rtol=1).passed


def test_legacy_fallback_warns(tiny_cnn, tmp_path, monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("simulated dynamo failure")

    monkeypatch.setattr(export_mod, "_trace_dynamo", broken)
    with caplog.at_level(logging.WARNING, logger="edgekit.export.onnx"):
        out = export_onnx(tiny_cnn, tmp_path / "onnx")
    m = read_manifest(out)
    assert m.config["exporter"] == "legacy" and m.metrics["parity"]["passed"]
    assert any("falling back to the legacy" in r.getMessage() and "simulated dynamo failure" in r.getMessage()
               for r in caplog.records)


def test_external_data_above_threshold(tiny_mlp, tmp_path, monkeypatch):
    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 0)
    out = export_onnx(tiny_mlp, tmp_path / "onnx", FAST)
    m = read_manifest(out)
    assert m.files == {"onnx": "model.onnx", "onnx_data": "model.onnx.data"}
    assert (out / "model.onnx.data").stat().st_size > 0
    assert m.metrics["parity"]["passed"]  # ONNX Runtime read the external data


def test_onnx_input_is_validated_and_copied(tiny_onnx, tmp_path):
    out = export_onnx(tiny_onnx, tmp_path / "onnx")
    m = read_manifest(out)
    assert m.config["exporter"] == "copy" and m.metrics["parity"]["skipped"] is True
    assert (out / "model.onnx").read_bytes() == tiny_onnx.read_bytes()
    assert m.inputs["model"]["path"] == str(tiny_onnx)
    # an onnx artifact is itself a valid input
    again = export_onnx(out, tmp_path / "again")
    assert read_manifest(again).model["inputs"][0]["shape"] == ["batch", 3, 16, 16]


@pytest.mark.parametrize("content", [b"this is not an onnx file", "truncated"])
def test_corrupt_or_truncated_onnx_is_bad_input(content, tiny_onnx, tmp_path):
    bad = tmp_path / "bad.onnx"
    data = tiny_onnx.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if content == "truncated" else content)
    with pytest.raises(BadInputError, match=r"bad\.onnx is not a valid ONNX model"):
        export_onnx(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_model_file(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        export_onnx(tmp_path / "nope.onnx", tmp_path / "out")


@pytest.mark.parametrize("kwargs, pattern", [
    ({"opset": 7}, r"opset 7 is not supported \(choose 13 to 23\)"),
    ({"atol": -1.0}, r"parity atol must be >= 0, got -1.0"),
    ({"batch": 0}, r"export batch must be an integer >= 1, got 0"),
    ({"tolerances": {"logits": (1e-3,)}}, r"tolerances.logits: must be a list of 2 numbers, got \(0.001,\)"),
])
def test_export_config_validation(kwargs, pattern):
    with pytest.raises(BadInputError, match=pattern):
        ExportConfig(**kwargs)


def test_export_config_is_frozen_and_serializable():
    cfg = ExportConfig(opset=17, tolerances={"y": (1e-3, 1e-2)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.opset = 18  # type: ignore[misc]
    assert cfg.to_dict()["tolerances"] == {"y": [1e-3, 1e-2]}


def test_static_batch_when_not_dynamic(tiny_mlp, tmp_path):
    import onnx

    out = export_onnx(tiny_mlp, tmp_path / "onnx", ExportConfig(dynamo=False, dynamic_batch=False))
    dim = onnx.load(str(out / "model.onnx")).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_value == 1
    m = read_manifest(out)
    assert m.model["inputs"][0]["shape"] == [1, 16] and m.metrics["parity"]["batches"] == [1]


def test_opset_below_18_uses_legacy_exporter(tiny_cnn, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="edgekit.export.onnx"):
        out = export_onnx(tiny_cnn, tmp_path / "onnx", ExportConfig(opset=17))
    m = read_manifest(out)
    assert m.config["exporter"] == "legacy" and m.config["opset_used"] == 17 and m.metrics["parity"]["passed"]
    assert any("using the legacy TorchScript exporter for opset 17" in r.getMessage() for r in caplog.records)


def test_constrained_named_axis_still_exports(tmp_path):
    """A model that fixes a declared-dynamic axis (a position table of 8) still exports with dynamo."""
    import torch
    from torch import nn

    from edgekit.sources.handle import InputSpec, ModelHandle

    class Pos(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.randn(8, 4))
            self.fc = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x + self.pos)

    handle = ModelHandle(name="pos", source="tests:pos", module=Pos().eval(),
                         inputs=[InputSpec("x", ("batch", "sequence", 4), "float32")], outputs=["y"],
                         make_inputs=lambda batch=1, **_: {"x": np.ones((batch, 8, 4), np.float32)})
    out = export_onnx(handle, tmp_path / "onnx")
    m = read_manifest(out)
    assert m.config["exporter"] == "dynamo" and m.metrics["parity"]["passed"]
    import onnx

    dims = [d.dim_param or d.dim_value for d in onnx.load(str(out / "model.onnx")).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 8, 4]  # batch stays dynamic; the constrained axis is specialised


def test_the_same_model_exports_and_builds_to_the_same_bytes(tiny_cnn, tmp_path):
    """What ``benchmarks/bench_output_hashes.py`` relies on to show that a change of code left every
    output as it was: an export and an ONNX Runtime build of one model write the same bytes twice."""
    from edgekit.build import build_engine
    from edgekit.runtimes.base import BuildOptions

    written = []
    for run in ("first", "second"):
        onnx_dir = export_onnx(tiny_cnn, tmp_path / run / "onnx", FAST)
        engine = build_engine(onnx_dir, "cpu", tmp_path / run / "engine", BuildOptions(threads=1))
        written.append({"model.onnx": (onnx_dir / "model.onnx").read_bytes(),
                        "model.opt.onnx": (engine / "model.opt.onnx").read_bytes(),
                        "precision": read_manifest(engine).config["precision"]})
    assert written[0]["precision"] == "fp32" and len(written[0]["model.opt.onnx"]) > 1000
    assert written[0] == written[1]


def test_the_exporter_registry_built_once_gives_the_graph_a_fresh_one_gives(tiny_cnn, tmp_path, monkeypatch):
    """The dynamo exporter's ATen -> ONNX registry is built once per opset and copied for each export
    (``_torchlib_registry_reused``): the graph is byte for byte the one a registry built afresh gives, each
    export's copy is its own (a custom op registered in one does not reach the next), and torch's own
    ``from_torchlib`` is back in place afterwards."""
    from torch.onnx._internal.exporter import _registration

    from edgekit.export import onnx as export_module

    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    monkeypatch.setattr(export_module, "_TORCHLIB_REGISTRIES", {})
    config = ExportConfig()  # the dynamo exporter
    fresh = export_onnx(tiny_cnn, tmp_path / "fresh", config)  # builds the registry: what torch alone does
    assert set(export_module._TORCHLIB_REGISTRIES) == {config.opset}
    reused = export_onnx(tiny_cnn, tmp_path / "reused", config)
    assert (fresh / "model.onnx").read_bytes() == (reused / "model.onnx").read_bytes()
    assert _registration.ONNXRegistry.__dict__["from_torchlib"] is original
    with export_module._torchlib_registry_reused():
        a = _registration.ONNXRegistry.from_torchlib(config.opset)
        a.functions["custom::op"] = ["an op one export registered"]
        b = _registration.ONNXRegistry.from_torchlib(config.opset)
    built = export_module._TORCHLIB_REGISTRIES[config.opset]
    assert "custom::op" not in b.functions and b.functions.keys() == built.functions.keys()
    assert b.functions["aten::add.Tensor"] is not a.functions["aten::add.Tensor"]
