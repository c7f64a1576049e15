"""Parity: does the ONNX graph compute what the PyTorch model computes?

ONNX Runtime runs the exported graph and PyTorch runs ``handle.module`` on the same
realistic inputs (``handle.sample_inputs``), at batch 1 and, when the batch axis is
dynamic, batch 2. Each output passes when every element satisfies
``|onnx - torch| <= atol + rtol * |torch|`` (numpy's ``allclose`` rule); the report keeps
the maximum absolute and relative error per output and names the worst one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.export.rope import model_rope, reset_rope_state
from edgekit.onnx_int8_kernels import describe_semantics, session_for
from edgekit.sources.handle import ModelHandle


def module_device(module: Any) -> Any:
    """Where the module's weights live (tracing inputs go there); CPU for a weightless module."""
    import torch

    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")

# Relative error is |a - b| / max(|b|, _REL_FLOOR), so near-zero references do not explode it.
_REL_FLOOR = 1e-6


@dataclass
class OutputError:
    name: str
    batch: int
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    ratio: float  # max of |a - b| / (atol + rtol |b|); <= 1 passes
    shape_ok: bool = True

    @property
    def passed(self) -> bool:
        return self.shape_ok and self.ratio <= 1.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "batch": self.batch, "max_abs_error": self.max_abs, "max_rel_error": self.max_rel,
                "atol": self.atol, "rtol": self.rtol, "ratio": self.ratio, "shape_ok": self.shape_ok,
                "passed": self.passed}


@dataclass
class ParityReport:
    errors: list[OutputError] = field(default_factory=list)
    batches: tuple[int, ...] = (1,)
    notes: list[str] = field(default_factory=list)  # what was checked beyond the sample inputs, or not
    kernels: str = ""  # what ran the graph (``describe_semantics``)

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.errors)

    @property
    def worst(self) -> OutputError | None:
        if not self.errors:
            return None
        return max(self.errors, key=lambda e: (not e.shape_ok, e.ratio))

    def to_dict(self) -> dict[str, Any]:
        per_output: dict[str, dict[str, Any]] = {}
        for e in self.errors:  # the worst batch per output
            cur = per_output.get(e.name)
            if cur is None or e.ratio > cur["ratio"] or not e.shape_ok:
                per_output[e.name] = e.to_dict()
        worst = self.worst
        return {"passed": self.passed, "batches": list(self.batches), "kernels": self.kernels, "outputs": per_output,
                "worst": worst.name if worst else None,
                "max_abs_error": max((e.max_abs for e in self.errors), default=0.0),
                "max_rel_error": max((e.max_rel for e in self.errors), default=0.0),
                **({"notes": self.notes} if self.notes else {})}

    def message(self) -> str:
        w = self.worst
        if w is None:
            return "parity: no outputs compared"
        if not w.shape_ok:
            return f"parity failed: output {w.name!r} has a different shape in ONNX than in PyTorch (batch {w.batch})"
        verdict = "failed" if not self.passed else "passed"
        return (f"parity {verdict}: worst output {w.name!r} (batch {w.batch}) max abs error {w.max_abs:.3g} "
                f"(atol {w.atol:g}), max rel error {w.max_rel:.3g} (rtol {w.rtol:g})")


def compare(name: str, reference: np.ndarray, candidate: np.ndarray, atol: float, rtol: float,
            batch: int = 1) -> OutputError:
    """Errors of ``candidate`` (ONNX) against ``reference`` (PyTorch) for one output."""
    ref = np.asarray(reference)
    got = np.asarray(candidate)
    if ref.shape != got.shape:
        return OutputError(name, batch, float("inf"), float("inf"), atol, rtol, float("inf"), shape_ok=False)
    if ref.size == 0:
        return OutputError(name, batch, 0.0, 0.0, atol, rtol, 0.0)
    r = ref.astype(np.float64)
    g = got.astype(np.float64)
    diff = np.abs(g - r)
    # NaN in one but not the other is infinitely wrong; NaN in both agrees.
    both_nan = np.isnan(r) & np.isnan(g)
    diff = np.where(both_nan, 0.0, np.where(np.isnan(diff), np.inf, diff))
    rel = diff / np.maximum(np.abs(np.nan_to_num(r)), _REL_FLOOR)
    ratio = diff / (atol + rtol * np.abs(np.nan_to_num(r)) + 1e-30)
    return OutputError(name, batch, float(diff.max()), float(rel.max()), atol, rtol, float(ratio.max()))


def run_torch(module: Any, feeds: dict[str, np.ndarray], input_names: list[str]) -> list[np.ndarray]:
    import torch

    device = module_device(module)
    args = [torch.from_numpy(np.ascontiguousarray(feeds[n])).to(device) for n in input_names]
    with torch.inference_mode():
        out = module(*args)
    if isinstance(out, dict):
        out = tuple(out.values())
    if not isinstance(out, (tuple, list)):
        out = (out,)
    return [o.detach().cpu().float().numpy() if o.dtype.is_floating_point else o.detach().cpu().numpy()
            for o in out]


def run_onnxruntime(path: str | os.PathLike[str], feeds: dict[str, np.ndarray],
                    semantics: str | None = None) -> tuple[list[str], list[np.ndarray]]:
    """ONNX Runtime on this machine, or computing what ``semantics`` computes (an INT8 graph on
    another CPU's integer kernels, or with Q/DQ in float as TensorRT: ``onnx_int8_kernels``)."""
    import onnxruntime as ort

    if semantics is not None:
        sess = session_for(path, semantics)
    else:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    outs = sess.run(None, {n: feeds[n] for n in names})
    return [o.name for o in sess.get_outputs()], list(outs)


def has_dynamic_batch(handle: ModelHandle) -> bool:
    return any(len(s.shape) > 0 and s.shape[0] == "batch" for s in handle.inputs)


def check_parity(onnx_path: str | os.PathLike[str], handle: ModelHandle, atol: float = 1e-4, rtol: float = 1e-3,
                 per_output: dict[str, tuple[float, float]] | None = None,
                 batches: tuple[int, ...] = (1, 2), semantics: str | None = None) -> ParityReport:
    """ONNX Runtime on ``onnx_path`` against ``handle.module`` on ``handle.sample_inputs``;
    ``semantics``: the integer kernels an INT8 graph is judged on (``run_onnxruntime``; None: this
    machine's).

    >>> report = check_parity("model.onnx", handle)  # doctest: +SKIP
    >>> report.passed, report.worst.max_abs  # doctest: +SKIP
    """
    per_output = per_output or {}
    if not has_dynamic_batch(handle):
        batches = (1,)
    names = [s.name for s in handle.inputs]
    report = ParityReport(batches=tuple(batches), kernels=describe_semantics(semantics))
    runs = [(b, handle.sample_inputs(b), "") for b in batches]
    long = _past_rotary_threshold(handle, report)
    if long is not None:
        runs.append((1, long, f" at {long['input_ids'].shape[1]} tokens"))
    for b, feeds, where in runs:
        reset_rope_state(handle.module)
        ref = run_torch(handle.module, feeds, names)
        out_names, got = run_onnxruntime(Path(onnx_path), feeds, semantics)
        for i, g in enumerate(got):
            name = out_names[i]
            a, r = per_output.get(name, (atol, rtol))
            if i >= len(ref):
                report.errors.append(OutputError(name + where, b, float("inf"), float("inf"), a, r, float("inf"),
                                                 False))
                continue
            report.errors.append(compare(name + where, ref[i], g, a, r, batch=b))
    return report


# A causal LM whose rotation changes with the sequence length (dynamic NTK, longrope) is also compared on
# one sequence crossing that threshold by this many tokens, when its logits (tokens x vocabulary, float32)
# stay within LONG_CHECK_ELEMENTS; a graph without position inputs cannot place a short prompt there.
LONG_CHECK_MARGIN = 8
LONG_CHECK_ELEMENTS = 1 << 26  # 256 MiB of logits per copy


def _past_rotary_threshold(handle: ModelHandle, report: ParityReport) -> dict[str, np.ndarray] | None:
    """Feeds of one sequence past the threshold of a position-dependent rotary causal LM (None for other
    models, or where it would be too large: then a note in ``report`` says so)."""
    spec = model_rope(handle.module) if handle.kind == "causal-lm" and handle.module is not None else None
    if spec is None or spec.threshold is None:
        return None
    n = spec.threshold + LONG_CHECK_MARGIN
    vocab = int(handle.extra.get("vocab_size") or 0)
    if vocab and n * vocab > LONG_CHECK_ELEMENTS:
        report.notes.append(f"{spec.rope_type} rotary: not compared past its threshold of {spec.threshold} tokens "
                            f"({n} x {vocab} logits exceed {LONG_CHECK_ELEMENTS} elements); the KV-cache export "
                            "checks those positions")
        return None
    feeds = handle.sample_inputs(1, sequence=n)
    if feeds["input_ids"].shape[1] < n:  # sample inputs shorter than asked: repeat them
        reps = -(-n // feeds["input_ids"].shape[1])
        feeds = {k: np.tile(v, (1, reps))[:, :n] for k, v in feeds.items()}
    report.notes.append(f"{spec.rope_type} rotary: compared on {n} tokens, past its threshold of {spec.threshold}")
    return {k: np.ascontiguousarray(v[:, :n]) for k, v in feeds.items()}
