"""dist.partition=views against locality, virtual: bytes and balance, with and without the
regroupings, and before its balance guard (gstrain/distributed/view_partition.py; this study came first).

    1. views split into W equal groups by recursive bisection of their centroids (the mean
       position of the Gaussians each view touches), along the longest axis;
    2. each Gaussian to the group with the most of its touching views (untouched ones: the
       locality partition's owner);
    3. groups = gstrain's homes (assign_homes) under that partition; back to 2, `--iters` times.

The rows here are before the guard (dist.max_imbalance: training falls back to locality beyond
1.5x the mean load or count). Bytes from gstrain.distributed.comm_model, one view per rank per step.

    OMP_NUM_THREADS=2 python -m bench.dist_views [--scenes garden,city] [--world 2,8] [--iters 3]
"""

from __future__ import annotations

import argparse

import torch

from bench.dist_comm import scene_city, scene_garden
from gstrain.config import DistConfig
from gstrain.distributed.comm_model import expected_step_bytes
from gstrain.distributed.partition import AccessProfile, assign_homes, make_partition, view_owner_counts
from gstrain.distributed.view_partition import view_owners


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
                "view clusters, no regrouping": _row(prof, view_owners(prof, means, world, locality, regroupings=0),
                                                     load, world),  # fmt: skip
                f"view clusters, {args.iters} regroupings": _row(
                    prof, view_owners(prof, means, world, locality, regroupings=args.iters), load, world),
            }
            rr = rows["round robin"][0]
            for part, (sent, lmax, cmax) in rows.items():
                print(f"| {name} | {world} | {part} | {sent / 1e6:.3f} | {sent / rr:.3f} | {lmax:.2f} | {cmax:.2f} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
