"""Recipes, per-stage budgets, caching, CI outputs and sweeps, on the tiny example stages."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgekit.errors import BadInputError
from edgekit.pipelines.recipe import parse_recipe
from edgekit.pipelines.run import StageResult, _critical_path, run_recipe
from edgekit.pipelines.sweep import apply_overrides, combinations, parse_grid

FAST_PROFILE = {"warmup_ms": 5, "duration_s": 0.05, "iterations": 10, "node_profile": False}


def _recipe(**over):
    data = {
        "name": "tiny", "target": "cpu", "budget_ms": 1000, "percentile": "p99", "seed": 0, "profile": FAST_PROFILE,
        "stages": [
            {"name": "pre", "callable": "edgekit.pipelines.examples:scale", "inputs": {"x": {"shape": [1, 16]}},
             "budget_ms": 100},
            {"name": "mlp", "model": "edgekit.pipelines.examples:tiny_mlp", "budget_ms": 500},
        ],
    }
    data.update(over)
    return data


def _cli(*args):
    """Run the CLI in-process (click's runner); exit code, stdout and stderr as a subprocess would see them."""
    from click.testing import CliRunner

    from edgekit.cli import cli

    return CliRunner().invoke(cli, list(args))


# ----- validation (all before any work) -----

@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(bogus=1), "recipe bogus: unknown key (known: budget_ms, description, frames, max_jitter, name"),
    (lambda d: d["stages"][1].update(color="red"), "stage 2 color: unknown key (known: budget_ms, build"),
    (lambda d: d.update(budget_ms=0), "recipe budget_ms: must be a positive number of milliseconds, got 0"),
    (lambda d: d["stages"][0].update(budget_ms=-3), "stage 'pre' budget_ms: must be a positive number"),
    (lambda d: d["stages"][1].update(steps=[{"quantize": {}}]),
     "stage 'mlp' steps[0]: unknown step 'quantize' (choose from 'distill', 'half', 'int8', 'lora', 'prune', 'weight-only')"),
    (lambda d: d.update(target="nosuch-board"), "recipe targets[0]: unknown target 'nosuch-board'"),
    (lambda d: d.update(percentile="p42"), "recipe percentile: unknown percentile 'p42'"),
    (lambda d: d["stages"][0].update(parallel_with=["mlp"]),
     "stage 'pre' parallel_with: 'mlp' comes later; declare parallel_with: [pre] on 'mlp' instead"),
    (lambda d: d["stages"][1].update(parallel_with=["ghost"]),
     "stage 'mlp' parallel_with: unknown stage 'ghost' (stages: mlp, pre)"),
    (lambda d: d["stages"][1].update(callable="x:y"), "stage 'mlp': needs exactly one of 'model'"),
])
def test_recipe_validation_messages(mutate, message):
    data = _recipe()
    mutate(data)
    with pytest.raises(BadInputError) as e:
        parse_recipe(data)
    assert message in str(e.value)


def test_cyclic_parallel_declaration_is_rejected():
    data = _recipe()
    data["stages"].append({"name": "b", "model": "edgekit.pipelines.examples:tiny_mlp", "parallel_with": ["mlp"]})
    data["stages"][1]["parallel_with"] = ["b"]
    with pytest.raises(BadInputError, match="cyclic parallel declaration: 'mlp' <-> 'b'"):
        parse_recipe(data)


def test_step_needing_float_after_packing_is_rejected():
    pytest.importorskip("edgekit.compress.weight_only.step")
    pytest.importorskip("edgekit.compress.prune")
    data = _recipe()
    data["stages"][1]["steps"] = [{"weight-only": {"method": "rtn", "group_size": 16}}, {"prune": {"ratio": 0.5}}]
    with pytest.raises(BadInputError, match=r"stage 'mlp' steps: prune needs float weights, but after weight-only the model "
                                            r"is packed \(low-bit codes\); put prune before weight-only"):
        parse_recipe(data)


def test_critical_path_with_parallel_stages():
    recipe = parse_recipe({**_recipe(), "stages": [
        {"name": "a", "callable": "edgekit.pipelines.examples:scale"},
        {"name": "b", "callable": "edgekit.pipelines.examples:scale"},
        {"name": "c", "callable": "edgekit.pipelines.examples:scale", "parallel_with": ["b"]},
        {"name": "d", "callable": "edgekit.pipelines.examples:scale"},
    ]})
    res = [StageResult(stage=n, target="cpu", kind="callable", source="measured", latency_ms=v, p50_ms=v, p99_ms=v,
                       parallel_with=list(recipe.stage(n).parallel_with)) for n, v in zip("abcd", (2.0, 6.0, 4.0, 3.0))]
    summary = _critical_path(res, recipe)
    # a: 0-2, b: 2-8, c starts with b: 2-6, d after both: 8-11
    assert [(r.start_ms, r.end_ms) for r in res] == [(0, 2), (2, 8), (2, 6), (8, 11)]
    assert summary["total_ms"] == pytest.approx(11.0)
    assert summary["passed"] is True and summary["margin_ms"] == pytest.approx(989.0)


# ----- a real run of the tiny stages -----

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("edgekit.build")
    out = tmp_path_factory.mktemp("run")
    recipe = parse_recipe(_recipe())
    first = run_recipe(recipe, out, progress=False)
    second = run_recipe(recipe, out, progress=False)
    return out, first, second


def test_run_writes_results_junit_summary_and_html(tiny_run):
    out, first, _ = tiny_run
    assert first.passed
    assert [r.stage for r in first.stages] == ["pre", "mlp"]
    t = first.targets["cpu"]
    # Measured frames: the end-to-end figure is the frames' own p99, not a sum of stage p99s.
    assert t["method"] == "measured frames" and t["frames"] >= 10
    assert t["total_ms"] == pytest.approx(t["p99_ms"])
    assert t["sum_of_stage_ms"] == pytest.approx(sum(r.latency_ms for r in first.stages))
    assert all(r.latency_ms > 0 and r.cv >= 0 for r in first.stages)
    # Shares are of the measured frame mean; stage times are inside the frame, so they sum to at most 1.
    assert 0 < sum(r.share for r in first.stages) <= 1.0 + 1e-9
    assert first.stages[0].estimated_ms is None and first.stages[1].estimated_ms > 0  # roofline beside measurement
    assert first.stages[1].artifacts["frames"] == first.stages[0].artifacts["frames"]
    data = json.loads((out / "results.json").read_text())
    assert data["seed"] == 0 and data["percentile"] == "p99"
    suite = ET.parse(out / "junit.xml").getroot()
    names = [c.get("name") for c in suite.iter("testcase")]
    assert names == ["cpu.total_budget", "cpu.pre.budget", "cpu.mlp.budget"]
    assert suite.get("failures") == "0"
    outs = [e.text for e in suite.iter("system-out")]
    assert outs[0].startswith("frame p99 ") and "measured over" in outs[0] and "cv " in outs[0]
    assert all("cv " in o for o in outs)
    md = (out / "summary.md").read_text()
    assert "| cpu | pre |" in md and "against 1000 ms: **PASS**" in md
    assert "| cv |" in md and "measured over" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2


def test_second_run_reuses_every_step(tiny_run):
    _, first, second = tiny_run
    assert not any(first.stages[1].reused.values())
    assert all(second.stages[1].reused.values()) and second.stages[0].reused == {"frames": True}
    assert second.stages[1].artifacts == first.stages[1].artifacts


def test_changed_stage_rebuilds_it_and_everything_after(tmp_path, tiny_run):
    out, first, _ = tiny_run
    data = _recipe()
    data["stages"][0]["inputs"] = {"x": {"shape": [2, 16]}}  # change the first stage only
    changed = run_recipe(parse_recipe(data), out, progress=False)
    assert changed.stages[0].reused == {"frames": False}
    assert not any(changed.stages[1].reused.values())  # after a changed stage: rebuilt


def test_stage_output_that_does_not_fit_the_next_stage_is_exit_2_before_timing(tmp_path):
    pytest.importorskip("edgekit.build")
    data = _recipe()
    data["stages"][0]["inputs"] = {"x": {"shape": [1, 32]}}  # pre's output (1, 32) vs mlp's input (batch, 16)
    p = tmp_path / "misfit.yaml"
    p.write_text(yaml.safe_dump(data))
    r = _cli("run", str(p), "-o", str(tmp_path / "run"))
    assert r.exit_code == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: stage 'pre' does not fit stage 'mlp': input 'input' has shape (1, 32); "
                           "the model expects ('batch', 16)")
    assert "pre.output (1, 32) float32 -> input" in line and "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "results.json").exists()
    assert not list((tmp_path / "run" / "cache").glob("frames-*"))  # nothing timed
    assert not list((tmp_path / "run" / "cache").glob("profile-*"))


def test_stage_count_mismatch_names_both_stages(tmp_path):
    from edgekit.pipelines.frames import callable_stage, measure_frames
    from edgekit.profiling import ProfileConfig

    a = callable_stage("split", lambda x: (x, x), {"x": {"shape": [2]}})
    b = callable_stage("add", lambda x: x + 1)
    frames = [{"x": np.ones(2, np.float32)}]
    with pytest.raises(BadInputError, match=r"stage 'add' takes 1 input\(s\) \(x\) but stage 'split' gives 2 "
                                            r"\(split.output0, split.output1\): they do not fit"):
        measure_frames([a, b], frames, ProfileConfig(warmup_ms=0, duration_s=0, iterations=1))


def test_parallel_stages_run_concurrently_and_the_frame_is_the_critical_path():
    import time as _time

    from edgekit.pipelines.frames import callable_stage, measure_frames
    from edgekit.profiling import ProfileConfig

    def sleep(ms):
        def fn(x):
            _time.sleep(ms / 1e3)  # sleeping releases the GIL, as ONNX Runtime and NumPy kernels do
            return x
        return fn

    stages = [callable_stage("a", sleep(2), {"x": {"shape": [1]}}), callable_stage("b", sleep(30)),
              callable_stage("c", sleep(30), parallel_with=["b"]), callable_stage("d", lambda x: x)]
    stages[3].feeds = {"x": "b"}
    m = measure_frames(stages, [{"x": np.zeros(1, np.float32)}],
                       ProfileConfig(warmup_ms=0, duration_s=0, iterations=5, max_repeats=0))
    assert len(m.total_ms) == 5
    total = m.total().p50
    # b and c overlap: the frame is about 2 + 30 ms, far below the 62 ms their sum would be.
    assert total < 55 and total >= 30
    assert abs(m.start_ms["b"] - m.start_ms["c"]) < 10
    assert m.share("b") > 0.5 and m.share("c") > 0.5  # each of the parallel stages covers most of the frame


def test_a_parallel_stage_cannot_feed_on_its_partner():
    from edgekit.pipelines.frames import callable_stage, measure_frames
    from edgekit.profiling import ProfileConfig

    stages = [callable_stage("a", lambda x: x, {"x": {"shape": [1]}}), callable_stage("b", lambda x: x),
              callable_stage("c", lambda x: x, parallel_with=["b"], feeds={"x": "b"})]
    with pytest.raises(BadInputError, match="stage 'c' feeds: 'b' runs in parallel with 'c'"):
        measure_frames(stages, [{"x": np.zeros(1, np.float32)}], ProfileConfig(warmup_ms=0, duration_s=0, iterations=1))


def test_noisy_measurement_is_repeated_then_reported():
    from edgekit.profiling import ProfileConfig, repeat_while_noisy

    cvs = iter([0.5, 0.4, 0.3, 0.01])
    calls = []

    def attempt():
        calls.append(1)
        return next(cvs)

    best, seen = repeat_while_noisy(attempt, lambda v: v, ProfileConfig(noise_cv=0.1, max_repeats=2))
    assert seen == [0.5, 0.4, 0.3] and best == 0.3 and len(calls) == 3  # bounded: 1 + 2 attempts
    best, seen = repeat_while_noisy(lambda: 0.05, lambda v: v, ProfileConfig(noise_cv=0.1))
    assert seen == [0.05]


def test_noisy_verdict_says_so():
    from edgekit.pipelines.run import target_verdict

    t = {"method": "measured frames", "total_ms": 30.0, "p50_ms": 20.0, "p99_ms": 30.0, "cv": 0.3, "noisy": True,
         "attempts": 3, "frames": 200, "sum_of_stage_ms": 41.0, "budget_ms": 33.0, "passed": True, "margin_ms": 3.0}
    line = target_verdict(t)
    assert line.startswith("frame p99 30.000 ms (measured over 200 frames; p50 20.000, cv 30.0%; sum of stage p99s "
                           "41.000; noisy after 3 attempt(s)) against 33 ms: PASS (noisy measurement")
    est = {"method": "estimate (sum of stages)", "total_ms": 12.0, "budget_ms": None}
    assert target_verdict(est) == "p99 12.000 ms (estimate (sum of stages)) (no end-to-end budget)"


def test_remeasure_times_cached_engines_again_without_rebuilding(tmp_path):
    pytest.importorskip("edgekit.build")
    recipe = parse_recipe(_recipe())
    first = run_recipe(recipe, tmp_path, progress=False)
    again = run_recipe(recipe, tmp_path, progress=False, remeasure=True)
    mlp = again.stages[1].reused
    assert mlp["export"] and mlp["build"]  # nothing rebuilt
    assert mlp["profile"] is False and mlp["frames"] is False and again.stages[0].reused == {"frames": False}
    assert again.stages[1].artifacts["engine"] == first.stages[1].artifacts["engine"]
    r = _cli("run", "--help")
    assert "--remeasure" in r.stdout


def test_budget_miss_fails_and_junit_reports_it(tmp_path):
    pytest.importorskip("edgekit.build")
    data = _recipe(budget_ms=1e-6)
    result = run_recipe(parse_recipe(data), tmp_path, progress=False)
    assert result.passed is False and result.targets["cpu"]["passed"] is False
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert suite.get("failures") == "1"
    failure = next(suite.iter("failure"))
    assert "vs budget 1e-06 ms" in failure.get("message")


def test_cli_run_exit_codes_and_dry_run(tmp_path):
    pytest.importorskip("edgekit.build")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_recipe()))
    r = _cli("run", str(good), "--dry-run")
    assert r.exit_code == 0, r.output
    assert "cpu / mlp [budget 500 ms]: load edgekit.pipelines.examples:tiny_mlp -> export onnx" in r.stdout
    assert not (tmp_path / "runs").exists()
    r = _cli("run", str(good), "-o", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    assert "PASS" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_recipe(budget_ms=1e-6)))
    r = _cli("run", str(bad), "-o", str(tmp_path / "run2"))
    assert r.exit_code == 1
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(_recipe(budgett=3)))
    r = subprocess.run([sys.executable, "-m", "edgekit.cli", "run", str(broken)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"error: {broken}: recipe budgett: unknown key (known: budget_ms, ")
    assert r.stderr.strip().endswith("did you mean 'budget_ms'?)")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ----- sweeps -----

def test_grid_parsing_and_overrides():
    grid = parse_grid(["bits=32,8", "prune.ratio=0,0.5"])
    assert grid == {"bits": [32, 8], "prune.ratio": [0, 0.5]}
    assert len(combinations(grid)) == 4
    pytest.importorskip("edgekit.compress.prune")
    pytest.importorskip("edgekit.compress.int8.step")
    data = _recipe()
    data["stages"][1]["steps"] = [{"prune": {"ratio": 0.3}}, {"int8": {"method": "ptq"}}]
    base = apply_overrides(data, {"prune.ratio": 0, "bits": 32})
    assert base["stages"][1]["steps"] == []
    four = apply_overrides(data, {"prune.ratio": 0.5, "bits": 4})
    assert four["stages"][1]["steps"] == [{"prune": {"ratio": 0.5}}, {"weight-only": {"method": "rtn", "bits": 4}}]
    with pytest.raises(BadInputError, match="grid key \\(no step has it\\) 'weight-only.group_size'"):
        apply_overrides(data, {"weight-only.group_size": 32})
    data["stages"][1]["steps"] = [{"int8": {"method": "qat", "calib_samples": 8}}]
    assert apply_overrides(data, {"bits": 8})["stages"][1]["steps"] == [{"int8": {"method": "qat", "calib_samples": 8}}]
    data["stages"][1]["steps"] = [{"weight-only": {"method": "gptq-plus", "group_size": 32}}]  # weight-only stays weight-only
    assert apply_overrides(data, {"bits": 8})["stages"][1]["steps"] == [
        {"weight-only": {"method": "gptq-plus", "group_size": 32, "bits": 8}}]
    with pytest.raises(BadInputError, match="grid bits=5: bits must be 32 \\(float\\), 8, 4, 3 or 2"):
        apply_overrides(data, {"bits": 5})



def test_a_grid_key_or_recipe_naming_the_old_step_sets_the_new_one(monkeypatch, caplog):
    import importlib

    monkeypatch.setattr(importlib.import_module("edgekit.compress"), "_warned_aliases", set())
    data = _recipe()
    data["stages"][1]["steps"] = [{"int4": {"method": "rtn"}}]  # a recipe of an earlier version
    with caplog.at_level("WARNING", logger="edgekit.compress"):
        for key in ("int4.group_size", "weight-only.group_size", "mlp.int4.group_size"):
            assert apply_overrides(data, {key: 32})["stages"][1]["steps"] == [
                {"weight-only": {"method": "rtn", "group_size": 32}}]
    assert [r.getMessage() for r in caplog.records] == [
        "grid key 'int4.group_size': 'int4' is now 'weight-only'; the old name will be removed in a later release"]


def _sweep_recipe(tmp_path: Path) -> Path:
    data = _recipe()
    data["stages"] = [data["stages"][1]]
    data["stages"][0]["steps"] = [{"prune": {"ratio": 0.25}}]
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_pareto_marks_only_non_dominated_rows():
    from edgekit.pipelines.sweep import SweepRow, _pareto

    def row(acc, lat, size):
        return SweepRow(params={"x": acc}, run_dir="", passed=True, metric="accuracy", value=acc,
                        higher_is_better=True, size_mb=size, latency_ms={"cpu": lat})

    rows = [row(0.90, 1.0, 1.0), row(0.92, 2.0, 2.0), row(0.89, 3.0, 3.0), row(0.95, 4.0, 0.5)]
    _pareto(rows, "cpu")
    assert [r.pareto for r in rows] == [True, True, False, True]


def test_each_plot_has_the_pareto_set_of_its_own_two_axes():
    from edgekit.pipelines.html import pareto_2d

    # (latency, accuracy): (4, 0.95) beats nothing on latency but everyone on accuracy.
    assert pareto_2d([(1, 0.90), (2, 0.92), (3, 0.89), (4, 0.95)], True) == [True, True, False, True]
    # Lower is better (perplexity): (2, 9) is beaten by (1, 8) in both axes.
    assert pareto_2d([(1, 8.0), (2, 9.0), (3, 7.0)], False) == [True, False, True]
    # A point optimal in three objectives (small size) is not on the 2-D latency frontier.
    from edgekit.pipelines.sweep import SweepRow, _pareto

    rows = [SweepRow(params={"k": i}, run_dir="", passed=True, metric="accuracy", value=v, higher_is_better=True,
                     size_mb=s, latency_ms={"cpu": lat}) for i, (v, lat, s) in enumerate([(0.9, 1, 5), (0.9, 2, 1)])]
    _pareto(rows, "cpu")
    assert [r.pareto for r in rows] == [True, True]
    assert pareto_2d([(1, 0.9), (2, 0.9)], True) == [True, False]


def test_sweep_writes_table_and_html(tmp_path):
    pytest.importorskip("edgekit.build")
    pytest.importorskip("edgekit.compress.prune")
    from edgekit.pipelines.sweep import run_sweep

    recipe = _sweep_recipe(tmp_path)
    with pytest.raises(BadInputError, match="grid key"):
        run_sweep(recipe, ["mlp.model=x"], tmp_path / "s0")
    assert not (tmp_path / "s0").exists()  # validated before any work
    rows = run_sweep(recipe, ["prune.ratio=0,0.5"], tmp_path / "s1")
    assert [r.params for r in rows] == [{"prune.ratio": 0}, {"prune.ratio": 0.5}]
    assert all(r.latency_ms["cpu"] > 0 and r.size_mb > 0 and r.estimated_ms["cpu"] > 0 for r in rows)
    assert rows[1].size_mb < rows[0].size_mb
    assert (tmp_path / "s1" / "sweep.json").exists() and (tmp_path / "s1" / "sweep.md").exists()
    assert all(r.p50_ms["cpu"] <= r.p99_ms["cpu"] and r.budget_ms == 1000 for r in rows)  # measured frames
    assert "Pareto set" in (tmp_path / "s1" / "sweep.html").read_text()



def test_sweep_plots_label_points_and_draw_budget_and_error_bars(tmp_path):
    from edgekit.pipelines.html import sweep_plots
    from edgekit.pipelines.sweep import SweepRow

    rows = [SweepRow(params={"int8.calib_samples": n, "prune.ratio": r}, run_dir="", passed=True, metric="map50",
                     value=v, higher_is_better=True, size_mb=s, latency_ms={"cpu": lat},
                     p50_ms={"cpu": lat * 0.8}, p99_ms={"cpu": lat}, budget_ms=33.0)
            for n, r, v, s, lat in [(16, 0, 0.95, 2.0, 40.0), (32, 0.3, 0.93, 1.5, 30.0), (16, 0.5, 0.80, 1.0, 35.0)]]
    plots = sweep_plots(rows, tmp_path, budget_ms=33.0)
    assert set(plots) == {"latency-cpu", "size"}
    assert all(p.stat().st_size > 5000 for p in plots.values())


@pytest.mark.ray
@pytest.mark.matrix  # starting Ray costs more than the sweep: with -m matrix, apart from CI
def test_ray_executor_runs_a_small_sweep(tmp_path):
    ray = pytest.importorskip("ray")
    pytest.importorskip("edgekit.build")
    pytest.importorskip("edgekit.compress.prune")
    from edgekit.pipelines.sweep import ray_resource, run_sweep

    recipe = _sweep_recipe(tmp_path)
    ray.init(num_cpus=2, resources={ray_resource("cpu"): 1}, include_dashboard=False, log_to_driver=False)
    try:
        rows = run_sweep(recipe, ["prune.ratio=0"], tmp_path / "ray", executor="ray")
    finally:
        ray.shutdown()
    assert len(rows) == 1 and rows[0].passed and rows[0].latency_ms["cpu"] > 0


@pytest.mark.browser
def test_html_report_renders_in_headless_chromium(tiny_run, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed")
    out, _, _ = tiny_run
    shot = tmp_path / "shot.png"
    dump = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600", "--virtual-time-budget=3000",
         "--dump-dom", (out / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert "edgekit run: tiny" in dump.stdout
    assert dump.stdout.count("data:image/png;base64,") >= 2
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile2'}", "--window-size=1200,1600", f"--screenshot={shot}",
         (out / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000
    # The plots are images the browser decoded: a non-blank screenshot with many colours.
    from PIL import Image

    img = Image.open(shot).convert("RGB").resize((200, 266))
    assert len(set(img.getdata())) > 50


@pytest.mark.browser
def test_sweep_html_renders_in_headless_chromium(tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed")
    from edgekit.pipelines.html import render_sweep_html, sweep_plots
    from edgekit.pipelines.sweep import SweepRow

    rows = [SweepRow(params={"bits": b}, run_dir="", passed=lat <= 33, metric="map50", value=v, higher_is_better=True,
                     size_mb=s, latency_ms={"cpu": lat}, p50_ms={"cpu": lat * 0.7}, p99_ms={"cpu": lat}, budget_ms=33.0)
            for b, v, s, lat in [(32, 0.99, 7.3, 40.0), (8, 0.98, 2.2, 25.0)]]
    plots = sweep_plots(rows, tmp_path, budget_ms=33.0)
    page = render_sweep_html(rows, tmp_path / "sweep.html", plots, "dms.yaml")
    dump = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert "edgekit sweep: dms.yaml" in dump.stdout and "Pareto set" in dump.stdout
    assert dump.stdout.count("data:image/png;base64,") == 2
