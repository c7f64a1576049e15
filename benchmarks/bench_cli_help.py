"""What `edgekit COMMAND --help` costs: CPU seconds (user + system), wall seconds and peak memory
of one process per command, the median of --repeats runs, and which heavy packages it imported.

    python benchmarks/bench_cli_help.py [--repeats 3] [--source DIR] [--cold] [--out results/cli_help.json]
    python benchmarks/bench_cli_help.py --against DIR [--repeats 7] [--out results/cli_help_against.json]

--source: the edgekit source tree to measure (default: this checkout), to compare a commit
before and after. The help cache (``$EDGEKIT_CACHE/cli``) starts empty: the first --help of
a version fills it (its cost is the "first" row); every run after it reads it. With --cold
every run starts with an empty cache of its own: what a command's --help costs when the
cache is missing (the first --help after an install or upgrade, a read-only cache folder).
--against DIR: the tree of another commit, measured interleaved with --source (each run of one
beside the same run of the other, each with its own filled cache), so that a loaded machine's
drift falls on both alike.
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
            ["check"], ["report"], ["run"], ["sweep"], ["zoo"], ["targets", "show"], ["remote", "build"],
            ["remote", "profile"]]
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
    ap.add_argument("--cold", action="store_true", help="every run with an empty help cache of its own")
    ap.add_argument("--against", type=Path, default=None, help="another tree, measured interleaved with --source")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "cli_help.json")
    a = ap.parse_args()
    if a.against is not None:
        against(a.against, a.source, a.repeats, a.out)
        return

    def fresh(args: list[str]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as empty:
            return one(a.source, args, {**os.environ, "EDGEKIT_CACHE": empty})

    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "EDGEKIT_CACHE": cache}
        first = one(a.source, ["compress"], env)  # fills the help cache where there is one
        rows = []
        for args in COMMANDS:
            runs = [fresh(args) if a.cold else one(a.source, args, env) for _ in range(a.repeats)]
            rows.append({"command": " ".join(args), "cpu_s": statistics.median(r["cpu_s"] for r in runs),
                         "wall_s": statistics.median(r["wall_s"] for r in runs),
                         "max_rss_mb": max(r["max_rss_mb"] for r in runs), "heavy": runs[-1]["heavy"]})
    print(f"{'command':<18}{'CPU s':>7}{'wall s':>8}{'RSS MB':>8}  heavy imports")
    for name, r in [("(first compress)", first), *((r["command"], r) for r in rows)]:
        print(f"{name:<18}{r['cpu_s']:>7.2f}{r['wall_s']:>8.2f}{r['max_rss_mb']:>8.0f}  {','.join(r['heavy']) or '-'}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "source": str(a.source),
                                 "repeats": a.repeats, "cold": a.cold, "first_compress_help": first, "rows": rows},
                                indent=2) + "\n")
    print(f"wrote {a.out}")


def against(before: Path, after: Path, repeats: int, out: Path) -> None:
    """``--against``: before and after interleaved, per command the median CPU s of each."""
    sides = {"before": before, "after": after}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as c1, tempfile.TemporaryDirectory() as c2:
        envs = {"before": {**os.environ, "EDGEKIT_CACHE": c1}, "after": {**os.environ, "EDGEKIT_CACHE": c2}}
        for side, source in sides.items():
            one(source, ["compress"], envs[side])  # each side's cache filled first
        for _ in range(repeats):
            for args in COMMANDS:
                for side, source in sides.items():
                    runs.setdefault((" ".join(args), side), []).append(one(source, args, envs[side]))
    rows = [{"command": " ".join(args),
             **{f"{k}_{side}": f(runs[(" ".join(args), side)]) for side in sides for k, f in (
                 ("cpu_s", lambda rs: statistics.median(r["cpu_s"] for r in rs)),
                 ("max_rss_mb", lambda rs: max(r["max_rss_mb"] for r in rs)),
                 ("heavy", lambda rs: rs[-1]["heavy"]))}} for args in COMMANDS]
    print(f"{'command':<18}{'CPU s before':>13}{'after':>7}{'RSS MB before':>15}{'after':>7}  heavy imports after")
    for r in rows:
        print(f"{r['command']:<18}{r['cpu_s_before']:>13.2f}{r['cpu_s_after']:>7.2f}{r['max_rss_mb_before']:>15.0f}"
              f"{r['max_rss_mb_after']:>7.0f}  {','.join(r['heavy_after']) or '-'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "date": time.strftime("%Y-%m-%d"), "before": str(before),
                               "after": str(after), "repeats": repeats, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
