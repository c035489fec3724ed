"""Photos -> COLMAP scene: structure-from-motion with pycolmap, undistorted to PINHOLE.

Stages: SIFT feature extraction, matching (exhaustive or sequential), incremental mapping (the
largest model is kept when mapping splits), undistortion. Everything happens in a temporary
workspace next to SCENE_DIR; only a finished scene replaces it, so a failed run leaves nothing
half-written. SCENE_DIR gets images/, sparse/0/ and sfm.json (the manifest of the photos and of
every file written: a re-run on the same photos replaces those files without --force, another
scene needs --force, and a file gstrain did not write is never replaced; gstrain.scene_folder).
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gstrain import __version__
from gstrain.choices import SFM_MATCHERS
from gstrain.errors import UserError
from gstrain.scene_folder import check_replace, install, workspace, write_manifest

MANIFEST = "sfm.json"
# Formats both PIL (our readability check) and COLMAP's image reader handle.
PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp")
# Models COLMAP can estimate and undistort to a pinhole camera afterwards.
CAMERA_MODELS = (
    "SIMPLE_PINHOLE", "PINHOLE", "SIMPLE_RADIAL", "RADIAL", "OPENCV", "FULL_OPENCV",
    "SIMPLE_RADIAL_FISHEYE", "RADIAL_FISHEYE", "OPENCV_FISHEYE", "FOV", "THIN_PRISM_FISHEYE",
)  # fmt: skip
MIN_MAX_SIZE = 32
_SEED = 0  # fixed RANSAC / mapper seeds: re-runs on the same photos give (nearly) the same scene


@dataclass
class SfmReport:
    scene_dir: Path
    num_photos: int  # readable photos that went into SfM
    num_registered: int  # images with a pose in the kept model
    num_points: int
    reprojection_error: float  # mean, pixels (at the resolution features were extracted)
    num_models: int  # models mapping produced (we keep the largest)
    camera_model: str
    seconds: float
    notes: list[str] = field(default_factory=list)


def run_sfm(
    photos_dir: str | Path,
    scene_dir: str | Path,
    camera_model: str = "SIMPLE_RADIAL",
    matcher: str = "exhaustive",
    max_size: int = 1600,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> SfmReport:
    """Run SfM on the photos in photos_dir and write a pinhole COLMAP scene to scene_dir.

    Raises UserError (one line) for unusable input: no readable photos, fewer than two
    registered images, or a scene_dir that already holds something else (unless force).
    """
    import pycolmap

    start = time.perf_counter()
    photos = Path(photos_dir).expanduser()
    scene = Path(scene_dir).expanduser()
    model = camera_model.upper()
    if model not in CAMERA_MODELS:
        raise UserError(f"unknown --camera-model '{camera_model}' (choose from {', '.join(CAMERA_MODELS)})")
    if matcher not in SFM_MATCHERS:
        raise UserError(f"unknown --matcher '{matcher}' (choose from {' | '.join(SFM_MATCHERS)})")
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < MIN_MAX_SIZE:
        raise UserError(f"--max-size must be an integer >= {MIN_MAX_SIZE} pixels, got {max_size!r}")
    if not photos.exists():
        raise UserError(f"photos folder not found: {photos}")
    if not photos.is_dir():
        raise UserError(f"photos path is not a folder: {photos}")
    if photos.resolve() == scene.resolve() or scene.resolve() in photos.resolve().parents:
        # --force would delete the photos themselves
        raise UserError(f"the photos folder {photos} is inside the output folder {scene}; choose another")

    notes: list[str] = []
    candidates = sorted(p for p in photos.iterdir() if p.is_file() and p.suffix.lower() in PHOTO_SUFFIXES)
    readable, sizes, bad = _readable_photos(candidates)
    if bad:
        notes.append(f"skipped {len(bad)} unreadable photo(s), e.g. {bad[0].name}")
    if not readable:
        what = f"{len(candidates)} image file(s), none readable" if candidates else "no image files"
        raise UserError(f"no readable photos in {photos} ({what}; supported: {' '.join(PHOTO_SUFFIXES)})")
    if len(readable) < 2:
        raise UserError(f"SfM needs at least 2 photos, {photos} has {len(readable)} readable one(s)")
    manifest_photos = [{"name": p.name, "bytes": p.stat().st_size} for p in readable]
    same = is_same_sfm_output(scene, manifest_photos)
    replacing = check_replace(scene, MANIFEST, "scene", force, same=same, legacy=_legacy_files)

    names = [p.name for p in readable]
    with workspace(scene, "sfm") as work:
        registered, n_points, error, models = _reconstruct(
            pycolmap, photos, names, sizes, work, model, matcher, max_size, notes, log)
        try:
            result = work / "scene"
            (result / "sparse").mkdir(parents=True)
            os.replace(work / "undistorted" / "images", result / "images")
            os.replace(work / "undistorted" / "sparse", result / "sparse" / "0")
            record: dict[str, Any] = {
                "gstrain": __version__,
                "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "photos_dir": str(photos.resolve()),
                "photos": manifest_photos,
                "camera_model": model,
                "matcher": matcher,
                "max_size": max_size,
                "registered": registered,
                "points": n_points,
                "reprojection_error": error,
            }
            write_manifest(result, MANIFEST, record)
            install(result, scene, MANIFEST, work / "previous", "scene", legacy=_legacy_files)
        except OSError as exc:
            raise UserError(f"SfM could not write its output next to {scene}: {exc.strerror or exc}") from None

    if replacing:
        notes.append(f"replaced the earlier scene in {scene} (only the files listed in its {MANIFEST})")
    for note in notes:
        log(f"gstrain: sfm: {note}")
    return SfmReport(
        scene_dir=scene, num_photos=len(names), num_registered=registered, num_points=n_points,
        reprojection_error=error, num_models=len(models), camera_model=model,
        seconds=time.perf_counter() - start, notes=notes,
    )  # fmt: skip


def _reconstruct(pycolmap: Any, photos: Path, names: list[str], sizes: list[tuple[int, int]], work: Path,
                 model: str, matcher: str, max_size: int, notes: list[str],
                 log: Callable[[str], None]) -> tuple[int, int, float, list[Any]]:
    """The four SfM stages in work/; the undistorted scene lands in work/undistorted.
    Returns (registered images, points, mean reprojection error, every model mapping made)."""
    try:
        with _quiet_colmap(pycolmap):
            db = work / "database.db"
            # One shared camera when all photos have one size (the usual single-camera capture):
            # SfM on few views is far more stable with shared intrinsics.
            single = len(set(sizes)) == 1
            _stage(log, 1, f"extracting SIFT features from {len(names)} photos (max {max_size} px, "
                   f"{model}, {'one shared camera' if single else 'camera per image size'})")  # fmt: skip
            reader = pycolmap.ImageReaderOptions()
            reader.camera_model = model
            extraction = pycolmap.FeatureExtractionOptions()
            extraction.max_image_size = max_size
            pycolmap.extract_features(
                db, photos, image_names=names,
                camera_mode=pycolmap.CameraMode.SINGLE if single else pycolmap.CameraMode.AUTO,
                reader_options=reader, extraction_options=extraction,
            )  # fmt: skip
            with pycolmap.Database.open(db) as database:
                n_in_db = database.num_images()
            if n_in_db < 2:
                raise UserError(f"COLMAP could read only {n_in_db} of the {len(names)} photos in {photos}")
            if n_in_db < len(names):
                notes.append(f"COLMAP could not read {len(names) - n_in_db} of the photos")

            _stage(log, 2, f"matching features ({matcher})")
            verification = pycolmap.TwoViewGeometryOptions()
            verification.ransac.random_seed = _SEED
            if matcher == "exhaustive":
                pycolmap.match_exhaustive(db, verification_options=verification)
            else:
                pycolmap.match_sequential(db, verification_options=verification)
            with pycolmap.Database.open(db) as database:
                # pairs that kept geometrically verified inliers (failed pairs have rows too)
                n_pairs = len(database.read_two_view_geometry_num_inliers()[0])
            log(f"gstrain: sfm: {n_pairs} image pairs verified")
            if n_pairs == 0:
                raise UserError(
                    f"only 0 of {len(names)} photos registered (need at least 2): no two photos share "
                    "verified matches; photos need more overlap or texture"
                )

            _stage(log, 3, "incremental mapping")
            models = _map(pycolmap, db, photos, work / "sparse", len(names))
            if not models:
                raise UserError(
                    f"only 0 of {len(names)} photos registered (need at least 2); "
                    "photos need more overlap or texture"
                )
            best = max(models, key=lambda r: (r.num_reg_images(), r.num_points3D()))
            registered = best.num_reg_images()
            if registered < 2:
                raise UserError(
                    f"only {registered} of {len(names)} photos registered (need at least 2); "
                    "photos need more overlap or texture"
                )
            if len(models) > 1:
                others = ", ".join(str(r.num_reg_images()) for r in models if r is not best)
                notes.append(
                    f"mapping split into {len(models)} models; kept the largest "
                    f"({registered} images; the others had {others})"
                )
            error = float(best.compute_mean_reprojection_error())
            n_points = best.num_points3D()
            model_dir = work / "model"
            model_dir.mkdir()
            best.write(str(model_dir))

            _stage(log, 4, "undistorting to PINHOLE")
            undistorted = work / "undistorted"
            undistort = pycolmap.UndistortCameraOptions()
            undistort.max_image_size = max_size
            pycolmap.undistort_images(undistorted, model_dir, photos, undistort_options=undistort)
    except OSError as exc:
        raise UserError(f"SfM could not write its workspace {work}: {exc.strerror or exc}") from None
    return registered, n_points, error, models


def _stage(log: Callable[[str], None], i: int, text: str) -> None:
    log(f"gstrain: sfm [{i}/4] {text}")


def _readable_photos(files: list[Path]) -> tuple[list[Path], list[tuple[int, int]], list[Path]]:
    """(readable files, their sizes, unreadable files): a header parse plus PIL's integrity check."""
    from PIL import Image

    readable, sizes, bad = [], [], []
    for file in files:
        try:
            with Image.open(file) as img:
                img.verify()
                size = img.size
        except (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError):
            bad.append(file)
            continue
        readable.append(file)
        sizes.append(size)
    return readable, sizes, bad


def is_same_sfm_output(scene: Path, photos: list[dict[str, Any]]) -> bool:
    """True when scene is an earlier `gstrain sfm` output made from these very photos (name + size)."""
    try:
        manifest = json.loads((scene / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("photos") == photos


def _map(pycolmap: Any, db: Path, photos: Path, out: Path, n_images: int) -> list[Any]:
    """Incremental mapping with a progress bar over registered images; all models it made."""
    from tqdm import tqdm

    out.mkdir()
    options = pycolmap.IncrementalPipelineOptions()
    options.random_seed = _SEED
    bar = tqdm(total=n_images, desc="gstrain: sfm mapping", unit="img", leave=False, dynamic_ncols=True)
    try:
        # Called per image registration across every model the mapper tries, so it can pass the
        # photo count; capped so the bar stays an honest "at most this many" for one model.
        def step() -> None:
            if bar.n < n_images:
                bar.update()

        recs = pycolmap.incremental_mapping(db, photos, out, options=options, next_image_callback=step)
    finally:
        bar.close()
    return list(recs.values())


def _legacy_files(manifest: dict[str, Any]) -> list[str]:
    """What gstrain sfm wrote before sfm.json listed its files: the undistorted photos under their
    own names, and the model."""
    photos = manifest.get("photos")
    names = [p["name"] for p in photos if isinstance(p, dict) and isinstance(p.get("name"), str)] \
        if isinstance(photos, list) else []
    model = [f"sparse/0/{m}.bin" for m in ("cameras", "images", "points3D", "rigs", "frames")]
    return [f"images/{n}" for n in names] + model


@contextmanager
def _quiet_colmap(pycolmap: Any) -> Iterator[None]:
    """COLMAP logs every step at INFO level; we report stages ourselves and errors as one line."""
    level = pycolmap.logging.minloglevel
    pycolmap.logging.minloglevel = 3 if not os.environ.get("GSTRAIN_SFM_VERBOSE") else 0
    try:
        yield
    finally:
        pycolmap.logging.minloglevel = level
