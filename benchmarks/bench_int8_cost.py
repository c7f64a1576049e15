"""What ``edgekit compress MODEL --bits 8`` costs against OpenVINO + NNCF on the same images (issue 26, item 7).

Runs, interleaved over ``--rounds``, each in its own process: edgekit's whole command (quality gate
included) and NNCF's default post-training quantization of the FP32 ONNX graph (``bench_cpu_engines``'s
NNCF call, same calibration images); with ``--baseline DIR``, the same edgekit command from another
checkout of edgekit (``PYTHONPATH=DIR``) as a third variant, for a before/after. Per run: user + system
CPU seconds, wall seconds and peak RSS (``/usr/bin/time``), and for edgekit the phases of
``metrics.int8.seconds``: the quantization proper (``load_data``, ``equalize``, ``calibrate``,
``gptq_rounding``, ``bias_correction``), which item 7 compares with NNCF's whole run, and the gate. The
engine's top-1 agreement and KL on the eval split are printed as the command reports them (nothing is
chosen on them).

    python benchmarks/bench_int8_cost.py [--model efficientnet-lite0] [--rounds 3] [--calib-samples 128]
        [--baseline DIR] [--out benchmarks/results/int8_cost.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("EDGEKIT_PROGRESS", "0")

from bench_cpu_engines import CALIB_DATA, PREPROCESS, lscpu_flags, model_source, run_child  # noqa: E402

from edgekit.artifact import atomic_write_json, machine_info, now_iso, package_versions, read_manifest  # noqa: E402

PROPER = ("load_data", "equalize", "calibrate", "gptq_rounding", "bias_correction")


def edgekit_run(model: str, out: Path, calib_samples: int, code: Path | None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "edgekit.cli", "compress", model_source(model), "--bits", "8", "-o", str(out),
            "--calib-samples", str(calib_samples)]
    calib, preprocess = CALIB_DATA[model], PREPROCESS[model]
    if calib:
        argv += ["--calib", calib]
    if preprocess:
        argv += ["--preprocess", preprocess]
    # another checkout: its folder first on the path (``-m`` puts the working folder before PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": str(code)} if code is not None else None
    row: dict[str, Any] = vars(run_child(argv, env=env, cwd=code))
    metrics = read_manifest(out).metrics.get("int8", {})
    phases = metrics.get("seconds", {})
    row["phases_cpu_s"] = {k: v["cpu"] for k, v in phases.items()}
    row["proper_cpu_s"] = round(sum(phases[k]["cpu"] for k in PROPER if k in phases), 2)
    row["gate_cpu_s"] = round(sum(v["cpu"] for k, v in phases.items() if k not in PROPER), 2)
    engine = metrics.get("int8_engine", {})
    row["engine"] = {k: engine[k] for k in ("top1_agreement", "mean_kl", "accuracy") if k in engine}
    return row


def nncf_run(model: str, fp32: Path, dst: Path, calib_samples: int) -> dict[str, Any]:
    return vars(run_child([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_engines.py"), "--child", "nncf",
                           model, str(fp32), str(dst), "--calib-samples", str(calib_samples)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="efficientnet-lite0", choices=sorted(CALIB_DATA))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--baseline", type=Path, help="another checkout of edgekit, run as a second edgekit variant")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "int8_cost.json"))
    args = ap.parse_args()
    if args.baseline is not None and not (args.baseline / "edgekit" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: not a checkout of edgekit (no edgekit/__init__.py)")
    from bench_cpu_engines import open_nsfw_path

    from edgekit.export.onnx import ExportConfig, export_onnx
    from edgekit.sources.models import load_model

    variants = ["edgekit"] + (["edgekit baseline"] if args.baseline else []) + ["nncf"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-int8-cost-") as tmp:
        work = Path(tmp)
        if args.model == "open_nsfw":
            fp32 = open_nsfw_path()
        else:
            export_onnx(load_model(args.model), work / "fp32", ExportConfig(skip_parity=True))
            fp32 = work / "fp32" / "model.onnx"
        for r in range(args.rounds):
            for v in variants:
                dst = work / f"{v.replace(' ', '-')}-{r}"
                if v == "nncf":
                    dst.mkdir()
                    row = nncf_run(args.model, fp32, dst / "model.xml", args.calib_samples)
                else:
                    row = edgekit_run(args.model, dst, args.calib_samples, args.baseline if v != "edgekit" else None)
                runs[v].append(row)
                print(f"round {r + 1} {v}: {row}", flush=True)

    def median(v: str, key: str) -> float:
        return round(statistics.median(run[key] for run in runs[v]), 2)

    nncf_cpu = median("nncf", "cpu_s")
    print(f"\n{args.model}, {args.calib_samples} calibration images, medians of {args.rounds} interleaved rounds\n")
    print("| variant | CPU s (whole run) | wall s | peak RSS MB | quantization proper CPU s | x NNCF CPU |\n"
          "|---|---|---|---|---|---|")
    for v in variants:
        proper = median(v, "proper_cpu_s") if v != "nncf" else median(v, "cpu_s")
        print(f"| {v} | {median(v, 'cpu_s')} | {median(v, 'wall_s')} | {median(v, 'peak_rss_mb'):,.0f} | "
              f"{proper if v != 'nncf' else '-'} | {proper / nncf_cpu:.2f}x |")
    atomic_write_json(Path(args.out), {
        "date": now_iso(), "machine": {**machine_info(), "flags": lscpu_flags(), "loadavg": os.getloadavg()},
        "versions": package_versions(),
        "settings": {"model": args.model, "rounds": args.rounds, "calib_samples": args.calib_samples,
                     "baseline": str(args.baseline) if args.baseline else None},
        "runs": runs, "nncf_cpu_s_median": nncf_cpu})
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
