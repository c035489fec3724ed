"""Ellipse culling of (Gaussian, tile) pairs: dev.ellipse_cull.

gsplat's isect_tiles pairs each Gaussian with every tile its 3-sigma bounding box touches, and
both raster passes walk every pair. Many of those tiles only meet the box's corners, or lie where
a faint Gaussian's alpha is already below the 1/255 cut-off. cull_pairs drops a pair when the
Gaussian's alpha is provably < 1/255 at every pixel centre of the tile (alpha_bound), so the
rasterizers would skip it at every pixel anyway: images and gradients are unchanged.

Everything is tensor ops on the pair list (CPU or CUDA, no per-pair Python). The one host sync
is the compaction (its size), after gsplat's isect_tiles has already synced for its own.
Renders on CUDA use isect.py instead (the same test inside our intersection kernel, before the
sort); cull_pairs stays as its test oracle and bench_cull's comparison.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gstrain.render.alpha_bound import min_sigma_on_rect, sigma_threshold


@dataclass
class CulledPairs:
    """The kept pairs in gsplat's non-packed layout, and the pair counts before and after."""

    isect_offsets: Tensor  # [C, tiles_y, tiles_x] int32: first kept pair of each tile
    flatten_ids: Tensor  # [M'] int32, in the original (tile, depth) order
    pairs_before: int
    pairs_after: int


def pair_tiles(isect_offsets: Tensor, n_pairs: int) -> Tensor:
    """The flat tile index (camera * tiles + tile) of every pair, from the tiles' first pairs.

    Empty tiles repeat the next tile's offset; the last tile whose offset is <= i holds pair i.
    """
    offs = isect_offsets.reshape(-1).contiguous()
    pos = torch.arange(n_pairs, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, pos, right=True) - 1


@torch.no_grad()
def keep_mask(
    tiles: Tensor,
    gaussians: Tensor,
    means2d: Tensor,
    conics: Tensor,
    opacities: Tensor,
    width: int,
    height: int,
    tile_size: int,
) -> Tensor:
    """Which (flat tile, flat Gaussian) pairs may contribute >= 1/255 to a pixel centre of the tile.

    means2d [C,N,2], conics [C,N,3], opacities [C,N]; gaussians index the flattened C*N arrays.
    Tiles at the right and bottom edge count only their pixels inside the image.
    """
    tiles_x = (width + tile_size - 1) // tile_size
    tiles_y = (height + tile_size - 1) // tile_size
    thr = sigma_threshold(conics.reshape(-1, 3).float(), opacities.reshape(-1).float())
    per_gaussian = torch.cat([means2d.reshape(-1, 2).float(), conics.reshape(-1, 3).float(), thr[:, None]], -1)
    g = per_gaussian.index_select(0, gaussians)  # one gather: [pairs, 6] (int32 ids index directly)
    t = tiles.long() % (tiles_x * tiles_y)
    corner_x = (t % tiles_x).float() * tile_size
    corner_y = (t // tiles_x).float() * tile_size
    # the tile's first and last pixel centres, clipped to the image (scalars: no host copy)
    first = torch.stack([corner_x + 0.5, corner_y + 0.5], -1)
    last = torch.stack([(corner_x + (tile_size - 0.5)).clamp_max(width - 0.5),
                        (corner_y + (tile_size - 0.5)).clamp_max(height - 0.5)], -1)  # fmt: skip
    mean = g[:, 0:2]
    sigma = min_sigma_on_rect(first - mean, last - mean, g[:, 2:5])
    return ~(sigma > g[:, 5])  # NaN anywhere keeps the pair


@torch.no_grad()
def cull_pairs(
    means2d: Tensor,
    conics: Tensor,
    opacities: Tensor,
    isect_offsets: Tensor,
    flatten_ids: Tensor,
    width: int,
    height: int,
    tile_size: int,
    mask_fn: Callable[..., Tensor] = keep_mask,
) -> CulledPairs:
    """Drop the pairs of gsplat's intersection (isect_offsets [C,th,tw], flatten_ids [M]) that
    cannot reach 1/255 anywhere on their tile; the rest keep their (tile, depth) order.

    mask_fn: keep_mask or a drop-in for it (bench_cull times a torch.compile'd one).
    """
    n_pairs = flatten_ids.numel()
    if n_pairs == 0:
        return CulledPairs(isect_offsets, flatten_ids, 0, 0)
    tiles = pair_tiles(isect_offsets, n_pairs)
    keep = mask_fn(tiles, flatten_ids, means2d, conics, opacities, width, height, tile_size)
    # a tile's new first pair = the number of kept pairs before its old first pair
    kept_before = torch.zeros(n_pairs + 1, device=keep.device, dtype=torch.int32)
    torch.cumsum(keep, 0, dtype=torch.int32, out=kept_before[1:])
    offsets = kept_before.index_select(0, isect_offsets.reshape(-1).long()).reshape(isect_offsets.shape)
    kept = flatten_ids[keep]  # the compaction: its size is the one host sync
    return CulledPairs(offsets.to(isect_offsets.dtype), kept, n_pairs, kept.numel())
