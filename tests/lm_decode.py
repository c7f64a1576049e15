"""Shared checks of exported decoder graphs (the fused-graph tests of Gemma, Falcon and MoE):
logits through ONNX Runtime's KV cache against the PyTorch model's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgekit.export.lm import lm_feeds, lm_session, presents_to_past


def decode_logits(path: Path, ids: np.ndarray, prompt: int) -> np.ndarray:
    """Logits of a prefill of ``prompt`` tokens, then one-token decode steps through the KV cache."""
    sess = lm_session(path)
    out = sess.run(None, lm_feeds(sess, ids[:, :prompt]))
    logits = [out[0]]
    for t in range(prompt, ids.shape[1]):
        out = sess.run(None, lm_feeds(sess, ids[:, t:t + 1], presents_to_past(sess, out)))
        logits.append(out[0])
    return np.concatenate(logits, axis=1)


def reference_logits(handle, ids: np.ndarray) -> np.ndarray:
    """The handle's PyTorch module on the same ids (attention mask of ones)."""
    t = torch.from_numpy(ids)
    with torch.no_grad():
        return handle.module(t, torch.ones_like(t)).float().numpy()


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape and np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def token_ids(n: int, seed: int = 0) -> np.ndarray:
    """One row of ``n`` seeded random ids below 256 (the tiny models' vocabulary)."""
    return np.random.default_rng(seed).integers(0, 256, (1, n)).astype(np.int64)
