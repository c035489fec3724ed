"""Who owns which Gaussian, and which rank renders which view (pure functions on tensors).

- Morton codes of the means order Gaussians along a Z curve, so contiguous ranges are compact.
- The access profile records, for each training view, which Gaussians it touches (projection
  radii > 0: in front of the camera, in the frustum widened by the 3.33-sigma extent).
- Partitions give owner[i] in [0, W): `locality` (contiguous Morton ranges of equal load, load =
  number of views touching a Gaussian), `random` (a seeded permutation cut into equal counts,
  Grendel's scheme after its rebalance) and `round_robin` (i % W, gsplat's scheme).
- View homes: each view goes to the rank that owns most of what it sees, with floor(V/W) or
  ceil(V/W) views per rank, so that every rank renders as many views (greedy, largest counts first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gstrain.choices import PARTITIONS  # views: gstrain/distributed/view_partition.py
from gstrain.knn import morton_codes
from gstrain.render.reference import project_gaussians

__all__ = [
    "AccessProfile", "access_profile", "assign_homes", "load_imbalance", "locality_partition",
    "make_partition",
    "morton_codes", "random_partition", "round_robin_partition", "shard_indices", "view_owner_counts",
]  # fmt: skip



@dataclass
class AccessProfile:
    """Visible Gaussian ids of each view in CSR form: view v touches ids[ptr[v]:ptr[v+1]] (ascending)."""

    ptr: Tensor  # [V+1] int64
    ids: Tensor  # [nnz] int32 or int64
    n: int  # number of Gaussians

    @property
    def n_views(self) -> int:
        return self.ptr.numel() - 1

    def view(self, v: int) -> Tensor:
        return self.ids[int(self.ptr[v]) : int(self.ptr[v + 1])]

    def view_of_entries(self) -> Tensor:
        """[nnz] the view of each entry."""
        return torch.repeat_interleave(torch.arange(self.n_views), self.ptr.diff())

    def access_counts(self) -> Tensor:
        """[N] how many views touch each Gaussian: the load a locality partition balances."""
        return torch.bincount(self.ids.long(), minlength=self.n)

    @staticmethod
    def from_lists(visible: Sequence[Tensor], n: int) -> AccessProfile:
        counts = torch.tensor([len(v) for v in visible], dtype=torch.int64)
        ptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        ids = [v.sort().values.to(torch.int32) for v in visible]
        ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
        return AccessProfile(ptr=ptr, ids=ids, n=n)


@torch.no_grad()
def access_profile(
    means: Tensor,
    quats: Tensor,
    scales: Tensor,
    viewmats: Tensor,
    Ks: Tensor,
    widths: Sequence[int],
    heights: Sequence[int],
    chunk: int = 1 << 20,
) -> AccessProfile:
    """Which Gaussians each view touches: project_gaussians' radii > 0, in chunks of Gaussians.

    scales are LINEAR (exp of the parameter). viewmats [V,4,4], Ks [V,3,3].
    """
    visible = []
    for v in range(viewmats.shape[0]):
        parts = []
        for s in range(0, means.shape[0], chunk):
            p = project_gaussians(means[s : s + chunk], quats[s : s + chunk], scales[s : s + chunk],
                                  viewmats[v], Ks[v], int(widths[v]), int(heights[v]))  # fmt: skip
            parts.append(torch.nonzero((p.radii > 0).all(-1)).squeeze(1) + s)
        visible.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    return AccessProfile.from_lists(visible, means.shape[0])


def locality_partition(means: Tensor, load: Tensor, world: int, count_weight: float = 0.5) -> Tensor:
    """owner [N]: contiguous ranges of the Morton order, cut so each rank's summed weight is equal
    (to within one Gaussian's), where a Gaussian weighs (1 - count_weight) * its share of the load
    plus count_weight * its share of the count (1/N).

    Load (views touching a Gaussian) sets the records a rank sends; count sets its memory,
    projection and optimizer work. Load alone (count_weight=0) measured 447k and 53k Gaussians on
    two ranks (500k random Gaussians on beer): no memory saved on the larger one. With a weight w,
    a rank holds at most 1/(W w) of the Gaussians and 1/(W (1 - w)) of the load. A zero total
    load falls back to equal counts."""
    if not 0.0 <= count_weight <= 1.0:
        raise ValueError(f"count_weight must be in [0, 1], got {count_weight}")
    n = means.shape[0]
    order = torch.argsort(morton_codes(means), stable=True)
    w = load.double().index_select(0, order)
    total = float(w.sum())
    if total <= 0:
        w = torch.ones_like(w)
    else:
        w = (1.0 - count_weight) * w / total + count_weight / max(n, 1)
    cum = w.cumsum(0)
    targets = cum[-1] * torch.arange(1, world, dtype=torch.float64) / world
    # rank k-1 ends with the first Gaussian whose cumulative weight reaches the k-th target
    cuts = (torch.searchsorted(cum, targets) + 1).clamp_max(n)
    rank_sorted = torch.searchsorted(cuts, torch.arange(n), right=True)
    owner = torch.empty(n, dtype=torch.int64)
    owner[order] = rank_sorted
    return owner


def load_imbalance(loads: Sequence[float]) -> float:
    """max / mean of the ranks' loads (records each owner sent); 1.0 when nothing was sent."""
    total = float(sum(loads))
    return max(loads) * len(loads) / total if total > 0 else 1.0


class LoadWindow:
    """The ranks' loads summed over a window of at least `steps` steps (dist.rebalance_window).
    A few steps' loads follow the few views drawn, not the partition: a decision on them would
    partition again for noise, and again at the next check."""

    def __init__(self, world: int, steps: int, start: int = 0) -> None:
        self.steps = steps
        self.start = start
        self.loads = [0.0] * world

    def add(self, loads: Sequence[float], step: int) -> float | None:
        """Add the loads since the last call (now at `step`); when the window spans `steps`
        steps, its max/mean load, and a new window begins here. Else None."""
        self.loads = [a + b for a, b in zip(self.loads, loads, strict=True)]
        if step - self.start < self.steps:
            return None
        ratio = load_imbalance(self.loads)
        self.loads = [0.0] * len(self.loads)
        self.start = step
        return ratio


def random_partition(n: int, world: int, seed: int = 0) -> Tensor:
    """owner [N]: a seeded random permutation cut into W equal counts."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    owner = torch.empty(n, dtype=torch.int64)
    owner[perm] = torch.arange(n) * world // max(n, 1)
    return owner


def round_robin_partition(n: int, world: int) -> Tensor:
    """owner [N] = i % W (gsplat's distributed sharding)."""
    return torch.arange(n) % world


def make_partition(kind: str, means: Tensor, load: Tensor, world: int, seed: int = 0,
                   count_weight: float = 0.5) -> Tensor:  # fmt: skip
    """owner [N] by dist.partition; count_weight: the locality cut's balance (locality_partition)."""
    if kind == "locality":
        return locality_partition(means, load, world, count_weight)
    if kind == "random":
        return random_partition(means.shape[0], world, seed)
    if kind == "round_robin":
        return round_robin_partition(means.shape[0], world)
    if kind == "views":
        raise ValueError("the views partition needs the access profile: gstrain.distributed.view_partition.views_plan")
    raise ValueError(f"partition must be one of {PARTITIONS}, got {kind!r}")


def shard_indices(owner: Tensor, world: int) -> list[Tensor]:
    """The global ids each rank owns, ascending: rank r's rows in the order it stores them."""
    order = torch.argsort(owner, stable=True)
    return list(torch.split(order, torch.bincount(owner, minlength=world).tolist()))


def view_owner_counts(profile: AccessProfile, owner: Tensor, world: int) -> Tensor:
    """[V, W] int64: how many of the Gaussians view v touches each rank owns."""
    key = profile.view_of_entries() * world + owner.index_select(0, profile.ids.long())
    return torch.bincount(key, minlength=profile.n_views * world).view(profile.n_views, world)


def assign_homes(counts: Tensor) -> Tensor:
    """homes [V]: each view's renderer rank. Greedy over (view, rank) pairs by decreasing count:
    a view goes to the rank owning most of what it sees unless that rank is full, then to its
    next best rank. Every rank ends with floor(V/W) or ceil(V/W) views (V mod W ranks get the
    extra one), so that each rank has views to render every step.
    """
    n_views, world = counts.shape
    floor, extra = divmod(n_views, world)
    homes = [-1] * n_views
    taken = [0] * world
    left = n_views
    # pairs by count, largest first; ties: lower view, then lower rank (stable)
    for p in torch.argsort(counts.flatten(), descending=True, stable=True).tolist():
        v, r = divmod(p, world)
        if homes[v] >= 0 or taken[r] > floor or (taken[r] == floor and extra == 0):
            continue
        if taken[r] == floor:
            extra -= 1  # this rank takes one of the V mod W extra views
        homes[v] = r
        taken[r] += 1
        left -= 1
        if left == 0:
            break
    return torch.tensor(homes, dtype=torch.int64)
