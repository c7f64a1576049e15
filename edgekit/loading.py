"""Loading and exporting any model a user names, compressed model folders included.

``sources.models.load_model`` and ``export.onnx.export_onnx`` sit below the compression steps and
cannot rebuild a compressed model folder (base model + step chain + weights) themselves: the layers
above pass them ``ARTIFACT_LOADERS``. These twins do, and are what ``edgekit.load_model`` and
``edgekit.export_onnx`` are, so the Python API loads what the command line loads in a fresh
interpreter, with nothing registered by an earlier import.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.sources import models as sources

if TYPE_CHECKING:
    from edgekit.export.onnx import ExportConfig
    from edgekit.sources.handle import ModelHandle
    from edgekit.sources.inputs import InputOptions


def _load_compressed(folder: Path) -> ModelHandle:
    # torch and the steps load only when a compressed model is given (`build --help` stays light)
    from edgekit.compress import load_compressed

    return load_compressed(folder)


ARTIFACT_LOADERS: dict[str, sources.ArtifactLoader] = {"model": _load_compressed}


def load_model(spec: str | os.PathLike[str] | ModelHandle, input_options: InputOptions | None = None, *,
               half_storage: bool = False) -> ModelHandle:
    """``sources.models.load_model`` that also loads compressed model folders.

    >>> handle = load_model("out/int8")  # doctest: +SKIP
    >>> [s.name for s in handle.steps]  # doctest: +SKIP
    ['int8']
    """
    return sources.load_model(spec, input_options, half_storage=half_storage, loaders=ARTIFACT_LOADERS)


def export_onnx(model: str | os.PathLike[str] | ModelHandle, out_dir: str | os.PathLike[str],
                config: ExportConfig | None = None, input_options: InputOptions | None = None,
                **kwargs: Any) -> Path:
    """``export.onnx.export_onnx`` that also exports compressed model folders (same arguments).

    >>> out = export_onnx("out/int8", "out/int8-onnx")  # doctest: +SKIP
    """
    # ONNX and torch load with the first export, not with this module (`--help` stays light)
    from edgekit.export.onnx import export_onnx as export

    return export(model, out_dir, config, input_options, loaders=ARTIFACT_LOADERS, **kwargs)
