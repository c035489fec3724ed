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
