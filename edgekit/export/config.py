"""How to export, as configs that import neither PyTorch nor ONNX: ``ExportConfig`` (every
export) and ``CausalLMExportOptions`` (the KV-cache export of a causal LM). Their fields
declare the flags of ``edgekit export`` (``edgekit.options``); recipes name the same fields.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from edgekit.errors import BadInputError, bad_choice
from edgekit.options import option
from edgekit.schema import check_fields

DEFAULT_OPSET = 18
MIN_OPSET, MAX_OPSET = 13, 23
LM_OPSET = 21  # the KV-cache export's default (blocked DequantizeLinear needs 21)
LM_TOLERANCE = 2e-3  # the KV-cache export's default atol and rtol (export_causal_lm's)
LM_GRAPHS = ("auto", "fused", "traced")
LM_WEIGHT_FORMATS = ("matmulnbits", "qdq")
# the bit widths of packed low-bit layers (packing.py), here so that the configs the command line reads
# (compress's weight-only step) check them without PyTorch
SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class ExportConfig:
    """How to export.

    opset: ONNX opset, 13 to 23 (the dynamo exporter emits 18 and later; below 18 the legacy
        exporter is used, with a warning; the legacy exporter stops at 20).
    dynamo: use the dynamo exporter (legacy TorchScript exporter as the fallback).
    dynamic_batch: keep the batch axis (from ``handle.dynamic_axes``) symbolic.
    batch: batch size of the tracing inputs (2 keeps the exporter from specialising on 1).
    atol / rtol: parity tolerances for every output; ``tolerances`` overrides per output
        name with ``(atol, rtol)``. A compression step may loosen atol/rtol through its
        record (``meta["parity"]``); see ``effective_tolerances``.
    skip_parity: write the artifact without the parity check.
    int8_kernels: the integer arithmetic an INT8 graph's parity is judged in: "int16-pairs" (x86
        without VNNI), "int32" (VNNI, AMX, arm64), "float-qdq" (TensorRT); None: what the INT8 step
        recorded for its target, else this machine's kernels. Other kernels than this machine's run
        through ``onnx_int8_kernels``'s model of them.
    """

    opset: int = field(default=DEFAULT_OPSET, metadata=option(
        "--opset", basic=True, show_default=False,
        help=f"ONNX opset, {MIN_OPSET} to {MAX_OPSET} (default {DEFAULT_OPSET}; with --kv-cache {LM_OPSET})."))
    dynamo: bool = field(default=True, metadata=option(
        "--dynamo/--legacy", help="The exporter: dynamo (torch.export), or the legacy TorchScript one."))
    dynamic_batch: bool = True
    batch: int = 2
    atol: float = field(default=1e-4, metadata=option(
        "--atol", show_default=False,
        help=f"Parity: absolute tolerance (default 1e-4; with --kv-cache {LM_TOLERANCE:g})."))
    rtol: float = field(default=1e-3, metadata=option(
        "--rtol", show_default=False,
        help=f"Parity: relative tolerance (default 1e-3; with --kv-cache {LM_TOLERANCE:g})."))
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    skip_parity: bool = field(default=False, metadata=option(
        "--no-parity/--parity", basic=True,
        help="Write the ONNX graph unchecked (--no-parity), or check it against PyTorch on ONNX Runtime."))
    int8_kernels: str | None = None

    def __post_init__(self) -> None:
        # onnx_int8_kernels imports ONNX: read here, so that the config module stays light
        from edgekit.onnx_int8_kernels import SEMANTICS

        check_fields(self)  # types from the annotations, before the range checks below
        if not isinstance(self.opset, int) or not MIN_OPSET <= self.opset <= MAX_OPSET:
            raise BadInputError(f"opset {self.opset!r} is not supported (choose {MIN_OPSET} to {MAX_OPSET})")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise BadInputError(f"export batch must be an integer >= 1, got {self.batch!r}")
        for what, v in (("atol", self.atol), ("rtol", self.rtol)):
            if not (isinstance(v, (int, float)) and v >= 0):
                raise BadInputError(f"parity {what} must be >= 0, got {v!r}")
        for name, tol in self.tolerances.items():
            if not (isinstance(tol, (tuple, list)) and len(tol) == 2 and all(
                    isinstance(t, (int, float)) and t >= 0 for t in tol)):
                raise BadInputError(f"tolerance for output {name!r} must be (atol, rtol) >= 0, got {tol!r}")
        if self.int8_kernels is not None and self.int8_kernels not in SEMANTICS:
            raise bad_choice("INT8 kernels", self.int8_kernels, SEMANTICS)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tolerances"] = {k: list(v) for k, v in self.tolerances.items()}
        return d


@dataclass(frozen=True)
class CausalLMExportOptions:
    """The KV-cache export of a causal LM (``export_causal_lm``'s own options; opset, atol,
    rtol and parity are ExportConfig's flags).

    kv_cache: export with the KV cache as inputs and outputs (optimum's
        text-generation-with-past), for real one-token decode latency.
    accuracy_level: MatMulNBits compute precision on ONNX Runtime's CPU (0 fp32 ... 4 int8;
        None: the exporter's default, 4). Int8 compute rounds each activation block to int8, its only
        loss, the same on every CPU kind (``onnx_int8_kernels.matmulnbits_int8``).
    graph: "fused" (ONNX Runtime's fused decoder graph), "traced" (optimum's export) or "auto"
        (fused where the architecture has it).
    block_size: the fused graph's MatMulNBits block size (None: the quantization group).
    weight_format: packed low-bit layers as "matmulnbits" or blocked DequantizeLinear ("qdq").
    """

    kv_cache: bool = field(default=False, metadata=option(
        "--kv-cache/--no-kv-cache", basic=True,
        help="Causal LMs: export with the KV cache as inputs and outputs (text-generation-with-past, optimum), "
             "for real one-token decode latency."))
    accuracy_level: int | None = field(default=None, metadata=option(
        "--accuracy-level", bounds=(0, 4),
        help="Packed low-bit layers (with --kv-cache): MatMulNBits compute precision on ONNX Runtime's CPU; "
             "4 = int8 compute (default: 11.6x faster one-token decode on SmolLM2 than 0), 0 = fp32 compute."))
    graph: str = field(default="auto", metadata=option(
        "--graph", choices=LM_GRAPHS,
        help="Causal LMs (with --kv-cache): fused = ONNX Runtime's fused decoder graph (GroupQueryAttention, "
             "fused norms and matmuls, in-place KV cache), traced = optimum's export; auto = fused where the "
             "architecture has it (Llama, Mistral, Qwen2, Gemma 2 and 3)."))
    block_size: int | None = field(default=None, metadata=option(
        "--block-size",
        help="Fused graph: MatMulNBits block size (16..256, dividing the quantization group; default the group)."))
    weight_format: str = field(default="matmulnbits", metadata=option(
        "--weight-format", choices=LM_WEIGHT_FORMATS,
        help="Packed low-bit layers (with --kv-cache): matmulnbits = ONNX Runtime's MatMulNBits (CPU, CUDA); "
             "qdq = blocked DequantizeLinear (opset 21), the form TensorRT 10 imports (signed, no zero points, "
             "when the weights were quantized with --sym)."))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.graph not in LM_GRAPHS:
            raise bad_choice("graph", self.graph, LM_GRAPHS)
        if self.weight_format not in LM_WEIGHT_FORMATS:
            raise bad_choice("weight format", self.weight_format, LM_WEIGHT_FORMATS)
        if self.accuracy_level is not None and not 0 <= self.accuracy_level <= 4:
            raise BadInputError(f"accuracy level {self.accuracy_level!r} is not one of 0 to 4")
        if not self.kv_cache:
            if self.accuracy_level is not None:
                raise BadInputError("--accuracy-level applies to the KV-cache export of a packed causal LM "
                                    "(add --kv-cache)")
            if self.graph != "auto" or self.block_size is not None or self.weight_format != "matmulnbits":
                raise BadInputError("--graph, --block-size and --weight-format apply to the KV-cache export of a "
                                    "causal LM (add --kv-cache)")
