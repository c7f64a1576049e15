"""The TensorRT engine cache: built engines keyed by everything that makes them valid.

A TensorRT engine runs only on the GPU model and TensorRT version it was built with,
and only for the precision, shapes and flags it was built for. ``EngineKey`` holds all
of these plus the ONNX file's hash; its digest names a folder under
``cache_dir()/tensorrt-engines``. A matching entry is reused; anything else is a miss
and the engine is rebuilt, never run. ``check_compatible`` refuses to load an engine
recorded for another GPU or TensorRT version.

Timing caches (TensorRT's per-tactic timings, reusable across builds of different
models on the same GPU and TensorRT version) live next to the engines, one per
(TensorRT version, GPU, SM).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgekit.artifact import atomic_write_bytes, atomic_write_json, cache_dir, file_lock, sha256_json, staged_dir
from edgekit.errors import BadInputError

ENGINE_FILE = "model.plan"
KEY_FILE = "key.json"


@dataclass(frozen=True)
class EngineKey:
    tensorrt_version: str
    gpu: str
    sm: str
    precision: str
    shapes: dict[str, Any] = field(default_factory=dict)  # input -> {"min", "opt", "max"}
    flags: dict[str, Any] = field(default_factory=dict)  # strongly_typed, workspace_mb, dla_core, ...
    onnx_sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return sha256_json(self.to_dict())[:32]

    def mismatches(self, other: EngineKey | dict[str, Any]) -> list[str]:
        """The fields that differ (empty when the keys match)."""
        theirs = other.to_dict() if isinstance(other, EngineKey) else dict(other)
        mine = self.to_dict()
        return [k for k in mine if json.dumps(mine[k], sort_keys=True) != json.dumps(theirs.get(k), sort_keys=True)]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


class EngineCache:
    """``lookup(key)`` -> folder with ``model.plan`` (and the build's other outputs) or None;
    ``store(key, folder)`` copies a finished build in."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else cache_dir() / "tensorrt-engines"

    def entry(self, key: EngineKey) -> Path:
        return self.root / key.digest()

    def lookup(self, key: EngineKey) -> Path | None:
        folder = self.entry(key)
        try:
            recorded = json.loads((folder / KEY_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if key.mismatches(recorded) or not (folder / ENGINE_FILE).is_file():
            return None  # a digest collision or a damaged entry: rebuild
        return folder

    def store(self, key: EngineKey, files: dict[str, Path]) -> Path:
        """Copy ``files`` (relative name -> source path; must include ``model.plan``) into
        the entry for ``key``, atomically (a reader sees a complete entry or none)."""
        if ENGINE_FILE not in files:
            raise BadInputError(f"an engine cache entry needs {ENGINE_FILE}")
        final = self.entry(key)
        # Processes sharing the cache store an entry one at a time, each entry whole.
        with file_lock(self.root / ".locks" / final.name), \
                staged_dir(final, own_entry=lambda p: (p / KEY_FILE).is_file()) as tmp:
            for rel, src in files.items():
                dst = tmp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
            atomic_write_json(tmp / KEY_FILE, key.to_dict())
        return final

    def timing_cache_path(self, tensorrt_version: str, gpu: str, sm: str) -> Path:
        return self.root / "timing-caches" / f"{_slug(gpu)}-{_slug(sm)}-trt{_slug(tensorrt_version)}.cache"

    def save_timing_cache(self, path: Path, data: bytes) -> None:
        atomic_write_bytes(path, data)


def check_compatible(recorded: dict[str, Any], local: dict[str, Any], what: str = "engine") -> None:
    """Raise BadInputError when an engine recorded for one GPU / SM / TensorRT version is
    loaded on another. ``recorded`` and ``local`` hold ``tensorrt_version``, ``gpu``, ``sm``;
    a missing local value is not checked."""
    problems = []
    for field_name, label in (("sm", "GPU architecture"), ("gpu", "GPU"), ("tensorrt_version", "TensorRT version")):
        want, have = recorded.get(field_name), local.get(field_name)
        if want and have and str(want) != str(have):
            problems.append(f"{label} {want} (this machine: {have})")
    if problems:
        raise BadInputError(f"{what} was built for {'; '.join(problems)}: TensorRT engines are not portable "
                            "across GPUs or TensorRT versions; rebuild it here with `edgekit build`")
