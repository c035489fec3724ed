"""Random initial points in the cameras' view volume, for scenes that come without a point cloud.

A point is drawn by picking a training view, a pixel and a depth between near and far (uniform in
the frustum's volume), then kept with probability equal to the share of training views that see it
(in frame, between near and far). So the points fill the space the views look at together, densest
where most views overlap (an object-centric capture's object), not the space behind the cameras.
Each point takes the colour of the pixel it was drawn through.
"""

from __future__ import annotations

import numpy as np

from gstrain.data.scene import View

NEAR_FRACTION = 0.02  # near and far as fractions of the scene extent (camera spread x 1.1)
FAR_FRACTION = 2.0
_CHECK_VIEWS = 64  # views a candidate's coverage is counted over (a random subset when more)


def view_volume_points(views: list[View], n: int, extent: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """([n, 3] float32 world positions, [n, 3] uint8 colours) inside the views' shared frustum volume."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    if not views:
        raise ValueError("no views to draw points from")
    rng = np.random.default_rng(seed)
    near, far = NEAR_FRACTION * extent, FAR_FRACTION * extent
    cams = [_camera(v) for v in views]
    check = cams if len(cams) <= _CHECK_VIEWS else [cams[i] for i in rng.choice(len(cams), _CHECK_VIEWS, replace=False)]
    kept_xyz, kept_rgb, count = [], [], 0
    for _ in range(1000):  # coverage is >= 1/len(check) for most candidates: this ends in a few rounds
        xyz, rgb = _candidates(views, cams, max(4 * n, 1024), near, far, rng)
        seen = np.zeros(len(xyz))
        for K, R, t, w, h in check:
            cam = xyz @ R.T + t
            z = cam[:, 2]
            with np.errstate(divide="ignore", invalid="ignore"):
                u = K[0, 0] * cam[:, 0] / z + K[0, 2]
                v = K[1, 1] * cam[:, 1] / z + K[1, 2]
            seen += (z > near) & (z < far) & (u >= 0) & (u < w) & (v >= 0) & (v < h)
        keep = rng.random(len(xyz)) < seen / len(check)
        kept_xyz.append(xyz[keep])
        kept_rgb.append(rgb[keep])
        count += int(keep.sum())
        if count >= n:
            break
    xyz = np.concatenate(kept_xyz)[:n]
    rgb = np.concatenate(kept_rgb)[:n]
    return xyz.astype(np.float32), rgb


def _camera(view: View) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    viewmat = view.viewmat.double().numpy()
    return view.K.double().numpy(), viewmat[:3, :3], viewmat[:3, 3], view.width, view.height


def _candidates(
    views: list[View], cams: list, m: int, near: float, far: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """m points, each uniform in the frustum volume of a random view, and that view's pixel colour."""
    pick = rng.integers(0, len(views), m)
    xyz = np.empty((m, 3))
    rgb = np.empty((m, 3), np.uint8)
    for i in np.unique(pick):
        rows = np.flatnonzero(pick == i)
        K, R, t, w, h = cams[i]
        px = rng.random(len(rows)) * w
        py = rng.random(len(rows)) * h
        # depth with density ~ z^2: uniform over the frustum's volume, not crowded near the camera
        z = np.cbrt(near**3 + rng.random(len(rows)) * (far**3 - near**3))
        cam = np.stack([(px - K[0, 2]) / K[0, 0] * z, (py - K[1, 2]) / K[1, 1] * z, z], axis=1)
        xyz[rows] = (cam - t) @ R  # R^T (cam - t), row-wise
        rgb[rows] = views[i].image.numpy()[py.astype(int), px.astype(int)]
    return xyz, rgb
