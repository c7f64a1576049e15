"""Weight-only quantization to packed 2- to 8-bit codes: GPTQ, AWQ, AWQ+GPTQ or RTN.

Where things are: ``config.py`` (``WeightOnlyConfig``; no torch: the command line reads it), which
builds each method's own config (``method_config()``: ``RtnConfig``, ``GptqConfig`` or ``AwqConfig``
in ``rtn_config.py``, ``gptq_config.py``, ``awq_config.py``, on ``grid_config.GridConfig``),
``rtn.py`` (round-to-nearest group quantization), ``packing.py`` (the packed layers, from
``edgekit.export.packing``), ``blocks.py`` (the block walk: ``BlockWalker``, ``GroupInputs``),
``gptq.py`` (the one GPTQ solver, also used by INT8 rounding), ``awq.py``, ``mixed.py``
(mixed precision within a size budget) and ``step.py`` (the step).
"""
