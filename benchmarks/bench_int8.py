"""INT8 benchmark (issue 3): FP32 versus edgekit PTQ (each calibration method), edgekit QAT,
and the peer, ONNX Runtime's own ``quantize_static`` (QDQ, per-channel, U8S8), side by side.

Per model: accuracy on the labelled eval split (Fashion-MNIST CNN), or top-1 agreement
and mean KL against the FP32 engine (EfficientNet-Lite0, on the photos+fashion-mnist eval
split, disjoint from calibration), or mean cosine (MiniLM); ONNX size; ONNX Runtime
latency at batch 1 on 1 thread (interleaved rounds: every variant is timed in every round,
so a neighbour's load hits all alike; p50/p99 over all samples); ratios to FP32 and to
the peer; quantization time; and the optimized graph's integer-node count.

    python benchmarks/bench_int8.py [--models fmnist-cnn,efficientnet-lite0,minilm-l6]
        [--methods percentile,minmax,entropy,mse] [--peer-methods minmax]
        [--calib-samples 96] [--rounds 5] [--iters 30] [--qat-steps 600]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions  # noqa: E402

INTEGER_OPS = {"QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "ConvInteger", "QLinearAdd",
               "QLinearGlobalAveragePool", "QLinearAveragePool", "MatMulIntegerToFloat", "DynamicQuantizeMatMul",
               "QLinearMul", "QLinearConcat", "QLinearSigmoid", "QLinearLeakyRelu", "QLinearSoftmax"}


def session(path: Path, threads: int = 1, optimized_out: Path | None = None) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    if optimized_out is not None:
        so.optimized_model_filepath = str(optimized_out)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def run_all(sess: Any, samples: Any, batch: int = 32) -> np.ndarray:
    names = [i.name for i in sess.get_inputs()]
    outs = []
    for b in samples.batches(batch):
        outs.append(sess.run(None, {n: b[n] for n in names})[0])
    return np.concatenate(outs)


def integer_nodes(path: Path) -> tuple[int, int]:
    import onnx

    tmp = path.with_suffix(".opt.onnx")
    session(path, optimized_out=tmp)
    nodes = [n.op_type for n in onnx.load(str(tmp)).graph.node]
    tmp.unlink()
    return sum(op in INTEGER_OPS for op in nodes), len(nodes)


def metrics_for(out: np.ndarray, ref: np.ndarray, labels: np.ndarray | None, evaluator: str | None) -> dict[str, float]:
    from edgekit.compress.int8 import score

    return score(out, ref, labels, evaluator)


def export(handle: Any, folder: Path) -> Path:
    from edgekit.export.onnx import ExportConfig, export_onnx

    export_onnx(handle, folder, ExportConfig(skip_parity=True))
    return folder / "model.onnx"


def peer_quantize(fp32: Path, dst: Path, calib: Any, method: str) -> float:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calib.batches(1))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    cm = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
          "percentile": CalibrationMethod.Percentile}[method]
    extra = {"CalibPercentile": 99.999} if method == "percentile" else {}
    t0 = time.perf_counter()
    quantize_static(str(fp32), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=cm,
                    extra_options=extra)
    return time.perf_counter() - t0


def time_variants(variants: dict[str, Path], feeds: dict[str, np.ndarray], rounds: int, iters: int) -> dict[str, dict[str, float]]:
    sessions = {k: session(p) for k, p in variants.items()}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for s in sessions.values():  # warm-up
        names = [i.name for i in s.get_inputs()]
        t_end = time.perf_counter() + 0.2
        while time.perf_counter() < t_end:
            s.run(None, {n: feeds[n] for n in names})
    for _ in range(rounds):
        for k, s in sessions.items():
            names = [i.name for i in s.get_inputs()]
            f = {n: feeds[n] for n in names}
            for _ in range(iters):
                t0 = time.perf_counter()
                s.run(None, f)
                samples[k].append((time.perf_counter() - t0) * 1e3)
    return {k: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)), "n": len(v)}
            for k, v in samples.items()}


def bench_model(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from edgekit.compress import StepContext
    from edgekit.compress.int8 import Int8Config, apply
    from edgekit.errors import BadInputError
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    h = load_model(name)
    calib = load_samples(None, h, split="calib", limit=args.calib_samples)
    try:
        ev = load_samples(None, h, split="eval", limit=args.eval_limit)
    except BadInputError:  # a smaller split than the limit: take all of it
        ev = load_samples(None, h, split="eval")
    evaluator = h.evaluator
    print(f"[{name}] calib {len(calib)} ({calib.source}), eval {len(ev)} ({ev.source}), evaluator {evaluator}",
          flush=True)
    variants: dict[str, Path] = {}
    info: dict[str, dict[str, Any]] = {}
    fp32 = export(h, work / name / "fp32")
    variants["fp32"] = fp32
    info["fp32"] = {"kind": "fp32"}
    ref = run_all(session(fp32, threads=os.cpu_count() or 1), ev)

    for m in args.peer_methods:
        dst = work / name / f"peer-{m}.onnx"
        try:
            secs = peer_quantize(fp32, dst, calib, m)
        except Exception as e:  # record, keep going
            info[f"ort-quantize_static-{m}"] = {"kind": "peer", "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"  peer {m} failed: {e}", flush=True)
            continue
        variants[f"ort-quantize_static-{m}"] = dst
        info[f"ort-quantize_static-{m}"] = {"kind": "peer", "quant_seconds": round(secs, 2)}
        print(f"  peer {m}: {secs:.1f} s", flush=True)

    configs: list[tuple[str, Any]] = [(f"edgekit-ptq-{m}", Int8Config(calib_method=m, calib_samples=args.calib_samples,
                                                                     eval_samples=8)) for m in args.methods]
    if name == "fmnist-cnn" and args.qat_steps:
        configs.append(("edgekit-qat", Int8Config(method="qat", calib_samples=args.calib_samples, qat_epochs=1,
                                                  qat_max_steps=args.qat_steps, qat_lr=2e-4, eval_samples=8)))
    if name == "efficientnet-lite0" and args.fallback is not None:
        configs.append((f"edgekit-ptq-fallback-{args.fallback}", Int8Config(
            calib_samples=args.calib_samples, max_accuracy_drop=args.fallback, eval_samples=None)))
    for label, cfg in configs:
        ctx = StepContext(calib=calib, eval=ev.subset(slice(0, cfg.eval_samples)) if cfg.eval_samples else ev,
                          work_dir=work / name / f"{label}.work", progress=False)
        t0 = time.perf_counter()
        try:
            q = apply(load_model(name), cfg, ctx)
        except Exception as e:
            info[label] = {"kind": "edgekit", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {label} failed: {e}", flush=True)
            continue
        secs = time.perf_counter() - t0
        if q.module is not None:
            path = export(q, work / name / label)
            # parity: the ORT INT8 engine against the PyTorch fake-quant model, 8 eval samples
            x = {k: v[:8] for k, v in ev.inputs.items()}
            with torch.no_grad():
                y_t = q.module(*[torch.from_numpy(x[s.name]) for s in q.inputs])
                y_t = (y_t[0] if isinstance(y_t, (tuple, list)) else y_t).numpy()
            s = session(path)
            y_o = s.run(None, {i.name: x[i.name] for i in s.get_inputs()})[0]
            parity = {"max_abs": float(np.abs(y_o - y_t).max()), "ref_max_abs": float(np.abs(y_t).max()),
                      "top1_match": float((y_o.argmax(-1) == y_t.argmax(-1)).mean()) if y_o.ndim == 2 else None}
        else:
            path = Path(q.onnx_path)
            parity = {"skipped": "ONNX-only result"}
        variants[label] = path
        m = ctx.metrics.get("int8", {})
        info[label] = {"kind": "edgekit", "quant_seconds": round(secs, 2), "parity_vs_fake_quant": parity,
                       "float_layers": q.steps[-1].meta.get("float_layers", []),
                       "fallback": {k: v for k, v in m.get("fallback", {}).items()
                                    if k in ("float_layers", "float_activations", "float_mac_share", "met")},
                       "qat": m.get("qat")}
        print(f"  {label}: {secs:.1f} s", flush=True)

    results: dict[str, Any] = {}
    for k, path in variants.items():
        out = run_all(session(path, threads=os.cpu_count() or 1), ev)
        ints, total = integer_nodes(path)
        results[k] = {**info[k], "metrics": metrics_for(out, ref, ev.labels, evaluator),
                      "size_mb": round(sum(f.stat().st_size for f in path.parent.glob(path.name + "*")) / 2**20, 3),
                      "integer_nodes": ints, "nodes": total}
    feeds = {k: v[:1] for k, v in ev.inputs.items()}
    lat = time_variants(variants, feeds, args.rounds, args.iters)
    peer_keys = [k for k in variants if k.startswith("ort-quantize_static")]
    peer_p50 = min((lat[k]["p50"] for k in peer_keys), default=None)
    for k in variants:
        r = results[k]
        r["latency_ms"] = lat[k]
        r["speedup_vs_fp32"] = lat["fp32"]["p50"] / lat[k]["p50"]
        r["speed_vs_peer"] = (peer_p50 / lat[k]["p50"]) if peer_p50 else None
    for k in info:
        if k not in results:
            results[k] = info[k]
    return {"model": name, "calib": {"source": calib.source, "n": len(calib)},
            "eval": {"source": ev.source, "n": len(ev)}, "evaluator": evaluator, "variants": results}


def print_table(res: dict[str, Any]) -> None:
    print(f"\n{res['model']}  (eval {res['eval']['n']} x {res['eval']['source']})")
    print(f"{'variant':38s} {'quality':>26s} {'size MB':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'xFP32':>6s} "
          f"{'xpeer':>6s} {'int nodes':>10s} {'quant s':>8s}")
    for k, r in res["variants"].items():
        if "metrics" not in r:
            print(f"{k:38s} ERROR {r.get('error')}")
            continue
        m = r["metrics"]
        if "accuracy" in m:
            q = f"acc {m['accuracy'] * 100:.2f}% agr {m['top1_agreement'] * 100:.1f}%"
        elif "mean_cosine" in m:
            q = f"cos {m['mean_cosine']:.4f} min {m['min_cosine']:.3f}"
        else:
            q = f"agr {m['top1_agreement'] * 100:.1f}% KL {m['mean_kl']:.4f}"
        sp = f"{r['speed_vs_peer']:.2f}" if r.get("speed_vs_peer") else "-"
        print(f"{k:38s} {q:>26s} {r['size_mb']:8.2f} {r['latency_ms']['p50']:8.3f} {r['latency_ms']['p99']:8.3f} "
              f"{r['speedup_vs_fp32']:6.2f} {sp:>6s} {r['integer_nodes']:>4d}/{r['nodes']:<5d} "
              f"{r.get('quant_seconds', '-')!s:>8s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="fmnist-cnn,efficientnet-lite0,minilm-l6")
    p.add_argument("--methods", default="percentile,minmax,entropy,mse")
    # the peer's percentile/entropy calibrators keep every intermediate tensor in memory: on
    # EfficientNet with 96 images they were OOM-killed on the 2-core/23 GB machine; opt in with care
    p.add_argument("--peer-methods", default="minmax")
    p.add_argument("--calib-samples", type=int, default=96)
    p.add_argument("--eval-limit", type=int, default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--qat-steps", type=int, default=600)
    p.add_argument("--fallback", type=float, default=None, help="EfficientNet: also run --max-accuracy-drop X")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int8.json"))
    args = p.parse_args()
    args.methods = [m for m in args.methods.split(",") if m]
    args.peer_methods = [m for m in args.peer_methods.split(",") if m]
    out: dict[str, Any] = {"created": now_iso(), "machine": machine_info(), "versions": package_versions(),
                           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": []}
    with tempfile.TemporaryDirectory(prefix="edgekit-bench-int8-") as tmp:
        for name in [m for m in args.models.split(",") if m]:
            t0 = time.perf_counter()
            res = bench_model(name, args, Path(tmp))
            res["seconds"] = round(time.perf_counter() - t0, 1)
            out["models"].append(res)
            print_table(res)
            atomic_write_json(Path(args.out), out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
