"""Virtual ranks: the exact bytes the sharded render would move, without W processes.

Input: counts[v, r] = how many Gaussians that view v touches rank r owns (partition.view_owner_counts)
and the view homes. Per step, for the batch views, each rank (as the real render_sharded does):
- `counts`: sends every other rank one record count per batch view that rank renders;
- `records_fwd`: sends each batch view it does not render its visible records (layout.forward_record_bytes);
- `records_bwd`: sends back, for each view it renders, the gradients of the records it received.
Bytes are those that leave a rank for another rank (sends to itself are copies, not counted).

`bound_step_bytes` is the floor under every partition: a view's renderer owns at most as many of
its visible Gaussians as one shard holds, so no partition with shards of at most `max_shard`
Gaussians sends fewer records for it than visible - max_shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from gstrain.distributed.layout import backward_record_bytes, count_bytes, forward_record_bytes

__all__ = ["OPS", "bound_step_bytes", "expected_step_bytes", "per_view_bytes", "remote_lower_bound", "step_bytes"]

OPS = ("counts", "records_fwd", "records_bwd")


def per_view_bytes(
    counts: Tensor, homes: Tensor, dtype: torch.dtype = torch.float32, compress: str = "none"
) -> dict[str, tuple[Tensor, Tensor]]:
    """For each op, (sent [V, W], received [V, W]): bytes each rank sends/receives for one view."""
    n_views, world = counts.shape
    c = counts.to(torch.int64)
    home = torch.zeros(n_views, world, dtype=torch.bool)
    home[torch.arange(n_views), homes] = True
    remote = torch.where(home, 0, c)  # records that cross to the renderer
    remote_in = remote.sum(1, keepdim=True)  # per view, received by its renderer
    fwd, bwd, cb = forward_record_bytes(dtype, compress), backward_record_bytes(dtype, compress), count_bytes()
    at_home = home.long()
    away = 1 - at_home
    return {
        "counts": (away * cb, at_home * (world - 1) * cb),
        "records_fwd": (remote * fwd, at_home * remote_in * fwd),
        "records_bwd": (at_home * remote_in * bwd, remote * bwd),
    }


def step_bytes(
    counts: Tensor, homes: Tensor, batch: Sequence[int], dtype: torch.dtype = torch.float32, compress: str = "none"
) -> dict[str, tuple[Tensor, Tensor]]:
    """For each op, (sent [W], received [W]) bytes per rank for one step over the batch views."""
    idx = torch.as_tensor(list(batch), dtype=torch.int64)
    return {op: (s.index_select(0, idx).sum(0), r.index_select(0, idx).sum(0))
            for op, (s, r) in per_view_bytes(counts, homes, dtype, compress).items()}  # fmt: skip


def expected_step_bytes(
    counts: Tensor, homes: Tensor, views_per_rank: int = 1, dtype: torch.dtype = torch.float32, compress: str = "none"
) -> tuple[Tensor, Tensor]:
    """Expected (sent [W], received [W]) bytes per step, all ops, when every rank renders
    views_per_rank views drawn uniformly from its home views (B = W * views_per_rank).
    A rank without home views renders nothing (it still owns and sends)."""
    n_views, world = counts.shape
    per_home = torch.bincount(homes, minlength=world).clamp_min(1).double()
    weight = views_per_rank / per_home.index_select(0, homes)  # each view's expected draws per step
    sent = torch.zeros(world, dtype=torch.float64)
    recv = torch.zeros(world, dtype=torch.float64)
    for s, r in per_view_bytes(counts, homes, dtype, compress).values():
        sent += (s.double() * weight[:, None]).sum(0)
        recv += (r.double() * weight[:, None]).sum(0)
    return sent, recv


def remote_lower_bound(visible: Tensor, max_shard: int) -> Tensor:
    """[V]: the fewest records any partition with shards of at most max_shard Gaussians can send
    to a view's renderer, given visible [V] (Gaussians each view touches): the renderer owns at
    most min(visible, max_shard) of them, whichever rank it is."""
    return (visible.to(torch.int64) - int(max_shard)).clamp_min(0)


def bound_step_bytes(
    visible: Tensor,
    world: int,
    max_shard: int,
    views_per_rank: int = 1,
    dtype: torch.dtype = torch.float32,
    compress: str = "none",
) -> float:
    """A lower bound on expected_step_bytes' mean over ranks (sent, equal to received), over every
    partition with shards of at most max_shard Gaussians and every home assignment with
    floor(V/W) or ceil(V/W) views per rank (as assign_homes gives).

    Per view drawn: (W-1) counts and remote * (forward + backward record) bytes leave ranks. A
    view on a rank with k home views is drawn views_per_rank/k times a step; the weights least
    favourable to the bound put 1/ceil on the ceil * (V mod W) views of largest bound."""
    n_views = visible.numel()
    floor, extra = divmod(n_views, world)
    ceil = floor + (extra > 0)
    low = remote_lower_bound(visible, max_shard).double().sort(descending=True).values
    n_ceil = ceil * extra if floor else n_views  # views on ranks holding ceil(V/W) of them
    weights = torch.full((n_views,), 1.0 / max(floor, 1), dtype=torch.float64)
    weights[:n_ceil] = 1.0 / ceil
    ranks_rendering = extra + (world - extra if floor else 0)
    per_record = forward_record_bytes(dtype, compress) + backward_record_bytes(dtype, compress)
    total = ranks_rendering * (world - 1) * count_bytes() + float((weights * low).sum()) * per_record
    return views_per_rank * total / world
