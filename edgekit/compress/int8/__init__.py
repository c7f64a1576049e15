"""INT8 weights and activations (the "int8" step): post-training quantization and QAT to a
Q/DQ graph that the target's engines fuse.

Where things are: ``technique_configs.py`` (each technique's small config: ``CalibrationConfig``,
``RoundingConfig``, ``QatConfig``, ``FallbackConfig``, ``OnnxGraphConfig``, ``SmoothConfig``, and
the choices they check), ``config.py`` (``Int8Config``, the step's options, which builds them; both
without torch: the command line reads them), ``calibration.py`` (observers, ranges, calibration data
and metrics), ``qdq.py`` (the fake-quant graph and its ONNX rewrite), ``equalize.py``
(cross-layer equalization, bias correction), ``smooth.py`` (SmoothQuant for causal LMs),
``rounding.py`` (GPTQ rounding on the int8 grid), ``sensitivity.py`` (the float fallback),
``qat.py`` (quantization-aware training), ``onnx_graph.py`` (INT8 of an ONNX graph: ONNX-only
models, and models torch.fx cannot trace) and ``step.py`` (the step). Imports point down in
that order.
"""
