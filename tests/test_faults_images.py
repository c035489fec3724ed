"""Input images the user did not mean (issue 20): RGBA, grayscale, an image the sparse model does
not list, an image at twice its camera's size. Each is said once per run, and says what was done."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_util import call_cli
from PIL import Image

from gstrain.data.colmap import load_scene


@pytest.fixture
def odd_scene(demo_scene: Path, tmp_path: Path) -> Path:
    """The demo scene with one RGBA image (alpha all zero), one grayscale image, one image at
    twice its camera's size and an extra image that the sparse model does not list."""
    scene = tmp_path / "scene"
    shutil.copytree(demo_scene, scene)
    files = sorted((scene / "images").iterdir())
    rgba = Image.open(files[1]).convert("RGBA")
    rgba.putalpha(0)
    rgba.save(files[1])
    Image.open(files[2]).convert("L").save(files[2])
    big = Image.open(files[3])
    big.resize((big.width * 2, big.height * 2), Image.Resampling.NEAREST).save(files[3])
    shutil.copy(files[4], scene / "images" / "zz_extra.png")
    return scene


def _view(scene, name):
    return next(v for v in [*scene.train, *scene.test] if v.name == name)


def test_notes_say_what_was_done(demo_scene: Path, odd_scene: Path) -> None:
    clean = load_scene(demo_scene)
    assert clean.notes == []
    scene = load_scene(odd_scene)
    files = sorted(p.name for p in (odd_scene / "images").iterdir())
    notes = scene.notes
    assert len(notes) == 5, notes
    alpha, grey, size, extra, mask = (next(n for n in notes if key in n) for key in
                                      ("alpha channel", "grayscale", "differ in size", "not in the sparse model",
                                       "have a mask"))
    assert alpha.startswith("1 images") and files[1] in alpha and "alpha is their mask" in alpha
    assert "ignore every pixel" in mask  # that image's alpha is 0 everywhere
    assert grey.startswith("1 images") and files[2] in grey
    assert files[3] in size and "128x128, camera 64x64" in size and "resized to the camera's size" in size
    assert "intrinsics scaled" not in size
    assert extra.startswith("1 images") and "zz_extra.png" in extra

    # what the notes say is what happened: the big image was resized and its intrinsics kept,
    # the RGBA image keeps its colours with alpha as its mask (all ignored), the grey one has three equal channels
    big, ref = _view(scene, files[3]), _view(clean, files[3])
    assert tuple(big.image.shape) == (64, 64, 3)
    assert np.array_equal(big.K.numpy(), ref.K.numpy())
    assert np.array_equal(_view(scene, files[1]).image.numpy(), _view(clean, files[1]).image.numpy())
    assert not _view(scene, files[1]).mask.any() and _view(clean, files[1]).mask is None
    grey_view = _view(scene, files[2]).image
    assert np.array_equal(grey_view[..., 0].numpy(), grey_view[..., 2].numpy())
    assert all(v.name != "zz_extra.png" for v in [*scene.train, *scene.test])


def test_fit_says_each_note_once(odd_scene: Path, tmp_path: Path) -> None:
    code, err = call_cli("fit", odd_scene, "--out", tmp_path / "run", "--steps", "1",
                         "--set", "model.sh_degree=0", "--set", "log.progress_every=1")
    assert code == 0, err
    for key in ("alpha is their mask", "grayscale", "resized to the camera's size", "not in the sparse model"):
        assert err.count(key) == 1, (key, err)
