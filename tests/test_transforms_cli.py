"""transforms.json scenes through the real commands: fit, eval, render and the viewer's loader
accept them; bad or partial files end in one line naming the field; a scene without points starts
from random points where the cameras look."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_util import assert_one_error, call_cli
from transforms_util import write_blender, write_nerfstudio

from gstrain.data.demo import CAMERA_DISTANCE, DISC_RADIUS, write_demo_scene
from gstrain.data.inputs import load_scene
from gstrain.data.view_volume import FAR_FRACTION, NEAR_FRACTION, view_volume_points
from gstrain.model import random_points

TINY = ["--device", "cpu", "--set", "model.sh_degree=0", "--set", "model.init_points=2000",
        "--set", "log.progress_every=2", "--set", "strategy.refine_start=100", "--seed", "5"]


@pytest.fixture(scope="module")
def colmap(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_scene(tmp_path_factory.mktemp("tcli") / "colmap", n_views=16, width=32, height=32)


@pytest.fixture(scope="module")
def blender(colmap: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_blender(colmap, tmp_path_factory.mktemp("tcli_b") / "blender")


def _seen_by(points: np.ndarray, views, near: float, far: float) -> np.ndarray:
    """How many views see each point (in frame, depth in (near, far)): brute force per view."""
    count = np.zeros(len(points), int)
    for view in views:
        m = view.viewmat.double().numpy()
        cam = points.astype(np.float64) @ m[:3, :3].T + m[:3, 3]
        uv = cam @ view.K.double().numpy().T
        u, v = uv[:, 0] / uv[:, 2], uv[:, 1] / uv[:, 2]
        count += (cam[:, 2] > near) & (cam[:, 2] < far) & (u >= 0) & (u < view.width) & (v >= 0) & (v < view.height)
    return count


def test_random_points_fill_the_view_volume(blender):
    scene = load_scene(blender)
    assert len(scene.points) == 0 and not scene.points_expected
    assert any("random points in the cameras' view volume" in n for n in scene.notes)
    pts, cols = view_volume_points(scene.train, 4000, scene.extent, seed=3)
    assert pts.shape == (4000, 3) and cols.shape == (4000, 3) and pts.dtype == np.float32
    near, far = NEAR_FRACTION * scene.extent, FAR_FRACTION * scene.extent
    seen = _seen_by(pts, scene.train, near, far)
    assert (seen >= 1).all()
    # The views look at the demo object together: most points sit where most views overlap,
    # within the ground disc's radius of the origin (cameras are CAMERA_DISTANCE away).
    near_object = np.linalg.norm(pts, axis=1) < DISC_RADIUS
    assert near_object.mean() > 0.35, near_object.mean()  # measured 0.46
    assert np.median(seen) >= len(scene.train) // 3, np.median(seen)
    # the old ball around the cameras (still model.init=random on COLMAP scenes) puts far fewer there
    centers = np.stack([v.camera_center.numpy() for v in scene.train])
    ball, _ = random_points(4000, centers.mean(axis=0), scene.extent, seed=3)
    assert (np.linalg.norm(ball, axis=1) < DISC_RADIUS).mean() < near_object.mean() / 2  # measured 0.15
    assert (_seen_by(ball, scene.train, near, far) == 0).mean() > 0.3  # measured 0.52: seen by no view
    assert CAMERA_DISTANCE > DISC_RADIUS  # the cameras are outside that region


def test_fit_eval_render_and_viewer_accept_a_blender_scene(blender, tmp_path):
    run = tmp_path / "run"
    code, err = call_cli("fit", blender, "--out", run, "--steps", "4", *TINY)  # no points, no --set model.init
    assert code == 0, err
    assert "initialising 2000 random Gaussians" in err and "NeRF/Blender" in err
    code, err = call_cli("eval", run, "--device", "cpu")
    assert code == 0, err
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["psnr"] > 0 and len(list((run / "renders" / "test").glob("*.png"))) == 2
    out = tmp_path / "frames"
    code, err = call_cli("render", run, "--path", "test", "--out", out, "--device", "cpu")
    assert code == 0, err
    assert len(list(out.glob("*.png"))) == 2  # transforms_test.json's two views
    from gstrain.viewer.run_info import load_run_info

    info = load_run_info(run, log=lambda m: None)
    assert info.scene is not None and len(info.scene.train) == 14


def _edit(scene: Path, name: str, change) -> None:
    path = scene / name
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def _fit_fails(scene: Path, tmp_path: Path, *needles: str) -> None:
    out = tmp_path / "run"
    assert_one_error(*call_cli("fit", scene, "--out", out, "--steps", "1", *TINY), *needles)
    assert not out.exists()  # bad input writes nothing


def _frame0(key: str, value=None):
    def change(meta):
        if value is None:
            del meta["frames"][0][key]
        else:
            meta["frames"][0][key] = value
    return change


BLENDER_FAULTS = [
    ("transforms_train.json", lambda m: m.pop("camera_angle_x"), ("camera_angle_x", "fl_x", "frame 0")),
    ("transforms_train.json", lambda m: m.pop("frames"), ("'frames' is missing", "transforms_train.json")),
    ("transforms_train.json", lambda m: m.update(frames=[]), ("'frames' is missing or empty",)),
    ("transforms_train.json", _frame0("transform_matrix", [[1, 0, 0], [0, 1, 0], [0, 0, 1]]),
     ("'transform_matrix' must be a 4x4 matrix, got shape 3x3", "frame 0")),
    ("transforms_train.json", _frame0("transform_matrix"), ("'transform_matrix' is missing",)),
    ("transforms_train.json", _frame0("transform_matrix", np.diag([2.0, 1, 1, 1]).tolist()),
     ("not a rigid camera pose",)),
    ("transforms_train.json", _frame0("file_path"), ("'file_path' is missing", "frame 0")),
    ("transforms_train.json", _frame0("file_path", "./images/nope"), ("image file not found", "nope")),
    ("transforms_test.json", lambda m: m.update(camera_angle_x=4.0), ("camera_angle_x", "transforms_test.json")),
    ("transforms_train.json", lambda m: m.update(ply_file_path="gone.ply"), ("ply_file_path", "gone.ply")),
]


@pytest.mark.parametrize("name, change, needles", BLENDER_FAULTS, ids=[f[2][0][:30] for f in BLENDER_FAULTS])
def test_bad_blender_fields(blender, tmp_path, name, change, needles):
    scene = tmp_path / "scene"
    shutil.copytree(blender, scene)
    _edit(scene, name, change)
    _fit_fails(scene, tmp_path, *needles)


NERFSTUDIO_FAULTS = [
    (lambda m: m.update(camera_model="EQUIRECTANGULAR"), ("unknown camera_model 'EQUIRECTANGULAR'",)),
    (lambda m: m.pop("fl_y"), ("'fl_y' is missing",)),
    (lambda m: m.update(fl_x="wide"), ("'fl_x' must be a finite number",)),
    (lambda m: m.update(camera_model="OPENCV", k4=0.1), ("'k4'",)),
    (lambda m: m.update(w=0), ("'w' must be a whole number",)),
    (lambda m: m.update(applied_transform=[[1, 0], [0, 1]]), ("'applied_transform' must be a 4x4 matrix",)),
]


@pytest.mark.parametrize("change, needles", NERFSTUDIO_FAULTS, ids=[f[1][0][:30] for f in NERFSTUDIO_FAULTS])
def test_bad_nerfstudio_fields(colmap, tmp_path, change, needles):
    scene = write_nerfstudio(colmap, tmp_path / "scene")
    _edit(scene, "transforms.json", change)
    _fit_fails(scene, tmp_path, *needles)


def test_not_json_and_not_a_scene(colmap, tmp_path):
    scene = write_nerfstudio(colmap, tmp_path / "scene")
    (scene / "transforms.json").write_text("{ not json")
    _fit_fails(scene, tmp_path, "not valid JSON", "transforms.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fit_fails(empty, tmp_path, "no scene found", "sparse", "transforms.json")
