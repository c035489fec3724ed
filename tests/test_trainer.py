"""Trainer-level behaviour that the CLI tests cannot reach cheaply: NaN safety, sampler, SH schedule."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train.checkpoint import list_checkpoints
from gstrain.train.trainer import Trainer, ViewSampler


@pytest.fixture(scope="module")
def scene(demo_scene):
    return load_scene(demo_scene)


def make_trainer(scene, run_dir, **train):
    cfg = build_config(overrides=[
        {"train": {"steps": 40, **train}, "log": {"progress_every": 5, "ckpt_every": 10, "tb_every": 1000,
                                                  "eval_steps": [], "save_steps": []},
         "strategy": {"refine_start": 10, "refine_every": 10}, "model": {"sh_degree": 1}},
    ])
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None)


def test_sampler_visits_every_view_and_resumes():
    a = ViewSampler(5, seed=0)
    first = [a.next() for _ in range(5)]
    assert sorted(first) == list(range(5))
    state = a.state_dict()
    rest = [a.next() for _ in range(7)]
    b = ViewSampler(5, seed=123)
    b.load_state_dict(state)
    assert [b.next() for _ in range(7)] == rest


def test_nan_stops_and_keeps_last_good_checkpoint(scene, tmp_path, monkeypatch):
    trainer = make_trainer(scene, tmp_path / "run")
    real_loss = trainer.runner.loss_fn
    calls = {"n": 0}

    def poisoned(image, gt, lam):
        calls["n"] += 1
        loss, terms = real_loss(image, gt, lam)
        if calls["n"] >= 23:  # from step 23 on, the loss is NaN
            loss = loss * float("nan")
        return loss, terms

    monkeypatch.setattr(trainer.runner, "loss_fn", poisoned)
    result = trainer.fit()
    assert result.status == "nan"
    steps = [s for s, _ in list_checkpoints(tmp_path / "run")]
    assert steps and max(steps) == 20  # the step-30 checkpoint was never written
    state = torch.load(result.checkpoint, weights_only=False)
    assert all(torch.isfinite(v).all() for v in state["params"].values())
    assert result.step <= 25  # it stopped at the first check after the NaN


def test_sh_degree_schedule(scene, tmp_path):
    trainer = make_trainer(scene, tmp_path / "run", sh_degree_interval=10)
    degrees = []
    for step in (0, 9, 10, 25, 100):
        trainer.step = step
        degrees.append(trainer.active_sh_degree())
    assert degrees == [0, 0, 1, 1, 1]


def test_sh_degree_at_is_the_one_schedule():
    """One more degree every `interval` steps, capped by the config and by what is stored."""
    from gstrain.render.sh import sh_degree_at

    assert [sh_degree_at(s, 100, 3) for s in (0, 99, 100, 199, 200, 300, 10_000)] == [0, 0, 1, 1, 2, 3, 3]
    assert [sh_degree_at(s, 100, 3, stored=1) for s in (0, 150, 300)] == [0, 1, 1]
    assert sh_degree_at(0, 0, 2) == 2  # no schedule: the full degree from the start
    assert sh_degree_at(50, 10, 0) == 0


@pytest.mark.slow
def test_training_reduces_loss(scene, tmp_path):
    trainer = make_trainer(scene, tmp_path / "run")
    losses = []
    for step in range(60):
        loss, _, _, _ = trainer.train_step(step)
        losses.append(float(loss))
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < 0.8 * sum(losses[:10])


def test_checkpoints_and_timer_leave_training_unchanged(scene, tmp_path):
    # gstrain's pipeline writes a checkpoint every 1000 steps and the bench baseline none; the
    # phase timer runs on some steps only. Neither may touch the training state: with refinements
    # and an opacity reset inside the run, both runs must end bit for bit the same. (This test
    # found the CPU model sharing memory with the scene's points, so a second run started where
    # the first had moved them.)
    def run(name: str, ckpt_every: int, time_every: int) -> Trainer:
        cfg = build_config(overrides=[
            {"train": {"steps": 45, "seed": 5}, "model": {"sh_degree": 1},
             "strategy": {"refine_start": 5, "refine_every": 10, "reset_every": 20},
             "log": {"progress_every": 5, "ckpt_every": ckpt_every, "tb_every": 1000, "eval_steps": [],
                     "save_steps": []}, "dev": {"time_every": time_every}},
        ])  # fmt: skip
        run_dir = tmp_path / name
        run_dir.mkdir()
        trainer = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None)
        assert trainer.fit().status == "done"  # fit seeds everything from train.seed
        return trainer

    points_before = scene.points.copy()
    plain, busy = run("plain", 0, 1000), run("busy", 7, 1)
    # the model copies the SfM points: training one model must not move the next one's start
    assert np.array_equal(scene.points, points_before)
    assert len(list_checkpoints(tmp_path / "busy")) >= 1 and plain.step == busy.step == 45
    assert len(plain.params["means"]) != 0
    for key in plain.params:
        assert torch.equal(plain.params[key], busy.params[key]), key
    for key in ("grad2d", "count"):
        a, b = plain.strategy.state.get(key), busy.strategy.state.get(key)
        assert (a is None and b is None) or torch.equal(a, b), key


@pytest.mark.parametrize("train_views", [False, True])
def test_summary_scores_each_view(scene, tmp_path, train_views):
    # The summary keeps each test view's PSNR from the last evaluation, and with
    # log.eval_train_views every training view's, so one failed view shows behind a mean.
    cfg = build_config(overrides=[
        {"train": {"steps": 6}, "model": {"sh_degree": 1},
         "log": {"progress_every": 3, "ckpt_every": 0, "tb_every": 1000, "eval_steps": [], "save_steps": [],
                 "eval_train_views": train_views}},
    ])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lambda m: None).fit()
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert result.status == "done" and scene.test
    test_views = summary["final_test_views_psnr"]
    assert list(test_views) == [v.name for v in scene.test]
    assert sum(test_views.values()) / len(test_views) == pytest.approx(summary["final_test_psnr"], abs=1e-3)
    if not train_views:
        assert summary["final_train_views"] is None
        return
    scored = summary["final_train_views"]
    assert list(scored["views_psnr"]) == [v.name for v in scene.train]
    assert scored["min_psnr"] == min(scored["views_psnr"].values()) < scored["psnr"]
    assert sum(scored["views_psnr"].values()) / len(scene.train) == pytest.approx(scored["psnr"], abs=1e-3)


def test_run_record_keeps_the_fields_studies_read(scene, tmp_path):
    """train_summary.json comes from one function (run_record.write_run_record) with the field
    names bench scripts read; per-phase means cover the timed windows."""
    trainer = make_trainer(scene, tmp_path / "run", steps=10)
    trainer.cfg.log.tb_every = 5
    trainer.cfg.dev.time_every = 1
    result = trainer.fit()
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    for key in ("status", "steps", "first_step", "seconds", "num_gaussians", "max_gaussians", "initial_test_psnr",
                "final_test_psnr", "final_test_ssim", "test_history", "final_test_views_psnr", "final_train_views",
                "backend", "atomic_mode", "atomic_threshold", "phase_ms_per_step", "host_ms_per_step",
                "wall_ms_per_step", "peak_gpu_memory_gib", "checkpoint"):
        assert key in summary, key
    assert (summary["status"], summary["steps"], summary["first_step"]) == ("done", 10, 0)
    assert (summary["backend"], summary["atomic_mode"], summary["atomic_threshold"]) == ("reference", None, None)
    assert summary["num_gaussians"] == result.num_gaussians == len(trainer.params["means"])
    assert summary["final_test_psnr"] == pytest.approx(result.final_test_psnr)
    assert {"forward", "loss", "backward", "optimizer", "densify"} <= set(summary["phase_ms_per_step"])
    assert all(v > 0 for v in summary["phase_ms_per_step"].values())
