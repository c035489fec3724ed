"""Camera gradients for our kernels that return none (train.pose_refine needs them), from the
per-Gaussian gradients they do return, on the torch side: no kernel change.

SH colours (render/sh_colors.py): a colour reads the camera only through dirs = mean - centre, so
d loss / d centre is minus the sum over the Gaussians of the gradient the kernel returns for the
means (which is d loss / d mean through the directions). The centre is computed from viewmat by
torch (render/projection.camera_centre), so autograd carries it on to viewmat, exactly.

The canvas projection (render/sized_projection.py): its outputs read viewmat = [R t] only through
each Gaussian's camera-frame mean R mean + t and covariance R Sigma R^T. Moving the camera by a
small rigid motion (I + xi^) viewmat, xi = (theta, rho) in its own frame, is therefore moving
every Gaussian by the world motion viewmat^-1 xi^ viewmat: rotation theta_w = R^T theta and
translation rho_w = R^T (theta x t + rho), which turns each mean by theta_w x mean + rho_w and
each rotation quaternion q by (0, theta_w / 2) * q (any length of q: the kernel normalises it).
The kernel's gradients for the means and the quaternions then give the loss's change along
every rigid motion of the camera:

    g_theta_w = sum mean x v_mean + 1/2 sum (w v_qvec - v_qw qvec + qvec x v_qvec),  g_rho_w = sum v_mean
    g_theta = R g_theta_w + t x (R g_rho_w),  g_rho = R g_rho_w

and rigid_viewmat_grad returns the [4,4] matrix G with <G, xi^ viewmat> = theta . g_theta +
rho . g_rho for every xi. That is viewmat's gradient along every rigid motion, which is all a pose
correction moves (train/pose_refine.py); along a non-rigid change of the matrix (a shear, a
scale) it is not the gradient, which no caller needs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def centre_grad(v_means_dirs: Tensor) -> Tensor:
    """d loss / d camera centre [3] of a function that reads the centre only through
    dirs = mean - centre, from d loss / d means [N,3] through those directions."""
    return -v_means_dirs.sum(0)


def _quat_rotation_grad(quats: Tensor, v_quats: Tensor) -> Tensor:
    """sum over Gaussians of d loss / d theta for q -> (0, theta / 2) * q (Hamilton product, w first)."""
    w, vec = quats[:, :1], quats[:, 1:]
    v_w, v_vec = v_quats[:, :1], v_quats[:, 1:]
    return 0.5 * (w * v_vec - v_w * vec + torch.linalg.cross(vec, v_vec)).sum(0)


def rigid_viewmat_grad(viewmat: Tensor, means: Tensor, quats: Tensor, v_means: Tensor, v_quats: Tensor) -> Tensor:
    """viewmat's gradient [4,4] along every rigid motion of the camera (module docstring) of a
    function that reads viewmat only through R mean + t and R Sigma(quat) R^T, from its gradients
    v_means [N,3] and v_quats [N,4] for means [N,3] and quats [N,4]. viewmat must be rigid."""
    means, quats, v_means, v_quats = (x.reshape(-1, x.shape[-1]) for x in (means, quats, v_means, v_quats))
    rot, trans = viewmat[:3, :3], viewmat[:3, 3]
    rho_world = v_means.sum(0)
    theta_world = torch.linalg.cross(means, v_means).sum(0) + _quat_rotation_grad(quats, v_quats)
    g_rho = rot @ rho_world
    g_theta = rot @ theta_world + torch.linalg.cross(trans, g_rho)
    # G = H viewmat^-T with H = [[g_theta]x / 2, g_rho; 0, 0]: <H, xi^> = theta . g_theta + rho . g_rho
    x, y, z = g_theta.unbind()
    zero = torch.zeros_like(x)
    half_skew = 0.5 * torch.stack([zero, -z, y, z, zero, -x, -y, x, zero]).reshape(3, 3)
    centre_cam = rot.T @ trans  # viewmat^-T's bottom row is [-(R^T t)^T, 1]
    grad = torch.zeros_like(viewmat)
    grad[:3, :3] = half_skew @ rot - g_rho[:, None] * centre_cam[None, :]
    grad[:3, 3] = g_rho
    return grad
