"""transforms.json scenes (NeRF/Blender and nerfstudio forms) against their COLMAP twin.

The twin is the generated demo scene; tests/transforms_util.py writes its cameras in the formats'
published conventions, so the COLMAP loader is the independent reference for every view.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pycolmap
import pytest
import torch
from PIL import Image
from transforms_util import colmap_frames, write_blender, write_nerfstudio

from gstrain.config import build_config
from gstrain.data import demo
from gstrain.data.colmap import load_scene as load_colmap
from gstrain.data.demo import write_demo_scene
from gstrain.data.inputs import load_scene
from gstrain.train.trainer import Trainer

SIZE = 48


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("transforms")
    colmap = write_demo_scene(root / "colmap", n_views=16, width=SIZE, height=SIZE)
    return {
        "colmap": colmap,
        "blender": write_blender(colmap, root / "blender", ply=True),
        "blender_no_points": write_blender(colmap, root / "blender_no_points"),
        "nerfstudio": write_nerfstudio(colmap, root / "nerfstudio"),
    }


def _views(scene):
    return [*scene.train, *scene.test]


@pytest.mark.parametrize("form", ["blender", "nerfstudio"])
def test_views_match_the_colmap_twin(scenes, form):
    twin = load_colmap(scenes["colmap"])
    scene = load_scene(scenes[form])
    assert [Path(v.name).name for v in scene.test] == [v.name for v in twin.test] == ["000.png", "008.png"]
    assert [Path(v.name).name for v in scene.train] == [v.name for v in twin.train]
    for got, want in zip(_views(scene), _views(twin), strict=True):
        torch.testing.assert_close(got.viewmat, want.viewmat, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.K, want.K, atol=1e-4, rtol=0)
        assert torch.equal(got.image, want.image) and got.mask is None
    np.testing.assert_allclose(scene.points, twin.points, atol=1e-6)  # ply positions: 8 decimals
    assert np.array_equal(scene.point_colors, twin.point_colors)
    assert scene.extent == pytest.approx(twin.extent, rel=1e-6)
    notes = " ".join(scene.notes)
    if form == "blender":
        assert "transforms_val.json is not used" in notes
    else:
        assert "applied_transform" in notes


def test_per_frame_intrinsics_and_factor(scenes, tmp_path):
    camera, *_ = colmap_frames(scenes["colmap"])
    fx, fy, cx, cy = camera.params
    zero_opencv = {"camera_model": "OPENCV", "fl_x": fx, "fl_y": fy, "cx": cx, "cy": cy,
                   "w": SIZE, "h": SIZE, "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0}
    scene = load_scene(write_nerfstudio(scenes["colmap"], tmp_path / "ns", zero_opencv, per_frame=True), factor=2)
    twin = load_colmap(scenes["colmap"], factor=2)
    for got, want in zip(_views(scene), _views(twin), strict=True):
        torch.testing.assert_close(got.K, want.K, atol=1e-4, rtol=0)
        assert got.image.shape == (SIZE // 2, SIZE // 2, 3) and torch.equal(got.image, want.image)
    assert not any("undistorted" in n for n in scene.notes)  # zero distortion is a pinhole


def test_alpha_is_composited_over_the_background(scenes, tmp_path):
    scene_dir = tmp_path / "rgba"
    shutil.copytree(scenes["blender"], scene_dir)
    rgb = np.asarray(Image.open(scene_dir / "images" / "000.png").convert("RGB"))
    alpha = np.tile(np.linspace(0, 255, SIZE).round().astype(np.uint8), (SIZE, 1))
    Image.fromarray(np.dstack([rgb, alpha])).save(scene_dir / "images" / "000.png")
    view = load_scene(scene_dir, background=(1.0, 0.5, 0.0)).test[0]
    a = alpha[..., None] / 255.0
    want = np.rint(rgb * a + np.array([255.0, 127.5, 0.0]) * (1 - a))
    assert np.abs(view.image.numpy().astype(float) - want).max() <= 0.5 + 1e-9
    assert view.mask is None  # composited alpha is no mask


def _fisheye_scene(out: Path, size: int) -> tuple[Path, pycolmap.Camera]:
    """The demo scene ray-cast through an OPENCV_FISHEYE camera, written as nerfstudio form."""
    n_views = 8
    focal = 0.5 * size / np.tan(np.radians(demo.FOV_DEG) / 2)
    camera = pycolmap.Camera(model="OPENCV_FISHEYE", width=size, height=size,
                             params=[focal, focal, size / 2, size / 2, -0.1, 0.02, 0.0, 0.0])
    (out / "images").mkdir(parents=True)
    frames = []
    offsets = (np.arange(2) + 0.5) / 2
    xs = (np.arange(size)[:, None] + offsets).ravel()
    grid = np.stack(np.meshgrid(xs, xs), -1).reshape(-1, 2)
    normalized = camera.cam_from_img(grid)  # the fisheye model's own inverse: the known answer
    for i, center in enumerate(demo._camera_centers(n_views)):
        R, t = demo._look_at(center)
        dirs = np.hstack([normalized, np.ones((len(grid), 1))]) @ R
        dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
        dist, on_sphere = demo._ray_cast(center, dirs)
        rgb = np.zeros((len(dirs), 3))
        hit = np.isfinite(dist)
        rgb[hit] = demo._shade(center + dist[hit, None] * dirs[hit], on_sphere[hit])
        rgb = rgb.reshape(size, 2, size, 2, 3).mean(axis=(1, 3))
        Image.fromarray(demo._to_uint8(rgb)).save(out / "images" / f"{i:03d}.png")
        c2w = np.eye(4)
        c2w[:3, :3], c2w[:3, 3] = R.T, center
        c2w[:3, 1:3] *= -1
        frames.append({"file_path": f"images/{i:03d}.png", "transform_matrix": c2w.tolist()})
    meta = {"camera_model": "OPENCV_FISHEYE", "fl_x": focal, "fl_y": focal, "cx": size / 2, "cy": size / 2,
            "w": size, "h": size, "k1": -0.1, "k2": 0.02, "k3": 0.0, "k4": 0.0, "frames": frames}
    (out / "transforms.json").write_text(json.dumps(meta))
    return out, camera


def test_fisheye_is_undistorted_to_the_pinhole_view(tmp_path):
    size = 96
    scene_dir, camera = _fisheye_scene(tmp_path / "fisheye", size)
    scene = load_scene(scene_dir, test_every=0)
    assert "undistorted 8 OPENCV_FISHEYE images to PINHOLE" in " ".join(scene.notes)
    for i, view in enumerate(scene.train):
        R, t = demo._look_at(demo._camera_centers(8)[i])
        K = view.K.double().numpy()
        pinhole = demo._render(R, t, K, view.width, view.height).astype(float)  # truth at the new K
        got = view.image.numpy().astype(float)
        inner = (slice(2, -2), slice(2, -2))  # bilinear resampling reaches past the frame at the edge
        err = np.abs(got[inner] - pinhole[inner]).mean()
        assert err < 4.0, (view.name, err)  # measured ~2.4 of 255: resampling blur
        # reading the fisheye image as a pinhole one (its own fx, fy, cx, cy) is far worse
        raw = np.asarray(Image.open(scene_dir / "images" / f"{i:03d}.png")).astype(float)
        naive = demo._render(R, t, camera.calibration_matrix(), size, size).astype(float)
        assert np.abs(raw - naive).mean() > 3 * err  # measured ~9.8
        torch.testing.assert_close(view.viewmat[:3, :3], torch.from_numpy(R).float(), atol=1e-6, rtol=0)
    cfg = build_config(overrides=[_train_overrides(4)])
    run = tmp_path / "run"
    run.mkdir()
    result = Trainer(cfg, scene, run, torch.device("cpu"), log=lambda m: None).fit()
    assert result.status == "done"


def _train_overrides(steps: int) -> dict:
    return {
        "train": {"steps": steps}, "model": {"sh_degree": 0, "init_points": 3000},
        "strategy": {"refine_start": 10 * steps},
        "log": {"progress_every": 10**6, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [], "save_steps": []},
    }


def _final_psnr(scene_dir: Path, run_dir: Path, steps: int) -> float:
    cfg = build_config(overrides=[_train_overrides(steps)])
    run_dir.mkdir()
    scene = load_scene(scene_dir)
    result = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None).fit()
    assert result.status == "done"
    return float(result.final_test_psnr)


def test_both_forms_train_like_the_colmap_twin(scenes, tmp_path):
    steps = 30
    twin = _final_psnr(scenes["colmap"], tmp_path / "colmap", steps)
    for form in ("blender", "nerfstudio"):
        assert _final_psnr(scenes[form], tmp_path / form, steps) == pytest.approx(twin, abs=0.05), form


@pytest.mark.parametrize("text", [False, True])
def test_ply_points_read_like_plyfile(tmp_path, text):
    from plyfile import PlyData, PlyElement  # an independent PLY writer

    from gstrain.data.ply_points import read_ply_points

    rng = np.random.default_rng(0)
    rows = np.zeros(50, dtype=[("nx", "f4"), ("x", "f8"), ("y", "f8"), ("z", "f8"),
                               ("red", "u1"), ("green", "u1"), ("blue", "u1"), ("alpha", "u1")])
    for key in ("nx", "x", "y", "z"):
        rows[key] = rng.normal(size=50)
    for key in ("red", "green", "blue", "alpha"):
        rows[key] = rng.integers(0, 256, 50)
    path = tmp_path / "points.ply"
    PlyData([PlyElement.describe(rows, "vertex"), PlyElement.describe(np.zeros(2, [("i", "i4")]), "face")],
            text=text).write(str(path))
    xyz, rgb = read_ply_points(path)
    np.testing.assert_allclose(xyz, np.stack([rows["x"], rows["y"], rows["z"]], 1).astype(np.float32), rtol=1e-6)
    assert np.array_equal(rgb, np.stack([rows["red"], rows["green"], rows["blue"]], 1))


def test_named_split_and_prescaled_images(scenes, tmp_path):
    scene_dir = write_nerfstudio(scenes["colmap"], tmp_path / "ns")
    meta = json.loads((scene_dir / "transforms.json").read_text())
    meta["train_filenames"] = [f"images/{i:03d}.png" for i in range(2, 16)]
    meta["test_filenames"] = ["images/001"]  # without its extension, as file_path may be
    (scene_dir / "transforms.json").write_text(json.dumps(meta))
    small = scene_dir / "images_2"  # nerfstudio's downscaled copies, marked so their use shows
    small.mkdir()
    for file in (scene_dir / "images").iterdir():
        Image.new("RGB", (SIZE // 2, SIZE // 2), (10, 200, 30)).save(small / file.name)
    scene = load_scene(scene_dir, factor=2)
    assert [v.name for v in scene.test] == ["images/001.png"]
    assert [v.name for v in scene.train] == [f"images/{i:03d}.png" for i in range(2, 16)]
    assert "1 frames are in neither" in " ".join(scene.notes)
    assert all((v.image == torch.tensor([10, 200, 30], dtype=torch.uint8)).all() for v in _views(scene))
    twin = load_colmap(scenes["colmap"], factor=2)
    torch.testing.assert_close(scene.test[0].K, twin.train[0].K, atol=1e-4, rtol=0)
