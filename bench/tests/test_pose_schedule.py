"""bench/pose_schedule.py: its perturbation is the known answer's (1 degree, 1% of the extent), a
scene-only phase leaves the poses as they were and a pose-only phase the scene."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from bench.pose_schedule import Schedule, axis_errors, perturbed
from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train.pose_align import pose_errors
from gstrain.train.run_record import RunRecord
from gstrain.train.trainer import Trainer


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_perturbation_is_one_degree_and_one_percent(demo_scene):
    scene = load_scene(demo_scene)
    moved = perturbed(list(scene.train), scene.extent, seed=1)
    arrays = lambda views: [v.viewmat.double().numpy() for v in views]  # noqa: E731
    rot, centre = pose_errors(arrays(moved), arrays(scene.train), scene.extent)
    assert rot == pytest.approx(1.0, rel=1e-3) and centre == pytest.approx(0.01, rel=1e-3)  # float32 poses


def test_scene_phase_holds_the_poses_and_pose_phase_holds_the_scene(demo_scene, tmp_path):
    scene = load_scene(demo_scene)
    scene.train = perturbed(list(scene.train), scene.extent, seed=1)
    cfg = build_config(overrides=[{
        "train": {"steps": 10, "device": "cpu", "pose_refine": True}, "model": {"sh_degree": 0},
        "strategy": {"refine_start": 10**6},
        "log": {"progress_every": 10**6, "ckpt_every": 0, "tb_every": 10**6, "eval_steps": [], "save_steps": []},
    }])  # fmt: skip
    trainer = Trainer(cfg, scene, tmp_path, torch.device("cpu"), log=lambda m: None)
    trainer._begin(False, None)
    trainer.record = RunRecord(first_step=0, max_gaussians=trainer.gaussian_count())
    sched = Schedule(trainer, pose_updates=4, lr=5e-3, lr_final=5e-4, pose_gauge=False, seed=1)
    scene_before = digest(trainer.params.values())
    sched.scene_steps(3, poses_learn=False)
    assert digest(trainer.params.values()) != scene_before
    assert not trainer.pose_refiner.delta.detach().any() and int(trainer.pose_refiner.updates.sum()) == 0
    scene_after = digest(trainer.params.values())
    sched.pose_steps(4)
    assert digest(trainer.params.values()) == scene_after
    moved_rows = trainer.pose_refiner.delta.detach().abs().amax(dim=1) > 0
    assert int(moved_rows.sum()) == 4  # four distinct views, gauge off: only theirs
    assert all(p.requires_grad for p in trainer.params.values())


def rodrigues(omega) -> np.ndarray:
    """exp([omega]x), Rodrigues' formula."""
    omega = np.asarray(omega, dtype=np.float64)
    angle = float(np.linalg.norm(omega))
    k = omega / angle
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    return np.eye(3) + np.sin(angle) * kx + (1 - np.cos(angle)) * kx @ kx


def test_axis_errors_read_back_a_known_rotation_in_each_camera_frame():
    """Each camera turned by a known axis-angle about its own centre, the whole set then moved by
    a similarity of the world: axis_errors gives minus each turn (the way back), in degrees."""
    rng = np.random.default_rng(0)
    truth, estimated, turns = [], [], []
    world = np.eye(4)
    world[:3, :3] = rodrigues([0.3, -0.2, 0.5])
    world[:3, 3] = [1.0, 2.0, -0.5]
    for _ in range(6):
        mat = np.eye(4)
        mat[:3, :3] = rodrigues(rng.normal(size=3))
        mat[:3, 3] = rng.normal(size=3) * 3
        turn = rng.normal(size=3) * 0.01
        turned = mat.copy()
        turned[:3, :3] = rodrigues(turn) @ mat[:3, :3]
        turned[:3, 3] = rodrigues(turn) @ mat[:3, 3]  # the same centre
        moved = turned @ np.linalg.inv(world)  # world points x -> world @ x: the camera follows
        moved[:3, 3] *= 2.0  # and the world scaled by 2 about the origin after it
        truth.append(mat)
        estimated.append(moved)
        turns.append(turn)
    np.testing.assert_allclose(axis_errors(estimated, truth), -np.degrees(turns), atol=1e-9)
