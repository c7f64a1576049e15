"""The machine that builds or runs an engine: its GPU, SM and TensorRT.

``probe_local()`` looks here; ``probe_remote(host)`` runs the same probe over SSH; a
bundle's ``build.sh`` runs it on the device and writes its output to
``results/device.txt``. ``parse_probe`` reads that output back.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from edgekit.errors import UnavailableError
from edgekit.ssh import RemoteHost

# On JetPack, trtexec is not on PATH.
JETSON_TRTEXEC = "/usr/src/tensorrt/bin/trtexec"

PROBE_SH = r"""
T="${EDGEKIT_TRTEXEC:-trtexec}"
if ! command -v "$T" >/dev/null 2>&1 && [ -x /usr/src/tensorrt/bin/trtexec ]; then T=/usr/src/tensorrt/bin/trtexec; fi
echo "gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1)"
echo "compute_cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1)"
echo "board=$(tr -d '\0' < /proc/device-tree/model 2>/dev/null)"
if command -v "$T" >/dev/null 2>&1; then
  echo "trtexec=$(command -v "$T")"
  echo "trtexec_banner=$("$T" --help 2>&1 | grep -o 'TensorRT v[0-9]*' | head -n1)"
fi
echo "py_tensorrt=$(python3 -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null)"
"""


@dataclass
class DeviceInfo:
    gpu: str | None = None
    sm: str | None = None
    tensorrt_version: str | None = None
    trtexec: str | None = None
    python_tensorrt: str | None = None
    board: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_probe(text: str) -> DeviceInfo:
    """Parse PROBE_SH's ``key=value`` lines."""
    kv = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            kv[k.strip()] = v.strip()
    info = DeviceInfo(gpu=kv.get("gpu") or None, trtexec=kv.get("trtexec") or None,
                      python_tensorrt=kv.get("py_tensorrt") or None, board=kv.get("board") or None)
    cc = kv.get("compute_cap", "")
    if re.fullmatch(r"\d+\.\d+", cc):
        major, minor = cc.split(".")
        info.sm = f"sm_{major}{minor}"
    board = info.board or ""
    if info.sm is None and "orin" in board.lower():
        info.sm = "sm_87"  # every Jetson Orin module
        info.gpu = info.gpu or board
    banner = re.search(r"v(\d+)", kv.get("trtexec_banner", ""))
    if banner:
        info.tensorrt_version = trt_version_from_int(int(banner.group(1)))
    if info.python_tensorrt:
        info.tensorrt_version = info.tensorrt_version or info.python_tensorrt
    return info


def trt_version_from_int(v: int) -> str:
    """trtexec's banner ``TensorRT v100300`` -> ``10.3.0`` (``v8601`` -> ``8.6.1``)."""
    if v >= 10000:  # TensorRT >= 10: MMmmpp
        return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
    return f"{v // 1000}.{(v // 100) % 10}.{v % 100}"  # TensorRT 8: Mmpp


def import_tensorrt() -> ModuleType | None:
    """The ``tensorrt`` module, or None where it is not installed or cannot load."""
    try:
        import tensorrt as trt  # noqa: PLC0415
    except (ImportError, OSError):  # not installed, or a broken install (missing libnvinfer)
        return None
    return trt


def probe_local(trtexec: str | None = None) -> DeviceInfo:
    env = dict(os.environ)
    if trtexec:
        env["EDGEKIT_TRTEXEC"] = trtexec
    try:
        out = subprocess.run(["bash", "-c", PROBE_SH], capture_output=True, text=True, timeout=60, env=env).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    info = parse_probe(out)
    trt = import_tensorrt()
    if trt is not None:
        info.python_tensorrt = str(getattr(trt, "__version__", "unknown"))
        info.tensorrt_version = info.python_tensorrt
    return info


def probe_remote(host: RemoteHost, trtexec: str | None = None) -> DeviceInfo:
    """The device's GPU, SM and TensorRT, probed over SSH."""
    env = f"EDGEKIT_TRTEXEC={shlex.quote(trtexec)} " if trtexec else ""
    out = host.run(f"{env}bash -c {shlex.quote(PROBE_SH)}", timeout=host.connect_timeout + 60).stdout
    return parse_probe(out)


def require_remote_tensorrt(host: RemoteHost) -> DeviceInfo:
    """The device's TensorRT, or UnavailableError naming what is missing."""
    info = probe_remote(host)
    if not info.trtexec and not info.python_tensorrt:
        raise UnavailableError(f"remote {host.spec} lacks TensorRT: no trtexec on PATH or at {JETSON_TRTEXEC} "
                               "and no tensorrt Python module")
    return info


def find_trtexec(extra: dict[str, Any]) -> str | None:
    """trtexec named in ``extra["trtexec"]`` or ``$EDGEKIT_TRTEXEC``, else on PATH, else JetPack's."""
    cand = extra.get("trtexec") or os.environ.get("EDGEKIT_TRTEXEC")
    if cand:
        return shutil.which(str(cand)) or (str(cand) if Path(str(cand)).is_file() else None)
    return shutil.which("trtexec") or (JETSON_TRTEXEC if Path(JETSON_TRTEXEC).is_file() else None)
