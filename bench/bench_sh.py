"""The fused SH colours (render/sh_colors.py) against gsplat's path (render/cuda.splat_colors
without `fused`), forward + backward, at one population; CUDA-event medians. A study, not a test.

    python -m bench.bench_sh [--n 300000] [--degree 3] [--iters 50]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from bench.builds import build_all
from gstrain.render.cuda import splat_colors


def _time(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300_000)
    ap.add_argument("--degree", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    build_all(gsplat=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    n = args.n
    params = {"means": torch.randn(n, 3, generator=g, device="cuda"),
              "sh0": torch.randn(n, 1, 3, generator=g, device="cuda"),
              "shN": torch.randn(n, 15, 3, generator=g, device="cuda") * 0.3}  # fmt: skip
    params = {k: v.requires_grad_(True) for k, v in params.items()}
    viewmat = torch.eye(4, device="cuda")
    viewmat[2, 3] = 5.0
    radii = torch.randint(0, 9, (1, n, 2), generator=g, device="cuda", dtype=torch.int32)  # ~1/5 invisible
    weights = torch.randn(1, n, 3, generator=g, device="cuda")
    row = {"n": n, "degree": args.degree, "gpu": torch.cuda.get_device_name()}
    for name, fused in (("gsplat_path", False), ("fused", True)):
        def forward(fused=fused):
            return splat_colors(params, viewmat, args.degree, radii, fused=fused)

        def both(fused=fused):
            for p in params.values():
                p.grad = None
            (forward(fused) * weights).sum().backward()

        with torch.no_grad():
            row[f"{name}_fwd_ms"] = round(_time(forward, args.iters), 4)
        row[f"{name}_fwd_bwd_ms"] = round(_time(both, args.iters), 4)
    row["fused_over_gsplat_fwd_bwd"] = round(row["fused_fwd_bwd_ms"] / row["gsplat_path_fwd_bwd_ms"], 3)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
