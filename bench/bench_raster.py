"""Rasterizer backward benchmark: our atomic modes against gsplat 1.5.3's kernel, in one process.

Workloads from test_garden.npz (real garden SfM points and cameras, 3 views):
  initial  138k Gaussians: opacity 0.1, isotropic kNN scales, random rotations
  dense    ~2.2M: 16 jittered copies of each point, scales / 3, opacity U(0.05, 0.95)
at 1296x840 and 2592x1680 (Ks[:, :2] x2 / x4). Inputs are frozen (projected and intersected once);
each backward call is timed with CUDA events after warm-up, median of the repetitions. Each call
allocates and zeroes its gradient outputs, ours and gsplat's alike.

    python -m bench.bench_raster [--data PATH] [--reps 25]

Prints markdown tables and ratios; writes JSON to $OUT/bench_raster.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.builds import build_all

REPO = Path(__file__).resolve().parents[1]

THRESHOLDS = (1, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32)


def find_data(arg: str | None) -> Path:
    cands = [Path(arg)] if arg else []
    cands += [REPO / ".benchdata" / "test_garden.npz", REPO.parent / "shared" / "data" / "test_garden.npz"]
    for c in cands:
        if c.is_file():
            return c
    sys.exit(f"bench_raster: test_garden.npz not found (tried {', '.join(map(str, cands))})")


def knn_scale(points: torch.Tensor, k: int = 3, chunk: int = 4096) -> torch.Tensor:
    """sqrt of the mean squared distance to the k nearest other points (3DGS's init)."""
    out = torch.empty(points.shape[0], device=points.device)
    for i in range(0, points.shape[0], chunk):
        d = torch.cdist(points[i : i + chunk], points)
        d2 = d.topk(k + 1, largest=False).values[:, 1:] ** 2  # drop the point itself
        out[i : i + chunk] = d2.mean(-1).sqrt()
    return out.clamp_min(1e-7)


def build_workload(name: str, data: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    means = torch.from_numpy(data["means3d"]).float().cuda()
    rgb = torch.from_numpy(data["colors"]).float().cuda() / 255.0
    s = knn_scale(means)
    n = means.shape[0]
    if name == "initial":
        scales = s[:, None].expand(n, 3)
        opac = torch.full((n,), 0.1, device="cuda")
    elif name == "dense":
        copies = 16
        means = means.repeat(copies, 1) + torch.randn(copies * n, 3, generator=gen).cuda() * s.repeat(copies)[:, None]
        rgb = (rgb.repeat(copies, 1) + 0.05 * torch.randn(copies * n, 3, generator=gen).cuda()).clamp(0, 1)
        scales = (s.repeat(copies) / 3.0)[:, None].expand(copies * n, 3)
        opac = 0.05 + 0.9 * torch.rand(copies * n, generator=gen).cuda()
    else:
        raise ValueError(name)
    quats = torch.randn(means.shape[0], 4, generator=gen).cuda()
    return {"means": means, "scales": scales.contiguous(), "quats": quats, "opacities": opac, "colors": rgb}


def time_calls(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, stop in pairs:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in pairs]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown (no commit)"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def bench_case(ext, gsplat_fn, wl: dict, factor: int, data: dict, args, layouts: list[tuple[bool, bool]]) -> dict:
    from gsplat import fully_fused_projection, isect_offset_encode, isect_tiles

    from gstrain.render.cuda import THRESHOLD_NEVER

    width, height = int(data["width"]) * factor, int(data["height"]) * factor
    viewmats = torch.from_numpy(data["viewmats"]).float().cuda()
    Ks = torch.from_numpy(data["Ks"]).float().cuda().clone()
    Ks[:, :2] *= factor
    c = viewmats.shape[0]
    with torch.no_grad():
        radii, means2d, depths, conics, _ = fully_fused_projection(
            wl["means"], None, wl["quats"], wl["scales"], viewmats, Ks, width, height, packed=False
        )
        tw, th = math.ceil(width / 16), math.ceil(height / 16)
        _, isect_ids, flatten_ids = isect_tiles(means2d, radii, depths, 16, tw, th, packed=False, n_images=c)
        offsets = isect_offset_encode(isect_ids, c, tw, th)
    del isect_ids
    n = wl["means"].shape[0]
    colors = wl["colors"][None].expand(c, n, 3).contiguous()
    opac = wl["opacities"][None].expand(c, n).contiguous()
    means2d, conics = means2d.contiguous(), conics.contiguous()
    gen = torch.Generator(device="cuda").manual_seed(1)
    v_image = torch.randn(c, height, width, 3, device="cuda", generator=gen)
    v_alpha = torch.randn(c, height, width, 1, device="cuda", generator=gen)
    common = (means2d, conics, colors, opac, None, width, height, 16, offsets, flatten_ids)

    image, alpha, t_final, last_ids = ext.rasterize_fwd(*common, None)
    g_colors, g_alphas, g_last = gsplat_fn("rasterize_to_pixels_3dgs_fwd")(
        means2d, conics, colors, opac, None, None, width, height, 16, offsets, flatten_ids
    )

    def ours(threshold: int, vector: bool, scatter: bool = True):
        return lambda: ext.rasterize_bwd(
            *common, t_final, last_ids, v_image, v_alpha, False, threshold, vector, scatter, None
        )  # fmt: skip

    def peer():
        return gsplat_fn("rasterize_to_pixels_3dgs_bwd")(
            means2d, conics, colors, opac, None, None, width, height, 16, offsets, flatten_ids,
            g_alphas, g_last, v_image, v_alpha, False,
        )  # fmt: skip

    # the same function as gsplat's kernel (both cap alpha at 0.999; these opacities stay below it)
    ours_g = ours(1, False)()
    peer_g = peer()
    check = {
        "image": rel(image, g_colors),
        "alpha": rel(alpha, g_alphas),
        "means2d": rel(ours_g[0], peer_g[1]),
        "conics": rel(ours_g[1], peer_g[2]),
        "colors": rel(ours_g[2], peer_g[3]),
        "opacities": rel(ours_g[3], peer_g[4]),
    }
    del ours_g, peer_g

    res: dict = {
        "n_gaussians": n,
        "width": width,
        "height": height,
        "views": c,
        "n_isects": int(flatten_ids.numel()),
        "check_vs_gsplat_rel_err": check,
        "layouts": {},
    }
    res["fwd_ms"] = {
        "ours": statistics.median(time_calls(lambda: ext.rasterize_fwd(*common, None), 2, args.reps)),
        "gsplat": statistics.median(
            time_calls(
                lambda: gsplat_fn("rasterize_to_pixels_3dgs_fwd")(
                    means2d, conics, colors, opac, None, None, width, height, 16, offsets, flatten_ids
                ),
                2,
                args.reps,
            )
        ),
    }
    res["gsplat_ms"] = statistics.median(time_calls(peer, 3, args.reps))
    for vector, scatter in layouts:
        key = layout_key(vector, scatter)
        ms: dict[str, float] = {}
        ms["atomic"] = statistics.median(time_calls(ours(THRESHOLD_NEVER, vector), 1, args.atomic_reps))
        ms["warp"] = statistics.median(time_calls(ours(1, vector, scatter), 3, args.reps))
        for t in THRESHOLDS:
            ms[f"T={t}"] = statistics.median(time_calls(ours(t, vector, scatter), 3, args.reps))
        chosen, arc_costs = tune_arc(lambda t, v=vector, r=scatter: ours(t, v, r)())
        ms["arc"] = statistics.median(time_calls(ours(chosen, vector, scatter), 3, args.reps))
        best_t = min(THRESHOLDS, key=lambda t: ms[f"T={t}"])
        res["layouts"][key] = {
            "ms": ms,
            "arc_threshold": chosen,
            "arc_costs": arc_costs,
            "best_fixed_T": best_t,
            "ratios": {
                "atomic_over_arc": ms["atomic"] / ms["arc"],
                "gsplat_over_arc": res["gsplat_ms"] / ms["arc"],
                "arc_over_best_fixed": ms["arc"] / ms[f"T={best_t}"],
                "gsplat_over_warp": res["gsplat_ms"] / ms["warp"],
            },
        }
    if args.cull and layouts:
        res["culled"] = bench_culled(ext, common, radii, depths, v_image, v_alpha, *layouts[0], args.reps)
        res["culled"]["gsplat_over_arc_culled"] = res["gsplat_ms"] / res["culled"]["arc_ms"]
    return res


def tune_arc(call: Callable[[int], object]) -> tuple[int, dict]:
    """ARC as in training: the tuner picks T from timed backward calls (call(T) runs one)."""
    from gstrain.render.arc import DEFAULT_CANDIDATES, ArcTuner

    tuner = ArcTuner(candidates=DEFAULT_CANDIDATES, reps=3)
    for _ in range(tuner.warmup + len(tuner.candidates) * tuner.reps):
        t, probe = tuner.next_call(1.0)
        if probe is not None:
            probe.start()
        call(t)
        if probe is not None:
            probe.stop()
    torch.cuda.synchronize()  # in training, later iterations would find the events done
    if not tuner.poll():
        raise RuntimeError("ARC tuner did not finish its round")
    return tuner.threshold, (tuner.history[-1].costs if tuner.history else {})


def layout_key(vector: bool, scatter: bool) -> str:
    """The results' name of a gradient layout and warp reduction (the scatter one is the default)."""
    return ("vector" if vector else "scalar") + ("" if scatter else "-butterfly")


def bench_culled(ext, common: tuple, radii, depths, v_image, v_alpha, vector: bool, scatter: bool,
                 reps: int) -> dict:  # fmt: skip
    """Our forward and arc backward on the pairs dev.ellipse_cull keeps (our intersection
    kernel), as training runs them; gsplat keeps its own isect_tiles pairs (its pipeline).
    Also the culled backward's largest gradient error against the unculled one (should be ~0)."""
    from gstrain.render.isect import culled_intersection

    means2d, conics, colors, opac, bg, width, height, tile, offsets, flatten_ids = common
    with torch.no_grad():
        kept = culled_intersection(ext, means2d, radii, depths, conics, opac, width, height, tile)
    culled = (means2d, conics, colors, opac, bg, width, height, tile, kept.isect_offsets, kept.flatten_ids)
    fwd_full = ext.rasterize_fwd(*common, None)
    fwd_cull = ext.rasterize_fwd(*culled, None)
    image_err = rel(fwd_cull[0], fwd_full[0])

    def bwd(args: tuple, fwd: tuple, threshold: int):
        return ext.rasterize_bwd(*args, fwd[2], fwd[3], v_image, v_alpha, False, threshold, vector, scatter, None)

    full_g, cull_g = bwd(common, fwd_full, 1), bwd(culled, fwd_cull, 1)
    grad_err = max(rel(a, b) for a, b in zip(cull_g[:4], full_g[:4], strict=True))
    del full_g, cull_g
    chosen, _ = tune_arc(lambda t: bwd(culled, fwd_cull, t))
    return {
        "pairs_before": kept.pairs_before,
        "pairs_after": kept.pairs_after,
        "fwd_ms": statistics.median(time_calls(lambda: ext.rasterize_fwd(*culled, None), 2, reps)),
        "arc_ms": statistics.median(time_calls(lambda: bwd(culled, fwd_cull, chosen), 3, reps)),
        "arc_threshold": chosen,
        "vs_unculled_rel_err": {"image": image_err, "grads": grad_err},
    }


def print_tables(results: dict, layouts: list[str]) -> None:
    for key in layouts:
        print(f"\n### Raster backward, {key} gradient layout (ms, median)\n")
        cols = ["atomic", "warp"] + [f"T={t}" for t in THRESHOLDS] + ["arc"]
        print("| workload | " + " | ".join(cols) + " | gsplat 1.5.3 |")
        print("|---" * (len(cols) + 2) + "|")
        for name, r in results.items():
            lay = r["layouts"][key]
            cells = [f"{lay['ms'][k]:.2f}" for k in cols[:-1]]
            cells.append(f"{lay['ms']['arc']:.2f} (T={lay['arc_threshold']})")
            print(f"| {name} | " + " | ".join(cells) + f" | {r['gsplat_ms']:.2f} |")
        print(f"\n### Ratios, {key} layout\n")
        print("| workload | atomic / arc | gsplat / arc | arc / best fixed T (T) | gsplat / warp |")
        print("|---|---|---|---|---|")
        for name, r in results.items():
            lay = r["layouts"][key]
            q = lay["ratios"]
            print(
                f"| {name} | {q['atomic_over_arc']:.1f}x | {q['gsplat_over_arc']:.3f}x | "
                f"{q['arc_over_best_fixed']:.3f} (T={lay['best_fixed_T']}) | {q['gsplat_over_warp']:.3f}x |"
            )
    culled = {name: r["culled"] for name, r in results.items() if "culled" in r}
    if culled:
        print("\n### Culled pairs (dev.ellipse_cull, first layout): our arc backward vs gsplat on its own pairs\n")
        print("| workload | pairs kept | fwd ms | arc bwd ms (T) | gsplat bwd ms | gsplat / arc culled | rel err |")
        print("|---|---|---|---|---|---|---|")
        for name, c in culled.items():
            err = max(c["vs_unculled_rel_err"].values())
            print(
                f"| {name} | {c['pairs_after']} / {c['pairs_before']} | {c['fwd_ms']:.2f} | {c['arc_ms']:.2f} "
                f"(T={c['arc_threshold']}) | {results[name]['gsplat_ms']:.2f} | "
                f"{c['gsplat_over_arc_culled']:.3f}x | {err:.1e} |"
            )
    print("\n### Forward (ms) and agreement with gsplat (relative L2 error)\n")
    print("| workload | isects | ours fwd | gsplat fwd | max rel err (image, grads) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        err = max(r["check_vs_gsplat_rel_err"].values())
        fwd = r["fwd_ms"]
        print(f"| {name} | {r['n_isects']} | {fwd['ours']:.2f} | {fwd['gsplat']:.2f} | {err:.1e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="test_garden.npz (default: .benchdata/ or ../shared/data/)")
    ap.add_argument("--workloads", default="initial,dense")
    ap.add_argument("--factors", default="2,4", help="resolution factors over 648x420")
    ap.add_argument("--layouts", default="scalar,vector")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--atomic-reps", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reductions", default="scatter",
                    help="warp reductions to time: scatter (the default kernel), butterfly (the former)")
    ap.add_argument("--cull", action="store_true",
                    help="also our arc backward on the ellipse-culled pairs (the training default) vs gsplat's")
    ap.add_argument("--json", default=None, help="output JSON (default: $OUT/bench_raster.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_raster: needs a CUDA GPU")

    import gsplat
    from gsplat.cuda._wrapper import _make_lazy_cuda_func  # gsplat's raw kernels: the peer

    t0 = time.time()
    ext = build_all(["raster"])["raster"]
    data_path = find_data(args.data)
    data = dict(np.load(data_path))
    reductions = [x for x in args.reductions.split(",") if x]
    layouts = [(lay == "vector", red == "scatter") for lay in args.layouts.split(",") if lay for red in reductions]
    keys = [layout_key(*lay) for lay in layouts]
    results: dict = {}
    for wname in args.workloads.split(","):
        gen = torch.Generator().manual_seed(args.seed)
        wl = build_workload(wname, data, gen)
        for f in (int(x) for x in args.factors.split(",")):
            size = f"{int(data['width']) * f}x{int(data['height']) * f}"
            label = f"{wname} {wl['means'].shape[0] / 1e6:.2f}M, {size}"
            results[label] = bench_case(ext, _make_lazy_cuda_func, wl, f, data, args, layouts)
            torch.cuda.empty_cache()
            print(f"bench_raster: {label} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        del wl
        torch.cuda.empty_cache()

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gsplat": gsplat.__version__,
        "commit": git_commit(),
        "command": "python -m bench.bench_raster " + " ".join(sys.argv[1:]),
        "data": str(data_path.name),
        "reps": args.reps,
    }
    print("\n" + " | ".join(f"{k}: {v}" for k, v in meta.items()))
    print_tables(results, keys)
    out = args.json or (os.path.join(os.environ["OUT"], "bench_raster.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
