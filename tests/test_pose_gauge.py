"""gstrain/train/pose_gauge.py against exact similarities of the world: the corrections that move a
camera rig by one rotation, translation and scale of the world (computed exactly, through the
matrix logarithm) are removed by the projection, and what it keeps is orthogonal to them; so is a
common rotation of every camera in its own frame; rigs too small for ten independent directions
get an orthonormal basis of what they have."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gstrain.train.pose_gauge import gauge_basis, without_gauge
from gstrain.train.pose_refine import PoseRefiner
from tests.test_pose_refine import rodrigues


def rotation_log(rot: np.ndarray) -> np.ndarray:
    """The axis-angle vector of a rotation matrix (angle below pi)."""
    angle = math.acos(min(max((np.trace(rot) - 1) / 2, -1.0), 1.0))
    axis = np.array([rot[2, 1] - rot[1, 2], rot[0, 2] - rot[2, 0], rot[1, 0] - rot[0, 1]]) / 2
    return axis if angle < 1e-12 else axis * angle / math.sin(angle)


def rig(n: int, rng: np.random.Generator) -> tuple[list[np.ndarray], np.ndarray]:
    """n world-to-camera matrices in general position and their rotation pivots (depths)."""
    mats = []
    for _ in range(n):
        m = np.eye(4)
        m[:3, :3] = rodrigues(rng.normal(size=3))
        m[:3, 3] = rng.normal(size=3) * 3
        mats.append(m)
    return mats, rng.uniform(1.0, 5.0, size=n)


def similarity_corrections(mats, pivots, extent: float, rot_world, shift, scale) -> np.ndarray:
    """The exact corrections [V,6] (pose_refine.correction_matrices' parametrisation) that render
    each camera's view of the world after x -> scale * rot_world @ x + shift, as it saw it before."""
    out = []
    for m, depth in zip(mats, pivots, strict=True):
        rot, trans = m[:3, :3], m[:3, 3]
        moved = np.eye(4)
        moved[:3, :3] = rot @ rot_world.T
        moved[:3, 3] = scale * trans - rot @ rot_world.T @ shift
        fix = moved @ np.linalg.inv(m)
        pivot = np.array([0.0, 0.0, depth])
        out.append(np.concatenate([rotation_log(fix[:3, :3]), (fix[:3, 3] - pivot + fix[:3, :3] @ pivot) / extent]))
    return np.array(out)


def test_a_similarity_of_the_world_is_removed():
    rng = np.random.default_rng(0)
    mats, pivots = rig(9, rng)
    basis = gauge_basis([torch.tensor(m) for m in mats], torch.tensor(pivots), 3.0)
    for size in (1e-5, 1e-3):
        rot_world = rodrigues(rng.normal(size=3) * size)
        moves = similarity_corrections(mats, pivots, 3.0, rot_world, rng.normal(size=3) * size, 1 + rng.normal() * size)
        moves = torch.tensor(moves)
        left = without_gauge(moves, basis)
        # first order: what is left is second order in the similarity's size
        assert float(left.norm()) < 10 * size * float(moves.norm()), (size, float(left.norm()), float(moves.norm()))


def test_what_the_projection_keeps_is_orthogonal_to_every_similarity():
    rng = np.random.default_rng(1)
    mats, pivots = rig(12, rng)
    basis = gauge_basis([torch.tensor(m) for m in mats], torch.tensor(pivots), 2.0)
    delta = torch.tensor(rng.normal(size=(12, 6)))
    kept = without_gauge(delta, basis)
    for k in range(7):  # each generator alone: 3 rotations, 3 translations, the scale
        g = np.zeros(7)
        g[k] = 1e-6
        move = similarity_corrections(mats, pivots, 2.0, rodrigues(g[:3]), g[3:6], 1 + g[6])
        cos = float((kept.numpy() * move).sum()) / (float(kept.norm()) * np.linalg.norm(move))
        assert abs(cos) < 1e-4, (k, cos)
    # and the part it removed lies in the gauge: projecting again changes nothing
    torch.testing.assert_close(without_gauge(kept, basis), kept, rtol=0, atol=1e-12)
    assert float((delta - kept).norm()) > 0.1  # a random delta has a gauge part to lose


def common_rotation(n_views: int, omega: np.ndarray) -> np.ndarray:
    """[V,6]: every camera turned by omega in its own frame about its pivot, no translation."""
    return np.concatenate([np.tile(omega, (n_views, 1)), np.zeros((n_views, 3))], axis=1)


def common_rotation_generators(n_views: int) -> np.ndarray:
    """[V*6, 3]: the corrections per unit of common rotation about each camera axis."""
    return np.stack([common_rotation(n_views, axis).reshape(-1) for axis in np.eye(3)], axis=1)


def test_a_common_rotation_in_the_cameras_frames_is_removed():
    rng = np.random.default_rng(2)
    mats, pivots = rig(11, rng)
    basis = gauge_basis([torch.tensor(m) for m in mats], torch.tensor(pivots), 2.0)
    assert basis.shape == (66, 10)
    torch.testing.assert_close(basis.T @ basis, torch.eye(10, dtype=torch.float64), rtol=0, atol=1e-12)
    delta = torch.tensor(rng.normal(size=(11, 6)) * 1e-3)
    kept = without_gauge(delta, basis)
    common = torch.tensor(common_rotation(11, np.array([0.02, -0.01, 0.005])))
    # adding a common rotation changes nothing that is kept: it is removed whole
    torch.testing.assert_close(without_gauge(delta + common, basis), kept, rtol=0, atol=1e-12)
    # and what is kept has no common rotation left: its mean omega is zero
    assert float(kept[:, :3].mean(dim=0).abs().max()) < 1e-12


@pytest.mark.parametrize("n_views", [1, 2])
def test_a_rig_with_fewer_directions_gets_an_orthonormal_basis_of_them(n_views):
    """One view has 6 directions, all of them gauge (ten columns, rank 6); two views have 12 and
    the ten columns are independent only if no two coincide. QR would return ten columns either way,
    some of them arbitrary; the basis must be exactly orthonormal and span only the columns."""
    rng = np.random.default_rng(4)
    mats, pivots = rig(n_views, rng)
    basis = gauge_basis([torch.tensor(m) for m in mats], torch.tensor(pivots), 2.0)
    k = basis.shape[1]
    assert k <= min(10, 6 * n_views)
    torch.testing.assert_close(basis.T @ basis, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-12)
    generators = np.concatenate([similarity_generators(mats, pivots, 2.0), common_rotation_generators(n_views)], 1)
    assert np.linalg.matrix_rank(generators, tol=1e-6) == k
    # every generator lies in the basis' span (what the projection removes is theirs alone)
    residual = generators - basis.numpy() @ (basis.numpy().T @ generators)
    assert np.abs(residual).max() < 1e-5 * np.abs(generators).max()


def similarity_generators(mats, pivots, extent: float) -> np.ndarray:
    """[V*6, 7]: the corrections per unit of each similarity generator, by finite differences."""
    step = 1e-7
    columns = []
    for k in range(7):
        g = np.zeros(7)
        g[k] = step
        move = similarity_corrections(mats, pivots, extent, rodrigues(g[:3]), g[3:6], 1 + g[6])
        columns.append(move.reshape(-1) / step)
    return np.stack(columns, axis=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_refiner_step_is_adam_less_its_gauge_part(device):
    """One update of view 3 with a known gradient: Adam's first step is -lr * sign(gradient) on
    that row; the refiner keeps it less its least-squares fit by the exact similarity moves and
    the common rotations."""
    rng = np.random.default_rng(5)
    mats, pivots = rig(10, rng)
    cfg = SimpleNamespace(optim=SimpleNamespace(pose_lr=1e-3, pose_lr_final=1e-4),
                          train=SimpleNamespace(pose_refine_start=0, steps=100))  # fmt: skip
    refiner = PoseRefiner([torch.tensor(m) for m in mats], torch.tensor(pivots, dtype=torch.float32), 2.0, cfg,
                          torch.device(device))  # fmt: skip
    grad = torch.tensor(rng.normal(size=(10, 6)), dtype=torch.float32)
    refiner.camera(torch.eye(4, device=device), SimpleNamespace(index=3), 0)  # view 3 is rendered
    refiner.delta.grad = grad.to(device)
    refiner.after_step(0)
    step = np.zeros((10, 6))
    step[3] = -1e-3 * np.sign(grad[3].numpy())
    generators = similarity_generators(mats, pivots.astype(np.float32).astype(np.float64), 2.0)
    generators = np.concatenate([generators, common_rotation_generators(10)], 1)
    fit, *_ = np.linalg.lstsq(generators, step.reshape(-1), rcond=None)
    expected = step - (generators @ fit).reshape(10, 6)
    np.testing.assert_allclose(refiner.delta.detach().cpu().double().numpy(), expected, rtol=0, atol=2e-8)


def test_the_similarity_gauge_alone_keeps_a_common_rotation():
    """common_rotation=False: seven directions, a similarity of the world still removed to first
    order, and a common rotation in the cameras' frames (not a similarity for a rig in general
    position) mostly kept."""
    rng = np.random.default_rng(4)
    mats, pivots = rig(9, rng)
    basis = gauge_basis([torch.tensor(m) for m in mats], torch.tensor(pivots), 3.0, common_rotation=False)
    assert basis.shape == (54, 7)
    torch.testing.assert_close(basis.T @ basis, torch.eye(7, dtype=torch.float64), rtol=0, atol=1e-12)
    moves = torch.tensor(similarity_corrections(mats, pivots, 3.0, rodrigues(rng.normal(size=3) * 1e-5),
                                                rng.normal(size=3) * 1e-5, 1 + rng.normal() * 1e-5))  # fmt: skip
    assert float(without_gauge(moves, basis).norm()) < 1e-4 * float(moves.norm())
    common = torch.tensor(common_rotation(9, np.array([0.02, -0.01, 0.005])))
    assert float(without_gauge(common, basis).norm()) > 0.5 * float(common.norm())
