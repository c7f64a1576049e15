"""A device results folder, as a bundle's ``build.sh`` writes it on the device.

``results/`` holds trtexec's exports (``trtexec_times.json``, ``trtexec_profile.json``,
``trtexec_layers.json``) and log, ``device.txt`` (GPU, SM, board, trtexec banner),
``machine.txt`` (JetPack, L4T, TensorRT package, power mode, kernel, date),
``nvpmodel.txt`` (``nvpmodel -q``), ``jetson_clocks.txt`` (``jetson_clocks --show``) and
``bundle_manifest.json`` (the bundle's manifest). ``read_machine_state`` turns the text
files into the ``machine`` record of the profile, with warnings where the state makes
timings unreliable (clocks not locked, power mode unknown).

The formats of ``nvpmodel -q`` ("NV Power Mode: MAXN" then the mode id) and
``jetson_clocks --show`` ("GPU MinFreq=... MaxFreq=... CurrentFreq=...", one line per
clock domain, "cpuN: Online=1 ... CurrentFreq=...") are as JetPack 5 and 6 print them.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from edgekit.runtimes.base import MAX_DEVICE_NOTE_BYTES, RESULTS_MANIFEST, read_device_text
from edgekit.runtimes.tensorrt.device import parse_probe
from edgekit.runtimes.tensorrt.settings import DEVICE_FILE, MACHINE_FILE, RESULTS_DIR

NVPMODEL_FILE = "nvpmodel.txt"
CLOCKS_FILE = "jetson_clocks.txt"
_FREQ = re.compile(r"(MinFreq|MaxFreq|CurrentFreq)=(\d+)")


def results_dir_of(folder: Path) -> Path | None:
    """The device results folder: ``folder`` itself (copied back alone) or its ``results/``."""
    for cand in (folder, folder / RESULTS_DIR):
        if (cand / DEVICE_FILE).is_file() or (cand / RESULTS_MANIFEST).is_file():
            return cand
    return None


def _key_values(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            if v.strip():
                out[k.strip()] = v.strip()
    return out


def parse_jetson_clocks(text: str) -> dict[str, Any]:
    """``jetson_clocks --show`` -> {domain: {"min_mhz", "max_mhz", "current_mhz"}} for GPU, EMC,
    DLA..., and "cpu": {"online", "current_min_mhz", "current_max_mhz", "max_mhz"}."""
    clocks: dict[str, Any] = {}
    cpus: list[dict[str, int]] = []
    for line in text.splitlines():
        line = line.strip()
        freqs = {k: int(v) for k, v in _FREQ.findall(line)}
        if not freqs:
            continue
        name = line.split()[0].rstrip(":")
        if re.fullmatch(r"cpu\d+", name):
            if "Online=1" in line and "CurrentFreq" in freqs:
                cpus.append(freqs)
            continue
        # GPU/EMC/DLA lines give Hz; CPU lines kHz.
        clocks[name.lower()] = {f"{k[:-4].lower()}_mhz": round(v / 1e6, 1) for k, v in
                                (("MinFreq", freqs.get("MinFreq")), ("MaxFreq", freqs.get("MaxFreq")),
                                 ("CurrentFreq", freqs.get("CurrentFreq"))) if v is not None}
    if cpus:
        clocks["cpu"] = {"online": len(cpus),
                         "current_min_mhz": round(min(c["CurrentFreq"] for c in cpus) / 1e3, 1),
                         "current_max_mhz": round(max(c["CurrentFreq"] for c in cpus) / 1e3, 1),
                         "max_mhz": round(max(c.get("MaxFreq", 0) for c in cpus) / 1e3, 1)}
    return clocks


def _note(path: Path) -> str:
    return read_device_text(path, f"{path.stem} record", MAX_DEVICE_NOTE_BYTES)


def read_machine_state(results: Path) -> tuple[dict[str, Any], list[str]]:
    """(the machine record of a device measurement, warnings about its state)."""
    state: dict[str, Any] = {"measured_on": "device"}
    warnings: list[str] = []
    if (results / DEVICE_FILE).is_file():
        info = parse_probe(_note(results / DEVICE_FILE))
        state.update({k: v for k, v in info.to_dict().items() if v and k != "trtexec"})
    if (results / MACHINE_FILE).is_file():
        state.update(_key_values(_note(results / MACHINE_FILE)))
    if (results / NVPMODEL_FILE).is_file():
        text = _note(results / NVPMODEL_FILE)
        m = re.search(r"NV Power Mode:\s*(\S+)", text)
        if m:
            state["power_mode"] = m.group(1)
            mode_id = [ln.strip() for ln in text.splitlines() if ln.strip().isdigit()]
            if mode_id:
                state["power_mode_id"] = int(mode_id[0])
    if (results / CLOCKS_FILE).is_file():
        clocks = parse_jetson_clocks(_note(results / CLOCKS_FILE))
        if clocks:
            state["clocks"] = clocks
            gpu = clocks.get("gpu", {})
            locked = bool(gpu) and gpu.get("current_mhz") == gpu.get("max_mhz")
            state["clocks_locked"] = locked
            if gpu and not locked:
                warnings.append(f"GPU clock {gpu.get('current_mhz')} MHz is below its maximum {gpu.get('max_mhz')} MHz "
                                "when the results were recorded: clocks were not locked (`sudo jetson_clocks`), so "
                                "latencies vary with DVFS")
    if state.get("board") and "power_mode" not in state:
        warnings.append("the power mode was not recorded (nvpmodel missing): latencies depend on it")
    return state, warnings
