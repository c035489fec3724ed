"""Pure-PyTorch reference renderer: the CPU training path and the ground truth for our kernels.

Everything follows docs/CONVENTIONS.md exactly (projection as gsplat's fully_fused_projection,
per-tile compositing with the 1/255 skip, gsplat's 0.999 alpha cap and the exclusive 1e-4 stop rule).

Rasterization cost follows the overlaps, not pixels x Gaussians:
- (tile, Gaussian) pairs by CONVENTIONS' tile rule, sorted by (tile, depth), stably;
- each tile's list is split over its 8x8 pixel cells, dropping Gaussians whose alpha is provably
  < 1/255 on the whole cell (they would be skipped anyway: no pixel changes);
- cells of similar list lengths are evaluated together as dense [cells, 64 pixels, 32 Gaussians]
  blocks, front to back, carrying each pixel's T; a cell leaves once all its pixels stopped.
The backward is written by hand (_RasterizeFn). The same compositing written plainly and
differentiated by autograd is kept as `_rasterize(..., use_autograd=True)`; the tests check the
two against each other, against a per-pixel loop and against finite differences.

Split by job: projection.py (project_gaussians), raster_plan.py (the cell lists),
raster_composite.py (compositing forward and backward); this module ties them together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from gstrain.render.common import phase, strategy_info
from gstrain.render.projection import Projection, camera_centre, project_gaussians
from gstrain.render.raster_composite import _composite_autograd, _RasterizeFn
from gstrain.render.raster_plan import _plan_cells
from gstrain.render.sh import num_sh_bases, sh_to_color

__all__ = ["Projection", "camera_centre", "project_gaussians", "rasterize", "render_reference", "sh_to_color"]

# elements of one dense [cells, pixels, K] block; small enough to stay in cache on a CPU
CHUNK_ELEMS = 1 << 18
# side of the pixel cells the (tile, Gaussian) lists are refined to (a divisor of the tile size)
CELL = 8
# Gaussians composited per step; a cell leaves once all its pixels stopped
SEGMENT = 32


def _rasterize(
    means2d: Tensor,
    conics: Tensor,
    colors: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    background: Tensor | None = None,
    tile_size: int = 16,
    absgrad_owner: Tensor | None = None,
    use_autograd: bool = False,
    cell: int = CELL,
    chunk_elems: int = CHUNK_ELEMS,
    segment: int = SEGMENT,
) -> tuple[Tensor, Tensor]:
    n = means2d.shape[0]
    if colors.dim() != 2 or colors.shape[0] != n or colors.shape[1] < 1:
        raise ValueError(f"colors must be [N,C] with N={n}, got {list(colors.shape)}")
    for name, t, shape in [
        ("means2d", means2d, (n, 2)),
        ("conics", conics, (n, 3)),
        ("opacities", opacities, (n,)),
        ("radii", radii, (n, 2)),
        ("depths", depths, (n,)),
    ]:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    dtype = means2d.dtype
    conics, colors, opacities = conics.to(dtype), colors.to(dtype), opacities.to(dtype)
    if tile_size % cell:
        cell = tile_size

    plan = _plan_cells(means2d, conics, opacities, radii, depths, width, height, tile_size, cell, chunk_elems, segment)
    if use_autograd:
        if absgrad_owner is not None:
            raise ValueError("absgrad needs the default (hand-written) backward")
        rgb, t_final = _composite_autograd(means2d, conics, colors, opacities, plan)
    else:
        # keep intermediates only when a backward can follow (not under no_grad, e.g. evaluation)
        keep = torch.is_grad_enabled() and any(t.requires_grad for t in (means2d, conics, colors, opacities))
        rgb, t_final = _RasterizeFn.apply(means2d, conics, colors, opacities, plan, absgrad_owner, segment, keep)

    # cells [cy * cx, s * s] -> image rows/cols, cropped to the requested size
    s, nc, gx, gy = cell, colors.shape[1], plan.cells_x, plan.cells_y
    rgb = rgb.reshape(gy, gx, s, s, nc).permute(0, 2, 1, 3, 4).reshape(gy * s, gx * s, nc)[:height, :width]
    t_final = t_final.reshape(gy, gx, s, s).permute(0, 2, 1, 3).reshape(gy * s, gx * s, 1)[:height, :width]
    if background is not None:
        rgb = rgb + t_final * background.to(dtype)
    return rgb, 1 - t_final


def rasterize(
    means2d: Tensor,
    conics: Tensor,
    colors: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    background: Tensor | None = None,
    tile_size: int = 16,
    absgrad: bool = False,
) -> tuple[Tensor, Tensor]:
    """Alpha-composite projected Gaussians front to back (CONVENTIONS.md, per 16x16 tile).

    means2d [N,2], conics [N,3], colors [N,C], opacities [N] in (0,1), radii [N,2] (0 = culled),
    depths [N], background [C] or None (zeros). Returns image [H,W,C] and alpha [H,W,1].
    absgrad=True: after backward, means2d.absgrad [N,2] holds sum over pixels of the per-pixel
    |dL/dmeans2d| (gsplat's definition).
    """
    return _rasterize(
        means2d, conics, colors, opacities, radii, depths, width, height, background, tile_size,
        absgrad_owner=means2d if absgrad else None,
    )  # fmt: skip


def render_reference(
    params: Mapping[str, Tensor],
    viewmat: Tensor,
    K: Tensor,
    width: int,
    height: int,
    sh_degree: int,
    background: Tensor | None = None,
    absgrad: bool = False,
    timer: Any = None,
    antialiased: bool = False,
) -> tuple[Tensor, Tensor, dict]:
    """Render one view of the Gaussians in params (CONVENTIONS.md names and activations).

    Returns image [H,W,3], alpha [H,W,1] and the info dict gsplat's strategies read:
    means2d [1,N,2] (the tensor that feeds rasterization: retain_grad() on it works, and
    .absgrad is set after backward when absgrad=True), radii [1,N,2] int32, depths [1,N],
    conics [1,N,3], width, height, n_cameras=1, gaussian_ids=None (not packed).
    timer: an optional gstrain.train.timing.PhaseTimer; it gets the projection / raster_fwd /
    raster_bwd split, as on the CUDA path. antialiased: RasterOptions.antialiased.
    """
    means = params["means"]
    viewmat = viewmat.to(means)
    K = K.to(means)
    with phase(timer, "projection"):
        nb = num_sh_bases(sh_degree)
        sh = params["sh0"]
        if nb > 1:
            sh = torch.cat([sh, params["shN"][:, : nb - 1]], dim=1)
        proj = project_gaussians(means, params["quats"], torch.exp(params["scales"]), viewmat, K, width, height,
                                 antialiased=antialiased)  # fmt: skip
        colors = sh_to_color(sh, means - camera_centre(viewmat), sh_degree)
        opacities = torch.sigmoid(params["opacities"])
        if proj.compensations is not None:
            opacities = opacities * proj.compensations
        means2d = proj.means2d[None]
    with phase(timer, "raster_fwd"):
        span = timer.backward_span("raster_bwd") if timer is not None else None
        conics = span.input(proj.conics) if span is not None else proj.conics
        image, alpha = _rasterize(
            means2d[0], conics, colors, opacities, proj.radii, proj.depths, width, height, background,
            absgrad_owner=means2d if absgrad else None,
        )  # fmt: skip
        if span is not None:
            image = span.output(image)
    info = strategy_info(means2d, proj.radii[None], proj.depths[None], proj.conics[None], width, height)
    return image, alpha, info
