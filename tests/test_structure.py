"""The package's structure: no module imports another module's private name, and no new
import cycle between modules (``lint-imports`` checks the layers and the cycles between
sibling packages; this also catches a cycle through a package's ``__init__``)."""
from __future__ import annotations

import ast
from pathlib import Path

import grimp

import edgekit
from edgekit.compress import STEP_ALIASES, STEPS
from edgekit.runtimes import RUNTIMES

PACKAGE = Path(edgekit.__file__).parent

# Still to be removed (then delete the line).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

# Runtime-name branches outside edgekit/runtimes/ still to be removed (module, name); then delete the line.
KNOWN_RUNTIME_BRANCHES: set[tuple[str, str]] = set()
# Comparisons with a runtime's name that are not about runtimes: "torch" is also the namespace of
# PyTorch's operators in a .pt2 program.
NOT_RUNTIME_NAMES = {("edgekit.sources.pt2", "torch")}

# Step names outside edgekit/compress/ still to be replaced by registry data (module, name); then
# delete the line. The command line's options are being regenerated from the configs.
KNOWN_STEP_NAMES: set[tuple[str, str]] = set()
# Step names that are also precisions: compared with a precision they are not about steps.
PRECISION_NAMES = {"int8", "int4"}

# Modules whose in-function imports of edgekit's own modules still need a reason or the top of
# the file (the command line's options are being regenerated from the configs); then delete.
KNOWN_UNEXPLAINED_IMPORTS: set[str] = set()

# Module cycles still to be cut (each set is one strongly connected group of modules).
KNOWN_CYCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_a_private_name_of_another():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edgekit"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.add((_module_name(path), node.module, alias.name))
    assert found - KNOWN_PRIVATE_IMPORTS == set()


def _cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """Strongly connected groups of more than one module (Tarjan, iteratively)."""
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.add(w)
                        if w == v:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return groups


def test_no_new_import_cycle():
    graph = grimp.build_graph("edgekit", cache_dir=None)
    new = [g for g in _cycles(graph) if not any(g <= known for known in KNOWN_CYCLES)]
    assert new == []


def test_only_the_runtimes_branch_on_a_runtime_name():
    """Nothing outside edgekit/runtimes/ compares a value with a runtime's name (==, !=, in):
    what differs between runtimes lives behind the Runtime and Engine protocols."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "edgekit.runtimes" or module.startswith("edgekit.runtimes."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for operand in (node.left, *node.comparators):
                    if isinstance(operand, ast.Constant) and operand.value in RUNTIMES:
                        found.add((module, operand.value))
    assert found - KNOWN_RUNTIME_BRANCHES - NOT_RUNTIME_NAMES == set()


# What the layers above may import of runtimes/ (docs/architecture.md): the registry, the protocols
# and build options, and `edgekit lint`'s TensorRT check (ONNX-level, no TensorRT).
RUNTIMES_PUBLIC_FACE = {
    "edgekit.runtimes", "edgekit.runtimes.base", "edgekit.runtimes.build_options", "edgekit.runtimes.tensorrt",
    "edgekit.runtimes.tensorrt.lint", "edgekit.runtimes.tensorrt.lint_rules", "edgekit.runtimes.tensorrt.lint_options",
}


def test_every_module_outside_runtimes_is_kept_from_the_runtime_modules():
    """The forbidden contract of pyproject.toml names its source modules one by one: a new
    top-level module or package must join it; and it forbids every module of runtimes/ but the
    package's public face: a new runtime module must join it."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == "Only runtimes import a runtime"]
    top = {f"edgekit.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    top |= {f"edgekit.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(contract["source_modules"]) == sorted(top - {"edgekit.runtimes"})
    # every module of runtimes/ is either its public face or forbidden outside it
    runtimes_dir = PACKAGE / "runtimes"
    inside = {_module_name(p) for p in runtimes_dir.rglob("*.py")}
    assert sorted(inside - set(contract["forbidden_modules"])) == sorted(RUNTIMES_PUBLIC_FACE)
    assert set(contract["forbidden_modules"]) <= inside


def test_only_compress_branches_on_a_step_name():
    """Nothing outside edgekit/compress/ compares a value with a step's registry name: what a
    step does for the layers around it is data of its registry entry (``Step.quantizes_to``,
    ``Step.unchanged_at``) or of its record. "int8" and "int4" are also precisions; compared
    with a record's ``.name`` or from a module that names no precision they are step names."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "edgekit.compress" or module.startswith("edgekit.compress."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = (node.left, *node.comparators)
            on_a_name = any(isinstance(o, ast.Attribute) and o.attr == "name" for o in operands)
            for operand in operands:
                for const in ast.walk(operand):
                    if (isinstance(const, ast.Constant) and const.value in (*STEPS, *STEP_ALIASES)
                            and (on_a_name or const.value not in PRECISION_NAMES or module == "edgekit.cli")):
                        found.add((module, const.value))
    assert found - KNOWN_STEP_NAMES == set()


def test_in_function_imports_of_edgekit_say_why():
    """edgekit's own modules are imported at the top of a file; one imported inside a function
    (it brings torch or transformers that a light command must not pay for) says so in a
    comment on its line or the line above."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        lines = path.read_text().split("\n")
        for fn in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if any(n == "edgekit" or n.startswith("edgekit.") for n in names):
                    said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                    if not said and module not in KNOWN_UNEXPLAINED_IMPORTS:
                        found.append(f"{module}:{node.lineno}")
    assert found == []


def test_tests_mirror_the_package():
    """tests/<package>/ holds the tests of edgekit/<package>/; nothing else gets a folder."""
    tests = Path(__file__).parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in {"fixtures", "__pycache__"}}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders and folders <= packages, sorted(folders - packages)
    for folder in folders:
        assert all(f.name.startswith("test_") for f in (tests / folder).glob("*.py")), folder


# Modules with logic of their own that have no tests/<package>/test_<module>.py yet: each is tested
# through the file of the feature it serves (the artifact package by test_artifact_safety.py, sources
# by sources/test_sources.py and test_data.py, pipelines by pipelines/test_pipelines.py and
# test_recipe_schema.py, the estimator by estimate/test_estimate.py, detection by
# detection/test_detection.py, the LM export by export/test_decode.py and test_conformance.py, the
# commands by test_cli*.py). The list only shrinks: a new module comes with its own test file.
# compress/ is tested by step (compress/int8/test_int8.py, compress/weight_only/test_weight_only.py).
NO_MIRRORED_TEST_YET = {
    "__init__", "artifact/atomic", "artifact/files", "artifact/locks", "artifact/manifest", "build", "check",
    "detection/boxes", "detection/decode", "detection/metrics", "estimate/calibrate", "estimate/cost",
    "estimate/efficiency", "estimate/graph", "estimate/roofline", "estimate/uncertainty", "evaluate_detection",
    "export/lm", "export/lm_graph", "export/packing", "export/parity", "finetune", "interrupts", "loading",
    "measure", "pipelines/detection_stages", "pipelines/examples", "pipelines/frames", "pipelines/html",
    "pipelines/results", "pipelines/run", "pipelines/sweep", "profiling_lm", "runtimes/tensorrt/api",
    "runtimes/tensorrt/bundle", "runtimes/tensorrt/int8", "runtimes/tensorrt/lint_rules",
    "runtimes/tensorrt/results", "schema", "sources/arrays", "sources/assets", "sources/detection_data",
    "sources/detectors", "sources/fmnist", "sources/handle", "sources/hf", "sources/models", "sources/pt2",
    "sources/text", "sources/zoo", "training/checkpoint",
}


def _mirrored_test_files(module: Path) -> list[Path]:
    """tests/<package>/test_<module>.py, or test_<package>_<module>.py where that basename is taken
    elsewhere (pytest's default import mode needs unique basenames); a package's own __init__ by
    test_<package>.py."""
    tests = PACKAGE.parent / "tests"
    rel = module.relative_to(PACKAGE)
    folder = rel.parent
    stem = (folder.name or "edgekit") if rel.name == "__init__.py" else rel.stem
    return [tests / folder / f"test_{stem}.py", tests / folder / f"test_{folder.name}_{stem}.py"]


def test_every_module_with_logic_has_its_own_test_file():
    """A module that defines a function or method has tests/<package>/test_<module>.py (outside
    compress/), or is one of NO_MIRRORED_TEST_YET."""
    missing = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        if rel.parts[0] == "compress":
            continue
        logic = [n for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name not in ("__getattr__", "__dir__")]
        if logic and not any(f.is_file() for f in _mirrored_test_files(path)):
            missing.add(rel.as_posix())
    assert missing <= NO_MIRRORED_TEST_YET, f"modules without tests/<package>/test_<module>.py: {sorted(missing - NO_MIRRORED_TEST_YET)}"
