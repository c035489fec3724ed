"""Render a batch of views from Gaussians sharded over ranks (one owner per Gaussian).

Every rank calls render_sharded with its own shard and the same batch (cameras and homes):
1. as owner, it projects its Gaussians for every batch view and keeps the visible ones
   (radii > 0), packed as records (layout.py), grouped by the view's renderer (its home);
2. per-view record counts, then the records, go through one uneven all_to_all_single each
   (exchange.py); the backward returns the records' gradients through the reverse exchange;
3. as renderer, it rasterizes each of its views from the records it received.
One rank on a GPU (W=1) skips 1-2: nothing crosses a shard, so its views rasterize the projection
directly, as render_cuda does.

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

from gstrain.distributed.exchange import CommCounter, exchange, exchange_counts, rank_and_world
from gstrain.distributed.layout import META_DTYPE, N_DIFF
from gstrain.render import CUDA_BACKENDS
from gstrain.render.common import DEFAULT_OPTIONS, RasterOptions, strategy_info, sum_pairs
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
    owner_records: int = 0  # records this rank's Gaussians sent (its load this step; host int)
    # (Gaussian, tile) pairs of this rank's views before and after the ellipse cull, and views
    # (host ints; None from the reference rasterizer)
    pairs: tuple[int, int, int] | None = None


def _colors_sh(shard: Mapping[str, Tensor], sh_degree: int) -> Tensor:
    nb = num_sh_bases(sh_degree)
    sh = shard["sh0"]
    return torch.cat([sh, shard["shN"][:, : nb - 1]], dim=1) if nb > 1 else sh


def _project(shard: Mapping[str, Tensor], batch: ViewBatch, scales: Tensor, on_gpu: bool,
             antialiased: bool = False) -> tuple[Tensor, ...]:  # fmt: skip
    """means2d [B,n,2], radii [B,n,2] int32, conics [B,n,3], depths [B,n] of this shard in every
    batch view: gsplat's projection on a CUDA backend (as render_cuda), else the reference's. With
    antialiased (RasterOptions.antialiased) also the opacity compensations [B,n]."""
    means, n_batch = shard["means"], len(batch)
    if not n_batch:
        n = means.shape[0]
        radii = torch.zeros(0, n, 2, dtype=torch.int32, device=means.device)
        empty = (means.new_zeros(0, n, 2), radii, means.new_zeros(0, n, 3), means.new_zeros(0, n))
        return empty + ((means.new_zeros(0, n),) if antialiased else ())
    if on_gpu:
        from gsplat import fully_fused_projection

        outs = [
            fully_fused_projection(means, None, shard["quats"], scales, batch.viewmats[i : i + 1].to(means),
                                   batch.Ks[i : i + 1].to(means), int(batch.widths[i]), int(batch.heights[i]),
                                   eps2d=0.3, near_plane=0.01, packed=False,
                                   calc_compensations=antialiased)  # fmt: skip
            for i in range(n_batch)
        ]
        radii, means2d, depths, conics, *comp = (torch.cat([o[k] for o in outs]) if n_batch > 1 else outs[0][k]
                                                 for k in range(5 if antialiased else 4))  # fmt: skip
        return (means2d, radii, conics, depths, *comp)
    projs = [
        project_gaussians(means, shard["quats"], scales, batch.viewmats[i].to(means), batch.Ks[i].to(means),
                          int(batch.widths[i]), int(batch.heights[i]), antialiased=antialiased)  # fmt: skip
        for i in range(n_batch)
    ]
    fields = ("means2d", "radii", "conics", "depths") + (("compensations",) if antialiased else ())
    return tuple(torch.stack([getattr(p, f) for p in projs]) for f in fields)


def _colors(sh: Tensor, dirs: Tensor, sh_degree: int, on_gpu: bool) -> Tensor:
    """max(SH(dirs) + 0.5, 0) of the records: gsplat's SH on a CUDA backend, else the reference's."""
    if on_gpu and sh.numel():
        from gsplat import spherical_harmonics

        return torch.clamp_min(spherical_harmonics(sh_degree, dirs, sh) + 0.5, 0.0)
    return sh_to_color(sh, dirs, sh_degree)


def _rasterize_view(rec: Tensor, meta: Tensor, width: int, height: int, background: Tensor | None,
                    backend: str, options: RasterOptions) -> tuple[Tensor, Tensor, tuple[int, int] | None]:
    """One view from its received records: our CUDA kernels (or gsplat's rasterizer) after gsplat's
    tile intersection on a CUDA backend, else the reference rasterizer. image [H,W,3], alpha [H,W,1],
    the intersection's pairs (before, after the cull; None on the reference)."""
    depth = meta[:, 0].contiguous().view(torch.float32).to(rec.dtype)
    means2d, conics, opac, colors = rec[:, 0:2], rec[:, 2:5], rec[:, 5], rec[:, 6:9]
    radii = meta[:, 1:3]
    if backend not in CUDA_BACKENDS:
        return (*rasterize(means2d, conics, colors, opac, radii, depth, width, height, background), None)
    from gstrain.render.cuda import intersect_splats, rasterize_splats

    one = [t.contiguous()[None] for t in (means2d, conics, opac, radii, depth, colors)]
    splats = intersect_splats(*one[:5], width, height, options.ellipse_cull)
    image, alpha = rasterize_splats(splats, one[5], background, options)
    return image[0], alpha[0], splats.pairs


def _compact(mask: Tensor, total: int) -> Tensor:
    """Flat positions of the True entries of `mask`, ascending, as torch.nonzero gives them, but
    without its host sync (it must learn its size; the caller knows it already: `total`)."""
    flat = mask.reshape(-1)
    slot = torch.where(flat, torch.cumsum(flat, 0) - 1, total)  # misses go to a spill slot at the end
    out = torch.empty(total + 1, dtype=torch.int64, device=flat.device)
    out.scatter_(0, slot, torch.arange(flat.numel(), device=flat.device))
    return out[:total]


def _render_alone(shard: Mapping[str, Tensor], batch: ViewBatch, sh_degree: int, projected: tuple[Tensor, ...],
                  opacities: Tensor, background: Tensor | None, options: RasterOptions) -> ShardedRender:
    """One rank owns everything (W=1 on a GPU): nothing crosses a shard, so nothing is packed or
    exchanged; each view rasterizes the owner's projection directly (what render_cuda does)."""
    from gstrain.render.cuda import intersect_splats, rasterize_splats, splat_colors

    means2d, radii, conics, depths = projected
    images, alphas, pairs = [], [], []
    for i in range(len(batch)):
        view = slice(i, i + 1)  # slices of the [B, N, ...] tensors the strategy reads
        w, h = int(batch.widths[i]), int(batch.heights[i])
        opac = opacities[None] if opacities.dim() == 1 else opacities[view]  # [N], or per view [B,N]
        splats = intersect_splats(means2d[view], conics[view], opac, radii[view], depths[view], w, h,
                                  options.ellipse_cull)  # fmt: skip
        colors = splat_colors(shard, batch.viewmats[i], sh_degree, radii[view], fused=options.fused_sh)
        image, alpha = rasterize_splats(splats, colors, background, options)
        images.append(image[0])
        alphas.append(alpha[0])
        pairs.append(splats.pairs)
    info = strategy_info(means2d, radii, depths, conics, int(batch.widths[0]), int(batch.heights[0]))
    info["n_cameras"] = len(batch)
    return ShardedRender(list(range(len(batch))), images, alphas, info, means2d.new_zeros(()),
                         pairs=sum_pairs(pairs))  # fmt: skip


def render_sharded(
    shard: Mapping[str, Tensor],
    batch: ViewBatch,
    sh_degree: int,
    background: Tensor | None = None,
    compress: str = "none",
    counter: CommCounter | None = None,
    group: dist.ProcessGroup | None = None,
    backend: str = "reference",
    options: RasterOptions = DEFAULT_OPTIONS,
) -> ShardedRender:
    """Render this rank's batch views (homes == rank) from every rank's shard (CONVENTIONS'
    parameter names and activations, as render_reference). Collective: all ranks call it.

    backend: reference (PyTorch, any device) or, on a GPU, cuda / gsplat (config's render.backend
    after auto): owners project with gsplat, renderers rasterize as render_cuda does with `options`.
    """
    rank, world = rank_and_world(group)
    n_batch = len(batch)
    on_gpu = backend in CUDA_BACKENDS
    means = shard["means"]
    scales = torch.exp(shard["scales"])
    opac_all = torch.sigmoid(shard["opacities"])

    # ---- owner: project for every batch view, pack visible records by renderer rank
    means2d, radii, conics, depths, *comp = _project(shard, batch, scales, on_gpu, options.antialiased)
    # antialiased: the opacities differ per view, [B, n]; else one per Gaussian, [n]
    opac = opac_all[None] * comp[0] if comp else opac_all
    if world == 1 and on_gpu and n_batch:
        return _render_alone(shard, batch, sh_degree, (means2d, radii, conics, depths), opac, background, options)
    sh = _colors_sh(shard, sh_degree)
    send_order = sorted(range(n_batch), key=lambda i: (int(batch.homes[i]), i))
    # a pageable host tensor copied without non_blocking would wait for the GPU's queue
    order_t = torch.tensor(send_order, dtype=torch.int64).to(means.device, non_blocking=True)
    n_own = means.shape[0]
    visible = (radii > 0).all(-1).index_select(0, order_t)  # [views in send order, Gaussians]
    counts = visible.sum(1)

    # ---- counts to the renderers (the uneven split needs them on the host: the one sync here)
    views_of = [[i for i in range(n_batch) if int(batch.homes[i]) == r] for r in range(world)]
    mine = views_of[rank]
    per_dest = [len(v) for v in views_of]
    got = exchange_counts(counts, per_dest, [len(mine)] * world, counter, group)
    host = torch.cat([counts, got.flatten().to(counts)]).tolist()
    counts_host, got_flat = host[:n_batch], host[n_batch:]
    got_host = [got_flat[s * len(mine) : (s + 1) * len(mine)] for s in range(world)]  # [source][my view]
    total = sum(counts_host)

    # ---- owner: pack the visible records, view by view (send order), ascending local index
    flat = _compact(visible, total)
    li = flat % max(n_own, 1)
    vi = order_t.index_select(0, flat // max(n_own, 1))
    if total:
        rows = vi * n_own + li  # index_select, not [vi, li]: its backward is an index_add, no sort
        cams = torch.stack([camera_centre(batch.viewmats[i].to(means)) for i in range(n_batch)])
        dirs = means.index_select(0, li) - cams.index_select(0, vi)
        colors = _colors(sh.index_select(0, li), dirs, sh_degree, on_gpu)
        projected = torch.cat([means2d, conics], -1).reshape(-1, 5).index_select(0, rows)
        opac_rows = opac.reshape(-1).index_select(0, rows) if comp else opac_all.index_select(0, li)
        payload = torch.cat([projected, opac_rows[:, None], colors], 1)
        depth_bits = depths.detach().reshape(-1).index_select(0, rows).float().view(META_DTYPE)
        meta = torch.cat([depth_bits[:, None], radii.reshape(-1, 2).index_select(0, rows).to(META_DTYPE)], 1)
    else:
        payload = means.new_zeros(0, N_DIFF)
        meta = torch.zeros(0, 3, dtype=META_DTYPE, device=means.device)
    send_splits = [0] * world
    for i, c in zip(send_order, counts_host, strict=True):
        send_splits[int(batch.homes[i])] += c
    recv_splits = [sum(row) for row in got_host]
    recv, recv_meta, _ = exchange(payload, send_splits, recv_splits, meta, compress, counter, group)

    # ---- renderer: regroup rows view by view (source order kept), rasterize
    per_view = [sum(col) for col in zip(*got_host, strict=True)] if mine else []
    if world > 1 and len(mine) > 1:  # rows come source by source: interleaved views
        sizes = torch.tensor(got_flat, dtype=torch.int64).to(recv.device, non_blocking=True)
        view_ids = torch.arange(len(mine), device=recv.device).repeat(world)
        view_of_row = torch.repeat_interleave(view_ids, sizes, output_size=sum(recv_splits))
        perm = torch.argsort(view_of_row, stable=True)
        recv, recv_meta = recv.index_select(0, perm), recv_meta.index_select(0, perm)
    recs = recv.split(per_view)
    rmeta = recv_meta.split(per_view)
    images, alphas, pairs = [], [], []
    for j, i in enumerate(mine):
        img, alpha, view_pairs = _rasterize_view(recs[j], rmeta[j], int(batch.widths[i]), int(batch.heights[i]),
                                                 background, backend, options)  # fmt: skip
        images.append(img)
        alphas.append(alpha)
        pairs.append(view_pairs)

    # gsplat's strategies scale gradients by one width/height: batches of one image size
    width = int(batch.widths[0]) if n_batch else 0
    height = int(batch.heights[0]) if n_batch else 0
    info = strategy_info(means2d, radii, depths, conics, width, height)
    info["n_cameras"] = n_batch
    return ShardedRender(views=mine, images=images, alphas=alphas, owner_info=info, zero_term=recv[:0].sum(),
                         owner_records=total, pairs=sum_pairs(pairs))  # fmt: skip
