"""Mip-Splatting's 3D smoothing filter (render.filter_3d), as a transform of the parameters.

A Gaussian can be no finer than the finest sampling of the training views that saw it: its
highest sampling rate nu = max over training cameras of focal / depth (cameras it is in front of
and, with a 15% margin, inside the frustum of). The filter convolves it with an isotropic 3D
Gaussian of variance (sqrt(v) / nu)^2, v = render.filter_3d in pixels^2: the covariance gains
that variance on its diagonal (scale^2 + f^2 per axis: an isotropic term commutes with the
rotation), and the opacity is scaled by sqrt(det(Sigma) / det(Sigma + f^2 I)) so that the
Gaussian's integral stays the same.

The rate is per Gaussian and depends on its mean, so it is recomputed when the population
changes (Renderer.gaussians_changed) and held fixed in between, as the paper does. The filter
enters every backend the same way: apply_filter_3d returns the parameters with scales and opacity
logits that, through the renderers' own exp and sigmoid, give the filtered ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

NEAR_DEPTH = 0.2  # Mip-Splatting's: points closer to a camera than this do not count for its rate
FRUSTUM_MARGIN = 0.15  # share of the image size a projected centre may lie outside and still count
# keeps the filtered opacity's logit finite (sigmoid(o) * c below 1 - 1e-7 in float32)
MAX_LOG_OPACITY = -1e-7


def max_sampling_rate(means: Tensor, viewmats: Tensor, Ks: Tensor, sizes: Sequence[tuple[int, int]]) -> Tensor:
    """[N] highest focal / depth (pixels per world unit) over the cameras that see each mean.

    means [N,3], viewmats [V,4,4] world-to-camera, Ks [V,3,3], sizes (width, height) per view.
    A mean no camera sees gets the rate of the camera that would sample it finest were it turned
    towards it: the highest focal / distance to the camera's centre. (The paper gives it the lowest
    rate of those seen, a minimum over the whole population: each Gaussian's own rate keeps the
    filter the same on a shard of the model as on all of it, so ranks need not agree on a minimum.)
    One pass over the cameras; no per-Gaussian Python work.
    """
    means = means.detach()
    rate = means.new_zeros(means.shape[0])
    turned = means.new_zeros(means.shape[0])  # the rate were the camera turned towards the mean
    for viewmat, K, (width, height) in zip(viewmats.to(means), Ks.to(means), sizes, strict=True):
        p = means @ viewmat[:3, :3].T + viewmat[:3, 3]
        z = p[:, 2]
        z_safe = torch.where(z > NEAR_DEPTH, z, torch.ones_like(z))
        u = K[0, 0] * p[:, 0] / z_safe + K[0, 2]
        v = K[1, 1] * p[:, 1] / z_safe + K[1, 2]
        mx, my = FRUSTUM_MARGIN * width, FRUSTUM_MARGIN * height
        seen = (z > NEAR_DEPTH) & (u >= -mx) & (u <= width + mx) & (v >= -my) & (v <= height + my)
        focal = torch.maximum(K[0, 0], K[1, 1])
        rate = torch.where(seen, torch.maximum(rate, focal / z_safe), rate)
        turned = torch.maximum(turned, focal / p.norm(dim=-1).clamp_min(NEAR_DEPTH))
    return torch.where(rate > 0, rate, turned)


def filter_std(rate: Tensor, variance: float) -> Tensor:
    """[N] the 3D filter's standard deviation in world units: sqrt(variance) / rate (0 where rate is 0)."""
    safe = torch.where(rate > 0, rate, torch.ones_like(rate))
    return torch.where(rate > 0, variance**0.5 / safe, torch.zeros_like(rate))


def apply_filter_3d(params: Mapping[str, Tensor], std: Tensor) -> dict[str, Tensor]:
    """params with "scales" (log) and "opacities" (logits) of the filtered Gaussians; the rest as is.

    scale' = sqrt(scale^2 + std^2) per axis; opacity' = opacity * prod(scale / scale'). Both are
    differentiable in the raw parameters; std [N] is a constant.
    """
    log_s = params["scales"]
    log_f = torch.log(std.to(log_s))[:, None]  # -inf where std is 0: logaddexp then returns log_s
    log_s_new = 0.5 * torch.logaddexp(2 * log_s, 2 * log_f)
    log_comp = (log_s - log_s_new).sum(-1)  # log sqrt(det(Sigma) / det(Sigma + f^2 I)) <= 0
    log_p = (F.logsigmoid(params["opacities"]) + log_comp).clamp_max(MAX_LOG_OPACITY)
    logits = log_p - torch.log(-torch.expm1(log_p))
    return {**params, "scales": log_s_new, "opacities": logits}


def stack_cameras(cameras: Sequence[tuple[Tensor, Tensor, int, int]]) -> tuple[Tensor, Tensor, list[tuple[int, int]]]:
    """viewmats [V,4,4], Ks [V,3,3] and (width, height) of (viewmat, K, width, height) cameras."""
    viewmats = torch.stack([c[0].float() for c in cameras]) if cameras else torch.zeros(0, 4, 4)
    Ks = torch.stack([c[1].float() for c in cameras]) if cameras else torch.zeros(0, 3, 3)
    return viewmats, Ks, [(int(c[2]), int(c[3])) for c in cameras]
