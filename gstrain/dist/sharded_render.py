"""Render a batch of views from Gaussians sharded over ranks (one owner per Gaussian).

Every rank calls render_sharded with its own shard and the same batch (cameras and homes):
1. as owner, it projects its Gaussians for every batch view and keeps the visible ones
   (radii > 0), packed as records (layout.py), grouped by the view's renderer (its home);
2. per-view record counts, then the records, go through one uneven all_to_all_single each
   (exchange.py); the backward returns the records' gradients through the reverse exchange;
3. as renderer, it rasterizes each of its views from the records it received.

Order: the received rows come source rank by source rank, each owner's rows by ascending local
index, and `rasterize` sorts them by depth stably. So records of equal depth keep rank-major
order: the result is the single-process render of the shards concatenated in rank order
(exactly, ties included). For a locality partition stored as contiguous Morton ranges that is
the global order; no Gaussian id has to travel with the records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gstrain.dist.exchange import CommCounter, exchange, exchange_counts, rank_and_world
from gstrain.dist.layout import META_DTYPE, N_DIFF
from gstrain.render.common import strategy_info
from gstrain.render.reference import camera_centre, project_gaussians, rasterize
from gstrain.render.sh import num_sh_bases, sh_to_color

__all__ = ["ShardedRender", "ViewBatch", "render_sharded"]


@dataclass
class ViewBatch:
    """The step's B views, identical on every rank (drawn from a shared seed)."""

    viewmats: Tensor  # [B,4,4] world-to-camera
    Ks: Tensor  # [B,3,3]
    widths: Sequence[int]
    heights: Sequence[int]
    homes: Sequence[int]  # renderer rank of each batch view

    def __len__(self) -> int:
        return len(self.homes)


@dataclass
class ShardedRender:
    views: list[int]  # batch indices this rank rendered, ascending
    images: list[Tensor]  # [H,W,3] each
    alphas: list[Tensor]  # [H,W,1] each
    # this rank's Gaussians as owner: means2d [B,n,2] (feeds the exchange, so retain_grad() works),
    # radii [B,n,2], depths [B,n], conics [B,n,3]; n_cameras = B (gsplat's strategy layout)
    owner_info: dict[str, Any]
    # 0, tied to the exchange: add it to the loss so that every rank joins the backward
    # exchange even when its loss does not depend on any record (no views, nothing visible)
    zero_term: Tensor


def _colors_sh(shard: Mapping[str, Tensor], sh_degree: int) -> Tensor:
    nb = num_sh_bases(sh_degree)
    sh = shard["sh0"]
    return torch.cat([sh, shard["shN"][:, : nb - 1]], dim=1) if nb > 1 else sh


def render_sharded(
    shard: Mapping[str, Tensor],
    batch: ViewBatch,
    sh_degree: int,
    background: Tensor | None = None,
    compress: str = "none",
    counter: CommCounter | None = None,
    group: dist.ProcessGroup | None = None,
) -> ShardedRender:
    """Render this rank's batch views (homes == rank) from every rank's shard (CONVENTIONS'
    parameter names and activations, as render_reference). Collective: all ranks call it."""
    rank, world = rank_and_world(group)
    n_batch = len(batch)
    means = shard["means"]
    sh = _colors_sh(shard, sh_degree)
    scales = torch.exp(shard["scales"])
    opac_all = torch.sigmoid(shard["opacities"])

    # ---- owner: project for every batch view, pack visible records by renderer rank
    projs = [
        project_gaussians(means, shard["quats"], scales, batch.viewmats[i].to(means), batch.Ks[i].to(means),
                          int(batch.widths[i]), int(batch.heights[i]))  # fmt: skip
        for i in range(n_batch)
    ]
    n_own = means.shape[0]
    if n_batch:
        means2d = torch.stack([p.means2d for p in projs])
        radii = torch.stack([p.radii for p in projs])
        conics = torch.stack([p.conics for p in projs])
        depths = torch.stack([p.depths for p in projs])
    else:
        means2d, conics, depths = means.new_zeros(0, n_own, 2), means.new_zeros(0, n_own, 3), means.new_zeros(0, n_own)
        radii = torch.zeros(0, n_own, 2, dtype=torch.int32, device=means.device)
    send_order = sorted(range(n_batch), key=lambda i: (int(batch.homes[i]), i))
    order_t = torch.tensor(send_order, dtype=torch.int64, device=means.device)
    # one nonzero over [views in send order, Gaussians]: records view by view, ascending local index
    pos, li = torch.nonzero((radii.index_select(0, order_t) > 0).all(-1), as_tuple=True)
    vi = order_t.index_select(0, pos)
    counts = torch.bincount(pos, minlength=n_batch)
    cams = torch.stack([camera_centre(batch.viewmats[i].to(means)) for i in range(n_batch)]) if n_batch else None
    if li.numel():
        colors = sh_to_color(sh.index_select(0, li), means.index_select(0, li) - cams.index_select(0, vi), sh_degree)
        payload = torch.cat([means2d[vi, li], conics[vi, li], opac_all.index_select(0, li)[:, None], colors], 1)
        depth_bits = depths.detach()[vi, li].float().view(META_DTYPE)
        meta = torch.cat([depth_bits[:, None], radii[vi, li].to(META_DTYPE)], 1)
    else:
        payload = means.new_zeros(0, N_DIFF)
        meta = torch.zeros(0, 3, dtype=META_DTYPE, device=means.device)

    # ---- counts, then records, to the renderers (the uneven split needs the counts on the host)
    views_of = [[i for i in range(n_batch) if int(batch.homes[i]) == r] for r in range(world)]
    mine = views_of[rank]
    per_dest = [len(v) for v in views_of]
    got = exchange_counts(counts, per_dest, [len(mine)] * world, counter, group)
    got = got.view(world, len(mine))  # [source, my view]
    got_host = got.tolist()
    send_splits = [0] * world
    for i, c in zip(send_order, counts.tolist(), strict=True):
        send_splits[int(batch.homes[i])] += c
    recv_splits = [sum(row) for row in got_host]
    recv, recv_meta, _ = exchange(payload, send_splits, recv_splits, meta, compress, counter, group)

    # ---- renderer: regroup rows view by view (source order kept), rasterize
    view_of_row = torch.repeat_interleave(torch.arange(len(mine), device=got.device).repeat(world), got.flatten())
    perm = torch.argsort(view_of_row, stable=True)
    per_view = [sum(col) for col in zip(*got_host, strict=True)] if mine else []
    recs = recv.index_select(0, perm).split(per_view)
    rmeta = recv_meta.index_select(0, perm).split(per_view)
    images, alphas = [], []
    for j, i in enumerate(mine):
        r, m = recs[j], rmeta[j]
        depth = m[:, 0].contiguous().view(torch.float32).to(r.dtype)
        img, alpha = rasterize(r[:, 0:2], r[:, 2:5], r[:, 6:9], r[:, 5], m[:, 1:3], depth,
                               int(batch.widths[i]), int(batch.heights[i]), background)  # fmt: skip
        images.append(img)
        alphas.append(alpha)

    # gsplat's strategies scale gradients by one width/height: batches of one image size
    width = int(batch.widths[0]) if n_batch else 0
    height = int(batch.heights[0]) if n_batch else 0
    info = strategy_info(means2d, radii, depths, conics, width, height)
    info["n_cameras"] = n_batch
    return ShardedRender(views=mine, images=images, alphas=alphas, owner_info=info, zero_term=recv[:0].sum())
