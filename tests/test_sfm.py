"""`gstrain sfm`: generated photos -> SfM -> a scene `gstrain fit` trains on; and its bad inputs.

The photos come from a small ray-cast scene (a sphere on a disc) with a posterised solid noise
texture: unlike the demo scene's periodic checkers, it is non-repetitive and corner-rich, so SIFT
matching is unambiguous and COLMAP recovers the true focal length from 160 px images in seconds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pycolmap
import pytest
from cli_util import assert_one_error, call_cli, run_cli
from PIL import Image

N_PHOTOS = 36
SIZE = 160
FOV_DEG = 48.0


def _solid_texture(points: np.ndarray, seed: int = 1, n: int = 48) -> np.ndarray:
    """RGB in [0,1] of 3D points: random-direction sine sums (no period), posterised to 4 levels."""
    rng = np.random.default_rng(seed)
    dirs = rng.normal(size=(3 * n, 3))
    freqs = dirs / np.linalg.norm(dirs, axis=1, keepdims=True) * rng.uniform(3.0, 30.0, size=(3 * n, 1))
    phases = rng.uniform(0, 2 * np.pi, 3 * n)
    amps = 1.0 / np.linalg.norm(freqs, axis=1)  # 1/f: smooth blobs with finer detail on top
    waves = np.sin(points @ freqs.T + phases) * amps
    field = waves.reshape(len(points), 3, n).sum(-1)
    field /= np.abs(field).max(0) + 1e-9
    # sharp band edges and their junctions are what SIFT finds and matches
    return np.floor(np.clip(0.5 + 0.8 * field, 0, 0.999) * 4) / 3


def render_photos(out: Path, n_views: int = N_PHOTOS, size: int = SIZE) -> Path:
    """Ray-cast n_views PNGs around a textured unit sphere resting on a disc (black background)."""
    out.mkdir(parents=True, exist_ok=True)
    focal = 0.5 * size / np.tan(np.radians(FOV_DEG) / 2)
    offs = np.array([0.25, 0.75])  # 2x2 supersampling: antialiased like a photo
    xs = (np.arange(size)[:, None] + offs).ravel()
    gx, gy = np.meshgrid(xs, xs)
    rays = np.stack([(gx - size / 2) / focal, (gy - size / 2) / focal, np.ones_like(gx)], -1).reshape(-1, 3)
    for i in range(n_views):
        az = 2 * np.pi * i / n_views
        el = np.radians(30 + 8 * np.sin(3 * az))  # varying height: a less degenerate capture
        centre = 4.0 * np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
        fwd = -centre / np.linalg.norm(centre)
        right = np.cross(fwd, [0.0, 0.0, 1.0])
        right /= np.linalg.norm(right)
        R = np.stack([right, np.cross(fwd, right), fwd])
        d = rays @ R
        d /= np.linalg.norm(d, axis=1, keepdims=True)
        b = d @ centre
        disc = b * b - (centre @ centre - 1.0)
        s_sphere = np.where(disc >= 0, -b - np.sqrt(np.maximum(disc, 0)), np.inf)
        with np.errstate(divide="ignore", invalid="ignore"):
            s_plane = (-1.0 - centre[2]) / d[:, 2]
        hit = centre + np.nan_to_num(s_plane, posinf=0, neginf=0)[:, None] * d
        s_plane = np.where((s_plane > 0) & (np.hypot(hit[:, 0], hit[:, 1]) < 3.0), s_plane, np.inf)
        s = np.minimum(s_sphere, s_plane)
        rgb = np.zeros((len(d), 3))
        ok = np.isfinite(s)
        rgb[ok] = _solid_texture(centre + s[ok, None] * d[ok])
        img = rgb.reshape(size, 2, size, 2, 3).mean((1, 3))
        Image.fromarray(np.round(img * 255).astype(np.uint8)).save(out / f"photo_{i:03d}.png")
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_photos(tmp_path_factory.mktemp("sfm") / "photos")


def _registered(scene: Path) -> pycolmap.Reconstruction:
    return pycolmap.Reconstruction(str(scene / "sparse" / "0"))


@pytest.mark.slow
def test_photos_to_sfm_to_fit(photos: Path, tmp_path: Path) -> None:
    scene = tmp_path / "scene"
    t0 = time.perf_counter()
    proc = run_cli("sfm", photos, scene)
    sfm_seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert "[3/4] incremental mapping" in proc.stderr  # per-stage progress
    assert "registered" in proc.stdout and "reprojection error" in proc.stdout
    print(f"sfm: {sfm_seconds:.1f}s; {proc.stdout.strip()}")

    rec = _registered(scene)
    assert rec.num_reg_images() >= 0.8 * N_PHOTOS
    assert {cam.model_name for cam in rec.cameras.values()} <= {"PINHOLE", "SIMPLE_PINHOLE"}
    assert rec.compute_mean_reprojection_error() < 2.0
    true_focal = 0.5 * SIZE / np.tan(np.radians(FOV_DEG) / 2)
    for cam in rec.cameras.values():
        # undistortion may rescale the image a little; focal per pixel of width stays put
        assert abs(cam.focal_length_x / cam.width - true_focal / SIZE) < 0.1 * true_focal / SIZE
    names = {im.name for im in rec.images.values()}
    assert all((scene / "images" / name).is_file() for name in names)
    manifest = json.loads((scene / "sfm.json").read_text())
    assert len(manifest["photos"]) == N_PHOTOS and manifest["registered"] == rec.num_reg_images()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # workspace cleaned up

    run = tmp_path / "run"
    t0 = time.perf_counter()
    # factor 2 (80 px) halves the CPU time and also runs the loader's downscale on an SfM scene
    code, err = call_cli("fit", scene, "--steps", "150", "--factor", "2", "--out", run,
                         "--set", "log.progress_every=10", "--set", "log.eval_steps=[0]")
    assert code == 0, err
    print(f"fit 150 steps: {time.perf_counter() - t0:.1f}s")
    summary = json.loads((run / "train_summary.json").read_text())
    assert summary["final_test_psnr"] > summary["initial_test_psnr"], summary


def test_rerun_same_photos_replaces_but_other_scene_needs_force(photos: Path, tmp_path: Path) -> None:
    scene = tmp_path / "scene"
    assert run_cli("sfm", photos, scene, "--matcher", "sequential").returncode == 0
    again = run_cli("sfm", photos, scene, "--matcher", "sequential")  # our own output, same photos
    assert again.returncode == 0, again.stderr
    assert _registered(scene).num_reg_images() >= 0.8 * N_PHOTOS

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("someone else's work")
    for force in ([], ["--force"]):  # not gstrain's: refused, and named, even with --force
        assert_one_error(*call_cli("sfm", photos, other, *force), "did not write", "notes.txt")
    assert (other / "notes.txt").read_text() == "someone else's work"  # untouched

    # beside our own scene, the user's notes survive a --force that replaces the scene
    (scene / "notes.txt").write_text("the user's notes")
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    for p in sorted(photos.iterdir())[:-2]:
        (fewer / p.name).write_bytes(p.read_bytes())
    assert_one_error(*call_cli("sfm", fewer, scene), "earlier scene", "--force")
    forced = run_cli("sfm", fewer, scene, "--force", "--camera-model", "pinhole", "--max-size", "128")
    assert forced.returncode == 0, forced.stderr
    assert (scene / "notes.txt").read_text() == "the user's notes"
    rec = _registered(scene)
    assert max(max(c.width, c.height) for c in rec.cameras.values()) <= 128
    assert {p.name for p in (scene / "images").iterdir()} == {im.name for im in rec.images.values()}


def test_no_readable_photos(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "readme.txt").write_text("not a photo")
    assert_one_error(*call_cli("sfm", folder, tmp_path / "out"), "no readable photos", "no image files")
    (folder / "broken.png").write_bytes(b"\x89PNG garbage")
    assert_one_error(*call_cli("sfm", folder, tmp_path / "out"), "no readable photos", "none readable")
    assert not (tmp_path / "out").exists()


def test_single_photo(photos: Path, tmp_path: Path) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "a.png").write_bytes((photos / "photo_000.png").read_bytes())
    assert_one_error(*call_cli("sfm", folder, tmp_path / "out"), "at least 2")


def test_fewer_than_two_register(tmp_path: Path) -> None:
    folder = tmp_path / "noise"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):  # unrelated random images: features, but nothing that verifies
        Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(folder / f"n{i}.png")
    assert_one_error(*call_cli("sfm", folder, tmp_path / "out"), "registered", "need at least 2")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # workspace cleaned up


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--camera-model", "BOGUS"], "camera-model"),
        (["--matcher", "vocab"], "matcher"),
        (["--max-size", "8"], "max-size"),
        (["--max-size", "big"], "max-size"),
    ],
)
def test_bad_flags(photos: Path, tmp_path: Path, flags: list[str], needle: str) -> None:
    assert_one_error(*call_cli("sfm", photos, tmp_path / "out", *flags), needle)


def test_bad_paths(photos: Path, tmp_path: Path) -> None:
    assert_one_error(*call_cli("sfm", tmp_path / "nope", tmp_path / "out"), "not found")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert_one_error(*call_cli("sfm", photos, a_file), "not a folder")
    # the photos inside the output folder: --force would delete them
    assert_one_error(*call_cli("sfm", photos, photos.parent, "--force"), "inside the output folder")
