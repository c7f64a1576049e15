"""The runtime registry: name -> "module:attribute" of the runtime object. One line per
runtime; its module is imported on first use (``edgekit.runtimes.get_runtime``), so the
package imports without onnxruntime, TensorRT or a GPU.

It is data, and it lives with the targets: a target file lists the runtimes it prefers by
these names and is checked against them as it loads, while the runtimes (which take a
``Target``) sit a layer above and read it through ``edgekit.runtimes``. It imports nothing.
"""
from __future__ import annotations

RUNTIMES: dict[str, str] = {
    "onnxruntime": "edgekit.runtimes.onnxruntime:RUNTIME",
    "torch": "edgekit.runtimes.torch_aot:RUNTIME",
    "tensorrt": "edgekit.runtimes.tensorrt:RUNTIME",
    "openvino": "edgekit.runtimes.openvino:RUNTIME",
}
BEST_RUNTIME = "best"  # build: time each of the target's runtimes here and keep the fastest
