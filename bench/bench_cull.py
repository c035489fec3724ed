"""dev.ellipse_cull: pairs and phase times with no cull, the PyTorch cull and the kernel cull.

Workloads (gstrain.profile.load_workload, the same Gaussians as `gstrain profile`):
  beer     the COLMAP scene's SfM points as the trainer initialises them (--beer, factor 1)
  garden   test_garden.npz's points, initialised the same way, at --garden-scale (4: 2592x1680)
  dense    garden's ~2.2M-Gaussian workload of bench/bench_raster.py (16 jittered copies per point,
           scales / 3, opacity U(0.05, 0.95), random rotations), same cameras
  any trained run or scene passed with --target (its last checkpoint: the real, elongated shapes)

Settings (gstrain.render.cuda.project_splats):
  off      gsplat's projection, isect_tiles and isect_offset_encode
  PyTorch  the same, then gstrain/render/cull.py:cull_pairs on the sorted pair list
  kernel   gsplat's projection, then our culled intersection (csrc/isect.cu via
           gstrain/render/isect.py): culled pairs are never made, so never sorted

Per view and setting: pairs kept; median ms (CUDA events, after warm-up) of projection +
intersection (+ cull), of our raster forward and of our raster backward (arc tuned to
convergence first, one tuner per setting); whole = the three; for the PyTorch cull also the cull
alone. Ratios are against off. Also the largest image difference and gradient error of each cull
against off (they should be ~0: culled pairs are skipped anyway), and whether the kernel's pairs
equal the PyTorch cull's exactly (the exit status is 1 when not).

    python -m bench.bench_cull [--beer .benchdata/beer] [--garden .benchdata/test_garden.npz] [--quick] [--compile]

--compile also times the keep mask alone, eager and under torch.compile (the eager mask is ~30
memory-bound kernels over the pair list), and the PyTorch cull with the compiled mask.

Prints a markdown table; writes JSON to $OUT/bench_cull.json (else bench/results/cull/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SH_C0 = 0.28209479177387814


def time_calls(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median ms of `fn` over `reps` calls (bench_raster's CUDA-event timing)."""
    from bench.bench_raster import time_calls as event_times

    return statistics.median(event_times(fn, warmup, reps))


def dense_params(garden_npz: Path, sh_degree: int) -> dict[str, torch.Tensor]:
    """bench_raster's dense garden workload as model parameters (log scales, logit opacities, SH)."""
    import numpy as np

    from bench.bench_raster import build_workload

    wl = build_workload("dense", dict(np.load(garden_npz)), torch.Generator().manual_seed(0))
    n = wl["means"].shape[0]
    k = (sh_degree + 1) ** 2 - 1
    return {
        "means": wl["means"].contiguous(),
        "scales": wl["scales"].log().contiguous(),
        "quats": wl["quats"],
        "opacities": torch.logit(wl["opacities"]),
        "sh0": ((wl["colors"] - 0.5) / SH_C0)[:, None, :].contiguous(),
        "shN": torch.zeros(n, k, 3, device=wl["means"].device),
    }


_COMPILED: dict[str, object] = {}


def compiled_keep_mask() -> Callable | None:
    """keep_mask through torch.compile (one fused kernel instead of ~30 eager ones), or None."""
    if "fn" not in _COMPILED:
        from gstrain.render.cull import keep_mask

        try:
            _COMPILED["fn"] = torch.compile(keep_mask, dynamic=True)
        except Exception as exc:  # noqa: BLE001 - a missing compiler is a result here, not a crash
            _COMPILED["fn"], _COMPILED["error"] = None, repr(exc)
    return _COMPILED["fn"]  # type: ignore[return-value]


def time_compiled_mask(plain, width: int, height: int, warmup: int, reps: int) -> dict:
    """The mask alone, eager and compiled (the compaction and offsets are not in either)."""
    from gstrain.render.cuda import TILE_SIZE
    from gstrain.render.cull import keep_mask, pair_tiles

    tiles = pair_tiles(plain.isect_offsets, plain.flatten_ids.numel())
    args = (tiles, plain.flatten_ids, plain.means2d, plain.conics, plain.opacities, width, height, TILE_SIZE)
    out = {"mask_only_ms": time_calls(lambda: keep_mask(*args), warmup, reps)}
    fn = compiled_keep_mask()
    if fn is not None:
        try:
            t0 = time.perf_counter()
            same = bool(torch.equal(fn(*args), keep_mask(*args)))
            out["compile_s"] = time.perf_counter() - t0
            out["mask_compiled_ms"] = time_calls(lambda: fn(*args), warmup, reps)
            out["compiled_mask_equal"] = same
        except Exception as exc:  # noqa: BLE001
            _COMPILED["fn"], _COMPILED["error"] = None, repr(exc)
    if "error" in _COMPILED:
        out["compile_error"] = _COMPILED["error"]
    return out


# (tag, label, ellipse_cull, cull_kernel): no cull; gsplat's isect_tiles then the PyTorch
# cull_pairs; our culled intersection kernel (pairs cut before the sort)
SETTINGS = (("off", "off", False, True), ("torch", "PyTorch cull", True, False), ("kernel", "kernel cull", True, True))


def bench_view(params, camera, sh_degree: int, warmup: int, reps: int, compiled: bool = False) -> dict:
    from gstrain.render.arc import ArcTuner
    from gstrain.render.common import RasterOptions
    from gstrain.render.cuda import TILE_SIZE, project_splats, rasterize_splats, splat_colors
    from gstrain.render.cull import cull_pairs

    viewmat, K, width, height = camera
    row: dict = {"width": width, "height": height}
    with torch.no_grad():
        colors = splat_colors(params, viewmat, sh_degree, project_splats(params, viewmat, K, width, height).radii)
    gen = torch.Generator(device=viewmat.device).manual_seed(0)
    v_image = torch.randn(1, height, width, 3, device=viewmat.device, generator=gen)
    outputs = {}
    for tag, _, cull, kernel in SETTINGS:

        def project(c=cull, k=kernel):
            return project_splats(params, viewmat, K, width, height, ellipse_cull=c, cull_kernel=k)

        with torch.no_grad():
            row[f"proj_isect_ms_{tag}"] = time_calls(project, warmup, reps)
            splats = project()
        row["pairs_before"], row[f"pairs_{tag}"] = splats.pairs[0], splats.pairs[1]
        if tag == "torch":
            plain = project_splats(params, viewmat, K, width, height)
            row["cull_only_ms"] = time_calls(
                lambda p=plain: cull_pairs(p.means2d, p.conics, p.opacities, p.isect_offsets, p.flatten_ids,
                                           width, height, TILE_SIZE),
                warmup, reps,
            )  # fmt: skip
            if compiled:
                row.update(time_compiled_mask(plain, width, height, warmup, reps))
                fn = compiled_keep_mask()
                if fn is not None:

                    def proj_compiled(f=fn):
                        p = project_splats(params, viewmat, K, width, height)
                        return cull_pairs(p.means2d, p.conics, p.opacities, p.isect_offsets, p.flatten_ids,
                                          width, height, TILE_SIZE, mask_fn=f)  # fmt: skip

                    row["proj_isect_ms_torch_compiled"] = time_calls(proj_compiled, warmup, reps)
        pairs = (splats.isect_offsets, splats.flatten_ids)
        leaves = [t.detach().clone().requires_grad_(True) for t in (splats.means2d, splats.conics, colors)]
        splats.means2d = leaves[0]
        tuner = ArcTuner()
        options = RasterOptions(atomic_mode="arc", tuner=tuner)

        def forward(s=splats, lv=leaves, o=options):
            return rasterize_splats(s, lv[2], None, o, conics=lv[1])[0]

        with torch.no_grad():
            row[f"raster_fwd_ms_{tag}"] = time_calls(forward, warmup, reps)
        image = forward()

        def backward(img=image, lv=leaves):
            return torch.autograd.grad(img, lv, grad_outputs=v_image, retain_graph=True)

        for _ in range(5000):  # arc: tune to convergence before timing
            if not tuner.tuning:
                break
            backward()
            torch.cuda.synchronize()
            tuner.poll()
        row[f"arc_threshold_{tag}"] = int(tuner.threshold)
        row[f"raster_bwd_ms_{tag}"] = time_calls(backward, warmup, reps)
        outputs[tag] = (image.detach(), backward(), pairs)
    img_off, g_off, _ = outputs["off"]
    for tag in ("torch", "kernel"):
        img, grads, _ = outputs[tag]
        row[f"max_image_diff_{tag}"] = float((img - img_off).abs().max())
        row[f"max_grad_rel_err_{tag}"] = max(
            float((a - b).double().norm() / b.double().norm().clamp_min(1e-30))
            for a, b in zip(grads, g_off, strict=True)
        )
    (off_t, ids_t), (off_k, ids_k) = outputs["torch"][2], outputs["kernel"][2]
    row["kernel_pairs_equal_torch"] = bool(torch.equal(off_t, off_k) and torch.equal(ids_t, ids_k))
    return row


def summarise(rows: list[dict]) -> dict:
    keys = {k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: statistics.median(r[k] for r in rows if k in r) for k in sorted(keys)}


def markdown(results: dict) -> str:
    """One row per workload and setting; `vs off` = off's ms / this setting's ms (> 1: faster)."""
    head = ("| workload | Gaussians | setting | pairs/view | kept | proj+isect ms | vs off | cull alone ms | "
            "raster fwd ms | vs off | raster bwd ms | vs off | whole (proj+fwd+bwd) ms | vs off | "
            "max image diff | max grad rel err |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    mask_lines = []
    for name, r in results.items():
        s = r["median"]
        whole = {t: s[f"proj_isect_ms_{t}"] + s[f"raster_fwd_ms_{t}"] + s[f"raster_bwd_ms_{t}"] for t, *_ in SETTINGS}
        for tag, label, _, _ in SETTINGS:
            cells = [name, f"{r['gaussians']:,}", label, f"{s[f'pairs_{tag}']:,.0f}",
                     f"{s[f'pairs_{tag}'] / max(s['pairs_off'], 1):.1%}"]  # fmt: skip
            for key in ("proj_isect_ms", "cull_only_ms", "raster_fwd_ms", "raster_bwd_ms", "whole"):
                if key == "cull_only_ms":
                    cells.append(f"{s[key]:.3f}" if tag == "torch" else "-")
                    continue
                ms, off = (whole[tag], whole["off"]) if key == "whole" else (s[f"{key}_{tag}"], s[f"{key}_off"])
                cells += [f"{ms:.3f}", f"{off / ms:.2f}x"]
            if tag == "off":
                cells += ["-", "-"]
            else:
                cells += [f"{max(v[f'max_image_diff_{tag}'] for v in r['views']):.2e}",
                          f"{max(v[f'max_grad_rel_err_{tag}'] for v in r['views']):.2e}"]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        if "mask_only_ms" in s:
            keys = ("mask_compiled_ms", "proj_isect_ms_torch_compiled")
            compiled = [f"{s[k]:.3f}" if k in s else "failed" for k in keys]
            mask_lines.append(f"| {name} | {s['mask_only_ms']:.3f} | {compiled[0]} | {s['proj_isect_ms_off']:.3f} | "
                              f"{s['proj_isect_ms_torch']:.3f} | {compiled[1]} | "
                              f"{s['proj_isect_ms_kernel']:.3f} |")  # fmt: skip
    if mask_lines:
        lines += ["", "| workload | keep mask eager ms | keep mask torch.compile ms | proj+isect ms off | "
                  "PyTorch cull (eager) | PyTorch cull (compiled mask) | kernel cull |",
                  "|---|---|---|---|---|---|---|", *mask_lines]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--beer", default=str(REPO / ".benchdata" / "beer"), help="COLMAP scene (factor 1); '' skips")
    ap.add_argument("--garden", default=str(REPO / ".benchdata" / "test_garden.npz"), help="'' skips garden and dense")
    ap.add_argument("--garden-scale", type=int, default=4, help="garden's resolution x this (4: 2592x1680)")
    ap.add_argument("--target", action="append", default=[], help="also a trained run dir or scene (repeatable)")
    ap.add_argument("--views", type=int, default=3, help="views per workload (evenly spaced)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-dense", action="store_true")
    ap.add_argument("--quick", action="store_true", help="1 view, 5 reps, 2 warm-up calls")
    ap.add_argument("--compile", action="store_true", help="also time the mask under torch.compile (adds compile time)")
    ap.add_argument("--json", default=None, help="output JSON (default: $OUT/bench_cull.json or bench/results/cull/)")
    args = ap.parse_args()
    if args.quick:
        args.views, args.reps, args.warmup = 1, 5, 2
    if not torch.cuda.is_available():
        sys.exit("bench_cull: needs a CUDA GPU")
    from bench.builds import build_all
    from gstrain.config import build_config
    from gstrain.profile import load_workload

    build_all(["raster"], gsplat=True)  # compile outside any timing
    cfg = build_config()
    device = torch.device("cuda")
    t0 = time.perf_counter()
    workloads: list[tuple[str, Callable[[], tuple[dict, list, int]]]] = []

    def from_target(path: Path, **kw) -> Callable[[], tuple[dict, list, int]]:
        def load():
            wl = load_workload(path, cfg, device, **kw)
            return wl.params, wl.cameras, wl.sh_degree

        return load

    if args.beer:
        workloads.append(("beer initial", from_target(Path(args.beer), factor=1)))
    if args.garden:
        garden = Path(args.garden)
        garden_cameras: list = []

        def garden_initial():
            params, cameras, sh = from_target(garden, npz_scale=args.garden_scale)()
            garden_cameras[:] = cameras
            return params, cameras, sh

        def dense():  # garden's cameras, bench_raster's dense Gaussians
            return dense_params(garden, cfg.model.sh_degree), garden_cameras, cfg.model.sh_degree

        workloads.append((f"garden initial x{args.garden_scale}", garden_initial))
        if not args.no_dense:
            workloads.append((f"garden dense x{args.garden_scale}", dense))
    for t in args.target:
        workloads.append((Path(t).name, from_target(Path(t))))
    results: dict = {}
    for name, load in workloads:
        t1 = time.perf_counter()
        params, cameras, sh_degree = load()
        dev = cameras[0][0].device  # where the workload put its views (the GPU)
        params = {k: v.detach().to(dev).float().contiguous() for k, v in params.items()}
        step = max(len(cameras) // args.views, 1)
        picked = cameras[::step][: args.views]
        rows = [bench_view(params, cam, sh_degree, args.warmup, args.reps, args.compile) for cam in picked]
        n = int(params["means"].shape[0])
        results[name] = {"gaussians": n, "views": rows, "median": summarise(rows)}
        print(f"bench_cull: {name}: {n} Gaussians, {len(rows)} views at {rows[0]['width']}x{rows[0]['height']}, "
              f"{time.perf_counter() - t1:.1f} s", flush=True)  # fmt: skip
        del params
        torch.cuda.empty_cache()
    table = markdown(results)
    print(table)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": args.reps,
            "warmup": args.warmup, "seconds": time.perf_counter() - t0}  # fmt: skip
    out = args.json or (os.path.join(os.environ["OUT"], "bench_cull.json") if os.environ.get("OUT") else None)
    if out is None:
        out_dir = REPO / "bench" / "results" / "cull"
        out_dir.mkdir(parents=True, exist_ok=True)
        out = str(out_dir / "bench_cull.json")
    Path(out).write_text(json.dumps({"meta": meta, "results": results, "table": table}, indent=1))
    print(f"bench_cull: wrote {out} ({meta['seconds']:.0f} s)")
    mismatched = [n for n, r in results.items() if not all(v["kernel_pairs_equal_torch"] for v in r["views"])]
    if mismatched:
        print(f"bench_cull: the kernel cull's pairs differ from the PyTorch cull's in {', '.join(mismatched)}")
    finite = all(math.isfinite(r["median"][f"raster_bwd_ms_{t}"]) for r in results.values() for t, *_ in SETTINGS)
    return 0 if finite and not mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
