"""Partition again during training by moving only the Gaussians whose owner changes.

Every rank profiles its own Gaussians (which training views touch them), the ranks share each
Gaussian's mean and load (20 bytes a Gaussian, not its whole state), and every rank computes the
same new partition from them (plan_order). Each rank then sends the rows it no longer owns,
with their Adam moments and strategy statistics, straight to their new owners (one uneven
all_to_all_single of serialized row groups): no rank ever holds more than its old and new shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gstrain.distributed.exchange import exchange_objects
from gstrain.distributed.partition import make_partition, morton_codes, shard_indices
from gstrain.train.shards import merge_shards, select_rows

__all__ = ["move_rows", "owners_of", "plan_from_owner", "plan_order"]


def plan_order(kind: str, means: Tensor, load: Tensor, world: int, seed: int, count_weight: float
               ) -> tuple[Tensor, list[int]]:  # fmt: skip
    """(order, rows per rank): the new global row order, rank by rank, as old global positions.

    A locality partition's shards come out in Morton order (contiguous ranges, so that the
    sharded render's rank-major record order is the global one); the others keep index order.
    The same inputs give the same plan on every rank (host tensors, deterministic ops)."""
    base = torch.arange(means.shape[0])
    if kind == "locality" and world > 1:
        base = torch.argsort(morton_codes(means), stable=True)
    owner = make_partition(kind, means.index_select(0, base), load.index_select(0, base), world, seed, count_weight)
    order, rows = plan_from_owner(owner, world)
    return base[order], rows


def plan_from_owner(owner: Tensor, world: int) -> tuple[Tensor, list[int]]:
    """(order, rows per rank) of a partition given as owner [N]: each rank's rows in index order."""
    shards = shard_indices(owner, world)
    return torch.cat(shards), [len(s) for s in shards]


def owners_of(order: Tensor, rows: list[int]) -> Tensor:
    """[N] the new owner of every old global position under the plan (order, rows)."""
    owner = torch.empty_like(order)
    owner[order] = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows, dtype=torch.int64))
    return owner


def move_rows(state: dict[str, Any], order: Tensor, rows: list[int], sizes: list[int], rank: int,
              device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, Any]:  # fmt: skip
    """This rank's new shard: `state` holds its current rows (global positions offset..offset+n,
    offsets from `sizes`, the rows every rank holds now); the new plan is (order, rows). Rows
    travel to their new owners in new-position order; the result is in the new order."""
    world = len(rows)
    new_pos = torch.empty_like(order)
    new_pos[order] = torch.arange(order.numel())
    starts = torch.tensor([0, *rows]).cumsum(0)
    offset = sum(sizes[:rank])
    mine = torch.arange(offset, offset + sizes[rank])
    pos = new_pos.index_select(0, mine)
    dest = torch.searchsorted(starts[1:], pos, right=True)
    parts = []
    for r in range(world):
        local = torch.nonzero(dest == r).squeeze(1)
        parts.append(select_rows(state, local[torch.argsort(pos.index_select(0, local))]))
    received = exchange_objects(parts, device, group)
    merged = merge_shards(received)  # source by source, each in new-position order
    segment = order[int(starts[rank]) : int(starts[rank + 1])]  # old global positions, new order
    source = torch.searchsorted(torch.tensor(sizes).cumsum(0), segment, right=True)
    by_source = torch.argsort(source, stable=True)  # merged row k sits at new position by_source[k]
    return select_rows(merged, torch.argsort(by_source))
