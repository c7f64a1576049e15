"""``benchmarks/bench_llamacpp.py``'s summary of interleaved rounds (the numbers its table and
benchmarks/RESULTS.md report): medians over rounds and pooled decode steps, prefill with llama.cpp's
all-logits time beside, and a non-positive time refused."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "tests", ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_llamacpp import summarize  # noqa: E402


def _round(prefill_cpu: float, steps: list[float], all_logits: float | None = None) -> dict:
    prefill = {"tokens": 128, "cpu_ms": prefill_cpu, "wall_ms": 2 * prefill_cpu}
    if all_logits is not None:
        prefill.update(all_logits_cpu_ms=all_logits, all_logits_wall_ms=2 * all_logits)
    return {"prefill": [prefill],
            "decode": [{"context": 1024, "cpu_ms": steps, "wall_ms": [3 * s for s in steps]}]}


def test_summary_takes_medians_over_rounds_and_pooled_steps() -> None:
    out = summarize([_round(100.0, [1.0, 2.0, 9.0]), _round(300.0, [3.0, 4.0, 5.0]), _round(200.0, [6.0, 7.0, 8.0])])
    assert out["prefill"]["128"]["cpu_ms"] == 200.0
    assert out["prefill"]["128"]["wall_ms"] == 400.0
    assert out["prefill"]["128"]["n"] == 3
    assert "all_logits_cpu_ms" not in out["prefill"]["128"]  # edgekit's graph has one prefill time
    decode = out["decode"]["1024"]
    assert decode["n"] == 9
    assert decode["cpu_ms"] == 5.0  # the median of the 9 pooled steps
    assert decode["wall_ms"] == 15.0
    assert decode["cpu_p90_ms"] == pytest.approx(8.2)


def test_summary_keeps_llama_cpp_all_logits_prefill() -> None:
    out = summarize([_round(100.0, [1.0], all_logits=130.0), _round(120.0, [1.0], all_logits=150.0)])
    assert out["prefill"]["128"]["cpu_ms"] == 110.0
    assert out["prefill"]["128"]["all_logits_cpu_ms"] == 140.0
    assert out["prefill"]["128"]["all_logits_wall_ms"] == 280.0


def test_summary_refuses_a_non_positive_time() -> None:
    with pytest.raises(SystemExit, match="decode time of 1024 tokens is not positive"):
        summarize([_round(100.0, [1.0, 0.0])])


# --- the llama.cpp harness on a tiny GGUF, where a llama.cpp build is given ------------------------

LLAMA_CPP = os.environ.get("EDGEKIT_LLAMA_CPP")  # a llama.cpp source tree (include/, ggml/include/)
LLAMA_CPP_BUILD = os.environ.get("EDGEKIT_LLAMA_CPP_BUILD")  # its CMake build folder (bin/libllama.so)
needs_llama_cpp = pytest.mark.skipif(not (LLAMA_CPP and LLAMA_CPP_BUILD),
                                     reason="set EDGEKIT_LLAMA_CPP and EDGEKIT_LLAMA_CPP_BUILD to a llama.cpp "
                                            "source tree and its build")


@pytest.mark.slow
@needs_llama_cpp
def test_harness_quantizes_times_and_scores_a_tiny_gguf(tmp_path: Path) -> None:
    import json
    import subprocess

    import numpy as np
    from bench_llamacpp import build_harness
    from tiny_gguf import write_tiny_gguf

    exe = build_harness(Path(str(LLAMA_CPP)), Path(str(LLAMA_CPP_BUILD)), tmp_path)
    model = write_tiny_gguf(tmp_path / "tiny.gguf", "bpe-smollm")
    ids = np.random.default_rng(0).integers(3, 200, size=(2, 24)).astype(np.int32)
    ids.tofile(tmp_path / "ids.bin")

    def harness(*args: str) -> dict:
        out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    stats = harness(str(model), "1", "imatrix", str(tmp_path / "ids.bin"), "2", "24", str(tmp_path / "m.imatrix"))
    assert stats == {"tensors": 7, "min_rows": 48}  # q, k, v, o, gate, up, down of the one block; 2 x 24 rows
    q8 = harness(str(model), "1", "quantize", str(tmp_path / "q8.gguf"), "Q8_0", str(tmp_path / "m.imatrix"))
    assert q8 == {"type": "Q8_0", "imatrix_tensors": 7}
    assert (tmp_path / "q8.gguf").stat().st_size < model.stat().st_size

    vocab = 1 + int(ids.max())
    for path in (model, tmp_path / "q8.gguf"):
        ppl = harness(str(path), "1", "ppl", str(tmp_path / "ids.bin"), "2", "24")
        assert ppl["tokens"] == 2 * 23
        # random weights: near-uniform predictions over the vocabulary, never below what a few
        # hundred tokens allow far from uniform
        assert 0.5 * np.log(vocab) < ppl["nll"] / ppl["tokens"] < 3 * np.log(1000)

    timing = harness(str(model), "1", "time", str(tmp_path / "ids.bin"), "8,16", "3", "8,16")
    assert [p["tokens"] for p in timing["prefill"]] == [8, 16]
    assert all(p["cpu_ms"] > 0 and p["all_logits_cpu_ms"] > 0 for p in timing["prefill"])
    assert [d["context"] for d in timing["decode"]] == [8, 16]
    assert all(len(d["cpu_ms"]) == 3 == len(d["wall_ms"]) for d in timing["decode"])
    assert "AVX" in timing["system_info"] or "NEON" in timing["system_info"]

    bad = subprocess.run([str(exe), str(model), "1", "quantize", str(tmp_path / "x.gguf"), "Q3_X"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown type Q3_X (Q4_K_M, Q4_0, Q8_0, F32)" in bad.stderr
    assert not (tmp_path / "x.gguf").exists()
