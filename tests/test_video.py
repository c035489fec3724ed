"""`gstrain render`: camera paths (geometry), depth rendering, and the command on a tiny run."""

from __future__ import annotations

import math
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli, run_cli

from gstrain.camera_paths import camera_path, focus_point, orbit_frame, parse_size, scale_camera
from gstrain.config import RenderConfig
from gstrain.data.colmap import load_scene
from gstrain.errors import UserError
from gstrain.render import Renderer
from gstrain.video import colorize_depth, colormap, depth_range


@pytest.fixture(scope="module")
def views(demo_scene: Path) -> list:
    scene = load_scene(demo_scene, test_every=8)
    return sorted([*scene.train, *scene.test], key=lambda v: v.name)


def _centre(vm: torch.Tensor) -> np.ndarray:
    vm = vm.double().numpy()
    return -vm[:3, :3].T @ vm[:3, 3]


def test_focus_point_lies_on_every_camera_axis(views) -> None:
    centres = np.stack([_centre(v.viewmat) for v in views])
    forwards = np.stack([v.viewmat.double().numpy()[2, :3] for v in views])
    focus = focus_point(centres, forwards)
    for c, d in zip(centres, forwards, strict=True):
        off = focus - c
        assert np.linalg.norm(off - (off @ d) * d) < 1e-3  # distance from the optical axis
        assert off @ d > 0  # in front of the camera


def test_orbit_looks_at_focus_from_equal_distance_in_the_camera_plane(views) -> None:
    n = 7
    cams = camera_path(views, "orbit", n)
    assert len(cams) == n
    focus, up, height, radius = orbit_frame(views)
    assert abs(up @ np.array([0.0, 0.0, 1.0])) > 0.99  # the demo's rings are horizontal
    dists = []
    for vm, K, w, h in cams:
        assert (w, h) == (views[0].width, views[0].height)
        assert torch.equal(K, views[0].K)
        p = vm.double().numpy() @ np.append(focus, 1.0)
        assert abs(p[0]) < 1e-4 * p[2] and abs(p[1]) < 1e-4 * p[2] and p[2] > 0  # dead ahead
        c = _centre(vm)
        assert (c - focus) @ up == pytest.approx(height, abs=1e-4)
        dists.append(np.linalg.norm(c - focus))
        R = vm.double().numpy()[:3, :3]
        assert np.allclose(R @ R.T, np.eye(3), atol=1e-5)
        assert -R[1] @ up > 0  # image up points to world up: not upside down
    assert np.ptp(dists) < 1e-4
    assert dists[0] == pytest.approx(math.hypot(height, radius), rel=1e-4)
    # the mean camera distance of the capture (the demo's cameras are 4.5 from their target)
    assert dists[0] == pytest.approx(np.mean([np.linalg.norm(_centre(v.viewmat) - focus) for v in views]), rel=0.05)


def test_spiral_and_dataset_paths(views) -> None:
    spiral = camera_path(views, "spiral", 10)
    assert len(spiral) == 10
    centres = np.stack([_centre(vm) for vm, *_ in spiral])
    assert np.isfinite(centres).all()
    assert np.linalg.norm(np.diff(centres, axis=0), axis=1).min() > 1e-3  # it moves every frame
    # every frame looks at one target point
    forwards = np.stack([vm.double().numpy()[2, :3] for vm, *_ in spiral])
    target = focus_point(centres, forwards)
    for c, d in zip(centres, forwards, strict=True):
        assert np.linalg.norm((target - c) - ((target - c) @ d) * d) < 1e-3
    assert camera_path(views, "spiral", 3, points=np.random.default_rng(0).normal(size=(100, 3)))
    train = camera_path(views[:3], "train")
    assert [torch.equal(vm, v.viewmat) for (vm, *_), v in zip(train, views[:3], strict=True)] == [True] * 3
    with pytest.raises(UserError, match="unknown camera path"):
        camera_path(views, "helix", 5)


def test_sizes_and_colormap() -> None:
    assert parse_size("640x480") == (640, 480)
    for bad in ("640", "0x10", "axb", "640x480x3"):
        with pytest.raises(UserError, match="--size"):
            parse_size(bad)
    vm, K = torch.eye(4), torch.tensor([[50.0, 0, 32], [0, 50, 24], [0, 0, 1]])
    _, K2, w, h = scale_camera((vm, K, 64, 48), 32, 96)
    assert (w, h) == (32, 96) and K2[0, 0] == 25 and K2[0, 2] == 16 and K2[1, 1] == 100 and K2[1, 2] == 48
    ramp = colormap(np.linspace(0, 1, 11))
    assert ramp.shape == (11, 3) and ramp.min() >= 0 and ramp.max() <= 1
    assert ramp[0, 2] > ramp[0, 0] and ramp[-1, 0] > ramp[-1, 2]  # cool far end, warm near end
    depth = np.array([[0.0, 1.0], [2.0, 3.0]])
    near, far = depth_range([depth])
    assert 1.0 <= near < far <= 3.0  # zeros (nothing hit) are ignored
    img = colorize_depth(depth, near, far)
    assert img.dtype == np.uint8 and img.shape == (2, 2, 3) and not img[0, 0].any()


def test_render_depth_is_expected_depth() -> None:
    """Two Gaussians straight ahead at z=2 and z=4: depth = sum(w_i z_i) / alpha, as composited."""
    params = {
        "means": torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, 4.0]]),
        "quats": torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0]]),
        "scales": torch.log(torch.tensor([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0]])),
        "opacities": torch.logit(torch.tensor([0.5, 0.9])),
    }
    K = torch.tensor([[40.0, 0, 16.5], [0, 40, 16.5], [0, 0, 1]])  # pixel (16, 16) centre on axis
    depth = Renderer(RenderConfig(backend="reference"), torch.device("cpu")).render_depth(
        params, torch.eye(4), K, 32, 32
    )
    assert depth.shape == (32, 32, 1)
    centre = float(depth[16, 16, 0])
    # at the image centre both are at their peak: w1 = 0.5, w2 = 0.9 * (1 - 0.5)
    assert centre == pytest.approx((0.5 * 2 + 0.45 * 4) / 0.95, rel=1e-3)
    assert float(depth[0, 0, 0]) > 3.9  # the corner sees only the wide far Gaussian
    assert torch.all(depth >= 0)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(demo_scene: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("render") / "run"
    code, err = call_cli(
        "fit", demo_scene, "--steps", "30", "--out", run,
        "--set", "log.progress_every=10", "--set", "model.sh_degree=1",
    )  # fmt: skip
    assert code == 0, err
    return run


def test_render_orbit_mp4(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "orbit.mp4"
    proc = run_cli("render", tiny_run, "--path", "orbit", "--frames", "6", "--fps", "12", "--size", "48x32",
                   "--out", out)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert out.is_file() and "6 rgb frames at 48x32" in proc.stdout
    reader = imageio.get_reader(out)
    frames = [f for f in reader]
    assert reader.get_meta_data()["fps"] == pytest.approx(12)
    reader.close()
    assert len(frames) == 6 and all(f.shape == (32, 48, 3) for f in frames)
    assert max(float(f.mean()) for f in frames) > 5  # the object is in view, not a black video
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


def test_render_odd_size_mp4_is_even(tiny_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "odd.mp4"
    proc = run_cli("render", tiny_run, "--path", "test", "--size", "33x21", "--out", out)
    assert proc.returncode == 0, proc.stderr
    frames = [f for f in imageio.get_reader(out)]
    assert len(frames) == 2 and frames[0].shape == (20, 32, 3)  # 16 demo views, every 8th is a test view


def test_render_depth_and_alpha_png_frames(tiny_run: Path, tmp_path: Path) -> None:
    depth_dir = tmp_path / "depth"
    proc = run_cli("render", tiny_run, "--path", "test", "--what", "depth", "--out", depth_dir)
    assert proc.returncode == 0, proc.stderr
    files = sorted(depth_dir.glob("*.png"))
    assert len(files) == 2
    img = imageio.imread(files[0])
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 10  # a ramp of depths, not one flat colour

    alpha_dir = tmp_path / "alpha"
    proc = run_cli("render", tiny_run, "--path", "spiral", "--frames", "3", "--what", "alpha", "--out", alpha_dir)
    assert proc.returncode == 0, proc.stderr
    files = sorted(alpha_dir.glob("*.png"))
    assert len(files) == 3
    img = imageio.imread(files[0])
    assert img.shape == (64, 64, 3)
    assert np.array_equal(img[..., 0], img[..., 1])  # grey


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--path", "circle"], "--path"),
        (["--what", "normals"], "--what"),
        (["--size", "64"], "--size"),
        (["--size", "0x10"], "--size"),
        (["--fps", "0"], "--fps"),
        (["--frames", "0"], "--frames"),
        (["--out", "video.gif"], "unsupported output"),
    ],
)
def test_render_bad_flags(tiny_run: Path, tmp_path: Path, flags: list[str], needle: str) -> None:
    flags = [str(tmp_path / f) if f.endswith(".gif") else f for f in flags]
    assert_one_error(*call_cli("render", tiny_run, *flags), needle)


def test_render_bad_run_and_unwritable_out(tiny_run: Path, tmp_path: Path) -> None:
    assert_one_error(*call_cli("render", tmp_path), "not a gstrain run")
    assert_one_error(*call_cli("render", tmp_path / "nope"), "not found")
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    assert_one_error(*call_cli("render", tiny_run, "--out", blocker / "video.mp4"), "cannot write")
    assert_one_error(*call_cli("render", tiny_run, "--out", blocker), "not a folder")
