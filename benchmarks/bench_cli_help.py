"""What `edgekit COMMAND --help` costs: CPU seconds (user + system), wall seconds and peak memory
of one process per command, the median of --repeats runs, and which heavy packages it imported.

    python benchmarks/bench_cli_help.py [--repeats 3] [--source DIR] [--out results/cli_help.json]

--source: the edgekit source tree to measure (default: this checkout), to compare a commit
before and after. The help cache (``$EDGEKIT_CACHE/cli``) starts empty: the first --help of
a version fills it (its cost is the "first" row); every run after it reads it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine  # noqa: E402

COMMANDS = [["compress"], ["distill"], ["finetune"], ["export"], ["build"], ["profile"], ["estimate"], ["lint"],
            ["check"], ["report"], ["run"], ["sweep"], ["zoo"], ["targets", "show"], ["remote", "build"]]
PROBE = ("import sys, runpy; sys.argv = ['edgekit', *sys.argv[1:]]\n"
         "try:\n    runpy.run_module('edgekit.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
         "print('HEAVY=' + ','.join(m for m in ('torch', 'onnx', 'onnxruntime') if m in sys.modules), file=sys.stderr)\n"
         "print('FROM=' + sys.modules['edgekit'].__file__, file=sys.stderr)")


def one(source: Path, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """One process: /usr/bin/time's user and system CPU seconds and peak RSS, and the wall time."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "TIME=%U %S %M", sys.executable, "-c", PROBE, *args, "--help"],
                       env={**env, "PYTHONPATH": str(source)}, cwd=source, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    lines = r.stderr.strip().splitlines()
    user, system, rss_kb = lines[-1].removeprefix("TIME=").split()
    heavy = next(line for line in lines if line.startswith("HEAVY=")).removeprefix("HEAVY=")
    origin = next(line for line in lines if line.startswith("FROM=")).removeprefix("FROM=")
    if not origin.startswith(str(source.resolve())):
        raise SystemExit(f"edgekit came from {origin}, not from {source}")
    return {"cpu_s": float(user) + float(system), "wall_s": wall, "max_rss_mb": int(rss_kb) / 1024,
            "heavy": heavy.split(",") if heavy else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cli_help.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "EDGEKIT_CACHE": cache}
        first = one(a.source, ["compress"], env)  # fills the help cache where there is one
        rows = []
        for args in COMMANDS:
            runs = [one(a.source, args, env) for _ in range(a.repeats)]
            rows.append({"command": " ".join(args), "cpu_s": statistics.median(r["cpu_s"] for r in runs),
                         "wall_s": statistics.median(r["wall_s"] for r in runs),
                         "max_rss_mb": max(r["max_rss_mb"] for r in runs), "heavy": runs[-1]["heavy"]})
    print(f"{'command':<18}{'CPU s':>7}{'wall s':>8}{'RSS MB':>8}  heavy imports")
    for name, r in [("(first compress)", first), *((r["command"], r) for r in rows)]:
        print(f"{name:<18}{r['cpu_s']:>7.2f}{r['wall_s']:>8.2f}{r['max_rss_mb']:>8.0f}  {','.join(r['heavy']) or '-'}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "source": str(a.source),
                                 "repeats": a.repeats, "first_compress_help": first, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
