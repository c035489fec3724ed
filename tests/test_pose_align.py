"""gstrain/train/pose_align.py against known transforms: a similarity applied to a camera rig is
undone exactly, and the aligned error of a rig with per-view errors equals those errors."""

from __future__ import annotations

import math

import numpy as np

from gstrain.train.pose_align import pose_errors, umeyama


def rotation(axis, degrees: float) -> np.ndarray:
    k = np.asarray(axis, dtype=np.float64) / np.linalg.norm(axis)
    kx = np.array([[0, -k[2], k[1]], [k[2], 0, -k[0]], [-k[1], k[0], 0]])
    a = math.radians(degrees)
    return np.eye(3) + math.sin(a) * kx + (1 - math.cos(a)) * kx @ kx


def viewmat(rot_wc: np.ndarray, centre: np.ndarray) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = rot_wc.T
    out[:3, 3] = -rot_wc.T @ centre
    return out


def rig(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [viewmat(rotation(rng.normal(size=3), rng.uniform(0, 180)), rng.normal(size=3) * 3) for _ in range(n)]


def test_umeyama_recovers_a_known_similarity():
    rng = np.random.default_rng(0)
    src = rng.normal(size=(20, 3))
    rot, scale, shift = rotation([1, 2, 3], 37.0), 1.7, np.array([0.3, -2.0, 5.0])
    s, r, t = umeyama(src, scale * src @ rot.T + shift)
    assert math.isclose(s, scale, rel_tol=1e-12)
    np.testing.assert_allclose(r, rot, atol=1e-12)
    np.testing.assert_allclose(t, shift, atol=1e-12)
    s, r, t = umeyama(src, src @ rot.T + shift, with_scale=False)
    assert s == 1.0
    np.testing.assert_allclose(r, rot, atol=1e-12)


def test_umeyama_returns_a_rotation_for_mirrored_points():
    rng = np.random.default_rng(1)
    src = rng.normal(size=(10, 3))
    _, r, _ = umeyama(src, src * np.array([1.0, 1.0, -1.0]))
    assert math.isclose(np.linalg.det(r), 1.0, rel_tol=1e-12)


def test_a_moved_rig_has_raw_error_but_no_aligned_error():
    truth = rig(8, seed=2)
    rot, scale, shift = rotation([0, 1, 1], 2.0), 1.05, np.array([0.1, 0.2, -0.1])
    moved = []
    for m in truth:  # every camera through the same similarity of the world
        rot_wc, centre = m[:3, :3].T, -m[:3, :3].T @ m[:3, 3]
        moved.append(viewmat(rot @ rot_wc, scale * rot @ centre + shift))
    raw = pose_errors(moved, truth, extent=1.0)
    assert raw[0] > 1.9 and raw[1] > 0.05
    aligned = pose_errors(moved, truth, extent=1.0, align=True)
    assert aligned[0] < 1e-6 and aligned[1] < 1e-9


def test_aligned_error_of_per_view_rotations_is_their_angle():
    truth = rig(12, seed=3)
    rng = np.random.default_rng(4)
    turned = [viewmat(rotation(rng.normal(size=3), 1.0) @ m[:3, :3].T, -m[:3, :3].T @ m[:3, 3]) for m in truth]
    rot_err, centre_err = pose_errors(turned, truth, extent=1.0, align=True)
    assert math.isclose(rot_err, 1.0, rel_tol=1e-9) and centre_err < 1e-9
