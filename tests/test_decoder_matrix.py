"""The decoder conformance matrix generated from the installed transformers (issue 31): every model
type mapped to a ``*ForCausalLM`` class whose config can be made tiny, through 8-bit and 4-bit RTN,
GPTQ and AWQ, the graph INT8 step, the KV-cache export, and its engine built and profiled. A cell
passes its bound or is refused with one line (an edgekit error naming what is missing); never a
traceback, never past its time limit.

The cell logic and bounds are the benchmark's (``benchmarks/bench_decoder_matrix.py``, whose table
is in benchmarks/RESULTS.md). The default suite runs a fixed, generated sample of the types (every
``SAMPLE_STEP``-th of the sorted list) through the cells that take well under a second (float, RTN
at 8 and 4 bits: ``DEFAULT_STEPS``); the rest of the matrix is marked ``matrix`` (about 650 cells,
tens of minutes on 2 cores: ``pytest -m matrix``), outside both suites that CI runs.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "tests", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_decoder_matrix import STEPS, W4_REL, _logits, _OverTime, _windows, routing_diagnosis, run_cell  # noqa: E402
from tiny_models import causal_lm_types, tiny_causal_lm  # noqa: E402

TYPES = causal_lm_types()
SAMPLE_STEP = 12
FAST = TYPES[::SAMPLE_STEP]
DEFAULT_STEPS = ("float", "rtn-8", "rtn-4")  # each cell well under a second; GPTQ, AWQ, INT8 and export take more
CELL_SECONDS = 60
OK = ("pass", "refused")
# Cells over their bound today (benchmarks/RESULTS.md), each strict xfail: when it passes, the mark goes.
# Diagnosed (test_moe_error_over_the_bound_is_rerouting): the 4-bit experts change the top-k expert set
# of 7-24% of the tokens (the routers stay float); with the float model's routing each is within it.
_REROUTED = ("4-bit logit error over 0.30 on random-token windows for this mixture of experts: the 4-bit "
             "experts reroute 7-24% of the tokens; with the float routing the error is 0.25-0.29")
KNOWN: dict[tuple[str, str], str] = {
    ("aria_text", "rtn-4"): _REROUTED,
    ("flex_olmo", "rtn-4"): _REROUTED, ("flex_olmo", "gptq-4"): _REROUTED,
    ("hunyuan_v1_moe", "rtn-4"): _REROUTED, ("hunyuan_v1_moe", "gptq-4"): _REROUTED,
    ("phimoe", "rtn-4"): _REROUTED, ("phimoe", "gptq-4"): _REROUTED,
    ("hunyuan_v1_moe", "awq-4"): _REROUTED, ("phimoe", "awq-4"): _REROUTED,  # 0.448, 0.428 (2026-11-28)
    ("phimoe", "int8"): "INT8 logit error 0.171 over 0.10 on this mixture of experts (not diagnosed; rerouting likely)",
    # found by the 8-column run (benchmarks/RESULTS.md, 2026-11-28)
    ("olmoe", "int8"): "INT8 logit error 0.108 over 0.10 on this mixture of experts (not diagnosed; rerouting likely)",
    ("jetmoe", "int8"): "INT8 logit error 0.209 over 0.10 on this mixture of experts (not diagnosed; rerouting likely)",
    ("mixtral", "int8"): "INT8 logit error 0.130 over 0.10 on this mixture of experts (its experts float in the MoE node; "
                         "not diagnosed; rerouting likely)",
}


def _params(steps: tuple[str, ...]) -> list:
    def marks(t: str, s: str) -> list:
        speed = [] if t in FAST and s in DEFAULT_STEPS else [pytest.mark.slow, pytest.mark.matrix]
        known = [pytest.mark.xfail(strict=True, reason=KNOWN[(t, s)])] if (t, s) in KNOWN else []
        return speed + known

    return [pytest.param(t, s, id=f"{t}-{s}", marks=marks(t, s)) for t in TYPES for s in steps]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


def test_the_matrix_is_generated_from_transformers():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert TYPES == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and len(TYPES) > 50
    assert {"llama", "mixtral", "falcon", "llama4_text", "qwen2_moe"} <= set(TYPES)
    assert len(FAST) >= 5


# model type -> why it is not in the matrix, found by its first cell: the others skip without building it
# again (an excluded config can take seconds to build: LongCat-Flash is 282M parameters at the tiny sizes)
_EXCLUDED: dict[str, str] = {}


def _raise_over_time(_signum, _frame):
    raise _OverTime


@pytest.mark.parametrize("model_type,step", _params(STEPS))
def test_cell_passes_or_is_refused_in_one_line(model_type, step, tmp_path):
    previous = signal.signal(signal.SIGALRM, _raise_over_time)
    signal.alarm(CELL_SECONDS)
    if model_type in _EXCLUDED:
        pytest.skip(f"not in the matrix: {_EXCLUDED[model_type]}")
    try:
        model = tiny_causal_lm(model_type)
        if isinstance(model, str):
            _EXCLUDED[model_type] = model
            pytest.skip(f"not in the matrix: {model}")
        want = _logits(model, _windows())
        cell = run_cell(model_type, step, model, want, tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert cell["status"] in OK, cell
    if cell["status"] == "refused":
        assert "\n" not in cell["detail"] and len(cell["detail"]) < 600
    if "rel" in cell:  # each step's own bound is the benchmark's (W8_REL, INT8_REL, W4_REL): the loosest here
        assert 0 < cell["rel"] < W4_REL


@pytest.mark.parametrize("model_type", [pytest.param("phimoe"),
                                        pytest.param("hunyuan_v1_moe", marks=[pytest.mark.slow, pytest.mark.matrix]),
                                        pytest.param("flex_olmo", marks=[pytest.mark.slow, pytest.mark.matrix]),
                                        pytest.param("aria_text", marks=[pytest.mark.slow, pytest.mark.matrix])])
def test_moe_error_over_the_bound_is_rerouting(model_type):
    """The known-over cells above: with every router returning the float model's scores, the same
    4-bit model is within the bound; the excess is tokens sent to other experts."""
    model = tiny_causal_lm(model_type)
    d = routing_diagnosis(model, _logits(model, _windows()))
    assert d["routers"] >= 1
    assert d["rel"] >= 0.30 > d["rel_float_routing"] > 0
    assert max(d["tokens_rerouted"]) > 0.05


@pytest.mark.parametrize("model_type,routers", [
    ("jetmoe", ["model.layers.0.self_attention.experts.router.layer", "model.layers.0.mlp.router.layer",
                "model.layers.1.self_attention.experts.router.layer", "model.layers.1.mlp.router.layer"]),
    ("hunyuan_v1_moe", ["model.layers.0.mlp.gate.wg", "model.layers.1.mlp.gate.wg"]),
    ("aria_text", ["model.layers.0.mlp.router", "model.layers.1.mlp.router"]),
])
def test_routers_wrapped_in_a_gate_module_or_counted_as_moe_num_experts_stay_float(model_type, routers):
    """JetMoE's ``router.layer``, HunYuan's ``gate.wg`` and Aria's ``moe_num_experts`` were missed, and
    their routers rounded to 4 bits (JetMoE 0.42 -> 0.27 with the router float)."""
    from edgekit.compress.weight_only.blocks import expert_routers, quantizable_linears

    model = tiny_causal_lm(model_type)
    assert expert_routers(model) == routers
    assert not set(routers) & set(quantizable_linears(model)[2])



def test_experts_behind_a_router_that_is_no_linear_get_gptaq_pairs_by_token():
    """GLM-4 MoE's router is a bare weight, not an nn.Linear: its experts are still routed groups (their
    probe rows are not one per token), so GPTAQ pairs each expert's rows by token. They were paired by
    position, and 137 rows met 141 in a traceback."""
    model = tiny_causal_lm("glm4_moe")
    want = _logits(model, _windows())
    cell = run_cell("glm4_moe", "gptq-4", model, want, Path("."))
    assert cell["status"] == "pass" and 0 < cell["rel"] < 0.30  # measured 0.169
