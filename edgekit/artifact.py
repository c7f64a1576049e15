"""Artifact folders and their manifest, with atomic writes.

Every step (compress, export, build, profile, run) writes one folder holding its
files and a ``manifest.json``: what kind of artifact it is, the inputs and their
hashes, the step's config, the package versions and the metrics. A later step takes
the folder as its input, so a run can be reproduced, cached and resumed from
manifests alone.

Writes are atomic: a file is written to a temporary sibling and renamed; a folder is
staged as a temporary sibling and renamed into place only when the step succeeded,
so an interrupted or failed step never leaves a half-written output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from edgekit.errors import BadInputError
from edgekit.schema import FieldError, Loc, check_entries, check_keys, show

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1

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
    schema: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, where: str = MANIFEST) -> Manifest:
        """A manifest from its JSON form, every field checked against its annotation (and
        kind known, file paths inside the folder, steps well-formed, schema not newer than
        this edgekit reads); errors are one line naming ``where``, the field and the value."""
        loc = Loc(where)
        values = check_entries(cls, check_keys(cls, data, loc, noun="field"), loc)
        if "kind" not in values:
            raise FieldError(loc, f"missing required field 'kind' (one of {', '.join(KINDS)})")
        if values["kind"] not in KINDS:
            raise FieldError(loc / "kind", f"unknown kind {values['kind']!r} (choose from {', '.join(KINDS)})")
        for role, rel in values.get("files", {}).items():
            parts = Path(rel).parts
            if not rel or Path(rel).is_absolute() or ".." in parts or "\x00" in rel:
                raise FieldError(loc / "files" / role, f"must be a relative path inside the folder, got {rel!r}")
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


def cache_dir() -> Path:
    """Where edgekit caches derived files (a float copy of a GGUF model, trained
    benchmark weights, timing caches): ``$EDGEKIT_CACHE`` or ``~/.cache/edgekit``."""
    path = Path(os.environ.get("EDGEKIT_CACHE") or Path.home() / ".cache" / "edgekit")
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    try:  # numpy scalars and arrays
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``out`` only if the block succeeds.

    An existing ``out`` is replaced only after the new one is complete. On any
    exception, KeyboardInterrupt included, the staged folder is removed and ``out`` is
    left as it was.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_manifest(folder: str | os.PathLike[str], manifest: Manifest) -> Path:
    if not manifest.created:
        manifest.created = now_iso()
    if not manifest.versions:
        manifest.versions = package_versions()
    if not manifest.machine:
        manifest.machine = machine_info()
    return atomic_write_json(Path(folder) / MANIFEST, manifest.to_dict())


def is_artifact(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(folder: str | os.PathLike[str]) -> Manifest:
    folder = Path(folder)
    mf = folder / MANIFEST
    if not mf.is_file():
        raise BadInputError(f"{folder} is not an edgekit output folder (no {MANIFEST})")
    try:
        data = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInputError(f"{mf} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        raise BadInputError(f"{mf} has unknown kind {data.get('kind') if isinstance(data, dict) else None!r} "
                            f"(known: {', '.join(KINDS)})")
    return Manifest.from_dict(data, str(mf))


def input_record(path: str | os.PathLike[str]) -> dict[str, str]:
    p = Path(path)
    return {"path": str(p), "sha256": sha256_tree(p)}
