"""dist.partition=views (gstrain/distributed/view_partition.py): cases worked out by hand, the balance
guard, and the per-rank (collective) plan equal to the whole-model plan over gloo processes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gstrain.distributed.local import run_local
from gstrain.distributed.migrate import plan_order
from gstrain.distributed.partition import AccessProfile
from gstrain.distributed.view_partition import guarded, imbalance, view_groups, view_owners, views_plan


def _line() -> tuple[torch.Tensor, AccessProfile]:
    # six Gaussians on the x axis (the last far off, seen by no view); views 0, 1 see the left
    # ones, views 2, 3 the right ones, and views 0 and 2 both see the middle one
    means = torch.tensor([[-2.0, 0, 0], [-1.0, 0, 0], [0.0, 0, 0], [1.0, 0, 0], [2.0, 0, 0], [5.0, 5, 5]])
    seen = [torch.tensor(v) for v in ([0, 1, 2], [0, 1], [2, 3, 4], [3, 4])]
    return means, AccessProfile.from_lists(seen, 6)


def test_views_by_hand() -> None:
    means, prof = _line()
    # view centroids x: -1, -1.5, 1, 1.5 -> the two left views form group 0
    assert view_groups(prof, means, 2, lambda t: t).tolist() == [0, 0, 1, 1]
    fallback = torch.ones(6, dtype=torch.int64)
    for regroupings in (0, 1, 3):
        # Gaussian 2's tie (one view of each group) goes to the lower group; 5 keeps its fallback
        assert view_owners(prof, means, 2, fallback, regroupings=regroupings).tolist() == [0, 0, 0, 1, 1, 1]


def test_more_ranks_than_views_falls_back_to_locality() -> None:
    means, _ = _line()  # 2 views for 8 ranks: six groups get no view, their ranks no rows
    prof = AccessProfile.from_lists([torch.tensor([0, 1, 2]), torch.tensor([3, 4])], 6)
    order, rows, kept = views_plan(prof, means, prof.access_counts(), 0, 8, 0.5)
    assert not kept and sum(rows) == 6 and sorted(order.tolist()) == list(range(6))
    locality = plan_order("locality", means, prof.access_counts(), 8, 0, 0.5)  # the fall-back is that plan
    assert torch.equal(order, locality[0]) and rows == locality[1]


def test_guard_by_hand() -> None:
    load = torch.tensor([4.0, 4.0, 1.0, 1.0])
    skewed = torch.tensor([0, 0, 0, 1])  # loads 9 / 1 (max/mean 1.8), counts 3 / 1 (1.5)
    assert imbalance(skewed, load, 2) == 1.8
    fallback = torch.tensor([0, 1, 0, 1])
    assert guarded(skewed, fallback, load, 2, limit=1.5) == (fallback, False)
    owner, kept = guarded(skewed, fallback, load, 2, limit=1.8)
    assert kept and owner is skewed
    # beyond the limit a partition stays only if no less balanced than its fallback: 1.8 against a
    # fallback at 1.6 falls back, 1.6 against a fallback at 1.8 stays
    worse = torch.tensor([0, 0, 1, 1])  # loads 8 / 2
    assert imbalance(worse, load, 2) == 1.6
    assert guarded(skewed, worse, load, 2, limit=1.5) == (worse, False)
    assert guarded(worse, skewed, load, 2, limit=1.5) == (worse, True)


def _city_like() -> tuple[torch.Tensor, AccessProfile]:
    """48 Gaussians along a street, 12 views each seeing a window of 8 (overlapping neighbours)."""
    g = torch.Generator().manual_seed(4)
    means = torch.cat([torch.arange(48.0)[:, None], torch.rand(48, 2, generator=g)], 1)
    seen = [torch.arange(4 * v, min(4 * v + 8, 48)) for v in range(12)]
    return means, AccessProfile.from_lists(seen, 48)


def _rows_of(prof: AccessProfile, lo: int, hi: int) -> AccessProfile:
    """The profile restricted to Gaussians lo..hi-1, renumbered from 0 (one rank's rows)."""
    return AccessProfile.from_lists([v[(v >= lo) & (v < hi)] - lo for v in
                                     (prof.view(i).long() for i in range(prof.n_views))], hi - lo)  # fmt: skip


def _collective(rank: int, world: int) -> tuple[list[int], list[int], bool]:
    means, prof = _city_like()
    lo, hi = (0, 20) if rank == 0 else (20, 48)  # uneven shards

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [None] * world
        dist.all_gather_object(parts, t)
        return torch.cat(parts)

    order, rows, kept = views_plan(_rows_of(prof, lo, hi), means, prof.access_counts(), lo, 2, 0.5,
                                   reduce=reduce, gather=gather)  # fmt: skip
    return order.tolist(), rows, kept


def test_collective_plan_equals_whole_model_plan() -> None:
    means, prof = _city_like()
    load = prof.access_counts()
    order, rows, kept = views_plan(prof, means, load, 0, 2, 0.5)
    # views 0-5 form group 0 (centroids x = 4v + 3.5); Gaussian g is seen by views g//4 - 1 and
    # g//4, so 24..27 (views 5 and 6) tie and go to the lower group: 28 rows on rank 0, 20 on rank 1
    # (count max/mean 1.17, within the guard)
    assert kept and rows == [28, 20]
    owner = torch.empty(48, dtype=torch.int64)
    owner[order] = torch.repeat_interleave(torch.arange(2), torch.tensor(rows))
    assert owner.tolist() == [0] * 28 + [1] * 20
    for got in run_local(_collective, 2, timeout=30):
        assert got == (order.tolist(), rows, kept)


def test_sparse_votes_equal_dense_votes(monkeypatch) -> None:
    import gstrain.distributed.view_partition as vp

    g = torch.Generator().manual_seed(9)
    means = torch.rand(300, 3, generator=g) * 10
    seen = [torch.nonzero((means - means[i * 25]).norm(dim=1) < 4).squeeze(1) for i in range(12)]
    prof = AccessProfile.from_lists(seen, 300)
    fallback = torch.randint(0, 4, (300,), generator=g)
    dense = view_owners(prof, means, 4, fallback)
    monkeypatch.setattr(vp, "DENSE_VOTES_MAX", 0)  # every table "too large": the sparse path
    assert torch.equal(view_owners(prof, means, 4, fallback), dense)
    assert len(set(dense.tolist())) > 1  # not a trivial partition
