"""Pose error after the best similarity alignment (Umeyama 1991), the way camera-refinement work
(BARF, nerfstudio's camera optimizer) scores learned poses: a run that refines poses jointly with
the scene may drift as a whole (the world frame is not anchored: rotating every camera and the
scene together renders the same images), so the raw error mixes that gauge drift with the
per-view error the refinement is meant to remove."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def umeyama(src: np.ndarray, dst: np.ndarray, with_scale: bool = True) -> tuple[float, np.ndarray, np.ndarray]:
    """(s, R, t) minimising sum |dst_i - (s R src_i + t)|^2 over points src, dst [N, 3] (least
    squares, closed form from the SVD of their cross-covariance; R a proper rotation)."""
    src, dst = np.asarray(src, dtype=np.float64), np.asarray(dst, dtype=np.float64)
    mu_s, mu_d = src.mean(axis=0), dst.mean(axis=0)
    a, b = src - mu_s, dst - mu_d
    cov = b.T @ a / len(src)
    u, sing, vt = np.linalg.svd(cov)
    sign = np.eye(3)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:  # a reflection fits better: take the best rotation
        sign[2, 2] = -1.0
    rot = u @ sign @ vt
    var = (a**2).sum() / len(src)
    scale = float(np.trace(np.diag(sing) @ sign) / var) if with_scale and var > 0 else 1.0
    return scale, rot, mu_d - scale * rot @ mu_s


def _centres_and_rotations(viewmats: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Camera centres [N,3] and camera-to-world rotations [N,3,3] of world-to-camera matrices.
    Inverses, not transposes: a float32 pose is orthonormal only to ~1e-7, which would move the
    angle of a 0.2 degree turn by ~1e-3 degrees."""
    mats = np.asarray([np.asarray(m, dtype=np.float64) for m in viewmats])
    rot_wc = np.linalg.inv(mats[:, :3, :3])
    return -(rot_wc @ mats[:, :3, 3:])[:, :, 0], rot_wc


def view_errors(estimated: Sequence[np.ndarray], truth: Sequence[np.ndarray], extent: float,
                align: bool = False) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Per view, the rotation error (degrees) and camera-centre error (fraction of `extent`) of
    estimated world-to-camera matrices against the true ones; `align`: after mapping the estimated
    cameras by the similarity that best fits their centres to the true ones (umeyama)."""
    centres, rots = _centres_and_rotations(estimated)
    true_centres, true_rots = _centres_and_rotations(truth)
    if align:
        scale, rot, shift = umeyama(centres, true_centres)
        centres = scale * centres @ rot.T + shift
        rots = rot[None] @ rots
    turns = np.linalg.solve(rots, true_rots)  # each estimated camera's rotation onto the true one
    sines = np.linalg.norm(turns - np.transpose(turns, (0, 2, 1)), axis=(1, 2)) / (2 * math.sqrt(2))
    cosines = (np.trace(turns, axis1=1, axis2=2) - 1) / 2
    # atan2 of sine and cosine keeps small angles exact, where acos of the trace would lose them
    return np.degrees(np.arctan2(sines, cosines)), np.linalg.norm(centres - true_centres, axis=1) / extent


def pose_errors(estimated: Sequence[np.ndarray], truth: Sequence[np.ndarray], extent: float,
                align: bool = False) -> tuple[float, float]:  # fmt: skip
    """Mean rotation error (degrees) and camera-centre error (fraction of `extent`): view_errors'
    means."""
    rotation, centre = view_errors(estimated, truth, extent, align)
    return float(rotation.mean()), float(centre.mean())
