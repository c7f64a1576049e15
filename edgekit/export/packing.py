"""Packed low-bit linear layers (``QuantLinear``, ``QuantEmbedding``) and their on-disk layout.

Shared by the 4-bit compression step (``compress.weight_only`` packs into it; ``compress.weight_only.packing``
re-exports these names) and the ONNX writers (``export.lm``, ``export.lm_graph`` read it).

Layout (the tensors of one packed layer in ``model.safetensors``; ``N`` = out_features
(rows of the weight), ``K`` = in_features, ``G = ceil(K / group_size)`` groups per row,
``group_size = K`` for per-channel):

``<layer>.qweight``  uint8 ``(N, ceil(K * bits / 8))`` for bits in {2, 4, 8}:
    the integer codes ``q[n, k]`` in ``[0, 2**bits - 1]``, row-major, ``8 // bits`` codes
    per byte, **least significant bits first**: for 4 bits byte ``b = q[n, 2i] | q[n, 2i+1] << 4``
    (low nibble = even column). A row whose ``K * bits`` is not a multiple of 8 is padded
    with zero codes. This is exactly ONNX Runtime's ``MatMulNBits`` ``B`` input
    ``(N, G, group_size * bits / 8)`` once reshaped, when ``group_size`` divides ``K``.
    bits = 3 is stored in the 4-bit layout (two codes per byte, codes 0..7): a 3-bit grid is a
    subset of the 4-bit one, so such layers also run on MatMulNBits' 4-bit kernel. Storage is
    therefore 4 bits per weight for W3 (true 3-bit packing would save another 25%).
``<layer>.scales``   float32 ``(N, G)``.
``<layer>.qzeros``   uint8 ``(N, ceil(G * bits / 8))``: integer zero points packed like
    ``qweight`` along the group axis, per row (the ``MatMulNBits`` ``zero_points`` layout);
    nibbles for 3 bits. Symmetric quantization stores ``2**(bits-1)`` (8 for 4 bits).
``<layer>.bias``     float32 ``(N,)`` when the layer has a bias.

Dequantization: ``W[n, k] = (q[n, k] - zero[n, k // group_size]) * scale[n, k // group_size]``.
``bits`` and ``group_size`` are not tensors: they live in the compression step's record
(``manifest.json`` ``steps[].meta.layers``), from which ``weight_only.rebuild`` recreates
the modules before the state dict is loaded strictly.

``QuantLinear`` dequantizes on the fly in ``forward`` (so the model runs in PyTorch and
adapters such as LoRA can train on top of the frozen packed base); ``dequantize()`` gives
the float weight, and ``weight`` is the same, as a read-only property.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from edgekit.errors import BadInputError
from edgekit.export.config import SUPPORTED_BITS

Device = torch.device | str | None
# QuantLinear.forward dequantizes the whole weight when it has at most this many elements (64 MiB in
# float32), else a block of output rows at a time (Gemma 3's 262,144 x 640 LM head: 640 MiB at once).
FORWARD_CHUNK = 1 << 24
# dequantized_once keeps at most this many bytes of float weights (SmolLM2-135M's 4-bit linears: 0.54 GiB)
KEEP_DEQUANTIZED_BYTES = 1 << 30
# compress's memory goal: its peak within 1.5x the model in bfloat16 (plus one block). What the quality
# gate keeps dequantized must fit in what that leaves beside the packed model and what the gate holds
# anyway (the imported libraries, one window's activations and logits: about 1 GiB).
MEMORY_GOAL_BF16_FACTOR = 1.5
GATE_RESERVE_BYTES = 1 << 30


def num_groups(cols: int, group_size: int) -> int:
    """Groups per row of ``cols`` weights (``group_size == -1``: one group, per channel)."""
    return 1 if group_size == -1 else math.ceil(cols / group_size)


def group_width(cols: int, group_size: int) -> int:
    """Weights per group (``group_size == -1``: the whole row)."""
    return cols if group_size == -1 else group_size


def storage_bits(bits: int) -> int:
    """Bits per code as stored: 3-bit codes use the 4-bit layout."""
    return 4 if bits == 3 else bits


def packed_width(n: int, bits: int) -> int:
    """Bytes per row holding ``n`` codes of ``bits`` bits."""
    return math.ceil(n * storage_bits(bits) / 8)


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (..., n) -> packed uint8 (..., packed_width(n, bits)), LSB first."""
    q = q.to(torch.uint8)
    bits = storage_bits(bits)
    if bits == 8:
        return q.contiguous()
    per = 8 // bits
    n = q.shape[-1]
    pad = (-n) % per
    if pad:
        q = F.pad(q, (0, pad))
    # in uint8 throughout: the low 8 bits int32 arithmetic would keep, without int32 copies of the codes
    # (an LM head's 4-bit codes as int32 were 4x its size in float32 terms: ~1 GB at Llama-3.2-1B)
    q = q.reshape(*q.shape[:-1], -1, per)
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: packed uint8 (..., m) -> uint8 codes (..., n)."""
    bits = storage_bits(bits)
    if bits == 8:
        return packed[..., :n]
    per = 8 // bits
    # floor-divide and modulo rather than shifts: they export to ONNX on every exporter
    div = (2 ** (bits * torch.arange(per, device=packed.device, dtype=torch.int32)))
    out = torch.remainder(torch.div(packed.to(torch.int32).unsqueeze(-1), div, rounding_mode="floor"), 1 << bits)
    return out.to(torch.uint8).reshape(*packed.shape[:-1], -1)[..., :n]


def _exporting() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(torch.onnx.is_in_onnx_export() or (compiler is not None and compiler.is_exporting()))


class _PackedTable(nn.Module):
    """Buffers and dequantization shared by QuantLinear and QuantEmbedding."""

    qweight: torch.Tensor  # buffers (registered in _init_buffers), declared for type checkers
    scales: torch.Tensor
    qzeros: torch.Tensor
    bits: int
    group_size: int

    @property
    def _rows(self) -> int:  # rows of the weight (out_features, num_embeddings)
        raise NotImplementedError

    @property
    def _cols(self) -> int:  # columns of the weight (in_features, embedding_dim)
        raise NotImplementedError

    def _init_buffers(self, rows: int, cols: int, bits: int, group_size: int, device: Device = None) -> None:
        if bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
        self.bits = bits
        self.group_size = group_size
        ng = num_groups(cols, group_size)
        self.register_buffer("qweight", torch.zeros(rows, packed_width(cols, bits), dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.ones(rows, ng, dtype=torch.float32, device=device))
        self.register_buffer("qzeros", torch.zeros(rows, packed_width(ng, bits), dtype=torch.uint8, device=device))

    @property
    def n_groups(self) -> int:
        return self.scales.shape[1]

    def set_quantized(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """Store codes q (rows, cols) uint8, scales (rows, G) and zeros (rows, G) uint8."""
        self.qweight.copy_(pack_codes(q, self.bits))
        self.scales.copy_(scales.float())
        self.qzeros.copy_(pack_codes(zeros, self.bits))

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.qweight, self.bits, self._cols)

    def zeros(self) -> torch.Tensor:
        return unpack_codes(self.qzeros, self.bits, self.n_groups)

    def _dequant_rows(self, qrows: torch.Tensor, srows: torch.Tensor, zrows: torch.Tensor) -> torch.Tensor:
        cols = self._cols
        g = group_width(cols, self.group_size)
        q = unpack_codes(qrows, self.bits, cols).to(srows.dtype)
        z = unpack_codes(zrows, self.bits, srows.shape[-1]).to(srows.dtype)
        q = q[..., : (cols // g) * g] if cols % g == 0 else F.pad(q, (0, (-cols) % g))
        shape = (*q.shape[:-1], srows.shape[-1], g)
        # in place on the fresh float codes: one weight-sized tensor, not three (same values)
        w = q.reshape(shape).sub_(z.unsqueeze(-1)).mul_(srows.unsqueeze(-1))
        return w.reshape(*q.shape[:-1], -1)[..., :cols]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (rows, cols) this layer computes with."""
        w = self._dequant_rows(self.qweight, self.scales, self.qzeros)
        return w if dtype is None else w.to(dtype)

    def dequantize_rows(self, lo: int, hi: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows lo:hi of ``dequantize()``, without dequantizing the others."""
        w = self._dequant_rows(self.qweight[lo:hi], self.scales[lo:hi], self.qzeros[lo:hi])
        return w if dtype is None else w.to(dtype)

    def check(self, name: str = "") -> None:
        """Raise ValueError when the buffers do not fit the declared shape, bits and groups."""
        ng = num_groups(self._cols, self.group_size)
        rows = self._rows
        want = {"qweight": (rows, packed_width(self._cols, self.bits)), "scales": (rows, ng),
                "qzeros": (rows, packed_width(ng, self.bits))}
        for key, shape in want.items():
            got = tuple(getattr(self, key).shape)
            if got != shape:
                raise ValueError(f"{name}.{key} has shape {got}, expected {shape}")
        if not torch.isfinite(self.scales).all():
            raise ValueError(f"{name}.scales holds non-finite values")


class QuantLinear(_PackedTable):
    """A linear layer with packed ``bits``-bit weights, dequantized on the fly.

    >>> layer = QuantLinear(256, 64, bits=4, group_size=128)
    >>> layer(torch.randn(2, 256)).shape
    torch.Size([2, 64])
    """

    bias: torch.Tensor | None
    # (dtype, first row -> float weight of each row block) while inside dequantized_once, else None
    _kept: tuple[torch.dtype, dict[int, torch.Tensor]] | None = None

    def __init__(self, in_features: int, out_features: int, bits: int = 4, group_size: int = 128,
                 bias: bool = False, device: Device = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self._init_buffers(out_features, in_features, bits, group_size, device)
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float32, device=device))
        else:
            self.bias = None

    @property
    def _rows(self) -> int:
        return self.out_features

    @property
    def _cols(self) -> int:
        return self.in_features

    @property
    def weight(self) -> torch.Tensor:  # read-only float view, for code that inspects .weight
        return self.dequantize()

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                       group_size: int, bias: torch.Tensor | None = None) -> QuantLinear:
        out_f, in_f = q.shape
        layer = cls(in_f, out_f, bits, group_size, bias=bias is not None, device=q.device)
        layer.set_quantized(q, scales, zeros)
        if bias is not None and layer.bias is not None:
            layer.bias.copy_(bias.detach().float())
        return layer

    def _row_blocks(self) -> list[tuple[int, int]]:
        """The blocks of output rows ``forward`` dequantizes at a time (one: the whole weight)."""
        rows = max(1, FORWARD_CHUNK // max(self.in_features, 1))
        if self.out_features <= rows:
            return [(0, self.out_features)]
        # a large table (an LM head over a large vocabulary): a block of output rows at a time
        return [(lo, min(lo + rows, self.out_features)) for lo in range(0, self.out_features, rows)]

    def _block_weight(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        kept = self._kept
        if kept is not None and kept[0] == dtype:
            return kept[1][lo]
        return self.dequantize(dtype) if (lo, hi) == (0, self.out_features) else self.dequantize_rows(lo, hi, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        blocks = self._row_blocks()
        if len(blocks) == 1 or _exporting():
            weight = self.dequantize(x.dtype) if _exporting() else self._block_weight(0, self.out_features, x.dtype)
            return F.linear(x, weight, bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for lo, hi in blocks:
            out[..., lo:hi] = F.linear(x, self._block_weight(lo, hi, x.dtype), None if bias is None else bias[lo:hi])
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


@contextmanager
def dequantized_once(module: nn.Module, dtype: torch.dtype = torch.float32,
                     max_bytes: int = KEEP_DEQUANTIZED_BYTES) -> Iterator[int]:
    """Within: the ``QuantLinear`` layers of ``module`` compute with their weights dequantized once,
    on entry, instead of on every forward (the same function of the same codes, so the same outputs
    to the bit). For many forwards of a model whose codes do not change meanwhile (the quality gate's
    windows). Layers are kept in module order while their float weights total at most ``max_bytes``;
    the others dequantize per forward as before. Yields the bytes kept; they are let go on exit."""
    kept: list[QuantLinear] = []
    total = 0
    try:
        for m in module.modules():
            if not isinstance(m, QuantLinear) or m._kept is not None:
                continue
            size = m.out_features * m.in_features * dtype.itemsize
            if total + size > max_bytes:
                continue
            m._kept = (dtype, {lo: m._block_weight(lo, hi, dtype) for lo, hi in m._row_blocks()})
            kept.append(m)
            total += size
        yield total
    finally:
        for m in kept:
            m._kept = None


def _stored_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``module``, each tensor that shares another's storage left out."""
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the model's tensors as stored (shared tensors counted once)."""
    return sum(t.numel() * t.element_size() for t in _stored_tensors(module))


def keep_dequantized_budget(module: nn.Module) -> int:
    """The float bytes ``dequantized_once`` may keep for ``module`` (a packed model) within the memory
    goal: ``1.5 x`` its weights in bfloat16, less its stored bytes and ``GATE_RESERVE_BYTES``, at most
    ``KEEP_DEQUANTIZED_BYTES``; 0 for a small model, whose imports alone exceed the goal (SmolLM2-135M),
    ~1 GiB from 1B parameters on. The same outputs either way: only the CPU time differs."""
    tensors = _stored_tensors(module)
    stored = sum(t.numel() * t.element_size() for t in tensors)
    weights = sum(t.numel() for t in tensors if t.is_floating_point())
    tables = set()
    for m in module.modules():  # packed tables: the weights they stand for (a tied pair once)
        if isinstance(m, _PackedTable) and m.qweight.data_ptr() not in tables:
            tables.add(m.qweight.data_ptr())
            weights += m._rows * m._cols
    budget = int(MEMORY_GOAL_BF16_FACTOR * 2 * weights) - stored - GATE_RESERVE_BYTES
    return max(0, min(KEEP_DEQUANTIZED_BYTES, budget))


class QuantEmbedding(_PackedTable):
    """An embedding table with packed rows; ``forward`` dequantizes only the rows looked up.

    Tied to a ``QuantLinear`` LM head by sharing its buffers (``tie_to``). ``scale``: the factor a
    scaled embedding applies to its rows (Gemma 3's ``sqrt(hidden)``; 1.0 for ``nn.Embedding``),
    kept so that packing does not change what the model computes.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int = 8, group_size: int = 128,
                 padding_idx: int | None = None, device: Device = None, scale: float = 1.0) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.scale = float(scale)
        self._init_buffers(num_embeddings, embedding_dim, bits, group_size, device)

    @property
    def _rows(self) -> int:
        return self.num_embeddings

    @property
    def _cols(self) -> int:
        return self.embedding_dim

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def tie_to(self, head: QuantLinear) -> None:
        """Share the packed table of ``head`` (an LM head of shape (vocab, hidden))."""
        if (head.out_features, head.in_features) != (self.num_embeddings, self.embedding_dim):
            raise ValueError("tied head and embedding shapes differ")
        self.bits, self.group_size = head.bits, head.group_size
        self.qweight, self.scales, self.qzeros = head.qweight, head.scales, head.qzeros

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if _exporting():  # one Gather on the dequantized table: what export rewrites find
            rows = F.embedding(ids, self.dequantize())
        else:
            rows = self._dequant_rows(self.qweight[ids], self.scales[ids], self.qzeros[ids])
        return rows if self.scale == 1.0 else rows * self.scale

    def extra_repr(self) -> str:
        extra = f", scale={self.scale:g}" if self.scale != 1.0 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}{extra}"


class ScaledEmbedding(nn.Embedding):
    """``nn.Embedding`` whose rows are multiplied by a constant: the float stand-in of a packed
    scaled embedding (Gemma 3) while a graph is traced (``export.lm.float_placeholders``)."""

    def __init__(self, *args: Any, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale = float(scale)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return rows if self.scale == 1.0 else rows * self.scale


def validate_packed(module: nn.Module) -> None:
    """Raise BadInputError when a loaded packed layer's buffers are inconsistent."""
    for name, m in module.named_modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            try:
                m.check(name)
                if int(m.zeros().max()) > 2**m.bits - 1:
                    raise ValueError(f"{name}.qzeros holds codes beyond {m.bits} bits")
            except ValueError as e:
                raise BadInputError(f"corrupt packed checkpoint: {e}") from None
