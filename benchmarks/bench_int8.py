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
        [--torchao] [--keep-float first] [--fallback 8] [--batches 64,256]
    # as run for RESULTS.md (torchao installed with `pip install --no-deps --target DIR torchao==0.18.0`):
    PYTHONPATH=DIR python benchmarks/bench_int8.py --models efficientnet-lite0 --torchao --qat-steps 0
    python benchmarks/bench_int8.py --models fmnist-cnn,fmnist-cnn-wide --peer-methods minmax,percentile \
        --qat-steps 0 --eval-limit 2000 --out benchmarks/results/int8_small.json
    python benchmarks/bench_int8.py --only minilm --rounds 7 --iters 20   # the MiniLM-L6 part alone
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
    if sess.get_inputs()[0].shape and sess.get_inputs()[0].shape[0] == 1:  # a batch-1 graph (the torchao export)
        batch = 1
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
    from edgekit.compress.int8.calibration import score

    return score(out, ref, labels, evaluator)


def export(handle: Any, folder: Path) -> Path:
    from edgekit.export.onnx import ExportConfig, export_onnx

    export_onnx(handle, folder, ExportConfig(skip_parity=True))
    return folder / "model.onnx"


def peer_quantize(fp32: Path, dst: Path, calib: Any, method: str, nodes: list[str] | None = None,
                  reduce_range: bool = False) -> float:
    """``quantize_static``; ``nodes``: only these MatMul/Gemm nodes (default: every op it knows);
    ``reduce_range``: 7-bit weights (its advice for x86 CPUs without VNNI)."""
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
    only = {"nodes_to_quantize": nodes, "op_types_to_quantize": ["MatMul", "Gemm"]} if nodes else {}
    t0 = time.perf_counter()
    quantize_static(str(fp32), str(dst), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=reduce_range, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    calibrate_method=cm, extra_options=extra, **only)
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


# --- EfficientNet-Lite0 and Fashion-MNIST CNN extras: torchao peer, larger batches, per-op profile ---


def _plain_convs(module: Any) -> Any:
    """torchao's X86InductorQuantizer matches convolutions and activations by the module that
    ran them: it skips ``Conv2dStaticSamePadding`` (an nn.Conv2d subclass that calls F.conv2d)
    and fails on one ReLU6 module called twice per block ("Input partition has more than one
    output node"). Rewrite both into the same computation with plain modules (exact)."""
    import torch
    from torch import nn

    class _ReLU6(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.hardtanh(x, 0.0, 6.0)

    for name, ch in list(module.named_children()):
        if isinstance(ch, nn.Conv2d) and type(ch) is not nn.Conv2d and hasattr(ch, "static_padding"):
            c = nn.Conv2d(ch.in_channels, ch.out_channels, ch.kernel_size, ch.stride, 0, ch.dilation, ch.groups,
                          ch.bias is not None)
            c.load_state_dict(ch.state_dict(), strict=False)
            setattr(module, name, nn.Sequential(ch.static_padding, c))
        elif isinstance(ch, nn.ReLU6):
            setattr(module, name, _ReLU6())
        else:
            _plain_convs(ch)
    return module


def peer_torchao(handle: Any, dst: Path, calib: Any) -> float:
    """torchao PT2E: torch.export -> prepare_pt2e(X86InductorQuantizer, default config: uint8
    activations, per-channel int8 weights) -> calibrate -> convert_pt2e -> torch.onnx (dynamo)."""
    import copy
    import warnings

    import torch
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq

    warnings.filterwarnings("ignore")
    name = handle.inputs[0].name
    t0 = time.perf_counter()
    m = _plain_convs(copy.deepcopy(handle.module).eval())
    x = torch.from_numpy(np.ascontiguousarray(calib.inputs[name][:1]))
    gm = torch.export.export(m, (x,)).module()
    q = xiq.X86InductorQuantizer()
    q.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(gm, q)
    with torch.no_grad():
        for b in calib.batches(1):  # exported for batch 1
            prepared(torch.from_numpy(b[name]))
    converted = convert_pt2e(prepared)
    torch.onnx.export(converted, (x,), str(dst), dynamo=True, input_names=[name])
    return time.perf_counter() - t0


def time_batches(variants: dict[str, Path], inputs: dict[str, np.ndarray], batches: list[int], rounds: int,
                 iters: int) -> dict[str, dict[str, dict[str, float]]]:
    """p50 per variant at each batch size (interleaved rounds, 1 thread), ms per batch."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for b in batches:
        reps = -(-b // len(next(iter(inputs.values()))))
        feeds = {k: np.ascontiguousarray(np.concatenate([v] * reps)[:b]) for k, v in inputs.items()}
        lat = time_variants(variants, feeds, rounds, iters)
        for k, v in lat.items():
            out.setdefault(k, {})[str(b)] = {**v, "ms_per_sample": v["p50"] / b}
    return out


def op_profile(path: Path, feeds: dict[str, np.ndarray], iters: int = 20) -> dict[str, Any]:
    """ONNX Runtime's own profiler, 1 thread: mean kernel time per run (ms) by operator type
    and by node (the optimized graph's node names)."""
    import json

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = str(path.with_suffix("")) + "-prof"
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    f = {i.name: feeds[i.name] for i in s.get_inputs()}
    for _ in range(3):
        s.run(None, f)
    for _ in range(iters):
        s.run(None, f)
    prof = Path(s.end_profiling())
    by_op: dict[str, float] = {}
    by_node: dict[str, float] = {}
    for e in json.loads(prof.read_text()):
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time"):
            op = e.get("args", {}).get("op_name", "?")
            by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e3
            node = f"{e['name'][:-len('_kernel_time')]} ({op})"
            by_node[node] = by_node.get(node, 0.0) + e["dur"] / 1e3
    prof.unlink()
    n = iters + 3

    def top(d: dict[str, float]) -> dict[str, float]:
        return {k: round(v / n, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}

    return {"by_op": top(by_op), "by_node": dict(list(top(by_node).items())[:12])}


def bench_model(name: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from edgekit.compress import StepContext
    from edgekit.compress.int8.config import Int8Config
    from edgekit.compress.int8.step import apply
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
    if name == "efficientnet-lite0" and args.torchao:
        key = "torchao-pt2e-x86"
        try:
            secs = peer_torchao(h, work / name / "torchao.onnx", calib)
            variants[key] = work / name / "torchao.onnx"
            info[key] = {"kind": "peer", "quant_seconds": round(secs, 2),
                         "note": "torchao PT2E X86InductorQuantizer default config, exported with torch.onnx (dynamo); "
                                 "same-padding convs and shared ReLU6 rewritten to plain modules (exact) first"}
            print(f"  torchao: {secs:.1f} s", flush=True)
        except Exception as e:  # not installed, or a failing step: record the error line
            info[key] = {"kind": "peer", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
            print(f"  torchao failed: {info[key]['error']}", flush=True)

    # each calibration method with plain round-to-nearest weights, then the default (mse ranges, GPTQ rounding)
    configs: list[tuple[str, Any]] = [(f"edgekit-ptq-{m}", Int8Config(calib_method=m, calib_samples=args.calib_samples,
                                                                     rounding="nearest", eval_samples=8))
                                      for m in args.methods]
    if not name.startswith("minilm"):
        configs.append(("edgekit-ptq-default-mse-gptq", Int8Config(calib_samples=args.calib_samples, eval_samples=8)))
    if name == "fmnist-cnn" and args.qat_steps:
        configs.append(("edgekit-qat", Int8Config(method="qat", calib_samples=args.calib_samples, qat_epochs=1,
                                                  qat_max_steps=args.qat_steps, qat_lr=2e-4, eval_samples=8)))
    if not name.startswith("minilm"):
        for keep in args.keep_float:  # e.g. "first": the first conv's weights (and its input) stay float
            configs.append((f"edgekit-ptq-default-float-{keep.replace(',', '+')}", Int8Config(
                calib_samples=args.calib_samples, keep_float=tuple(keep.split(",")), eval_samples=8)))
    if name == "efficientnet-lite0" and args.fallback is not None:
        # the fallback measures on calib-split images after the first calib_samples (never on eval)
        configs.append((f"edgekit-ptq-default-fallback-{args.fallback:g}", Int8Config(
            calib_samples=args.calib_samples, max_accuracy_drop=args.fallback, eval_samples=8)))
    calib_all = load_samples(None, h, split="calib")
    for label, cfg in configs:
        ctx = StepContext(calib=calib_all if cfg.max_accuracy_drop is not None else calib,
                          eval=ev.subset(slice(0, cfg.eval_samples)) if cfg.eval_samples else ev,
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
                                    if k in ("float_layers", "float_activations", "float_mac_share", "met", "steps",
                                             "all_int8", "final", "samples", "sensitivity", "output_sqnr_db",
                                             "scanned_units", "held_out_of_calibration")},
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
    extra: dict[str, Any] = {}
    if name.startswith("fmnist") and args.batches:
        # a 0.05 ms model is dispatch-bound at batch 1; at larger batches compute dominates
        sel = {k: p for k, p in variants.items() if k == "fp32" or k.startswith("ort-quantize_static-minmax")
               or k in ("edgekit-ptq-mse", "edgekit-ptq-default-mse-gptq") or k.startswith("edgekit-ptq-default-float")}
        extra["batch_latency"] = time_batches(sel, ev.inputs, args.batches, args.rounds, max(5, args.iters // 3))
        big = max(args.batches)
        feeds_big = {k: np.ascontiguousarray(v[:big]) for k, v in ev.inputs.items()}
        extra["op_profile_ms"] = {"batch": big, **{k: op_profile(p, feeds_big) for k, p in sel.items()}}
    for k in info:
        if k not in results:
            results[k] = info[k]
    return {"model": name, "calib": {"source": calib.source, "n": len(calib)},
            "eval": {"source": ev.source, "n": len(ev)}, "evaluator": evaluator, "variants": results, **extra}


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
    for k, per_b in res.get("batch_latency", {}).items():
        fp = res["batch_latency"]["fp32"]
        print(f"  {k:36s} " + "  ".join(f"b{b}: {v['p50']:.3f} ms ({fp[b]['p50'] / v['p50']:.2f}x FP32)"
                                         for b, v in per_b.items()))
    prof = res.get("op_profile_ms")
    if prof:
        for k, ops in prof.items():
            if k != "batch":
                print(f"  ops at batch {prof['batch']} {k}: " + ", ".join(f"{o} {t:.3f}" for o, t in list(ops["by_op"].items())[:6]))
                print("     nodes: " + ", ".join(f"{o} {t:.3f}" for o, t in list(ops["by_node"].items())[:6]))


# --- MiniLM-L6 (transformer encoder): placement, calibration, dynamic, peers ---------------------
# `python benchmarks/bench_int8.py --only minilm` -> benchmarks/results/int8_minilm.json

MATMUL_OPS = {"MatMul", "FusedMatMul", "Gemm", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul",
              "MatMulInteger", "QGemm"}


def engine_ops(path: Path) -> dict[str, int]:
    """Op types of ONNX Runtime's optimized CPU graph (what the engine runs)."""
    import collections

    import onnx

    tmp = path.with_suffix(".ops.onnx")
    session(path, optimized_out=tmp)
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp)).graph.node)
    for f in tmp.parent.glob(tmp.name + "*"):
        f.unlink()
    return dict(ops.most_common())


def bench_minilm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """FP32; edgekit linear-only placement with each calibration method; the peers:
    ``quantize_static`` (its default placement, and restricted to the weight MatMuls) and
    ``quantize_dynamic`` (its default, and per-channel on the weight MatMuls)."""
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from edgekit.compress.int8.onnx_graph import quantize_onnx_file, weight_linear_nodes
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    torch.set_num_threads(1)
    name = "minilm-l6"
    h = load_model(name)
    names = [s.name for s in h.inputs]
    calib = load_samples(None, h, split="calib", limit=args.calib_samples)
    ev = load_samples(None, h, split="eval", limit=args.eval_limit) if args.eval_limit else \
        load_samples(None, h, split="eval")
    print(f"[{name}] calib {len(calib)} ({calib.source}), eval {len(ev)} ({ev.source})", flush=True)
    d = work / name
    fp32 = export(h, d / "fp32")
    variants: dict[str, Path] = {"fp32": fp32}
    info: dict[str, dict[str, Any]] = {"fp32": {"kind": "fp32"}}
    linear = [n.name for n in weight_linear_nodes(onnx.load(str(fp32)))]

    def add(label: str, kind: str, fn: Any, **extra: Any) -> None:
        dst = d / f"{label}.onnx"
        t0 = time.perf_counter()
        try:
            out = fn(dst)
        except Exception as e:  # record, keep going
            info[label] = {"kind": kind, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {label} failed: {e}", flush=True)
            return
        secs = time.perf_counter() - t0
        variants[label] = dst
        info[label] = {"kind": kind, "quant_seconds": round(secs, 2), **extra,
                       **(out if isinstance(out, dict) else {})}
        print(f"  {label}: {secs:.1f} s", flush=True)

    add("ort-quantize_static-minmax", "peer", lambda dst: peer_quantize(fp32, dst, calib, "minmax"),
        placement="ORT default (every quantizable op)")
    add("ort-quantize_static-minmax-linear", "peer",
        lambda dst: peer_quantize(fp32, dst, calib, "minmax", nodes=linear),
        placement="weight MatMuls (nodes_to_quantize)")
    add("ort-quantize_dynamic", "peer-dynamic",
        lambda dst: quantize_dynamic(str(fp32), str(dst), weight_type=QuantType.QInt8),
        placement="ORT default, per-tensor weights")
    add("ort-quantize_dynamic-linear-per-channel", "peer-dynamic",
        lambda dst: quantize_dynamic(str(fp32), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                                     op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=linear),
        placement="weight MatMuls, per-channel weights")
    for m in args.methods:
        add(f"edgekit-ptq-linear-{m}", "edgekit",
            lambda dst, m=m: quantize_onnx_file(fp32, dst, calib, names, m, 99.99, "u8s8", placement="linear"),
            calib_method=m)

    ref = run_all(session(fp32, threads=os.cpu_count() or 1), ev)
    results: dict[str, Any] = {}
    for k, path in variants.items():
        out = run_all(session(path, threads=os.cpu_count() or 1), ev)
        ops = engine_ops(path)
        ints = sum(v for op, v in ops.items() if op in INTEGER_OPS)
        mm_int = sum(v for op, v in ops.items() if op in MATMUL_OPS and op in INTEGER_OPS)
        mm_all = sum(v for op, v in ops.items() if op in MATMUL_OPS)
        results[k] = {**info[k], "metrics": metrics_for(out, ref, None, "cosine"),
                      "size_mb": round(path.stat().st_size / 2**20, 3), "integer_nodes": ints,
                      "nodes": sum(ops.values()), "int8_matmuls": mm_int, "matmuls": mm_all, "engine_ops": ops}
        print(f"  {k}: cosine {results[k]['metrics']['mean_cosine']:.4f}", flush=True)
    # batch 1, 1 thread: a padded 95-token row (as the earlier table) and one sentence at its own length
    x = {k: v[:1] for k, v in ev.inputs.items()}
    n_tok = int(x["attention_mask"].sum())
    shapes = {"seq_padded": x, "seq_own": {k: v[:, :n_tok] for k, v in x.items()}}
    lat = {s: time_variants(variants, f, args.rounds, args.iters) for s, f in shapes.items()}
    for s, f in shapes.items():
        peer = lat[s]["ort-quantize_static-minmax"]["p50"] if "ort-quantize_static-minmax" in lat[s] else None
        for k in variants:
            r = results[k].setdefault("latency", {})
            r[s] = {**lat[s][k], "tokens": int(f["input_ids"].shape[1]),
                    "speedup_vs_fp32": lat[s]["fp32"]["p50"] / lat[s][k]["p50"],
                    "speed_vs_peer": peer / lat[s][k]["p50"] if peer else None}
    for k in info:
        if k not in results:
            results[k] = info[k]
    return {"model": name, "calib": {"source": calib.source, "n": len(calib)},
            "eval": {"source": ev.source, "n": len(ev)}, "evaluator": "cosine", "variants": results}


def print_minilm_table(res: dict[str, Any]) -> None:
    lat_keys = ("seq_padded", "seq_own")
    print(f"\n{res['model']}  (eval {res['eval']['n']} x {res['eval']['source']})")
    print(f"{'variant':42s} {'cos mean':>9s} {'cos min':>8s} {'MB':>6s} " +
          " ".join(f"{'p50 ' + s:>14s} {'xFP32':>6s} {'xpeer':>6s}" for s in lat_keys) +
          f" {'int8 mm':>8s} {'int nodes':>10s} {'quant s':>8s}")
    for k, r in res["variants"].items():
        if "metrics" not in r:
            print(f"{k:42s} ERROR {r.get('error')}")
            continue
        m = r["metrics"]
        cols = []
        for s in lat_keys:
            lt = r["latency"][s]
            sp = f"{lt['speed_vs_peer']:.2f}" if lt.get("speed_vs_peer") else "-"
            cols.append(f"{lt['p50']:14.2f} {lt['speedup_vs_fp32']:6.2f} {sp:>6s}")
        print(f"{k:42s} {m['mean_cosine']:9.4f} {m['min_cosine']:8.4f} {r['size_mb']:6.1f} " + " ".join(cols) +
              f" {r['int8_matmuls']:>3d}/{r['matmuls']:<4d} {r['integer_nodes']:>4d}/{r['nodes']:<5d} "
              f"{r.get('quant_seconds', '-')!s:>8s}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="fmnist-cnn,efficientnet-lite0,minilm-l6")
    p.add_argument("--only", choices=["minilm"], default=None,
                   help="minilm: only the MiniLM-L6 part (methods default mse,minmax,percentile,entropy; "
                        "JSON to results/int8_minilm.json)")
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
    p.add_argument("--keep-float", default="first", help="CNNs: also the default PTQ with these layers' weights "
                   "float; ';'-separated variants of ','-separated layers ('first', 'last' or names)")
    p.add_argument("--torchao", action="store_true", help="EfficientNet: also the torchao PT2E peer (if importable)")
    p.add_argument("--batches", default="64,256", help="fmnist models: also time these batch sizes")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int8.json"))
    args = p.parse_args()
    if args.only == "minilm":
        args.models = "minilm-l6"
        if args.out == p.get_default("out"):
            args.out = str(ROOT / "benchmarks" / "results" / "int8_minilm.json")
        if args.methods == p.get_default("methods"):
            args.methods = "mse,minmax,percentile,entropy"
    args.methods = [m for m in args.methods.split(",") if m]
    args.peer_methods = [m for m in args.peer_methods.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.keep_float = [k for k in args.keep_float.split(";") if k]
    out: dict[str, Any] = {"created": now_iso(), "machine": machine_info(), "versions": package_versions(),
                           "settings": {k: v for k, v in vars(args).items() if k != "out"}, "models": []}
    with tempfile.TemporaryDirectory(prefix="edgekit-bench-int8-") as tmp:
        for name in [m for m in args.models.split(",") if m]:
            t0 = time.perf_counter()
            minilm = name == "minilm-l6"
            res = bench_minilm(args, Path(tmp)) if minilm else bench_model(name, args, Path(tmp))
            res["seconds"] = round(time.perf_counter() - t0, 1)
            out["models"].append(res)
            (print_minilm_table if minilm else print_table)(res)
            atomic_write_json(Path(args.out), out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
