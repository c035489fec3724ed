"""Undistortion on a GPU: the device remap against the CPU one, and the stores of a distorted lazy
scene (gpu, host, disk) byte for byte alike on the device, also while the step's stream is busy."""

from __future__ import annotations

from pathlib import Path

import pycolmap
import pytest
import torch
from test_data_colmap import write_scene
from test_image_store import draw_views
from test_undistort import CAMERAS, HEIGHT, WIDTH, _camera, photo_like

from gstrain.data.colmap import load_scene
from gstrain.data.image_store import DiskStore, HostStore, ResidentStore
from gstrain.data.undistort import build_map, pin_maps, remap
from gstrain.train.run_state import ViewSampler

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


@pytest.mark.parametrize("model", list(CAMERAS))
def test_device_remap_equals_the_cpu_one_within_a_level(model: str) -> None:
    camera = _camera(model)
    pinhole = pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), camera)
    image = torch.from_numpy(photo_like(WIDTH, HEIGHT, seed=4))
    undistort = build_map(camera, pinhole)
    on_cpu = remap(image, undistort)
    pinned = pin_maps([undistort])[0]
    assert pinned is not None and pinned.grid.is_pinned()
    on_gpu = remap(image.to(CUDA), pinned)
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape
    diff = (on_gpu.cpu().int() - on_cpu.int()).abs()
    assert int(diff.max()) <= 1 and float((diff == 0).float().mean()) >= 0.999
    assert torch.equal(remap(image.to(CUDA), undistort), on_gpu)  # deterministic, pinned or not


@pytest.fixture(scope="module")
def distorted_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("distorted_cuda")
    write_scene(root, model="OPENCV", n_images=6, ext=".jpg")
    return root


@pytest.mark.parametrize("fused", [True, False])  # dev.fused_remap
def test_streamed_undistorted_on_cuda_equal_resident(distorted_scene: Path, fused: bool) -> None:
    lazy = load_scene(distorted_scene, factor=2, test_every=0, lazy=True)
    eager = load_scene(distorted_scene, factor=2, test_every=0)  # undistorted on the CPU
    resident = ResidentStore(lazy.train, CUDA, fused_remap=fused)  # gpu on CUDA: lazy, undistorted on the device
    for idx, view in enumerate(eager.train):
        diff = (resident.get(idx).cpu().int() - view.image.int()).abs()
        assert int(diff.max()) <= 1
    for kind in (HostStore, DiskStore):
        store = kind(lazy.train, CUDA, fused_remap=fused)
        sampler = ViewSampler(len(lazy.train), seed=3)
        for _ in range(3 * len(lazy.train)):
            torch.cuda._sleep(2_000_000)  # a busy step stream: copy and remap must land before the read
            (idx, image), = draw_views(store, sampler)
            assert image.device.type == "cuda" and torch.equal(image, resident.get(idx)), (kind, idx)
        store.close()


def test_disk_stages_the_next_decoded_image_beside_the_step(distorted_scene: Path) -> None:
    """A decode that is done when the sampler's next indices come is copied and undistorted on the
    side stream at once (staged), not decoded again, and get() returns it without a wait."""
    lazy = load_scene(distorted_scene, factor=2, test_every=0, lazy=True)
    resident = ResidentStore(lazy.train, CUDA)
    store = DiskStore(lazy.train, CUDA, workers=1, depth=3)
    store.prefetch([2, 4, 1])
    for future in list(store.pending.values()):
        future.result()
    store.prefetch([2, 4, 1])  # the next step's view (per_step=1) is decoded: staged
    assert list(store.staged) == [2] and 2 not in store.pending
    torch.cuda._sleep(2_000_000)
    assert torch.equal(store.get(2), resident.get(2)) and store.waits == 0 and not store.staged
    assert torch.equal(store.get(4), resident.get(4)) and store.waits == 0  # decoded, not staged: no wait
    store.close()


def test_pinned_maps_keep_values_and_sharing() -> None:
    first, second = (build_map(_camera(m), pycolmap.undistort_camera(pycolmap.UndistortCameraOptions(), _camera(m)))
                     for m in ("OPENCV", "OPENCV_FISHEYE"))
    out = pin_maps([first, None, first, second])
    assert out[1] is None and out[0] is out[2] and out[0] is not None and out[3] is not None
    for original, pinned in ((first, out[0]), (second, out[3])):
        assert pinned.grid.is_pinned() and torch.equal(pinned.grid, original.grid)
        assert (pinned.size, pinned.source, pinned.inside) == (original.size, original.source, original.inside)
