"""SmoothQuant activation smoothing (``compress/int8/smooth.py``) on tiny decoders: the fold is exact, it
lowers the INT8 error where an activation channel is an outlier, and its option validates."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from edgekit.compress.int8.config import Int8Config
from edgekit.compress.int8.smooth import smooth, smoothing_scales
from edgekit.compress.int8.technique_configs import SmoothConfig
from edgekit.errors import BadInputError

TESTS = Path(__file__).resolve().parents[2]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from tiny_models import build, save_tiny  # noqa: E402

OUTLIER = 3  # the hidden channel made an outlier
FACTOR = 40.0


def _ids(vocab: int, n: int = 4, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _runner(ids: torch.Tensor):
    def run(m: nn.Module) -> None:
        with torch.no_grad():
            m(input_ids=ids)
    return run


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _with_outlier(family: str = "llama") -> nn.Module:
    """A tiny decoder whose norms output channel ``OUTLIER`` ``FACTOR`` times larger and whose
    projections read it ``FACTOR`` times smaller: the same function, with the outlier channel LLM
    activations have (what int8 per-tensor activation scales handle worst)."""
    model = build(family)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, lins in ((layer.input_layernorm, ("q_proj", "k_proj", "v_proj")),
                               (layer.post_attention_layernorm, ("gate_proj", "up_proj"))):
                norm.weight[OUTLIER] *= FACTOR
                parent = layer.self_attn if "q_proj" in lins else layer.mlp
                for name in lins:
                    getattr(parent, name).weight[:, OUTLIER] /= FACTOR
    return model


def _int8_error(model: nn.Module, calib: torch.Tensor, test: torch.Tensor, ref: torch.Tensor) -> float:
    """Logit error of W8A8 fake quantization: every linear in the blocks gets per-output-channel
    symmetric int8 weights and a per-tensor int8 input scale calibrated (max |x|) on ``calib``."""
    linears = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    amax: dict[nn.Linear, float] = {}

    def observe(m: nn.Module, args: tuple) -> None:
        amax[m] = max(amax.get(m, 0.0), float(args[0].abs().max()))

    handles = [lin.register_forward_pre_hook(observe) for lin in linears]
    _logits(model, calib)
    for h in handles:
        h.remove()
    with torch.no_grad():
        for lin in linears:
            w = lin.weight
            step = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
            w.copy_(torch.round(w / step).clamp(-127, 127) * step)

    def quant_input(m: nn.Module, args: tuple) -> tuple:
        step = amax[m] / 127
        return (torch.round(args[0] / step).clamp(-127, 127) * step, *args[1:])

    handles = [lin.register_forward_pre_hook(quant_input) for lin in linears]
    try:
        return _rel(_logits(model, test), ref)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_fold_leaves_the_float_model_unchanged(family):
    """Norm producers (Gemma's 1 + w too), linear producers (up -> down, v -> o), fused projections."""
    model = build(family)
    ids = _ids(model.config.vocab_size)
    before = _logits(model, ids)
    pairs = smooth(model, _runner(ids), SmoothConfig(0.5))
    after = _logits(model, ids)
    assert len(pairs) >= 2 * model.config.num_hidden_layers
    assert _rel(after, before) < 1e-5


def test_every_llama_pair_is_smoothed_and_recorded():
    model = build("llama")
    ids = _ids(model.config.vocab_size)
    pairs = smooth(model, _runner(ids), SmoothConfig(0.5))
    producers = {p["producer"] for p in pairs}
    assert {"input_layernorm", "post_attention_layernorm", "mlp.up_proj"} <= producers
    assert {p["block"] for p in pairs} == set(range(model.config.num_hidden_layers))
    assert all(p["act_max"] >= p["act_median"] > 0 for p in pairs)


def test_smoothing_flattens_a_planted_outlier_channel():
    model = _with_outlier()
    ids = _ids(model.config.vocab_size)
    pairs = smooth(model, _runner(ids), SmoothConfig(0.5))
    attn = next(p for p in pairs if p["producer"] == "input_layernorm" and p["block"] == 0)
    assert attn["act_max"] > 10 * attn["act_median"]  # the outlier was seen
    seen: list[torch.Tensor] = []
    h = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    _logits(model, ids)
    h.remove()
    cmax = seen[0].reshape(-1, seen[0].shape[-1]).abs().amax(0)
    assert float(cmax.max() / cmax.median()) < attn["act_max"] / attn["act_median"] / 4


def test_smoothing_lowers_int8_logit_error_with_an_outlier_channel():
    vocab = build("llama").config.vocab_size
    calib, test = _ids(vocab, seed=1), _ids(vocab, seed=2)
    plain = _with_outlier()
    ref = _logits(plain, test)
    err_plain = _int8_error(plain, calib, test, ref)
    smoothed = _with_outlier()
    smooth(smoothed, _runner(calib), SmoothConfig(0.5))
    err_smooth = _int8_error(smoothed, calib, test, ref)
    assert err_smooth < 0.5 * err_plain
    assert err_smooth < 0.1


def test_scales_follow_the_formula():
    act = torch.tensor([1.0, 4.0, 100.0])
    w = torch.tensor([[0.5, 2.0, 1.0], [-1.0, 0.5, 0.25]])
    s = smoothing_scales(act, [w], 0.5)
    torch.testing.assert_close(s, torch.tensor([1.0, 4.0 ** 0.5 / 2.0 ** 0.5, 10.0]))
    torch.testing.assert_close(smoothing_scales(act, [w], 1.0), act)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "half", True])
def test_alpha_outside_0_1_is_refused_in_one_line(alpha):
    with pytest.raises(BadInputError, match=r"smooth(ing)?_?\s?alpha") as e:
        Int8Config(smooth_alpha=alpha)
    assert "\n" not in str(e.value)


def test_alpha_bounds_are_accepted():
    assert Int8Config(smooth_alpha=0.0).smooth_alpha == 0.0
    assert Int8Config(smooth_alpha=1).smooth_alpha == 1
    assert Int8Config().smooth_alpha is None


def test_a_causal_lm_is_smoothed_at_alpha_half_by_default_and_0_turns_it_off():
    """Not given, the alpha is the model kind's: 0.5 for a causal LM with PyTorch weights (chosen on validation
    windows, benchmarks/RESULTS.md issue 31), off for other models and ONNX-only LMs; 0 is off."""
    assert Int8Config().for_model("causal-lm", smoothable=True).smooth_config() == SmoothConfig(0.5)
    assert Int8Config().for_model("causal-lm", smoothable=False).smooth_config() is None
    assert Int8Config().for_model("image", smoothable=False).smooth_config() is None
    assert Int8Config(smooth_alpha=0).for_model("causal-lm", smoothable=True).smooth_config() is None
    assert Int8Config(smooth_alpha=0.8).for_model("causal-lm", smoothable=True).smooth_config() == SmoothConfig(0.8)


@pytest.mark.parametrize("value", ["1.5", "-0.2"])
def test_cli_refuses_alpha_outside_0_1(value, tmp_path):
    from click.testing import CliRunner

    from edgekit.cli import cli

    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "--bits", "8", "--smooth-alpha",
                                 value, "-o", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "smoothing alpha must be a number in [0, 1]" in r.stderr and value in r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_refuses_smoothing_a_model_that_is_no_causal_lm(tmp_path):
    """The smoothing has nothing to fold into in a CNN or an MLP: refused, not silently ignored."""
    from click.testing import CliRunner

    from edgekit.cli import cli

    r = CliRunner().invoke(cli, ["compress", "edgekit.pipelines.examples:tiny_mlp", "--bits", "8", "--smooth-alpha",
                                 "0.5", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "--smooth-alpha applies to causal LMs" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # an ONNX export and graph quantization: about a minute on a loaded 2-core machine
def test_int8_step_smooths_a_causal_lm_and_records_the_pairs(tmp_path):
    """The INT8 step of a causal LM (through its ONNX graph) folds the scales before export and says so."""
    from edgekit.compress import StepContext
    from edgekit.compress.families import hf_model
    from edgekit.compress.int8.step import apply
    from edgekit.loading import load_model

    handle = load_model(str(save_tiny("llama", tmp_path)))
    ctx = StepContext(calib="lee-news", eval="wikipedia", progress=False)
    out = apply(handle, Int8Config(calib_samples=8, eval_samples=2), ctx)  # smoothing: on by default, alpha 0.5
    meta = out.steps[-1].meta["smoothing"]
    assert meta["alpha"] == 0.5 and meta["calib_samples"] == 8 and out.steps[-1].config["smooth_alpha"] == 0.5
    assert meta["groups"] == 3 * hf_model(handle.module).config.num_hidden_layers  # v -> o: grouped heads, no fold
    assert "input_layernorm -> self_attn.q_proj, self_attn.k_proj, self_attn.v_proj" in meta["pairs"]
    assert "mlp.up_proj -> mlp.down_proj" in meta["pairs"]
    assert ctx.metrics["int8"]["smoothing"]["groups"] == meta["groups"]
    logits = next(iter(ctx.metrics["int8"]["outputs"].values()))  # the INT8 graph against the float graph
    assert logits["mean_cosine"] > 0.95


@pytest.mark.slow  # an ONNX export and graph quantization of a tiny Llama: about 30 s on a loaded 2-core machine
def test_default_smoothing_is_skipped_and_said_where_nothing_folds_but_an_asked_alpha_is_refused(tmp_path, monkeypatch):
    """A family whose norms and linears take no fold: the default quantizes it unsmoothed and records why (an
    INT8 that worked before the default changed keeps working); an explicit alpha stops with the reason."""
    from edgekit.compress import StepContext
    from edgekit.compress.int8 import step
    from edgekit.loading import load_model

    def no_fold(*args, **kwargs):
        raise BadInputError("llama: no norm or linear whose output scales fold exactly")

    monkeypatch.setattr(step, "smooth", no_fold)
    handle = load_model(str(save_tiny("llama", tmp_path)))
    ctx = StepContext(calib="lee-news", eval="wikipedia", progress=False)
    out = step.apply(handle, Int8Config(calib_samples=8, eval_samples=2), ctx)
    assert out.steps[-1].meta["smoothing"] == {"alpha": None, "skipped": "llama: no norm or linear whose output "
                                                                         "scales fold exactly"}
    assert out.steps[-1].config["smooth_alpha"] == 0.0 and ctx.metrics["int8"]["smoothing"]["alpha"] is None
    with pytest.raises(BadInputError, match="no norm or linear"):
        step.apply(load_model(str(save_tiny("llama", tmp_path / "again"))), Int8Config(calib_samples=8, eval_samples=2,
                                                                                        smooth_alpha=0.5), ctx)
