"""EWA projection of 3D Gaussians through a pinhole camera, in PyTorch (gsplat's fully_fused_projection).

The reference renderer's first half (docs/CONVENTIONS.md); the CUDA path uses gsplat's kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

RADIUS_SIGMAS = 3.33


@dataclass
class Projection:
    means2d: Tensor  # [N,2] pixel coords
    conics: Tensor  # [N,3] (a,b,c) of the inverse 2D covariance
    depths: Tensor  # [N]
    radii: Tensor  # [N,2] int32, 0 = culled
    # [N] sqrt(det(cov2d) / det(cov2d + eps2d I)) with antialiased, else None; 0 where culled or degenerate
    compensations: Tensor | None = None


def _quat_to_rotmat(quats: Tensor) -> Tensor:
    """[N,4] (w,x,y,z), any length -> [N,3,3] rotation."""
    q = quats / quats.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    w, x, y, z = q.unbind(-1)
    rows = [
        1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
    ]  # fmt: skip
    return torch.stack(rows, dim=-1).reshape(q.shape[:-1] + (3, 3))


def project_gaussians(
    means: Tensor,
    quats: Tensor,
    scales: Tensor,
    viewmat: Tensor,
    K: Tensor,
    width: int,
    height: int,
    eps2d: float = 0.3,
    near_plane: float = 0.01,
    far_plane: float = 1e10,
    antialiased: bool = False,
) -> Projection:
    """EWA projection of 3D Gaussians through a pinhole camera (gsplat's fully_fused_projection).

    means [N,3], quats [N,4] (w,x,y,z, unnormalised), scales [N,3] LINEAR, viewmat [4,4]
    world-to-camera, K [3,3]. Culled Gaussians get radii 0; their other outputs stay finite so
    that they receive zero (not NaN) gradients. antialiased: also the opacity compensations
    (RasterOptions.antialiased), the caller multiplies the opacities by them.
    """
    viewmat = viewmat.to(means)
    K = K.to(means)
    rot = _quat_to_rotmat(quats)
    r_cam, t_cam = viewmat[:3, :3], viewmat[:3, 3]
    means_c = means @ r_cam.T + t_cam
    m = r_cam @ (rot * scales[:, None, :])  # camera-space R S
    cov_c = m @ m.transpose(-1, -2)

    depths = means_c[:, 2]
    in_depth = (depths > near_plane) & (depths < far_plane)
    # a stand-in depth for culled Gaussians: no division by ~0, hence no inf/NaN in backward
    z = torch.where(in_depth, depths, torch.ones_like(depths))
    fx, fy, cx, cy = K[0, 0], K[1, 1], K[0, 2], K[1, 2]
    u = means_c[:, 0] / z
    v = means_c[:, 1] / z

    # gsplat clamps the Jacobian's x/z, y/z to the view frustum widened by 0.3 tan(half fov)
    tan_x = 0.5 * width / fx
    tan_y = 0.5 * height / fy
    uc = torch.clamp(u, min=-(cx / fx + 0.3 * tan_x), max=(width - cx) / fx + 0.3 * tan_x)
    vc = torch.clamp(v, min=-(cy / fy + 0.3 * tan_y), max=(height - cy) / fy + 0.3 * tan_y)
    zero = torch.zeros_like(z)
    jac = torch.stack([fx / z, zero, -fx * uc / z, zero, fy / z, -fy * vc / z], -1).reshape(-1, 2, 3)
    cov2d = jac @ cov_c @ jac.transpose(-1, -2)

    c00 = cov2d[:, 0, 0] + eps2d
    c11 = cov2d[:, 1, 1] + eps2d
    c01 = 0.5 * (cov2d[:, 0, 1] + cov2d[:, 1, 0])
    det = c00 * c11 - c01 * c01
    det_ok = det > 0
    det_safe = torch.where(det_ok, det, torch.ones_like(det))
    conics = torch.stack([c11 / det_safe, -c01 / det_safe, c00 / det_safe], dim=-1)
    compensations = None
    if antialiased:
        # the blur's share of the footprint: det before eps2d over det after. A flat Gaussian seen
        # edge-on (det before <= 0) gets 0, and no gradient rather than sqrt's infinite one at 0
        ratio = (cov2d[:, 0, 0] * cov2d[:, 1, 1] - c01 * c01) / det_safe
        positive = det_ok & (ratio > 0)
        compensations = torch.where(positive, torch.where(positive, ratio, torch.ones_like(ratio)).sqrt(),
                                    torch.zeros_like(ratio))  # fmt: skip
    means2d = torch.stack([fx * u + cx, fy * v + cy], dim=-1)

    with torch.no_grad():
        rx = torch.ceil(RADIUS_SIGMAS * c00.clamp_min(0).sqrt())
        ry = torch.ceil(RADIUS_SIGMAS * c11.clamp_min(0).sqrt())
        mx, my = means2d[:, 0], means2d[:, 1]
        inside = (mx + rx > 0) & (mx - rx < width) & (my + ry > 0) & (my - ry < height)
        keep = in_depth & det_ok & inside
        radii = torch.where(keep[:, None], torch.stack([rx, ry], -1), 0).to(torch.int32)
    return Projection(means2d=means2d, conics=conics, depths=depths, radii=radii, compensations=compensations)


def camera_centre(viewmat: Tensor) -> Tensor:
    """World position of the camera of a world-to-camera matrix [4,4]."""
    return -viewmat[:3, :3].T @ viewmat[:3, 3]
