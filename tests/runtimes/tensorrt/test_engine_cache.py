"""Built TensorRT engines keyed by everything that makes them valid (runtimes/tensorrt/engine_cache.py):
every field changes the key, a tampered entry is a miss, and an engine built for another GPU or
TensorRT is refused naming both."""
from __future__ import annotations

import json

import pytest

from edgekit.errors import BadInputError


def test_engine_cache_keys(tmp_path):
    from edgekit.runtimes.tensorrt.engine_cache import EngineCache, EngineKey, check_compatible

    base = EngineKey("10.3.0", "NVIDIA H100 80GB HBM3", "sm_90", "fp16", {"x": {"min": [1], "opt": [1], "max": [1]}},
                     {"strongly_typed": False}, "abc")
    variants = [base.__class__(**{**base.to_dict(), k: v}) for k, v in (
        ("tensorrt_version", "10.4.0"), ("gpu", "NVIDIA L4"), ("sm", "sm_89"), ("precision", "int8"),
        ("shapes", {"x": {"min": [1], "opt": [2], "max": [4]}}), ("flags", {"strongly_typed": True}),
        ("onnx_sha256", "abd"))]
    digests = {base.digest()} | {v.digest() for v in variants}
    assert len(digests) == 8  # every field changes the key
    assert base.mismatches(variants[3]) == ["precision"] and base.mismatches(base) == []
    cache = EngineCache(tmp_path)
    assert cache.lookup(base) is None
    plan = tmp_path / "model.plan"
    plan.write_bytes(b"engine")
    entry = cache.store(base, {"model.plan": plan})
    assert cache.lookup(base) == entry and all(cache.lookup(v) is None for v in variants)
    (entry / "key.json").write_text(json.dumps({**base.to_dict(), "precision": "int8"}))  # tampered entry
    assert cache.lookup(base) is None
    with pytest.raises(BadInputError, match=r"built for GPU architecture sm_87 \(this machine: sm_90\); "
                                            r"TensorRT version 10.3.0 \(this machine: 10.4.0\)"):
        check_compatible({"sm": "sm_87", "tensorrt_version": "10.3.0"}, {"sm": "sm_90", "tensorrt_version": "10.4.0"})
    check_compatible({"sm": "sm_90"}, {"sm": "sm_90", "gpu": None})
