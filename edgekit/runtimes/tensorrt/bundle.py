"""A TensorRT build bundle: what the device needs to build and time the engine itself.

``build.sh`` finds trtexec, records the device, refuses a GPU of another architecture and
runs exactly the recorded trtexec command; ``README.md`` says what was and was not done.
"""
from __future__ import annotations

import json
import shlex

from edgekit import __version__
from edgekit.runtimes.tensorrt.device import JETSON_TRTEXEC, PROBE_SH
from edgekit.runtimes.tensorrt.parsers import LAYERS_JSON, PROFILE_JSON, TIMES_JSON
from edgekit.runtimes.tensorrt.settings import (
    DEVICE_FILE,
    ENGINE_FILE,
    RESULTS_DIR,
    TIMING_CACHE_FILE,
    TrtSettings,
)
from edgekit.targets import Target


def bundle_script(argv: list[str], target: Target, settings: TrtSettings) -> str:
    """build.sh: find trtexec (PATH, then JetPack's place), record the device, check the
    GPU architecture and TensorRT version, run exactly ``argv``."""
    cmd = " \\\n  ".join(shlex.quote(a) if i else '"$TRTEXEC"' for i, a in enumerate(argv))
    sm = getattr(target, "sm", "") or ""
    rng = getattr(target, "tensorrt_versions", "") or ""
    return f"""#!/usr/bin/env bash
# Build bundle written by edgekit {__version__} for target {target.name} ({getattr(target, 'description', '')}).
# Run it ON THE DEVICE: `bash build.sh`. It builds model.plan with trtexec, then times it the
# trtexec way (warm-up {settings.warmup_ms} ms, >= {settings.duration_s} s, >= {settings.iterations} iterations) and writes
# per-layer info, per-layer profile and per-inference times to {RESULTS_DIR}/*.json.
# Copy the folder back and run `edgekit profile <this folder>` / `edgekit check` / `edgekit report`.
set -euo pipefail
cd "$(dirname "$0")"
TRTEXEC="${{TRTEXEC:-trtexec}}"
if ! command -v "$TRTEXEC" >/dev/null 2>&1; then
  if [ -x {JETSON_TRTEXEC} ]; then TRTEXEC={JETSON_TRTEXEC}; else
    echo "build.sh: trtexec not found (not on PATH, not at {JETSON_TRTEXEC}); install TensorRT or set TRTEXEC=" >&2
    exit 2
  fi
fi
mkdir -p {RESULTS_DIR}
export EDGEKIT_TRTEXEC="$TRTEXEC"
bash -c {shlex.quote(PROBE_SH.strip())} > {RESULTS_DIR}/{DEVICE_FILE} 2>/dev/null || true
CC=$(sed -n 's/^compute_cap=//p' {RESULTS_DIR}/{DEVICE_FILE})
BOARD=$(sed -n 's/^board=//p' {RESULTS_DIR}/{DEVICE_FILE})
SM=""
if [ -n "$CC" ]; then SM="sm_${{CC/./}}"; elif echo "$BOARD" | grep -qi orin; then SM=sm_87; fi
if [ -n "$SM" ] && [ "$SM" != "{sm}" ]; then
  echo "build.sh: this GPU is $SM but the bundle is for {target.name} ({sm}); the engine would not run there" >&2
  exit 2
fi
echo "build.sh: $(sed -n 's/^trtexec_banner=//p' {RESULTS_DIR}/{DEVICE_FILE}) (target expects TensorRT {rng or 'any'})"
{cmd} 2>&1 | tee {RESULTS_DIR}/trtexec.log
test -s {ENGINE_FILE} || {{ echo "build.sh: trtexec wrote no {ENGINE_FILE}; see {RESULTS_DIR}/trtexec.log" >&2; exit 1; }}
echo "build.sh: wrote {ENGINE_FILE} and {RESULTS_DIR}/{{{LAYERS_JSON},{PROFILE_JSON},{TIMES_JSON}}}"
"""


def bundle_readme(argv: list[str], target: Target, settings: TrtSettings, rel_onnx: str, warnings: list[str]) -> str:
    lines = [
        f"# TensorRT build bundle for {target.name}",
        "",
        f"Written by edgekit on a machine without a GPU of the target's architecture ({getattr(target, 'sm', '?')}),",
        "so nothing here was built yet. TensorRT engines only run on the GPU architecture and TensorRT",
        "version they were built with, so the engine is built on the device itself.",
        "",
        "## On the device",
        "```bash",
        "bash build.sh            # or TRTEXEC=/path/to/trtexec bash build.sh",
        "```",
        f"It checks the GPU (expects {getattr(target, 'sm', '?')}) and records it in `results/{DEVICE_FILE}`,",
        "then runs exactly:",
        "```bash",
        shlex.join(argv),
        "```",
        f"Target TensorRT versions: {getattr(target, 'tensorrt_versions', None) or 'any'}"
        + (f" (JetPack {target.jetpack})" if getattr(target, "jetpack", None) else ""),
        "",
        "## Back on the build machine",
        "```bash",
        "edgekit profile THIS_FOLDER --json profile.json   # reads results/*.json",
        "edgekit check profile.json --budget-ms 33",
        "edgekit report THIS_FOLDER",
        "```",
        "",
        "## Settings",
        f"- ONNX: `{rel_onnx}`",
        f"- precision: {settings.precision}; strongly typed: {settings.strongly_typed}; Q/DQ in graph: {settings.has_qdq}",
        f"- optimization profile: {json.dumps(settings.shapes) if settings.shapes else 'static shapes'}",
        f"- workspace: {settings.workspace_mb or 'TensorRT default'} MB; DLA core: {settings.dla_core}"
        + (" with GPU fallback" if settings.gpu_fallback else ""),
        f"- timing cache: `{TIMING_CACHE_FILE}` (created on the first build, reused afterwards)",
    ]
    if warnings:
        lines += ["", "## Warnings"] + [f"- {w}" for w in warnings]
    return "\n".join(lines) + "\n"


