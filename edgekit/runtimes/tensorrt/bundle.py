"""A TensorRT build bundle: what the device needs to build and time the engine itself.

``build.sh`` (run on the device) finds trtexec, records the machine (GPU, board, JetPack,
TensorRT, power mode with ``nvpmodel -q``, clocks with ``jetson_clocks --show``), refuses a
GPU of another architecture, runs exactly the recorded trtexec command (build, then a
separate profiling run with ``--exportTimes/--exportProfile/--exportLayerInfo``) and
writes everything into one results folder, ``results/``, with a copy of the bundle's
manifest. ``edgekit profile results/`` turns that folder into a profile labelled as a
device measurement. ``README.md`` says what was and was not done.
"""
from __future__ import annotations

import json
import shlex

from edgekit.markup import md, md_code
from edgekit.runtimes.base import RESULTS_MANIFEST
from edgekit.runtimes.tensorrt.device import JETSON_TRTEXEC, PROBE_SH
from edgekit.runtimes.tensorrt.parsers import LAYERS_JSON, PROFILE_JSON, TIMES_JSON
from edgekit.runtimes.tensorrt.settings import (
    DEVICE_FILE,
    ENGINE_FILE,
    MACHINE_FILE,
    RESULTS_DIR,
    TIMING_CACHE_FILE,
    TrtSettings,
)
from edgekit.targets import Target
from edgekit.version import __version__

# What build.sh records about the machine, as key=value lines in results/machine.txt;
# nvpmodel and jetson_clocks write their own files (they exist on Jetson only).
MACHINE_SH = r"""
echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "kernel=$(uname -r)"
echo "l4t=$(head -n1 /etc/nv_tegra_release 2>/dev/null)"
echo "jetpack=$(dpkg-query -W -f='${Version}' nvidia-jetpack 2>/dev/null)"
echo "tensorrt_package=$(dpkg-query -W -f='${Version}' tensorrt 2>/dev/null || dpkg-query -W -f='${Version}' libnvinfer-bin 2>/dev/null)"
echo "power_mode=$(nvpmodel -q 2>/dev/null | sed -n 's/^NV Power Mode: *//p' | head -n1)"
"""


def bundle_script(argv: list[str], target: Target, settings: TrtSettings) -> str:
    """build.sh: find trtexec (PATH, then JetPack's place), record the machine, check the
    GPU architecture, run exactly ``argv``, and leave one results folder."""
    cmd = " \\\n  ".join(shlex.quote(a) if i else '"$TRTEXEC"' for i, a in enumerate(argv))
    sm = target.sm or ""
    rng = target.tensorrt_versions or ""
    return f"""#!/usr/bin/env bash
# Build bundle written by edgekit {__version__} for target {target.name} ({target.description}).
# Nothing in this folder was built or measured yet. Run it ON THE DEVICE: `bash build.sh`.
# It builds {ENGINE_FILE} with trtexec, then times it the trtexec way (warm-up {settings.warmup_ms} ms,
# >= {settings.duration_s} s, >= {settings.iterations} iterations, per-layer profile in a separate run) and writes one
# results folder, {RESULTS_DIR}/: trtexec's JSON exports and log, the device, JetPack, TensorRT,
# power mode and clocks, and a copy of the bundle's manifest.
# Copy {RESULTS_DIR}/ (or the whole folder) back and run `edgekit profile {RESULTS_DIR}` / `edgekit check` / `edgekit report`.
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
bash -c {shlex.quote(MACHINE_SH.strip())} > {RESULTS_DIR}/{MACHINE_FILE} 2>/dev/null || true
if command -v nvpmodel >/dev/null 2>&1; then nvpmodel -q > {RESULTS_DIR}/nvpmodel.txt 2>&1 || true; fi
if command -v jetson_clocks >/dev/null 2>&1; then
  jetson_clocks --show > {RESULTS_DIR}/jetson_clocks.txt 2>&1 || sudo -n jetson_clocks --show > {RESULTS_DIR}/jetson_clocks.txt 2>&1 || true
fi
cp manifest.json {RESULTS_DIR}/{RESULTS_MANIFEST}
echo "build.sh: $(sed -n 's/^trtexec_banner=//p' {RESULTS_DIR}/{DEVICE_FILE})" {shlex.quote(f"(target expects TensorRT {rng or 'any'})")}
{cmd} 2>&1 | tee {RESULTS_DIR}/trtexec.log
test -s {ENGINE_FILE} || {{ echo "build.sh: trtexec wrote no {ENGINE_FILE}; see {RESULTS_DIR}/trtexec.log" >&2; exit 1; }}
echo "build.sh: wrote {ENGINE_FILE} and {RESULTS_DIR}/ ({LAYERS_JSON}, {PROFILE_JSON}, {TIMES_JSON}, machine state)"
"""


def bundle_readme(argv: list[str], target: Target, settings: TrtSettings, rel_onnx: str, warnings: list[str],
                  status: dict[str, object], notes: list[str]) -> str:
    lines = [
        f"# TensorRT build bundle for {md(target.name)}",
        "",
        f"**Status: nothing here was built or measured.** {md(status['summary'])}.",
        "No engine exists until `build.sh` runs on the device, and nothing in this folder was checked",
        "by TensorRT. TensorRT engines only run on the GPU architecture and TensorRT version they were",
        f"built with, so the engine is built on the device itself (why here: {md(status['reason'])}).",
        "",
        "## On the device",
        "```bash",
        "bash build.sh            # or TRTEXEC=/path/to/trtexec bash build.sh",
        "```",
        f"It checks the GPU (expects {target.sm or '?'}), records the device, JetPack, TensorRT, power mode",
        f"(`nvpmodel -q`) and clocks (`jetson_clocks --show`) in `{RESULTS_DIR}/`, then runs exactly:",
        *md_code(shlex.join(argv), "bash"),
        f"Target TensorRT versions: {target.tensorrt_versions or 'any'}"
        + (f" (JetPack {target.jetpack})" if target.jetpack else ""),
        "For stable numbers, set the power mode and lock the clocks first (`sudo nvpmodel -m 0`,",
        "`sudo jetson_clocks`); the results record both either way.",
        "",
        "## Back on the build machine",
        "```bash",
        f"edgekit profile {RESULTS_DIR} --json profile.json   # a device measurement, with the machine state",
        "edgekit check profile.json --budget-ms 33 --require-verified",
        "edgekit report THIS_FOLDER",
        "```",
        f"`edgekit profile` accepts the results only if they match this bundle: the GPU's SM ({target.sm or '?'}), "
        f"TensorRT {target.tensorrt_versions or 'any'}, the ONNX's inputs, batch and node names (the manifest keeps them); "
        "results of another device or model are refused, and facts the device did not record leave them unverified.",
        "",
        "## Settings",
        f"- ONNX: {md(rel_onnx)}",
        f"- precision: {settings.precision}; strongly typed: {settings.strongly_typed}; Q/DQ in graph: {settings.has_qdq}",
        f"- optimization profile: {md(json.dumps(settings.shapes)) if settings.shapes else 'static shapes'}",
        f"- workspace: {settings.workspace_mb or 'TensorRT default'} MB; DLA core: {settings.dla_core}"
        + (" with GPU fallback" if settings.gpu_fallback else ""),
        f"- timing cache: `{TIMING_CACHE_FILE}` (created on the first build, reused afterwards)",
    ]
    if notes:
        lines += ["", "## What edgekit did to the graph"] + [f"- {md(n)}" for n in notes]
    if warnings:
        lines += ["", "## Warnings"] + [f"- {md(w)}" for w in warnings]
    return "\n".join(lines) + "\n"
