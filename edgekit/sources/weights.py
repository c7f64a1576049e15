"""Bounded checks of weight files before a library parses them: safetensors and GGUF.

Both formats start with a header that declares lengths, counts, shapes and offsets. A
corrupt or hostile header (a length of 2^63, a tensor "stored" past the end of the file,
ten billion metadata entries) makes a trusting parser allocate, loop or fail with a
traceback. These checks read only the header, cap every declared length by what the file
can hold, and check every tensor's declared bytes against the file size before any
weights are read, so a bad file costs one line (``BadInputError`` naming the file and
what is wrong) in time and memory proportional to its header.

>>> info = check_safetensors("model.safetensors")  # doctest: +SKIP
>>> info.elements  # doctest: +SKIP
134515008
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError
from edgekit.memory import drop_file_pages

MAX_SAFETENSORS_HEADER = 100_000_000  # bytes; the safetensors library's own limit
# bits per element of each safetensors dtype
SAFETENSORS_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
GGUF_MAX_DIMS = 4
GGUF_MAX_STRING_ITEMS = 16_000_000  # strings in all metadata arrays (a 256k-token vocabulary has 0.5M)
GGUF_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> (name, fixed size in bytes; 0 for string and array)
GGUF_VALUE_TYPES = {0: ("uint8", 1), 1: ("int8", 1), 2: ("uint16", 2), 3: ("int16", 2), 4: ("uint32", 4),
                    5: ("int32", 4), 6: ("float32", 4), 7: ("bool", 1), 8: ("string", 0), 9: ("array", 0),
                    10: ("uint64", 8), 11: ("int64", 8), 12: ("float64", 8)}
GGUF_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
                       11: "<q", 12: "<d"}
GGUF_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                     11: "<i8", 12: "<f8"}
_U64 = struct.Struct("<Q")


@dataclass
class TensorInfo:
    """One tensor's declared type and shape (``dtype`` is the format's own name)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass
class WeightFileInfo:
    """What a checked header declares: tensors by name and their element count."""

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, Any] = field(default_factory=dict)
    # the values of the metadata arrays asked for (``check_gguf(..., arrays=...)``): a list of str
    # for an array of strings, a numpy array for numbers
    arrays: dict[str, Any] = field(default_factory=dict)

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors.values())


def first_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (its type name when it has none)."""
    for line in str(e).splitlines():
        if line.strip():
            return line.strip()
    return type(e).__name__


def refused_by_unpickler(e: BaseException) -> bool:
    """Whether ``torch.load(weights_only=True)`` refused the pickle (rather than found it corrupt)."""
    return str(e).startswith("Weights only load failed")


def unpickler_reason(e: BaseException) -> str:
    """What torch's long weights-only refusal says was refused (``Unsupported global: GLOBAL
    io.open was not an allowed global by default``), without its advice to load unsafely."""
    text = str(e)
    if not text.startswith("Weights only load failed"):
        return first_line(e)
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].split(" Please use `torch.serialization", 1)[0]
        for line in reason.splitlines():
            if line.strip():
                return line.strip()
    skip = ("Weights only load failed", "Check the documentation", "(1)", "(2)", "Please file an issue")
    for line in text.splitlines():
        if line.strip() and not line.strip().startswith(skip):
            return line.strip()
    return "the weights-only unpickler refused it"


def _file_size(path: Path, what: str) -> int:
    try:
        if not path.is_file():
            raise BadInputError(f"{what} {str(path)!r} does not exist")
        return path.stat().st_size
    except OSError as e:
        raise BadInputError(f"cannot read {what} {path}: {e.strerror or e}") from None


# ----------------------------------------------------------------------------------------------
# safetensors: u64 header length N, N bytes of JSON, then the data buffer


def check_safetensors(path: str | os.PathLike[str]) -> WeightFileInfo:
    """Check a safetensors file's header against its size (``BadInputError`` if anything is off)."""
    path = Path(path)
    size = _file_size(path, "weights file")
    if size < 8:
        raise BadInputError(f"{path} is not a safetensors file: {size} bytes, shorter than its 8-byte header length")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_SAFETENSORS_HEADER or n > size - 8:
                raise BadInputError(f"{path} is not a valid safetensors file: it declares a {n:,}-byte header in a "
                                    f"{size:,}-byte file (at most {min(MAX_SAFETENSORS_HEADER, size - 8):,})")
            raw = f.read(n)
    except OSError as e:
        raise BadInputError(f"cannot read weights file {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadInputError(f"{path} is not a valid safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise BadInputError(f"{path} is not a valid safetensors file: its header is not a JSON object")
    data_len = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise BadInputError(f"{path} is not a valid safetensors file: __metadata__ is not a map of strings")
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, t in header.items():
        where = f"{path} is not a valid safetensors file: tensor {name[:80]!r}"
        if not isinstance(t, dict) or set(t) != {"dtype", "shape", "data_offsets"}:
            raise BadInputError(f"{where} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = t["dtype"], t["shape"], t["data_offsets"]
        if dtype not in SAFETENSORS_BITS:
            raise BadInputError(f"{where} has unknown dtype {str(dtype)[:20]!r} (known: {', '.join(SAFETENSORS_BITS)})")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise BadInputError(f"{where} has shape {str(shape)[:60]}, not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise BadInputError(f"{where} has data_offsets {str(offsets)[:60]}, not [begin, end] with begin <= end")
        begin, end = offsets
        bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
        if end > data_len:
            raise BadInputError(f"{where} ends at byte {end:,} of a {data_len:,}-byte data section (truncated file?)")
        if bits % 8 or end - begin != bits // 8:
            raise BadInputError(f"{where} ({dtype} {tuple(shape)}) needs {bits / 8:,.0f} bytes but spans "
                                f"{end - begin:,}")
        tensors[name] = TensorInfo(dtype, tuple(shape))
        spans.append((begin, end, name))
    spans.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(spans, spans[1:]):
        if begin < prev_end:
            raise BadInputError(f"{path} is not a valid safetensors file: tensors {prev[:60]!r} and {name[:60]!r} "
                                "overlap")
    return WeightFileInfo(path, tensors, dict(metadata))


# ----------------------------------------------------------------------------------------------
# GGUF: magic, version, tensor count, metadata count, metadata, tensor infos, padding, data


class _Cursor:
    """Bounded little-endian reads from a buffer; every read checks what is left."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> BadInputError:
        return BadInputError(f"{self.path} is not a valid GGUF file: {what} (at byte {self.pos:,} of {self.size:,})")

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n:,} bytes past the end of the file (truncated?)")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def count(self, what: str, min_item_bytes: int) -> int:
        n = self.unpack("<Q", what)
        if n * min_item_bytes > self.size - self.pos:
            raise self.fail(f"{what} declares {n:,} items; the {self.size - self.pos:,} bytes left hold at most "
                            f"{(self.size - self.pos) // max(min_item_bytes, 1):,}")
        return int(n)

    def string(self, what: str) -> bytes:
        n = self.unpack("<Q", f"{what} length")
        start = self.take(n, what)
        return bytes(self.buf[start:self.pos])

    def strings(self, n: int, what: str) -> list[bytes]:
        """``n`` strings in a row (a vocabulary: 262,144 for Gemma 3), each bounded like ``string``."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        for _ in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"{what} length needs 8 bytes past the end of the file (truncated?)")
            (length,) = _U64.unpack_from(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                raise self.fail(f"{what} needs {length:,} bytes past the end of the file (truncated?)")
            out.append(buf[pos:pos + length])
            pos += length
        self.pos = pos
        return out


def check_gguf(path: str | os.PathLike[str], arrays: tuple[str, ...] = ()) -> WeightFileInfo:
    """Check a GGUF file's header: every count and length against the bytes left, every
    tensor's data inside the file. ``metadata`` holds the scalar and string values (an array
    stands as its length); ``arrays`` names the metadata arrays whose values are kept
    (``info.arrays``: the tokenizer's vocabulary, scores, token types and merges)."""
    path = Path(path)
    size = _file_size(path, "model file")
    if size < 24:
        raise BadInputError(f"{path} is not a GGUF file: {size} bytes, shorter than the GGUF header")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_gguf(buf, path, frozenset(arrays))
    except BadInputError:
        raise
    except (OSError, ValueError) as e:  # mmap of an unreadable or special file
        raise BadInputError(f"cannot read model file {path}: {e}") from None


def _parse_gguf(buf: Any, path: Path, keep: frozenset[str] = frozenset()) -> WeightFileInfo:
    import gguf

    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise BadInputError(f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r}, not {GGUF_MAGIC!r})")
    cur.take(4, "magic")
    version = cur.unpack("<I", "version")
    if version not in GGUF_VERSIONS:
        raise cur.fail(f"version {version} (edgekit reads versions {', '.join(map(str, GGUF_VERSIONS))})")
    n_tensors = cur.count("tensor count", 24)  # name length 8 + dimension count 4 + type 4 + offset 8
    n_kv = cur.count("metadata count", 13)  # key length 8 + type 4 + at least one byte of value
    metadata: dict[str, Any] = {}
    kept: dict[str, Any] = {}
    strings = [0]
    for _ in range(n_kv):
        key = _utf8(cur, cur.string("metadata key"), "metadata key")
        vtype = cur.unpack("<I", f"type of {_short(key)}")
        metadata[key] = _gguf_value(cur, vtype, key, strings, depth=0, keep=kept if key in keep else None)
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
    quant_sizes = {int(t): bs for t, bs in gguf.GGML_QUANT_SIZES.items()}
    type_names = {int(t): t.name for t in gguf.GGMLQuantizationType}
    declared = []
    for _ in range(n_tensors):
        name = _utf8(cur, cur.string("tensor name"), "tensor name")
        n_dims = cur.unpack("<I", f"dimension count of {_short(name)}")
        if n_dims > GGUF_MAX_DIMS:
            raise cur.fail(f"tensor {_short(name)} has {n_dims} dimensions (at most {GGUF_MAX_DIMS})")
        dims = tuple(cur.unpack("<Q", f"dimension of {_short(name)}") for _ in range(n_dims))
        ggml_type = cur.unpack("<I", f"type of {_short(name)}")
        offset = cur.unpack("<Q", f"offset of {_short(name)}")
        if ggml_type not in quant_sizes:
            raise cur.fail(f"tensor {_short(name)} has unknown type {ggml_type}")
        block, type_size = quant_sizes[ggml_type]
        elements = math.prod(dims)
        if dims and dims[0] % block:
            raise cur.fail(f"tensor {_short(name)} ({type_names[ggml_type]}) has a first dimension {dims[0]:,} that is not "
                           f"a multiple of its block of {block}")
        if offset % alignment:
            raise cur.fail(f"tensor {_short(name)} starts at offset {offset:,}, not a multiple of the alignment {alignment}")
        declared.append((name, TensorInfo(type_names[ggml_type], dims), offset, elements // block * type_size))
    data_start = cur.pos + (-cur.pos % alignment)
    tensors: dict[str, TensorInfo] = {}
    for name, info, offset, nbytes in declared:
        end = data_start + offset + nbytes
        if end > cur.size:
            raise BadInputError(f"{path} is not a valid GGUF file: tensor {_short(name)} {info.dtype} {info.shape} needs "
                                f"bytes up to {end:,} of a {cur.size:,}-byte file (truncated?)")
        if name in tensors:
            raise cur.fail(f"tensor {_short(name)} is declared twice")
        tensors[name] = info
    return WeightFileInfo(path, tensors, metadata, kept)


def _short(text: str) -> str:
    """A name from a file, quoted and cut short for a message."""
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def _utf8(cur: _Cursor, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise cur.fail(f"a {what} is not UTF-8") from None


def _gguf_value(cur: _Cursor, vtype: int, key: str, strings: list[int], depth: int,
                keep: dict[str, Any] | None = None) -> Any:
    """One metadata value; arrays of fixed-size items are skipped in one step, arrays of
    strings walked (their lengths must be read), nested arrays at most two deep. With
    ``keep``, the values of a flat array are stored there under ``key``."""
    if vtype not in GGUF_VALUE_TYPES:
        raise cur.fail(f"metadata {_short(key)} has unknown value type {vtype}")
    if vtype in GGUF_SCALAR_FORMATS:
        return cur.unpack(GGUF_SCALAR_FORMATS[vtype], f"value of {_short(key)}")
    if vtype == 8:
        raw = cur.string(f"value of {_short(key)}")
        return raw.decode("utf-8", errors="replace")
    if depth >= 2:
        raise cur.fail(f"metadata {_short(key)} nests arrays more than two deep")
    item_type = cur.unpack("<I", f"item type of {_short(key)}")
    if item_type not in GGUF_VALUE_TYPES:
        raise cur.fail(f"metadata {_short(key)} is an array of unknown type {item_type}")
    item_size = GGUF_VALUE_TYPES[item_type][1]
    n = cur.count(f"array {_short(key)}", item_size or (8 if item_type == 8 else 12))
    if item_size:
        start = cur.take(n * item_size, f"array {_short(key)}")
        if keep is not None:
            import numpy as np  # only for GGUF arrays: the header checks run without numpy

            keep[key] = np.frombuffer(cur.buf, GGUF_ARRAY_DTYPES[item_type], n, start).copy()
        return n  # the length stands for the array: only scalars and strings are needed later
    if item_type == 8:
        strings[0] += n
        if strings[0] > GGUF_MAX_STRING_ITEMS:
            raise cur.fail(f"metadata holds more than {GGUF_MAX_STRING_ITEMS:,} strings")
        items = cur.strings(n, f"item of {_short(key)}")
        if keep is not None:
            try:
                keep[key] = [b.decode("utf-8") for b in items]
            except UnicodeDecodeError:
                raise cur.fail(f"an item of {_short(key)} is not UTF-8") from None
        return n
    for _ in range(n):
        _gguf_value(cur, item_type, key, strings, depth + 1)
    return n


# ----------------------------------------------------------------------------------------------
# After loading


FINITE_CHECK_CHUNK = 1 << 22  # elements checked at a time: isfinite's temporaries (abs, masks) stay ~20 MiB


def check_finite_parameters(module: Any, where: str) -> None:
    """Refuse a model whose parameters hold NaN or infinity (a corrupt or bit-flipped file).
    Each weight is checked ``FINITE_CHECK_CHUNK`` elements at a time: ``torch.isfinite`` of a
    whole table makes float and boolean temporaries the size of it (Gemma-3's 262,144 x 640
    embedding: ~1 GB). A weight memory-mapped from its file leaves resident memory once checked
    (``drop_file_pages``): reading the model here does not make the whole file resident at once."""
    import torch

    for name, p in module.named_parameters():
        if not p.is_floating_point():
            continue
        flat = p.detach().reshape(-1)
        if all(bool(torch.isfinite(flat[i:i + FINITE_CHECK_CHUNK]).all())
               for i in range(0, flat.numel(), FINITE_CHECK_CHUNK)):
            drop_file_pages([p])
            continue
        bad = sum(int((~torch.isfinite(flat[i:i + FINITE_CHECK_CHUNK])).sum())
                  for i in range(0, flat.numel(), FINITE_CHECK_CHUNK))
        raise BadInputError(f"{where}: weight {name} holds {bad:,} NaN or infinite values of {p.numel():,} "
                            "(a corrupt file?)")
