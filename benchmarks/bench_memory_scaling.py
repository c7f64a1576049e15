"""Benchmark: time and peak memory of `edgekit compress --bits 4` and `edgekit export --kv-cache`
against parameter count, on random-weight models of the shapes users ship (0.5B-3B).

Models are built offline from their published configurations (no hub): Qwen2.5-0.5B, Llama-3.2-1B and
Llama-3.2-3B shapes (hidden size, layers, heads, key/value heads, MLP width, vocabulary, tied
embeddings), random weights stored in bfloat16 as Hugging Face folders with a byte-level tokenizer
(the weights are random, so only time and memory mean anything: perplexity is near the vocabulary
size). Each command runs as its own process (``nice -n 5``): compress as ``compress()`` (what ``edgekit
compress`` runs; ``--quality-windows`` eval windows for its quality gate, 8 like the CLI by default),
export as ``edgekit export --kv-cache`` of the RTN model; its peak resident memory (``ru_maxrss``, which
counts the memory-mapped weights' resident pages too) and CPU time come from the kernel when it ends
(``os.wait4``), beside wall time and the load average. "x bf16" = peak / (parameters x 2 bytes).
``--code TREE --label=-before`` measures another edgekit tree (an older commit unpacked with ``git
archive``) for a before/after. Memory-heavy: run nothing else big beside it (3B: ~7 GB).

    python benchmarks/bench_memory_scaling.py --models qwen2.5-0.5b,llama-3.2-1b --steps rtn,export,gptq
    python benchmarks/bench_memory_scaling.py --table-only        # table and plot of the parts present

Results: benchmarks/results/memory_scaling/<model>-<step>.json, the table, and
benchmarks/results/memory_scaling.png (time and peak memory against parameters).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PARTS = ROOT / "benchmarks" / "results" / "memory_scaling"

# published shapes (config.json of each model on its hub page), random weights here
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "llama-3.2-1b": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "llama-3.2-3b": dict(family="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=131072,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
}
STEPS = ("load", "rtn", "export", "gptq")  # "gptq": the default GPTQ method (gptq-plus)


def build_model(name: str, folder: Path) -> None:
    """The random-weight bfloat16 model of ``name``'s shape as a Hugging Face folder (in a child process)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_models import byte_tokenizer

    shape = dict(SHAPES[name])
    family = shape.pop("family")
    config = AutoConfig.for_model(family, **shape, bos_token_id=257, eos_token_id=258, pad_token_id=256)
    config.architectures = ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"]
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="2GB")
    tok = byte_tokenizer()
    tok.model_max_length = 4096
    tok.save_pretrained(tmp)
    tmp.rename(folder)


def sample_rss(pid: int, samples: list[tuple[float, int, int]], t0: float, period: float = 0.2) -> None:
    """Append (seconds, anonymous MiB, file-backed MiB) of process ``pid`` every ``period`` s until it ends:
    where in a command its peak is, and whether it is heap or memory-mapped weights."""
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f)
                       if k in ("RssAnon", "RssFile")}
        except (OSError, ValueError):
            return
        if len(kib) < 2:
            return
        samples.append((round(time.perf_counter() - t0, 1), kib["RssAnon"] // 1024, kib["RssFile"] // 1024))
        time.sleep(period)


def measure(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: str | None = None) -> dict[str, Any]:
    """Run ``cmd`` (niced); its own peak RSS and CPU time (``os.wait4``), wall time, load average, and its
    RSS (heap and file-backed apart) sampled every 0.2 s: the samples at the peak, and a timeline."""
    import threading

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    samples: list[tuple[float, int, int]] = []
    with open(log, "w") as f:
        proc = subprocess.Popen(["nice", "-n", "5", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        sampler = threading.Thread(target=sample_rss, args=(proc.pid, samples, t0), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
    sampler.join(timeout=1)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}); see {log}")
    top = max(samples, key=lambda s: s[1] + s[2], default=(0.0, 0, 0))
    every = max(1, len(samples) // 200)  # a timeline of ~200 points
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
            "wall_s": round(wall, 1), "load_before": round(load0[0], 2), "load_after": round(os.getloadavg()[0], 2),
            "sampled_peak": {"at_s": top[0], "anon_mib": top[1], "file_mib": top[2]},
            "rss_timeline": samples[::every], "t0": t0}


def parameters(folder: Path) -> int:
    """Parameters stored in the folder's safetensors files (tied tables once: they are stored once)."""
    import math

    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())  # noqa: SIM118
    return total


def run_step(name: str, step: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    folder = work / name
    code_root = str(Path(args.code).resolve()) if args.code else str(ROOT)  # the edgekit tree to measure
    env = {**os.environ, "PYTHONPATH": code_root, "HF_HUB_OFFLINE": "1"}
    # `python -c` puts its working directory first on sys.path: run in the tree measured, or a run from this
    # repository's root would import this tree's edgekit whatever --code says
    out = work / f"{name}-{step}{args.label}"
    log = work / f"{name}-{step}{args.label}.log"
    shutil.rmtree(out, ignore_errors=True)
    if step == "load":
        code = ("from edgekit.sources.models import load_model; "
                f"h = load_model({str(folder)!r}, half_storage=True); print(sum(p.numel() for p in h.module.parameters()))")
        rec = measure([sys.executable, "-c", code], log, env, cwd=code_root)
    elif step in ("rtn", "gptq"):
        # what `edgekit compress FOLDER --bits 4 --method M` runs (compress()), with the quality gate on
        # --quality-windows eval windows (the CLI's 8 by default): the gate holds one window's logits
        # at a time, so the window count changes the time, not the peak
        cfg = {"method": {"gptq": "gptq-plus"}.get(step, step), "bits": 4,
               **({"calib_samples": args.calib_samples} if step == "gptq" else {})}
        code = ("import sys, time; from edgekit.compress import StepContext, compress; "
                # the phases' ends on the monotonic clock the sampler uses (the float reference, the comparison)
                f"{PHASE_MARKS}; "
                f"compress({str(folder)!r}, [('weight-only', {cfg!r})], {str(out)!r}, StepContext(progress=False, "
                f"accept_quality_loss=True, quality_windows={args.quality_windows}))")
        rec = measure([sys.executable, "-c", code], log, env, cwd=code_root)
        rec["phases_end_s"] = phase_ends(log, rec.pop("t0"))
        man = json.loads((out / "manifest.json").read_text())
        meta = man["steps"][-1]["meta"]
        rec.update({"quant_cpu_s": meta.get("cpu_seconds"), "quant_wall_s": meta.get("seconds"),
                    "calib_windows": meta.get("calib_windows"), "packed_bytes": meta.get("packed_bytes"),
                    "quality": man["metrics"].get("quality")})
    elif step == "export":
        src = work / f"{name}-rtn{args.label}"
        # `edgekit -q export SRC --kv-cache -o OUT`, with the ends of its phases marked (EXPORT_MARKS)
        code = (f"import sys, time; import edgekit.export.lm; from edgekit.cli import main; {EXPORT_MARKS}; "
                f"sys.argv = ['edgekit', '-q', 'export', {str(src)!r}, '--kv-cache', '-o', {str(out)!r}]; main()")
        rec = measure([sys.executable, "-c", code], log, env, cwd=code_root)
        rec["phases_end_s"] = phase_ends(log, rec.pop("t0"))
        rec["onnx_bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx"))
    else:
        raise SystemExit(f"unknown step {step!r} (choose from {', '.join(STEPS)})")
    return rec


# wraps compress()'s two quality-gate functions (in edgekit.compress.quality, where compress() looks them up) to
# print when each returned (time.perf_counter: CLOCK_MONOTONIC, the same clock in every process), so the
# sampled peak can be placed in a phase
PHASE_MARKS = ("import edgekit.compress.quality; m = sys.modules['edgekit.compress.quality']; "
               "mark = lambda f, n: (lambda *a: (r := f(*a), print('phase', n, time.perf_counter(), flush=True))[0]); "
               "m.measure_reference = mark(m.measure_reference, 'reference'); m.compare = mark(m.compare, 'steps')")


# the fused-graph export's phases: the graph built, the file written, PyTorch's parity logits (a tree
# before them has no lm_references), parity against PyTorch, against float
EXPORT_MARKS = ("m = sys.modules['edgekit.export.lm']; "
                "mark = lambda f, n: (lambda *a, **k: (r := f(*a, **k), print('phase', n, time.perf_counter(), "
                "flush=True))[0]); "
                "m.fused_decoder_parts = mark(m.fused_decoder_parts, 'graph'); "
                "m.verify_onnx_runs = mark(m.verify_onnx_runs, 'written'); "
                "hasattr(m, 'lm_references') and setattr(m, 'lm_references', mark(m.lm_references, 'references')); "
                "m.check_lm_parity = mark(m.check_lm_parity, 'parity'); "
                "m.check_against_float = mark(m.check_against_float, 'parity_float')")


def phase_ends(log: Path, t0: float) -> dict[str, float]:
    """Seconds after the command's start at which each marked phase ended (``PHASE_MARKS``)."""
    out: dict[str, float] = {}
    for line in log.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "phase":
            key = parts[1] if parts[1] not in out else f"{parts[1]}_2"  # parity runs twice (fp32 twin, int8)
            out[key] = round(float(parts[2]) - t0, 1)
    return out


def versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "transformers", "onnx", "onnxruntime", "safetensors")}


def block_mib(name: str) -> float:
    """One decoder layer's weights in float32 (MiB): what the block walk holds cast up at a time."""
    c = SHAPES[name]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attn = c["hidden_size"] * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    return (attn + 3 * c["hidden_size"] * c["intermediate_size"]) * 4 / 2**20


def goal_mib(r: dict[str, Any]) -> float:
    """Issue 30's bound: 1.5x the bf16 model plus one block."""
    return 1.5 * r["parameters"] * 2 / 2**20 + block_mib(r["model"])


def table() -> None:
    rows = [json.loads(p.read_text()) for p in sorted(PARTS.glob("*.json"))]
    rows.sort(key=lambda r: (r["parameters"], STEPS.index(r["step"]), r.get("label", "after") != "before"))
    print("| model | parameters | bf16 MiB | step | code | peak MiB | x bf16 | goal MiB (1.5x + block) | CPU s | wall s "
          "| load | notes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bf16 = r["parameters"] * 2 / 2**20
        note = f"{r['calib_windows']} calibration windows" if r.get("calib_windows") else ""
        if r.get("quality_windows"):
            note += f"quality gate on {r['quality_windows']} windows"
        print(f"| {r['model']} | {r['parameters'] / 1e9:.2f}B | {bf16:,.0f} | {r['step']} | {r.get('label', 'after')} | "
              f"{r['peak_rss_mib']:,} | {r['peak_rss_mib'] / bf16:.2f} | {goal_mib(r):,.0f} | {r['cpu_s']} | "
              f"{r['wall_s']} | {r['load_before']}-{r['load_after']} | {note} |")
    plot([r for r in rows if r.get("label", "after") == "after"])


def plot(rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for step in STEPS:
        pts = sorted((r["parameters"] / 1e9, r["peak_rss_mib"] / 1024, r["cpu_s"]) for r in rows if r["step"] == step)
        if not pts:
            continue
        a1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=step)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=step)
    goals = sorted({(r["parameters"] / 1e9, goal_mib(r) / 1024) for r in rows})
    a1.plot([g[0] for g in goals], [g[1] for g in goals], "k--", label="goal: 1.5x bf16 + one block")
    a1.set(xlabel="parameters (billions)", ylabel="peak RSS (GiB)", title="peak memory per command")
    a2.set(xlabel="parameters (billions)", ylabel="CPU s", title="CPU time per command", yscale="log")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    out = ROOT / "benchmarks" / "results" / "memory_scaling.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--steps", default="load,rtn,export")
    ap.add_argument("--calib-samples", type=int, default=8, help="GPTQ calibration windows (time grows with them)")
    ap.add_argument("--work", default=None, help="folder for the models and outputs (bf16 weights: 1-7 GB each)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--build-one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--quality-windows", type=int, default=8, help="eval windows of compress's quality gate")
    ap.add_argument("--code", default=None, help="measure the edgekit tree at this path instead (e.g. an older "
                    "commit unpacked with git archive, for a before/after)")
    ap.add_argument("--label", default="", help="suffix of the result files and outputs (e.g. -before)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.work is None:
        from edgekit.artifact import cache_dir

        args.work = str(cache_dir() / "bench-memory-scaling")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.build_one:
        build_model(args.build_one, work / args.build_one)
        return
    PARTS.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        from machine_info import machine

        for name in args.models.split(","):
            if name not in SHAPES:
                raise SystemExit(f"unknown model {name!r} (choose from {', '.join(SHAPES)})")
            if not (work / name).is_dir():
                print(f"building {name} ...", flush=True)
                rec = measure([sys.executable, __file__, "--build-one", name, "--work", str(work)],
                              work / f"{name}-build.log")
                print(f"built {name}: {rec}", flush=True)
            if args.build_only:
                continue
            n = parameters(work / name)
            for step in args.steps.split(","):
                rec = run_step(name, step, args, work)
                rec.pop("t0", None)
                rec.update({"model": name, "step": step, "parameters": n, "machine": machine(), "versions": versions(),
                            "label": args.label.lstrip("-") or "after", "code": args.code or "this tree",
                            "quality_windows": args.quality_windows if step in ("rtn", "gptq") else None,
                            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
                (PARTS / f"{name}-{step}{args.label}.json").write_text(json.dumps(rec, indent=1, default=str))
                print(f"{name} {step}: peak {rec['peak_rss_mib']} MiB ({rec['peak_rss_mib'] / (n * 2 / 2**20):.2f}x bf16), "
                      f"CPU {rec['cpu_s']} s, wall {rec['wall_s']} s", flush=True)
    table()


if __name__ == "__main__":
    main()
