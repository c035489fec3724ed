"""`gstrain profile` input handling, which runs without a GPU (the timing itself is a cuda test)."""

from __future__ import annotations

import pytest
import torch
from cli_util import call_cli

from conftest import SHARED_DATA
from gstrain.config import Config
from gstrain.errors import UserError
from gstrain.profile import (
    SWITCHES,
    column_config,
    format_table,
    load_workload,
    profile_columns,
    profile_config,
    switch_variants,
)


def test_workload_from_scene_and_from_run(demo_scene, tmp_path):
    cpu = torch.device("cpu")
    scene_work = load_workload(demo_scene, Config(), cpu)
    assert len(scene_work.cameras) == 14 and scene_work.params["means"].shape[0] > 1000

    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "20")
    assert code == 0, err
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


def test_switch_variants_turn_off_one_switch_each_and_all_for_the_baseline():
    cfg = Config()
    variants = switch_variants(cfg)
    assert list(variants) == ["all on", *SWITCHES, "+ sparse Adam", "baseline"]
    assert variants["+ sparse Adam"].optim.sparse_adam is True and variants["all on"].optim.sparse_adam is False
    assert variants["no ellipse cull"].dev.ellipse_cull is False and variants["all on"].dev.ellipse_cull
    assert variants["all on"].render.atomic_mode == "arc" and variants["all on"].dev.fused_adam
    assert variants["torch Adam"].dev.fused_adam is False and variants["torch Adam"].dev.fused_ssim
    assert variants["gsplat raster"].render.backend == "gsplat"
    base = variants["baseline"]
    assert base.dev.ellipse_cull is False and base.optim.sparse_adam is False
    # a configuration that has the opt-in switch on already profiles no extra column for it
    cfg_on = Config()
    cfg_on.optim.sparse_adam = True
    on = switch_variants(cfg_on)
    assert "+ sparse Adam" not in on and on["baseline"].optim.sparse_adam is False
    assert (base.render.backend, base.dev.fused_ssim, base.dev.fused_adam, base.dev.fast_stats) == (
        "gsplat", False, False, False)
    assert cfg.dev.fused_adam  # the input is not modified


def test_profile_config_times_whole_windows_on_cpu(demo_scene):
    cfg = Config()
    cfg.model.sh_degree = 1
    work = load_workload(demo_scene, cfg, torch.device("cpu"))
    work.sh_degree = 1
    samples = profile_config(work, cfg, iters=4, warmup=1, window=2)
    assert len(samples["timed_wall"]) == 2 and len(samples["wall"]) == 2  # two windows of two steps, each pass
    for key in ("forward", "loss", "backward", "optimizer", "densify", "total", "host", "timed_wall", "wall"):
        assert all(v > 0 for v in samples[key]), key
    # the phases run inside the step: together they cannot take longer than the wall clock
    assert all(t <= w * 1.05 for t, w in zip(samples["total"], samples["timed_wall"], strict=True))
    assert samples["graph_share"] == [0.0]  # no CUDA graphs on the CPU: the untimed steps ran eagerly


def test_profile_columns_from_the_flags():
    assert profile_columns("all", "all") == ["atomic", "warp", "distwar", "arc", "gsplat"]
    assert profile_columns("all", "cuda") == ["atomic", "warp", "distwar", "arc"]
    assert profile_columns("arc, warp", "gsplat") == ["gsplat"]
    assert profile_columns("distwar", "all") == ["distwar", "gsplat"]
    assert profile_columns("all", "all", switches=True) == ["arc"]
    assert profile_columns("all", "gsplat", switches=True) == ["gsplat"]
    with pytest.raises(UserError, match="use --backend gsplat"):
        profile_columns("arc,gsplat", "all")
    with pytest.raises(UserError, match="--backend must be one of cuda, gsplat, all"):
        profile_columns("all", "reference")


def test_column_config_picks_backend_and_mode():
    cfg = Config()
    cfg.dev.atomic_threshold = 5
    assert (column_config(cfg, "gsplat").render.backend, column_config(cfg, "gsplat").dev.atomic_threshold) == (
        "gsplat", 5)
    warp = column_config(cfg, "warp").render
    assert (warp.backend, warp.atomic_mode) == ("cuda", "warp")
    assert (cfg.render.backend, cfg.render.atomic_mode) == ("auto", "arc")  # the input is not modified
