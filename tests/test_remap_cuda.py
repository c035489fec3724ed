"""The fused undistortion remap on a GPU (dev.fused_remap, data/csrc/remap.cu), against two
references: the torch path on the same device (F.interpolate to a full-resolution map, the inside
test, F.grid_sample: the same function, so equal up to float rounding, a level at most and
rarely), and pycolmap.undistort_image (independent: the tolerance of tests/test_undistort.py).
Every camera model of that file, pixels outside the distorted frame, beer's photo size, one and
four channels; the Trainer hands dev.fused_remap to its image store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pycolmap
import pytest
import torch
from test_data_colmap import write_scene
from test_undistort import CAMERAS, HEIGHT, WIDTH, _camera, _pycolmap, photo_like

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.data.undistort import build_map, pin_maps, remap
from gstrain.train.trainer import Trainer

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def _both(image: np.ndarray, camera: pycolmap.Camera, blank: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(torch path, fused kernel) on the GPU for the pinhole pycolmap.undistort_camera gives."""
    options = pycolmap.UndistortCameraOptions()
    options.blank_pixels = blank
    undistort = pin_maps([build_map(camera, pycolmap.undistort_camera(options, camera))])[0]
    assert undistort is not None
    pixels = torch.from_numpy(image if image.ndim == 3 else image[:, :, None]).to(CUDA)
    plain = remap(pixels, undistort)
    fused = remap(pixels, undistort, fused=True)
    assert fused.dtype == torch.uint8 and fused.shape == plain.shape and fused.is_cuda
    return plain.cpu(), fused.cpu()


def _within_rounding(plain: torch.Tensor, fused: torch.Tensor) -> str:
    diff = (fused.int() - plain.int()).abs()
    report = f"{int((diff > 0).sum())} of {diff.numel()} values differ, at most by {int(diff.max())}"
    assert int(diff.max()) <= 1, report
    assert float((diff > 0).float().mean()) <= 1e-4, report
    return report


@pytest.mark.parametrize("model", list(CAMERAS))
def test_fused_remap_is_the_torch_remap_and_follows_pycolmap(model: str) -> None:
    camera = _camera(model)
    image = photo_like(WIDTH, HEIGHT, seed=5)
    plain, fused = _both(image, camera)
    print(model, _within_rounding(plain, fused))
    reference, _pin = _pycolmap(image, camera)
    diff = np.abs(fused.numpy().astype(int) - reference.astype(int))
    assert (diff <= 1).mean() >= 0.999 and diff.max() <= 2
    assert (diff == 0).mean() >= 0.9


@pytest.mark.parametrize("model", ["SIMPLE_RADIAL", "OPENCV", "OPENCV_FISHEYE"])
def test_fused_remap_blacks_out_what_maps_outside(model: str) -> None:
    camera = _camera(model)
    image = np.maximum(photo_like(WIDTH, HEIGHT, seed=6), 1)  # black only where a pixel maps outside
    plain, fused = _both(image, camera, blank=1.0)
    print(model, _within_rounding(plain, fused))
    reference, _pin = _pycolmap(image, camera, blank=1.0)
    black, black_ref = (fused.numpy() == 0).all(axis=2), (reference == 0).all(axis=2)
    assert black_ref.sum() > 100  # the case is exercised
    assert (black != black_ref).sum() <= 0.002 * black.size
    assert torch.equal((fused == 0).all(dim=2), (plain == 0).all(dim=2))


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_fused_remap_at_beers_photo_size(channels: int) -> None:
    """1280 x 720 SIMPLE_RADIAL, beer's cameras' kind; channels are sampled alike and apart."""
    camera = pycolmap.Camera(model="SIMPLE_RADIAL", width=1280, height=720, params=[1150.0, 640.0, 360.0, -0.05])
    rgb = photo_like(1280, 720, seed=7)
    image = np.concatenate([rgb, rgb[:, :, :1]], axis=2)[:, :, :channels] if channels != 3 else rgb
    plain, fused = _both(np.ascontiguousarray(image), camera)
    print(channels, _within_rounding(plain, fused))
    if channels > 1:  # each channel is its own one-channel remap
        _, alone = _both(np.ascontiguousarray(image[:, :, 1]), camera)
        assert torch.equal(alone[:, :, 0], fused[:, :, 1])


@pytest.mark.parametrize("fused", [True, False])
def test_the_trainer_hands_dev_fused_remap_to_its_store(tmp_path: Path, fused: bool) -> None:
    root = tmp_path / "scene"
    root.mkdir()
    write_scene(root, model="OPENCV", n_images=4, ext=".jpg")
    scene = load_scene(root, factor=2, test_every=0, lazy=True)
    cfg = build_config(overrides=[{"train": {"steps": 1, "device": "cuda"}, "data": {"images_on": "disk"},
                                   "dev": {"fused_remap": fused}}])  # fmt: skip
    trainer = Trainer(cfg, scene, tmp_path / "run", CUDA, log=lambda m: None)
    try:
        assert trainer.image_store.fused_remap is fused
    finally:
        trainer.image_store.close()
