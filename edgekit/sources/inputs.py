"""What a model is fed: input shapes, real sample inputs, and image preprocessing.

Three options, the same on ``export``, ``build``, ``profile``, ``estimate`` and
``compress`` and in recipes:

* **shapes** (trtexec's ``--shapes`` syntax): ``input_ids:1x128,attention_mask:1x128``.
  They bind the model's dynamic dimensions (``batch``, ``sequence``...) for tracing,
  parity, build-time sample inputs and timing. A dynamic dimension nobody binds takes a
  documented default: the batch axis is the batch, a dimension of an integer (token id)
  input is ``DEFAULT_SEQUENCE`` tokens; any other is an error naming the input and its
  dimensions.
* **inputs** (``--inputs FILE.npz``): real sample inputs, one array per model input
  name, read through ``sources.arrays.read_arrays`` (headers checked, never unpickled) and
  checked against the model's input names, dtypes, ranks and static dimensions.
* **preprocess**: how an image becomes the model's input (``Preprocess``): layout
  (``nchw``/``nhwc``), channel order (``rgb``/``bgr``), scale (the value white maps to:
  1 for [0, 1], 255 for raw pixels), per-channel mean and std (in the model's channel
  order), resize and crop. Fields the user leaves out are read from the model where it
  says (``detect_preprocess``: an input shaped ``(N, H, W, 3)`` is NHWC; ONNX metadata
  ``Image.BitmapPixelFormat``, ``Image.NominalPixelRange`` and ``edgekit.preprocess``).

``InputOptions`` bundles the three; ``apply_input_options(handle, options)`` makes a
loaded ``ModelHandle`` follow them (``handle.sample_inputs`` and ``handle.prepare``).
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import BadInputError, bad_choice
from edgekit.limits import MAX_DIM
from edgekit.schema import FieldError, check_fields, show
from edgekit.sources.arrays import image_input, read_arrays
from edgekit.sources.assets import resize_center_crop
from edgekit.sources.handle import InputSpec, ModelHandle, fit_array

DEFAULT_SEQUENCE = 128  # tokens, for a dynamic dimension of a token-id input nobody binds
SHAPES_FORM = "NAME:DIMS[,NAME:DIMS...] with DIMS like 1x3x224x224 (trtexec's --shapes)"
PREPROCESS_FORM = ("KEY=VALUE[,KEY=VALUE...] with keys layout=nchw|nhwc, order=rgb|bgr, scale=1|255|..., "
                   "mean=M or M/M/M, std=S or S/S/S, resize=N, size=HxW "
                   "(e.g. layout=nhwc,order=bgr,scale=255,mean=104/117/123)")
LAYOUTS = ("nchw", "nhwc")
ORDERS = ("rgb", "bgr")
MAX_ELEMENTS = 1 << 31  # one sample input of more elements than this is a typo


# --- shapes -------------------------------------------------------------------------------------


def parse_dims(text: str, where: str) -> tuple[int, ...]:
    """``1x3x224x224`` -> (1, 3, 224, 224); every dimension a whole number >= 1."""
    parts = str(text).strip().lower().split("x")
    if not all(p.strip().isdigit() for p in parts):
        raise BadInputError(f"{where}: dims {str(text)!r} must be whole numbers joined by 'x' (like 1x3x224x224)")
    return check_dims(tuple(int(p) for p in parts), where)


def check_dims(dims: tuple[int, ...], where: str) -> tuple[int, ...]:
    if not dims or len(dims) > 8 or any(d < 1 or d > MAX_DIM for d in dims):
        raise BadInputError(f"{where}: dims {'x'.join(map(str, dims)) or '(none)'} must be 1 to 8 dimensions, "
                            f"each 1 to {MAX_DIM}")
    if math.prod(dims) > MAX_ELEMENTS:
        raise BadInputError(f"{where}: shape {'x'.join(map(str, dims))} has {math.prod(dims):,} elements; at most "
                            f"{MAX_ELEMENTS:,} for one sample input")
    return dims


def parse_shapes(value: str | Mapping[str, Any] | None, where: str = "--shapes") -> dict[str, tuple[int, ...]]:
    """trtexec's ``--shapes`` syntax (``name:1x3x224x224,name2:1x128``), or a mapping of input
    names to dims (a list of ints or a ``1x128`` string, as recipes write them).

    >>> parse_shapes("input_ids:1x128,attention_mask:1x128")
    {'input_ids': (1, 128), 'attention_mask': (1, 128)}
    """
    if value is None:
        return {}
    out: dict[str, tuple[int, ...]] = {}
    if isinstance(value, Mapping):
        for name, dims in value.items():
            if not isinstance(name, str) or not name:
                raise BadInputError(f"{where}: input name {show(name)} must be a non-empty string")
            loc = f"{where} {name!r}"
            if isinstance(dims, str):
                out[name] = parse_dims(dims, loc)
            elif isinstance(dims, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
                out[name] = check_dims(tuple(dims), loc)
            else:
                raise BadInputError(f"{loc}: dims must be a list of whole numbers or a string like 1x128, "
                                    f"got {show(dims)}")
        return out
    text = str(value).strip()
    if not text:
        raise BadInputError(f"{where} is empty; the form is {SHAPES_FORM}")
    for item in text.split(","):
        name, sep, dims = item.strip().rpartition(":")
        if not sep or not name.strip() or not dims.strip():
            raise BadInputError(f"{where} entry {item.strip()!r} is not NAME:DIMS; the form is {SHAPES_FORM}")
        name = name.strip().strip("'\"")
        if name in out:
            raise BadInputError(f"{where} gives input {name!r} twice")
        out[name] = parse_dims(dims, f"{where} {name!r}")
    return out


def shapes_text(shapes: Mapping[str, tuple[int, ...]]) -> str:
    """The trtexec form of ``shapes`` (for messages and bundles)."""
    return ",".join(f"{n}:{'x'.join(map(str, d))}" for n, d in shapes.items())


def check_shapes(specs: list[InputSpec], shapes: Mapping[str, tuple[int, ...]], model: str) -> None:
    """Every named input exists, with the model's rank and static dimensions."""
    names = [s.name for s in specs]
    by_name = {s.name: s for s in specs}
    for name, dims in shapes.items():
        if name not in by_name:
            raise BadInputError(f"--shapes names input {name!r}, which model {model!r} does not have "
                                f"(its inputs: {', '.join(names) or 'none declared'})")
        spec = by_name[name]
        if len(dims) != len(spec.shape):
            raise BadInputError(f"--shapes {name}:{'x'.join(map(str, dims))} has {len(dims)} dimensions; input "
                                f"{name!r} of {model!r} has {len(spec.shape)} {_show_shape(spec.shape)}")
        for ax, (want, have) in enumerate(zip(spec.shape, dims)):
            if isinstance(want, int) and want != have:
                raise BadInputError(f"--shapes {name}:{'x'.join(map(str, dims))}: dimension {ax} of input {name!r} "
                                    f"is fixed at {want} in {model!r} {_show_shape(spec.shape)}")


def _show_shape(shape: tuple[int | str, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def unbound_dims(spec: InputSpec, dims: Mapping[str, int]) -> list[str]:
    """Dynamic dimensions of ``spec`` that neither the batch nor ``dims`` bind."""
    return [d for d in spec.shape if isinstance(d, str) and d != "batch" and d not in dims]


# --- sample inputs from a file ------------------------------------------------------------------


def read_input_file(path: str | os.PathLike[str], specs: list[InputSpec], model: str) -> dict[str, np.ndarray]:
    """Real sample inputs from a ``.npz`` (one array per input name; a ``.npy`` for a
    single-input model), checked against the model's inputs: names, dtypes, ranks, static
    dimensions, one sample count. Any mismatch is one line naming the array and what fits."""
    p = Path(path)
    if p.suffix.lower() not in (".npz", ".npy"):
        raise BadInputError(f"--inputs {str(path)!r} must be a .npz file (one array per input name, as numpy.savez "
                            "writes) or a .npy file for a single-input model")
    if not p.is_file():
        raise BadInputError(f"--inputs file {str(path)!r} does not exist")
    arrays = read_arrays(p)
    names = [s.name for s in specs]
    if "" in arrays:  # a .npy: the one input
        if len(specs) != 1:
            raise BadInputError(f"--inputs {p} holds one array but model {model!r} has {len(specs)} inputs "
                                f"{names}; give a .npz with one array per input name")
        arrays = {names[0]: arrays.pop("")}
    missing = [n for n in names if n not in arrays]
    extra = [n for n in arrays if n not in names]
    if missing or extra:
        raise BadInputError(f"--inputs {p} has arrays {sorted(arrays)}; model {model!r} takes {names}"
                            + (f" (missing {missing})" if missing else "") + (f" (unknown {extra})" if extra else ""))
    for s in specs:
        a = arrays[s.name]
        want = f"{s.dtype} {_show_shape(s.shape)}"
        if str(a.dtype) != s.dtype:
            raise BadInputError(f"--inputs {p}: array {s.name!r} is {a.dtype}; model {model!r} takes {want}")
        if a.ndim != len(s.shape) or any(isinstance(d, int) and d != g for d, g in zip(s.shape, a.shape)):
            raise BadInputError(f"--inputs {p}: array {s.name!r} has shape {tuple(a.shape)}; model {model!r} "
                                f"takes {want}")
    batched = [s.name for s in specs if s.shape and s.shape[0] == "batch"]
    counts = {int(arrays[n].shape[0]) for n in batched}
    if len(counts) > 1:
        raise BadInputError(f"--inputs {p}: arrays {batched} have different batch sizes {sorted(counts)}")
    return {n: np.ascontiguousarray(arrays[n]) for n in names}


# --- image preprocessing ------------------------------------------------------------------------


@dataclass(frozen=True)
class Preprocess:
    """How an image (HWC uint8 RGB) becomes a model input: resized (shorter side to
    ``resize``), centre-cropped to ``size`` (H, W; default the model's input), channels in
    ``order``, ``value = (pixel / 255 * scale - mean) / std`` per channel (mean and std in
    the model's channel order), laid out ``layout``. Unset fields (None) are detected from
    the model or take the defaults NCHW, RGB, scale 1, mean 0, std 1."""

    layout: str | None = None
    order: str | None = None
    scale: float | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    resize: int | None = None
    size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.layout is not None and self.layout not in LAYOUTS:
            raise FieldError("layout", str(bad_choice("layout", self.layout, LAYOUTS)))
        if self.order is not None and self.order not in ORDERS:
            raise FieldError("order", str(bad_choice("channel order", self.order, ORDERS)))
        if self.scale is not None and not (math.isfinite(self.scale) and self.scale > 0):
            raise FieldError("scale", f"must be a positive number (1: [0, 1], 255: raw pixels), got {self.scale}")
        for name in ("mean", "std"):
            v = getattr(self, name)
            if v is None:
                continue
            object.__setattr__(self, name, tuple(float(x) for x in v))
            if len(v) not in (1, 3) or not all(math.isfinite(x) for x in v):
                raise FieldError(name, f"must be 1 or 3 finite numbers (M or M/M/M), got {'/'.join(map(str, v))}")
        if self.std is not None and any(x <= 0 for x in self.std):
            raise FieldError("std", f"must be positive, got {'/'.join(map(str, self.std))}")
        if self.resize is not None and not 1 <= self.resize <= 16384:
            raise FieldError("resize", f"must be 1 to 16384 pixels, got {self.resize}")
        if self.size is not None:
            object.__setattr__(self, "size", tuple(self.size))
            if len(self.size) != 2 or not all(1 <= s <= 16384 for s in self.size):
                raise FieldError("size", f"must be HxW, each 1 to 16384, got {self.size}")

    def merged(self, other: Preprocess | None) -> Preprocess:
        """``other``'s set fields over these (the user's options over what the model says)."""
        if other is None:
            return self
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(other)
                                if getattr(other, f.name) is not None})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v, tuple) else v) for f in fields(self)
                if (v := getattr(self, f.name)) is not None}

    def describe(self) -> str:
        return ",".join(f"{k}={'/'.join(map(_num, v)) if isinstance(v, list) and k != 'size' else v}"
                        if k != "size" else f"size={v[0]}x{v[1]}" for k, v in self.to_dict().items())


def _num(x: float) -> str:
    return f"{x:g}"


def parse_preprocess(value: str | Mapping[str, Any] | Preprocess | None, where: str = "--preprocess") -> Preprocess | None:
    """``layout=nhwc,order=bgr,scale=255,mean=104/117/123`` (or a recipe's mapping) -> Preprocess.

    >>> parse_preprocess("layout=nhwc,order=bgr,scale=255,mean=104/117/123").mean
    (104.0, 117.0, 123.0)
    """
    if value is None or isinstance(value, Preprocess):
        return value
    known = [f.name for f in fields(Preprocess)]
    if isinstance(value, Mapping):
        raw = dict(value)
    else:
        raw = {}
        for item in str(value).split(","):
            if not item.strip():
                continue
            key, sep, v = item.partition("=")
            key = key.strip().lower()
            if not sep or not v.strip():
                raise BadInputError(f"{where} entry {item.strip()!r} is not KEY=VALUE; the form is {PREPROCESS_FORM}")
            if key in raw:
                raise BadInputError(f"{where} gives {key!r} twice")
            raw[key] = v.strip()
        if not raw:
            raise BadInputError(f"{where} is empty; the form is {PREPROCESS_FORM}")
    out: dict[str, Any] = {}
    for key, v in raw.items():
        if key not in known:
            raise BadInputError(f"{where}: unknown key {key!r} (known: {', '.join(known)})")
        try:
            out[key] = _preprocess_value(key, v)
        except ValueError:
            raise BadInputError(f"{where}: {key}={v!r} is not valid; the form is {PREPROCESS_FORM}") from None
    try:
        return Preprocess(**out)
    except BadInputError as e:
        raise BadInputError(f"{where}: {e}") from None


def _preprocess_value(key: str, v: Any) -> Any:
    if key in ("layout", "order"):
        return str(v).strip().lower()
    if key == "scale":
        return float(v)
    if key == "resize":
        if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
            raise ValueError(v)
        return int(v)
    if key in ("mean", "std"):
        items = v if isinstance(v, (list, tuple)) else str(v).split("/")
        return tuple(float(x) for x in items)
    if key == "size":
        items = v if isinstance(v, (list, tuple)) else str(v).lower().split("x")
        if len(items) == 1:
            items = [items[0], items[0]]
        return tuple(int(x) for x in items)
    raise ValueError(key)


# ONNX's image metadata (onnx/docs/MetadataProps.md): pixel format and nominal range.
_PIXEL_FORMATS = {"rgb8": "rgb", "rgba8": "rgb", "bgr8": "bgr", "bgra8": "bgr"}
_PIXEL_RANGES: dict[str, dict[str, Any]] = {
    "nominalrange_0_255": {"scale": 255.0},
    "normalized_0_1": {"scale": 1.0},
    "normalized_1_1": {"scale": 2.0, "mean": (1.0,)},
    "nominalrange_16_235": {"scale": 255.0},
}


def detect_preprocess(spec: InputSpec, metadata: Mapping[str, str] | None = None) -> Preprocess:
    """What the model says about its image input: the layout from its shape (3 or 1 in the
    last dimension and not in the second: NHWC), the crop size from static H and W, and
    ONNX metadata (``Image.BitmapPixelFormat``, ``Image.NominalPixelRange``, and
    ``edgekit.preprocess`` in ``--preprocess`` syntax, which wins)."""
    shape = spec.shape
    nhwc = shape[3] in (1, 3) and shape[1] not in (1, 3)
    h, w = (shape[1], shape[2]) if nhwc else (shape[2], shape[3])
    found: dict[str, Any] = {"layout": "nhwc" if nhwc else "nchw"}
    if isinstance(h, int) and isinstance(w, int):
        found["size"] = (h, w)
    meta = {k.lower(): v for k, v in (metadata or {}).items()}
    fmt = meta.get("image.bitmappixelformat", "").strip().lower()
    if fmt in _PIXEL_FORMATS:
        found["order"] = _PIXEL_FORMATS[fmt]
    found.update(_PIXEL_RANGES.get(meta.get("image.nominalpixelrange", "").strip().lower(), {}))
    detected = Preprocess(**found)
    if "edgekit.preprocess" in meta:
        detected = detected.merged(parse_preprocess(meta["edgekit.preprocess"], "ONNX metadata edgekit.preprocess"))
    return detected


DEFAULT_CROP = 224
RESIZE_RATIO = 256 / 224  # shorter side before the centre crop, as ImageNet evaluation does


def image_prepare(spec: InputSpec, pp: Preprocess) -> Callable[..., dict[str, np.ndarray]]:
    """``prepare(images)`` for an image input: HW/HWC uint8 images -> ``{spec.name: float array}``
    following ``pp`` (see ``Preprocess``). Images already of the input's size are used as
    they are; others are resized (shorter side to ``pp.resize``, default 256/224 of the
    crop) and centre-cropped. Without a size (dynamic H and W), images of one size keep it,
    mixed sizes become 224x224."""

    layout = pp.layout or "nchw"
    channels = spec.shape[3] if layout == "nhwc" else spec.shape[1]
    channels = channels if isinstance(channels, int) else 3
    scale = 1.0 if pp.scale is None else pp.scale
    mean = np.asarray(pp.mean or (0.0,), dtype=np.float32)
    std = np.asarray(pp.std or (1.0,), dtype=np.float32)
    if channels == 1 and (mean.size == 3 or std.size == 3):
        raise BadInputError(f"preprocess gives 3 channel means/stds but input {spec.name!r} has 1 channel")
    dtype = np.dtype(spec.dtype)

    def one(im: np.ndarray, h: int, w: int) -> np.ndarray:
        a = np.asarray(im)
        if a.shape[:2] != (h, w):
            a = resize_center_crop(a, pp.resize or round(max(h, w) * RESIZE_RATIO), max(h, w))
            top, left = (a.shape[0] - h) // 2, (a.shape[1] - w) // 2
            a = a[top:top + h, left:left + w]
        a = a[:, :, None] if a.ndim == 2 else a[:, :, :3]
        x = a.astype(np.float32)
        if channels == 1 and x.shape[2] == 3:
            x = x @ np.asarray([[0.299], [0.587], [0.114]], np.float32)  # luma
        elif channels == 3 and x.shape[2] == 1:
            x = np.repeat(x, 3, axis=2)
        if channels == 3 and pp.order == "bgr":
            x = x[:, :, ::-1]
        return (x * (scale / 255.0) - mean) / std

    def prepare(images: list[np.ndarray], **_: Any) -> dict[str, np.ndarray]:
        if pp.size is not None:
            h, w = pp.size
        else:
            sizes = {tuple(np.asarray(im).shape[:2]) for im in images}
            h, w = next(iter(sizes)) if len(sizes) == 1 else (DEFAULT_CROP, DEFAULT_CROP)
        batch = np.stack([one(im, h, w) for im in images]).astype(dtype)  # (n, h, w, c)
        if layout == "nchw":
            batch = batch.transpose(0, 3, 1, 2)
        return {spec.name: np.ascontiguousarray(batch)}

    return prepare


# --- the options together ------------------------------------------------------------------------


@dataclass(frozen=True)
class InputOptions:
    """What a command was told about the model's inputs: ``shapes`` (input -> dims),
    ``inputs`` (a .npz of real sample inputs) and ``preprocess`` (image preprocessing)."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    inputs: str | None = None
    preprocess: Preprocess | None = None

    def __bool__(self) -> bool:
        return bool(self.shapes or self.inputs or self.preprocess)

    def to_dict(self) -> dict[str, Any]:
        return {"shapes": {k: list(v) for k, v in self.shapes.items()}, "inputs": self.inputs,
                "preprocess": self.preprocess.to_dict() if self.preprocess else None}


def input_options(shapes: str | Mapping[str, Any] | None = None, inputs: str | os.PathLike[str] | None = None,
                  preprocess: str | Mapping[str, Any] | Preprocess | None = None) -> InputOptions | None:
    """``InputOptions`` from command-line or recipe values (None when none is given)."""
    opts = InputOptions(shapes=parse_shapes(shapes), inputs=None if inputs is None else str(inputs),
                        preprocess=parse_preprocess(preprocess))
    return opts or None


def apply_input_options(handle: ModelHandle, options: InputOptions | None) -> ModelHandle:
    """Make ``handle`` follow ``options`` (in place; returned for chaining): shapes checked
    against its inputs and used by ``sample_inputs``; a ``.npz`` of real inputs checked and
    used as its sample inputs; an image preprocessing (over what the model says) as its
    ``prepare``."""
    if not options:
        return handle
    model = handle.name
    if options.shapes:
        check_shapes(handle.inputs, options.shapes, model)
        handle.extra["shapes"] = dict(options.shapes)
    if options.inputs is not None:
        arrays = read_input_file(options.inputs, handle.inputs, model)
        for name, dims in options.shapes.items():
            if tuple(arrays[name].shape) != tuple(dims):
                raise BadInputError(f"--inputs and --shapes disagree on input {name!r}: the file holds "
                                    f"{'x'.join(map(str, arrays[name].shape))}, --shapes says "
                                    f"{'x'.join(map(str, dims))}; give one of them")
        handle.make_inputs = given_inputs(arrays, handle.inputs)
        handle.extra["sample_inputs"] = options.inputs
    if options.preprocess is not None:
        spec = image_input(handle.inputs)
        if spec is None:
            raise BadInputError(f"--preprocess is for image models; {model!r} takes "
                                + (", ".join(f"{s.name} {_show_shape(s.shape)} {s.dtype}" for s in handle.inputs)
                                   or "no declared inputs"))
        pp = detect_preprocess(spec, handle.extra.get("onnx_metadata")).merged(options.preprocess)
        handle.prepare = image_prepare(spec, pp)
        handle.extra["preprocess"] = pp.to_dict()
    return handle


def given_inputs(arrays: dict[str, np.ndarray], specs: list[InputSpec]) -> Callable[..., dict[str, np.ndarray]]:
    """``make_inputs`` serving ``arrays``: the batch axis (where dynamic) cut or repeated to
    the batch asked for; other dimensions as the file holds them."""
    batched = {s.name for s in specs if s.shape and s.shape[0] == "batch"}

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return {k: fit_array(v, (batch, *v.shape[1:])) if k in batched else v for k, v in arrays.items()}

    return make_inputs



def shapes_only(options: InputOptions | None) -> InputOptions | None:
    """Just the shapes of ``options`` (what export and build need once data are prepared)."""
    return InputOptions(shapes=dict(options.shapes)) if options is not None and options.shapes else None
