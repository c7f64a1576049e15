"""The half step (edgekit/compress/half.py): float16 / bfloat16 storage of linear, conv and
embedding weights, norms kept in float32; its flag and recipe key come from its config alone."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import make_tiny_cnn, make_tiny_transformer
from safetensors import safe_open

from edgekit.cli import cli
from edgekit.compress import StepContext, compress, get_step, load_compressed, make_config
from edgekit.compress.half import apply
from edgekit.compress.half_config import HalfConfig
from edgekit.compress.plan import plan_steps
from edgekit.compress.quality import QualityBounds
from edgekit.errors import BadInputError


def _outputs(handle, module=None):
    feeds = handle.sample_inputs(4)
    with torch.no_grad():
        return (module or handle.module)(*[torch.from_numpy(feeds[i.name]) for i in handle.inputs])


# fp16 keeps 11 significant bits (rounding 2**-11 = 4.9e-4 relative), bf16 8 (3.9e-3); measured on the
# tiny models the output error is 2.4e-4 / 4.2e-4 (fp16) and 2.2e-3 / 3.2e-3 (bf16) of the output's peak
@pytest.mark.parametrize("make", [make_tiny_transformer, make_tiny_cnn])
@pytest.mark.parametrize("dtype, torch_dtype, bound", [("fp16", torch.float16, 1e-3), ("bf16", torch.bfloat16, 8e-3)])
def test_weights_are_stored_in_half_and_the_outputs_stay_close(make, dtype, torch_dtype, bound):
    h = make()
    reference = copy.deepcopy(h.module)
    ctx = StepContext()
    out = apply(h, HalfConfig(dtype), ctx)
    y0, y1 = _outputs(out, reference), _outputs(out)
    assert y1.dtype == torch.float32  # the model's interface is unchanged
    assert float((y1 - y0).abs().max() / y0.abs().max()) < bound
    casts = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)
    norms = (torch.nn.LayerNorm, torch.nn.BatchNorm2d)
    for m in out.module.modules():
        if isinstance(m, casts):
            assert m.weight.dtype == torch_dtype
        if isinstance(m, norms):
            assert m.weight.dtype == torch.float32
    m = ctx.metrics["half"]
    assert m["dtype"] == dtype and m["layers"] == (7 if make is make_tiny_transformer else 4)
    assert m["weight_bytes_after"] * 2 == m["weight_bytes_before"]
    assert 0 < m["max_weight_rel_error"] < {"fp16": 2 ** -11, "bf16": 2 ** -8}[dtype]
    assert out.steps[-1].name == "half" and out.steps[-1].config == {"dtype": dtype}


def test_compressed_folder_holds_half_weights_passes_the_gate_and_reloads(tmp_path: Path):
    h = make_tiny_transformer()
    reference = copy.deepcopy(h.module)
    ctx = StepContext(quality_bounds=QualityBounds(min_cosine=0.9999, min_agreement=1.0), progress=False)
    folder = compress(h, [("half", {"dtype": "fp16"})], tmp_path / "half", ctx)
    manifest = json.loads((folder / "manifest.json").read_text())
    quality = manifest["metrics"]["quality"]
    assert quality["passed"] is True and quality["cosine"] > 0.9999 and quality["relative_error"] < 1e-3
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    assert dtypes["q.weight"] == dtypes["embed.weight"] == dtypes["mlp.0.bias"] == "F16"
    assert dtypes["norm1.weight"] == dtypes["norm2.bias"] == "F32"
    float_bytes = sum(p.numel() * 4 for p in reference.parameters())
    assert (folder / "model.safetensors").stat().st_size < 0.6 * float_bytes


def test_cli_json_and_reload(tmp_path: Path):
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "--precision", "bf16",
                                 "-o", str(tmp_path / "h"), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)  # one JSON document, nothing else on stdout
    assert doc["steps"] == ["half"] and doc["metrics"]["half"]["dtype"] == "bf16"
    assert doc["metrics"]["quality"]["passed"] is True
    back = load_compressed(tmp_path / "h")
    assert back.module[0].weight.dtype == torch.bfloat16
    from edgekit.pipelines.examples import tiny_mlp

    expected = apply(tiny_mlp(), HalfConfig("bf16"))  # load_compressed rebuilds the cast layers from the record
    assert torch.equal(_outputs(back), _outputs(expected))
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "--precision", "fp16", "--bits", "8",
                                 "-o", str(tmp_path / "x")])
    assert r.exit_code == 2 and "half needs float weights, but after int8 the model is fake-quant" in r.stderr


def test_flag_and_recipe_key_come_from_the_config():
    assert plan_steps(precision="bf16") == [("half", {"dtype": "bf16"})]
    assert plan_steps(precision="fp16", bits=8) == [("int8", {"method": "ptq"}), ("half", {"dtype": "fp16"})]
    assert make_config("half", {"dtype": "bf16"}) == HalfConfig("bf16")
    assert get_step("half").transitions == {"float": "float"}
    r = CliRunner().invoke(cli, ["compress", "--help"])
    assert "--precision TEXT" in r.output and "fp16 | bf16" in r.output


def test_bad_dtype_and_fp16_overflow_are_one_line_errors(tmp_path: Path):
    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "--precision", "fp8",
                                 "-o", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert r.stderr.strip() == "error: unknown half-precision type 'fp8' (choose from 'bf16', 'fp16')"
    assert not (tmp_path / "x").exists()
    h = make_tiny_cnn()
    with torch.no_grad():
        h.module[0].weight[0, 0, 0, 0] = 1e5
    with pytest.raises(BadInputError, match=r"0.weight holds 1e\+05, beyond fp16's range \(\+-65504\); use bf16"):
        apply(h, HalfConfig("fp16"))
    assert apply(make_tiny_cnn(), HalfConfig("bf16")).module[0].weight.dtype == torch.bfloat16


def test_each_step_declares_its_quality_gate():
    """The gate comes from the steps (Step.bounds / deliberate), not from names in quality.py:
    half alone gets its tight bound; with a 4-bit step the chain gets the 4-bit (looser) one;
    a deliberate step (pruning) turns gating off."""
    from edgekit.compress import default_bounds, make_config
    from edgekit.compress.quality import BOUNDS_4BIT, BOUNDS_8BIT, BOUNDS_HALF

    half = ("half", make_config("half", {"dtype": "fp16"}))
    assert default_bounds([half]) == BOUNDS_HALF
    assert default_bounds([("weight-only", make_config("weight-only", {"bits": 4})), half]) == BOUNDS_4BIT
    assert default_bounds([("weight-only", make_config("weight-only", {"bits": 8}))]) == BOUNDS_8BIT
    assert default_bounds([("prune", make_config("prune", {"ratio": 0.3})), half]) is None
    assert BOUNDS_HALF.max_ppl_ratio == 1.02 and BOUNDS_HALF.min_cosine == 0.99
