"""The gauge of train.pose_refine: the seven directions in which the per-view corrections can move
every camera by one similarity of the world (rotation, translation, scale).

Rotating, shifting or scaling the whole scene and every camera together renders the same images,
so the photometric loss cannot see those seven directions. Left free, the cameras drift along
them with the scene, and the test views, which keep their given poses, are then rendered against
a scene that has moved away from them. PoseRefiner removes the gauge component from the
corrections after each step, so the corrected cameras stay, on average, where they were given:
the SfM frame, which is the test views' frame too.

Why this and not an anchored view: freezing one view fixes rotation and translation but puts
that view's own pose error into the whole frame (and leaves the scale free); the zero-mean
projection spreads it over every view. On the demo scene (1 degree / 1% perturbation, 1000 joint
steps) test PSNR was 25.95 dB with the projection, 25.03 dB with view 0 anchored, 25.48 dB with a
projection weighted by Adam's second moments, 22.85 dB without refinement.

For view i with world-to-camera rotation R_i, translation t_i and rotation pivot p_i = (0, 0, d_i)
(train/pose_refine.py correction_matrices), an infinitesimal similarity x -> (1 + s) x + [theta]x x + b
of the world is matched, to first order, by the correction

    omega_i = -R_i theta
    tau_i   = ((R_i theta) x (t_i - p_i) - R_i b + s t_i) / extent

(the camera's coordinates scale with the world, which a pinhole image does not see). The seven
columns of that linear map, stacked over the views, span the gauge; `gauge_basis` returns them
orthonormalised, and the projection removes their span from the [V, 6] corrections.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GAUGE_DIMENSIONS = 7  # a similarity of 3D space: rotation 3, translation 3, scale 1


def _cross_columns(vectors: Tensor) -> Tensor:
    """[V,3,3] matrices M_i with M_i w = w x vectors_i, i.e. -[vectors_i]x."""
    x, y, z = vectors.unbind(-1)
    zero = torch.zeros_like(x)
    skew = torch.stack([zero, -z, y, z, zero, -x, -y, x, zero], dim=-1).reshape(-1, 3, 3)
    return -skew


def gauge_basis(viewmats: Sequence[Tensor], pivots: Tensor, extent: float) -> Tensor:
    """An orthonormal basis [V*6, 7] (float64) of the corrections that move every camera by one
    infinitesimal similarity of the world (module docstring), in the layout of delta.reshape(-1)."""
    mats = torch.stack([torch.as_tensor(m).detach().double().cpu() for m in viewmats])
    rot, trans = mats[:, :3, :3], mats[:, :3, 3]
    n_views = len(mats)
    pivot = torch.zeros(n_views, 3, dtype=torch.float64)
    pivot[:, 2] = pivots.detach().double().cpu()
    columns = torch.zeros(n_views, 6, GAUGE_DIMENSIONS, dtype=torch.float64)
    # rotation theta: omega = -R theta; tau = (R theta) x (t - p) / extent
    columns[:, :3, 0:3] = -rot
    columns[:, 3:, 0:3] = _cross_columns(trans - pivot) @ rot / extent
    # translation b, in units of the extent so that its columns weigh like the others
    columns[:, 3:, 3:6] = -rot
    # scale about the world origin
    columns[:, 3:, 6] = trans / extent
    basis, _ = torch.linalg.qr(columns.reshape(n_views * 6, GAUGE_DIMENSIONS))
    return basis


def without_gauge(delta: Tensor, basis: Tensor) -> Tensor:
    """delta [V,6] less its component in the span of `basis` (gauge_basis, on delta's device)."""
    flat = delta.reshape(-1, 1).to(basis.dtype)
    return (flat - basis @ (basis.T @ flat)).reshape(delta.shape).to(delta.dtype)
