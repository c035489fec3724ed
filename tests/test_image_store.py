"""data.images_on: the image stores (gpu, host, disk), lazy scenes and the look-ahead, on the CPU
(the settings: test_images_on_settings.py).

References are independent of the code under test: a second ViewSampler drawn with next(), the
eagerly loaded scene's images, hand-computed sizes and choices.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from test_data_colmap import write_scene

import gstrain.data.decode as decode_mod
from gstrain.data.colmap import load_scene
from gstrain.data.decoders import ProcessDecoder, ThreadDecoder
from gstrain.data.image_store import (
    DiskStore,
    HostStore,
    ResidentStore,
    TrainImages,
    build_image_store,
    images_ahead,
)
from gstrain.data.images import LazyView
from gstrain.data.scene import View
from gstrain.errors import UserError
from gstrain.train.context import TrainViews
from gstrain.train.run_state import ViewSampler

CPU = torch.device("cpu")
GIB = 2**30


class LoggedView(View):
    """A view whose image is made on access (like a LazyView), logging each decode; `gate` (an
    Event) makes the decode wait until it is set."""

    def __init__(self, index: int, log: list[int], gate: threading.Event | None = None) -> None:
        self.index, self.log, self.gate = index, log, gate
        pixels = torch.arange(4 * 5 * 3, dtype=torch.int64).reshape(4, 5, 3)
        self.pixels = ((pixels * (index + 3)) % 251).to(torch.uint8)
        super().__init__(name=f"v{index}", image=None, K=torch.eye(3), viewmat=torch.eye(4))  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def image(self) -> torch.Tensor:
        if self.gate is not None:
            self.gate.wait(5)
        self.log.append(self.index)
        return self.pixels.clone()

    @image.setter
    def image(self, value: torch.Tensor | None) -> None:
        pass

    @property
    def width(self) -> int:
        return 5

    @property
    def height(self) -> int:
        return 4


def draw_views(store, sampler: ViewSampler) -> list[tuple[int, torch.Tensor]]:
    """One step's draw as the engines make it: TrainViews.draw (which prefetches), then the image."""
    views = TrainViews(TrainImages(store), [], [])
    return [(idx, views.images[idx]) for idx in views.draw(sampler)]


def _sequence(n: int, seed: int, count: int) -> list[int]:
    sampler = ViewSampler(n, seed)
    return [sampler.next() for _ in range(count)]


def test_peek_is_what_next_draws() -> None:
    sampler = ViewSampler(5, seed=3)
    drawn = _sequence(5, 3, 23)  # four passes and a bit: peeks cross pass boundaries
    for i in range(20):
        state = sampler.state_dict()
        assert sampler.peek(3) == drawn[i : i + 3]
        after = sampler.state_dict()
        assert torch.equal(state["gen"], after["gen"]) and state["order"] == after["order"]
        assert state["pos"] == after["pos"]
        assert sampler.next() == drawn[i]


def test_disk_prefetch_order_is_the_samplers() -> None:
    n, seed, steps, depth = 6, 9, 18, 3
    log: list[int] = []
    views = [LoggedView(i, log) for i in range(n)]
    store = DiskStore(views, CPU, workers=1, depth=depth)  # one worker: decodes run in submission order
    sampler = ViewSampler(n, seed)
    got = [draw_views(store, sampler)[0] for _ in range(steps)]
    store.close()
    expected = _sequence(n, seed, steps)
    assert [idx for idx, _ in got] == expected
    for idx, image in got:
        assert torch.equal(image, views[idx].pixels)
    # decoded in the sampler's order, except a draw of a view drawn at most `depth` draws before
    # (then in the look-ahead, so kept); the last steps' look-ahead decodes run past the draws.
    # (A view drawn again exactly depth + 1 draws later is kept only if the draw between was
    # kept too; this seed's sequence has no such repeat.)
    gaps = [i - max(j for j in range(i) if expected[j] == v) for i, v in enumerate(expected) if v in expected[:i]]
    assert depth + 1 not in gaps and sum(g <= depth for g in gaps) >= 5, gaps
    fresh = [v for i, v in enumerate(expected) if v not in expected[max(0, i - depth) : i]]
    assert log[: len(fresh)] == fresh
    assert len(store.recent.items) == 0  # closed


def test_disk_keeps_only_images_drawn_again_within_the_look_ahead() -> None:
    views = [LoggedView(i, []) for i in range(8)]
    store = DiskStore(views, CPU, workers=1, depth=3)
    store.prefetch([0, 1, 2])
    for idx in (0, 1):
        store.get(idx)
    store.prefetch([2, 0, 5])  # 0 comes again within the look-ahead: kept; 1 does not
    assert sorted(store.recent.items) == [0, 1]  # 1 is the last image got (a step's second read)
    store.get(2)
    store.prefetch([0, 5, 6])
    assert sorted(store.recent.items) == [0, 2]
    assert store.get(0) is store.recent.items[0] and store.gets == 3  # no decode, no wait
    store.prefetch([5, 6, 7])
    assert sorted(store.recent.items) == [0]  # only the last image got: nothing ahead draws it
    store.close()


def test_host_prefetch_starts_the_next_view() -> None:
    views = [LoggedView(i, []) for i in range(5)]
    store = HostStore(views, CPU)
    sampler = ViewSampler(5, seed=2)
    expected = _sequence(5, 2, 12)
    for step in range(12):
        (idx, image), = draw_views(store, sampler)
        assert idx == expected[step] and torch.equal(image, views[idx].pixels)
        if step + 1 < 12 and expected[step + 1] != idx:
            assert list(store.inflight) == [expected[step + 1]]  # one step ahead, the sampler's next
    assert store.missed == 1  # only the first step's copy was not started ahead


@pytest.fixture(scope="module")
def jpg_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("store_scene")
    write_scene(root, model="OPENCV", n_images=7, ext=".jpg")  # distorted: resize + undistort per decode
    return root


def _stream(store, sampler: ViewSampler, steps: int) -> list[tuple[int, torch.Tensor]]:
    return [draw_views(store, sampler)[0] for _ in range(steps)]


@pytest.mark.parametrize(("where", "decode_in"), [("host", "processes"), ("disk", "processes"), ("disk", "threads")])
def test_streamed_images_equal_resident_ones(jpg_scene: Path, where: str, decode_in: str) -> None:
    eager = load_scene(jpg_scene, factor=2, test_every=0)
    lazy = load_scene(jpg_scene, factor=2, test_every=0, lazy=True)
    assert all(isinstance(v, LazyView) for v in lazy.train)
    for a, b in zip(eager.train, lazy.train, strict=True):
        assert torch.equal(a.K, b.K) and torch.equal(a.viewmat, b.viewmat)
        assert (a.width, a.height) == (b.width, b.height)
    resident = ResidentStore(eager.train, CPU)
    store = build_image_store(lazy.train, where, CPU, log=lambda _m: None, decode_in=decode_in)
    assert store.where == where
    if where == "disk":
        assert isinstance(store.decoder, ProcessDecoder if decode_in == "processes" else ThreadDecoder)
    n = len(eager.train)
    sampler = ViewSampler(n, seed=7)
    for idx, image in _stream(store, sampler, 2 * n):  # two full passes of sampled indices
        reference = eager.train[idx].image
        assert image.dtype == torch.uint8 and image.shape == reference.shape == store.shape(idx)
        assert torch.equal(image, reference) and torch.equal(resident.get(idx), reference)
    store.close()


def _fake_training(store, n: int, steps: int = 50) -> torch.Tensor:
    """A stand-in for the training step: parameters moved by each step's target as the loss would."""
    sampler = ViewSampler(n, seed=42)
    params = torch.zeros(8, dtype=torch.float64)
    for step in range(steps):
        (idx, image), = draw_views(store, sampler)
        gt = image.float() / 255.0
        grad = torch.stack([gt[..., c].mean() for c in range(3)] + [gt.std(), gt.max(), gt.min(),
                            gt[: gt.shape[0] // 2].mean(), torch.tensor(float(idx), device=gt.device)]).double().cpu()
        params -= 0.01 * (grad - params) * (1 + step % 3)
    store.close()
    return params


def test_fifty_steps_streamed_equal_resident(jpg_scene: Path) -> None:
    eager = load_scene(jpg_scene, factor=2, test_every=0)
    lazy = load_scene(jpg_scene, factor=2, test_every=0, lazy=True)
    n = len(eager.train)
    resident = _fake_training(ResidentStore(eager.train, CPU), n)
    for where, decode_in in (("host", "processes"), ("disk", "processes"), ("disk", "threads")):
        store = build_image_store(lazy.train, where, CPU, log=lambda _m: None, decode_in=decode_in)
        assert torch.equal(_fake_training(store, n), resident), (where, decode_in)


def _count_decodes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    decoded: list[Path] = []
    real = decode_mod.decode

    def counting(file: Path, composite_over=None):
        decoded.append(file)
        return real(file, composite_over)

    monkeypatch.setattr(decode_mod, "decode", counting)
    return decoded


def test_disk_start_up_decodes_only_what_the_first_steps_need(jpg_scene: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded = _count_decodes(monkeypatch)
    load_scene(jpg_scene, factor=2, test_every=0)
    assert len(decoded) == 7  # an eager scene decodes every image: the counter sees decodes
    decoded.clear()
    lazy = load_scene(jpg_scene, factor=2, test_every=0, lazy=True)
    assert decoded == []  # headers only
    store = DiskStore(lazy.train, CPU, workers=1, depth=2, decode_in="threads")  # decodes this process sees
    sampler = ViewSampler(len(lazy.train), seed=1)
    draw_views(store, sampler)  # the first step
    store.close()
    assert 1 <= len(decoded) <= 3  # its own image and at most two ahead, not all seven


def test_disk_says_when_training_waited() -> None:
    gate = threading.Event()
    views = [LoggedView(i, [], gate) for i in range(3)]
    store = DiskStore(views, CPU, workers=1, depth=2)
    store.prefetch([1, 2])
    threading.Timer(0.05, gate.set).start()
    start = time.perf_counter()
    assert torch.equal(store.get(1), views[1].pixels)  # waits for the worker
    assert time.perf_counter() - start >= 0.04
    store.pending[2].result()  # decoded before it is asked for: no wait
    store.get(2)
    note = store.note()
    store.close()
    assert store.waits == 1 and store.gets == 2
    assert note is not None and note.startswith("data-bound: 1 of 2 steps waited") and "\n" not in note


def test_disk_without_waits_says_nothing() -> None:
    views = [LoggedView(i, []) for i in range(3)]
    store = DiskStore(views, CPU, workers=1, depth=3)
    store.prefetch([0, 1, 2])
    for future in list(store.pending.values()):
        future.result()
    for idx in (0, 1, 2):
        store.get(idx)
    assert store.note() is None
    store.close()


@pytest.mark.parametrize("decode_in", ["processes", "threads"])
def test_disk_decode_error_is_one_user_error(tmp_path: Path, decode_in: str) -> None:
    write_scene(tmp_path, n_images=3, ext=".jpg")
    lazy = load_scene(tmp_path, test_every=0, lazy=True)
    good = (tmp_path / "images" / "img_01.jpg").read_bytes()
    (tmp_path / "images" / "img_01.jpg").write_bytes(good[: len(good) // 3])  # truncated after start-up
    store = DiskStore(lazy.train, CPU, workers=1, depth=3, decode_in=decode_in)
    store.prefetch([1])
    with pytest.raises(UserError, match="cannot decode image .*img_01.jpg"):
        store.get(1)
    store.close()


def test_train_images_adapter_fetches_by_index_only() -> None:
    from gstrain.data.image_store import TrainImages

    log: list[int] = []
    views = [LoggedView(i, log) for i in range(4)]
    images = TrainImages(DiskStore(views, CPU, workers=1, depth=2))
    assert len(images) == 4 and images.shapes == [(4, 5, 3)] * 4 and log == []  # shapes without decoding
    assert torch.equal(images[2], views[2].pixels) and torch.equal(images[2], views[2].pixels)
    assert log == [2]  # the step's second read (train PSNR) is the same tensor, not a second decode
    with pytest.raises(TypeError, match="use .shapes"):
        list(images)
    images.store.close()


def test_image_shapes_of_both_kinds() -> None:
    from gstrain.data.image_store import TrainImages, image_shapes

    log: list[int] = []
    views = [LoggedView(i, log) for i in range(3)]
    assert image_shapes(TrainImages(HostStore(views, CPU))) == [(4, 5, 3)] * 3
    assert image_shapes([torch.zeros(2, 7, 3, dtype=torch.uint8)]) == [(2, 7, 3)]


def test_transforms_scene_lazy_and_max_side_equal_eager(tmp_path: Path) -> None:
    """transforms.json scenes go through the same lazy path: an RGBA image composited over the
    background, fisheye-free pinhole views, decoded later, equal the eager scene's pixels; and
    data.max_side shrinks them with its note, as on COLMAP."""
    import numpy as np
    from PIL import Image
    from transforms_util import write_blender

    from gstrain.data.demo import write_demo_scene
    from gstrain.data.inputs import load_scene as load_any

    colmap = write_demo_scene(tmp_path / "colmap", n_views=8, width=40, height=40)
    scene_dir = write_blender(colmap, tmp_path / "blender")
    rgb = np.asarray(Image.open(scene_dir / "images" / "003.png").convert("RGB"))
    alpha = np.tile(np.linspace(0, 255, 40).round().astype(np.uint8), (40, 1))
    Image.fromarray(np.dstack([rgb, alpha])).save(scene_dir / "images" / "003.png")
    eager = load_any(scene_dir, background=(1.0, 0.5, 0.0))
    lazy = load_any(scene_dir, background=(1.0, 0.5, 0.0), lazy=True)
    views = [*lazy.train, *lazy.test]
    assert views and all(isinstance(v, LazyView) for v in views)
    for a, b in zip([*eager.train, *eager.test], views, strict=True):
        assert torch.equal(a.K, b.K) and (a.width, a.height) == (b.width, b.height)
        assert torch.equal(a.image, b.image)
    small = load_any(scene_dir, max_side=20, lazy=True)
    assert {tuple(v.image.shape) for v in small.train} == {(20, 20, 3)}
    assert len([n for n in small.notes if n.startswith("data.max_side=20: ")]) == 1


def test_scoring_pass_reads_streamed_images_in_order(jpg_scene: Path) -> None:
    """images_ahead (the evaluation's reader) gives each lazy view's own decode, in view order."""
    eager = load_scene(jpg_scene, factor=2, test_every=0)
    lazy = load_scene(jpg_scene, factor=2, test_every=0, lazy=True)
    got = list(images_ahead(lazy.train, workers=3))
    assert len(got) == len(eager.train)
    for image, view in zip(got, eager.train, strict=True):
        assert torch.equal(image, view.image)


def test_scoring_pass_decodes_a_bounded_distance_ahead() -> None:
    """While the first image is held back, at most `workers` decodes have started; the rest
    start only as the pass moves on (a scoring pass never holds every image of a big capture)."""
    log: list[int] = []
    gate = threading.Event()

    class Recipe:  # a LazyView's recipe that decodes like LoggedView (logged, view 0 gated)
        size = (5, 4)

        def __init__(self, index: int) -> None:
            self.source = LoggedView(index, log, gate if index == 0 else None)

        def pixels(self) -> torch.Tensor:
            return self.source.image

    recipes = [Recipe(i) for i in range(10)]
    views = [LazyView(f"v{i}", r, torch.eye(3), torch.eye(4)) for i, r in enumerate(recipes)]  # type: ignore[arg-type]
    reader = images_ahead(views, workers=3)
    first = []
    consumer = threading.Thread(target=lambda: first.append(next(reader)))
    consumer.start()
    time.sleep(0.3)  # views 1 and 2 decode; view 0 waits on the gate; nothing else may start
    assert sorted(log) == [1, 2], log
    gate.set()
    consumer.join(5)
    rest = list(reader)
    assert [int(v.name[1:]) for v in views] == list(range(10))
    assert all(torch.equal(a, r.source.pixels) for a, r in zip([*first, *rest], recipes, strict=True))
    assert sorted(log) == list(range(10))


def test_views_read_again_are_asked_for_before_the_samplers_next() -> None:
    """TrainViews.prefetch(first=...), as a graph engine's redo calls it: the store is asked for
    those views first, then for the sampler's next ones; a view read without being asked for is
    counted (unasked)."""
    views = [LoggedView(i, []) for i in range(9)]
    store = DiskStore(views, CPU, workers=1, depth=3)
    train_views = TrainViews(TrainImages(store), [], [])
    sampler = ViewSampler(9, seed=3)
    drawn = [train_views.draw(sampler)[0] for _ in range(4)]
    assert store.unasked == 1  # the first draw: nothing was asked for before it
    asked = set(store.pending) | set(store.recent.items)
    again = [i for i in drawn if i not in asked][:2]  # drawn, used, no longer held
    assert len(again) == 2
    train_views.prefetch(sampler, first=again)
    assert list(store.pending)[-2:] == again  # asked for now, in that order
    for idx in again:
        assert torch.equal(store.get(idx), views[idx].pixels)
    assert store.unasked == 1
    store.get(next(i for i in range(9) if i not in store.pending and i not in store.recent.items))
    assert store.unasked == 2
    store.close()
