"""Recipes validated completely before anything runs: one schema from the dataclasses, YAML
read without aliases or bounds broken, step order from declared weight states, sweep
overrides through the same validation; hostile and random recipes never crash the CLI."""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgekit.compress import STEPS, WEIGHT_STATES, check_order, get_step, initial_state, make_config
from edgekit.errors import BadInputError
from edgekit.export.onnx import ExportConfig
from edgekit.pipelines.recipe import (
    Recipe,
    StageSpec,
    load_recipe,
    parse_recipe,
    read_recipe_data,
    validate_recipe,
)
from edgekit.pipelines.run import run_recipe
from edgekit.pipelines.sweep import apply_overrides, run_sweep
from edgekit.runtimes.base import BuildExtras, BuildOptions
from edgekit.schema import known_keys, parse_yaml

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
MLP = "edgekit.pipelines.examples:tiny_mlp"


def _recipe(**over):
    data = {
        "name": "tiny", "target": "cpu", "budget_ms": 1000, "percentile": "p99", "seed": 0,
        "profile": {"warmup_ms": 5, "duration_s": 0.05, "iterations": 10, "node_profile": False},
        "stages": [
            {"name": "pre", "callable": "edgekit.pipelines.examples:scale", "inputs": {"x": {"shape": [1, 16]}}},
            {"name": "mlp", "model": MLP, "budget_ms": 500},
        ],
    }
    data.update(over)
    return data


def _cli(*args):
    from click.testing import CliRunner

    from edgekit.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _one_line_error(result) -> str:
    """The CLI failed the way edgekit promises: exit 2, one `error:` line, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    err = result.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in result.output, err
    return err


# ----------------------------------------------------------------------------- what was seen

def _alias_bomb(levels: int = 9) -> str:
    """Nine levels of nine aliases: 9**9 = 387 million strings once expanded (gigabytes)."""
    items = ['&a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("where", ["description", "export"])
def test_alias_bomb_is_refused_at_once_with_one_line(tmp_path, where):
    # Before: the description bomb hung at 2 GB and climbing; the export one said "plan OK".
    value = _alias_bomb() if where == "description" else "{opset: " + _alias_bomb() + "}"
    text = f"name: bomb\ntarget: cpu\nstages:\n  - name: m\n    model: fmnist-cnn\n    {where}: {value}\n"
    assert len(text) < 600
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    t0 = time.process_time()
    err = _one_line_error(_cli("run", path, "--dry-run"))
    assert time.process_time() - t0 < 5  # refused while reading, nothing expanded
    assert err == f"error: recipe {str(path)!r}: line 6: YAML anchors (&a0) are not allowed"


@pytest.mark.parametrize("section, value, message", [
    ("export", {"opst": 18}, "stage 'mlp' export.opst: unknown option (known: atol, batch, dynamic_batch, dynamo, "
                             "int8_kernels, opset, rtol, skip_parity, tolerances; did you mean 'opset'?)"),
    ("build", {"threds": 1}, "stage 'mlp' build.threds: unknown option (known: batch, extra, optimization_level, "
                             "precision, runtime, threads; did you mean 'threads'?)"),
    ("build", {"extra": {"workspace": 64}}, "stage 'mlp' build.extra.workspace: unknown option (known: "
                                            "accuracy_samples, build_timeout, builder_optimization_level,"),
])
def test_unknown_export_and_build_options_fail_the_dry_run_and_the_run_alike(tmp_path, section, value, message):
    # Before: --dry-run said "plan OK" and the real run crashed with a TypeError traceback.
    data = _recipe()
    data["stages"][1][section] = value
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    dry = _one_line_error(_cli("run", path, "--dry-run"))
    real = _one_line_error(_cli("run", path, "-o", tmp_path / "run"))
    assert dry == real and dry.startswith(f"error: {path}: {message}")
    assert not (tmp_path / "run").exists()


def test_a_recipe_built_in_code_is_validated_before_the_run_writes_anything(tmp_path):
    recipe = Recipe(name="r", targets=("cpu",), stages=(StageSpec(name="m", model=MLP, export={"opst": 18}),))
    with pytest.raises(BadInputError, match=r"^stage 'm' export.opst: unknown option"):
        run_recipe(recipe, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_int8_then_prune_and_distill_is_rejected_with_the_reason():
    data = _recipe()
    data["stages"][1]["steps"] = ["int8", {"prune": {"ratio": 0.3}}, "distill"]
    with pytest.raises(BadInputError) as e:
        parse_recipe(data)
    assert str(e.value) == ("stage 'mlp' steps: prune needs float weights, but after int8 the model is fake-quant "
                            "(float weights on an int8 grid, with Q/DQ); put prune before int8")


# ----------------------------------------------------------------------------- one schema, every section

@pytest.mark.parametrize("mutate, message", [
    # top level
    (lambda d: d.update(budget_ms="fast"), "recipe budget_ms: must be a finite number, got 'fast'"),
    (lambda d: d.update(budget_ms=float("nan")), "recipe budget_ms: must be a finite number, got nan"),
    (lambda d: d.update(seed=2**40), "recipe seed: must be 0 to 4294967295, got 1099511627776"),
    (lambda d: d.update(seed=True), "recipe seed: must be an integer, got True"),
    (lambda d: d.update(max_jitter=0.5), "recipe max_jitter: is a p99/p50 ratio and must be >= 1, got 0.5"),
    (lambda d: d.update(name="../../home"), "recipe name: '../../home' must be letters, digits"),
    (lambda d: d.update(targets=["cpu"]), "recipe: has both 'target' and 'targets'; use one"),
    (lambda d: d.update(stages=[]), "recipe stages: must be a non-empty list of stages, got []"),
    (lambda d: d.update(stages={"a": 1}), "recipe stages: must be a non-empty list of stages, got {'a': 1}"),
    (lambda d: d.update(description=["x"]), "recipe description: must be a string, got ['x']"),
    # profile: ProfileConfig
    (lambda d: d["profile"].update(iterations=10.5), "recipe profile.iterations: must be an integer, got 10.5"),
    (lambda d: d["profile"].update(warmup_ms=1e12), "recipe profile: warm-up must be 0 to 600000 ms"),
    (lambda d: d["profile"].update(threads=0), "recipe profile: threads must be >= 1, got 0"),
    (lambda d: d["profile"].update(repeat=3), "recipe profile.repeat: unknown option (known: batch, duration_s,"),
    (lambda d: d.update(profile=[1]), "recipe profile: must be a mapping of options, got [1]"),
    # stages
    (lambda d: d["stages"].append("oops"), "stage 3: must be a mapping of keys, got 'oops'"),
    (lambda d: d["stages"][1].update(name="a.b"), "stage 2 name: 'a.b' must be letters, digits, '_' or '-'"),
    (lambda d: d["stages"][1].update(name="pre"), "stage 'pre': the name is used twice"),
    (lambda d: d["stages"][1].update(after="pre"), "stage 2 after: unknown key (known: budget_ms, build,"),
    (lambda d: d["stages"][1].update(inputs={"x": {"shape": [1]}}),
     "stage 'mlp' inputs: a model stage does not use 'inputs' (a model declares its own inputs)"),
    (lambda d: d["stages"][0].update(steps=["int8"]),
     "stage 'pre' steps: a Python (callable) stage does not use 'steps'"),
    (lambda d: d["stages"][0].update(callable="os.system"), "stage 'pre' callable: must be 'package.module:function'"),
    (lambda d: d["stages"][1].update(model="nosuch-model"), "stage 'mlp' model: unknown model 'nosuch-model' (choose"),
    (lambda d: d["stages"][1].update(parallel_with="mlp"),
     "stage 'mlp' parallel_with: a stage cannot run parallel with itself"),
    (lambda d: d["stages"][1].update(budget_ms=True), "stage 'mlp' budget_ms: must be a finite number, got True"),
    # inputs: InputDecl
    (lambda d: d["stages"][0].update(inputs={"x": {"shape": [1, -16]}}),
     "stage 'pre' inputs.x.shape: must be up to 8 dimensions, each >= 1, got [1, -16]"),
    (lambda d: d["stages"][0].update(inputs={"x": {"shape": [65536, 65536]}}),
     "stage 'pre' inputs.x.shape: [65536, 65536] has 4294967296 elements; at most 67108864"),
    (lambda d: d["stages"][0].update(inputs={"x": {"dtype": "object"}}),
     "stage 'pre' inputs.x.dtype: unknown dtype 'object' (choose from bool, uint8,"),
    (lambda d: d["stages"][0].update(inputs={"x": {"shape": "1x16"}}),
     "stage 'pre' inputs.x.shape: must be a list of integers, got '1x16'"),
    (lambda d: d["stages"][0].update(inputs=["x"]),
     "stage 'pre' inputs: must be a mapping of names to option mappings, got ['x']"),
    # export: ExportConfig
    (lambda d: d["stages"][1].update(export={"opset": 99}), "stage 'mlp' export: opset 99 is not supported (choose 13 to 23)"),
    (lambda d: d["stages"][1].update(export={"atol": "1e-3"}), "stage 'mlp' export.atol: must be a finite number, got '1e-3'"),
    (lambda d: d["stages"][1].update(export={"tolerances": {"logits": [1e-3]}}),
     "stage 'mlp' export.tolerances.logits: must be a list of 2 numbers, got [0.001]"),
    (lambda d: d["stages"][1].update(export={"dynamo": "yes"}), "stage 'mlp' export.dynamo: must be true or false, got 'yes'"),
    # build: BuildOptions and BuildExtras
    (lambda d: d["stages"][1].update(build={"optimization_level": "max"}),
     "stage 'mlp' build: unknown optimization level 'max' (choose from 'all', 'basic', 'disable', 'extended')"),
    (lambda d: d["stages"][1].update(build={"runtime": "tvm"}),
     "stage 'mlp' build: unknown runtime 'tvm' (choose from 'best', 'onnxruntime', 'openvino', 'tensorrt', 'torch')"),
    (lambda d: d["stages"][1].update(build={"precision": "fp16"}),
     "stage 'mlp' build.precision: target 'cpu' does not support precision 'fp16' (choose from fp32, bf16, int8, int4)"),
    (lambda d: d["stages"][1].update(build={"extra": {"workspace_mb": 0}}),
     "stage 'mlp' build.extra.workspace_mb: must be >= 1, got 0"),
    (lambda d: d["stages"][1].update(build={"extra": {"ssh_port": 70000}}),
     "stage 'mlp' build.extra.ssh_port: must be a TCP port (1 to 65535), got 70000"),
    (lambda d: d["stages"][1].update(build={"extra": {"feeds": {}}}),
     "stage 'mlp' build.extra.feeds: unknown option"),  # set in code only
    (lambda d: d["stages"][1].update(build={"extra": {"max_shapes": {"x": [1, 0]}}}),
     "stage 'mlp' build.extra.max_shapes.x: dimensions must be 1 to 1048576, got [1, 0]"),
    # evaluate: EvaluateSpec
    (lambda d: d["stages"][1].update(evaluate={"min": 0.9, "max": 0.5}),
     "stage 'mlp' evaluate: min 0.9 is above max 0.5: no value could pass"),
    (lambda d: d["stages"][1].update(evaluate={"limit": 0}), "stage 'mlp' evaluate.limit: must be >= 1 sample, got 0"),
    (lambda d: d["stages"][1].update(evaluate={"metirc": "accuracy"}),
     "stage 'mlp' evaluate.metirc: unknown option (known: data, limit, max, metric, min; did you mean 'metric'?)"),
    # steps: each registered config
    (lambda d: d["stages"][1].update(steps=[{"int8": {"calib_samples": "many"}}]),
     "stage 'mlp' int8.calib_samples: must be an integer, got 'many'"),
    (lambda d: d["stages"][1].update(steps=[{"int8": {"method": "awq"}}]),
     "stage 'mlp' int8: unknown quantization method 'awq' (choose from 'ptq', 'qat')"),
    (lambda d: d["stages"][1].update(steps=[{"weight-only": {"group_size": 48}}]), "stage 'mlp' weight-only: unsupported group size 48"),
    (lambda d: d["stages"][1].update(steps=[{"weight-only": {"damp": float("inf")}}]),
     "stage 'mlp' weight-only.damp: must be a finite number, got inf"),
    (lambda d: d["stages"][1].update(steps=[{"prune": {"ratio": 1.5}}]), "stage 'mlp' prune: pruning ratio must be in (0, 1), got 1.5"),
    (lambda d: d["stages"][1].update(steps=[{"prune": {"ignore": [3]}}]), "stage 'mlp' prune.ignore[0]: must be a string, got 3"),
    (lambda d: d["stages"][1].update(steps=[{"distill": {"temperature": "hot"}}]),
     "stage 'mlp' distill.temperature: must be a finite number, got 'hot'"),
    (lambda d: d["stages"][1].update(steps=[{"lora": {"r": 0}}]), "stage 'mlp' lora: LoRA rank must be a positive integer, got 0"),
    (lambda d: d["stages"][1].update(steps=[{"lora": {"rank": 8}}]), "stage 'mlp' lora.rank: unknown option (known: alpha,"),
    (lambda d: d["stages"][1].update(steps=[{"int8": [1]}]), "stage 'mlp' int8: must be a mapping of options, got [1]"),
    (lambda d: d["stages"][1].update(steps=[{"int8": {}, "prune": {}}]),
     "stage 'mlp' steps[0]: each step is `name` or `name: {options}`"),
    (lambda d: d["stages"][1].update(steps="int8"), "stage 'mlp' steps: must be a list like [{int8: {method: ptq}}], got 'int8'"),
])
def test_every_section_is_checked_with_the_path_of_the_bad_key(mutate, message):
    data = _recipe()
    mutate(data)
    with pytest.raises(BadInputError) as e:
        parse_recipe(data)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_options_are_declared_once_by_the_dataclasses():
    """The known keys in messages are the dataclass fields: adding a field adds the option."""
    assert known_keys(ExportConfig) == [f.name for f in dataclasses.fields(ExportConfig)]
    assert "feeds" not in known_keys(BuildExtras) and "export" not in known_keys(BuildExtras)
    assert known_keys(StageSpec) == [f.name for f in dataclasses.fields(StageSpec)]
    assert "path" not in known_keys(Recipe)  # internal: set in code only
    for name in STEPS:  # every step's options come from its config class, nothing re-declared
        config = get_step(name).config
        with pytest.raises(BadInputError, match=f"{name}.nosuch: unknown option \\(known: "
                                                f"{', '.join(sorted(f.name for f in dataclasses.fields(config)))}\\)"):
            make_config(name, {"nosuch": 1}, "stage 's'")


def test_build_options_in_code_check_their_extras():
    with pytest.raises(BadInputError, match=r"^extra.dla_cores: unknown option .*did you mean 'dla_core'\?\)$"):
        BuildOptions("fp16", extra={"dla_cores": 1})
    assert BuildOptions("fp16", extra={"feeds": {"x": [1]}, "export": {"dynamo": False}}).extra["feeds"] == {"x": [1]}


def test_valid_sections_parse_and_round_trip():
    data = _recipe()
    data["stages"][1].update(steps=[{"prune": {"ratio": 0.3, "ignore": ["2"]}}, {"int8": {"method": "ptq"}}],
                             export={"opset": 18, "tolerances": {"logits": [1e-3, 1e-2]}},
                             build={"precision": "int8", "threads": 1, "extra": {"workspace_mb": 64}},
                             evaluate={"metric": "top1_agreement", "min": 0.5, "limit": 8})
    data["percentile"] = 99  # an unquoted percentile is taken as written
    recipe = parse_recipe(data)
    assert recipe.percentile == "p99"
    assert [s.name for s in recipe.stages[1].steps] == ["prune", "int8"]
    assert recipe.stages[1].build == {"precision": "int8", "threads": 1, "extra": {"workspace_mb": 64}}
    assert validate_recipe(recipe) == recipe


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_shipped_examples_validate_and_dry_run(path):
    recipe = load_recipe(path)
    assert validate_recipe(recipe) == recipe
    r = _cli("run", path, "--dry-run")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().splitlines()[-1].startswith(f"plan OK: {len(recipe.stages)} stages")


# ----------------------------------------------------------------------------- YAML as untrusted input

@pytest.mark.parametrize("text, message", [
    ("a: &x 1\nb: *x\n", "line 1: YAML anchors (&x) are not allowed"),
    ("a: [1]\nb: *x\n", "line 2: YAML aliases (*x) are not allowed"),
    ("base: {a: 1}\nother:\n  <<: {b: 2}\n", "line 3: YAML merge keys (<<) are not allowed"),
    ("a: !!python/object/apply:os.system [ls]\n", "line 1: YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' "
                                                  "is not allowed"),
    ("a: !!binary aGVsbG8=\n", "line 1: YAML tag 'tag:yaml.org,2002:binary' is not allowed"),
    ("a: 1\na: 2\n", "line 2: duplicate key 'a'"),
    ("? [a, b]\n: 1\n", "line 1: a mapping key must be a plain value"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", "line 1: nested deeper than 32 levels"),
    ("a: !!int abc\n", "holds a value YAML cannot convert: invalid literal for int() with base 10: 'abc'"),
    ("a: " + "9" * 5000 + "\n", "holds a value YAML cannot convert: Exceeds the limit (4300 digits)"),
    ("a: [1, 2\n", "is not valid YAML: while parsing a flow sequence"),
])
def test_yaml_reader_refuses_what_a_recipe_never_needs(text, message):
    with pytest.raises(BadInputError) as e:
        parse_yaml(text, "recipe 'r.yaml'")
    assert message in str(e.value) and str(e.value).startswith("recipe 'r.yaml'")
    assert "\n" not in str(e.value)


def test_yaml_dates_stay_strings_and_plain_values_load():
    assert parse_yaml("d: 2001-13-14\nn: null\nf: .nan\nx: [1, 2.5, true, 'q']\n", "r") == {
        "d": "2001-13-14", "n": None, "f": pytest.approx(float("nan"), nan_ok=True), "x": [1, 2.5, True, "q"]}


def test_recipe_files_are_bounded_and_must_be_text(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("description: '" + "x" * (1 << 20) + "'\n")
    err = _one_line_error(_cli("run", big, "--dry-run"))
    assert err == f"error: recipe {str(big)!r} is larger than 1024 KiB; refusing to read it"
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    assert _one_line_error(_cli("run", binary, "--dry-run")) == f"error: recipe {str(binary)!r} is not UTF-8 text (byte 6)"
    top = tmp_path / "list.yaml"
    top.write_text("- a\n- b\n")
    assert _one_line_error(_cli("run", top, "--dry-run")) == (f"error: recipe {str(top)!r} must be a mapping at the top "
                                                              "level, got ['a', 'b']")
    assert _one_line_error(_cli("run", tmp_path, "--dry-run")) == f"error: recipe {str(tmp_path)!r} is not a file"


# ----------------------------------------------------------------------------- step order from declared states

def test_every_step_declares_its_weight_states():
    for name in STEPS:
        step = get_step(name)
        assert step.transitions and set(step.transitions) | set(step.transitions.values()) <= set(WEIGHT_STATES)
    assert get_step("int8").transitions == {"float": "fake-quant", "onnx": "onnx"}
    assert get_step("weight-only").transitions == {"float": "packed"}
    assert get_step("lora").transitions == {"float": "float", "packed": "packed"}


@pytest.mark.parametrize("chain, start, verdict", [
    (["prune", "distill", "int8"], "float", "fake-quant"),
    (["prune", "distill", "weight-only"], "float", "packed"),
    ([("weight-only", {}), ("lora", {"qlora": True})], "float", "packed"),  # QLoRA over packed weights is legal
    (["lora", "weight-only"], "float", "packed"),
    ([("lora", {"qlora": True, "qlora_base": "nf4"}), "int8"], "float", "fake-quant"),
    (["int8"], "onnx", "onnx"),
    (["weight-only", "prune"], "float", "prune needs float weights, but after weight-only the model is packed (low-bit codes); "
                                 "put prune before weight-only"),
    (["weight-only", "lora"], "float", "lora (plain LoRA; qlora: true trains over packed weights) needs float weights, "
                                "but after weight-only the model is packed (low-bit codes); put lora before weight-only"),
    ([("lora", {"qlora": True})], "float", "lora (qlora over packed weights) needs packed weights, but the model is "
                                           "float as loaded; put weight-only before it"),
    (["int8", "weight-only"], "float", "weight-only needs float weights, but after int8 the model is fake-quant"),
    (["weight-only", "int8"], "float", "int8 needs float weights or an ONNX graph, but after weight-only the model is packed"),
    (["int8", "int8"], "float", "int8 needs float weights or an ONNX graph, but after int8 the model is fake-quant "
                                "(float weights on an int8 grid, with Q/DQ); apply int8 once"),
    (["prune"], "onnx", "prune needs float weights, but the model is an ONNX graph (no PyTorch weights) as loaded"),
    (["distill"], "packed", "distill needs float weights, but the model is packed (low-bit codes) as loaded"),
])
def test_check_order_verdicts_come_from_the_declarations(chain, start, verdict):
    if verdict in WEIGHT_STATES:
        assert check_order(chain, start) == verdict
        return
    with pytest.raises(BadInputError) as e:
        check_order(chain, start)
    assert str(e.value).startswith(verdict)


# What the issue states each step takes and leaves (independent of the declarations): the oracle.
ORACLE = {
    "prune": {"float": "float"}, "distill": {"float": "float"}, "weight-only": {"float": "packed"},
    "int8": {"float": "fake-quant", "onnx": "onnx"}, "lora": {"float": "float"}, "qlora": {"packed": "packed"},
    "qlora-nf4": {"float": "float"},
}
AS_STEP = {"qlora": ("lora", {"qlora": True}), "qlora-nf4": ("lora", {"qlora": True, "qlora_base": "nf4"})}


@settings(max_examples=150, deadline=None)
@given(chain=st.lists(st.sampled_from(sorted(ORACLE)), max_size=4), start=st.sampled_from(WEIGHT_STATES))
def test_check_order_agrees_with_the_stated_semantics(chain, start):
    state: str | None = start
    for s in chain:
        state = ORACLE[s].get(state) if state is not None else None
    steps = [AS_STEP.get(s, (s, {})) for s in chain]
    if state is None:
        with pytest.raises(BadInputError, match=r" needs .* weights|needs .*ONNX graph"):
            check_order(steps, start)
    else:
        assert check_order(steps, start) == state


def test_a_stage_model_loads_in_its_recorded_state(tmp_path):
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"not parsed by validation")
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "manifest.json").write_text(json.dumps({
        "kind": "model", "files": {"weights": "model.safetensors"}, "source": "fmnist-cnn",
        "steps": [{"name": "weight-only", "config": {"method": "rtn"}, "meta": {}}]}))
    assert (initial_state(onnx_file), initial_state(packed), initial_state("fmnist-cnn")) == ("onnx", "packed", "float")
    data = _recipe()
    data["stages"][1].update(model=str(onnx_file), steps=["prune"])
    with pytest.raises(BadInputError, match=r"^stage 'mlp' steps: prune needs float weights, but the model is an "
                                            r"ONNX graph \(no PyTorch weights\) as loaded$"):
        parse_recipe(data)
    data["stages"][1].update(model=str(packed), steps=[{"lora": {"qlora": True}}])
    assert parse_recipe(data).stages[1].steps[0].name == "lora"


# ----------------------------------------------------------------------------- sweeps: same validation

def test_sweep_overrides_go_through_the_recipe_schema(tmp_path):
    data = _recipe()
    data["stages"][1]["steps"] = [{"prune": {"ratio": 0.3}}, {"int8": {"method": "ptq"}}]
    with pytest.raises(BadInputError, match=r"^stage 'mlp' int8.calib_samples: must be an integer, got 'lots'$"):
        parse_recipe(apply_overrides(data, {"int8.calib_samples": "lots"}))
    with pytest.raises(BadInputError, match=r"^stage 'mlp' prune.ratio: must be a finite number, got nan$"):
        parse_recipe(apply_overrides(data, {"prune.ratio": float("nan")}))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(BadInputError, match=rf"^{path} with prune.ratio=1.5: stage 'mlp' prune: pruning ratio must "
                                            r"be in \(0, 1\), got 1.5$"):
        run_sweep(path, ["prune.ratio=0.5,1.5"], tmp_path / "sweep")
    assert not (tmp_path / "sweep").exists()  # every configuration is validated before any runs
    path.write_text("stages: &s []\n")
    with pytest.raises(BadInputError, match="YAML anchors"):
        run_sweep(path, ["bits=8"], tmp_path / "sweep")


def test_overrides_leave_malformed_stages_for_the_validation_to_name():
    data = _recipe()
    data["stages"][1]["steps"] = {"int8": {}}  # not a list
    assert apply_overrides(data, {"bits": 32})["stages"][1]["steps"] == {"int8": {}}
    with pytest.raises(BadInputError, match=r"^stage 'mlp' steps: must be a list"):
        parse_recipe(apply_overrides(data, {"bits": 32}))


# ----------------------------------------------------------------------------- property-based

_SCALARS = (st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
            | st.text(max_size=12)
            | st.sampled_from(["p99", "cpu", "fmnist-cnn", "int8", "int4", "prune", "lora", "distill", MLP, "ptq",
                               "rtn", "float32", "uint8", "jetson-agx-orin-64", "accuracy", "fp16", "int8"]))
_KEYS = st.text(max_size=10) | st.sampled_from(
    ["name", "target", "targets", "stages", "steps", "model", "callable", "export", "build", "extra", "evaluate",
     "inputs", "profile", "budget_ms", "parallel_with", "shape", "dtype", "opset", "precision", "ratio", "method",
     "iterations", "min", "max", "limit", "qlora", "bits", "group_size", "workspace_mb", "seed", "percentile"])
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
                       max_leaves=12)


def _assert_parses_or_one_line(data: object, path: str | None = None) -> None:
    try:
        recipe = parse_recipe(data, path)
    except BadInputError as e:
        assert str(e) and "\n" not in str(e), str(e)
        return
    assert isinstance(recipe, Recipe) and validate_recipe(recipe) == recipe


@settings(max_examples=120, deadline=None)
@given(data=st.dictionaries(_KEYS, _VALUES, max_size=6))
def test_random_structures_parse_or_fail_in_one_line(data):
    _assert_parses_or_one_line(data)


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=160, deadline=None)
@given(example=st.sampled_from(EXAMPLES), draw=st.data())
def test_mutated_examples_parse_or_fail_in_one_line(example, draw):
    data = copy.deepcopy(read_recipe_data(example))
    for _ in range(draw.draw(st.integers(1, 3), label="mutations")):
        path = draw.draw(st.sampled_from(_paths(data)[1:]), label="path")
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        op = draw.draw(st.sampled_from(["set", "delete", "add"]), label="op")
        if op == "set":
            parent[path[-1]] = draw.draw(_VALUES, label="value")
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw.draw(_KEYS, label="key")] = draw.draw(_VALUES, label="value")
        else:
            parent.insert(path[-1], draw.draw(_VALUES, label="value"))
        if not _paths(data)[1:]:
            break
    _assert_parses_or_one_line(data, str(example))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(example=st.sampled_from(EXAMPLES), cut=st.floats(0, 1), flips=st.lists(
    st.tuples(st.floats(0, 1), st.sampled_from(list(":-[]{}&*!|>'\"#\n\t ") + ["\x00", "é", "9" * 5])), max_size=4))
def test_cli_dry_run_on_damaged_recipe_text_exits_0_or_2(tmp_path_factory, example, cut, flips):
    text = example.read_text()
    for where, char in flips:
        i = int(where * (len(text) - 1))
        text = text[:i] + char + text[i + 1:]
    text = text[: max(1, int(cut * len(text)))] if cut < 0.5 else text
    path = tmp_path_factory.mktemp("damaged") / example.name
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    r = _cli("run", path, "--dry-run")
    if r.exit_code == 0:
        assert "plan OK" in r.stdout
    else:
        _one_line_error(r)


def test_a_recipe_naming_the_old_step_runs_the_new_one_with_one_warning(monkeypatch, caplog):
    import importlib

    monkeypatch.setattr(importlib.import_module("edgekit.compress"), "_warned_aliases", set())
    old, new = _recipe(), _recipe()
    old["stages"][1]["steps"] = [{"prune": {"ratio": 0.5}}, {"int4": {"method": "rtn", "group_size": 16}}]
    new["stages"][1]["steps"] = [{"prune": {"ratio": 0.5}}, {"weight-only": {"method": "rtn", "group_size": 16}}]
    with caplog.at_level("WARNING", logger="edgekit.compress"):
        parsed_old = parse_recipe(copy.deepcopy(old))
        parse_recipe(copy.deepcopy(old))  # parsed again (a sweep's points): no second line
    assert [r.getMessage() for r in caplog.records] == [
        "stage 'mlp' steps[1]: 'int4' is now 'weight-only'; the old name will be removed in a later release"]
    assert [s.name for s in parsed_old.stages[1].steps] == ["prune", "weight-only"]
    # the same recipe as one written with the new name: the same stage cache key (a result cached
    # for either hits for both; one cached by an earlier version under "int4" is keyed apart, a clean miss)
    assert parsed_old.to_dict() == parse_recipe(new).to_dict()
    old["stages"][1]["steps"] = [{"int4": {"group_size": 48}}]  # the options are checked under the new name
    with pytest.raises(BadInputError, match=r"^stage 'mlp' weight-only: unsupported group size 48"):
        parse_recipe(old)
