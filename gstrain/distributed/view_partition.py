"""dist.partition=views: owners chosen from the views' side (Gaian's locality groups, by votes).

    1. the training views in W equal groups, by recursive bisection of their centroids (the mean
       position of the Gaussians each view touches) along the longest axis;
    2. each Gaussian to the group whose views touch it most (a Gaussian no view touches keeps its
       locality owner, dist.partition=locality);
    3. the groups become the views' homes under that partition (assign_homes), and 2 again,
       REGROUPINGS times.

Where views see small parts of the scene (a city walked street by street) this keeps most of a
view's Gaussians on its home: 0.098x round robin's bytes at W=8 on the generated 10M city,
against 0.158x for locality (bench/dist_views.py). Where every view sees most of the scene the
groups mean little and one rank can collect most of the load (garden: 5.7x the mean), so a
partition leaving a rank over MAX_IMBALANCE times the mean load or Gaussian count (and less
balanced than locality) falls back to the locality partition (`guarded`).

view_owners works on the whole model (one process) or on each rank's own rows during training,
where `reduce` sums the per-view tensors over the ranks: both give the same owners.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gstrain.distributed.migrate import plan_from_owner, plan_order
from gstrain.distributed.partition import AccessProfile, assign_homes, locality_partition, view_owner_counts

REGROUPINGS = 3
MAX_IMBALANCE = 1.5  # max / mean of the ranks' load or Gaussian count that `views` may leave
DENSE_VOTES_MAX = 1 << 26  # votes counted in a dense [N, W] int64 table up to this size (512 MB)

Reduce = Callable[[Tensor], Tensor]  # sums a tensor over the ranks (identity in one process)


def _bisect(points: Tensor, ids: Tensor, parts: int) -> list[Tensor]:
    if parts == 1:
        return [ids]
    if ids.numel() == 0:  # more ranks than views: some groups stay empty
        return [ids] * parts
    p = points.index_select(0, ids)
    axis = int((p.max(0).values - p.min(0).values).argmax())
    order = ids[torch.argsort(p[:, axis], stable=True)]
    half = len(order) * (parts // 2) // parts
    return _bisect(points, order[:half], parts // 2) + _bisect(points, order[half:], parts - parts // 2)


def view_groups(prof: AccessProfile, means: Tensor, world: int, reduce: Reduce) -> Tensor:
    """[V] int64: W equal groups of views by recursive bisection of their centroids."""
    sums = torch.zeros(prof.n_views, 4, dtype=torch.float64)
    pts = means.detach().double()
    for v in range(prof.n_views):  # view by view: gathering every (view, Gaussian) pair at once costs GBs
        sums[v, :3] = pts.index_select(0, prof.view(v).long()).sum(0)
    sums[:, 3] = prof.ptr.diff().double()
    sums = reduce(sums)  # position sums and counts over every rank's rows
    centres = sums[:, :3] / sums[:, 3:].clamp_min(1.0)
    groups = torch.empty(prof.n_views, dtype=torch.int64)
    for r, members in enumerate(_bisect(centres, torch.arange(prof.n_views), world)):
        groups[members] = r
    return groups


def _votes(prof: AccessProfile, groups: Tensor, world: int, fallback: Tensor) -> Tensor:
    """owner [N]: the group whose views touch each Gaussian most (ties: the lower group).

    A dense [N, W] table up to DENSE_VOTES_MAX entries, else sparse over the (Gaussian, group)
    pairs that occur: the table would be 10 GB at 10M Gaussians and W=128."""
    key = prof.ids.long() * world + groups.index_select(0, prof.view_of_entries())
    if prof.n * world <= DENSE_VOTES_MAX:  # a dense table is much faster than sorting the pairs
        votes = torch.bincount(key, minlength=prof.n * world).view(prof.n, world)
        return torch.where(votes.sum(1) > 0, votes.argmax(1), fallback)
    pairs, votes = torch.unique(key, return_counts=True)
    gaussian, group = pairs // world, pairs % world
    # more votes first, then the lower group: world - group lies in 1..world, below world + 1
    score = votes * (world + 1) + (world - group)
    best = torch.full((prof.n,), -1, dtype=torch.int64).scatter_reduce(0, gaussian, score, "amax")
    return torch.where(best >= 0, world - best % (world + 1), fallback)


def view_owners(prof: AccessProfile, means: Tensor, world: int, fallback: Tensor,
                reduce: Reduce = lambda t: t, regroupings: int = REGROUPINGS) -> Tensor:  # fmt: skip
    """owner [N] of the rows `prof` and `means` describe (this rank's, or the whole model's);
    fallback [N]: their locality owners, for rows no view touches."""
    groups = view_groups(prof, means, world, reduce)
    owner = _votes(prof, groups, world, fallback)
    for _ in range(regroupings):
        groups = assign_homes(reduce(view_owner_counts(prof, owner, world)))
        owner = _votes(prof, groups, world, fallback)
    return owner


def imbalance(owner: Tensor, load: Tensor, world: int) -> float:
    """The larger of max/mean load and max/mean Gaussian count over the ranks."""
    per_load = torch.bincount(owner, weights=load.double(), minlength=world)
    per_count = torch.bincount(owner, minlength=world).double()
    worst = float(per_count.max() / per_count.mean().clamp_min(1e-12))
    if float(per_load.sum()) > 0:
        worst = max(worst, float(per_load.max() / per_load.mean()))
    return worst


def guarded(owner: Tensor, fallback: Tensor, load: Tensor, world: int,
            limit: float = MAX_IMBALANCE) -> tuple[Tensor, bool]:  # fmt: skip
    """(owner, True) when it keeps every rank within `limit` x the mean, or no less balanced than
    the fallback (the locality cut itself passes 1.5x the mean count at many ranks); else
    (fallback, False)."""
    if imbalance(owner, load, world) <= max(limit, imbalance(fallback, load, world)):
        return owner, True
    return fallback, False


def views_plan(prof: AccessProfile, means: Tensor, load: Tensor, offset: int, world: int, count_weight: float,
               limit: float = MAX_IMBALANCE, reduce: Reduce = lambda t: t,
               gather: Reduce = lambda t: t) -> tuple[Tensor, list[int], bool]:  # fmt: skip
    """(order, rows per rank, whether `views` was kept) for dist.partition=views.

    means [N,3] and load [N] cover every row, rank-major; prof describes this process's rows
    offset .. offset + prof.n (all of them in one process); gather(owners of those rows) gives
    the owners of every row. The same inputs give the same plan on every rank."""
    fallback = locality_partition(means, load, world, count_weight)
    rows = slice(offset, offset + prof.n)
    mine = view_owners(prof, means[rows], world, fallback[rows], reduce)
    owner, kept = guarded(gather(mine), fallback, load, world, limit)
    if not kept:  # exactly dist.partition=locality's plan (its shards in Morton order)
        return (*plan_order("locality", means, load, world, 0, count_weight), False)
    order, sizes = plan_from_owner(owner, world)
    return order, sizes, True
