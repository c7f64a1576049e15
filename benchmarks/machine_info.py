"""The machine a benchmark ran on, as RESULTS.md records it: CPU model, SIMD flags from lscpu
(AVX, AVX-512, AMX, FMA, F16C, SSE4), cores, memory, load average and Python version."""
from __future__ import annotations

import os
import platform
import subprocess
from typing import Any


def machine() -> dict[str, Any]:
    flags, model = "", platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Flags:"):
                flags = " ".join(f for f in line.split()[1:] if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": model, "simd_flags": flags, "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version()}
