"""Real spherical harmonics up to degree 3, in gsplat's basis (signs, order and constants).

Coefficient k of a Gaussian multiplies basis function k below; sh[:, 0] is the DC term (sh0),
sh[:, 1:] are shN. Colour = max(SH(dirs) + 0.5, 0) as CONVENTIONS.md prescribes.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Normalisation constants of the real SH basis (degree 0..3). The polynomial forms below use
# z^2 instead of (2z^2 - x^2 - y^2) etc., which is only equal on the unit sphere: dirs are
# normalised first, as gsplat does.
_Y00 = 0.28209479177387814
_Y1 = 0.48860251190292
_Y2_YZ = 1.092548430592079
_Y2_ZZ_A = 0.9461746957575601
_Y2_ZZ_B = 0.3153915652525201
_Y2_XX_YY = 0.5462742152960395
_Y3_SIN3 = 0.5900435899266435
_Y3_XYZ = 1.445305721320277  # times 2xy
_Y3_Z2_A = 2.285228997322329
_Y3_Z2_B = 0.4570457994644658
_Y3_Z3_A = 1.865881662950577
_Y3_Z3_B = 1.119528997770346


def num_sh_bases(degree: int) -> int:
    """Number of SH coefficients used by `degree`: (degree + 1)^2."""
    return (degree + 1) ** 2


def sh_basis(dirs: Tensor, degree: int) -> Tensor:
    """Basis functions evaluated at unit directions dirs [..., 3] -> [..., (degree+1)^2]."""
    if not 0 <= degree <= 3:
        raise ValueError(f"SH degree must be in 0..3, got {degree}")
    out = [torch.full_like(dirs[..., 0], _Y00)]
    if degree >= 1:
        x, y, z = dirs.unbind(-1)
        out += [-_Y1 * y, _Y1 * z, -_Y1 * x]
    if degree >= 2:
        zz = z * z
        c1 = x * x - y * y  # cos(2 phi) r^2
        s1 = 2.0 * x * y  # sin(2 phi) r^2
        out += [
            _Y2_XX_YY * s1,
            -_Y2_YZ * z * y,
            _Y2_ZZ_A * zz - _Y2_ZZ_B,
            -_Y2_YZ * z * x,
            _Y2_XX_YY * c1,
        ]
    if degree >= 3:
        c2 = x * c1 - y * s1  # cos(3 phi) r^3
        s2 = x * s1 + y * c1  # sin(3 phi) r^3
        t = _Y3_Z2_B - _Y3_Z2_A * zz
        out += [
            -_Y3_SIN3 * s2,
            _Y3_XYZ * z * s1,
            t * y,
            z * (_Y3_Z3_A * zz - _Y3_Z3_B),
            t * x,
            _Y3_XYZ * z * c1,
            -_Y3_SIN3 * c2,
        ]
    return torch.stack(out, dim=-1)


def sh_to_color(sh: Tensor, dirs: Tensor, degree: int) -> Tensor:
    """Colour of each Gaussian seen along dirs.

    sh [N, K, 3] with K >= (degree+1)^2, dirs [N, 3] (any length) -> [N, 3] = max(SH + 0.5, 0).
    """
    k = num_sh_bases(degree)
    if sh.shape[-2] < k:
        raise ValueError(f"SH degree {degree} needs {k} coefficients, got {sh.shape[-2]}")
    if degree == 0:
        # dirs unused: avoids a normalisation (and its gradient) for nothing
        rgb = _Y00 * sh[..., 0, :]
    else:
        # clamp the length so a camera sitting on a Gaussian gives a finite colour, not NaN
        unit = dirs / dirs.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        basis = sh_basis(unit, degree)  # [N, k]
        rgb = torch.einsum("nk,nkc->nc", basis, sh[..., :k, :])
    return (rgb + 0.5).clamp_min(0.0)


def sh_degree_at(step: int, interval: int, max_degree: int, stored: int | None = None) -> int:
    """The SH degree training uses at `step`: one more every `interval` steps, up to max_degree
    (and up to `stored`, the degree the coefficients hold, when given). interval <= 0: max_degree.

    The one schedule: the trainer, `gstrain eval`, `gstrain render` and `profile` all read it.
    """
    reached = step // interval if interval > 0 else max_degree
    return max(0, min(reached, max_degree, max_degree if stored is None else stored))
