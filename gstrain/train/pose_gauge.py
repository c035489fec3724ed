"""The gauge of train.pose_refine: the seven directions in which the per-view corrections can move
every camera by one similarity of the world (rotation, translation, scale), and the three of a
common rotation of every camera in its own frame, which the images barely constrain.

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
columns of that linear map, stacked over the views, span the gauge.

The common rotation: omega_i = w for every view (in its own camera frame, about its pivot), tau_i
= 0. Where the cameras look at one object from around it (the demo's rings, most object
captures), turning every camera the same way in its own frame, e.g. all of them up, with the
scene stretched to match, renders nearly the same images: it is not a similarity, so the seven
directions leave it free, and joint training drifts along it. On the demo scene it drifted by
0.7-1.5 degrees of common pitch within 500 steps even from the TRUE poses (aligned rotation error
0.74 degrees from zero), which is the error the refinement then cannot remove. Held at zero, the
corrections keep the given poses' mean rotation in the camera frame; the cost is that a true
common rotation error of the given poses (the mean of independent errors, about 1/sqrt(views) of
one view's) stays. Demo scene, three 1 degree / 1% perturbations, 500 joint steps at pose_lr 5e-3:
aligned rotation error 0.96 / 0.99 / 0.83 degrees with the seven directions alone, 0.34 / 0.44 /
0.64 with the common rotation held too (1.01 / 1.02 / 1.01 given); test PSNR 24.98 / 24.47 / 24.54
and 24.93 / 23.88 / 24.14 dB (22.59 / 22.25 / 20.93 without refinement): the rotation error falls
further, the test PSNR up to 0.6 dB less. Where the cameras all face one way (a forward-facing
capture) a common rotation about the pivots is close to a rotation of the world about the scene,
already in the gauge, so holding it there costs little either.

`gauge_basis` returns the span of the ten columns orthonormalised, and the projection removes it
from the [V, 6] corrections.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GAUGE_DIMENSIONS = 7  # a similarity of 3D space: rotation 3, translation 3, scale 1
COMMON_ROTATION_DIMENSIONS = 3  # every camera turned the same way in its own frame
# a column whose singular value is below this fraction of the largest depends on the others
_RANK_TOLERANCE = 1e-9


def _cross_columns(vectors: Tensor) -> Tensor:
    """[V,3,3] matrices M_i with M_i w = w x vectors_i, i.e. -[vectors_i]x."""
    x, y, z = vectors.unbind(-1)
    zero = torch.zeros_like(x)
    skew = torch.stack([zero, -z, y, z, zero, -x, -y, x, zero], dim=-1).reshape(-1, 3, 3)
    return -skew


def gauge_basis(viewmats: Sequence[Tensor], pivots: Tensor, extent: float, common_rotation: bool = True) -> Tensor:
    """An orthonormal basis [V*6, k] (float64, k <= 10) of the corrections that move every camera
    by one infinitesimal similarity of the world or (with common_rotation) turn every camera the
    same way in its own frame (module docstring), in the layout of delta.reshape(-1)."""
    mats = torch.stack([torch.as_tensor(m).detach().double().cpu() for m in viewmats])
    rot, trans = mats[:, :3, :3], mats[:, :3, 3]
    n_views = len(mats)
    pivot = torch.zeros(n_views, 3, dtype=torch.float64)
    pivot[:, 2] = pivots.detach().double().cpu()
    held = GAUGE_DIMENSIONS + (COMMON_ROTATION_DIMENSIONS if common_rotation else 0)
    columns = torch.zeros(n_views, 6, held, dtype=torch.float64)
    # rotation theta: omega = -R theta; tau = (R theta) x (t - p) / extent
    columns[:, :3, 0:3] = -rot
    columns[:, 3:, 0:3] = _cross_columns(trans - pivot) @ rot / extent
    # translation b, in units of the extent so that its columns weigh like the others
    columns[:, 3:, 3:6] = -rot
    # scale about the world origin
    columns[:, 3:, 6] = trans / extent
    # the common rotation: omega = w in every camera's frame, tau = 0
    if common_rotation:
        columns[:, :3, GAUGE_DIMENSIONS:] = torch.eye(3, dtype=torch.float64)[:, :COMMON_ROTATION_DIMENSIONS]
    # SVD rather than QR: columns that depend on others (the common rotation of parallel cameras is
    # a world rotation; a single view has six directions only) must not add arbitrary directions
    left, singular, _ = torch.linalg.svd(columns.reshape(n_views * 6, -1), full_matrices=False)
    return left[:, singular > _RANK_TOLERANCE * singular[0]]


def without_gauge(delta: Tensor, basis: Tensor) -> Tensor:
    """delta [V,6] less its component in the span of `basis` (gauge_basis, on delta's device)."""
    flat = delta.reshape(-1, 1).to(basis.dtype)
    return (flat - basis @ (basis.T @ flat)).reshape(delta.shape).to(delta.dtype)
