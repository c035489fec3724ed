"""The reference rasterizer's plan: which Gaussians each 8x8 pixel cell composites, front to back.

(tile, Gaussian) pairs by CONVENTIONS' tile rule, sorted by (tile, depth), stably; each tile's
list is split over its pixel cells, dropping Gaussians whose alpha is provably < 1/255 on the
whole cell; cells of similar list lengths are grouped into dense chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gstrain.render.alpha_bound import alpha_extent


@dataclass
class _Plan:
    """Which Gaussians each pixel cell composites, front to back, grouped into dense chunks.

    A cell is a cell x cell block of pixels inside one 16x16 tile. Its list is the tile's list
    (CONVENTIONS' tile rule, depth order) minus Gaussians whose alpha is provably < 1/255 on
    every pixel of the cell: those are skipped by the compositing rule anyway, so dropping them
    changes nothing but the cost.
    """

    n: int  # number of Gaussians; index n is the zero padding entry
    cell: int  # cell side in pixels
    cells_x: int
    cells_y: int
    # (cell ids [Tc], Gaussian ids [Tc,K] front to back padded with n, list lengths [Tc])
    chunks: list[tuple[Tensor, Tensor, Tensor]]


@torch.no_grad()
def _plan_cells(
    means2d: Tensor,
    conics: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    tile_size: int,
    cell: int,
    chunk_elems: int,
    segment: int,
) -> _Plan:
    n = means2d.shape[0]
    dev = means2d.device
    tiles_x = (width + tile_size - 1) // tile_size
    tiles_y = (height + tile_size - 1) // tile_size
    r = tile_size // cell  # cells per tile side
    plan = _Plan(n=n, cell=cell, cells_x=tiles_x * r, cells_y=tiles_y * r, chunks=[])
    if n == 0 or tiles_x * tiles_y == 0:
        return plan

    m = means2d.detach()
    rad = radii.to(m.dtype)
    valid = (radii > 0).all(-1) & torch.isfinite(m).all(-1) & torch.isfinite(depths)
    valid &= torch.isfinite(conics).all(-1) & torch.isfinite(opacities)
    m = torch.where(valid[:, None], m, torch.zeros_like(m))
    hi = torch.tensor([tiles_x, tiles_y], device=dev, dtype=m.dtype)
    # CONVENTIONS: floor((mean - r)/16) <= t < ceil((mean + r)/16), clamped to the grid
    tmin = torch.minimum(torch.floor((m - rad) / tile_size).clamp_min(0), hi).long()
    tmax = torch.minimum(torch.ceil((m + rad) / tile_size).clamp_min(0), hi).long()
    span = (tmax - tmin).clamp_min(0)
    counts = span[:, 0] * span[:, 1] * valid

    # Gaussians front to back; stable, so equal depths keep index order (as a stable radix sort)
    order = torch.argsort(depths.detach(), stable=True)
    order = order[counts.index_select(0, order) > 0]
    cnt = counts.index_select(0, order)
    total = int(cnt.sum())
    if total == 0:
        return plan
    # one row per (tile, Gaussian) pair, Gaussian by Gaussian in depth order
    gid = torch.repeat_interleave(order, cnt)
    local = torch.arange(total, device=dev) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
    sx = span[:, 0].index_select(0, gid)
    tx = tmin[:, 0].index_select(0, gid) + local % sx
    ty = tmin[:, 1].index_select(0, gid) + local // sx

    if r > 1:
        # split each (tile, Gaussian) pair into the tile's cells the Gaussian can reach
        ext = alpha_extent(conics.detach(), opacities.detach())
        mg, eg = m.index_select(0, gid), ext.index_select(0, gid)
        lo, hi_ = mg - eg, mg + eg  # box of the pixel centres it can reach
        off = torch.arange(r, device=dev)
        first = torch.stack([tx, ty], -1)[:, None, :] * tile_size + (off * cell)[:, None] + 0.5  # [pairs,r,2]
        hit = (hi_[:, None, :] >= first) & (lo[:, None, :] <= first + (cell - 1))  # per axis
        p, iy, ix = torch.nonzero(hit[:, :, None, 1] & hit[:, None, :, 0], as_tuple=True)
        key = (ty.index_select(0, p) * r + iy) * plan.cells_x + tx.index_select(0, p) * r + ix
        gid = gid.index_select(0, p)
    else:
        key = ty * plan.cells_x + tx
    # a stable sort by cell keeps the depth order within each cell
    key, perm = torch.sort(key.int(), stable=True)
    key = key.long()
    gid = gid.index_select(0, perm)
    total = key.numel()
    if total == 0:
        return plan

    n_cells = plan.cells_x * plan.cells_y
    cell_counts = torch.bincount(key, minlength=n_cells)
    cell_start = torch.cumsum(cell_counts, 0) - cell_counts
    busy = torch.nonzero(cell_counts).squeeze(1)
    # chunk cells of similar list lengths together, so padding to the chunk's longest stays small;
    # one segment of a chunk is at most chunk_elems (pixels x Gaussians)
    busy = busy[torch.argsort(cell_counts[busy], stable=True)]
    busy_counts = cell_counts[busy].tolist()
    pix = cell * cell
    i = 0
    while i < len(busy_counts):
        j = i + 1
        while j < len(busy_counts) and (j + 1 - i) * pix * min(segment, busy_counts[j]) <= chunk_elems:
            j += 1
        k = busy_counts[j - 1]
        cells = busy[i:j]
        ar = torch.arange(k, device=dev)
        pos = (cell_start[cells, None] + ar).clamp_max(total - 1)
        ids = torch.where(ar < cell_counts[cells, None], gid.index_select(0, pos.view(-1)).view(pos.shape), n)
        plan.chunks.append((cells, ids, cell_counts[cells]))
        i = j
    return plan


def _pixel_centres(cells: Tensor, plan: _Plan, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    off = torch.arange(plan.cell, device=cells.device, dtype=dtype) + 0.5
    px = (cells % plan.cells_x).to(dtype)[:, None] * plan.cell + off
    py = (cells // plan.cells_x).to(dtype)[:, None] * plan.cell + off
    return px, py  # [Tc, cell] each
