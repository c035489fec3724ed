"""Load a transforms.json scene (NeRF/Blender or nerfstudio form) into a Scene.

Splits: with transforms_train.json, train comes from it and test from transforms_test.json;
transforms_val.json is not used (the papers train on train and score on test; val is their
tuning set). A single transforms.json is split by its train_filenames / test_filenames lists
(nerfstudio) when it has them, else its frames sorted by file path are split by test_every, as
COLMAP images are. Transparent pixels are composited over data.background (data/images.py).
Distorted cameras (OPENCV, OPENCV_FISHEYE) are undistorted to PINHOLE through pycolmap.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from gstrain.data.colmap import camera_extent
from gstrain.data.decode import DECODE_ERRORS
from gstrain.data.images import IMAGE_SUFFIXES, ViewLoader, ViewSource
from gstrain.data.masks import MaskReader, mask_note
from gstrain.data.ply_points import read_ply_points
from gstrain.data.scene import Scene
from gstrain.data.transforms_cameras import check_undistortable, frame_cam_from_world, frame_camera, world_change
from gstrain.errors import UserError

SINGLE_FILE = "transforms.json"
SPLIT_FILES = {"train": "transforms_train.json", "val": "transforms_val.json", "test": "transforms_test.json"}


def recognise(root: Path) -> bool:
    """Whether root holds a transforms.json scene."""
    return (root / SINGLE_FILE).is_file() or (root / SPLIT_FILES["train"]).is_file()


def scene_digest(root: Path) -> str:
    """sha256 of the scene's transforms files (cameras, poses, image names): the same scene
    wherever its folder is."""
    digest = hashlib.sha256()
    for name in (SINGLE_FILE, *SPLIT_FILES.values()):
        if (root / name).is_file():
            try:
                digest.update(name.encode() + (root / name).read_bytes())
            except OSError as exc:
                raise UserError(f"cannot read {root / name}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def load_scene(
    root: Path,
    factor: int = 1,
    test_every: int = 8,
    log: Callable[[str], None] | None = None,
    background: Sequence[float] = (0.0, 0.0, 0.0),
    max_side: int = 0,
    lazy: bool = False,
) -> Scene:
    """Read the scene's frames, images and optional ply points; UserError (one line) on bad input.
    max_side and lazy as in data/colmap.py's load_scene."""
    say = log or (lambda _msg: None)
    root = Path(os.path.abspath(root))  # not resolve(): an images/ symlink stays inside the scene
    notes: list[str] = []
    metas, split = _read_split(root, test_every, notes)
    say(f"reading {', '.join(sorted({str(m.file.name) for m in metas}))} in {root}")
    listed = [(f, s) for f, s in zip([f for meta in metas for f in meta.frames], split, strict=True) if s != "unused"]
    frames, split = [f for f, _ in listed], [s for _, s in listed]

    image_dir, prescaled = _pick_images(root, frames, factor, notes, say)
    sources, forms = [], set()
    checked: set[tuple] = set()
    for frame in frames:
        camera = frame_camera(frame.meta.data, frame.data, lambda f=frame.file: _image_size(f), frame.where)
        key = (camera.model_name, camera.width, camera.height, tuple(camera.params))
        if key not in checked:
            check_undistortable(camera, frame.where)
            checked.add(key)
        forms.add("nerfstudio" if "fl_x" in frame.data or "fl_x" in frame.meta.data else "NeRF/Blender")
        name = frame.file.relative_to(root).as_posix()
        file = image_dir / name.split("/", 1)[1] if prescaled else frame.file
        mask_name = name.split("/", 1)[1] if name.startswith("images/") else name
        sources.append(ViewSource(name, file, camera, frame_cam_from_world(frame.data, frame.meta.undo, frame.where),
                                  mask_name))
    _check_unique(sources)

    masks = MaskReader(root, image_dir, alpha_masks=False)
    loader = ViewLoader(factor, prescaled, masks, composite_over=background, camera_label="transforms.json camera",
                        max_side=max_side, lazy=lazy)
    say(f"{'reading the headers of' if lazy else 'loading'} {len(sources)} images (factor {factor})")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        results = list(pool.map(loader.load, sources))
    say(f"{'read the headers of' if lazy else 'loaded'} {len(sources)} images in {time.perf_counter() - start:.1f} s")
    views = [view for view, _ in results]

    notes.insert(0, f"read a {' and '.join(sorted(forms))} transforms.json scene")
    for model, count in sorted(Counter(m for _, m in results if m is not None).items()):
        notes.append(f"undistorted {count} {model} images to PINHOLE through pycolmap (not trained natively)")
    if any(meta.undo is not None for meta in metas):
        notes.append("undid nerfstudio's applied_transform: poses and points are in their source model's frame")
    notes.extend(loader.notes())
    masked = mask_note(views, masks)
    if masked:
        notes.append(masked)

    points, colors = _read_points(root, metas, notes)
    train = [v for v, s in zip(views, split, strict=True) if s == "train"]
    test = [v for v, s in zip(views, split, strict=True) if s == "test"]
    return Scene(train=train, test=test, points=points, point_colors=colors,
                 extent=camera_extent(views, points), notes=notes, points_expected=False)


class _Meta:
    """One transforms file: its JSON object, frames and world change."""

    def __init__(self, file: Path) -> None:
        self.file = file
        try:
            data = json.loads(file.read_text())
        except OSError as exc:
            raise UserError(f"cannot read {file}: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{file} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise UserError(f"{file}: the top level must be a JSON object")
        self.data: dict[str, Any] = data
        self.undo = world_change(data, str(file))
        frames = data.get("frames")
        if not isinstance(frames, list) or not frames:
            raise UserError(f"{file}: 'frames' is missing or empty (a list of {{file_path, transform_matrix}})")
        self.frames = [_Frame(self, i, f) for i, f in enumerate(frames)]


class _Frame:
    def __init__(self, meta: _Meta, index: int, data: Any) -> None:
        self.meta = meta
        self.where = f"{meta.file}: frame {index}"
        if not isinstance(data, dict):
            raise UserError(f"{self.where} must be a JSON object")
        path = data.get("file_path")
        if not isinstance(path, str) or not path:
            raise UserError(f"{self.where}: 'file_path' is missing")
        self.where = f"{meta.file}: frame {index} ({path})"
        self.data = data
        self.file = _resolve_image(meta.file.parent, path, self.where)


def _read_split(root: Path, test_every: int, notes: list[str]) -> tuple[list[_Meta], list[str]]:
    """The transforms files to read, and each frame's split ("train" or "test") in frame order."""
    train_file = root / SPLIT_FILES["train"]
    if train_file.is_file():
        metas = [_Meta(train_file)]
        test_file = root / SPLIT_FILES["test"]
        if test_file.is_file():
            metas.append(_Meta(test_file))
        else:
            notes.append(f"no {SPLIT_FILES['test']}: no test views")
        if (root / SPLIT_FILES["val"]).is_file():
            notes.append(f"{SPLIT_FILES['val']} is not used (train from train, test from test, as the papers do)")
        if (root / SINGLE_FILE).is_file():
            notes.append(f"{SINGLE_FILE} is not used: {SPLIT_FILES['train']} decides the split")
        split = [name for meta, name in zip(metas, ("train", "test"), strict=False) for _ in meta.frames]
        return metas, split
    meta = _Meta(root / SINGLE_FILE)
    meta.frames.sort(key=lambda f: f.file.as_posix())
    if "train_filenames" in meta.data or "test_filenames" in meta.data:
        return [meta], _named_split(meta, notes)
    split = ["test" if test_every > 0 and i % test_every == 0 else "train" for i in range(len(meta.frames))]
    return [meta], split


def _named_split(meta: _Meta, notes: list[str]) -> list[str]:
    """nerfstudio's train_filenames / test_filenames (paths like file_path); other frames are dropped."""
    named: dict[str, set[Path]] = {}
    for split in ("train", "test"):
        names = meta.data.get(f"{split}_filenames", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise UserError(f"{meta.file}: '{split}_filenames' must be a list of file paths")
        named[split] = {Path(os.path.normpath(meta.file.parent / n)) for n in names}
    split = []
    for frame in meta.frames:
        stem = frame.file.with_suffix("")  # a listed name may leave the extension off, as file_path may
        hits = [s for s in ("test", "train") if frame.file in named[s] or stem in named[s]]
        split.append(hits[0] if hits else "unused")
    if "train" not in split:
        raise UserError(f"{meta.file}: no frame is listed in 'train_filenames'")
    unused = split.count("unused")
    if unused:
        notes.append(f"{unused} frames are in neither train_filenames nor test_filenames and are not used")
    return split


def _resolve_image(base: Path, file_path: str, where: str) -> Path:
    """file_path relative to the JSON's folder; NeRF/Blender leave the extension off (r_0 -> r_0.png)."""
    path = Path(os.path.normpath(base / file_path))
    if path.is_file():
        return path
    for suffix in IMAGE_SUFFIXES:
        for cand in (Path(f"{path}{suffix}"), Path(f"{path}{suffix.upper()}")):
            if cand.is_file():
                return cand
    raise UserError(f"{where}: image file not found: {path} (also tried {', '.join(IMAGE_SUFFIXES)})")


def _image_size(file: Path) -> tuple[int, int]:
    try:
        with Image.open(file) as img:
            return img.size
    except DECODE_ERRORS as exc:
        raise UserError(f"cannot decode image {file}: {exc}") from None


def _pick_images(
    root: Path, frames: list[_Frame], factor: int, notes: list[str], say: Callable[[str], None]
) -> tuple[Path, bool]:
    """images_<factor>/ when every frame is under images/ and it has them all (nerfstudio's layout)."""
    for frame in frames:
        try:
            frame.file.relative_to(root)
        except ValueError:
            raise UserError(f"{frame.where}: the image {frame.file} is outside the scene folder {root}") from None
    if factor > 1:
        small = root / f"images_{factor}"
        names = [f.file.relative_to(root).as_posix() for f in frames]
        if small.is_dir() and all(n.startswith("images/") for n in names):
            missing = [n for n in names if not (small / n.split("/", 1)[1]).is_file()]
            if not missing:
                return small, True
            notes.append(f"{small} lacks {len(missing)} of {len(names)} images; downscaling the originals instead")
        say(f"downscaling images by {factor} on the fly")
    return root / "images", False


def _check_unique(sources: list[ViewSource]) -> None:
    seen: dict[str, int] = {}
    for source in sources:
        if source.name in seen:
            raise UserError(f"the image {source.file} is listed twice in the transforms files")
        seen[source.name] = 1


def _read_points(root: Path, metas: list[_Meta], notes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The first file's ply_file_path points (in the poses' frame), or none."""
    for meta in metas:
        ply = meta.data.get("ply_file_path")
        if ply is None:
            continue
        if not isinstance(ply, str) or not ply:
            raise UserError(f"{meta.file}: 'ply_file_path' must be a file path")
        path = meta.file.parent / ply
        if not path.is_file():
            raise UserError(f"{meta.file}: 'ply_file_path' {ply!r} not found ({path})")
        xyz, rgb = read_ply_points(path)
        if meta.undo is not None:
            xyz = (xyz.astype(np.float64) @ meta.undo[:3, :3].T + meta.undo[:3, 3]).astype(np.float32)
        return xyz, rgb
    notes.append("no ply_file_path: training starts from model.init_points random points in the "
                 "cameras' view volume")
    return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)
