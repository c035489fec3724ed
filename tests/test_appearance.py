"""train.appearance=affine: the per-image colour transform, its evaluation protocols, and a
known-answer run on the demo scene with known per-view gains and colour casts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from cli_util import assert_one_error, call_cli, run_cli

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.errors import UserError
from gstrain.train.appearance import AffineAppearance, apply_affine, fit_affine, fitted_half, identity_table
from gstrain.train.graph_step import graphs_possible
from gstrain.train.step import StepView
from gstrain.train.trainer import Trainer

N_VIEWS = 16


def _cfg(over: dict) -> object:
    base = {"train": {"device": "cpu"},
            "log": {"progress_every": 50, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0}}
    for section, values in over.items():
        base.setdefault(section, {}).update(values)
    return build_config([Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"], [base])


# ----------------------------------------------------------------- the transform and the fit
def test_fit_affine_is_the_least_squares_solution():
    gen = torch.Generator().manual_seed(0)
    render = torch.rand(20, 30, 3, generator=gen)
    target = torch.rand(20, 30, 3, generator=gen)
    got = fit_affine(render, target, ridge=0.0)
    x = np.concatenate([render.reshape(-1, 3).numpy(), np.ones((600, 1))], 1).astype(np.float64)
    expected, *_ = np.linalg.lstsq(x, target.reshape(-1, 3).numpy().astype(np.float64), rcond=None)
    np.testing.assert_allclose(got.numpy(), expected.T, atol=1e-5)


def test_fit_affine_with_no_kept_pixel_is_identity():
    render, target = torch.rand(4, 6, 3), torch.rand(4, 6, 3)
    got = fit_affine(render, target, keep=torch.zeros(4, 6, dtype=torch.bool))
    assert torch.allclose(got, identity_table(1)[0], atol=1e-6)


def test_fitted_half_fits_on_the_left_and_scores_the_right():
    render = torch.rand(8, 11, 3, generator=torch.Generator().manual_seed(1))
    known = torch.tensor([[0.8, 0.1, 0.0, 0.05], [0.0, 1.2, 0.0, -0.02], [0.05, 0.0, 0.7, 0.1]])
    target = render @ known[:, :3].T + known[:, 3]  # the photo: a known colour transform of the render
    corrected, gt, keep = fitted_half(render, target)
    assert corrected.shape == gt.shape == (8, 6, 3) and keep is None  # the right half: columns 5..10
    assert torch.equal(gt, target[:, 5:])
    assert torch.allclose(corrected, target[:, 5:], atol=1e-3)


def test_identity_transform_changes_no_bit_and_a_known_one_maps_colours():
    image = torch.rand(5, 7, 3)
    assert torch.equal(apply_affine(image, identity_table(1)[0]), image)  # the warm-up's exact no-op
    transform = torch.tensor([[2.0, 0, 0, 0.1], [0, 1, 1, 0], [0, 0, 0.5, -0.1]])
    r, g, b = image.unbind(-1)
    expected = torch.stack([2 * r + 0.1, g + b, 0.5 * b - 0.1], -1)
    assert torch.allclose(apply_affine(image, transform), expected, atol=1e-6)


def test_a_training_view_gets_its_own_row_and_a_view_without_index_none():
    model = AffineAppearance(3, torch.device("cpu"), lr=0.1)
    with torch.no_grad():
        model.table[2, 0, 0] = 2.0
    image = torch.full((2, 2, 3), 0.25)
    view = StepView(torch.eye(4), torch.eye(3), image, index=2)
    assert torch.allclose(model.image(image, view)[..., 0], torch.full((2, 2), 0.5))
    assert torch.equal(model.image(image, StepView(torch.eye(4), torch.eye(3), image)), image)


def test_warm_up_keeps_the_table_and_then_it_learns():
    model = AffineAppearance(2, torch.device("cpu"), lr=0.1, start=5)
    image = torch.rand(4, 4, 3)
    for step, moved in ((4, False), (5, True)):
        view = StepView(torch.eye(4), torch.eye(3), image, index=1)
        loss = (model.image(image, view) - 0.5 * image).abs().mean()
        loss.backward()
        model.after_step(step)
        assert model.table.grad is None
        assert torch.equal(model.table, identity_table(2)) != moved, step


def test_a_bad_appearance_key_is_one_line():
    with pytest.raises(UserError, match="train.appearance must be one of none, affine, bilateral; got 'grid'"):
        _cfg({"train": {"appearance": "grid"}})
    with pytest.raises(UserError, match="train.appearance_lr must be > 0"):
        _cfg({"train": {"appearance": "affine", "appearance_lr": 0}})


def test_cli_names_a_bad_appearance_value_in_one_line(demo_scene, tmp_path):
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--steps", "2", "--set", "train.appearance=grid")
    assert_one_error(code, err, "train.appearance must be one of none, affine, bilateral")


def test_graphs_run_with_appearance_and_pose_refinement():
    """The policy only (the CUDA path itself: test_appearance_graph_cuda.py, test_pose_graph_cuda.py):
    the affine correction and pose refinement are graph-safe; a correction that is not keeps the
    run off graphs, and the engine note names only it."""
    from gstrain.train.corrections import engine_note
    from gstrain.train.pose_refine import PoseRefiner

    cfg = SimpleNamespace(dev=SimpleNamespace(cuda_graphs=True), train=SimpleNamespace(batch_size=1))
    renderer = SimpleNamespace(backend="cuda", options=SimpleNamespace(ellipse_cull=True))
    runner = SimpleNamespace(fused_adam=object(), corrections=[])
    assert graphs_possible(cfg, renderer, runner, torch.device("cuda"))
    appearance = AffineAppearance(3, torch.device("cpu"), lr=0.1)
    runner.corrections = [appearance]
    assert graphs_possible(cfg, renderer, runner, torch.device("cuda"))
    pose_cfg = _cfg({"train": {"pose_refine": True}})
    refiner = PoseRefiner([torch.eye(4)] * 3, torch.ones(3), 1.0, pose_cfg, torch.device("cpu"))
    runner.corrections = [refiner, appearance]
    assert graphs_possible(cfg, renderer, runner, torch.device("cuda"))
    eager_only = SimpleNamespace(name="eager_only", graph_safe=False)
    runner.corrections = [refiner, eager_only, appearance]
    assert not graphs_possible(cfg, renderer, runner, torch.device("cuda"))
    note = engine_note(runner.corrections, "eager")
    assert "train.eager_only" in note and "appearance" not in note and "pose_refine" not in note, note


# ----------------------------------------------------------------- resume and eval
SMALL_RUN = """
train: {steps: 30, seed: 3, device: cpu, appearance: affine, appearance_lr: 0.02, appearance_start: 5,
        appearance_decay: 0.1}
model: {init: random, init_points: 400}
strategy: {refine_start: 10, refine_every: 10, reset_every: 100000}
log: {progress_every: 5, tb_every: 100000, eval_steps: [30], save_steps: [], ckpt_every: 0}
"""


@pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1",
                    reason="bit-identical CPU sums need one thread (run with OMP_NUM_THREADS=1)")
def test_resume_with_appearance_equals_the_uninterrupted_run_and_eval_reports_both_protocols(demo_scene, tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text(SMALL_RUN)
    full, part = tmp_path / "full", tmp_path / "part"
    for args in ((full,), (part, "--set", "train.stop_at=15"), (part, "--resume", "--set", "train.stop_at=0")):
        code, err = call_cli("fit", demo_scene, "--config", config, "--out", *args)
        assert code == 0, err
    a = torch.load(full / "ckpt" / "step_30.pt", weights_only=True)
    b = torch.load(part / "ckpt" / "step_30.pt", weights_only=True)
    for key in a["params"]:
        assert torch.equal(a["params"][key], b["params"][key]), key
    table_a, table_b = a["corrections"]["appearance"], b["corrections"]["appearance"]
    assert not torch.equal(table_a["table"], identity_table(len(table_a["table"])))  # it learned
    assert torch.equal(table_a["table"], table_b["table"])
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(table_a["optimizer"]["state"][0][key], table_b["optimizer"]["state"][0][key]), key

    proc = run_cli("eval", part, "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "raw render, no per-image correction" in proc.stdout and "fitted on the left half" in proc.stdout
    metrics = json.loads((part / "metrics.json").read_text())
    assert metrics["protocol"].startswith("raw") and metrics["appearance"] == "affine"
    assert metrics["fitted_half"]["protocol"].startswith("fitted_half")
    assert len(metrics["fitted_half"]["per_image"]) == metrics["num_views"] == 2
    summary = json.loads((part / "train_summary.json").read_text())
    assert abs(metrics["psnr"] - summary["final_test_psnr"]) < 1e-3
    assert abs(metrics["fitted_half"]["psnr"] - summary["final_test_psnr_fitted_half"]) < 1e-3


def test_render_says_its_images_are_raw(demo_scene, tmp_path):
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "4", "--device", "cpu",
                         "--set", "train.appearance=affine", "--set", "log.eval_steps=[]")
    assert code == 0, err
    code, err = call_cli("render", run, "--path", "test", "--device", "cpu", "--out", tmp_path / "frames")
    assert code == 0, err
    assert "renders are raw" in err and "train.appearance=affine" in err

    # gstrain view says so too, once it serves (then this test stops the process it started)
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    view = subprocess.Popen([sys.executable, "-m", "gstrain", "view", str(run), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = ""
        while "serving" not in line:
            line = view.stderr.readline()
            assert line, view.communicate()  # it ended before serving
    finally:
        view.terminate()
        view.communicate(timeout=30)
    assert "renders are raw" in line and "train.appearance=affine" in line, line


# ----------------------------------------------------------------- sharded: replicated tables
SHARDED = {"train": {"steps": 12, "seed": 5, "batch_size": 2, "appearance": "affine", "appearance_lr": 0.02},
           "model": {"init": "random", "init_points": 400, "sh_degree": 1},
           "optim": {"eps": 1e-7},  # see tests/test_dist_trainer.py: comparisons about gradients, not rounding
           "strategy": {"refine_start": 1000, "refine_stop": 2000},
           "log": {"progress_every": 3, "tb_every": 100_000, "eval_steps": [], "save_steps": [], "ckpt_every": 0}}


def _sharded_cfg(stop_at: int = 0) -> object:
    over = {k: dict(v) for k, v in SHARDED.items()}
    over["train"]["device"] = "cpu"
    over["train"]["stop_at"] = stop_at
    return build_config(None, [over])


def _sharded_fit(rank: int, world: int, scene: str, root: str) -> dict:
    from gstrain.distributed.trainer import DistTrainer

    out = {}
    for name, stop_at, resume in (("whole", 0, False), ("paused", 6, False), ("paused", 0, True)):
        cfg = _sharded_cfg(stop_at)
        data = load_scene(Path(scene), factor=1, test_every=cfg.data.test_every)
        trainer = DistTrainer(cfg, data, Path(root) / name, torch.device("cpu"), log=lambda m: None)
        trainer.fit(resume=resume)
        out[name] = {"table": trainer.ctx.corrections[0].table.detach().clone(), "order": trainer.row_order,
                     "params": {k: v.detach().clone() for k, v in trainer.params.items()}}
    return out


def test_two_ranks_hold_one_table_equal_to_one_process_and_resume_it(demo_scene, tmp_path):
    from gstrain.distributed.local import run_local

    cfg = _sharded_cfg()
    data = load_scene(demo_scene, factor=1, test_every=cfg.data.test_every)
    (tmp_path / "plain").mkdir()
    plain = Trainer(cfg, data, tmp_path / "plain", torch.device("cpu"), log=lambda m: None)
    assert plain.fit().status == "done"
    expected = plain.ctx.corrections[0].table.detach()
    assert not torch.equal(expected, identity_table(len(expected)))

    for name in ("whole", "paused"):
        (tmp_path / name).mkdir()
    ranks = run_local(_sharded_fit, 2, str(demo_scene), str(tmp_path), timeout=300)
    for result in ranks:
        # every rank holds the whole table, and the same one (the gradients are summed over ranks)
        assert torch.equal(result["whole"]["table"], ranks[0]["whole"]["table"])
        # paused at step 6, resumed at two ranks: the uninterrupted run's table bit for bit
        assert torch.equal(result["paused"]["table"], result["whole"]["table"])
    # the global batch's mean loss, as one process takes it: the same table up to summation order
    torch.testing.assert_close(ranks[0]["whole"]["table"], expected, rtol=1e-4, atol=2e-5)
    got = {k: torch.cat([r["whole"]["params"][k] for r in ranks]) for k in ranks[0]["whole"]["params"]}
    order = ranks[0]["whole"]["order"]
    for k, v in plain.params.items():
        torch.testing.assert_close(got[k], v.detach()[order], rtol=1e-4, atol=2e-5, msg=k)


def test_resume_cannot_switch_appearance_and_writes_nothing(demo_scene, tmp_path):
    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "2", "--device", "cpu",
                         "--set", "log.eval_steps=[]")  # fmt: skip
    assert code == 0, err
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, err = call_cli("fit", demo_scene, "--out", run, "--steps", "4", "--resume",
                         "--set", "train.appearance=affine")  # fmt: skip
    assert_one_error(code, err, "--resume cannot change train.appearance: none -> affine")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_view_whose_right_half_is_masked_out_is_not_scored_by_fitted_half():
    from gstrain.train.appearance import scores_right_half

    keep = torch.ones(4, 6, dtype=torch.bool)
    assert scores_right_half(None) and scores_right_half(keep)
    keep[:, 3:] = False
    assert not scores_right_half(keep)
    keep[0, 5] = True
    assert scores_right_half(keep)
