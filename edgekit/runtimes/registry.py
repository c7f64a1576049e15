"""The runtime registry: name -> "module:attribute" of the runtime object. One line per
runtime; its module is imported on first use (``edgekit.runtimes.get_runtime``), so the
package imports without onnxruntime, TensorRT or a GPU. Targets check their runtime names
against it, which is why it imports nothing."""
from __future__ import annotations

RUNTIMES: dict[str, str] = {
    "onnxruntime": "edgekit.runtimes.onnxruntime:RUNTIME",
    "torch": "edgekit.runtimes.torch_aot:RUNTIME",
    "tensorrt": "edgekit.runtimes.tensorrt:RUNTIME",
    "openvino": "edgekit.runtimes.openvino:RUNTIME",
}
BEST_RUNTIME = "best"  # build: time each of the target's runtimes here and keep the fastest
