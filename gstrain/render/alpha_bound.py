"""Where a Gaussian's alpha is provably below the compositing cut-off (1/255), in one place.

The compositing rule (docs/CONVENTIONS.md) skips a Gaussian at a pixel when
opacity * exp(-sigma) < 1/255, sigma = d^T Q d / 2 with Q the conic. Both the reference
raster plan (per 8x8 cell) and the ellipse cull of (Gaussian, tile) pairs (cull.py) drop work
only where that skip is certain, so neither changes an image. Bounds are padded so that float32
rounding in the kernels can never turn a dropped Gaussian into one that would have contributed.
"""

from __future__ import annotations

import torch
from torch import Tensor

ALPHA_MIN = 1.0 / 255.0


def log_cut(opacities: Tensor) -> Tensor:
    """log(255 o): the sigma at which opacity * exp(-sigma) falls to 1/255 (-inf for o = 0)."""
    return torch.log(opacities * 255.0)


@torch.no_grad()
def alpha_extent(conics: Tensor, opacities: Tensor) -> Tensor:
    """Half-extents [N,2] of a box holding every offset where opacity * exp(-sigma) >= 1/255.

    sigma = d^T Q d / 2 <= log(255 o) is an ellipse with half-extents sqrt(2 log(255 o) Q^-1_ii).
    Padded (relative and absolute) so float rounding can never cut off a pixel; inf when the
    conic is not positive definite (sigma unbounded below: no box).
    """
    a, b, c = conics.unbind(-1)
    det = a * c - b * b
    pd = (a > 0) & (c > 0) & (det > 0)
    det = torch.where(pd, det, torch.ones_like(det))
    s_max = log_cut(opacities.clamp_min(1e-30 / 255.0)).clamp_min(0.0)
    ext = torch.stack([(2 * s_max * c / det).sqrt(), (2 * s_max * a / det).sqrt()], -1) * 1.001 + 1e-3
    ok = pd[:, None] & torch.isfinite(ext)
    return torch.where(ok, ext, torch.full_like(ext, float("inf")))


@torch.no_grad()
def sigma_threshold(conics: Tensor, opacities: Tensor) -> Tensor:
    """Per Gaussian, a sigma above which its alpha is < 1/255 even as the float32 kernels compute it.

    The kernels' sigma has a relative rounding error of a few ulps times kappa =
    (sqrt(ac) + |b|) / (sqrt(ac) - |b|) (cancellation in the cross term; kappa <= the conic's
    condition number), __expf a few ulps more: the level log(255 o) is padded by 2e-3 (absolute
    and relative, 0.2% in alpha) and divided by 1 - 4e-6 kappa. +inf (never provably below) when
    the conic is not positive definite, is not finite, or is too ill-conditioned to bound;
    -inf when the opacity is 0; NaN inputs give NaN, which compares as "not above".
    """
    a, b, c = conics.unbind(-1)
    root = torch.sqrt((a * c).clamp_min(0.0))
    pd = (a > 0) & (c > 0) & (root > b.abs()) & torch.isfinite(conics).all(-1)
    kappa = (root + b.abs()) / torch.where(pd, root - b.abs(), torch.ones_like(root))
    shrink = 1.0 - 4e-6 * kappa
    level = log_cut(opacities)
    padded = level + 2e-3 * (1.0 + level.abs())
    thr = padded / shrink.clamp_min(1e-3)
    thr = torch.where(level == float("-inf"), level, thr)  # 0 * inf would be NaN
    keep_always = ~pd | (shrink < 0.5)
    return torch.where(keep_always, torch.full_like(thr, float("inf")), thr)


def min_sigma_on_rect(lo: Tensor, hi: Tensor, conics: Tensor) -> Tensor:
    """min of sigma(u) = (a ux^2 + c uy^2) / 2 + b ux uy over the rectangle lo <= u <= hi.

    lo, hi [..., 2] are the rectangle's corners relative to the Gaussian's mean, conics [..., 3]
    positive definite (otherwise the result is meaningless, see sigma_threshold). sigma is
    convex: 0 when the mean lies inside, else the least of its minima along the four edges.
    """
    a, b, c = conics.unbind(-1)
    a, b, c = a[..., None], b[..., None], c[..., None]
    xs = torch.stack([lo[..., 0], hi[..., 0]], -1)  # the two vertical edges
    ys = torch.stack([lo[..., 1], hi[..., 1]], -1)  # the two horizontal edges
    # on an edge the other coordinate minimises a 1-D parabola: its vertex, clamped to the edge
    y_at = torch.minimum(torch.maximum(-b * xs / c, lo[..., 1:2]), hi[..., 1:2])
    x_at = torch.minimum(torch.maximum(-b * ys / a, lo[..., 0:1]), hi[..., 0:1])
    ux = torch.cat([xs, x_at], -1)
    uy = torch.cat([y_at, ys], -1)
    sig = (0.5 * (a * ux * ux + c * uy * uy) + b * ux * uy).amin(-1)
    inside = ((lo <= 0) & (hi >= 0)).all(-1)
    return torch.where(inside, torch.zeros_like(sig), sig)
