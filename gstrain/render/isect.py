"""The culled tile intersection on CUDA (render.ellipse_cull): pairs cut before the sort.

cull.cull_pairs filters gsplat's sorted pair list afterwards with ~30 tensor ops over every pair.
Here our kernels (csrc/isect.cu) apply the same test while making the pairs: a count pass per
(camera, Gaussian), a prefix sum, a fill pass writing gsplat's isect_ids layout, a stable radix
sort, and gsplat's isect_offset_encode. The result equals isect_tiles + cull_pairs exactly
(tests/test_cull.py checks it) and costs one host sync, for the pair count.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import Tensor

from gstrain.render.cull import CulledPairs


@torch.no_grad()
def culled_intersection(
    ext: ModuleType,
    means2d: Tensor,
    radii: Tensor,
    depths: Tensor,
    conics: Tensor,
    opacities: Tensor,
    width: int,
    height: int,
    tile_size: int,
) -> CulledPairs:
    """Kept (Gaussian, tile) pairs of C cameras: means2d [C,N,2], radii [C,N,2] int32, depths [C,N],
    conics [C,N,3], opacities [C,N] (CUDA); ext is the built gstrain_raster extension.

    pairs_before is isect_tiles' count (the bounding rectangles), pairs_after the kept one.
    """
    from gsplat import isect_offset_encode

    means2d, radii = means2d.float().contiguous(), radii.int().contiguous()
    conics, opacities = conics.float().contiguous(), opacities.float().contiguous()
    size = (int(width), int(height), int(tile_size))
    counts, totals = ext.isect_count(means2d, radii, conics, opacities, *size)
    cum = torch.cumsum(counts, 0, dtype=torch.int64)  # Gaussian i's pairs end at cum[i]
    before, after = totals.tolist()  # the one host sync: both counts in one read
    isect_ids, flatten_ids = ext.isect_fill(
        means2d, radii, depths.float().contiguous(), conics, opacities, cum, after, *size
    )
    tiles_x = (width + tile_size - 1) // tile_size
    tiles_y = (height + tile_size - 1) // tile_size
    offsets = isect_offset_encode(isect_ids, means2d.shape[0], tiles_x, tiles_y)
    return CulledPairs(offsets, flatten_ids, int(before), int(after))
