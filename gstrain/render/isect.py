"""The culled tile intersection on CUDA (dev.ellipse_cull): pairs cut before the sort.

cull.cull_pairs filters gsplat's sorted pair list afterwards with ~30 tensor ops over every pair.
Here our kernels (csrc/isect.cu) apply the same test while making the pairs: a count pass per
(camera, Gaussian), a prefix sum, a fill pass writing gsplat's isect_ids layout, a stable radix
sort, and gsplat's isect_offset_encode. The result equals isect_tiles + cull_pairs exactly
(tests/test_cull.py checks it) and costs one host sync, for the pair count.

capped_intersection is the same without that sync (a CUDA-graph step cannot read a count back):
the pairs go into buffers of a fixed capacity, the sort covers the whole capacity (padding keys
sort last), and the real count stays on the device, where the rasterizer reads it. A view with
more pairs than the capacity is not rendered approximately: it sets PairBudget.flag, which makes
the step's Adam and statistics kernels no-ops, and the host redoes the step with a larger budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from gstrain.render.cull import CulledPairs


@dataclass
class PairBudget:
    """Fixed-capacity pair buffers' bookkeeping on the device (see the module docstring).

    tag [1] float32: the step's number + 1, written by the host before each step; flag [1] int32:
    0, or the tag of the first step whose pairs overflowed (sticky until the host clears it);
    pair_sum [3] int64: pairs before / after the cull summed over steps that fit, and the most
    pairs one view kept (overflowed ones included); with `slot` ([1] int32 on the device, refilled
    per step), pair_sum is [S, 3] and each step counts into row slot (a graph shared by views).
    """

    capacity: int
    tag: Tensor
    flag: Tensor
    pair_sum: Tensor
    slot: Tensor | None = None

    @classmethod
    def on(cls, device: torch.device, capacity: int, tag: Tensor | None = None) -> PairBudget:
        tag = torch.ones(1, device=device) if tag is None else tag
        return cls(int(capacity), tag, torch.zeros(1, dtype=torch.int32, device=device),
                   torch.zeros(3, dtype=torch.int64, device=device))  # fmt: skip


@dataclass
class CappedPairs:
    """capped_intersection's pairs: isect_offsets [C,th,tw], flatten_ids [capacity] (the first
    n_isects real), n_isects [1] int32 on the device."""

    isect_offsets: Tensor
    flatten_ids: Tensor
    n_isects: Tensor


class _Counted(NamedTuple):
    """isect_count's per-Gaussian counts, prefix-summed, and the inputs as the fill wants them."""

    args: tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # means2d, radii, depths, conics, opacities
    size: tuple[int, int, int]  # width, height, tile_size
    totals: Tensor  # [pairs of the bounding rectangles, pairs kept] int64 on the device
    cum: Tensor  # [C*N] int64: Gaussian i's pairs end at cum[i]


def _count(ext: ModuleType, means2d: Tensor, radii: Tensor, depths: Tensor, conics: Tensor, opacities: Tensor,
           width: int, height: int, tile_size: int, valid: Tensor | None = None) -> _Counted:  # fmt: skip
    means2d, radii = means2d.float().contiguous(), radii.int().contiguous()
    conics, opacities = conics.float().contiguous(), opacities.float().contiguous()
    size = (int(width), int(height), int(tile_size))
    counts, totals = ext.isect_count(means2d, radii, conics, opacities, *size, valid)
    cum = torch.cumsum(counts, 0, dtype=torch.int64)
    return _Counted((means2d, radii, depths.float().contiguous(), conics, opacities), size, totals, cum)


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

    c = _count(ext, means2d, radii, depths, conics, opacities, width, height, tile_size)
    before, after = c.totals.tolist()  # the one host sync: both counts in one read
    isect_ids, flatten_ids = ext.isect_fill(*c.args, c.cum, after, *c.size)
    tiles_x = (width + tile_size - 1) // tile_size
    tiles_y = (height + tile_size - 1) // tile_size
    offsets = isect_offset_encode(isect_ids, means2d.shape[0], tiles_x, tiles_y)
    return CulledPairs(offsets, flatten_ids, int(before), int(after))


@torch.no_grad()
def capped_intersection(
    ext: ModuleType,
    means2d: Tensor,
    radii: Tensor,
    depths: Tensor,
    conics: Tensor,
    opacities: Tensor,
    width: int,
    height: int,
    tile_size: int,
    budget: PairBudget,
    valid: Tensor | None = None,
) -> CappedPairs:
    """culled_intersection's pairs with no host sync, into budget.capacity slots. With `valid`
    ([2] int32 on the device: width, height), the image is that top-left part of a
    width x height canvas: pairs are made, and culled, for its tiles only."""
    c = _count(ext, means2d, radii, depths, conics, opacities, width, height, tile_size, valid)
    offsets, flatten_ids, n_isects = ext.isect_fill_capped(
        *c.args, c.cum, c.totals, budget.capacity, budget.tag, budget.flag, budget.pair_sum, *c.size, valid,
        budget.slot,
    )
    return CappedPairs(offsets, flatten_ids, n_isects)
