"""The public API: every name edgekit serves is declared for type checkers and resolves."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import edgekit


def _type_checking_imports() -> dict[str, str]:
    tree = ast.parse(Path(edgekit.__file__).read_text())
    names: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    names[alias.asname or alias.name] = f"{imp.module}:{alias.name}"
    return names


def test_declared_api_matches_lazy_table():
    assert _type_checking_imports() == edgekit._API
    assert sorted(edgekit.__all__) == sorted(["__version__", *edgekit._API])


def test_every_public_name_resolves():
    for name in edgekit._API:
        assert callable(getattr(edgekit, name)), name


def test_functions_keep_their_names_beside_subpackages():
    # compress, estimate, evaluate and finetune are functions and subpackages/modules of the same name.
    code = ("import types, edgekit, edgekit.compress.prune, edgekit.estimate, edgekit.evaluate, edgekit.finetune; "
            "from edgekit.compress import compress; "
            "print(all(callable(getattr(edgekit, n)) and not isinstance(getattr(edgekit, n), types.ModuleType) "
            "for n in ('compress', 'estimate', 'evaluate', 'finetune')), edgekit.compress is compress)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


def test_import_stays_light():
    # `import edgekit` (which every command runs first) loads none of the heavy libraries.
    code = "import sys, edgekit; print(sorted(m for m in ('torch', 'onnx', 'onnxruntime', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
