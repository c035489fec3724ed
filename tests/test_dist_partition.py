"""Partitions, view homes, the access profile and the comm model (pure functions, no processes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from gstrain.distributed.comm_model import OPS, expected_step_bytes, step_bytes
from gstrain.distributed.partition import (
    AccessProfile,
    access_profile,
    assign_homes,
    load_imbalance,
    locality_partition,
    make_partition,
    morton_codes,
    random_partition,
    round_robin_partition,
    shard_indices,
    view_owner_counts,
)
from gstrain.render.reference import project_gaussians


def _naive_morton(x: int, y: int, z: int) -> int:
    code = 0
    for b in range(21):
        code |= ((x >> b) & 1) << (3 * b) | ((y >> b) & 1) << (3 * b + 1) | ((z >> b) & 1) << (3 * b + 2)
    return code


def test_morton_codes_interleave_bits() -> None:
    top = (1 << 21) - 1
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, top + 1, (50, 3), generator=g)
    q[0], q[1] = 0, top  # corners: the grid maps onto itself exactly
    codes = morton_codes(q.double())
    assert codes.tolist() == [_naive_morton(*row) for row in q.tolist()]


def _clustered(n: int = 3000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(12, 3, generator=g) * 10
    means = centres[torch.randint(0, 12, (n,), generator=g)] + torch.randn(n, 3, generator=g) * 0.5
    load = torch.randint(0, 30, (n,), generator=g)
    return means, load


@pytest.mark.parametrize("kind", ["locality", "random", "round_robin"])
@pytest.mark.parametrize("world", [1, 3, 8])
def test_every_gaussian_owned_once(kind: str, world: int) -> None:
    means, load = _clustered()
    owner = make_partition(kind, means, load, world, seed=1)
    assert owner.shape == (means.shape[0],) and int(owner.min()) >= 0 and int(owner.max()) < world
    shards = shard_indices(owner, world)
    assert len(shards) == world
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(means.shape[0]))
    for r, rows in enumerate(shards):
        assert bool((owner[rows] == r).all()) and bool((rows.diff() > 0).all())


def test_locality_cuts_contiguous_morton_ranges_of_equal_load() -> None:
    means, load = _clustered()
    world = 7
    owner = locality_partition(means, load, world, count_weight=0.0)
    along = owner[torch.argsort(morton_codes(means), stable=True)]
    assert bool((along.diff() >= 0).all())  # contiguous ranges, rank by rank
    per_rank = torch.bincount(owner, weights=load.double(), minlength=world)
    assert float((per_rank - load.sum() / world).abs().max()) <= float(load.max())


def test_locality_count_weight_bounds_shard_sizes() -> None:
    """Load piled on a few Gaussians: load alone gives one rank nearly everything else; with
    count_weight w each rank holds at most N/(W w) (+1) Gaussians and load/(W (1 - w)) (+ one's)."""
    means, _ = _clustered(n=4000)
    load = torch.ones(4000, dtype=torch.int64)
    hot = torch.argsort(morton_codes(means))[:200]  # the first 5% along the curve carry most load
    load[hot] = 400
    world, n = 4, 4000
    load_only = torch.bincount(locality_partition(means, load, world, count_weight=0.0), minlength=world)
    assert int(load_only.max()) > 0.6 * n  # the imbalance the weight is for
    for w in (0.25, 0.5, 1.0):
        owner = locality_partition(means, load, world, count_weight=w)
        sizes = torch.bincount(owner, minlength=world)
        assert int(sizes.max()) <= n / (world * w) + 1, (w, sizes.tolist())
        along = owner[torch.argsort(morton_codes(means), stable=True)]
        assert bool((along.diff() >= 0).all())
        if w < 1.0:
            per_rank = torch.bincount(owner, weights=load.double(), minlength=world)
            assert float(per_rank.max()) <= float(load.sum()) / (world * (1 - w)) + float(load.max())
    equal = torch.bincount(locality_partition(means, load, world, count_weight=1.0), minlength=world)
    assert int(equal.max() - equal.min()) <= 1


def test_load_imbalance() -> None:
    assert load_imbalance([3.0, 1.0]) == 1.5  # max 3 over mean 2
    assert load_imbalance([5.0, 5.0, 5.0]) == 1.0
    assert load_imbalance([0.0, 0.0]) == 1.0  # nothing sent: nothing to even out


def test_load_window_decides_on_the_whole_window_only() -> None:
    from gstrain.distributed.partition import LoadWindow

    window = LoadWindow(2, steps=100, start=0)
    assert window.add([9.0, 1.0], 25) is None  # one check's skew (a few views) decides nothing
    assert window.add([1.0, 9.0], 50) is None
    assert window.add([5.0, 5.0], 75) is None
    # steps 0-100 summed by hand: [9+1+5+5, 1+9+5+5] = [20, 20]: even
    assert window.add([5.0, 5.0], 100) == 1.0
    # a new window from step 100: it closes at 200 or later, on its own loads only
    assert window.add([30.0, 10.0], 150) is None
    assert window.add([0.0, 0.0], 210) == 1.5  # [30, 10]: max 30 over mean 20


def test_round_robin_and_random() -> None:
    assert round_robin_partition(11, 3).tolist() == [i % 3 for i in range(11)]
    a, b, c = random_partition(100, 8, seed=4), random_partition(100, 8, seed=4), random_partition(100, 8, seed=5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    sizes = torch.bincount(a, minlength=8)
    assert int(sizes.max() - sizes.min()) <= 1


def test_assign_homes_prefers_owner_within_capacity() -> None:
    counts = torch.tensor([[10, 1], [9, 2], [8, 7]])
    assert assign_homes(counts).tolist() == [0, 0, 1]  # view 2 falls back: rank 0 holds ceil(3/2)
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 100, (23, 5), generator=g)
    homes = assign_homes(counts)
    per_rank = torch.bincount(homes, minlength=5)
    assert int(per_rank.max()) <= 5 and int(per_rank.min()) >= 4  # 23 views on 5 ranks: 4 or 5 each
    # a rank that owns nothing any view sees still gets its share of views to render
    skewed = torch.zeros(6, 3, dtype=torch.int64)
    skewed[:, 0] = 10
    assert torch.bincount(assign_homes(skewed), minlength=3).tolist() == [2, 2, 2]
    clear = torch.eye(4, dtype=torch.int64) * 50 + 1
    assert assign_homes(clear).tolist() == [0, 1, 2, 3]


def test_access_profile_chunks_match_whole_projection() -> None:
    g = torch.Generator().manual_seed(2)
    n = 60
    means = torch.randn(n, 3, generator=g) + torch.tensor([0.0, 0.0, 4.0])
    quats = torch.randn(n, 4, generator=g)
    scales = torch.rand(n, 3, generator=g) * 0.2
    viewmats = torch.eye(4).repeat(2, 1, 1)
    viewmats[1, 0, 3] = 1.5  # second camera shifted sideways
    Ks = torch.tensor([[30.0, 0, 16], [0, 30.0, 12], [0, 0, 1]]).repeat(2, 1, 1)
    prof = access_profile(means, quats, scales, viewmats, Ks, [32, 32], [24, 24], chunk=7)
    for v in range(2):
        p = project_gaussians(means, quats, scales, viewmats[v], Ks[v], 32, 24)
        expect = torch.nonzero((p.radii > 0).all(-1)).squeeze(1)
        assert 0 < expect.numel() < n
        assert torch.equal(prof.view(v).long(), expect)
    both = torch.cat([prof.view(0), prof.view(1)]).long()
    assert torch.equal(prof.access_counts(), torch.bincount(both, minlength=n))


def test_comm_model_by_hand() -> None:
    counts = torch.tensor([[3, 1], [0, 5]])  # view 0: 3 on rank 0, 1 on rank 1
    homes = torch.tensor([0, 1])
    m = step_bytes(counts, homes, [0, 1])
    # one remote record (rank 1 -> rank 0): forward 36 B payload + 4 B depth + 8 B radii; back 36 B
    assert m["records_fwd"][0].tolist() == [0, 48] and m["records_fwd"][1].tolist() == [48, 0]
    assert m["records_bwd"][0].tolist() == [36, 0] and m["records_bwd"][1].tolist() == [0, 36]
    assert m["counts"][0].tolist() == [8, 8]  # one int64 count per view rendered elsewhere
    half = step_bytes(counts, homes, [0, 1], compress="fp16")
    # fp16: means2d and conics stay 4 B each (5 x 4), opacity and colour 2 B (4 x 2); gradients 9 x 2
    assert half["records_fwd"][0].tolist() == [0, 40] and half["records_bwd"][0].tolist() == [18, 0]


def test_expected_bytes_average_over_all_batches() -> None:
    g = torch.Generator().manual_seed(3)
    world = 3
    counts = torch.randint(0, 40, (8, world), generator=g)
    homes = assign_homes(counts)
    sent, recv = expected_step_bytes(counts, homes, 1)
    per_rank = [torch.nonzero(homes == r).squeeze(1).tolist() for r in range(world)]
    batches = list(itertools.product(*per_rank))  # each rank renders one of its home views
    steps = [step_bytes(counts, homes, b) for b in batches]
    tot_s = sum(sum(s[op][0] for op in OPS) for s in steps)
    tot_r = sum(sum(s[op][1] for op in OPS) for s in steps)
    torch.testing.assert_close(sent, tot_s.double() / len(batches))
    torch.testing.assert_close(recv, tot_r.double() / len(batches))


def test_locality_keeps_accesses_local_on_a_clustered_scene() -> None:
    means, _ = _clustered()
    # each view sees one cluster's neighbourhood
    centres = means[torch.arange(0, 3000, 250)]
    visible = [torch.nonzero((means - c).norm(dim=1) < 3.0).squeeze(1) for c in centres]
    prof = AccessProfile.from_lists(visible, means.shape[0])
    remote = {}
    for kind in ("locality", "round_robin"):
        owner = make_partition(kind, means, prof.access_counts(), 4)
        counts = view_owner_counts(prof, owner, 4)
        homes = assign_homes(counts)
        remote[kind] = int(counts.sum() - counts[torch.arange(len(visible)), homes].sum())
    assert remote["locality"] < 0.5 * remote["round_robin"]
