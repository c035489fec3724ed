"""data.images_on on a GPU: host (pinned, side-stream copies) and disk (pinned decodes, async
copies) give the resident images byte for byte, also while the step's stream is busy."""

from __future__ import annotations

import pytest
import torch
from test_image_store import LoggedView, _fake_training, draw_views

from gstrain.data.image_store import DiskStore, HostStore, ResidentStore
from gstrain.train.run_state import ViewSampler

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("kind", [HostStore, DiskStore])
def test_streamed_on_cuda_equal_resident(kind: type) -> None:
    device = torch.device("cuda")
    views = [LoggedView(i, []) for i in range(6)]
    store = kind(views, device)
    if isinstance(store, HostStore):
        assert all(t.is_pinned() for t in store.host)
    sampler = ViewSampler(len(views), seed=4)
    for _ in range(3 * len(views)):
        torch.cuda._sleep(2_000_000)  # a busy step stream: the copy must still land before it is read
        (idx, image), = draw_views(store, sampler)
        assert image.device.type == "cuda" and image.dtype == torch.uint8
        assert torch.equal(image.cpu(), views[idx].pixels)
    store.close()


def test_fifty_fake_steps_on_cuda() -> None:
    device = torch.device("cuda")
    views = [LoggedView(i, []) for i in range(6)]
    resident = _fake_training(ResidentStore(views, device), len(views))
    for kind in (HostStore, DiskStore):
        assert torch.equal(_fake_training(kind(views, device), len(views)).cpu(), resident.cpu()), kind


def test_decode_processes_on_cuda_equal_the_files_while_copies_lag(tmp_path) -> None:
    """Lazy views through decode processes: the shared block is pinned, and a slot is reused only
    after the copy out of it has run, also when the side stream is held up (a sleep queued before
    each copy), with few slots (depth 2) over three passes."""
    from test_data_colmap import write_scene

    from gstrain.data.colmap import load_scene
    from gstrain.data.decoders import ProcessDecoder

    write_scene(tmp_path, model="OPENCV", n_images=6, ext=".jpg")
    eager = load_scene(tmp_path, test_every=0)
    lazy = load_scene(tmp_path, test_every=0, lazy=True)
    device = torch.device("cuda")
    store = DiskStore(lazy.train, device, workers=2, depth=2)
    assert isinstance(store.decoder, ProcessDecoder) and store.decoder.pinned
    resident = ResidentStore(lazy.train, device)  # undistorted on the device too: the same kernels
    for idx, view in enumerate(eager.train):  # and within a level of the CPU's undistortion
        assert int((resident.get(idx).cpu().int() - view.image.int()).abs().max()) <= 1
    sampler = ViewSampler(len(lazy.train), seed=5)
    for _ in range(3 * len(lazy.train)):
        with torch.cuda.stream(store.stream):
            torch.cuda._sleep(5_000_000)  # the next copies wait behind this on the side stream
        (idx, image), = draw_views(store, sampler)
        assert torch.equal(image, resident.get(idx)), idx
    store.close()


def test_a_graph_redo_asks_for_its_streamed_images_ahead(demo_scene, tmp_path, monkeypatch) -> None:
    """A graph engine's redo reads the redone steps' images again; with images_on=disk the store
    is asked for them ahead (none read unasked), so the redo does not wait on one decode after
    another. Pair buffers for a fifth of the most pairs seen make the replays overflow."""
    from gstrain.config import build_config
    from gstrain.data.inputs import load_scene
    from gstrain.train import graph_capacity
    from gstrain.train.trainer import Trainer

    monkeypatch.setattr(graph_capacity, "CAPACITY_ROUND", 64)
    monkeypatch.setattr(graph_capacity, "CAPACITY_MARGIN", 0.2)
    cfg = build_config(overrides=[{
        # two workers look 4 views ahead, fewer than the 14 training views: a redone step's image is gone
        "train": {"steps": 500, "device": "cuda"}, "data": {"images_on": "disk", "decode_workers": 2},
        "dev": {"cuda_graphs": True}, "render": {"atomic_mode": "warp"},  # warp: no tuning's eager steps
        "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 15},
    }])  # fmt: skip
    scene = load_scene(demo_scene, test_every=cfg.data.test_every, lazy=True)
    trainer = Trainer(cfg, scene, tmp_path / "run", torch.device("cuda"), log=lambda m: None)
    trainer.timer.enabled = False
    assert isinstance(trainer.image_store, DiskStore) and trainer.graphs is not None
    for step in range(30):
        trainer.step = step
        trainer.train_step(step)
    trainer.graphs.settle()
    g = trainer.graphs
    assert g.redos >= 1 and g.redone_steps >= 10, (g.summary(), g.eager_steps)
    store = trainer.image_store
    assert store.depth == 4 and store.unasked == 0
    trainer.image_store.close()
