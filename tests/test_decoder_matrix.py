"""The decoder conformance matrix generated from the installed transformers (issue 31): every model
type mapped to a ``*ForCausalLM`` class whose config can be made tiny, through 4-bit RTN and GPTQ
and the KV-cache export. A cell passes its bound or is refused with one line (an edgekit error
naming what is missing); never a traceback, never past its time limit.

The cell logic is the benchmark's (``benchmarks/bench_decoder_matrix.py``, whose table is in
benchmarks/RESULTS.md). The default suite runs a fixed, generated sample of the types (every
``SAMPLE_STEP``-th of the sorted list) through float and RTN; the rest of the matrix is marked
``matrix`` (about 300 cells, tens of minutes on 2 cores: ``pytest -m matrix``), outside both suites
that CI runs.
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

from bench_decoder_matrix import _logits, _OverTime, _windows, run_cell  # noqa: E402
from tiny_models import causal_lm_types, tiny_causal_lm  # noqa: E402

TYPES = causal_lm_types()
SAMPLE_STEP = 12
FAST = TYPES[::SAMPLE_STEP]
CELL_SECONDS = 60
OK = ("pass", "refused")
# Cells over their bound today (benchmarks/RESULTS.md), each strict xfail: when it passes, the mark goes.
_MOE_4BIT = ("4-bit logit error over 0.30 on random-token windows for this mixture of experts (measured "
             "0.34-0.45; dense decoders 0.02-0.29); not yet diagnosed")
KNOWN: dict[tuple[str, str], str] = {
    ("aria_text", "rtn-4"): _MOE_4BIT,
    ("flex_olmo", "rtn-4"): _MOE_4BIT, ("flex_olmo", "gptq-4"): _MOE_4BIT,
    ("hunyuan_v1_moe", "rtn-4"): _MOE_4BIT, ("hunyuan_v1_moe", "gptq-4"): _MOE_4BIT,
    ("jetmoe", "rtn-4"): _MOE_4BIT, ("jetmoe", "gptq-4"): _MOE_4BIT,
    ("phimoe", "rtn-4"): _MOE_4BIT, ("phimoe", "gptq-4"): _MOE_4BIT,
}


def _params(steps: tuple[str, ...]) -> list:
    def marks(t: str, s: str) -> list:
        speed = [] if t in FAST and s in ("float", "rtn-4") else [pytest.mark.slow, pytest.mark.matrix]
        known = [pytest.mark.xfail(strict=True, reason=KNOWN[(t, s)])] if (t, s) in KNOWN else []
        return speed + known

    return [pytest.param(t, s, id=f"{t}-{s}", marks=marks(t, s)) for t in TYPES for s in steps]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: one intra-op thread


def test_the_matrix_is_generated_from_transformers():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert TYPES == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and len(TYPES) > 50
    assert {"llama", "mixtral", "falcon", "llama4_text", "qwen2_moe"} <= set(TYPES)
    assert len(FAST) >= 5


def _raise_over_time(_signum, _frame):
    raise _OverTime


@pytest.mark.parametrize("model_type,step", _params(("float", "rtn-4", "gptq-4", "export-kv")))
def test_cell_passes_or_is_refused_in_one_line(model_type, step, tmp_path):
    previous = signal.signal(signal.SIGALRM, _raise_over_time)
    signal.alarm(CELL_SECONDS)
    try:
        model = tiny_causal_lm(model_type)
        if isinstance(model, str):
            pytest.skip(f"not in the matrix: {model}")
        want = _logits(model, _windows())
        cell = run_cell(model_type, step, model, want, tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert cell["status"] in OK, cell
    if cell["status"] == "refused":
        assert "\n" not in cell["detail"] and len(cell["detail"]) < 600
    if "rel" in cell:
        assert 0 < cell["rel"] < 0.30
