"""The examples in docstrings: every module's runnable examples run and give what they show
(examples that need a real model, a GPU or files are marked ``# doctest: +SKIP`` on each line)."""
from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import edgekit

MODULES = sorted(m.name for m in pkgutil.walk_packages(edgekit.__path__, "edgekit."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an example that writes files writes them here
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False,
                             report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
