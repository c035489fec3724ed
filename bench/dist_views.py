"""A partition from the views' side (virtual study, not in gstrain): group the training views, give
each Gaussian to the group whose views touch it most, regroup the views by where their Gaussians
now live, repeat. Against dist.partition=locality (Morton ranges cut for equal load and count).

    1. views split into W equal groups by recursive bisection of their centroids (the mean
       position of the Gaussians each view touches), along the longest axis;
    2. each Gaussian to the group with the most of its touching views (untouched ones: the
       locality partition's owner);
    3. groups = gstrain's homes (assign_homes) under that partition; back to 2, `--iters` times.

No balance control beyond what the views' grouping gives (reported as max / mean of the ranks'
load and Gaussian count). Bytes from gstrain.dist.comm_model, one view per rank per step.

    OMP_NUM_THREADS=2 python -m bench.dist_views [--scenes garden,city] [--world 2,8] [--iters 3]
"""

from __future__ import annotations

import argparse

import torch

from bench.dist_comm import scene_city, scene_garden
from gstrain.config import DistConfig
from gstrain.dist.comm_model import expected_step_bytes
from gstrain.dist.partition import AccessProfile, assign_homes, make_partition, view_owner_counts


def _bisect(points: torch.Tensor, ids: torch.Tensor, parts: int) -> list[torch.Tensor]:
    if parts == 1:
        return [ids]
    p = points.index_select(0, ids)
    axis = int((p.max(0).values - p.min(0).values).argmax())
    order = ids[torch.argsort(p[:, axis], stable=True)]
    half = len(order) * (parts // 2) // parts
    return _bisect(points, order[:half], parts // 2) + _bisect(points, order[half:], parts - parts // 2)


def view_groups(prof: AccessProfile, means: torch.Tensor, world: int) -> torch.Tensor:
    """[V] group of each view: equal-size groups by recursive bisection of the views' centroids."""
    vid, ids = prof.view_of_entries(), prof.ids.long()
    seen = prof.ptr.diff().clamp_min(1)[:, None].to(means.dtype)
    centres = torch.zeros(prof.n_views, 3, dtype=means.dtype).index_add_(0, vid, means.index_select(0, ids)) / seen
    groups = torch.empty(prof.n_views, dtype=torch.int64)
    for r, members in enumerate(_bisect(centres, torch.arange(prof.n_views), world)):
        groups[members] = r
    return groups


def view_cluster_partition(prof: AccessProfile, means: torch.Tensor, world: int, iters: int,
                           fallback: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """owner [N]: each Gaussian to the view group touching it most (untouched: fallback[g])."""
    vid, ids = prof.view_of_entries(), prof.ids.long()
    groups = view_groups(prof, means, world)
    owner = fallback
    for it in range(iters + 1):
        if it > 0:
            groups = assign_homes(view_owner_counts(prof, owner, world))
        votes = torch.bincount(ids * world + groups.index_select(0, vid), minlength=prof.n * world)
        votes = votes.view(prof.n, world)
        owner = torch.where(votes.sum(1) > 0, votes.argmax(1), fallback)
    return owner


def _row(prof: AccessProfile, owner: torch.Tensor, load: torch.Tensor, world: int) -> tuple[float, float, float]:
    counts = view_owner_counts(prof, owner, world)
    sent, _ = expected_step_bytes(counts, assign_homes(counts), 1, torch.float32, "none")
    per_load = torch.bincount(owner, weights=load.double(), minlength=world)
    per_count = torch.bincount(owner, minlength=world).double()
    return float(sent.mean()), float(per_load.max() / per_load.mean()), float(per_count.max() / per_count.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", default="garden,city")
    ap.add_argument("--world", default="2,8")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    makers = {"garden": scene_garden, "city": lambda: scene_city(10_000_000, 240, 120.0)}
    print("| scene | W | partition | MB/step/rank | vs round robin | load max/mean | Gaussians max/mean |")
    print("|---|---|---|---|---|---|---|")
    for name in args.scenes.split(","):
        prof, means, _ = makers[name]()
        load = prof.access_counts()
        for world in (int(x) for x in args.world.split(",")):
            locality = make_partition("locality", means, load, world, count_weight=DistConfig().count_weight)
            rows = {
                "round robin": _row(prof, make_partition("round_robin", means, load, world), load, world),
                "locality": _row(prof, locality, load, world),
                "view clusters, no regrouping": _row(prof, view_cluster_partition(prof, means, world, 0, locality),
                                                     load, world),  # fmt: skip
                f"view clusters, {args.iters} regroupings": _row(
                    prof, view_cluster_partition(prof, means, world, args.iters, locality), load, world),
            }
            rr = rows["round robin"][0]
            for part, (sent, lmax, cmax) in rows.items():
                print(f"| {name} | {world} | {part} | {sent / 1e6:.3f} | {sent / rr:.3f} | {lmax:.2f} | {cmax:.2f} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
