"""``benchmarks/bench_llm_quality.py``'s table: parts scored on other evaluation windows, or against
another float perplexity, are never rows of one comparison (benchmarks/RESULTS.md's GPTQ/AWQ/RTN tables)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_llm_quality import part_groups, part_name  # noqa: E402


def _part(model: str, method: str, windows: int, ppl_float: float, ppl: float) -> dict:
    return {"model": model, "method": method, "eval_windows": windows,
            "quality": {"perplexity_float": ppl_float, "perplexity": ppl}}


def test_parts_of_other_windows_or_float_reference_form_their_own_groups() -> None:
    parts = [_part("gemma3-270m", "gptq", 4, 22.7326, 30.0), _part("gemma3-270m", "rtn", 16, 23.255, 37.50),
             _part("gemma3-270m", "rtn", 4, 22.7326, 36.85), _part("smollm2-135m", "rtn", 16, 22.7608, 30.73),
             _part("smollm2-135m", "gptq", 16, 22.5520, 26.01)]  # re-measured against another float reference
    groups = part_groups(parts)
    keys = [(model, windows, ppl_f, list(methods)) for model, windows, ppl_f, methods in groups]
    assert keys == [("gemma3-270m", 16, 23.255, ["rtn"]), ("gemma3-270m", 4, 22.7326, ["rtn", "gptq"]),
                    ("smollm2-135m", 16, 22.552, ["gptq"]), ("smollm2-135m", 16, 22.7608, ["rtn"])]
    assert groups[1][3]["gptq"]["quality"]["perplexity"] == 30.0


def test_two_parts_of_one_method_in_a_group_are_refused() -> None:
    with pytest.raises(SystemExit, match="two rtn parts"):
        part_groups([_part("gemma3-270m", "rtn", 4, 22.7326, 36.85), _part("gemma3-270m", "rtn", 4, 22.7326, 36.9)])


def test_a_part_is_named_by_its_evaluation_windows() -> None:
    assert part_name("gemma3-270m", "gptq", 4) == "gemma3-270m-gptq-eval4.json"
    assert part_name("gemma3-270m", "gptq", 4) != part_name("gemma3-270m", "gptq", 16)
