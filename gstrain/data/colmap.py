"""Load a COLMAP scene (images/ + sparse model) into a Scene, through pycolmap.

Distorted cameras are undistorted to PINHOLE with pycolmap; images are downscaled by `factor`
(from images_<factor>/ when it is complete, else on the fly with area resampling).
"""

from __future__ import annotations

import copy
import hashlib
import numbers
import os
import struct
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pycolmap
import torch
from PIL import Image

from gstrain.data.masks import MaskReader, mask_note
from gstrain.data.scene import Scene, View
from gstrain.errors import UserError

_PINHOLE_MODELS = ("SIMPLE_PINHOLE", "PINHOLE")
_MODEL_FILES = ("cameras", "images", "points3D")
# The smallest view side a downscale factor may leave (one tile of the rasterizer).
MIN_IMAGE_SIDE = 16
# What PIL raises on bad image files (SyntaxError and struct.error come from some PNG/TIFF parsers).
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_GREY_MODES = ("L", "LA", "La", "1")
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)


def load_scene(
    path: str | Path,
    factor: int = 1,
    test_every: int = 8,
    log: Callable[[str], None] | None = None,
) -> Scene:
    """Read a COLMAP scene: posed, undistorted, downscaled views split into train/test, plus SfM points.

    Test views: images sorted by name, index i with i % test_every == 0 (none when test_every <= 0).
    Raises UserError with one line for any problem with the input.
    """
    say = log or (lambda _msg: None)
    root = Path(path).expanduser()
    if not root.exists():
        raise UserError(f"scene path does not exist: {root}")
    if not root.is_dir():
        raise UserError(f"scene path is not a directory: {root}")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Integral) or factor < 1:
        raise UserError(f"factor must be an integer >= 1, got {factor!r}")

    factor = int(factor)
    model_dir = find_model_dir(root)
    say(f"reading COLMAP model from {model_dir}")
    rec = _read_model(model_dir)

    notes: list[str] = []
    images = sorted((im for im in rec.images.values() if im.has_pose), key=lambda im: im.name)
    n_unposed = rec.num_images() - len(images)
    if n_unposed:
        notes.append(f"skipped {n_unposed} images without a pose in {model_dir}")
    if not images:
        raise UserError(f"the COLMAP model in {model_dir} has no posed images")

    _check_cameras(rec, images, model_dir)
    _check_factor(rec, images, factor)
    image_dir, from_small_dir = _pick_image_dir(root, [im.name for im in images], factor, notes, say)

    # pycolmap's undistortion holds the GIL; PIL decoding and resizing do not, so threads still help.
    workers = max(1, min(8, os.cpu_count() or 1))
    masks = MaskReader(root, image_dir)
    loader = _ViewLoader(image_dir, factor, from_small_dir, masks)
    say(f"loading {len(images)} images from {image_dir} (factor {factor})")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(loader.load, images))
    say(f"loaded {len(images)} images in {time.perf_counter() - start:.1f} s")
    views = [view for view, _ in results]

    undistorted = Counter(model for _, model in results if model is not None)
    for model, count in sorted(undistorted.items()):
        notes.append(f"undistorted {count} {model} images to PINHOLE")
    notes.extend(loader.notes())
    notes.extend(_unlisted_note(image_dir, rec))

    masked = mask_note(views, masks)  # masks: one line on how much is masked
    if masked:
        notes.append(masked)

    points, colors = _read_points(rec)
    extent = _camera_extent(views, points)

    if test_every > 0:
        test = [v for i, v in enumerate(views) if i % test_every == 0]
        train = [v for i, v in enumerate(views) if i % test_every != 0]
    else:
        test, train = [], views
    # Notes are not logged here: callers show them (the CLI prints log lines and notes alike).
    return Scene(train=train, test=test, points=points, point_colors=colors, extent=extent, notes=notes)


def find_model_dir(root: Path) -> Path:
    """The folder holding the sparse model: root/sparse/0 or root/sparse, in .bin or .txt."""
    candidates = [root / "sparse" / "0", root / "sparse"]
    for cand in candidates:
        for ext in (".bin", ".txt"):
            present = [(cand / f"{name}{ext}").is_file() for name in _MODEL_FILES]
            if all(present):
                return cand
            if any(present):
                missing = [f"{n}{ext}" for n, ok in zip(_MODEL_FILES, present, strict=True) if not ok]
                raise UserError(f"incomplete COLMAP model in {cand}: missing {', '.join(missing)}")
    looked = " and ".join(str(c) for c in candidates)
    raise UserError(f"no COLMAP sparse model (cameras/images/points3D .bin or .txt) in {looked}")


def _check_factor(rec: pycolmap.Reconstruction, images: list[pycolmap.Image], factor: int) -> None:
    """Refuse a factor that shrinks a view below MIN_IMAGE_SIDE: a few pixels train nothing."""
    for cam_id in sorted({im.camera_id for im in images}):
        cam = rec.cameras[cam_id]
        width, height = max(1, round(cam.width / factor)), max(1, round(cam.height / factor))
        if min(width, height) < MIN_IMAGE_SIDE:
            largest = max(1, min(cam.width, cam.height) // MIN_IMAGE_SIDE)
            raise UserError(f"factor {factor} (--factor, data.factor) shrinks the {cam.width}x{cam.height} images "
                            f"of camera {cam_id} to {width}x{height}; views need at least {MIN_IMAGE_SIDE} px "
                            f"on a side (use a factor up to {largest})")


def scene_digest(root: Path) -> str:
    """sha256 of the scene's cameras and images files (intrinsics, poses, image names): the same
    scene wherever its folder is. Points are left out: they do not change which views a run fits."""
    model_dir = find_model_dir(root)
    ext = ".bin" if (model_dir / "images.bin").is_file() else ".txt"
    digest = hashlib.sha256()
    for name in ("cameras", "images"):
        try:
            digest.update((model_dir / f"{name}{ext}").read_bytes())
        except OSError as exc:
            raise UserError(f"cannot read {model_dir / (name + ext)}: {exc.strerror or exc}") from None
    return digest.hexdigest()


def _read_model(model_dir: Path) -> pycolmap.Reconstruction:
    try:
        return pycolmap.Reconstruction(str(model_dir))
    except Exception as exc:  # pycolmap raises ValueError/IndexError/MemoryError on corrupt files
        reason = " ".join(str(exc).split()) or type(exc).__name__
        msg = f"cannot read the COLMAP model in {model_dir} (corrupt or truncated?): {reason}"
        raise UserError(msg) from None


def _check_cameras(rec: pycolmap.Reconstruction, images: list[pycolmap.Image], model_dir: Path) -> None:
    """Fail before decoding anything if a camera cannot be turned into a pinhole one."""
    options = pycolmap.UndistortCameraOptions()
    for cam_id in sorted({im.camera_id for im in images}):
        cam = rec.cameras[cam_id]
        if cam.width <= 0 or cam.height <= 0 or not cam.verify_params():
            raise UserError(f"camera {cam_id} ({cam.model_name}) in {model_dir} has invalid size or params")
        if cam.model_name in _PINHOLE_MODELS:
            continue
        try:
            pycolmap.undistort_camera(options, cam)
        except Exception:
            raise UserError(
                f"unsupported camera model {cam.model_name} (camera {cam_id} in {model_dir}): "
                "it cannot be undistorted to PINHOLE"
            ) from None


def _pick_image_dir(
    root: Path, names: list[str], factor: int, notes: list[str], say: Callable[[str], None]
) -> tuple[Path, bool]:
    """images_<factor>/ when complete, else images/; the bool says whether the images are pre-scaled."""
    if factor > 1:
        small = root / f"images_{factor}"
        if small.is_dir():
            missing = [n for n in names if not (small / n).is_file()]
            if not missing:
                return small, True
            notes.append(
                f"{small} lacks {len(missing)} of {len(names)} images (e.g. {missing[0]}); "
                f"downscaling {root / 'images'} by {factor} instead"
            )
    image_dir = root / "images"
    if not image_dir.is_dir():
        raise UserError(f"no images folder: {image_dir} does not exist")
    missing = [n for n in names if not (image_dir / n).is_file()]
    if missing:
        raise UserError(
            f"{len(missing)} image(s) listed in the COLMAP model are missing from {image_dir}, "
            f"e.g. {image_dir / missing[0]}"
        )
    if factor > 1:
        say(f"downscaling images by {factor} on the fly")
    return image_dir, False


class _ViewLoader:
    """Decodes, downscales and undistorts one image; safe to call from several threads."""

    def __init__(self, image_dir: Path, factor: int, prescaled: bool, masks: MaskReader) -> None:
        self.image_dir = image_dir
        self.masks = masks
        self.factor = factor
        self.prescaled = prescaled
        self.options = pycolmap.UndistortCameraOptions()
        # name -> (file size, camera size) of images that did not match their camera
        self.size_mismatch: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.alpha: list[str] = []  # images whose alpha channel was dropped
        self.grey: list[str] = []  # single-channel images spread to RGB

    def notes(self) -> list[str]:
        """One line per thing done to the images that the user did not ask for."""
        out = []
        if self.alpha:
            out.append(f"{len(self.alpha)} images have an alpha channel (e.g. {min(self.alpha)}); "
                       "where masks/ has no file for them, alpha is their mask (alpha < 0.5 is left out)")
        if self.grey:
            out.append(f"{len(self.grey)} images are grayscale (e.g. {min(self.grey)}); "
                       "their grey is used for all three colour channels")
        if self.size_mismatch:
            name = min(self.size_mismatch)
            (w, h), (cw, ch) = self.size_mismatch[name]
            if self.prescaled:
                what = f"intrinsics scaled to the images (not exactly 1/{self.factor} of the camera)"
            else:
                what = "resized to the camera's size before training (intrinsics kept)"
            out.append(f"{len(self.size_mismatch)} images differ in size from their COLMAP camera "
                       f"(e.g. {name}: {w}x{h}, camera {cw}x{ch}); {what}")
        return out

    def load(self, image: pycolmap.Image) -> tuple[View, str | None]:
        """The view, and the distorted model name when it was undistorted (else None)."""
        file = self.image_dir / image.name
        pil, mode = _decode(file)
        if mode in _ALPHA_MODES:
            self.alpha.append(image.name)
        if mode in _GREY_MODES:
            self.grey.append(image.name)
        cam: pycolmap.Camera = copy.copy(image.camera)
        w, h = pil.size
        # Images and cameras must agree on aspect ratio; more than ~2 px off means the wrong files.
        sx, sy = w / cam.width, h / cam.height
        if abs(sx - sy) * max(cam.width, cam.height) > 2.0:
            raise UserError(
                f"image {file} is {w}x{h} but its COLMAP camera is {cam.width}x{cam.height} "
                "(aspect ratios differ)"
            )
        if self.prescaled:
            target = (w, h)  # images_<factor>/ is used as it is; the camera follows its actual size
            if max(abs(w - cam.width / self.factor), abs(h - cam.height / self.factor)) > 1.0:
                self.size_mismatch[image.name] = ((w, h), (cam.width, cam.height))
        else:
            if (w, h) != (cam.width, cam.height):
                self.size_mismatch[image.name] = ((w, h), (cam.width, cam.height))
            target = (max(1, round(cam.width / self.factor)), max(1, round(cam.height / self.factor)))
        if (w, h) != target:
            # Area averaging (BOX) is the antialiased downscale; K follows the actual size ratio.
            pil = pil.resize(target, Image.Resampling.BOX)
        pixels = np.asarray(pil)

        camera_size = (cam.width, cam.height)
        distorted = cam.model_name not in _PINHOLE_MODELS
        if distorted:
            # Downscale first, then undistort with the rescaled camera: same result as the other order
            # within ~1/255 mean abs (checked on the beer scene), and factor^2 less undistortion work.
            cam.rescale(target[0], target[1])
            try:
                out, pin = pycolmap.undistort_image(self.options, pycolmap.Bitmap.from_array(pixels), cam)
            except Exception as exc:
                raise UserError(f"cannot undistort {file} ({cam.model_name}): {exc}") from None
            pixels = np.ascontiguousarray(out.to_array()).reshape(pin.height, pin.width, -1)
            K = pin.calibration_matrix()
        else:
            K = cam.calibration_matrix().copy()
            # COLMAP puts the top-left pixel centre at (0.5, 0.5), so plain scaling keeps centres aligned.
            K[0, :] *= target[0] / cam.width
            K[1, :] *= target[1] / cam.height

        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if pixels.shape[2] == 1:
            pixels = np.repeat(pixels, 3, axis=2)

        # masks: same resize and undistortion as the image (data/masks.py)
        mask = self.masks.load(image.name, file, (w, h), camera_size, target, cam if distorted else None)
        viewmat = np.eye(4)
        viewmat[:3, :] = image.cam_from_world().matrix()
        view = View(
            name=image.name,
            image=torch.from_numpy(np.array(pixels[:, :, :3], dtype=np.uint8, order="C")),
            K=torch.from_numpy(K.astype(np.float32)),
            viewmat=torch.from_numpy(viewmat.astype(np.float32)),
            mask=mask,
        )
        return view, (image.camera.model_name if distorted else None)


def _decode(file: Path) -> tuple[Image.Image, str]:
    """(RGB PIL image, the file's own mode: alpha dropped, grey expanded), or UserError if the
    file cannot be decoded. A palette image with a transparent colour counts as "RGBA"."""
    try:
        with Image.open(file) as img:
            img.load()
            mode = "RGBA" if img.mode == "P" and "transparency" in img.info else img.mode
            if img.mode.startswith("I;16") or img.mode in ("I", "F"):
                # 16-bit/float grey: PIL's convert("RGB") clips these, so scale to 8 bits ourselves.
                arr = np.asarray(img, dtype=np.float64)
                peak = 65535.0 if img.mode != "F" else max(float(arr.max()), 1.0)
                grey = np.clip(arr / peak * 255.0 + 0.5, 0, 255).astype(np.uint8)
                return Image.fromarray(grey).convert("RGB"), "L"
            return img.convert("RGB"), mode
    except _DECODE_ERRORS as exc:
        reason = str(exc).replace(f" '{file}'", "").strip() or type(exc).__name__
        raise UserError(f"cannot decode image {file}: {reason}") from None


_IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp"}


def _unlisted_note(image_dir: Path, rec: pycolmap.Reconstruction) -> list[str]:
    """A note for image files the sparse model does not list: they have no pose and are not used."""
    listed = {im.name for im in rec.images.values()}
    extra = sorted(
        p.relative_to(image_dir).as_posix() for p in image_dir.rglob("*")
        if p.suffix.lower() in _IMAGE_SUFFIXES and p.is_file() and p.relative_to(image_dir).as_posix() not in listed
    )
    if not extra:
        return []
    return [f"{len(extra)} images in {image_dir} are not in the sparse model and were not used (e.g. {extra[0]})"]


def _read_points(rec: pycolmap.Reconstruction) -> tuple[np.ndarray, np.ndarray]:
    ids = sorted(rec.point3D_ids())
    if not ids:
        return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)
    pts = rec.points3D
    xyz = np.array([pts[i].xyz for i in ids], dtype=np.float64).astype(np.float32)
    rgb = np.array([pts[i].color for i in ids], dtype=np.uint8)
    return xyz, rgb


def _camera_extent(views: list[View], points: np.ndarray) -> float:
    """1.1 x the largest distance of a camera centre from their mean (3DGS), with a fallback."""
    centers = np.stack([v.camera_center.double().numpy() for v in views])
    radius = float(np.linalg.norm(centers - centers.mean(axis=0), axis=1).max())
    if radius < 1e-6:
        # One camera (or all at one spot): use how far the scene is from it, else unit scale.
        if len(points):
            radius = float(np.median(np.linalg.norm(points.astype(np.float64) - centers[0], axis=1)))
        if not np.isfinite(radius) or radius < 1e-6:
            radius = 1.0
    return 1.1 * radius
