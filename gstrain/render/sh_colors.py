"""Colours from spherical harmonics in one CUDA kernel each way (csrc/sh_colors.cu).

The same function as render/cuda.splat_colors through gsplat (max(SH(dirs) + 0.5, 0) for the
visible Gaussians, dirs = mean - camera centre), without its pieces: the directions' tensor, the
[N, 16, 3] concatenation of sh0 and shN, the mask, the add and the clamp, and in the backward the
gradient's split and copies. sh0's and shN's gradients are written where they lie.
tests/test_sh_colors_cuda.py compares it with gsplat's, forward and backward, at every degree.
The kernel returns no camera gradient; where viewmat needs one (train.pose_refine) the camera
centre enters as an input computed from viewmat by torch, its gradient minus the sum of the
means' (render/camera_grad.py), so autograd carries it on to viewmat.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gstrain import extensions
from gstrain.render.camera_grad import centre_grad
from gstrain.render.projection import camera_centre

# csrc/sh_colors.h kShBwdMaxRest: the backward stages at least a warp's shN rows in 48 KiB of
# shared memory (degree 3 needs 15)
MAX_REST = 128


class _ShColors(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, means: Tensor, sh0: Tensor, shN: Tensor, viewmat: Tensor, radii: Tensor,
                degree: int, centre: Tensor | None, shn_step: Any) -> Tensor:  # fmt: skip
        # centre: viewmat's camera centre, differentiable (None: no camera gradient); the kernel
        # reads the centre from viewmat itself
        (colors,) = extensions.raster().sh_colors_fwd(means, sh0, shN, viewmat, radii, degree)
        ctx.save_for_backward(means, sh0, shN, viewmat, radii)
        ctx.degree = degree
        ctx.shn_step = shn_step
        return colors

    @staticmethod
    def backward(ctx: Any, v_colors: Tensor) -> tuple[Tensor | None, ...]:
        means, sh0, shN, viewmat, radii = ctx.saved_tensors
        v_colors = v_colors.contiguous()
        needs = ctx.needs_input_grad
        if ctx.shn_step is not None:
            v_means, v_sh0 = _backward_stepping_shn(ctx, means, sh0, shN, viewmat, radii, v_colors)
            v_shN = None
        else:
            v_means, v_sh0, v_shN = extensions.raster().sh_colors_bwd(means, sh0, shN, viewmat, radii, ctx.degree,
                                                                      v_colors)  # fmt: skip
        v_centre = centre_grad(v_means) if needs[6] else None
        return (v_means if needs[0] else None, v_sh0 if needs[1] else None, v_shN if needs[2] else None,
                None, None, None, v_centre, None)  # fmt: skip


def _backward_stepping_shn(ctx: Any, means: Tensor, sh0: Tensor, shN: Tensor, viewmat: Tensor, radii: Tensor,
                           v_colors: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The backward in slices of Gaussians (each Gaussian's gradients are its own), each slice's
    shN gradient stepped by dev.adam_in_backward (train/backward_adam.py) before the next slice
    is computed: shN's rows are read before they are stepped, and its whole gradient never exists."""
    n = means.shape[0]
    step = min(n, ctx.shn_step.slice_rows(n)) if n else 0
    if step == n:
        v_means, v_sh0, v_shN = extensions.raster().sh_colors_bwd(means, sh0, shN, viewmat, radii, ctx.degree,
                                                                  v_colors)  # fmt: skip
        ctx.shn_step.rows(0, v_shN, radii)
        return v_means, v_sh0
    v_means, v_sh0 = torch.empty_like(means), torch.empty_like(sh0)
    for start in range(0, n, step):
        end = min(n, start + step)
        part = slice(start, end)
        m, s0, sN = extensions.raster().sh_colors_bwd(means[part], sh0[part], shN[part], viewmat, radii[:, part],
                                                      ctx.degree, v_colors[:, part])  # fmt: skip
        v_means[part], v_sh0[part] = m, s0
        del m, s0
        ctx.shn_step.rows(start, sN, radii[:, part])
        del sN
    return v_means, v_sh0


def sh_colors(means: Tensor, sh0: Tensor, shN: Tensor, viewmat: Tensor, radii: Tensor, degree: int) -> Tensor:
    """Colours [1, N, 3] of N Gaussians seen through the world-to-camera viewmat [4, 4]: for those
    with both radii [1, N, 2] > 0, max(SH_degree(normalize(mean - camera centre)) + 0.5, 0) with
    sh0 [N, 1, 3] and shN [N, K, 3] as gsplat's coefficients 0 and 1..K; 0.5 for the others (whose
    colour no pixel reads). Gradients flow to means, sh0 and shN (K at most MAX_REST), and to
    viewmat where it requires them (through its camera centre); a shN that train/backward_adam.py
    marked is stepped in the backward instead, slice by slice."""
    if shN.shape[1] > MAX_REST:
        raise ValueError(f"the fused SH colours take at most {MAX_REST} shN coefficients per Gaussian, "
                         f"got {shN.shape[1]}")  # fmt: skip
    shn_step = getattr(shN, "shn_in_backward", None)
    viewmat = viewmat.float()
    centre = camera_centre(viewmat) if viewmat.requires_grad else None
    return _ShColors.apply(means.float().contiguous(), sh0.float().contiguous(), shN.float().contiguous(),
                           viewmat.detach().contiguous(), radii.int().contiguous(), int(degree), centre,
                           shn_step)  # fmt: skip
