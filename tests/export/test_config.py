"""edgekit/export/config.py: ExportConfig and CausalLMExportOptions check their values, declare
export's flags, and import neither PyTorch nor ONNX."""
from __future__ import annotations

import subprocess
import sys

import pytest

from edgekit.errors import BadInputError
from edgekit.export.config import CausalLMExportOptions, ExportConfig
from edgekit.options import config_options


def test_export_config_values_are_checked():
    assert ExportConfig().opset == 18 and ExportConfig().dynamo and not ExportConfig().skip_parity
    with pytest.raises(BadInputError, match=r"^opset 9 is not supported \(choose 13 to 23\)$"):
        ExportConfig(opset=9)
    with pytest.raises(BadInputError, match=r"^parity atol must be >= 0, got -1.0$"):
        ExportConfig(atol=-1.0)
    with pytest.raises(BadInputError, match=r"^unknown INT8 kernels 'int8' \(choose from"):
        ExportConfig(int8_kernels="int8")


def test_kv_cache_options_apply_only_with_the_kv_cache():
    assert CausalLMExportOptions(kv_cache=True, graph="fused", block_size=32).graph == "fused"
    with pytest.raises(BadInputError, match=r"^--graph, --block-size and --weight-format apply to the KV-cache "):
        CausalLMExportOptions(weight_format="qdq")
    with pytest.raises(BadInputError, match=r"^--accuracy-level applies to the KV-cache export"):
        CausalLMExportOptions(accuracy_level=4)
    with pytest.raises(BadInputError, match=r"^unknown graph 'onnx' \(choose from 'auto', 'fused', 'traced'\)$"):
        CausalLMExportOptions(kv_cache=True, graph="onnx")


def test_flags_pair_and_basic():
    opts = {o.dest: o for o in config_options([("export", ExportConfig), ("lm", CausalLMExportOptions)], "export")}
    assert list(opts) == ["opset", "dynamo", "atol", "rtol", "no_parity", "kv_cache", "accuracy_level", "graph",
                          "block_size", "weight_format"]
    assert opts["dynamo"].decls == ("--dynamo/--legacy",) and opts["dynamo"].default is True
    assert opts["no_parity"].fields[0][1] == "skip_parity" and opts["no_parity"].default is False
    assert {d for d, o in opts.items() if o.basic} == {"opset", "no_parity", "kv_cache"}
    assert opts["accuracy_level"].bounds == (0, 4) and opts["graph"].choices == ("auto", "fused", "traced")


def test_the_module_is_light():
    r = subprocess.run([sys.executable, "-c", "import sys, edgekit.export.config; print(sorted(m for m in "
                        "('torch', 'onnx', 'onnxruntime') if m in sys.modules))"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
