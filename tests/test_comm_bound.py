"""comm_model's floor under every partition, against a brute force over all balanced partitions
and home assignments of a few Gaussians (bytes from expected_step_bytes, which
tests/test_dist_render.py checks against a real exchange)."""

from __future__ import annotations

import itertools

import torch

from gstrain.distributed.comm_model import bound_step_bytes, expected_step_bytes, remote_lower_bound


def _partitions(n: int, world: int, shard: int):
    """Every owner vector of n Gaussians over `world` ranks with at most `shard` per rank."""
    for owner in itertools.product(range(world), repeat=n):
        if max(owner.count(r) for r in range(world)) <= shard:
            yield owner


def _home_choices(n_views: int, world: int):
    """Every homes vector with floor(V/W) or ceil(V/W) views per rank (V mod W ranks get ceil)."""
    floor, extra = divmod(n_views, world)
    for homes in itertools.product(range(world), repeat=n_views):
        sizes = sorted((homes.count(r) for r in range(world)), reverse=True)
        if sizes == [floor + 1] * extra + [floor] * (world - extra):
            yield homes


def _counts(visible: list[set[int]], owner: tuple[int, ...], world: int) -> torch.Tensor:
    return torch.tensor([[sum(owner[i] == r for i in vis) for r in range(world)] for vis in visible])


def _best(visible: list[set[int]], n: int, world: int, shard: int) -> float:
    """The least mean bytes per rank per step over all partitions and home assignments."""
    homes_all = [torch.tensor(h) for h in _home_choices(len(visible), world)]
    best = float("inf")
    for owner in _partitions(n, world, shard):
        counts = _counts(visible, owner, world)
        for homes in homes_all:
            best = min(best, float(expected_step_bytes(counts, homes, 1)[0].mean()))
    return best


def test_per_view_bound_is_the_best_single_view_partition() -> None:
    visible = [set(range(6)), {1, 2}, set(range(8))]
    for world, shard in ((2, 4), (3, 3)):
        low = remote_lower_bound(torch.tensor([len(v) for v in visible]), shard)
        for v, vis in enumerate(visible):
            fewest = min(len(vis) - max(sum(owner[i] == r for i in vis) for r in range(world))
                         for owner in _partitions(8, world, shard))  # fmt: skip
            assert int(low[v]) == fewest


def test_bound_is_reached_when_a_partition_attains_it() -> None:
    # shards {0..3} and {4..7} leave each view exactly max(0, visible - 4) remote records
    visible = [set(range(4)), set(range(4, 8)), set(range(6)), set(range(2, 8))]
    bound = bound_step_bytes(torch.tensor([len(v) for v in visible]), 2, 4)
    best = _best(visible, 8, 2, 4)
    assert bound > 0 and abs(bound - best) < 1e-9


def test_bound_never_exceeds_the_best_partition() -> None:
    g = torch.Generator().manual_seed(1)
    cases = [(8, 2, 5), (8, 2, 4), (6, 3, 2)]  # (Gaussians, ranks, views): V odd, V < W
    for n, world, n_views in cases:
        shard = -(-n // world)
        visible = [set(torch.nonzero(torch.rand(n, generator=g) < 0.7).squeeze(1).tolist()) for _ in range(n_views)]
        visible[0] = set(range(n))  # one view sees everything: its bound is n - shard > 0
        bound = bound_step_bytes(torch.tensor([len(v) for v in visible]), world, shard)
        best = _best(visible, n, world, shard)
        assert 0 < bound <= best + 1e-9, (n, world, n_views)
        # with more views per rank everything scales: the bound stays a bound
        assert bound_step_bytes(torch.tensor([len(v) for v in visible]), world, shard, 3) <= 3 * best + 1e-9
