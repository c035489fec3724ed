"""train.pose_refine: the correction's maths against Rodrigues' formula, gradients through the
reference renderer, checkpoints and exact --resume, the refined training poses in `gstrain
render`/open_run, and the known answer on the demo scene (perturbed training poses are pulled
back towards the true ones)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train.pose_align import pose_errors as aligned_pose_errors
from gstrain.train.pose_align import umeyama
from gstrain.train.pose_refine import STATE_KEY, correction_matrices
from gstrain.train.trainer import Trainer
from tests.cli_util import assert_one_error, call_cli


def rodrigues(omega: np.ndarray) -> np.ndarray:
    angle = float(np.linalg.norm(omega))
    if angle == 0.0:
        return np.eye(3)
    k = omega / angle
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + math.sin(angle) * kx + (1 - math.cos(angle)) * kx @ kx


def corrected(delta: np.ndarray, extent: float, viewmat: np.ndarray, pivot: float = 0.0) -> np.ndarray:
    """viewmat rotated by delta[:3] about the point `pivot` ahead of the camera, then moved by
    delta[3:] * extent, in camera coordinates."""
    rot, ahead = rodrigues(delta[:3]), np.array([0.0, 0.0, pivot])
    fix = np.eye(4)
    fix[:3, :3] = rot
    fix[:3, 3] = delta[3:] * extent + ahead - rot @ ahead
    return fix @ viewmat


def perturbed(views, extent: float, seed: int, degrees: float = 1.0, fraction: float = 0.01):
    """Each view's pose moved by `degrees` about a random axis and `fraction` of the extent in a
    random direction, in its camera frame."""
    rng = np.random.default_rng(seed)
    out = []
    for view in views:
        axis, direction = (v / np.linalg.norm(v) for v in rng.normal(size=(2, 3)))
        delta = np.concatenate([axis * math.radians(degrees), direction * fraction])
        moved = corrected(delta, extent, view.viewmat.double().numpy())
        out.append(dataclasses.replace(view, viewmat=torch.tensor(moved, dtype=torch.float32)))
    return out


def pose_errors(views, truth, extent: float) -> tuple[float, float]:
    """Mean rotation error (degrees) and camera-centre error (fraction of the extent)."""
    rot, trans = [], []
    for a, b in zip(views, truth, strict=True):
        A, B = a.viewmat.double().numpy(), b.viewmat.double().numpy()
        cos = (np.trace(A[:3, :3] @ B[:3, :3].T) - 1) / 2
        rot.append(math.degrees(math.acos(min(max(cos, -1.0), 1.0))))
        trans.append(np.linalg.norm(A[:3, :3].T @ A[:3, 3] - B[:3, :3].T @ B[:3, 3]) / extent)
    return float(np.mean(rot)), float(np.mean(trans))


def config(steps: int, refine: bool, **train):
    return build_config(overrides=[{
        "train": {"steps": steps, "device": "cpu", "pose_refine": refine, **train},
        "log": {"progress_every": 10, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [], "save_steps": []},
        "strategy": {"refine_start": 10, "refine_every": 10}, "model": {"sh_degree": 1},
    }])  # fmt: skip


@pytest.fixture(scope="module")
def scene(demo_scene):
    return load_scene(demo_scene)


def test_correction_is_rodrigues_and_extent_scaled():
    rng = np.random.default_rng(3)
    delta = rng.normal(scale=0.3, size=(5, 6))
    delta[0] = 0.0  # the identity, where the exp map starts
    viewmat = np.eye(4)
    viewmat[:3, :3] = rodrigues(rng.normal(size=3))
    viewmat[:3, 3] = rng.normal(size=3)
    pivots = rng.uniform(0.5, 5.0, size=5)
    fixes = correction_matrices(torch.tensor(delta), 2.5, torch.tensor(pivots)).numpy()
    for d, fix, pivot in zip(delta, fixes, pivots, strict=True):
        np.testing.assert_allclose(fix @ viewmat, corrected(d, 2.5, viewmat, pivot), atol=1e-12)
    np.testing.assert_array_equal(fixes[0], np.eye(4))


@pytest.mark.parametrize("gauge", [False, True])
def test_camera_gradient_reaches_only_rendered_views(scene, tmp_path, gauge):
    """Adam steps the rendered view's row alone (its moments and step count); with the gauge held
    (train/pose_gauge.py) the projection then spreads a small share of that step over every view
    (ten directions over 14 views: about a quarter of the step at most, measured 0.25)."""
    trainer = Trainer(config(1, True), scene, tmp_path, torch.device("cpu"), log=lambda m: None)
    refiner = trainer.pose_refiner
    if not gauge:
        refiner.gauge = None
    view = trainer.ctx.views.step_view(3)
    trainer.runner.run(trainer.params, trainer.optimizers, 0, [view], 0, trainer.background)
    only_3 = [i == 3 for i in range(len(scene.train))]
    assert (refiner.exp_avg != 0).any(dim=1).tolist() == only_3
    assert refiner.updates.tolist() == [int(i) for i in only_3]
    assert refiner.delta.grad is None  # cleared for the next step
    moved = refiner.delta.detach().abs().amax(dim=1)
    if gauge:
        others = torch.cat([moved[:3], moved[4:]])
        assert 0 < others.max() < 0.3 * moved[3], moved.tolist()
    else:
        assert (moved != 0).tolist() == only_3


def test_warm_up_leaves_poses_alone(scene, tmp_path):
    trainer = Trainer(config(6, True, pose_refine_start=6), scene, tmp_path, torch.device("cpu"), log=lambda m: None)
    trainer.fit()
    assert not trainer.pose_refiner.delta.detach().any()
    assert int(trainer.pose_refiner.updates.sum()) == 0


def test_resume_is_exact_with_pose_refine(scene, tmp_path):
    whole = Trainer(config(30, True), scene, tmp_path / "whole", torch.device("cpu"), log=lambda m: None)
    whole.fit()
    first = Trainer(config(30, True, stop_at=15), scene, tmp_path / "split", torch.device("cpu"), log=lambda m: None)
    assert first.fit().status == "stopped"
    state = torch.load(tmp_path / "split" / "ckpt" / "step_15.pt", weights_only=True)["corrections"]
    assert set(state[STATE_KEY]) >= {"delta", "exp_avg", "exp_avg_sq", "updates", "extent"}
    assert state[STATE_KEY]["delta"].abs().sum() > 0
    second = Trainer(config(30, True), scene, tmp_path / "split", torch.device("cpu"), log=lambda m: None)
    second.fit(resume=True)
    for key, value in whole.params.items():
        assert torch.equal(value, second.params[key]), key
    for key, value in whole.pose_refiner.state_dict().items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(second.pose_refiner.state_dict()[key])), key


def test_render_and_eval_read_the_refined_training_poses(demo_scene, tmp_path):
    from gstrain.run_dir import open_run

    run = tmp_path / "run"
    code, err = call_cli("fit", demo_scene, "--steps", "20", "--out", run, "--set", "train.pose_refine=true",
                         "--set", "optim.pose_lr=0.01", "--set", "log.progress_every=10")  # fmt: skip
    assert code == 0, err
    opened = open_run(run, "cpu")
    state = torch.load(opened.checkpoint, weights_only=True)["corrections"][STATE_KEY]
    given = load_scene(demo_scene)
    delta = state["delta"].double().numpy()
    assert np.abs(delta).max() > 1e-4  # the poses moved
    pivots = state["pivots"].double().numpy()
    assert np.all((pivots > 3.0) & (pivots < 6.0))  # the demo's cameras look at the sphere from 4.5 units
    for view, original, d, pivot in zip(opened.scene.train, given.train, delta, pivots, strict=True):
        expected = corrected(d, given.extent, original.viewmat.double().numpy(), pivot)
        np.testing.assert_allclose(view.viewmat.double().numpy(), expected, atol=1e-5)
    for view, original in zip(opened.scene.test, given.test, strict=True):  # test views: as given
        assert torch.equal(view.viewmat, original.viewmat)
    # the run says how far each camera moved: the turn is the correction's angle |omega| (Rodrigues),
    # the centres' distance from the same corrections in numpy, in float64
    change = json.loads((run / "train_summary.json").read_text())["pose_refinement"]
    expected = {}
    for original, d, pivot in zip(given.train, delta, pivots, strict=True):
        a = original.viewmat.double().numpy()
        b = corrected(d, given.extent, a, pivot)
        shift = np.linalg.norm(np.linalg.solve(a[:3, :3], a[:3, 3]) - np.linalg.solve(b[:3, :3], b[:3, 3]))
        expected[original.name] = (math.degrees(np.linalg.norm(d[:3])), shift / given.extent)
    assert set(change["views"]) == set(expected)
    for name, (angle, shift) in expected.items():
        assert change["views"][name] == pytest.approx([angle, shift], rel=1e-5, abs=1e-9), name
    most = max(expected, key=lambda name: expected[name][0])
    assert change["rotation_deg"]["max_view"] == most
    assert change["rotation_deg"]["median"] == pytest.approx(float(np.median([a for a, _ in expected.values()])),
                                                             rel=1e-5)  # fmt: skip
    assert change["centre_of_extent"]["max"] == pytest.approx(max(s for _, s in expected.values()), rel=1e-5)
    assert "pose refinement moved the training cameras by" in err


@pytest.mark.parametrize(("key", "value"), [("optim.pose_lr", "-1"), ("optim.pose_lr_final", "nan"),
                                            ("train.pose_refine_start", "-5")])
def test_bad_pose_refine_values_are_one_line(demo_scene, tmp_path, key, value):
    code, err = call_cli("fit", demo_scene, "--steps", "5", "--out", tmp_path / "run",
                         "--set", "train.pose_refine=true", "--set", f"{key}={value}")  # fmt: skip
    assert_one_error(code, err, key)
    assert not (tmp_path / "run").exists()


def test_sharded_run_refuses_pose_refine():
    from gstrain.distributed.trainer import _check_sharded
    from gstrain.errors import UserError

    with pytest.raises(UserError, match="train.pose_refine with several ranks"):
        _check_sharded(config(10, True))


def aligned_axis_errors(views, truth) -> np.ndarray:
    """Per view, the rotation error (degrees, axis-angle in the true camera's frame: x pitch, y yaw,
    z roll) after the similarity that best maps the views' centres onto the true ones (umeyama)."""
    est = [v.viewmat.double().numpy() for v in views]
    true = [v.viewmat.double().numpy() for v in truth]
    centre = lambda m: -m[:3, :3].T @ m[:3, 3]  # noqa: E731
    _, rot, _ = umeyama(np.array([centre(m) for m in est]), np.array([centre(m) for m in true]))
    out = []
    for a, b in zip(est, true, strict=True):
        err = b[:3, :3] @ (rot @ a[:3, :3].T)  # true world-to-camera after the aligned camera-to-world
        angle = math.acos(min(max((np.trace(err) - 1) / 2, -1.0), 1.0))
        axis = np.array([err[2, 1] - err[1, 2], err[0, 2] - err[2, 0], err[1, 0] - err[0, 1]]) / 2
        out.append(np.degrees(axis * angle / math.sin(angle)) if angle > 1e-12 else np.zeros(3))
    return np.array(out)


@pytest.mark.slow
def test_known_answer_joint_refinement(demo_scene, tmp_path):
    """Training poses perturbed by 1 degree and 1% of the extent, the scene and poses learned
    together from the SfM points for 500 steps: test PSNR rises by at least 1.5 dB over the same run
    without refinement (the test views keep their given poses, so this needs the gauge held), and
    the pose error shrinks on every axis, aligned (umeyama) and raw.

    What it measures against the seven-direction gauge alone: there every camera pitched up
    together by about 1 degree (the common rotation in the cameras' frames, which joint training
    drifts along even from the true poses; train/pose_gauge.py), so the aligned rotation error went
    1.01 -> 0.96 degrees; with the common rotation held too it goes to 0.34 (pitch 0.50 -> 0.23).
    The brief's 5x (0.20 degrees, 0.18% here) is not reached, and not reachable by this estimator:
    the same joint run started from the TRUE poses ends 0.22 degrees and 0.28% of the extent away
    (0.37 degrees after 1500 steps), and even a scene fitted on the true poses and frozen pulls
    the poses 0.24 degrees off: the scene's misfit biases each view's best pose (bench/NOTES.md,
    "Where joint refinement settles when it starts at the answer")."""
    steps = 500

    def fit(refine: bool, folder: str):
        scene = load_scene(demo_scene)
        truth = list(scene.train)
        scene.train = perturbed(truth, scene.extent, seed=1)
        cfg = build_config(overrides=[{
            "train": {"steps": steps, "device": "cpu", "pose_refine": refine},
            # the default rate is for full-length runs; 500 steps update each view ~36 times
            "optim": {"pose_lr": 5e-3, "pose_lr_final": 5e-4},
            "model": {"sh_degree": 0}, "strategy": {"refine_start": 10**6},
            "log": {"progress_every": 10**6, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [], "save_steps": []},
        }])  # fmt: skip
        trainer = Trainer(cfg, scene, tmp_path / folder, torch.device("cpu"), log=lambda m: None)
        return trainer, trainer.fit(), scene.train, truth

    trainer, refined_run, given, truth = fit(True, "refined")
    _, plain_run, _, _ = fit(False, "plain")
    refined = trainer.pose_refiner.refined(given)
    as_arrays = lambda views: [v.viewmat.double().numpy() for v in views]  # noqa: E731
    extent = load_scene(demo_scene).extent
    before = aligned_pose_errors(as_arrays(given), as_arrays(truth), extent, align=True)
    after = aligned_pose_errors(as_arrays(refined), as_arrays(truth), extent, align=True)
    raw_before = aligned_pose_errors(as_arrays(given), as_arrays(truth), extent)
    raw_after = aligned_pose_errors(as_arrays(refined), as_arrays(truth), extent)
    axes_before = np.abs(aligned_axis_errors(given, truth)).mean(axis=0)
    axes_after = np.abs(aligned_axis_errors(refined, truth)).mean(axis=0)
    report = (f"aligned (deg, centre/extent) {before} -> {after}; raw {raw_before} -> {raw_after}; "
              f"|pitch, yaw, roll| {axes_before.round(3)} -> {axes_after.round(3)}; test PSNR "
              f"{plain_run.final_test_psnr:.2f} without refinement, {refined_run.final_test_psnr:.2f} with")
    print(report)
    assert raw_before == pytest.approx((1.0, 0.01), rel=1e-3), report
    assert refined_run.final_test_psnr > plain_run.final_test_psnr + 1.5, report
    # measured: 2.99x rotation, 1.93x centre aligned; 2.55x, 1.77x raw; every axis 2.2x or more
    assert after[0] < before[0] / 2.5 and after[1] < before[1] / 1.6, report
    assert raw_after[0] < raw_before[0] / 2.2 and raw_after[1] < raw_before[1] / 1.5, report
    assert (axes_after < axes_before / 1.8).all(), report
