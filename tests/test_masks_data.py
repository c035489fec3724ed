"""Masks on disk (gstrain/data/masks.py): masks/ files, alpha channels, downscale, undistortion, errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli
from PIL import Image
from test_data_colmap import write_scene

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.data.demo import write_demo_scene
from gstrain.errors import UserError

MAGENTA = np.array([255, 0, 255])


@pytest.fixture(scope="module")
def masked_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_scene(tmp_path_factory.mktemp("masked") / "scene", n_views=16, width=64, height=64,
                            masks=True)


def _views(scene):
    return sorted(scene.train + scene.test, key=lambda v: v.name)


def _magenta(image: np.ndarray) -> np.ndarray:
    return np.all(image == MAGENTA, axis=-1)


def test_masks_folder_marks_the_distractor(masked_demo: Path) -> None:
    scene = load_scene(masked_demo)
    files = sorted(p.name for p in (masked_demo / "masks").iterdir())
    views = _views(scene)
    assert [v.name for v in views if v.mask is not None] == files
    assert len(files) == 14  # 16 views, two of them clean and without a mask file
    for view in views:
        blob = _magenta(view.image.numpy())
        if view.mask is None:
            assert not blob.any()
            continue
        assert blob.sum() > 30  # the distractor is there...
        assert not view.mask.numpy()[blob].any()  # ...and every pixel of it is ignored
        assert view.mask.float().mean() > 0.8  # the rest of the picture counts
    ignored = sum(int((~v.mask).sum()) for v in views if v.mask is not None)
    note = [n for n in scene.notes if n.startswith("masks:")]
    assert len(note) == 1 and "14 of 16 views" in note[0] and f" {ignored} of " in note[0]


def test_masks_follow_the_downscale(masked_demo: Path, tmp_path: Path) -> None:
    full = {v.name: v for v in _views(load_scene(masked_demo))}
    for scene in (load_scene(masked_demo, factor=2), _prescaled(masked_demo, tmp_path)):
        for view in _views(scene):
            if view.mask is None:
                continue
            assert view.mask.shape == view.image.shape[:2] == (32, 32)
            # the full-resolution mask, area-averaged by hand and thresholded at one half
            ref = full[view.name].mask.float().reshape(32, 2, 32, 2).mean(dim=(1, 3)) >= 0.5
            assert torch.equal(view.mask, ref)


def _prescaled(src: Path, tmp_path: Path):
    """The scene with images_2/ beside full-size images/ and masks/: images_2 is used as it is."""
    root = tmp_path / "pre"
    shutil.copytree(src, root)
    (root / "images_2").mkdir()
    for f in (root / "images").iterdir():
        Image.open(f).resize((32, 32), Image.Resampling.BOX).save(root / "images_2" / f.name)
    scene = load_scene(root, factor=2)
    assert not any("lacks" in n for n in scene.notes)
    return scene


def test_alpha_channel_is_the_mask(masked_demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "rgba"
    shutil.copytree(masked_demo, root)
    shutil.rmtree(root / "masks")
    expected = {}
    for f in sorted((root / "images").iterdir()):
        rgb = np.asarray(Image.open(f).convert("RGB"))
        alpha = np.where(_magenta(rgb), 0, 255).astype(np.uint8)
        alpha[0, 0] = 100  # grey below one half: ignored too
        alpha[0, 1] = 200  # grey above: kept
        Image.fromarray(np.dstack([rgb, alpha])).save(f)
        expected[f.name] = alpha >= 128
    for view in _views(load_scene(root)):
        assert np.array_equal(view.mask.numpy(), expected[view.name]), view.name
        assert view.image.shape == (64, 64, 3)


def test_masks_follow_the_undistortion(tmp_path: Path) -> None:
    write_scene(tmp_path, model="SIMPLE_RADIAL", n_images=2)
    (tmp_path / "masks").mkdir()
    for f in (tmp_path / "images").iterdir():
        grey = np.asarray(Image.open(f).convert("L"))
        # keep the bright dots only; written as JPEG-free PNG under another suffix's stem
        Image.fromarray(np.where(grey > 128, 255, 0).astype(np.uint8)).save(tmp_path / "masks" / (f.stem + ".png"))
    for view in _views(load_scene(tmp_path)):
        assert view.mask.shape == view.image.shape[:2]
        dots = view.image.double().mean(-1).numpy() > 128  # the image went through the same warp
        agree = (view.mask.numpy() == dots).mean()
        assert agree > 0.99, agree
        assert view.mask.sum() > 100


def test_wrong_size_mask_is_one_line_naming_the_file(masked_demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "bad"
    shutil.copytree(masked_demo, root)
    bad = root / "masks" / "003.png"
    Image.open(bad).resize((50, 64)).save(bad)
    with pytest.raises(UserError, match="003.png"):
        load_scene(root)
    assert_one_error(*call_cli("fit", root, "--out", tmp_path / "run", "--set", "train.steps=1"), str(bad), "50x64")


def test_mask_mode_is_validated() -> None:
    assert build_config(overrides=[{"data": {"mask_mode": "background"}}]).data.mask_mode == "background"
    with pytest.raises(UserError, match="data.mask_mode"):
        build_config(overrides=[{"data": {"mask_mode": "blur"}}])


def test_masks_factor_folder_and_misnamed_or_empty_masks(masked_demo: Path, tmp_path: Path) -> None:
    root = tmp_path / "m2"
    shutil.copytree(masked_demo, root)
    (root / "images_2").mkdir()
    (root / "masks_2").mkdir()
    square = np.full((32, 32), 255, np.uint8)
    square[4:12, 20:30] = 0  # not the distractor: shows which folder the mask came from
    for f in (root / "images").iterdir():
        Image.open(f).resize((32, 32), Image.Resampling.BOX).save(root / "images_2" / f.name)
        Image.fromarray(square).save(root / "masks_2" / f.name)
    (root / "masks" / "001.png").unlink()  # masks_2 is used for 001 as for every other view
    for view in _views(load_scene(root, factor=2)):
        assert np.array_equal(view.mask.numpy(), square >= 128), view.name
    # masks/ whose names match no image: said, not silently trained on every pixel
    shutil.rmtree(root / "masks_2")
    for f in list((root / "masks").iterdir()):
        f.rename(f.with_name("mask_" + f.name))
    notes = load_scene(root).notes
    assert any("holds no mask for any of the 16 images" in n for n in notes), notes
    # a mask that ignores everything is reported
    Image.fromarray(np.zeros((64, 64), np.uint8)).save(root / "masks" / "005.png")
    note = [n for n in load_scene(root).notes if n.startswith("masks:")]
    assert note == ["masks: 1 of 16 views have a mask; 4096 of their 4096 pixels (100.0%) are ignored; "
                    "1 of them ignore every pixel (those views teach nothing)"]
