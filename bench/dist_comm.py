"""Communication study with virtual ranks (issue 16): bytes per step per rank of the sharded
render, for W = 2..128, partitions locality / round_robin / random, with and without fp16.

No process group: the access profile (which Gaussians each view touches) and the partition give
counts[v, r]; gstrain.distributed.comm_model turns them into the exact bytes the real exchange would move
(tests/test_dist_render.py checks the model against the counter of a real gloo exchange).
Per step every rank renders b=1 view drawn from its home views (B = W); bytes scale with b.
Locality runs as gstrain runs it (dist.count_weight 0.5: the cut balances load and count) and
balancing the views' load alone ("locality (load only)", count_weight 0).

Scenes:
  beer    COLMAP scene at full resolution, its SfM points as Gaussians (gstrain's init: kNN scales)
  garden  test_garden.npz's 138k points; it holds only 3 cameras, so 157 more are placed on the ring
          through them (same height and radius around the points' median, looking at it)
  city    generated: >= 10M Gaussians on the walls, roofs and streets of a block city, cameras
          walking the streets at eye height. Visibility is a cheap test, not a projection: centre
          in front, inside the frustum widened by the Gaussian's 3-sigma radius, and nearer than
          --far metres. The far limit stands in for occlusion (projection culls only by frustum,
          so without it every camera down a street would "touch" the whole city behind walls).

The last two columns are floors (comm_model.bound_step_bytes): no partition whose shards hold at
most ceil(N/W) Gaussians (or at most as many as this row's largest shard) sends fewer bytes.

Usage: python -m bench.dist_comm [--scenes beer,garden,city] [--world 2,8] [--city-n 10000000]
                                 [--out bench/results/dist_comm]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.city import city_points, look_at, street_centre
from gstrain.choices import COMPRESSIONS, PARTITIONS
from gstrain.config import DistConfig
from gstrain.distributed.comm_model import bound_step_bytes, expected_step_bytes
from gstrain.distributed.partition import (
    AccessProfile,
    access_profile,
    assign_homes,
    make_partition,
    view_owner_counts,
)
from gstrain.distributed.view_partition import guarded, view_owners

WORLDS = (2, 4, 8, 16, 32, 64, 128)
ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# scenes -> (AccessProfile, means, description)


def _profile_params(means: torch.Tensor, scales: torch.Tensor, viewmats, Ks, widths, heights) -> AccessProfile:
    quats = torch.zeros(means.shape[0], 4)
    quats[:, 0] = 1.0
    return access_profile(means, quats, scales, viewmats, Ks, widths, heights, chunk=1 << 18)


@dataclass
class Cameras:
    """A study scene's Gaussians (isotropic: linear scales [N, 3]) and views."""

    means: torch.Tensor
    scales: torch.Tensor
    viewmats: torch.Tensor  # [V, 4, 4]
    Ks: torch.Tensor  # [V, 3, 3]
    widths: list[int]
    heights: list[int]
    desc: str

    def profile(self) -> AccessProfile:
        return _profile_params(self.means, self.scales, self.viewmats, self.Ks, self.widths, self.heights)


def beer_cameras() -> Cameras:
    from gstrain.data.colmap import load_scene
    from gstrain.model import init_gaussians

    scene = load_scene(DATA / "beer", factor=1, test_every=0)
    views = scene.train
    g = init_gaussians(scene.points, scene.point_colors, sh_degree=0)
    means, scales = g["means"].detach(), torch.exp(g["scales"].detach())
    size = f"{views[0].width}x{views[0].height}"
    desc = f"beer: {means.shape[0]} SfM points as Gaussians (kNN init), {len(views)} views {size}"
    return Cameras(means, scales, torch.stack([v.viewmat for v in views]), torch.stack([v.K for v in views]),
                   [v.width for v in views], [v.height for v in views], desc)  # fmt: skip


def scene_beer() -> tuple[AccessProfile, torch.Tensor, str]:
    cams = beer_cameras()
    return cams.profile(), cams.means, cams.desc


def garden_cameras(n_views: int = 160, dense: int = 1) -> Cameras:
    from gstrain.knn import knn_rms_distance

    d = np.load(DATA / "test_garden.npz")
    pts = torch.from_numpy(d["means3d"]).float()
    vm = d["viewmats"].astype(np.float64)
    w, h = int(d["width"]), int(d["height"])
    centres = np.stack([-m[:3, :3].T @ m[:3, 3] for m in vm])
    up = -vm[:, 1, :3].mean(0)  # camera y points down
    up /= np.linalg.norm(up)
    target = pts.median(0).values.double().numpy()
    rel = centres - target
    height = float((rel @ up).mean())
    radius = float(np.linalg.norm(rel - np.outer(rel @ up, up), axis=1).mean())
    a = np.cross(up, [1.0, 0.0, 0.0]) if abs(up[0]) < 0.9 else np.cross(up, [0.0, 1.0, 0.0])
    a /= np.linalg.norm(a)
    b = np.cross(up, a)
    extra = [look_at(target + up * height + radius * (math.cos(t) * a + math.sin(t) * b), target, up)
             for t in np.linspace(0, 2 * math.pi, n_views - len(vm), endpoint=False)]  # fmt: skip
    viewmats = torch.from_numpy(np.concatenate([vm.astype(np.float32), np.stack(extra)]))
    Ks = torch.from_numpy(d["Ks"][:1]).expand(len(viewmats), 3, 3)
    scales = knn_rms_distance(pts)[:, None].repeat(1, 3)
    means, label = pts, "initial"
    if dense > 1:  # densified stand-in: each point split into `dense` children at half the size
        g = torch.Generator().manual_seed(0)
        means = (pts[:, None] + torch.randn(pts.shape[0], dense, 3, generator=g) * scales[:, None] * 0.5).reshape(-1, 3)
        scales = (scales / 2).repeat_interleave(dense, 0)
        label = f"dense x{dense}"
    desc = f"garden {label}: {means.shape[0]} Gaussians, 3 given + {len(extra)} ring views {w}x{h}"
    return Cameras(means, scales, viewmats, Ks, [w] * len(viewmats), [h] * len(viewmats), desc)


def scene_garden(n_views: int = 160, dense: int = 1) -> tuple[AccessProfile, torch.Tensor, str]:
    cams = garden_cameras(n_views, dense)
    return cams.profile(), cams.means, cams.desc


def scene_city(n: int, n_views: int, far: float, seed: int = 0) -> tuple[AccessProfile, torch.Tensor, str]:
    """Blocks of buildings on a grid; Gaussians on walls, roofs and streets; cameras walk the streets."""
    g = torch.Generator().manual_seed(seed)
    city = city_points(n, g)  # g moves on: the cameras below draw after the points, as they always did
    blocks, pitch, means = city.blocks, city.pitch, city.means
    radius = torch.full((n,), city.sigma * 3.0)  # 3 sigma of a splat covering its share

    # cameras: walk along street centre lines, alternating direction, eye height 1.7 m
    cams = []
    lines = torch.randperm(blocks, generator=g)[: max(1, n_views // 20)]
    per_line = math.ceil(n_views / len(lines))
    for j, line in enumerate(lines.tolist()):
        c = street_centre(line)
        for q in range(per_line):
            a = (q + 0.5) / per_line * blocks * pitch
            horiz = j % 2 == 0
            eye = np.array([a, c, 1.7]) if horiz else np.array([c, a, 1.7])
            fwd = np.array([1.0, 0, 0]) if horiz else np.array([0, 1.0, 0])
            cams.append(look_at(eye, eye + fwd + np.array([0, 0, 0.05]), np.array([0, 0, 1.0])))
    cams = cams[:n_views]
    viewmats = torch.from_numpy(np.stack(cams))
    w, h, f = 1280, 720, 640.0  # 90 degrees horizontal field of view
    tx, ty = w / 2 / f, h / 2 / f

    # visibility per view, in chunks of Gaussians
    visible = []
    for vmat in viewmats:
        rot, tr = vmat[:3, :3], vmat[:3, 3]
        ids = []
        for st in range(0, n, 1 << 21):
            pc = means[st : st + (1 << 21)] @ rot.T + tr
            r = radius[st : st + (1 << 21)]
            zc = pc[:, 2]
            ok = (zc > 0.01) & (pc.norm(dim=1) < far)
            ok &= pc[:, 0].abs() < tx * zc + r * math.hypot(1, tx)
            ok &= pc[:, 1].abs() < ty * zc + r * math.hypot(1, ty)
            ids.append(torch.nonzero(ok).squeeze(1) + st)
        visible.append(torch.cat(ids))
    prof = AccessProfile.from_lists(visible, n)
    desc = (f"city: {n} Gaussians ({blocks}x{blocks} blocks), {len(cams)} street views {w}x{h}, "
            f"frustum + {far:g} m visibility")  # fmt: skip
    return prof, means, desc


# ---------------------------------------------------------------------------------------------


# the partitions as gstrain runs them, plus locality balancing the views' load alone (count_weight 0)
VARIANTS = [(p, p, DistConfig().count_weight) for p in PARTITIONS] + [("locality (load only)", "locality", 0.0)]


def partition_of(kind: str, prof: AccessProfile, means: torch.Tensor, load: torch.Tensor, world: int,
                 count_weight: float) -> torch.Tensor:  # fmt: skip
    """owner [N] as gstrain partitions (views: with its fall-back to locality, as in training)."""
    if kind != "views":
        return make_partition(kind, means, load, world, seed=0, count_weight=count_weight)
    fallback = make_partition("locality", means, load, world, count_weight=count_weight)
    return guarded(view_owners(prof, means, world, fallback), fallback, load, world, DistConfig().max_imbalance)[0]


def study(name: str, prof: AccessProfile, means: torch.Tensor, worlds: tuple[int, ...]) -> list[dict]:
    load = prof.access_counts()
    pairs = int(prof.ids.numel())
    visible = prof.ptr.diff()
    rows = []
    for world in worlds:
        balanced = bound_step_bytes(visible, world, math.ceil(prof.n / world))
        for part, kind, weight in VARIANTS:
            owner = partition_of(kind, prof, means, load, world, weight)
            largest = int(torch.bincount(owner, minlength=world).max())
            counts = view_owner_counts(prof, owner, world)
            homes = assign_homes(counts)
            remote = int(counts.sum()) - int(counts[torch.arange(counts.shape[0]), homes].sum())
            per_rank_load = torch.bincount(owner, weights=load.double(), minlength=world)
            imbalance = float(per_rank_load.max() / per_rank_load.mean().clamp_min(1e-12))
            row = {"scene": name, "world": world, "partition": part, "views": prof.n_views, "pairs": pairs,
                   "remote_fraction": remote / max(pairs, 1),
                   "load_max_over_mean": imbalance, "largest_shard": largest, "n": prof.n,
                   # floors under every partition (fp32): shards of ceil(N/W), or up to this one's largest
                   "bound_bytes_mean_balanced": balanced,
                   "bound_bytes_mean_largest": bound_step_bytes(visible, world, largest)}  # fmt: skip
            for comp in COMPRESSIONS:
                sent, recv = expected_step_bytes(counts, homes, 1, torch.float32, comp)
                row[f"bytes_mean_{comp}"] = float(sent.mean())
                row[f"bytes_max_{comp}"] = float(torch.maximum(sent, recv).max())
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| scene | W | partition | MB/step/rank | fp16 | max rank MB | remote pairs | vs round robin | "
           "bound (N/W shards) / rr | bound (this largest shard) / rr | largest shard / (N/W) |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    rr = {(r["scene"], r["world"]): r["bytes_mean_none"] for r in rows if r["partition"] == "round_robin"}
    for r in rows:
        base = max(rr[(r["scene"], r["world"])], 1e-12)
        out.append(f"| {r['scene']} | {r['world']} | {r['partition']} | {r['bytes_mean_none'] / 1e6:.3f} | "
                   f"{r['bytes_mean_fp16'] / 1e6:.3f} | {r['bytes_max_none'] / 1e6:.3f} | "
                   f"{r['remote_fraction']:.3f} | {r['bytes_mean_none'] / base:.3f} | "
                   f"{r['bound_bytes_mean_balanced'] / base:.3f} | "
                   f"{r['bound_bytes_mean_largest'] / base:.3f} | "
                   f"{r['largest_shard'] * r['world'] / r['n']:.2f} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenes", default="beer,garden,garden_dense,city")
    ap.add_argument("--city-n", type=int, default=10_000_000)
    ap.add_argument("--city-views", type=int, default=240)
    ap.add_argument("--far", type=float, default=120.0)
    ap.add_argument("--world", default=",".join(map(str, WORLDS)), help="rank counts, comma-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "dist_comm")
    args = ap.parse_args()
    worlds = tuple(int(w) for w in args.world.split(","))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out_dir = args.out / (commit or "unknown")
    out_dir.mkdir(parents=True, exist_ok=True)
    makers = {
        "beer": scene_beer,
        "garden": scene_garden,
        "garden_dense": lambda: scene_garden(dense=8),
        "city": lambda: scene_city(args.city_n, args.city_views, args.far),
    }
    for name in args.scenes.split(","):
        t0 = time.perf_counter()
        prof, means, desc = makers[name]()
        log(f"{desc}: profile {prof.ids.numel()} (view, Gaussian) pairs in {time.perf_counter() - t0:.0f} s")
        rows = study(name, prof, means, worlds)
        log(f"{name}: study done in {time.perf_counter() - t0:.0f} s")
        doc = {"scene": name, "description": desc, "commit": commit, "command": " ".join(sys.argv),
               "views_per_rank": 1, "rows": rows}  # fmt: skip
        (out_dir / f"{name}.json").write_text(json.dumps(doc, indent=1))
        print(f"\n{desc}\n\n{table(rows)}\n", flush=True)


if __name__ == "__main__":
    main()
