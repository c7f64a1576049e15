"""Arrays as files hold them and as a model takes them: ``.npy`` / ``.npz`` files read
safely (``read_arrays``: headers checked before numpy loads anything, never unpickled), the
single image-shaped input of a model (``image_input``), and arrays checked against a
model's inputs (``check_arrays``).

``sources.data`` (user data sources) and ``sources.inputs`` (``--inputs FILE.npz``) both
read arrays through here.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError
from edgekit.sources.handle import InputSpec

MAX_ARRAY_BYTES = 4 * 2**30  # refuse .npy/.npz files declaring more array data than this


def _npy_header(f: Any, where: str) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape from a .npy header (numpy caps the header's length), refusing object arrays."""
    from numpy.lib import format as npy

    try:
        version = npy.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = npy.read_array_header_2_0(f)
        else:
            raise ValueError(f"unknown .npy format version {version}")
    except (ValueError, OSError, EOFError, SyntaxError, struct.error) as e:
        raise BadInputError(f"{where} is not a valid .npy array: {str(e).strip().splitlines()[0]}") from None
    if dtype.hasobject:
        raise BadInputError(f"{where} holds Python objects (dtype {dtype}), which only unpickling can load; "
                            "edgekit reads numeric arrays only (allow_pickle=False)")
    return dtype, tuple(shape)


def _check_declared(where: str, dtype: np.dtype, shape: tuple[int, ...], available: int) -> int:
    """An array header's bytes against what the file holds and ``MAX_ARRAY_BYTES``."""
    need = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if need > MAX_ARRAY_BYTES:
        raise BadInputError(f"{where} declares a {dtype} array of shape {shape} ({need / 2**30:.1f} GiB); edgekit "
                            f"reads at most {MAX_ARRAY_BYTES / 2**30:.0f} GiB of arrays")
    if need > available:
        raise BadInputError(f"{where} declares a {dtype} array of shape {shape} ({need:,} bytes) but holds "
                            f"{available:,} bytes of data (truncated?)")
    return need


def _check_headers(path: Path) -> None:
    """Headers of a .npy file, or of every array in a .npz archive, before numpy loads them:
    no object arrays, declared sizes within the file and within ``MAX_ARRAY_BYTES`` in all."""
    import zipfile

    try:
        if path.suffix.lower() == ".npy":
            with open(path, "rb") as f:
                dtype, shape = _npy_header(f, str(path))
                _check_declared(str(path), dtype, shape, path.stat().st_size - f.tell())
            return
        total = 0
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                where = f"{path}: array {info.filename.removesuffix('.npy')!r}"
                if not info.filename.endswith(".npy"):
                    raise BadInputError(f"{path}: member {info.filename!r} is not a .npy array (an .npz archive "
                                        "holds only arrays, as written by numpy.savez)")
                with z.open(info) as f:
                    dtype, shape = _npy_header(f, where)
                    header = f.tell()
                total += _check_declared(where, dtype, shape, info.file_size - header)
                if total > MAX_ARRAY_BYTES:
                    raise BadInputError(f"{path} holds more than {MAX_ARRAY_BYTES / 2**30:.0f} GiB of arrays; "
                                        "edgekit reads at most that")
    except BadInputError:
        raise
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError) as e:
        raise BadInputError(f"{path} is not a valid .npz archive: {str(e).strip() or type(e).__name__}") from None


NUMERIC_KINDS = {"b": "bool", "i": "int", "u": "uint", "f": "float"}


def _check_array(where: str, name: str, a: np.ndarray) -> None:
    """A usable data array: numeric, at least one axis (samples), finite."""
    label = f"{where}: array {name!r}" if name else where
    if a.dtype.kind not in NUMERIC_KINDS:
        raise BadInputError(f"{label} has dtype {a.dtype}; data arrays are numeric "
                            f"({', '.join(NUMERIC_KINDS.values())})")
    if a.ndim == 0:
        raise BadInputError(f"{label} is a single {a.dtype} value; data arrays hold samples along axis 0")
    if a.dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(a)))
        if bad:
            raise BadInputError(f"{label} holds {bad:,} NaN or infinite values of {a.size:,}; calibration and "
                                "evaluation data must be finite")


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a ``.npy`` (under the name ``""``) or ``.npz`` file, read safely: headers
    checked before numpy loads anything (no pickles, declared sizes within the file), every
    array numeric, with a sample axis, and finite. Anything else is one ``BadInputError``."""
    import zipfile

    _check_headers(path)
    try:
        if path.suffix.lower() == ".npy":
            arrays = {"": np.load(path, allow_pickle=False)}
        else:
            with np.load(path, allow_pickle=False) as loaded:
                arrays = {k: loaded[k] for k in loaded.files}
    except OSError as e:
        raise BadInputError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise BadInputError(f"cannot read {path} as a NumPy file: {str(e).strip().splitlines()[0]}") from None
    for name, a in arrays.items():
        if name != "labels":
            _check_array(str(path), name, a)
    return arrays


def image_input(specs: list[InputSpec]) -> InputSpec | None:
    """The single float input shaped like a batch of images (rank 4 with 1 or 3 channels
    first or last), or None."""
    if len(specs) != 1:
        return None
    s = specs[0]
    if len(s.shape) != 4 or not s.dtype.startswith("float"):
        return None
    return s if s.shape[1] in (1, 3) or s.shape[3] in (1, 3) else None


def check_arrays(specs: list[InputSpec], arrays: dict[str, np.ndarray], where: str) -> None:
    """Arrays against the model's inputs: names, dtype, rank and static dimensions."""
    names = [s.name for s in specs]
    missing = [n for n in names if n not in arrays]
    if missing:
        raise BadInputError(f"{where} has arrays {sorted(arrays)}; the model's inputs are {names} (missing {missing})")
    for s in specs:
        a = arrays[s.name]
        if str(a.dtype) != s.dtype:
            raise BadInputError(f"{where}: input {s.name!r} has dtype {a.dtype}; the model expects {s.dtype}")
        if a.ndim != len(s.shape) or any(isinstance(d, int) and d != g for d, g in zip(s.shape, a.shape, strict=False)):
            raise BadInputError(f"{where}: input {s.name!r} has shape {tuple(a.shape)}; the model expects "
                                f"{tuple(s.shape)}")
    counts = {int(arrays[n].shape[0]) for n in names}
    if len(counts) > 1:
        raise BadInputError(f"{where}: inputs have different sample counts {sorted(counts)}")
