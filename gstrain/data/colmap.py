"""Load a COLMAP scene (images/ + sparse model) into a Scene, through pycolmap.

Distorted cameras are undistorted to PINHOLE with pycolmap; images are downscaled by `factor`
(from images_<factor>/ when it is complete, else on the fly with area resampling).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pycolmap

from gstrain.data.images import IMAGE_SUFFIXES, PINHOLE_MODELS, ViewLoader, ViewSource
from gstrain.data.masks import MaskReader, mask_note
from gstrain.data.scene import Scene, View
from gstrain.errors import UserError

_MODEL_FILES = ("cameras", "images", "points3D")
# The smallest view side a downscale factor may leave (one tile of the rasterizer).
MIN_IMAGE_SIDE = 16


def load_scene(
    path: str | Path,
    factor: int = 1,
    test_every: int = 8,
    log: Callable[[str], None] | None = None,
    background: Sequence[float] | None = None,
    max_side: int = 0,
    lazy: bool = False,
) -> Scene:
    """Read a COLMAP scene: posed, undistorted, downscaled views split into train/test, plus SfM points.

    background is not used: a COLMAP image's alpha channel is its mask (data/masks.py), not
    something to composite (the registry, data/inputs.py, passes it to every format).
    max_side: downscale further so the longer side is at most this (0: no limit). lazy: read only
    the images' headers; the views are LazyViews that decode when asked (an image store does).

    Test views: images sorted by name, index i with i % test_every == 0 (none when test_every <= 0).
    Raises UserError with one line for any problem with the input.
    """
    say = log or (lambda _msg: None)
    root = Path(path).expanduser()  # checked by data/inputs.py's load_scene, which every caller goes through

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

    # PIL decodes and resizes without the GIL, so loading on threads scales with the cores
    workers = max(1, min(8, os.cpu_count() or 1))
    masks = MaskReader(root, image_dir)
    loader = ViewLoader(factor, from_small_dir, masks, max_side=max_side, lazy=lazy)
    sources = [
        ViewSource(im.name, image_dir / im.name, im.camera, im.cam_from_world().matrix()) for im in images
    ]
    say(f"{'reading the headers of' if lazy else 'loading'} {len(images)} images from {image_dir} (factor {factor})")
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(loader.load, sources))
    say(f"{'read the headers of' if lazy else 'loaded'} {len(images)} images in {time.perf_counter() - start:.1f} s")
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
    extent = camera_extent(views, points)

    if test_every > 0:
        test = [v for i, v in enumerate(views) if i % test_every == 0]
        train = [v for i, v in enumerate(views) if i % test_every != 0]
    else:
        test, train = [], views
    # Notes are not logged here: callers show them (the CLI prints log lines and notes alike).
    return Scene(train=train, test=test, points=points, point_colors=colors, extent=extent, notes=notes)


def recognise(root: Path) -> bool:
    """Whether root looks like a COLMAP scene: any sparse model file in sparse/0 or sparse."""
    return any(
        (cand / f"{name}{ext}").is_file()
        for cand in (root / "sparse" / "0", root / "sparse") for name in _MODEL_FILES for ext in (".bin", ".txt")
    )


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
        if cam.model_name in PINHOLE_MODELS:
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


def _unlisted_note(image_dir: Path, rec: pycolmap.Reconstruction) -> list[str]:
    """A note for image files the sparse model does not list: they have no pose and are not used."""
    listed = {im.name for im in rec.images.values()}
    extra = sorted(
        p.relative_to(image_dir).as_posix() for p in image_dir.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file() and p.relative_to(image_dir).as_posix() not in listed
    )
    if not extra:
        return []
    return [f"{len(extra)} images in {image_dir} are not in the sparse model and were not used (e.g. {extra[0]})"]


def _read_points(rec: pycolmap.Reconstruction) -> tuple[np.ndarray, np.ndarray]:
    """The points' positions and colours in id order. pycolmap hands points to Python one object
    at a time (about 3 s for 1M points); its own PLY export writes them all from C++ (tens of ms),
    in the order its map's keys come, so the ids put them in order. A few points are checked
    against the per-point lookup, and any surprise takes the per-point path."""
    if rec.num_points3D() == 0:
        return np.zeros((0, 3), np.float32), np.zeros((0, 3), np.uint8)
    bulk = _points_through_ply(rec)
    if bulk is not None:
        return bulk
    items = sorted(rec.points3D.items(), key=lambda item: item[0])
    xyz = np.array([p.xyz for _, p in items], dtype=np.float64).astype(np.float32)
    rgb = np.array([p.color for _, p in items], dtype=np.uint8)
    return xyz, rgb


_PLY_POINT = np.dtype([("xyz", "<f4", 3), ("rgb", "u1", 3)])
_PLY_HEADER = (b"ply\nformat binary_little_endian 1.0\nelement vertex %d\nproperty float x\nproperty float y\n"
               b"property float z\nproperty uchar red\nproperty uchar green\nproperty uchar blue\nend_header\n")


def _points_through_ply(rec: pycolmap.Reconstruction) -> tuple[np.ndarray, np.ndarray] | None:
    """_read_points' bulk path, or None where the export is not the layout it expects."""
    import tempfile

    n = rec.num_points3D()
    ids = np.fromiter(rec.points3D.keys(), dtype=np.int64, count=n)
    with tempfile.TemporaryDirectory(prefix="gstrain-points-") as tmp:
        path = os.path.join(tmp, "points.ply")
        rec.export_PLY(path)
        raw = Path(path).read_bytes()
    header = _PLY_HEADER % n
    if not raw.startswith(header) or len(raw) != len(header) + n * _PLY_POINT.itemsize:
        return None
    points = np.frombuffer(raw, dtype=_PLY_POINT, offset=len(header))
    for i in np.linspace(0, n - 1, num=min(n, 16)).astype(np.int64):  # the export's order is the keys'
        point = rec.point3D(int(ids[i]))
        if not (np.allclose(point.xyz, points["xyz"][i], rtol=1e-6, atol=1e-6)
                and np.array_equal(point.color, points["rgb"][i])):  # fmt: skip
            return None
    order = np.argsort(ids, kind="stable")
    return points["xyz"][order].copy(), points["rgb"][order].copy()


def camera_extent(views: list[View], points: np.ndarray) -> float:
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
