"""Structured pruning + distillation benchmark (issue 5).

Parts (``--parts``, comma-separated; results merge into benchmarks/results/prune.json):

* ``cnn``: the Fashion-MNIST CNN (``fmnist-cnn``) pruned 30% and 50% (L2, uniform);
  test accuracy right after pruning, after plain fine-tuning (hard labels only, alpha 0)
  and after distillation from the unpruned model (T 4, alpha 0.7) for the same epochs,
  learning rate and data; MACs ratio and the measured ONNX Runtime latency ratio
  (engines from ``build_engine``, batch 1, 1 thread, interleaved rounds, medians).
* ``effnet``: EfficientNet-Lite0 pruned 30%: MACs ratio versus measured latency ratio.
* ``llm``: SmolLM2-135M with 20% of MLP channels pruned: Wikipedia perplexity before,
  after pruning, after a few minutes of distillation on Lee news text.
* ``int8``: prune 50% -> distill -> INT8 PTQ: one combined engine, accuracy and latency.

    python benchmarks/bench_prune.py                      # everything (~30 min on 2 cores)
    python benchmarks/bench_prune.py --parts cnn --epochs 2
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "prune.json"
# The int8 step's fake-quant model and its QDQ graph differ by up to a quantization step; its
# record did not loosen the export parity here (0.00057 abs error on logits), so the combined
# engine is built with this tolerance.
INT8_PARITY = {"atol": 5e-3, "rtol": 5e-2}

from edgekit.compress import StepContext, compress  # noqa: E402
from edgekit.compress.distill import DistillConfig, evaluate_pair  # noqa: E402
from edgekit.compress.distill import apply as distill_apply  # noqa: E402
from edgekit.compress.prune import apply as prune_apply  # noqa: E402
from edgekit.compress.prune import count_macs, example_inputs  # noqa: E402
from edgekit.compress.prune_config import PruneConfig  # noqa: E402
from edgekit.loading import load_model  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- latency


def build(handle_or_dir: Any, out: Path, export: dict[str, Any] | None = None) -> Path:
    from edgekit.build import build_engine
    from edgekit.runtimes.base import BuildOptions

    extra = {"export": export} if export else {}
    return build_engine(handle_or_dir, "cpu", out, BuildOptions(threads=1, runtime="onnxruntime", extra=extra))


def interleaved_latency(engines: dict[str, Path], rounds: int = 7, per_round_s: float = 0.6) -> dict[str, dict[str, float]]:
    """Median per-run latency (ms) of each engine at 1 thread: rounds interleave the
    engines so machine noise (the machine is shared) hits them alike."""
    from edgekit.build import load_engine, load_engine_inputs

    loaded = {k: (load_engine(v, threads=1), load_engine_inputs(v, batch=1)) for k, v in engines.items()}
    samples: dict[str, list[float]] = {k: [] for k in engines}
    round_medians: dict[str, list[float]] = {k: [] for k in engines}
    for eng, feeds in loaded.values():
        for _ in range(20):
            eng.run(feeds)
    for _ in range(rounds):
        for k, (eng, feeds) in loaded.items():
            t: list[float] = []
            end = time.perf_counter() + per_round_s
            while time.perf_counter() < end or len(t) < 10:
                t.append(eng.timed_run(feeds))
            samples[k] += t
            round_medians[k].append(float(np.median(t)))
    for eng, _ in loaded.values():
        eng.close()
    return {k: {"p50_ms": float(np.median(round_medians[k])), "p90_ms": float(np.percentile(samples[k], 90)),
                "min_ms": float(np.min(samples[k])), "runs": len(samples[k])} for k in engines}


# ----------------------------------------------------------------------------- CNN


def part_cnn(args: argparse.Namespace) -> dict[str, Any]:
    from edgekit.sources.data import load_samples

    base = load_model("fmnist-cnn")
    train = load_samples("fashion-mnist", base, split="train", limit=args.limit, seed=0)
    ev = load_samples("fashion-mnist", base, split="eval", seed=0)
    log(f"fmnist-cnn: {len(train)} train, {len(ev)} eval samples")
    base_acc = evaluate_pair(base, base, ev, 500)["student_accuracy"]
    rows: dict[str, Any] = {"unpruned": {"accuracy": base_acc, **_macs(base)}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-prune-"))
    engines = {"unpruned": build(base, tmp / "e-base")}
    cfg = dict(epochs=args.epochs, lr=args.lr, batch_size=128, patience=None, seed=0, eval_limit=None)
    for ratio in [float(r) for r in args.ratios.split(",")]:
        key = f"pruned {int(ratio * 100)}%"
        pruned = load_model("fmnist-cnn")
        prune_apply(pruned, PruneConfig(ratio=ratio), StepContext())
        meta = pruned.steps[-1].meta
        acc_pruned = evaluate_pair(base, pruned, ev, 500)["student_accuracy"]
        log(f"{key}: MACs {meta['macs_before']:,} -> {meta['macs_after']:,} ({meta['mac_ratio']}x), "
            f"accuracy {base_acc:.4f} -> {acc_pruned:.4f}")
        engines[key] = build(pruned, tmp / f"e-{int(ratio * 100)}")
        results = {}
        for name, alpha in (("finetune", 0.0), ("distill", 0.7)):
            student = copy.deepcopy(pruned)
            ctx = StepContext(reference=base, train=train, eval=ev, progress=False, seed=0)
            t0 = time.perf_counter()
            distill_apply(student, DistillConfig(alpha=alpha, temperature=4.0, **cfg), ctx)
            m = student.steps[-1].meta
            results[name] = {"accuracy": m["eval"]["student_accuracy"], "seconds": round(time.perf_counter() - t0, 1),
                             "val_history": [e.get("val") for e in m["fit"]["history"]]}
            log(f"{key} + {name} ({args.epochs} epochs): accuracy {results[name]['accuracy']:.4f} "
                f"({results[name]['seconds']} s)")
        rows[key] = {"accuracy_pruned": acc_pruned, "accuracy_finetune": results["finetune"]["accuracy"],
                     "accuracy_distill": results["distill"]["accuracy"], "details": results,
                     "macs": meta["macs_after"], "params": meta["params_after"], "mac_ratio": meta["mac_ratio"],
                     "param_ratio": meta["param_ratio"],
                     "channels": [m_.out_channels for m_ in pruned.module.modules()
                                  if isinstance(m_, torch.nn.Conv2d)]}
    log("timing engines (1 thread, batch 1, interleaved)")
    lat = interleaved_latency(engines)
    for k, v in lat.items():
        rows[k]["latency"] = v
        rows[k]["speedup"] = round(lat["unpruned"]["p50_ms"] / v["p50_ms"], 3)
    return {"model": "fmnist-cnn", "train_samples": len(train), "eval_samples": len(ev), "epochs": args.epochs,
            "lr": args.lr, "rows": rows}


def _macs(handle: Any) -> dict[str, int]:
    m = count_macs(handle.module, example_inputs(handle, 1))
    return {"macs": m["macs"], "params": m["params"]}


# ----------------------------------------------------------------------------- EfficientNet


def part_effnet(args: argparse.Namespace) -> dict[str, Any]:
    base = load_model("efficientnet-lite0")
    tmp = Path(tempfile.mkdtemp(prefix="bench-prune-eff-"))
    engines = {"unpruned": build(base, tmp / "e-base")}
    out: dict[str, Any] = {"unpruned": _macs(base)}
    for ratio, round_to in ((0.3, None), (0.3, 8)):
        key = f"pruned 30%{' round-to 8' if round_to else ''}"
        h = load_model("efficientnet-lite0")
        t0 = time.perf_counter()
        prune_apply(h, PruneConfig(ratio=ratio, round_to=round_to), StepContext())
        meta = h.steps[-1].meta
        ev = evaluate_pair(base, h, _photos(base), 16)
        out[key] = {"macs": meta["macs_after"], "params": meta["params_after"], "mac_ratio": meta["mac_ratio"],
                    "param_ratio": meta["param_ratio"], "top1_agreement_untrained": ev["agreement"],
                    "prune_seconds": round(time.perf_counter() - t0, 1)}
        log(f"effnet {key}: MACs ratio {meta['mac_ratio']}, params ratio {meta['param_ratio']}")
        engines[key] = build(h, tmp / f"e-{len(engines)}")
    lat = interleaved_latency(engines, rounds=5, per_round_s=1.5)
    for k, v in lat.items():
        out[k]["latency"] = v
        out[k]["speedup"] = round(lat["unpruned"]["p50_ms"] / v["p50_ms"], 3)
    return out


def _photos(handle: Any) -> Any:
    from edgekit.sources.assets import sample_photos
    from edgekit.sources.data import Samples

    return Samples(source="photos", split="eval", inputs=handle.prepare(sample_photos()))


# ----------------------------------------------------------------------------- SmolLM2


def part_llm(args: argparse.Namespace) -> dict[str, Any]:
    from edgekit.sources.data import load_samples

    base = load_model("smollm2-135m")
    ev = load_samples("wikipedia", base, split="eval", limit=args.llm_eval_windows, seqlen=256, seed=0)
    train = load_samples("lee-news", base, split="train", seqlen=128, seed=0)
    log(f"smollm2: {len(ev)} eval windows (wikipedia, 256 tokens), {len(train)} train windows (lee-news, 128)")
    student = copy.deepcopy(base)
    t0 = time.perf_counter()
    prune_apply(student, PruneConfig(ratio=0.2, scope="mlp"), StepContext())
    meta = student.steps[-1].meta
    prune_s = time.perf_counter() - t0
    before = evaluate_pair(base, student, ev, 4)
    log(f"smollm2 20% MLP: params {meta['params_before']:,} -> {meta['params_after']:,}; "
        f"ppl {before['teacher_ppl']} -> {before['student_ppl']}")
    # a few minutes of distillation: cap the optimizer steps by a measured time budget
    steps = max(1, int(args.llm_steps))
    ctx = StepContext(reference=base, train=train, eval=ev, progress=False, seed=0)
    t0 = time.perf_counter()
    distill_apply(student, DistillConfig(alpha=0.7, temperature=2.0, epochs=8, lr=1e-4, batch_size=4,
                                         max_steps=steps, patience=None, seqlen=128, eval_limit=None), ctx)
    kd_s = time.perf_counter() - t0
    after = student.steps[-1].meta["eval"]
    steps = student.steps[-1].meta["fit"]["steps"]
    log(f"smollm2 after {steps} distillation steps ({kd_s:.0f} s incl. eval): ppl {after['student_ppl']}")
    return {"eval": f"wikipedia, {len(ev)} windows of 256 tokens", "train": "lee-news, 128-token windows",
            "params_before": meta["params_before"], "params_after": meta["params_after"],
            "mac_ratio": meta["mac_ratio"], "intermediate_size": student.module.model.config.intermediate_size,
            "ppl_unpruned": before["teacher_ppl"], "ppl_pruned": before["student_ppl"],
            "ppl_distilled": after["student_ppl"], "distill_steps": steps, "distill_seconds": round(kd_s, 1),
            "prune_seconds": round(prune_s, 1)}


# ----------------------------------------------------------------------------- prune -> distill -> int8


def part_int8(args: argparse.Namespace) -> dict[str, Any]:
    from edgekit.sources.data import load_samples

    base = load_model("fmnist-cnn")
    train = load_samples("fashion-mnist", base, split="train", limit=args.limit, seed=0)
    ev = load_samples("fashion-mnist", base, split="eval", seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-prune-int8-"))
    ctx = StepContext(reference=base, train=train, eval=ev, progress=False, seed=0, calib="fashion-mnist")
    steps = [("prune", PruneConfig(ratio=0.5)),
             ("distill", DistillConfig(epochs=args.epochs, lr=args.lr, batch_size=128, patience=None,
                                       eval_limit=None)),
             ("int8", {"method": "ptq"})]
    floating = compress("fmnist-cnn", steps[:2], tmp / "pruned-distilled", ctx)  # prune -> distill
    folder = compress(floating, steps[2:], tmp / "int8", StepContext(calib="fashion-mnist", seed=0,
                                                                     progress=False))  # -> int8
    engines = {"unpruned fp32": build(base, tmp / "e-base"),
               "pruned 50% + distill fp32": build(floating, tmp / "e-float"),
               "pruned 50% + distill + int8": build(folder, tmp / "e-int8", INT8_PARITY)}
    accs = {k: _engine_accuracy(v, ev) for k, v in engines.items()}
    lat = interleaved_latency(engines)
    out = {}
    for k in engines:
        out[k] = {"accuracy": accs[k], "latency": lat[k],
                  "speedup": round(lat["unpruned fp32"]["p50_ms"] / lat[k]["p50_ms"], 3)}
        log(f"{k}: accuracy {accs[k]:.4f}, p50 {lat[k]['p50_ms']:.4f} ms ({out[k]['speedup']}x)")
    return out


def _engine_accuracy(engine_dir: Path, ev: Any) -> float:
    from edgekit.build import load_engine

    eng = load_engine(engine_dir, threads=1)
    right = 0
    x = ev.inputs["input"]
    for i in range(0, len(x), 256):
        logits = eng.run({eng.inputs[0].name: x[i:i + 256]})[0]
        right += int((logits.argmax(-1) == ev.labels[i:i + 256]).sum())
    eng.close()
    return right / len(x)


# ----------------------------------------------------------------------------- main


def table(results: dict[str, Any]) -> str:
    lines = []
    for key in [k for k in results if k.startswith("cnn")]:
        r = results[key]
        lines += [f"Fashion-MNIST CNN ({r['train_samples']} train samples, {r['epochs']} epochs, eval {r['eval_samples']})",
                  "| variant | MACs | ratio | p50 ms | speedup | acc pruned | acc fine-tune | acc distill |",
                  "|---|---|---|---|---|---|---|---|"]
        for k, v in r["rows"].items():
            if k == "unpruned":
                lines.append(f"| {k} | {v['macs']:,} | 1.00x | {v['latency']['p50_ms']:.4f} | 1.00x | "
                             f"{v['accuracy']:.4f} | | |")
            else:
                lines.append(f"| {k} | {v['macs']:,} | {v['mac_ratio']:.2f}x | {v['latency']['p50_ms']:.4f} | "
                             f"{v['speedup']:.2f}x | {v['accuracy_pruned']:.4f} | {v['accuracy_finetune']:.4f} | "
                             f"{v['accuracy_distill']:.4f} |")
    if "effnet" in results:
        lines += ["", "EfficientNet-Lite0", "| variant | MACs | MAC ratio | p50 ms | speedup |", "|---|---|---|---|---|"]
        for k, v in results["effnet"].items():
            lines.append(f"| {k} | {v['macs']:,} | {v.get('mac_ratio', 1.0):.2f}x | {v['latency']['p50_ms']:.3f} | "
                         f"{v['speedup']:.2f}x |")
    if "llm" in results:
        v = results["llm"]
        lines += ["", f"SmolLM2-135M, 20% MLP channels ({v['eval']})",
                  f"ppl unpruned {v['ppl_unpruned']}, pruned {v['ppl_pruned']}, after {v['distill_steps']} "
                  f"distillation steps ({v['distill_seconds']} s) {v['ppl_distilled']}"]
    if "int8" in results:
        lines += ["", "prune 50% -> distill -> int8", "| engine | accuracy | p50 ms | speedup |", "|---|---|---|---|"]
        for k, v in results["int8"].items():
            lines.append(f"| {k} | {v['accuracy']:.4f} | {v['latency']['p50_ms']:.4f} | {v['speedup']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="cnn,effnet,llm,int8")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ratios", default="0.3,0.5", help="CNN pruning ratios")
    ap.add_argument("--suffix", default="", help="store the part's results under NAME+SUFFIX")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--limit", type=int, default=30000, help="training samples for the CNN")
    ap.add_argument("--llm-steps", type=int, default=40)
    ap.add_argument("--llm-eval-windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (the machine is shared)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    parts = {"cnn": part_cnn, "effnet": part_effnet, "llm": part_llm, "int8": part_int8}
    for name in args.parts.split(","):
        log(f"--- {name}")
        t0 = time.perf_counter()
        part = parts[name](args)
        results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}  # other parts may have landed
        results[name + args.suffix] = part
        results.setdefault("seconds", {})[name + args.suffix] = round(time.perf_counter() - t0, 1)
        results["meta"] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                           "note": "shared 2-core machine; latency = median of interleaved rounds, 1 thread, batch 1"}
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        from edgekit.artifact import atomic_write_json

        atomic_write_json(RESULTS, results)
    print(table(results))


if __name__ == "__main__":
    main()
