"""train.appearance=bilateral: per training image a bilateral grid of 3x4 colour transforms (the
idea of "Bilateral Guided Radiance Field Processing", Wang et al. 2024).

Why: a per-image affine (train/appearance.py) is one transform for the whole image. Phone photos
also vary within an image: vignetting (a gain falling off with the radius), local tone mapping
and tone curves (a gain that depends on how bright the pixel is). A bilateral grid holds a 3x4
transform per cell of a coarse (x, y, luminance) grid; each pixel gets the trilinear blend of
the cells around (its position, its rendered luminance), so the transform varies smoothly across
the image and with brightness, yet edges of the render stay sharp (the luminance axis separates
a dark pixel from its bright neighbour).

The table: [views, 12, L, Y, X], channel 4 * r + c holding entry (r, c) of the [A | b] matrix, every
cell initialised to [I | 0] (a run starts as without it). A pixel at column px of W sits at grid x
(px + 0.5) / W * (X - 1) (pixel centres; the grid's first and last cells at the image's edges), y
likewise, and luminance (0.299 R + 0.587 G + 0.114 B of the render, clamped to [0, 1]) at
luminance * (L - 1) (on a CUDA-graph canvas, positions within the view's valid part:
StepView.valid). F.grid_sample does the trilinear blend (align_corners=True, border padding) and
its backward gives the table's gradient; on a GPU, by default (dev.fused_bilateral), one kernel
each way computes the same function without grid_sample's atomics (train/fused_bilateral.py).

The regulariser: train.bilateral_tv times the total variation of the whole table, the sum over
the three grid axes of the mean squared difference of neighbouring cells. Its gradient is a
closed form (total_variation_grad), added to the table's gradient before each step (view_table's
regulariser_grad): the same as adding the term to the loss, with device operations only (a
captured step runs it) and once per step whatever the batch. The reported loss leaves it out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gstrain.train.fused_bilateral import DEFAULT_BACKWARD, fusable, fused_apply_grid, prepare
from gstrain.train.view_table import ViewTable

# Rec. 601 luma: the guide the grid is sliced by (the weights a camera's tone mapping sees)
LUMA_R, LUMA_G, LUMA_B = 0.299, 0.587, 0.114
GRID_AXES = (2, 3, 4)  # the table's luminance, y and x axes (0: view, 1: affine entry)


def identity_grids(n_views: int, grid: tuple[int, int, int], device: torch.device | str = "cpu") -> Tensor:
    """[n_views, 12, L, Y, X] for grid = (L, Y, X): every cell's transform [I | 0]."""
    table = torch.zeros((n_views, 12, *grid), device=device)
    table[:, (0, 5, 10)] = 1.0  # entries (0, 0), (1, 1), (2, 2) of the row-major 3x4
    return table


def luminance(image: Tensor) -> Tensor:
    """[..., 3] -> [...]: the slicing guide (python scalars: nothing copied from the host)."""
    return image[..., 0] * LUMA_R + image[..., 1] * LUMA_G + image[..., 2] * LUMA_B


def slice_grid(grid: Tensor, image: Tensor, valid: Tensor | None = None) -> Tensor:
    """grid [12, L, Y, X], image [H, W, 3] -> each pixel's blended transform [H, W, 3, 4]. valid
    ([2] int32 (width, height) on the device, StepView.valid): the image is a canvas whose top-left
    part is the view, so positions are the view's (the rest lies past the grid's edge, clamped)."""
    height, width = image.shape[:2]
    kw = {"device": image.device, "dtype": image.dtype}
    if valid is None:
        step_x, step_y = 2.0 / width, 2.0 / height
    else:  # read on the device: a captured step serves views of every size
        steps = 2.0 / valid.to(image.dtype)
        step_x, step_y = steps[0], steps[1]
    xs = (torch.arange(width, **kw) + 0.5) * step_x - 1.0
    ys = (torch.arange(height, **kw) + 0.5) * step_y - 1.0
    guide = luminance(image).clamp(0.0, 1.0) * 2.0 - 1.0
    # grid_sample's last axis is (x, y, z) -> the input's (W, H, D) = the table's (X, Y, L)
    coords = torch.stack([xs.expand(height, width), ys[:, None].expand(height, width), guide], dim=-1)
    blended = F.grid_sample(grid[None], coords[None, None], mode="bilinear", padding_mode="border",
                            align_corners=True)  # fmt: skip
    return blended[0, :, 0].permute(1, 2, 0).reshape(height, width, 3, 4)


def apply_grid(image: Tensor, grid: Tensor, valid: Tensor | None = None, fused: bool = False,
               backward: str = DEFAULT_BACKWARD) -> Tensor:  # fmt: skip
    """A(x, y, lum) @ rgb + b(x, y, lum) per pixel: image [H, W, 3], grid [12, L, Y, X] (valid: as
    slice_grid). fused: the fused kernels where they take the inputs (float32 CUDA), else grid_sample;
    backward: the kernels' backward variant (fused_bilateral.BACKWARD_VARIANTS)."""
    if fused and fusable(image, grid):
        return fused_apply_grid(image, grid, valid, (LUMA_R, LUMA_G, LUMA_B), backward)
    transform = slice_grid(grid, image, valid)
    return (transform[..., :3] * image[..., None, :]).sum(-1) + transform[..., 3]


def total_variation(table: Tensor) -> Tensor:
    """Sum over the grid axes of the mean squared difference of neighbouring cells (an axis of
    one cell adds nothing)."""
    terms = [table.diff(dim=d).square().mean() for d in GRID_AXES if table.shape[d] > 1]
    return torch.stack(terms).sum() if terms else table.new_zeros(())


def total_variation_grad(table: Tensor, weight: float) -> Tensor:
    """d(weight * total_variation(table)) / d(table), in closed form: each difference pushes its
    two cells toward each other by 2 * weight * difference / count."""
    grad = torch.zeros_like(table)
    for d in GRID_AXES:
        n = table.shape[d]
        if n < 2:
            continue
        diff = table.diff(dim=d)
        scale = 2.0 * weight / diff.numel()
        grad.narrow(d, 1, n - 1).add_(diff, alpha=scale)
        grad.narrow(d, 0, n - 1).sub_(diff, alpha=scale)
    return grad


class BilateralAppearance(ViewTable):
    """The per-image bilateral grids of the training views (a corrections.ViewCorrection,
    graph-safe; train/view_table.py), grid = (L, Y, X) cells, TV weight `tv`; fused: slice with
    the fused kernels on a GPU (dev.fused_bilateral), their backward variant `backward`
    (fused_bilateral.BACKWARD_VARIANTS; bench/bilateral_cost.py times them)."""

    def __init__(self, n_views: int, grid: tuple[int, int, int], device: torch.device, lr: float,
                 decay: float = 0.0, start: int = 0, tv: float = 0.0, fused: bool = False,
                 backward: str = DEFAULT_BACKWARD) -> None:  # fmt: skip
        # the pull toward identity: one identity grid, broadcast over the views
        super().__init__(identity_grids(n_views, grid, device), identity_grids(1, grid, device), lr, decay, start)
        self.tv = float(tv)
        self.fused = prepare(device, fused)
        self.backward = backward

    def apply(self, image: Tensor, row: Tensor, valid: Tensor | None = None) -> Tensor:
        return apply_grid(image, row, valid, self.fused, self.backward)

    def regulariser_grad(self) -> Tensor | None:
        if not self.tv:
            return None
        return total_variation_grad(self.table.detach(), self.tv)
