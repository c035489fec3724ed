"""data.images_on's settings on the CPU: auto's choice and its one line, data.max_side,
data.decode_workers, and bad values as one line each.

References are independent of the code under test: hand-computed sizes and choices, counted
worker processes, the images' own sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_util import assert_one_error, call_cli
from test_data_colmap import WIDTH, write_scene
from test_image_store import LoggedView

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.data.decoders import ProcessDecoder
from gstrain.data.image_store import (
    DEVICE_SHARE,
    DISK_WORKERS,
    DiskStore,
    ResidentStore,
    build_image_store,
    choose_images_on,
    scene_is_lazy,
)
from gstrain.errors import UserError

CPU = torch.device("cpu")
GIB = 2**30


@pytest.fixture(scope="module")
def jpg_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("settings_scene")
    write_scene(root, model="OPENCV", n_images=7, ext=".jpg")
    return root


@pytest.mark.parametrize(
    ("image_gib", "device_free_gib", "host_gib", "expected"),
    [
        (10, 80, 100, "gpu"),  # 10 <= 0.25 * 80
        (20, 80, 100, "gpu"),  # exactly the share
        (21, 80, 100, "host"),  # over the device share, 21 <= 0.5 * 100
        (50, 80, 100, "host"),
        (51, 80, 100, "disk"),  # over both
        (10, None, 100, "gpu"),  # on the CPU: resident in host memory
        (60, None, 100, "disk"),
    ],
)
def test_auto_choice_on_given_sizes(image_gib: int, device_free_gib: int | None, host_gib: int, expected: str) -> None:
    assert DEVICE_SHARE == 0.25
    device_free = None if device_free_gib is None else device_free_gib * GIB
    where, line = choose_images_on(image_gib * GIB, device_free, host_gib * GIB)
    assert where == expected
    assert line.startswith("data.images_on=auto: ") and "\n" not in line


def test_auto_builds_and_says_which() -> None:
    views = [LoggedView(i, []) for i in range(4)]  # 4 x 60 bytes decoded
    said: list[str] = []
    store = build_image_store(views, "auto", CPU, log=said.append, device_free=None, host_available=1000)
    assert isinstance(store, ResidentStore) and len(said) == 1 and "images resident" in said[0]
    said.clear()
    store = build_image_store(views, "auto", CPU, log=said.append, device_free=None, host_available=400)
    assert isinstance(store, DiskStore) and len(said) == 1 and said[0].startswith("gstrain: data.images_on=auto: disk")
    store.close()


def test_max_side_downscales_with_one_note(tmp_path: Path) -> None:
    write_scene(tmp_path, n_images=3)  # 200 x 160
    full = load_scene(tmp_path, test_every=0)
    small = load_scene(tmp_path, test_every=0, max_side=100)
    assert {(v.width, v.height) for v in small.train} == {(100, 80)}
    for a, b in zip(full.train, small.train, strict=True):
        assert torch.allclose(b.K[:2], a.K[:2] * 0.5) and torch.equal(b.K[2], a.K[2])
    notes = [n for n in small.notes if "max_side" in n]
    assert len(notes) == 1 and "3 images" in notes[0] and "200x160 -> 100x80" in notes[0]
    both = load_scene(tmp_path, factor=2, test_every=0, max_side=60, lazy=True)  # 100x80 by factor, then 60
    assert {(v.width, v.height) for v in both.train} == {(60, 48)}
    assert tuple(both.train[0].image.shape) == (48, 60, 3)
    assert not [n for n in load_scene(tmp_path, test_every=0, max_side=WIDTH).notes if "max_side" in n]


@pytest.mark.parametrize(
    ("override", "needle"),
    [("data.images_on=ssd", "data.images_on must be one of auto, gpu, host, disk"),
     ("data.max_side=-1", "data.max_side must be >= 0"),
     ("train.max_memory_gib=-2", "train.max_memory_gib must be"),
     ("dev.decode_in=gpu", "dev.decode_in must be one of processes, threads"),
     ("data.decode_workers=-1", "data.decode_workers must be >= 0"),
     ("data.decode_workers=257", "data.decode_workers must be 0..256")],
)
def test_bad_values_are_one_line(override: str, needle: str) -> None:
    section, rest = override.split(".", 1)
    key, value = rest.split("=")
    typed = {"images_on": str, "decode_in": str, "decode_workers": int}.get(key, float)(value)
    with pytest.raises(UserError, match=needle):
        build_config(overrides=[{section: {key: typed}}])


@pytest.mark.parametrize(("asked", "started"), [(0, DISK_WORKERS), (2, 2)])
def test_decode_workers_is_how_many_processes_start(jpg_scene: Path, asked: int, started: int) -> None:
    lazy = load_scene(jpg_scene, factor=2, test_every=0, lazy=True)
    store = build_image_store(lazy.train, "disk", CPU, log=lambda _m: None, decode_workers=asked)
    assert isinstance(store.decoder, ProcessDecoder)
    assert len(store.decoder.workers) == min(started, len(lazy.train))
    store.close()


def test_bad_images_on_from_the_command_line(demo_scene: Path, tmp_path: Path) -> None:
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "1", "--set", "data.images_on=ssd")
    assert_one_error(code, err, "data.images_on must be one of")
    with pytest.raises(UserError, match="data.images_on"):
        scene_is_lazy("ram")
    assert scene_is_lazy("disk") and scene_is_lazy("auto") and not scene_is_lazy("gpu")


def test_max_side_run_trains_and_reopens_at_its_size(demo_scene: Path, tmp_path: Path) -> None:
    from gstrain.run_dir import open_run

    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "2", "--set", "data.max_side=32",
                         "--set", "model.sh_degree=0", "--set", "log.progress_every=1")
    assert code == 0, err
    opened = open_run(run, device="cpu", renderer=False)  # gstrain eval and view reopen the scene this way
    assert opened.cfg.data.max_side == 32
    assert {(v.width, v.height) for v in opened.scene.train + opened.scene.test} == {(32, 32)}  # demo: 64 x 64
    code, err = call_cli("fit", demo_scene, "--out", run, "--resume", "--set", "data.max_side=16")
    assert_one_error(code, err, "--resume cannot change data.max_side: 32 -> 16")
