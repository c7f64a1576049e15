"""The TensorRT runtime, self-contained: everything TensorRT-specific lives in this package.

- ``runtime``: ``TensorRTRuntime`` (the Runtime protocol) and how it picks a build path
  (Python API, trtexec here or over SSH, or a build bundle for the device);
- ``settings``: what a build is asked to do and the exact trtexec command line;
- ``device``: the GPU, SM and TensorRT of a machine (here, over SSH, or in a bundle's results);
- ``api``: the ``tensorrt`` Python API path and ``TensorRTEngine``;
- ``bundle``: ``build.sh`` and the README of a build bundle;
- ``parsers``: trtexec's ``--exportTimes/--exportProfile/--exportLayerInfo`` JSON;
- ``engine_cache``: built engines keyed by everything that makes them valid.

The registry (``edgekit.runtimes.RUNTIMES``) names ``RUNTIME`` here.
"""
from __future__ import annotations

from edgekit.runtimes.base import Runtime
from edgekit.runtimes.tensorrt.runtime import TensorRTRuntime

RUNTIME: Runtime = TensorRTRuntime()

__all__ = ["RUNTIME", "TensorRTRuntime"]
