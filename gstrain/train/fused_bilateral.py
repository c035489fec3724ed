"""The bilateral grid's slice-and-apply on the GPU in one kernel each way (dev.fused_bilateral).

The function is train/bilateral_grid.apply_grid's: each pixel's colour through the trilinear blend
(align_corners=True, border clamping) of a [12, L, Y, X] grid of 3x4 transforms at (its x, its y,
its clamped luminance), with the same pixel centres and the same optional canvas `valid`
(read on the device, so a captured CUDA-graph step serves views of every size).

Why a kernel: F.grid_sample's backward adds each pixel's 8 corners x 12 entries into the grid with
global atomics, and the grid is tiny (16 x 16 x 8 cells), so on a 703 x 1250 view about 84 million
atomics queue on a few thousand addresses (6.4 ms a step on the H200). A block of 32 x 8 pixels
touches only a few (x, y) cells of the grid, so the backward sums its pixels into a shared-memory
copy of those cells (every luminance level), a warp whose 32 pixels share one cell first with
shuffles, then adds each touched entry to the grid once: a few hundred global atomics a block
instead of 24576 (BACKWARD_VARIANTS: how the block sums its pixels first). A block whose cells do
not fit (a tiny image against a large grid) adds to global memory directly: slower, the same sums.
The backward recomputes the blend instead of keeping [H, W, 12] from the forward, and gives the
image's gradient through the transform and through the luminance coordinate (zero where that
coordinate is clamped at or past the grid's border, as grid_sample's is). Nothing is read back to
the host (csrc/bilateral.cu).

The CPU and anything the kernel does not take (another dtype, an empty image) keep grid_sample:
bilateral_grid.apply_grid asks `fusable` first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gstrain import extensions
from gstrain.choices import BILATERAL_BACKWARDS as BACKWARD_VARIANTS

# the backward variant (choices.BILATERAL_BACKWARDS, in the order of csrc/bilateral.h's
# BilateralBwdVariant: the index is what the kernel takes) when none is named
DEFAULT_BACKWARD = "row_runs"


class _FusedBilateral(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, image: Tensor, grid: Tensor, valid: Tensor | None,
                luma: tuple[float, float, float], variant: int) -> Tensor:  # fmt: skip
        ctx.save_for_backward(image, grid)
        ctx.valid, ctx.luma, ctx.variant = valid, luma, variant
        return extensions.bilateral().bilateral_fwd(image, grid, valid, *luma)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        image, grid = ctx.saved_tensors
        grad_image, grad_grid = extensions.bilateral().bilateral_bwd(image, grid, ctx.valid, grad.contiguous(),
                                                                     *ctx.luma, ctx.variant)  # fmt: skip
        return (grad_image if ctx.needs_input_grad[0] else None,
                grad_grid if ctx.needs_input_grad[1] else None, None, None, None)  # fmt: skip


def fusable(image: Tensor, grid: Tensor) -> bool:
    """Whether the kernel takes these: float32 CUDA tensors on one device, image [H, W, 3] of at
    least one pixel, grid [12, L, Y, X]."""
    return (
        image.is_cuda and grid.is_cuda and image.device == grid.device
        and image.dtype == torch.float32 and grid.dtype == torch.float32
        and image.dim() == 3 and image.shape[-1] == 3 and image.numel() > 0
        and grid.dim() == 4 and grid.shape[0] == 12
    )  # fmt: skip


def fused_apply_grid(image: Tensor, grid: Tensor, valid: Tensor | None, luma: tuple[float, float, float],
                     backward: str = DEFAULT_BACKWARD) -> Tensor:  # fmt: skip
    """A(x, y, g) @ rgb + b(x, y, g) per pixel by the kernels (inputs `fusable`); luma: the guide's
    (R, G, B) weights, which bilateral_grid owns; backward: one of BACKWARD_VARIANTS."""
    if backward not in BACKWARD_VARIANTS:
        raise ValueError(f"bilateral backward variant {backward!r}; known: {', '.join(BACKWARD_VARIANTS)}")
    if valid is not None:
        valid = valid.to(device=image.device, dtype=torch.int32).contiguous()
    return _FusedBilateral.apply(image.contiguous(), grid.contiguous(), valid, tuple(float(w) for w in luma),
                                 BACKWARD_VARIANTS.index(backward))  # fmt: skip


def prepare(device: torch.device, fused: bool) -> bool:
    """Whether a trainer on `device` slices with the kernels; when it does, the extension is built
    here, at start-up, so a compile or a missing toolchain shows before the first step."""
    if not (fused and torch.device(device).type == "cuda"):
        return False
    extensions.bilateral()
    return True
