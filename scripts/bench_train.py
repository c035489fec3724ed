"""End-to-end training benchmark: `gstrain fit` as pipelines that differ only in the speed
features, on one scene, several seeds. Prints a markdown table; writes bench_train.json.

  baseline   what a gsplat user runs: gsplat's projection and rasterize_to_pixels (forward and
             backward), L1 + SSIM as PyTorch convolutions, torch.optim.Adam(fused=True) per tensor,
             gsplat's DefaultStrategy as is, checkpoints only at the end
  gstrain    `gstrain fit` defaults, every speed feature on (ARC rasterizer, fused SSIM, one-launch
             Adam, sync-free densification statistics), checkpoints every 1000 steps
  gsplat-raster, conv-ssim, torch-adam, gsplat-stats   gstrain with that one feature off
  sparse-adam   gstrain plus Adam over the visible Gaussians only

    python3 scripts/bench_train.py SCENE --steps 7000 --seeds 0,1,2 --pipelines baseline,gstrain

Float atomics make runs diverge (densification differs), hence several seeds and medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Every speed switch off, and checkpoints only at the end as gsplat's example trainer does.
BASELINE = ["--atomic-mode", "gsplat", "--set", "train.fused_ssim=false", "--set", "optim.fused_adam=false",
            "--set", "strategy.fast_stats=false", "--set", "log.ckpt_every=0"]
PIPELINES = {
    "baseline": BASELINE,
    "gstrain": ["--atomic-mode", "arc"],  # the defaults: every switch on, checkpoints every 1000 steps
    # one switch off at a time: what each feature buys end to end
    "gsplat-raster": ["--atomic-mode", "gsplat"],
    "conv-ssim": ["--set", "train.fused_ssim=false"],
    "torch-adam": ["--set", "optim.fused_adam=false"],
    "gsplat-stats": ["--set", "strategy.fast_stats=false"],
    "sparse-adam": ["--set", "optim.sparse_adam=true"],
}


STEP_PHASES = ("data", "forward", "loss", "backward", "optimizer", "densify")  # top-level phases


def run_one(scene: Path, mode: str, seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    run_dir = out / f"{mode}_seed{seed}"
    cmd = [sys.executable, "-m", "gstrain", "fit", str(scene), "--out", str(run_dir), "--steps", str(steps),
           "--seed", str(seed), "--device", "cuda", *PIPELINES[mode], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "train_summary.json").read_text())
    summary.update(mode=mode, seed=seed, process_wall_s=round(wall, 2))
    (out / f"{mode}_seed{seed}.json").write_text(json.dumps(summary, indent=2))  # kept if a later run dies
    return summary


def median_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path)
    ap.add_argument("--steps", type=int, default=7000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--pipelines", default="baseline,gstrain", help=", ".join(PIPELINES))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs")) / "bench_train")
    ap.add_argument("--extra", default="", help="extra flags for gstrain fit, space-separated")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.pipelines.split(",")
    unknown = [m for m in modes if m not in PIPELINES]
    if unknown:
        raise SystemExit(f"unknown pipeline(s) {unknown}; choose from {', '.join(PIPELINES)}")
    rows = []
    for seed in seeds:
        for mode in modes:  # interleaved, so drift of the machine hits every mode alike
            rows.append(run_one(args.scene, mode, seed, args.steps, args.out, args.extra.split()))
            r = rows[-1]
            print(f"{mode} seed {seed}: {r['seconds']:.1f}s train loop, PSNR {r['final_test_psnr']:.2f}, "
                  f"{r['num_gaussians']} Gaussians, peak {r['peak_gpu_memory_gib']} GiB", flush=True)
    (args.out / "bench_train.json").write_text(json.dumps(rows, indent=2))
    print("\n| pipeline | train loop s | test PSNR | test SSIM | Gaussians | peak GiB |\n|---|---|---|---|---|---|")
    medians = {}
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        medians[mode] = statistics.median(r["seconds"] for r in rs)
        print(f"| {mode} | {median_spread([r['seconds'] for r in rs])} | "
              f"{median_spread([r['final_test_psnr'] for r in rs])} | "
              f"{median_spread([r['final_test_ssim'] for r in rs])} | "
              f"{median_spread([float(r['num_gaussians']) for r in rs])} | "
              f"{median_spread([r['peak_gpu_memory_gib'] for r in rs])} |")
    if "baseline" in medians:
        for mode in modes:
            print(f"{mode}: {medians[mode] / medians['baseline']:.3f}x the baseline's training time (medians)")
    print("\nper-phase ms per step (median over seeds):")
    phases = sorted({k for r in rows for k in (r.get("phase_ms_per_step") or {})})
    print("| phase | " + " | ".join(modes) + " |\n|---" * 1 + "|---" * len(modes) + "|")
    for ph in phases:
        cells = []
        for mode in modes:
            vals = [r["phase_ms_per_step"][ph] for r in rows if r["mode"] == mode and r.get("phase_ms_per_step")]
            cells.append(f"{statistics.median(vals):.3f}" if vals else "-")
        print(f"| {ph} | " + " | ".join(cells) + " |")
    for key in ("host_ms_per_step", "wall_ms_per_step"):
        cells = []
        for mode in modes:
            vals = [r[key] for r in rows if r["mode"] == mode and r.get(key) is not None]
            vals = [sum(v.get(p, 0.0) for p in STEP_PHASES) if isinstance(v, dict) else v for v in vals]
            cells.append(f"{statistics.median(vals):.3f}" if vals else "-")
        print(f"| {key.removesuffix('_per_step')} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
