"""What ``edgekit estimate`` is asked: ``EstimateOptions``, whose fields declare its flags
(``edgekit.options``). Light (no ONNX): the command line reads it to build its options.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgekit.errors import BadInputError
from edgekit.limits import MAX_DIM
from edgekit.options import option
from edgekit.schema import check_fields

TIMINGS = ("gpu-compute", "end-to-end")  # what an estimate's total stands for


def parse_axis_sizes(axes: tuple[str, ...]) -> dict[str, int]:
    """``("past_sequence_length=0", "sequence_length=128")`` -> ``{name: size}``; a malformed
    entry raises BadInputError naming it.

    >>> parse_axis_sizes(("sequence_length=128",))
    {'sequence_length': 128}
    """
    bound: dict[str, int] = {}
    for a in axes:
        name, _, value = a.partition("=")
        if not name or not value.strip().lstrip("-").isdigit() or not 0 <= int(value) <= MAX_DIM:
            raise BadInputError(f"--axis {a!r} must be NAME=SIZE with a whole number SIZE from 0 to {MAX_DIM} (0: an "
                                "empty axis, such as past_sequence_length=0 for a prefill)")
        bound[name] = int(value)
    return bound


@dataclass(frozen=True)
class EstimateOptions:
    """How to estimate (``estimate_with_calibration``'s options).

    precision: the engine's precision (None: the graph's own).
    batch: the batch to estimate.
    axes: named dynamic axes bound to a size, ``NAME=SIZE`` (``--shapes`` binds whole inputs).
    runtime: whose fusions apply (None: the target's first runtime).
    calibrate: first measure the model here and fit the target's efficiency factors.
    timing: what the total stands for (``TIMINGS``).
    top_k: kernels in the printed table.
    """

    precision: str | None = field(default=None, metadata=option(
        "--precision", basic=True, help="fp32 | fp16 | bf16 | int8 | int4 ... (default: the graph's own)."))
    batch: int = field(default=1, metadata=option("--batch", basic=True, bounds=(1, MAX_DIM), help="Batch to estimate."))
    axes: tuple[str, ...] = field(default=(), metadata=option(
        "--axis", basic=True, deprecated=("--dim",), metavar="NAME=SIZE",
        help="Bind a named dynamic axis of every input, NAME=SIZE (repeatable; 0: an empty axis, such as "
             "past_sequence_length=0 for a prefill); --shapes binds whole inputs."))
    runtime: str | None = field(default=None, metadata=option(
        "--runtime", help="Whose fusions to apply: tensorrt | onnxruntime | none (default: the target's first "
                          "runtime)."))
    calibrate: bool = field(default=False, metadata=option(
        "--calibrate/--no-calibrate", help="First measure the model here and fit the target's efficiency factors."))
    timing: str = field(default="gpu-compute", metadata=option(
        "--timing", choices=TIMINGS,
        help="What the total stands for: the engine's kernels (trtexec's GPU Compute Time, MLPerf's harness), or "
             "end to end through a Python predictor with host copies of inputs and outputs (Ultralytics' "
             "benchmark); both are estimated."))
    top_k: int = field(default=10, metadata=option("--top-k", bounds=(1, 10_000), help="Kernels in the table."))

    def __post_init__(self) -> None:
        check_fields(self)
        if not 1 <= self.batch <= MAX_DIM:
            raise BadInputError(f"batch {self.batch} is not one of 1 to {MAX_DIM}")
        if not 1 <= self.top_k:
            raise BadInputError(f"top_k {self.top_k} must be at least 1")
        parse_axis_sizes(self.axes)

    def axis_sizes(self) -> dict[str, int]:
        return parse_axis_sizes(self.axes)
