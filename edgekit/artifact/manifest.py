"""The ``manifest.json`` every edgekit output folder holds: what kind of artifact it is, its files,
the inputs and their hashes, the step's config, the package versions, the machine and the
metrics (``Manifest``, ``read_manifest``; ``write_manifest`` writes atomically, in
``atomic.py``). A later step takes the folder as its input, so a run can be reproduced, cached
and resumed from manifests alone."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError
from edgekit.schema import FieldError, Loc, check_entries, check_keys, read_json, show

MANIFEST = "manifest.json"


SCHEMA_VERSION = 2  # 2: ``contents``, every entry of the folder as it was committed


# What each artifact kind holds in ``files`` (role -> relative path).
KINDS = ("model", "onnx", "engine", "bundle", "profile", "report", "run", "sweep", "estimate", "adapter")


_TRACKED_PACKAGES = (
    "edgekit", "torch", "onnx", "onnxruntime", "onnxscript", "transformers", "peft",
    "torch-pruning", "numpy", "safetensors", "tensorrt",
)


@dataclass
class Manifest:
    """The record every step writes and the next one reads.

    kind: one of KINDS. files: role -> path relative to the folder (e.g.
    ``{"onnx": "model.onnx"}``). source: the base model's spec (zoo name, path, entry
    point) for model artifacts. steps: the compression chain, each
    ``{"name", "config", "meta"}``. inputs: role -> ``{"path", "sha256"}``.
    """

    kind: str
    files: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, dict[str, str]] = field(default_factory=dict)
    source: str | None = None
    model: dict[str, Any] = field(default_factory=dict)  # name, kind, inputs, outputs
    steps: list[dict[str, Any]] = field(default_factory=list)
    target: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    contents: list[str] = field(default_factory=list)  # the folder's entries, recorded by staged_dir as it commits
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, where: str = MANIFEST) -> Manifest:
        """A manifest from its JSON form, every field checked against its annotation (and
        kind known, file paths inside the folder, steps well-formed, schema not newer than
        this edgekit reads); errors are one line naming ``where``, the field and the value."""
        loc = Loc(where)
        newer = data.get("schema") if isinstance(data, dict) else None
        if isinstance(newer, int) and not isinstance(newer, bool) and newer > SCHEMA_VERSION:  # before its new fields
            raise FieldError(loc / "schema", f"{newer} is not a manifest schema this edgekit reads "
                                             f"(1 to {SCHEMA_VERSION}; a newer edgekit wrote it?)")
        values = check_entries(cls, check_keys(cls, data, loc, noun="field"), loc)
        if "kind" not in values:
            raise FieldError(loc, f"missing required field 'kind' (one of {', '.join(KINDS)})")
        if values["kind"] not in KINDS:
            raise FieldError(loc / "kind", f"unknown kind {values['kind']!r} (choose from {', '.join(KINDS)})")
        for role, rel in values.get("files", {}).items():
            parts = Path(rel).parts
            if not rel or Path(rel).is_absolute() or ".." in parts or "\x00" in rel:
                raise FieldError(loc / "files" / role, f"must be a relative path inside the folder, got {rel!r}")
        for i, name in enumerate(values.get("contents", [])):
            if not name or "/" in name or name in (".", "..") or "\x00" in name:
                raise FieldError((loc / "contents").at(i), f"must be the name of an entry of the folder, got {name!r}")
        for i, step in enumerate(values.get("steps", [])):
            if not isinstance(step.get("name"), str) or not isinstance(step.get("config", {}), dict) \
                    or not isinstance(step.get("meta", {}), dict) or set(step) - {"name", "config", "meta"}:
                raise FieldError((loc / "steps").at(i), "must be {name: str, config: mapping, meta: mapping}, got "
                                                      f"{show(step)}")
        schema = values.get("schema", SCHEMA_VERSION)
        if not 1 <= schema <= SCHEMA_VERSION:
            raise FieldError(loc / "schema", f"{schema} is not a manifest schema this edgekit reads "
                                             f"(1 to {SCHEMA_VERSION}; a newer edgekit wrote it?)")
        return cls(**values)

    def path_of(self, folder: Path, role: str) -> Path:
        if role not in self.files:
            raise BadInputError(f"{folder} has no {role!r} file (it has: {sorted(self.files) or 'none'})")
        return Path(folder) / self.files[role]


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in _TRACKED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"host": platform.node(), "system": platform.system(), "machine": platform.machine(),
            "cpu": cpu, "cores": os.cpu_count()}


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: str | os.PathLike[str]) -> str:
    """Hash of a file, or of a folder's files (names and contents, sorted)."""
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(str(f.relative_to(p)).encode())
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def is_artifact(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    folder = Path(folder)
    mf = folder / MANIFEST
    if not mf.is_file():
        raise BadInputError(f"{folder} is not an edgekit output folder (no {MANIFEST})")
    data = read_json(mf, "manifest")  # bounded; corrupt, deep or non-UTF-8 JSON is one line
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        raise BadInputError(f"{mf} has unknown kind {data.get('kind') if isinstance(data, dict) else None!r} "
                            f"(known: {', '.join(KINDS)})")
    return Manifest.from_dict(data, str(mf))


def input_record(path: str | os.PathLike[str]) -> dict[str, str]:
    p = Path(path)
    return {"path": str(p), "sha256": sha256_tree(p)}
