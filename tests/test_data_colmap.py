"""COLMAP loading: round trips through pycolmap, undistortion, downscaling, errors, the real scene."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pycolmap
import pytest
import torch
from PIL import Image

from gstrain.data.inputs import load_scene  # every command reads scenes through it
from gstrain.data.scene import Scene, View
from gstrain.errors import UserError

BEER = Path(__file__).resolve().parents[2] / "shared/data/beer"
WIDTH, HEIGHT, FOCAL = 200, 160, 150.0

# A 7x5 grid of dots on the plane z = 0, seen by cameras ~5 units away looking down +z: the dots
# land 24 px apart and reach the image corners, where distortion is strongest.
GRID = np.array([[x, y, 0.0] for x in np.linspace(-2.4, 2.4, 7) for y in np.linspace(-1.6, 1.6, 5)])


def _poses(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    poses = []
    for i in range(n):
        a = 0.04 * (i - n / 2)  # small yaw so the views differ in rotation too
        R = np.array([[np.cos(a), 0, -np.sin(a)], [0, 1, 0], [np.sin(a), 0, np.cos(a)]])
        center = np.array([0.1 * i - 0.2, 0.05 * i, -5.0])
        poses.append((R, -R @ center))
    return poses


def _make_camera(model: str, width: int = WIDTH, height: int = HEIGHT) -> pycolmap.Camera:
    cam = pycolmap.Camera.create_from_model_name(1, model, FOCAL, width, height)
    extra = {
        "SIMPLE_RADIAL": [0.15],
        "OPENCV": [-0.2, 0.03, 0.002, -0.001],
        "OPENCV_FISHEYE": [0.05, 0.0, 0.0, 0.0],
    }.get(model)
    if extra is not None:
        params = np.array(cam.params, dtype=np.float64)
        params[cam.extra_params_idxs()] = extra
        cam.params = params
    return cam


def _draw_dots(cam: pycolmap.Camera, xy: np.ndarray) -> np.ndarray:
    """Grey image with a small bright Gaussian blob centred at each xy (COLMAP pixel coordinates)."""
    ys, xs = np.mgrid[0 : cam.height, 0 : cam.width] + 0.5
    img = np.full((cam.height, cam.width), 40.0)
    for x, y in xy:
        img += 200.0 * np.exp(-((xs - x) ** 2 + (ys - y) ** 2) / (2 * 1.6**2))
    return np.clip(img, 0, 255).astype(np.uint8)


def write_scene(
    root: Path,
    model: str = "PINHOLE",
    n_images: int = 5,
    fmt: str = "bin",
    sub: str = "0",
    ext: str = ".png",
    with_points: bool = True,
    width: int = WIDTH,
    height: int = HEIGHT,
) -> tuple[pycolmap.Camera, list[tuple[np.ndarray, np.ndarray]]]:
    """A small COLMAP scene written with pycolmap: dot images, exact keypoints, grid points."""
    cam = _make_camera(model, width, height)
    poses = _poses(n_images)
    rec = pycolmap.Reconstruction()
    rec.add_camera_with_trivial_rig(cam)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for i, (R, t) in enumerate(poses):
        name = f"img_{i:02d}{ext}"
        xy = cam.img_from_cam(GRID @ R.T + t)
        Image.fromarray(_draw_dots(cam, xy)).convert("RGB").save(root / "images" / name, quality=98)
        keypoints = xy if with_points else np.zeros((0, 2))
        image = pycolmap.Image(name=name, keypoints=keypoints, camera_id=1, image_id=i + 1)
        rec.add_image_with_trivial_frame(image, pycolmap.Rigid3d(np.hstack([R, t[:, None]])))
    if with_points:
        for j, p in enumerate(GRID):
            track = pycolmap.Track([pycolmap.TrackElement(i + 1, j) for i in range(n_images)])
            rec.add_point3D(p, track, np.array([200, 100, 50], np.uint8))
    model_dir = root / "sparse" / sub if sub else root / "sparse"
    model_dir.mkdir(parents=True, exist_ok=True)
    if fmt == "bin":
        rec.write_binary(str(model_dir))
    else:
        rec.write_text(str(model_dir))
    return cam, poses


def _project(view: View, pts: np.ndarray) -> np.ndarray:
    """x_pix = K (R X + t) / z, in pixel units with pixel centres at +0.5 (COLMAP and ours)."""
    cam = pts @ view.viewmat[:3, :3].double().numpy().T + view.viewmat[:3, 3].double().numpy()
    uv = cam @ view.K.double().numpy().T
    return uv[:, :2] / uv[:, 2:3]


def _dot_errors(view: View, pts: np.ndarray, radius: int = 6) -> np.ndarray:
    """Distance from each dot's intensity centroid in the view to where K/viewmat project it."""
    img = view.image.double().mean(dim=2).numpy()
    errs = []
    for x, y in _project(view, pts):
        cx, cy = int(x), int(y)
        if not (radius <= cx < view.width - radius and radius <= cy < view.height - radius):
            continue  # dots cut by the border have a biased centroid
        win = img[cy - radius : cy + radius + 1, cx - radius : cx + radius + 1]
        w = np.clip(win - np.median(img), 0, None)
        ys, xs = np.mgrid[cy - radius : cy + radius + 1, cx - radius : cx + radius + 1] + 0.5
        errs.append(np.hypot((w * xs).sum() / w.sum() - x, (w * ys).sum() / w.sum() - y))
    assert len(errs) >= 10, "too few dots inside the image to check the projection"
    return np.array(errs)


def _all_views(scene: Scene) -> list[View]:
    return sorted(scene.train + scene.test, key=lambda v: v.name)


@pytest.mark.parametrize("fmt", ["bin", "txt"])
@pytest.mark.parametrize("sub", ["0", ""])
def test_round_trip_pinhole(tmp_path: Path, fmt: str, sub: str) -> None:
    cam, poses = write_scene(tmp_path, fmt=fmt, sub=sub, n_images=5)
    scene = load_scene(tmp_path, test_every=2)
    assert [v.name for v in scene.test] == ["img_00.png", "img_02.png", "img_04.png"]
    assert [v.name for v in scene.train] == ["img_01.png", "img_03.png"]
    assert scene.notes == []
    for view, (R, t) in zip(_all_views(scene), poses, strict=True):
        assert view.image.dtype == torch.uint8 and view.image.shape == (HEIGHT, WIDTH, 3)
        assert view.K.dtype == torch.float32 and view.viewmat.dtype == torch.float32
        np.testing.assert_allclose(view.K.numpy(), cam.calibration_matrix(), atol=1e-4)
        np.testing.assert_allclose(view.viewmat[:3, :3].numpy(), R, atol=1e-6)
        np.testing.assert_allclose(view.viewmat[:3, 3].numpy(), t, atol=1e-5)
        np.testing.assert_array_equal(view.viewmat[3].numpy(), [0, 0, 0, 1])
        assert _dot_errors(view, GRID).max() < 0.15
    assert scene.points.shape == (len(GRID), 3) and scene.points.dtype == np.float32
    assert scene.point_colors.shape == (len(GRID), 3) and scene.point_colors.dtype == np.uint8
    np.testing.assert_allclose(np.sort(scene.points, axis=0), np.sort(GRID, axis=0), atol=1e-6)
    centers = np.stack([-R.T @ t for R, t in poses])
    expected = 1.1 * np.linalg.norm(centers - centers.mean(0), axis=1).max()
    assert scene.extent == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("model", ["SIMPLE_RADIAL", "OPENCV", "OPENCV_FISHEYE"])
@pytest.mark.parametrize("factor", [1, 2])
def test_distorted_camera_is_undistorted(tmp_path: Path, model: str, factor: int) -> None:
    cam, poses = write_scene(tmp_path, model=model, n_images=3)
    scene = load_scene(tmp_path, factor=factor, test_every=0)
    assert scene.notes == [f"undistorted 3 {model} images to PINHOLE"]
    assert scene.test == [] and len(scene.train) == 3
    for view, (R, t) in zip(_all_views(scene), poses, strict=True):
        # The dots were drawn where the distorted model puts them; the pinhole K must find them.
        assert _dot_errors(view, GRID).max() < 0.35 * factor
        K = view.K.numpy()
        assert K[0, 1] == 0 and K[1, 0] == 0 and K[2, 2] == 1
        # And the test means something: treating the distorted camera as pinhole misses by pixels.
        small = copy.copy(cam)
        small.rescale(round(WIDTH / factor), round(HEIGHT / factor))
        naive = small.calibration_matrix() @ (GRID @ R.T + t).T
        distorted = small.img_from_cam(GRID @ R.T + t)
        assert np.abs(naive[:2].T / naive[2:].T - distorted).max() > 2.0 / factor


def test_equal_to_undistort_then_downscale(tmp_path: Path) -> None:
    """Downscale-then-undistort (what we do) matches undistort-then-downscale to ~1/255."""
    cam, _ = write_scene(tmp_path, model="SIMPLE_RADIAL", n_images=1, width=400, height=320)
    img = np.asarray(Image.open(tmp_path / "images" / "img_00.png").convert("RGB"))
    full, pin_full = pycolmap.undistort_image(
        pycolmap.UndistortCameraOptions(), pycolmap.Bitmap.from_array(img), cam
    )
    view = load_scene(tmp_path, factor=4, test_every=0).train[0]
    K, Kf = view.K.double().numpy(), pin_full.calibration_matrix()
    # The full-resolution region that our small view covers, then an area downscale into it.
    x0, x1 = (np.array([0, view.width]) - K[0, 2]) / K[0, 0] * Kf[0, 0] + Kf[0, 2]
    y0, y1 = (np.array([0, view.height]) - K[1, 2]) / K[1, 1] * Kf[1, 1] + Kf[1, 2]
    ref = Image.fromarray(full.to_array()).resize(
        (view.width, view.height), Image.Resampling.BOX, box=(x0, y0, x1, y1)
    )
    diff = np.abs(np.asarray(ref, dtype=np.float64) - view.image.double().numpy())[2:-2, 2:-2]
    assert diff.mean() < 2.0


def test_factor_on_the_fly_scales_k(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=2)
    full = _all_views(load_scene(tmp_path, factor=1))
    half = _all_views(load_scene(tmp_path, factor=2))
    for a, b in zip(full, half, strict=True):
        assert b.image.shape == (HEIGHT // 2, WIDTH // 2, 3)
        np.testing.assert_allclose(_project(b, GRID), _project(a, GRID) / 2, atol=1e-4)
        assert _dot_errors(b, GRID).max() < 0.3
        # Area resampling: the mean brightness is kept.
        assert abs(b.image.double().mean() - a.image.double().mean()) < 1.0


def test_factor_non_divisible_size(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=1, width=203, height=161)
    view = load_scene(tmp_path, factor=4, test_every=0).train[0]
    assert view.image.shape == (40, 51, 3)  # round(161 / 4), round(203 / 4)
    assert view.K[0, 0].item() == pytest.approx(FOCAL * 51 / 203, rel=1e-6)
    assert view.K[1, 1].item() == pytest.approx(FOCAL * 40 / 161, rel=1e-6)
    assert _dot_errors(view, GRID, radius=3).max() < 0.5


def test_images_factor_folder_is_used(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=3)
    (tmp_path / "images_2").mkdir()
    for f in sorted((tmp_path / "images").iterdir()):
        # Marked content so we can tell which folder was read.
        Image.new("RGB", (WIDTH // 2, HEIGHT // 2), (7, 8, 9)).save(tmp_path / "images_2" / f.name)
    scene = load_scene(tmp_path, factor=2)
    for view in _all_views(scene):
        assert view.image.shape == (HEIGHT // 2, WIDTH // 2, 3)
        assert (view.image == torch.tensor([7, 8, 9], dtype=torch.uint8)).all()
        assert view.K[0, 0].item() == pytest.approx(FOCAL / 2)
    assert scene.notes == []

    # Incomplete images_2/: fall back to downscaling images/ on the fly, and say so.
    (tmp_path / "images_2" / "img_01.png").unlink()
    scene = load_scene(tmp_path, factor=2)
    assert not (_all_views(scene)[0].image == torch.tensor([7, 8, 9], dtype=torch.uint8)).all()
    assert len(scene.notes) == 1 and "images_2" in scene.notes[0] and "img_01.png" in scene.notes[0]


def test_grey_and_rgba_images(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=2)
    a, b = sorted((tmp_path / "images").iterdir())
    Image.open(a).convert("L").save(a)
    Image.open(b).convert("RGBA").save(b)
    for view in _all_views(load_scene(tmp_path)):
        assert view.image.shape == (HEIGHT, WIDTH, 3) and view.image.dtype == torch.uint8


def test_empty_point_cloud_and_single_camera(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=1, with_points=False)
    scene = load_scene(tmp_path)
    assert scene.points.shape == (0, 3) and scene.points.dtype == np.float32
    assert scene.point_colors.shape == (0, 3) and scene.point_colors.dtype == np.uint8
    assert len(scene.test) == 1 and scene.train == []
    assert np.isfinite(scene.extent) and scene.extent > 0


def _error(path: Path, **kwargs: object) -> str:
    with pytest.raises(UserError) as info:
        load_scene(path, **kwargs)  # type: ignore[arg-type]
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_bad_paths(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path / "nope") and "nope" in _error(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("x")
    assert "not a directory" in _error(tmp_path / "file.txt")
    msg = _error(tmp_path)
    assert "no COLMAP sparse model" in msg and str(tmp_path / "sparse" / "0") in msg
    write_scene(tmp_path / "s", n_images=2)
    assert "factor" in _error(tmp_path / "s", factor=0)


def test_incomplete_and_corrupt_model(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=2)
    model = tmp_path / "sparse" / "0"
    pts = (model / "points3D.bin").read_bytes()
    (model / "points3D.bin").unlink()
    msg = _error(tmp_path)
    assert "incomplete" in msg and "points3D.bin" in msg and str(model) in msg
    (model / "points3D.bin").write_bytes(pts)
    (model / "cameras.bin").write_bytes(b"\x07" * 61)
    msg = _error(tmp_path)
    assert msg.startswith("cannot read the COLMAP model") and str(model) in msg
    (model / "cameras.bin").unlink()
    (model / "cameras.txt").write_text("1 PINHOLE what\n")
    for name in ("images", "points3D"):
        (model / f"{name}.txt").write_text("")
    _error(tmp_path)  # .bin set incomplete and .txt set garbage: either way one clear line


def test_missing_and_corrupt_images(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=3, ext=".jpg")
    (tmp_path / "images" / "img_01.jpg").unlink()
    msg = _error(tmp_path)
    assert "missing" in msg and str(tmp_path / "images" / "img_01.jpg") in msg
    (tmp_path / "images" / "img_01.jpg").write_bytes(b"\xff\xd8\xff\xe0 definitely not a jpeg" * 10)
    msg = _error(tmp_path)
    assert msg.startswith("cannot decode image") and "img_01.jpg" in msg
    good = (tmp_path / "images" / "img_00.jpg").read_bytes()
    (tmp_path / "images" / "img_01.jpg").write_bytes(good[: len(good) // 3])  # truncated JPEG
    assert "img_01.jpg" in _error(tmp_path)
    shutil.rmtree(tmp_path / "images")
    assert "images" in _error(tmp_path)


def test_wrong_size_image(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=2)
    Image.new("RGB", (WIDTH, WIDTH)).save(tmp_path / "images" / "img_01.png")
    msg = _error(tmp_path)
    assert "img_01.png" in msg and "aspect" in msg


def test_unsupported_camera_model(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=2)
    rec = pycolmap.Reconstruction(str(tmp_path / "sparse" / "0"))
    cam = pycolmap.Camera.create_from_model_name(1, "EQUIRECTANGULAR", 1.0, WIDTH, HEIGHT)
    rec.cameras[1] = cam
    rec.write_binary(str(tmp_path / "sparse" / "0"))
    msg = _error(tmp_path)
    assert "EQUIRECTANGULAR" in msg and "unsupported" in msg


@pytest.mark.skipif(not BEER.is_dir(), reason=f"real scene not found at {BEER}")
def test_real_beer_scene_factor_8() -> None:
    logs: list[str] = []
    scene = load_scene(BEER, factor=8, log=logs.append)
    assert len(scene.train) + len(scene.test) == 71 and len(scene.test) == 9
    assert scene.notes == ["undistorted 71 SIMPLE_RADIAL images to PINHOLE"]
    assert scene.points.shape == (4414, 3) and scene.point_colors.shape == (4414, 3)
    for view in scene.train + scene.test:
        # 720x1280 / 8 is 90x160; undistortion crops a few pixels.
        assert 80 <= view.width <= 90 and 150 <= view.height <= 160
    assert scene.test[0].name == "0000.jpg" and scene.test[1].name == "0008.jpg"
    assert 0.1 < scene.extent < 100 and logs
    # SfM points project inside the (undistorted) views that see them, as a sanity check of poses.
    rec = pycolmap.Reconstruction(str(BEER / "sparse" / "0"))
    view = scene.test[0]
    image = rec.find_image_with_name(view.name)
    obs = [p for p in image.points2D if p.has_point3D()]
    xyz = np.array([rec.points3D[p.point3D_id].xyz for p in obs])
    uv = _project(view, xyz)
    inside = (uv[:, 0] > 0) & (uv[:, 0] < view.width) & (uv[:, 1] > 0) & (uv[:, 1] < view.height)
    assert inside.mean() > 0.95
    # The observed keypoints (distorted, full resolution), taken to normalised coordinates by the
    # distorted model and back through our pinhole K, land where K/viewmat project their points.
    normalised = image.camera.cam_from_img(np.array([p.xy for p in obs]))
    K = view.K.double().numpy()
    keypoints = normalised @ K[:2, :2].T + K[:2, 2]
    assert np.median(np.linalg.norm(keypoints - uv, axis=1)) < 0.3


def test_points_come_in_id_order_with_their_colours() -> None:
    """_read_points: positions and colours in point-id order whatever order the model holds them in."""
    import numpy as np
    import pycolmap

    from gstrain.data.colmap import _read_points

    rec = pycolmap.Reconstruction()
    for pid in (9, 2, 5):
        point = pycolmap.Point3D()
        point.xyz = np.array([pid, -pid, 0.5 * pid], dtype=np.float64)
        point.color = np.array([pid, 10 * pid, 20 * pid], dtype=np.uint8)
        rec.add_point3D_with_id(pid, point)
    xyz, rgb = _read_points(rec)
    assert xyz.dtype == np.float32 and rgb.dtype == np.uint8
    assert xyz.tolist() == [[2, -2, 1], [5, -5, 2.5], [9, -9, 4.5]]
    assert rgb.tolist() == [[2, 20, 40], [5, 50, 100], [9, 90, 180]]
    empty_xyz, empty_rgb = _read_points(pycolmap.Reconstruction())
    assert empty_xyz.shape == (0, 3) and empty_rgb.shape == (0, 3)


def test_many_points_read_in_bulk_equal_the_per_point_lookup() -> None:
    """The bulk (PLY export) path is taken and gives, in id order, exactly what asking pycolmap for
    each point gives: float32 positions rounded from its float64, and the colours."""
    import numpy as np
    import pycolmap

    from gstrain.data.colmap import _points_through_ply, _read_points

    rng = np.random.default_rng(3)
    rec = pycolmap.Reconstruction()
    ids = rng.permutation(np.arange(1, 3001)) * 5 + 11
    for pid in ids:
        point = pycolmap.Point3D()
        point.xyz = rng.normal(scale=50.0, size=3)
        point.color = rng.integers(0, 256, 3).astype(np.uint8)
        rec.add_point3D_with_id(int(pid), point)
    assert _points_through_ply(rec) is not None
    xyz, rgb = _read_points(rec)
    expect = sorted(ids.tolist())
    assert xyz.tolist() == [rec.point3D(p).xyz.astype(np.float32).tolist() for p in expect]
    assert rgb.tolist() == [rec.point3D(p).color.tolist() for p in expect]
