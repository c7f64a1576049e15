"""Benchmark: mixed precision under a size budget (`edgekit compress smollm2-135m --bits 4 --avg-bits B`),
the size / perplexity trade-off as a sweep of budgets.

Each budget runs ``edgekit.compress.compress`` in its own process: the weight-only step scores every group of
linears (q/k/v, o, gate/up, down) by its Fisher-weighted rounding cost on the Lee-news calibration
windows, keeps the costliest per byte at 8 bits within the budget, and the quality gate measures the
result against the float model on ``--eval-windows`` 512-token Wikipedia eval windows (test data: no
setting was chosen on them; the float reference is measured once and shared, as in
``bench_gptq_time.py``). The process's CPU time (``time.process_time``), wall time and load are recorded.

    python benchmarks/bench_mixed.py                                  # RTN at every budget
    python benchmarks/bench_mixed.py --method gptq-plus --budgets 4.3,5.0 --calib-samples 32

Results: benchmarks/results/mixed/<method>-<budget>.json, and the table of those present.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
PARTS = ROOT / "benchmarks" / "results" / "mixed"
BUDGETS = "4,4.5,5,5.5,6,7,8"  # average bits per weight; 4: every group at 4 bits, 8: every group at 8 bits


def run_budget(budget: float, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from bench_gptq_time import _reference
    from machine_info import machine

    from edgekit.compress import StepContext, compress
    from edgekit.compress.weight_only.config import WeightOnlyConfig

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    reference = _reference(args, work)
    extra: dict[str, Any] = {"method": args.method, "calib_samples": args.calib_samples,
                             "eval_windows": 0}  # the quality gate below measures perplexity
    if budget >= 8:
        config = WeightOnlyConfig(bits=8, **extra)
    elif budget <= 4:
        config = WeightOnlyConfig(**extra)
    else:
        config = WeightOnlyConfig(avg_bits=budget, **extra)
    ctx = StepContext(progress=False, quality_windows=args.eval_windows, quality_reference=reference,
                      accept_quality_loss=True)
    out = work / f"mixed-{args.method}-{budget:g}"
    load0 = os.getloadavg()
    w0, c0 = time.perf_counter(), time.process_time()
    compress("smollm2-135m", [("weight-only", config)], out, ctx)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    man = json.loads((out / "manifest.json").read_text())
    meta = man["steps"][-1]["meta"]
    mixed = meta.get("mixed")
    layers = meta["layers"]
    weights = sum(v["in"] * v["out"] for v in layers.values())
    avg = mixed["avg_bits"] if mixed else (8 if budget >= 8 else None)
    if avg is None:  # every group at the low width: its stored bits per weight, as mixed precision counts them
        from edgekit.compress.weight_only.mixed import layer_bytes

        avg = round(8 * sum(layer_bytes(v["out"], v["in"], v["bits"], v["group_size"], v["bias"])
                            for v in layers.values()) / weights, 4)
    return {"method": args.method, "budget_bits": budget, "avg_bits": avg,
            "high_units": mixed["high_units"] if mixed else None, "units_total": mixed["units_total"] if mixed else None,
            "high": [u["names"] for u in mixed["units"] if u["bits"] == 8] if mixed else None,
            "packed_bytes": meta["packed_bytes"], "quality": man["metrics"]["quality"],
            "cpu_s": round(cpu, 1), "wall_s": round(wall, 1), "threads": torch.get_num_threads(),
            "calib_samples": args.calib_samples, "load_before": round(load0[0], 2),
            "load_after": round(os.getloadavg()[0], 2), "machine": machine(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _short(names: list[list[str]]) -> str:
    """``model.layers.3.self_attn.v_proj`` groups as ``3.qkv``, ``3.o``, ``3.gate_up``, ``3.down``."""
    out = []
    for group in names:
        parts = group[0].split(".")
        layer = next((p for p in parts if p.isdigit()), "?")
        kind = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                "up_proj": "gate_up", "down_proj": "down"}.get(parts[-1], parts[-1])
        out.append(f"{layer}.{kind}")
    return ", ".join(out)


def table() -> list[dict[str, Any]]:
    rows = [json.loads(p.read_text()) for p in sorted(PARTS.glob("*.json"))]
    rows.sort(key=lambda r: (r["method"], r["avg_bits"]))
    print("| method | budget (bits/weight) | stored bits/weight | groups at 8 bits | packed MB | PPL | PPL / float | "
          "top-1 agreement | CPU s | 8-bit groups |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = r["quality"]
        high = f"{r['high_units']} / {r['units_total']}" if r["high_units"] is not None else "-"
        print(f"| {r['method']} | {r['budget_bits']:g} | {r['avg_bits']:.2f} | {high} | {r['packed_bytes'] / 1e6:.1f} | "
              f"{q['perplexity']:.3f} | {q['perplexity_ratio']:.4f} | {q['agreement']:.4f} | {r['cpu_s']:.0f} | "
              f"{_short(r['high']) if r['high'] else ''} |")
    (ROOT / "benchmarks" / "results" / "mixed.json").write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default=BUDGETS, help="average bits per weight (4: all 4-bit, 8: all 8-bit)")
    ap.add_argument("--method", default="rtn", choices=["rtn", "gptq-plus", "gptq", "awq"])
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--work", default=None, help="folder for the models and the float reference")
    ap.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # the child process: one budget
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.work is None:
        from edgekit.artifact import cache_dir

        args.work = str(cache_dir() / "bench-gptq-time")  # shares the float reference with bench_gptq_time.py
    Path(args.work).mkdir(parents=True, exist_ok=True)
    PARTS.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        part = run_budget(args.one, args)
        (PARTS / f"{args.method}-{args.one:g}.json").write_text(json.dumps(part, indent=1))
        q = part["quality"]
        print(f"{args.method} {args.one:g}: {part['avg_bits']:.2f} bits/weight, ppl {q['perplexity']:.3f} "
              f"(float {q['perplexity_float']:.3f}), {part['cpu_s']} CPU s", flush=True)
        return
    if not args.table_only:
        for b in args.budgets.split(","):
            subprocess.run([sys.executable, __file__, "--one", b, "--method", args.method, "--calib-samples",
                            str(args.calib_samples), "--threads", str(args.threads), "--eval-windows",
                            str(args.eval_windows), "--work", args.work], check=True)
    table()


if __name__ == "__main__":
    main()
