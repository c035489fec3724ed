"""Our tensors in viser's terms: splats as centre / covariance / colour / opacity, cameras as poses.

Both sides use COLMAP/OpenCV camera axes (x right, y down, z forward), so a pose is just the
inverse of our world-to-camera matrix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from gstrain.formats import finite_rows

SH_C0 = 0.28209479177387814
THUMBNAIL_SIDE = 96  # longest side of the images shown on the frustums


def splat_arrays(params: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
    """Arrays for viser's add_gaussian_splats: centers [N,3], covariances [N,3,3], rgbs [N,3], opacities [N,1].

    Colour is the SH DC term only: viser's splat renderer has no view-dependent colour.
    """
    with torch.no_grad():
        p = {k: params[k].detach().to("cpu", torch.float32) for k in ("means", "scales", "quats", "opacities", "sh0")}
        finite = finite_rows(p.values())
        p = {k: v[finite] for k, v in p.items()}
        q = torch.nn.functional.normalize(p["quats"], dim=1)
        w, x, y, z = q.unbind(1)
        R = torch.stack([
            1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
            2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
            2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
        ], 1).reshape(-1, 3, 3)
        M = R * torch.exp(p["scales"])[:, None, :]  # R diag(s)
        cov = M @ M.transpose(1, 2)
        rgb = (p["sh0"].reshape(-1, 3) * SH_C0 + 0.5).clamp(0, 1)
        alpha = torch.sigmoid(p["opacities"]).reshape(-1, 1)
    return {"centers": p["means"].numpy(), "covariances": cov.numpy(), "rgbs": rgb.numpy(), "opacities": alpha.numpy()}


def pose_of(viewmat: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(camera-to-world rotation [3,3], camera centre [3]) of a world-to-camera matrix."""
    vm = viewmat.detach().double().cpu().numpy()
    R_wc = vm[:3, :3].T
    return R_wc, -R_wc @ vm[:3, 3]


def wxyz_of(R: np.ndarray) -> np.ndarray:
    """Unit quaternion (w, x, y, z) of a rotation matrix."""
    import viser.transforms as vtf

    return vtf.SO3.from_matrix(R).wxyz


def viewmat_of(wxyz: np.ndarray, position: np.ndarray) -> Tensor:
    """World-to-camera [4,4] float32 from a camera's orientation (camera-to-world) and centre."""
    import viser.transforms as vtf

    R_wc = vtf.SO3(np.asarray(wxyz, dtype=np.float64)).as_matrix()
    vm = np.eye(4)
    vm[:3, :3] = R_wc.T
    vm[:3, 3] = -R_wc.T @ np.asarray(position, dtype=np.float64)
    return torch.tensor(vm, dtype=torch.float32)


def intrinsics(fov_y: float, width: int, height: int) -> Tensor:
    """Pinhole K for a vertical field of view (radians) at width x height, centred principal point."""
    f = 0.5 * height / math.tan(0.5 * fov_y)
    return torch.tensor([[f, 0, width / 2], [0, f, height / 2], [0, 0, 1]], dtype=torch.float32)


def fit_size(width: int, height: int, longest: int) -> tuple[int, int]:
    """width x height scaled so the longest side is at most `longest` (never up)."""
    s = min(1.0, longest / max(width, height))
    return max(1, round(width * s)), max(1, round(height * s))


def thumbnail(image: Tensor, longest: int = THUMBNAIL_SIDE) -> np.ndarray:
    """A small uint8 copy of an [H,W,3] uint8 image, for a frustum."""
    h, w = image.shape[:2]
    tw, th = fit_size(w, h, longest)
    small = torch.nn.functional.interpolate(
        image.permute(2, 0, 1)[None].float(), size=(th, tw), mode="area"
    )
    return small[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()
