"""data/undistort.py: undistortion as a remap in torch, against pycolmap as the independent reference.

- pycolmap.undistort_image on generated photo-like images, for SIMPLE_RADIAL, RADIAL, OPENCV and
  OPENCV_FISHEYE cameras: the same output size, nearly every value within one level, none far off;
  also with pycolmap's blank_pixels (pixels that map outside the distorted image are black).
- The coarse map against pycolmap's exact per-pixel map (cam_from_img, img_from_cam at every pixel).
- A known answer for the pixel-centre convention: an undistorted camera half a pixel off the
  distorted one samples each 2x2 block's mean.
- Masks follow the same remap; the scene loads without pycolmap.undistort_image.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pycolmap
import pytest
import torch
import torch.nn.functional as F

from gstrain.data.undistort import MAP_STEP, MAP_TOLERANCE, build_map, pin_maps, remap

WIDTH, HEIGHT = 320, 240
# Distortion of the strength phones and action cameras have (focal lengths ~0.8-1.1x the width).
CAMERAS = {
    "SIMPLE_RADIAL": [300.0, 160.0, 120.0, -0.06],
    "RADIAL": [290.0, 159.5, 121.0, 0.05, -0.02],
    "OPENCV": [300.0, 296.0, 161.0, 119.5, -0.08, 0.015, 0.0008, -0.0006],
    "OPENCV_FISHEYE": [200.0, 200.0, 160.0, 120.0, 0.04, -0.01, 0.002, 0.0],
}


def _camera(model: str) -> pycolmap.Camera:
    return pycolmap.Camera(model=model, width=WIDTH, height=HEIGHT, params=CAMERAS[model])


def photo_like(width: int, height: int, seed: int = 0) -> np.ndarray:
    """[H, W, 3] uint8 with edges and texture at several scales (periods of 5 to 80 px, a few
    sharp-edged discs, a little noise): bilinear values of it land on all fractions of a level."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    out = np.zeros((height, width, 3))
    for c in range(3):
        for period in (5.0, 11.0, 23.0, 80.0):
            angle = rng.uniform(0, np.pi)
            phase = x * np.cos(angle) + y * np.sin(angle)
            out[:, :, c] += 30.0 * np.sin(2 * np.pi * phase / period + rng.uniform(0, 6.3))
    for _ in range(6):
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(8, 40)
        out[(x - cx) ** 2 + (y - cy) ** 2 < r * r] += rng.uniform(-60, 60, 3)
    out += 128.0 + rng.normal(0, 3, out.shape)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def _pycolmap(image: np.ndarray, camera: pycolmap.Camera, blank: float = 0.0) -> tuple[np.ndarray, pycolmap.Camera]:
    options = pycolmap.UndistortCameraOptions()
    options.blank_pixels = blank
    out, pin = pycolmap.undistort_image(options, pycolmap.Bitmap.from_array(image), camera)
    channels = image.shape[2] if image.ndim == 3 else 1
    return np.asarray(out.to_array()).reshape(pin.height, pin.width, channels), pin


def _ours(image: np.ndarray, camera: pycolmap.Camera, blank: float = 0.0) -> np.ndarray:
    options = pycolmap.UndistortCameraOptions()
    options.blank_pixels = blank
    pin = pycolmap.undistort_camera(options, camera)
    pixels = torch.from_numpy(image if image.ndim == 3 else image[:, :, None])
    return remap(pixels, build_map(camera, pin)).numpy()


@pytest.mark.parametrize("model", list(CAMERAS))
def test_remap_matches_pycolmap(model: str) -> None:
    camera = _camera(model)
    image = photo_like(WIDTH, HEIGHT, seed=len(model))
    reference, pin = _pycolmap(image, camera)
    got = _ours(image, camera)
    assert got.shape == reference.shape == (pin.height, pin.width, 3)
    assert (pin.width, pin.height) != (WIDTH, HEIGHT)  # the pinhole is not the distorted frame
    diff = np.abs(got.astype(int) - reference.astype(int))
    assert (diff <= 1).mean() >= 0.999, (diff > 1).mean()
    assert diff.max() <= 2
    assert (diff == 0).mean() >= 0.9  # most values exactly pycolmap's, not just close


@pytest.mark.parametrize("model", ["SIMPLE_RADIAL", "OPENCV", "OPENCV_FISHEYE"])
def test_pixels_outside_the_distorted_image_are_black_as_in_pycolmap(model: str) -> None:
    """blank_pixels=1 keeps the whole distorted frame: the pinhole's corners map outside it."""
    camera = _camera(model)
    image = photo_like(WIDTH, HEIGHT, seed=3)
    image = np.maximum(image, 1)  # black only where a pixel maps outside
    reference, _pin = _pycolmap(image, camera, blank=1.0)
    got = _ours(image, camera, blank=1.0)
    assert got.shape == reference.shape
    black_ref, black = (reference == 0).all(axis=2), (got == 0).all(axis=2)
    assert black_ref.sum() > 100  # the case is exercised
    # a pixel whose source point lies within the coarse map's error of the edge may flip
    assert (black != black_ref).sum() <= 0.002 * black.size
    both = ~black & ~black_ref
    diff = np.abs(got.astype(int) - reference.astype(int))[both]
    assert (diff <= 1).mean() >= 0.999 and diff.max() <= 2


def _exact_source(distorted: pycolmap.Camera, pinhole: pycolmap.Camera) -> np.ndarray:
    """[H, W, 2] source point (pixel-index units) of every undistorted pixel, through pycolmap."""
    y, x = np.mgrid[0 : pinhole.height, 0 : pinhole.width].astype(np.float64)
    rays = pinhole.cam_from_img(np.stack([x.ravel() + 0.5, y.ravel() + 0.5], axis=1))
    points = distorted.img_from_cam(np.concatenate([rays, np.ones((len(rays), 1))], axis=1)) - 0.5
    return points.reshape(pinhole.height, pinhole.width, 2)


@pytest.mark.parametrize("model", list(CAMERAS))
def test_coarse_map_against_pycolmaps_exact_map(model: str) -> None:
    """Within MAP_TOLERANCE (checked by build_map at the midpoints) and float32 of every pixel's
    exact source point; the map stays coarse (a node per 4 x 4 pixels or fewer)."""
    camera = _camera(model)
    pinhole = pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), camera)
    coarse = build_map(camera, pinhole)
    rows, cols = coarse.grid.shape[2:]
    assert rows <= (pinhole.height - 1) // 4 + 2 and cols <= (pinhole.width - 1) // 4 + 2
    assert rows >= (pinhole.height - 1) / MAP_STEP + 1 and cols >= (pinhole.width - 1) / MAP_STEP + 1
    full = F.interpolate(coarse.grid, size=(pinhole.height, pinhole.width), mode="bilinear", align_corners=True)
    scale = torch.tensor([(WIDTH - 1) / 2.0, (HEIGHT - 1) / 2.0], dtype=torch.float64)
    points = (full[0].permute(1, 2, 0).double() + 1.0) * scale  # back to pixel-index units
    error = np.abs(points.numpy() - _exact_source(camera, pinhole))
    assert error.max() < 1.5 * MAP_TOLERANCE, error.max()
    assert error.max() > 1e-5  # a map that is not exact at every pixel: the bound is what is tested


def test_half_pixel_shift_averages_each_2x2_block() -> None:
    """No distortion: pycolmap crops the pinhole by one pixel and centres it half a pixel off, so
    undistorted pixel (x, y) samples the distorted one at (x + 0.5, y + 0.5) in pixel-index units:
    the mean of a 2x2 block (computed here by hand), rounded half up."""
    camera = pycolmap.Camera(model="SIMPLE_RADIAL", width=40, height=30, params=[35.0, 20.0, 15.0, 0.0])
    pinhole = pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), camera)
    assert (pinhole.width, pinhole.height) == (39, 29)
    image = np.random.default_rng(5).integers(0, 256, (30, 40, 3)).astype(np.uint8)
    got = remap(torch.from_numpy(image), build_map(camera, pinhole)).numpy().astype(int)
    wide = image.astype(int)
    total = wide[:-1, :-1] + wide[1:, :-1] + wide[:-1, 1:] + wide[1:, 1:]
    expected = (total * 2 + 4) // 8  # floor(total / 4 + 0.5)
    tie = total % 4 == 2  # exactly half a level: float32 weights may round either way
    assert np.array_equal(got[~tie], expected[~tie])
    assert np.abs(got[tie] - expected[tie]).max() <= 1


def test_one_channel_and_pinned_maps_give_the_same_values() -> None:
    camera = _camera("OPENCV")
    pinhole = pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), camera)
    image = torch.from_numpy(photo_like(WIDTH, HEIGHT, seed=9))
    undistort = build_map(camera, pinhole)
    rgb = remap(image, undistort)
    for c in range(3):
        assert torch.equal(remap(image[:, :, c : c + 1].contiguous(), undistort)[:, :, 0], rgb[:, :, c])
    if torch.cuda.is_available():  # pinning needs a CUDA driver
        pinned, none = pin_maps([undistort, None])
        assert none is None and pinned is not None and pinned.grid.is_pinned()
        assert torch.equal(remap(image, pinned), rgb)
    with pytest.raises(ValueError, match="the map samples"):
        remap(image[:, :-1], undistort)


def test_last_row_and_column_have_no_right_neighbour() -> None:
    """A PINHOLE camera through pycolmap maps each pixel onto itself: the last row and column
    sample exactly at width - 1 (height - 1), where COLMAP's bilinear lookup has no second
    neighbour and writes black; every other pixel is the image's own value."""
    image = np.random.default_rng(2).integers(1, 256, (30, 40, 3)).astype(np.uint8)
    camera = pycolmap.Camera(model="PINHOLE", width=40, height=30, params=[35.0, 35.0, 20.0, 15.0])
    reference, pin = _pycolmap(image, camera)
    got = remap(torch.from_numpy(image), build_map(camera, pin)).numpy()
    for out in (reference, got):  # pycolmap's own rule, and ours
        assert (out[-1] == 0).all() and (out[:, -1] == 0).all()
    # pycolmap's double round-off puts its first row a hair above the image (black there); ours
    # lands on it exactly
    assert np.array_equal(reference[1:-1, :-1], image[1:-1, :-1])
    assert np.array_equal(got[:-1, :-1], image[:-1, :-1])


@pytest.mark.parametrize("model", list(CAMERAS))
def test_maps_inside_the_image_skip_the_edge_test_alike(model: str) -> None:
    """pycolmap's default pinhole keeps every source point inside: the map says so, and remap's
    shortcut (no edge test) gives the bytes the edge test gives. With blank_pixels=1 it is not."""
    camera = _camera(model)
    image = torch.from_numpy(photo_like(WIDTH, HEIGHT, seed=7))
    undistort = build_map(camera, pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), camera))
    assert undistort.inside
    assert torch.equal(remap(image, undistort), remap(image, replace(undistort, inside=False)))
    options = pycolmap.UndistortCameraOptions()
    options.blank_pixels = 1.0
    assert not build_map(camera, pycolmap.undistort_camera(options, camera)).inside
