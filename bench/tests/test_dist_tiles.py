"""bench/dist_tiles.py on a case worked out by hand: two Gaussians, a 2x2-tile image, two ranks."""

from __future__ import annotations

import torch

from bench.dist_comm import Cameras
from bench.dist_tiles import view_tiles


def test_tile_split_counts_by_hand() -> None:
    # fx = fy = 32 at depth 1: scale 0.01 gives variance 0.1024 + 0.3 (eps2d), radius ceil(3.33 * 0.634) = 3 px
    means = torch.tensor([[-0.25, -0.25, 1.0], [0.0, 0.0, 1.0]])  # pixels (8, 8) and (16, 16)
    scales = torch.full((2, 3), 0.01)
    K = torch.tensor([[32.0, 0.0, 16.0], [0.0, 32.0, 16.0], [0.0, 0.0, 1.0]])
    cams = Cameras(means, scales, torch.eye(4)[None], K[None], [32], [32], "hand")
    owner = torch.tensor([0, 1])
    got = view_tiles(cams, 0, owner, world=2)
    # A (rank 0) covers tile (0,0) only; B (rank 1) covers all four tiles. Tile (0,0) has one pair
    # of each rank, a tie that goes to rank 0; the other three tiles go to rank 1.
    assert got["visible"] == 2
    assert got["records"] == 1  # B to rank 0 for tile (0,0); A stays home
    # renderers [[0, 1], [1, 1]]: two tile edges between ranks, 16 px each, both sides, 5 px deep
    assert got["halo_records"] == 2 * 2 * 16 * (5 * 3 * 4 * 2) / 84
    assert got["work_max_over_mean"] == 3 / 2.5  # rank 0 renders 2 pairs, rank 1 three
