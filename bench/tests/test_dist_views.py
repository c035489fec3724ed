"""bench/dist_views.py's partition on a case worked out by hand."""

from __future__ import annotations

import torch

from bench.dist_views import view_cluster_partition, view_groups
from gstrain.dist.partition import AccessProfile


def test_view_clusters_by_hand() -> None:
    # six Gaussians on the x axis (the last far away, seen by no view); views 0, 1 see the left
    # ones, views 2, 3 the right ones, and views 0 and 2 both see the middle one
    means = torch.tensor([[-2.0, 0, 0], [-1.0, 0, 0], [0.0, 0, 0], [1.0, 0, 0], [2.0, 0, 0], [5.0, 5, 5]])
    seen = [torch.tensor(v) for v in ([0, 1, 2], [0, 1], [2, 3, 4], [3, 4])]
    prof = AccessProfile.from_lists(seen, 6)
    # centroids x: -1, -1.5, 1, 1.5 -> the two left views form group 0
    assert view_groups(prof, means, 2).tolist() == [0, 0, 1, 1]
    fallback = torch.tensor([1, 1, 1, 1, 1, 1])
    for iters in (0, 1):
        # Gaussian 2's tie (one view of each group) goes to the lower group; 5 keeps the fallback
        assert view_cluster_partition(prof, means, 2, iters, fallback).tolist() == [0, 0, 0, 1, 1, 1]
