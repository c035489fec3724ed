"""Undistortion in the image stores and the loaders, on the CPU: the stores keep distorted decodes
and undistort after the copy; auto weighs host memory by what it would hold; masks and images go
through the same remap, never through pycolmap.undistort_image.

References: pycolmap.undistort_image (masks), the files' own decode sizes, sums by hand.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pycolmap
import pytest
import torch
from PIL import Image
from test_data_colmap import write_scene

from gstrain.data.colmap import load_scene
from gstrain.data.image_store import DiskStore, HostStore, ResidentStore, scene_is_lazy
from gstrain.data.images import LazyView
from gstrain.data.images_on import HOST_SHARE, resolve_images_on

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def distorted_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("distorted")
    write_scene(root, model="OPENCV", n_images=4, ext=".jpg")
    return root


def _no_pycolmap_undistortion(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("pycolmap.undistort_image was called")

    monkeypatch.setattr(pycolmap, "undistort_image", refuse)


def test_loading_and_streaming_never_call_pycolmaps_undistort_image(distorted_scene: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """pycolmap.undistort_image holds the GIL for ~60 ms a 720p photo: the loaders and the stores
    use the remap instead, masks included."""
    root = tmp_path / "copy"
    root.mkdir()
    for part in ("images", "sparse"):
        (root / part).symlink_to(distorted_scene / part)
    (root / "masks").mkdir()
    for f in (distorted_scene / "images").iterdir():
        with Image.open(f) as image:
            size = image.size
        Image.fromarray(np.full(size[::-1], 255, np.uint8)).save(root / "masks" / f"{f.stem}.png")
    _no_pycolmap_undistortion(monkeypatch)
    eager = load_scene(root, test_every=0)
    lazy = load_scene(root, test_every=0, lazy=True)
    assert all(v.mask is not None and bool(v.mask[5:-5, 5:-5].all()) for v in eager.train)
    for where in (HostStore, DiskStore):
        store = where(lazy.train, CPU)
        for idx, view in enumerate(eager.train):
            assert torch.equal(store.get(idx), view.image)
        store.close()


def test_masks_follow_pycolmaps_undistortion(tmp_path: Path) -> None:
    """The mask's remap against pycolmap.undistort_image of the same grey mask, thresholded alike."""
    cam, _ = write_scene(tmp_path, model="SIMPLE_RADIAL", n_images=2)
    (tmp_path / "masks").mkdir()
    rng = np.random.default_rng(1)
    references = {}
    for f in sorted((tmp_path / "images").iterdir()):
        h, w = np.asarray(Image.open(f)).shape[:2]
        y, x = np.mgrid[0:h, 0:w]
        keep = np.zeros((h, w), bool)
        for _ in range(5):  # discs: edges at every angle and sub-pixel offset
            cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(10, 50)
            keep |= (x - cx) ** 2 + (y - cy) ** 2 < r * r
        grey = np.where(keep, 255, 0).astype(np.uint8)
        Image.fromarray(grey).save(tmp_path / "masks" / f"{f.stem}.png")
        out, pin = pycolmap.undistort_image(pycolmap.UndistortCameraOptions(), pycolmap.Bitmap.from_array(grey), cam)
        references[f.name] = np.asarray(out.to_array()).reshape(pin.height, pin.width) >= 128
    scene = load_scene(tmp_path, test_every=0)
    for view in scene.train:
        reference = references[view.name]
        assert view.mask is not None and view.mask.shape == reference.shape
        assert 0.05 < reference.mean() < 0.95  # both kinds of pixel present
        differ = view.mask.numpy() != reference
        assert differ.mean() <= 0.001, differ.mean()


def test_host_store_keeps_the_distorted_decodes(distorted_scene: Path) -> None:
    eager = load_scene(distorted_scene, factor=2, test_every=0)
    lazy = load_scene(distorted_scene, factor=2, test_every=0, lazy=True)
    store = HostStore(lazy.train, CPU)
    for idx, view in enumerate(lazy.train):
        assert isinstance(view, LazyView)
        with Image.open(view.recipe.file) as f:
            target = (round(f.size[0] / 2), round(f.size[1] / 2))
        assert tuple(store.host[idx].shape) == (target[1], target[0], 3)  # decoded at the factor's size
        assert tuple(store.host[idx].shape) != store.shape(idx)  # the undistorted size differs
        assert torch.equal(store.get(idx), eager.train[idx].image)
    store.close()


def test_resident_store_of_a_lazy_scene_undistorts_as_the_eager_load(distorted_scene: Path) -> None:
    """data.images_on=gpu on CUDA loads lazily (scene_is_lazy): its store decodes and undistorts,
    giving the bytes an eager load gives on the same device."""
    assert scene_is_lazy("gpu", torch.device("cuda")) and not scene_is_lazy("gpu", CPU) and not scene_is_lazy("gpu")
    eager = load_scene(distorted_scene, test_every=0)
    lazy = load_scene(distorted_scene, test_every=0, lazy=True)
    store = ResidentStore(lazy.train, CPU)  # dev.fused_remap's default: a CUDA kernel the CPU does not take
    assert not store.fused_remap
    for idx, view in enumerate(eager.train):
        assert torch.equal(store.get(idx), view.image)


def test_auto_weighs_host_memory_by_the_distorted_decodes(distorted_scene: Path) -> None:
    """With a GPU too small for the images, auto picks host when the decodes host memory would
    hold (before undistortion, at the factor's size) fit its share, not the undistorted bytes."""
    lazy = load_scene(distorted_scene, test_every=0, lazy=True)
    undistorted = sum(v.width * v.height * 3 for v in lazy.train)
    held = 0
    for view in lazy.train:
        with Image.open(view.recipe.file) as f:
            held += f.size[0] * f.size[1] * 3
    assert held != undistorted
    said: list[str] = []
    # host memory whose share lies between the two sizes: only the held size decides right
    between = (min(held, undistorted) + max(held, undistorted)) / 2 / HOST_SHARE
    expected = "host" if held < undistorted else "disk"
    where = resolve_images_on(lazy.train, "auto", CPU, said.append, device_free=1, host_available=int(between))
    assert where == expected and len(said) == 1
    if expected == "disk":
        assert "before undistortion" in said[0]


def test_views_of_one_camera_share_one_map(distorted_scene: Path) -> None:
    """write_scene gives every image one camera: its map is built once (start-up of big captures)."""
    lazy = load_scene(distorted_scene, test_every=0, lazy=True)
    maps = {id(v.recipe.undistort) for v in lazy.train if isinstance(v, LazyView)}
    assert len(lazy.train) == 4 and len(maps) == 1 and lazy.train[0].recipe.undistort is not None


def test_stores_keep_dense_maps_within_their_byte_bound(distorted_scene: Path) -> None:
    """A store keeps full-resolution maps (8 or 9 bytes a pixel) up to its bound, the most recent first,
    and an image resampled through a kept map equals the load's own undistortion."""
    from gstrain.data.undistort import DenseMaps, UndistortMap, remap

    eager = load_scene(distorted_scene, test_every=0)
    lazy = load_scene(distorted_scene, test_every=0, lazy=True)
    view = lazy.train[0]
    assert isinstance(view, LazyView)
    first = view.recipe.undistort
    width, height = first.size
    second = UndistortMap(first.grid.clone(), first.size, first.source, first.inside)  # another camera's
    one_map = width * height * (8 if first.inside else 9)  # float32 (x, y), and a bool mask unless all are inside
    dense = DenseMaps(max_bytes=one_map)
    kept = dense.get(first, CPU)
    assert dense.get(first, CPU)[0] is kept[0] and dense.nbytes == one_map  # kept, not made again
    dense.get(second, CPU)
    assert list(dense.maps) == [(id(second), CPU)] and dense.nbytes == one_map  # the older one went
    image = remap(view.recipe.decoded(), first, dense.get(first, CPU))
    assert torch.equal(image, eager.train[0].image)
    assert DenseMaps(max_bytes=one_map - 1).get(first, CPU)[0].shape == (1, height, width, 2)  # too big: made, not kept
