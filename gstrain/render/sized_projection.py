"""gsplat's projection with the image size read on the device (csrc/project.cu).

gsplat's fully_fused_projection takes the image's width and height as kernel arguments, and they
matter: its Jacobian is clamped to the frustum widened by 0.3 tan(half fov), and Gaussians off the
image are culled. A CUDA graph captured with one size therefore cannot replay a view of another.
This is the same function (pinhole, eps2d blur, 3.33 sigma radii, and with calc_compensations the
antialiased mode's opacity compensations) with the size in a [2] int32 device tensor, so one graph
serves views of every size (train/graph_step.py). tests/test_sized_projection_cuda.py compares it
with gsplat's, forward and backward. viewmat's gradient (train.pose_refine) is exact along rigid
motions of the camera, from the means' and quaternions' gradients (render/camera_grad.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gstrain import extensions
from gstrain.render.camera_grad import rigid_viewmat_grad

EPS2D = 0.3  # render/cuda.project_splats calls gsplat with these too
NEAR_PLANE = 0.01
FAR_PLANE = 1e10  # gsplat's default


class _SizedProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, means: Tensor, quats: Tensor, scales: Tensor, viewmat: Tensor, K: Tensor,
                size: Tensor, compensate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        # compensations [1, N] with `compensate`, else an empty placeholder
        radii, means2d, depths, conics, compensations = extensions.raster().project_fwd(
            means, quats, scales, viewmat, K, size, EPS2D, NEAR_PLANE, FAR_PLANE, compensate
        )
        ctx.save_for_backward(means, quats, scales, viewmat, K, size, radii, conics, compensations)
        ctx.compensate = compensate
        ctx.mark_non_differentiable(radii)
        return radii, means2d, depths, conics, compensations

    @staticmethod
    def backward(ctx: Any, _v_radii: Tensor, v_means2d: Tensor, v_depths: Tensor | None, v_conics: Tensor,
                 v_compensations: Tensor | None) -> tuple[Tensor | None, ...]:  # fmt: skip
        means, quats, scales, viewmat, K, size, radii, conics, compensations = ctx.saved_tensors
        v_depths = None if v_depths is None else v_depths.contiguous()
        if not ctx.compensate or v_compensations is None:
            compensations, v_compensations = None, None
        else:
            v_compensations = v_compensations.contiguous()
        v_means, v_quats, v_scales = extensions.raster().project_bwd(
            means, quats, scales, viewmat, K, size, EPS2D, radii, conics, v_means2d.contiguous(), v_depths,
            v_conics.contiguous(), compensations, v_compensations,
        )  # fmt: skip
        v_viewmat = rigid_viewmat_grad(viewmat, means, quats, v_means, v_quats) if ctx.needs_input_grad[3] else None
        return v_means, v_quats, v_scales, v_viewmat, None, None, None


def _inputs(means: Tensor, quats: Tensor, scales: Tensor, viewmat: Tensor, K: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.float().contiguous() for t in (means, quats, scales, viewmat, K))


def project_sized(means: Tensor, quats: Tensor, scales: Tensor, viewmat: Tensor, K: Tensor,
                  size: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """fully_fused_projection(means, None, quats, scales, viewmat[None], K[None], W, H, eps2d=0.3,
    near_plane=0.01, packed=False) for one camera, with (W, H) = size ([2] int32 on the device):
    radii [1,N,2] int32, means2d [1,N,2], depths [1,N], conics [1,N,3] (zeros where culled).
    scales are linear; gradients flow to means, quats and scales."""
    return _SizedProjection.apply(*_inputs(means, quats, scales, viewmat, K), size, False)[:4]


def project_sized_compensated(means: Tensor, quats: Tensor, scales: Tensor, viewmat: Tensor, K: Tensor,
                              size: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """project_sized and, as gsplat's calc_compensations=True gives them (the antialiased mode),
    compensations [1,N] = sqrt(max(0, det(cov2d) / det(cov2d + eps2d I))), 0 where culled; the
    gradients through them reach means, quats and scales."""
    return _SizedProjection.apply(*_inputs(means, quats, scales, viewmat, K), size, True)
