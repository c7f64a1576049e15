"""Hashes of the files edgekit writes, to show that a restructuring changed no output.

One command: exports, compresses and builds a tiny CNN (seeded) and EfficientNet-Lite0 (fp32)
through the Python API, then prints every written file with its sha256 and writes them to
JSON. Each ``manifest.json`` is hashed without what differs between runs by design (creation
time, machine, package versions, timings). ``--compare OLD.json`` exits 1 naming every file
whose hash differs (or that one side lacks).

    python benchmarks/bench_output_hashes.py --out results/output_hashes.json
    python benchmarks/bench_output_hashes.py --out new.json --compare results/output_hashes.json

Run it on two commits of the same machine and packages: ONNX export and ORT's graph
optimizations are deterministic for one set of versions, not across them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Manifest keys that differ between two runs of the same code by design (and every key that
# holds a duration: ``*_seconds``, ``*_s``, ``*_ms``).
VOLATILE_KEYS = {"created", "machine", "versions", "inputs"}  # inputs: hashes of input folders, whose
# manifests carry their own creation time
DURATION = re.compile(r"(seconds|_s|_ms)$")


def tiny_cnn() -> Any:
    """The tiny CNN of the test suite (conv, BN, depthwise conv, ReLU6, pooling, linear), seeded."""
    import torch
    from torch import nn

    from edgekit.sources.handle import InputSpec, ModelHandle

    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU6(),
        nn.Conv2d(8, 16, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()
    return ModelHandle(name="tiny-cnn", source="bench_output_hashes:tiny_cnn", kind="image-classifier", module=module,
                       inputs=[InputSpec("input", ("batch", 3, 32, 32), "float32")], outputs=["logits"],
                       dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, extra={"num_classes": 10})


def _stable(value: Any, work: str) -> Any:
    """A manifest without its volatile keys, the temporary work folder's path written as <work>."""
    if isinstance(value, dict):
        return {k: _stable(v, work) for k, v in sorted(value.items())
                if k not in VOLATILE_KEYS and not DURATION.search(k)}
    if isinstance(value, list):
        return [_stable(v, work) for v in value]
    if isinstance(value, str):
        return value.replace(work, "<work>")
    return value


def folder_hashes(folder: Path, work: Path, manifests: dict[str, Any]) -> dict[str, str]:
    """sha256 of every file under ``folder`` (each manifest.json without its volatile keys,
    which go into ``manifests`` too, to show what differs)."""
    out = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if path.name == "manifest.json":
            stable = _stable(json.loads(path.read_text()), str(work))
            manifests[f"{folder.name}/{rel}"] = stable
            data = json.dumps(stable, sort_keys=True).encode()
        else:
            data = path.read_bytes()
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def produce(work: Path, real: bool, manifests: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Every output folder this check writes -> its file hashes."""
    import numpy as np

    import edgekit
    from edgekit.compress import StepContext
    from edgekit.runtimes.base import BuildOptions

    folders: dict[str, Path] = {}
    tiny = "bench_output_hashes:tiny_cnn"  # a spec, so a compressed folder reloads its base model
    folders["tiny-onnx"] = edgekit.export_onnx(tiny, work / "tiny-onnx")
    folders["tiny-engine-ort"] = edgekit.build_engine(folders["tiny-onnx"], "cpu", work / "tiny-engine-ort",
                                                      BuildOptions(threads=1))
    folders["tiny-engine-ov"] = edgekit.build_engine(folders["tiny-onnx"], "cpu", work / "tiny-engine-ov",
                                                     BuildOptions(threads=1, runtime="openvino"))
    folders["tiny-fp16"] = edgekit.compress(tiny, [("half", {})], work / "tiny-fp16")
    folders["tiny-fp16-onnx"] = edgekit.export_onnx(folders["tiny-fp16"], work / "tiny-fp16-onnx")
    calib = work / "calib.npz"  # seeded images: the tiny CNN has no data set of its own
    np.savez(calib, input=np.random.default_rng(0).standard_normal((512, 3, 32, 32)).astype(np.float32))
    folders["tiny-onnx-int8"] = edgekit.compress(folders["tiny-onnx"] / "model.onnx", [("int8", {})],
                                                 work / "tiny-onnx-int8", StepContext(calib=str(calib), eval=str(calib)))
    folders["tiny-int8-engine"] = edgekit.build_engine(folders["tiny-onnx-int8"], "cpu", work / "tiny-int8-engine",
                                                       BuildOptions(threads=1))
    if real:
        folders["lite0-onnx"] = edgekit.export_onnx("efficientnet-lite0", work / "lite0-onnx")
        folders["lite0-engine-ort"] = edgekit.build_engine(folders["lite0-onnx"], "cpu", work / "lite0-engine-ort",
                                                           BuildOptions(threads=1))
    return {name: folder_hashes(Path(folder), work, manifests) for name, folder in folders.items()}


def compare(new: dict[str, dict[str, str]], old: dict[str, dict[str, str]]) -> list[str]:
    diffs = []
    for name in sorted(set(new) | set(old)):
        a, b = old.get(name, {}), new.get(name, {})
        for rel in sorted(set(a) | set(b)):
            if a.get(rel) != b.get(rel):
                diffs.append(f"{name}/{rel}: {a.get(rel, 'missing')[:12]} -> {b.get(rel, 'missing')[:12]}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file for the hashes")
    ap.add_argument("--compare", type=Path, help="an earlier run's JSON: exit 1 on any difference")
    ap.add_argument("--no-real", action="store_true", help="only the tiny CNN (skip EfficientNet-Lite0)")
    args = ap.parse_args()
    wall, cpu = time.perf_counter(), time.process_time()
    manifests: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        hashes = produce(Path(tmp), real=not args.no_real, manifests=manifests)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{'folder/file':58s} sha256")
    for name, files in hashes.items():
        for rel, digest in files.items():
            print(f"{name + '/' + rel:58s} {digest[:16]}")
    print(f"wall {wall:.1f} s, process CPU {cpu:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from edgekit.artifact import machine_info, now_iso, package_versions

    args.out.write_text(json.dumps({"date": now_iso(), "machine": machine_info(), "versions": package_versions(),
                                    "load_average": os.getloadavg(), "wall_s": round(wall, 1),
                                    "cpu_s": round(cpu, 1), "hashes": hashes, "manifests": manifests}, indent=1))
    if args.compare:
        diffs = compare(hashes, json.loads(args.compare.read_text())["hashes"])
        for line in diffs:
            print("DIFFERS", line)
        print(f"{sum(len(f) for f in hashes.values())} files compared, {len(diffs)} differ")
        return 1 if diffs else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
