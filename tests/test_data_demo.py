"""The demo scene: a valid COLMAP scene on disk that loads through the same path as user scenes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pycolmap
import pytest
from PIL import Image

from gstrain.data.colmap import load_scene
from gstrain.data.demo import write_demo_scene
from gstrain.data.scene import Scene
from gstrain.errors import UserError


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_scene(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def demo(demo_dir: Path) -> Scene:
    return load_scene(demo_dir)


def test_layout_and_split(demo_dir: Path, demo: Scene) -> None:
    assert len(list((demo_dir / "images").glob("*.png"))) == 32
    for name in ("cameras", "images", "points3D"):
        assert (demo_dir / "sparse" / "0" / f"{name}.bin").is_file()
    assert len(demo.test) == 4 and len(demo.train) == 28
    assert [v.name for v in demo.test] == ["000.png", "008.png", "016.png", "024.png"]
    assert demo.notes == []
    assert len(demo.points) > 1000 and demo.points.dtype == np.float32
    assert demo.point_colors.shape == demo.points.shape and demo.point_colors.dtype == np.uint8
    for view in demo.train + demo.test:
        assert view.image.shape == (128, 128, 3)
    # Not a blank render: the object fills a good part of every view, with many colours.
    img = demo.test[0].image.numpy()
    assert 0.3 < (img.sum(axis=2) > 0).mean() < 0.95
    assert len(np.unique(img.reshape(-1, 3) // 32, axis=0)) > 20
    assert 3.0 < demo.extent < 10.0


def test_model_is_a_valid_reconstruction(demo_dir: Path) -> None:
    rec = pycolmap.Reconstruction(str(demo_dir / "sparse" / "0"))
    assert rec.is_valid() and rec.num_reg_images() == 32
    assert rec.cameras[1].model_name == "PINHOLE"
    rec.update_point_3d_errors()
    assert rec.compute_mean_reprojection_error() < 1e-6
    assert rec.compute_mean_track_length() >= 2


def test_points_reproject_onto_their_observations(demo_dir: Path, demo: Scene) -> None:
    """x_pix = K (R X + t) / z lands on the recorded points2D (pixel centres at +0.5 in both)."""
    rec = pycolmap.Reconstruction(str(demo_dir / "sparse" / "0"))
    views = {v.name: v for v in demo.train + demo.test}
    n_checked = 0
    for image in rec.images.values():
        view = views[image.name]
        obs = [p for p in image.points2D if p.has_point3D()]
        xyz = np.array([rec.points3D[p.point3D_id].xyz for p in obs])
        cam = xyz @ view.viewmat[:3, :3].double().numpy().T + view.viewmat[:3, 3].double().numpy()
        uv = cam @ view.K.double().numpy().T
        uv = uv[:, :2] / uv[:, 2:3]
        np.testing.assert_allclose(uv, np.array([p.xy for p in obs]), atol=1e-3)
        n_checked += len(obs)
    assert n_checked > 10_000


def test_point_colours_match_the_images(demo: Scene, demo_dir: Path) -> None:
    """Each observation's pixel shows (about) the point's colour: points, poses and images agree."""
    rec = pycolmap.Reconstruction(str(demo_dir / "sparse" / "0"))
    views = {v.name: v for v in demo.train + demo.test}
    diffs = []
    for image in rec.images.values():
        img = views[image.name].image.numpy().astype(np.float64)
        for p in image.points2D:
            x, y = (int(c) for c in p.xy)
            diffs.append(np.abs(img[y, x] - rec.points3D[p.point3D_id].color).max())
    # Texture edges and antialiasing make a few pixels differ; most must be close.
    assert np.median(diffs) < 12


def test_deterministic_for_a_seed(tmp_path: Path, demo_dir: Path) -> None:
    again = write_demo_scene(tmp_path / "again")
    for name in ("000.png", "031.png"):
        assert (again / "images" / name).read_bytes() == (demo_dir / "images" / name).read_bytes()
    assert (again / "sparse/0/points3D.bin").read_bytes() == (demo_dir / "sparse/0/points3D.bin").read_bytes()
    other = write_demo_scene(tmp_path / "other", n_views=4, width=32, height=24, seed=1)
    assert (other / "sparse/0/points3D.bin").read_bytes() != (demo_dir / "sparse/0/points3D.bin").read_bytes()
    small = load_scene(other, test_every=0)
    assert len(small.train) == 4 and small.train[0].image.shape == (24, 32, 3)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(UserError):
        write_demo_scene(tmp_path, n_views=1)
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        write_demo_scene(tmp_path / "f")


def test_camera_distances_cycle_and_keep_the_sphere_in_frame(tmp_path: Path) -> None:
    """distances=(3, 4.5, 6.5): camera centres at those norms, cycled over the views; at the
    closest one (the smallest allowed) every sphere point facing the camera projects inside the
    image, by the loaded pose and intrinsics."""
    distances = (3.0, 4.5, 6.5)
    folder = write_demo_scene(tmp_path / "near_far", n_views=8, width=32, height=32, distances=distances)
    scene = load_scene(folder, test_every=0)
    views = sorted(scene.train, key=lambda v: v.name)
    centres = [-(v.viewmat[:3, :3].T.double() @ v.viewmat[:3, 3].double()).numpy() for v in views]
    expected = [distances[i % 3] for i in range(8)]
    assert np.allclose([np.linalg.norm(c) for c in centres], expected, atol=1e-5)
    assert json.loads((folder / "demo-scene.json").read_text())["distances"] == [3.0, 4.5, 6.5]
    normals = np.random.default_rng(0).normal(size=(4000, 3))
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)  # the unit sphere at the origin
    for view, centre in zip(views, centres, strict=True):
        facing = normals[normals @ centre > 1.0]  # seen from outside: n . (c - n) > 0
        viewmat, K = view.viewmat.double().numpy(), view.K.double().numpy()
        cam = facing @ viewmat[:3, :3].T + viewmat[:3, 3]
        uv = cam[:, :2] / cam[:, 2:] * K.diagonal()[:2] + K[:2, 2]
        assert (cam[:, 2] > 0).all() and (uv > 0).all() and (uv < 32).all(), view.name


@pytest.mark.parametrize("distances", [(), (2.9,), (4.5, float("inf")), (float("nan"),)])
def test_bad_camera_distances(tmp_path: Path, distances: tuple[float, ...]) -> None:
    with pytest.raises(UserError, match="camera distances must be finite and >= 3.0"):
        write_demo_scene(tmp_path / "scene", n_views=4, width=16, height=16, distances=distances)
    assert not (tmp_path / "scene").exists()


def test_default_layout_is_unchanged(tmp_path: Path) -> None:
    """Without distances or elevations the scene is the one the code wrote before they existed:
    digests of its decoded pixels and its points, taken from that code (main at 19c8e16)."""
    folder = write_demo_scene(tmp_path / "scene", n_views=6, width=24, height=24, seed=0)
    pixels = hashlib.sha256()
    for path in sorted((folder / "images").glob("*.png")):
        pixels.update(np.asarray(Image.open(path).convert("RGB")).tobytes())
    assert pixels.hexdigest() == "84fcc52dc1f434963a90be81b286b93f7e1aa660febe769f8901e2d3b6319646"
    points = load_scene(folder, test_every=0).points
    assert hashlib.sha256(points.tobytes()).hexdigest() == (
        "f914804c59fdf5cf86822231ccc558d9f761b7a575e0266920981ef532e505e4"
    )
    assert "distances" not in json.loads((folder / "demo-scene.json").read_text())


def test_ring_elevations(tmp_path: Path) -> None:
    """elevations=(10, 40, 70) over 9 views: three rings of three, each camera at its ring's
    elevation above the sphere's centre and at the default distance."""
    folder = write_demo_scene(tmp_path / "rings", n_views=9, width=16, height=16, elevations=(10, 40, 70))
    views = sorted(load_scene(folder, test_every=0).train, key=lambda v: v.name)
    centres = np.array([-(v.viewmat[:3, :3].T.double() @ v.viewmat[:3, 3].double()).numpy() for v in views])
    radius = np.linalg.norm(centres, axis=1)
    assert np.allclose(radius, 4.5, atol=1e-5)
    elevation = np.degrees(np.arcsin(centres[:, 2] / radius))
    assert np.allclose(elevation, [10] * 3 + [40] * 3 + [70] * 3, atol=1e-3)


@pytest.mark.parametrize("elevations", [(), (-5.0,), (30.0, 85.0), (float("nan"),), tuple(range(5))])
def test_bad_ring_elevations(tmp_path: Path, elevations: tuple[float, ...]) -> None:
    with pytest.raises(UserError, match="ring elevations must be 1 to 4 angles from 0.0 to 80.0 degrees"):
        write_demo_scene(tmp_path / "scene", n_views=4, width=16, height=16, elevations=elevations)
    assert not (tmp_path / "scene").exists()
