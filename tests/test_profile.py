"""`gstrain profile` input handling, which runs without a GPU (the timing itself is a cuda test)."""

from __future__ import annotations

import pytest
import torch
from cli_util import run_cli
from conftest import SHARED_DATA

from gstrain.config import Config
from gstrain.errors import UserError
from gstrain.profile import format_table, load_workload


def test_workload_from_scene_and_from_run(demo_scene, tmp_path):
    cpu = torch.device("cpu")
    scene_work = load_workload(demo_scene, Config(), cpu)
    assert len(scene_work.cameras) == 14 and scene_work.params["means"].shape[0] > 1000

    run = tmp_path / "run"
    assert run_cli("fit", demo_scene, "--out", run, "--steps", "20").returncode == 0
    run_work = load_workload(run, Config(), cpu)
    state = torch.load(next((run / "ckpt").glob("*.pt")), weights_only=False)
    assert torch.equal(run_work.params["means"], state["params"]["means"])
    assert len(run_work.targets) == len(run_work.cameras) == 14


def test_workload_from_test_garden_npz():
    path = SHARED_DATA / "test_garden.npz"
    if not path.is_file():
        pytest.skip("../shared/data/test_garden.npz is not present")
    work = load_workload(path, Config(), torch.device("cpu"), npz_scale=2)
    assert work.params["means"].shape[0] == 138_766
    assert [(w, h) for _, _, w, h in work.cameras] == [(1296, 840)] * 3
    assert work.cameras[0][1][0, 0] > 0


def test_bad_targets(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_workload(tmp_path / "missing", Config(), torch.device("cpu"))
    bad = tmp_path / "x.npz"
    bad.write_bytes(b"junk")
    with pytest.raises(UserError, match="test_garden"):
        load_workload(bad, Config(), torch.device("cpu"))


def test_table_has_speedups_against_both_baselines():
    med = {"atomic": {"raster_bwd": 10.0, "total": 20.0}, "arc": {"raster_bwd": 1.0, "total": 8.0},
           "gsplat": {"raster_bwd": 1.25, "total": 8.5}}
    table = format_table(med)
    assert "| rasterize backward speedup vs atomic | 1.00x | 10.00x | 8.00x |" in table
    assert "| rasterize backward speedup vs gsplat | 0.12x | 1.25x | 1.00x |" in table
