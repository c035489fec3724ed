"""Would splitting images instead of Gaussians meet issue 16's communication target? A virtual study.

gstrain's sharded render sends each view's visible records to ONE renderer (the view's home
rank). On beer and garden every view sees most of the scene, so most of what it sees is remote
under any partition of the Gaussians (bench/dist_comm.py: the floor is 0.99x / 0.88x of round
robin at W=8). The alternative measured here, a design that is NOT built: every rank renders
part of every view. Each 16x16 tile of a view goes to the rank owning most of the tile's
(Gaussian, tile) pairs; an owner sends a record to every other rank whose tiles its Gaussian's
rectangle touches. The Gaussians keep the locality partition (dist.partition=locality, W ranks).

Per scene and W it prints, over all views, records sent per view (as a fraction of round robin
under today's design, the target's baseline), the pixel halo the SSIM window would need between
ranks' tiles (5 px each side, 3 channels, image forward + gradient back, in record-equivalents of
84 B), and how unevenly the tiles' pairs fall on the ranks (max / mean per view, median over views).
Projections are the reference renderer's (gstrain.render.projection), with CONVENTIONS' tile rule.

    OMP_NUM_THREADS=2 python -m bench.dist_tiles [--scenes beer,garden,garden_dense] [--world 2,8]

garden_dense is bench/dist_comm.py's stand-in for a densified garden (each point split into 8
children at half the size, 1.1 M Gaussians).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from bench.dist_comm import Cameras, beer_cameras, garden_cameras
from gstrain.config import DistConfig
from gstrain.distributed.partition import assign_homes, make_partition, view_owner_counts
from gstrain.render.projection import project_gaussians

TILE = 16
RECORD_BYTES = 48 + 36  # forward record + its gradient (gstrain.distributed.layout, float32)
HALO_BYTES_PER_PX = 5 * 3 * 4 * 2  # 5 px deep, 3 channels, float32, image forward + gradient back


def _rect_sums(table: torch.Tensor, x0: torch.Tensor, x1: torch.Tensor, y0: torch.Tensor, y1: torch.Tensor):
    """Sum of table[..., y0:y1, x0:x1] per rectangle, from a 2D prefix sum over the last two dims."""
    s = torch.nn.functional.pad(table.cumsum(-1).cumsum(-2), (1, 0, 1, 0))
    return s[..., y1, x1] - s[..., y0, x1] - s[..., y1, x0] + s[..., y0, x0]


def view_tiles(cams: Cameras, v: int, owner: torch.Tensor, world: int) -> dict[str, float]:
    w, h = cams.widths[v], cams.heights[v]
    tw, th = math.ceil(w / TILE), math.ceil(h / TILE)
    quats = torch.zeros(cams.means.shape[0], 4)
    quats[:, 0] = 1.0
    p = project_gaussians(cams.means, quats, cams.scales, cams.viewmats[v], cams.Ks[v], w, h)
    ids = torch.nonzero((p.radii > 0).all(-1)).squeeze(1)
    m, r = p.means2d[ids].double(), p.radii[ids].double()
    x0 = torch.floor((m[:, 0] - r[:, 0]) / TILE).clamp(0, tw).long()
    x1 = torch.ceil((m[:, 0] + r[:, 0]) / TILE).clamp(0, tw).long()
    y0 = torch.floor((m[:, 1] - r[:, 1]) / TILE).clamp(0, th).long()
    y1 = torch.ceil((m[:, 1] + r[:, 1]) / TILE).clamp(0, th).long()
    keep = (x1 > x0) & (y1 > y0)
    ids, x0, x1, y0, y1 = ids[keep], x0[keep], x1[keep], y0[keep], y1[keep]
    own = owner[ids]
    # pairs per (rank, tile) from a 2D difference array per rank
    diff = torch.zeros(world, th + 1, tw + 1, dtype=torch.float64)
    for dy, dx, sign in ((y0, x0, 1.0), (y0, x1, -1.0), (y1, x0, -1.0), (y1, x1, 1.0)):
        diff.index_put_((own, dy, dx), torch.full((own.numel(),), sign, dtype=torch.float64), accumulate=True)
    pairs = diff.cumsum(1).cumsum(2)[:, :th, :tw]  # [W, th, tw]
    busy = pairs.sum(0) > 0
    renderer = pairs.argmax(0)  # each tile to the rank owning most of its pairs
    # records: one per (Gaussian, other rank) whose tiles the Gaussian's rectangle touches
    sent = torch.zeros(ids.numel(), dtype=torch.float64)
    for rank in range(world):
        mine = ((renderer == rank) & busy).double()
        touches = _rect_sums(mine, x0, x1, y0, y1) > 0
        sent += (touches & (own != rank)).double()
    # SSIM halo: tile edges between busy tiles of different renderers
    edges = ((renderer[:, 1:] != renderer[:, :-1]) & busy[:, 1:] & busy[:, :-1]).sum()
    edges += ((renderer[1:, :] != renderer[:-1, :]) & busy[1:, :] & busy[:-1, :]).sum()
    halo_px = 2 * int(edges) * TILE  # both sides of each edge
    work = torch.stack([pairs.sum(0)[renderer == k].sum() for k in range(world)])
    return {"visible": float(ids.numel()), "records": float(sent.sum()),
            "halo_records": halo_px * HALO_BYTES_PER_PX / RECORD_BYTES,
            "work_max_over_mean": float(work.max() / work.mean().clamp_min(1e-12))}  # fmt: skip


def study(cams: Cameras, world: int) -> dict[str, float]:
    prof = cams.profile()
    load = prof.access_counts()
    rows = {}
    for kind in ("round_robin", "locality"):
        owner = make_partition(kind, cams.means, load, world, seed=0, count_weight=DistConfig().count_weight)
        counts = view_owner_counts(prof, owner, world)
        homes = assign_homes(counts)
        remote = counts.sum() - counts[torch.arange(counts.shape[0]), homes].sum()
        rows[f"{kind}_home"] = float(remote) / prof.n_views  # today's design: records per view
        if kind == "locality":
            per_view = [view_tiles(cams, v, owner, world) for v in range(prof.n_views)]
            rows["tiles_records"] = statistics.fmean(t["records"] for t in per_view)
            rows["tiles_halo"] = statistics.fmean(t["halo_records"] for t in per_view)
            rows["tiles_work"] = statistics.median(t["work_max_over_mean"] for t in per_view)
            rows["visible"] = statistics.fmean(t["visible"] for t in per_view)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", default="beer,garden")
    ap.add_argument("--world", default="2,8")
    args = ap.parse_args()
    makers = {"beer": beer_cameras, "garden": garden_cameras, "garden_dense": lambda: garden_cameras(dense=8)}
    print("| scene | W | visible / view | round robin, home renders | locality, home renders | "
          "locality, tile split | + SSIM halo | tile split work max/mean |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.scenes.split(","):
        cams = makers[name]()
        for world in (int(x) for x in args.world.split(",")):
            r = study(cams, world)
            rr = r["round_robin_home"]
            print(f"| {name} | {world} | {r['visible']:.0f} | {rr:.0f} (1.000) | {r['locality_home']:.0f} "
                  f"({r['locality_home'] / rr:.3f}) | {r['tiles_records']:.0f} ({r['tiles_records'] / rr:.3f}) | "
                  f"{(r['tiles_records'] + r['tiles_halo']) / rr:.3f} | {r['tiles_work']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
