"""The model record that flows between steps: ``ModelHandle``.

Every model source (zoo name, entry point, Hugging Face folder, GGUF, ``.pt2``,
``.onnx``, a previous step's output folder) yields a ``ModelHandle``. Its ``module``
is always a plain ``nn.Module`` whose ``forward`` takes the tensors named in
``inputs`` positionally, in that order, and returns one tensor or a tuple of tensors
named by ``outputs``. Wrappers (e.g. around Hugging Face models) make that so, so
export, parity, compression and runtimes never special-case a model family.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.errors import BadInputError
from edgekit.limits import require_memory

if TYPE_CHECKING:  # numpy is imported where arrays are made: the command line reads this module without it
    import numpy as np

# Task kinds: decide default data, evaluation and how compression steps find layers.
KINDS = ("image-classifier", "causal-lm", "text-encoder", "generic")


@dataclass(frozen=True)
class InputSpec:
    """One model input. ``shape`` entries are ints or names of dynamic axes ("batch")."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str = "float32"  # numpy dtype name

    def concrete_shape(self, batch: int = 1, **dims: int) -> tuple[int, ...]:
        out = []
        for d in self.shape:
            if isinstance(d, int):
                out.append(d)
            elif d == "batch":
                out.append(batch)
            elif d in dims:
                out.append(dims[d])
            else:
                out.append(1)
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InputSpec:
        return cls(d["name"], tuple(d["shape"]), d.get("dtype", "float32"))


@dataclass
class StepRecord:
    """One applied compression step: registry name, config (as a dict) and what it
    learned that is needed to rebuild or export the model (kept layers, layouts...)."""

    name: str
    config: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelHandle:
    """A loaded model and everything edgekit knows about it.

    Attributes:
        name: display name ("efficientnet-lite0").
        source: the spec that reloads the *base* model (zoo name, path, "pkg.mod:fn").
        kind: one of KINDS.
        module: the PyTorch model (None for an ONNX-only source).
        onnx_path: set when the model is an ONNX file (external, or exported).
        inputs / outputs: the I/O contract of ``module`` and of the ONNX graph.
        make_inputs: ``make_inputs(batch, **dims) -> dict[name, np.ndarray]`` real or
            realistic sample inputs (a real image, a real sentence), used for export
            tracing, parity and profiling.
        prepare: maps raw samples from a data source (list of HWC uint8 images, or a
            text string) to model inputs ``dict[name, np.ndarray]`` with a leading
            sample axis. None when the model takes arrays as they come.
        default_calib / default_eval / default_train: data specs (see sources.data).
        evaluator: the name of the evaluation in ``edgekit.evaluate`` that fits it.
        tokenizer: for text models.
        dynamic_axes: input/output name -> {axis index: axis name}, for export.
        steps: compression steps applied so far (the chain the artifact records).
        step_rewrites: maps a step's name to its ONNX graph rewrite (or None); set by the
            compression steps that made the handle, read by export (which sits below them).
        extra: free-form facts (e.g. "num_classes", "labels", "hf_config").
        quantized: the integer precision ("int8", "int4") the last quantizing step of ``steps``
            left the model in, None for float weights; compress sets it from its registry as it
            applies or reloads steps, so the layers below it need no step names.
    """

    name: str
    source: str
    kind: str = "generic"
    module: Any = None  # torch.nn.Module; typed Any so the package imports without torch
    onnx_path: Path | None = None
    inputs: list[InputSpec] = field(default_factory=list)
    outputs: list[str] = field(default_factory=lambda: ["output"])
    make_inputs: Callable[..., dict[str, np.ndarray]] | None = None
    prepare: Callable[..., dict[str, np.ndarray]] | None = None  # (raw samples, seqlen=None for text)
    default_calib: str | None = None
    default_eval: str | None = None
    default_train: str | None = None
    evaluator: str | None = None
    tokenizer: Any = None
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    step_rewrites: Callable[[str], Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    quantized: str | None = None

    def sample_inputs(self, batch: int = 1, **dims: int) -> dict[str, np.ndarray]:
        """Inputs for tracing, parity and timing: the model's own realistic ones when it
        has them, else deterministic random values of the declared shapes and dtypes.
        Shapes the user gave (``extra["shapes"]``, see ``sources.inputs``) bind the batch and
        the named dynamic dimensions (explicit ``dims`` win), and the inputs they name come
        out at exactly those shapes."""
        shapes = self.extra.get("shapes") or {}
        if shapes:
            batch, bound = bind_dims(self.inputs, shapes, batch)
            dims = {**bound, **dims}
        require_memory(feeds_nbytes(self.inputs, batch, shapes, **dims),
                       f"a batch of {batch} sample inputs of {self.name}", "lower --batch or --shapes")
        feeds = self.make_inputs(batch, **dims) if self.make_inputs is not None else random_inputs(
            self.inputs, batch, **dims)
        return fit_feeds(feeds, shapes) if shapes else feeds

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "kind": self.kind,
                "inputs": [i.to_dict() for i in self.inputs], "outputs": list(self.outputs),
                "dynamic_axes": {k: {str(a): n for a, n in v.items()} for k, v in self.dynamic_axes.items()}}


def stored_bytes(handle: ModelHandle) -> int:
    """Bytes the model's weights take (its tensors once each, or its ONNX file with external
    data): about what an export or a build writes, checked against the free disk first."""
    if handle.module is not None:
        seen: set[int] = set()
        total = 0
        for t in [*handle.module.parameters(), *handle.module.buffers()]:
            if t.data_ptr() not in seen:  # tied weights are stored once
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
    if handle.onnx_path is not None:
        folder = Path(handle.onnx_path).parent
        try:
            total = Path(handle.onnx_path).stat().st_size
            stem = Path(handle.onnx_path).name
            total += sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith(stem) and f.name != stem
                         and f.is_file())
        except OSError:
            return 0
        return total
    return 0


def feeds_nbytes(specs: list[InputSpec], batch: int = 1, shapes: dict[str, tuple[int, ...]] | None = None,
                 **dims: int) -> int:
    """Bytes the sample inputs of ``specs`` take at ``batch`` (and ``dims``; an input ``shapes``
    names at exactly that shape): what ``sample_inputs`` checks before it allocates them."""
    total = 0
    bound = {k: v for k, v in dims.items() if isinstance(v, int)}  # None: the model's own default size
    for s in specs:
        shape = (shapes or {}).get(s.name) or s.concrete_shape(batch, **bound)
        try:
            import numpy as np

            itemsize = np.dtype(s.dtype).itemsize
        except TypeError:
            itemsize = 8
        total += math.prod(shape) * itemsize
    return total


def random_inputs(specs: list[InputSpec], batch: int = 1, seed: int = 0, **dims: int) -> dict[str, np.ndarray]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for s in specs:
        shape = s.concrete_shape(batch, **dims)
        dt = np.dtype(s.dtype)
        if dt.kind in "iu":
            out[s.name] = rng.integers(0, 100, size=shape).astype(dt)
        elif dt.kind == "b":
            out[s.name] = np.ones(shape, dtype=dt)
        else:
            out[s.name] = rng.standard_normal(shape).astype(dt)
    return out


# --- shapes the user gave (``--shapes``): binding dims and fitting sample inputs ------------------


def bind_dims(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]], batch: int) -> tuple[int, dict[str, int]]:
    """The batch and named dynamic dimensions that ``shapes`` (input -> dims) give:
    ``(batch, {axis name: size})``. One axis name given two sizes is an error."""
    bound: dict[str, int] = {}
    where: dict[str, str] = {}
    for spec in specs:
        dims = shapes.get(spec.name)
        if dims is None:
            continue
        for d, size in zip(spec.shape, dims):
            if isinstance(d, str):
                if d in bound and bound[d] != size:
                    raise BadInputError(f"--shapes gives dimension {d!r} as {bound[d]} (input {where[d]!r}) and "
                                        f"{size} (input {spec.name!r}); one size per named dimension")
                bound[d], where[d] = size, spec.name
    return bound.pop("batch", batch), bound


def fit_array(a: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """``a`` cut or tiled along each axis to ``dims`` (same rank): real values stay real
    values (token ids stay ids, masks stay masks)."""
    import numpy as np

    for ax, size in enumerate(dims):
        have = a.shape[ax]
        if have == size:
            continue
        if have == 0:
            raise BadInputError(f"cannot stretch an empty axis {ax} of a sample input to {size}")
        if size > have:
            a = np.concatenate([a] * -(-size // have), axis=ax)
        a = np.take(a, np.arange(size), axis=ax)
    return np.ascontiguousarray(a)


def fit_feeds(feeds: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Feeds with the inputs ``shapes`` names brought to those shapes (``fit_array``)."""
    out = dict(feeds)
    require_memory(sum(math.prod(shapes.get(k) or v.shape) * v.itemsize for k, v in feeds.items()),
                   f"sample inputs of shapes {', '.join(f'{k}:' + 'x'.join(map(str, d)) for k, d in shapes.items())}",
                   "lower --shapes")
    for name, dims in shapes.items():
        if name in out and tuple(out[name].shape) != tuple(dims):
            if out[name].ndim != len(dims):
                raise BadInputError(f"--shapes {name}:{'x'.join(map(str, dims))} has {len(dims)} dimensions; the "
                                    f"sample input {name!r} has {out[name].ndim} {tuple(out[name].shape)}")
            out[name] = fit_array(out[name], dims)
    return out


def data_view(handle: ModelHandle) -> ModelHandle:
    """``handle`` with a fixed first dimension shown as "batch": data sources stack samples on
    that axis (a graph exported for batch 1 still calibrates on many samples, one at a time)."""
    specs = [InputSpec(s.name, ("batch", *s.shape[1:]), s.dtype) if s.shape and isinstance(s.shape[0], int) else s
             for s in handle.inputs]
    return dataclasses.replace(handle, inputs=specs)
