"""End-to-end training benchmark: `gstrain fit` as pipelines that differ only in the speed
features, on one scene, several seeds. Prints a markdown table; writes bench_train.json.

  baseline   what a gsplat user runs: gsplat's projection and rasterize_to_pixels (forward and
             backward), L1 + SSIM as PyTorch convolutions, torch.optim.Adam(fused=True) per tensor,
             gsplat's DefaultStrategy (with the opacity reset that gsplat 1.5.3 skips, as 1.5.2
             and gsplat's main do it; both pipelines), checkpoints only at the end
  gstrain    `gstrain fit` defaults, every speed feature on (ARC rasterizer, fused SSIM, one-launch
             Adam, sync-free densification statistics), checkpoints every 1000 steps
  gsplat-raster, conv-ssim, torch-adam, gsplat-stats, no-cull   gstrain with that one feature off
  sparse-adam   gstrain plus Adam over the visible Gaussians only
  no-cull       gstrain without dev.ellipse_cull (the culled tile intersection; on by default)
  appearance, bilateral, antialiased, filter3d, pose-refine   gstrain with that real-capture feature on
             (appearance: the per-image affine; bilateral: the per-image bilateral grid)
  issue19-off   gstrain with issue 19's switches off (ellipse cull, CUDA graph steps, fused SH colours):
                how gstrain trained when issue 19 was filed, less the kernel changes that have no
                switch and compute the same function (the quality side of that issue's paired study)

    python -m bench.bench_train SCENE --steps 7000 --seeds 0,1,2 --pipelines baseline,gstrain
    python -m bench.bench_train --report DIR[:P1+P2] [DIR ...] [--seeds 0,1,2]
        (the tables again, from the per-run JSONs; only those seeds' runs with --seeds, only
        pipelines P1 and P2 from a DIR:P1+P2; speed figures only from runs that had the GPU alone)
    python -m bench.bench_train SCENE --steps 7000 --seeds 0-7 --pipelines gstrain,conv-ssim --jobs 4
        (quality only: several runs share the GPU at once, so their times are not speed figures)
    python -m bench.bench_train SCENE --steps 30000 --extra "--set train.stop_at=7000" ...
        (the 7k point of 30k runs, at a quarter of their cost: the schedules still span 30k)
    python -m bench.bench_train SCENE --steps 30000 --fork-at 7000 --pipelines baseline,gstrain,gstrain ...
        (paired runs: for each seed, gstrain (--fork-from) trains to step 7000 and pauses; each
        pipeline then resumes its own copy of that checkpoint to step 30000. Every pipeline starts
        its last 23k steps from the same state, so the seed-to-seed noise of the first 7k cancels
        in the differences. A pipeline named twice runs twice from each fork ("_twin"): the
        spread of those differences is the noise the pairing leaves, float atomics alone.)

Float atomics make runs diverge (densification differs), hence several seeds and medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.bench_report import load_runs, report, split_repeats
from bench.builds import build_all

# Every speed switch off, and checkpoints only at the end as gsplat's example trainer does.
BASELINE = ["--backend", "gsplat", "--set", "dev.fused_ssim=false", "--set", "dev.fused_adam=false",
            "--set", "dev.fast_stats=false", "--set", "dev.ellipse_cull=false", "--set", "log.ckpt_every=0"]
PIPELINES = {
    "baseline": BASELINE,
    "gstrain": ["--atomic-mode", "arc"],  # the defaults: every switch on, checkpoints every 1000 steps
    # one switch off at a time: what each feature buys end to end
    "gsplat-raster": ["--backend", "gsplat"],
    "conv-ssim": ["--set", "dev.fused_ssim=false"],
    "torch-adam": ["--set", "dev.fused_adam=false"],
    "gsplat-stats": ["--set", "dev.fast_stats=false"],
    "sparse-adam": ["--set", "optim.sparse_adam=true"],
    # one switch on: Adam's moments in bfloat16 with stochastic rounding (issue 37's fewer bytes per
    # Gaussian; its paired quality study against gstrain)
    "bf16-moments": ["--atomic-mode", "arc", "--set", "optim.moments=bf16"],
    # shN's moments in 8 bits with a scale per Gaussian, the others bfloat16 (86 B a Gaussian less
    # than bf16-moments at SH degree 3; the same paired study)
    "int8-moments": ["--atomic-mode", "arc", "--set", "optim.moments=int8"],
    "no-cull": ["--set", "dev.ellipse_cull=false"],
    "issue19-off": ["--atomic-mode", "arc", "--set", "dev.ellipse_cull=false", "--set", "dev.cuda_graphs=false",
                    "--set", "dev.fused_sh=false"],
    # the real-capture features, one at a time on top of the defaults: the paired runs that choose
    # which of them should be on by default
    "appearance": ["--atomic-mode", "arc", "--set", "train.appearance=affine"],
    "bilateral": ["--atomic-mode", "arc", "--set", "train.appearance=bilateral"],
    "antialiased": ["--atomic-mode", "arc", "--set", "render.antialiased=true"],
    "filter3d": ["--atomic-mode", "arc", "--set", "render.filter_3d=0.2"],
    "pose-refine": ["--atomic-mode", "arc", "--set", "train.pose_refine=true"],
}

# Every pipeline scores all training views after its loop (outside the timed part): a view the
# model never fitted tells a failed run from an overfitted one.
COMMON = ["--set", "log.eval_train_views=true"]


def fit(cmd: list[str], run_dir: Path) -> tuple[dict, float]:
    """Run one `gstrain fit` command; its train_summary.json and the process's wall seconds."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "train_summary.json").read_text()), wall


def fit_command(scene: Path, run_dir: Path, mode: str, extra: list[str], device: str) -> list[str]:
    flags = PIPELINES[mode]
    if device == "cpu":  # the scripts' own CPU tests: every pipeline renders with the reference there
        flags = [f for i, f in enumerate(flags) if "--backend" not in (f, flags[i - 1] if i else None)]
    return [sys.executable, "-m", "gstrain", "fit", str(scene), "--out", str(run_dir), "--device", device,
            *COMMON, *flags, *extra]


def save_run(out: Path, name: str, summary: dict) -> dict:
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2))  # kept if a later run dies
    return summary


def run_one(scene: Path, mode: str, seed: int, steps: int, out: Path, extra: list[str], commit: str | None,
            jobs: int = 1, device: str = "cuda") -> dict:
    run_dir = out / f"{mode}_seed{seed}"
    cmd = fit_command(scene, run_dir, mode, ["--steps", str(steps), "--seed", str(seed), *extra], device)
    summary, wall = fit(cmd, run_dir)
    # concurrent_jobs > 1: the GPU was shared, so the run's times are no speed figure
    summary.update(mode=mode, seed=seed, process_wall_s=round(wall, 2), commit=commit, concurrent_jobs=jobs)
    return save_run(out, f"{mode}_seed{seed}", summary)


def trunk_dir(out: Path, seed: int) -> Path:
    return out / "trunks" / f"seed{seed}"


def run_trunk(scene: Path, mode: str, seed: int, steps: int, fork_at: int, out: Path, extra: list[str],
              device: str = "cuda") -> dict:
    """The shared start of one fork: `mode` trained to step `fork_at` of a `steps`-step run (its
    schedules span all `steps`) and paused there with a checkpoint (train.stop_at)."""
    run_dir = trunk_dir(out, seed)
    cmd = fit_command(scene, run_dir, mode, ["--steps", str(steps), "--seed", str(seed), *extra,
                                             "--set", f"train.stop_at={fork_at}"], device)  # fmt: skip
    summary, _ = fit(cmd, run_dir)
    if summary.get("status") != "stopped" or summary.get("steps") != fork_at:
        raise SystemExit(f"the trunk in {run_dir} did not pause at step {fork_at}: {summary.get('status')}")
    summary.update(mode=mode, seed=seed)
    (run_dir.parent / f"seed{seed}.json").write_text(json.dumps(summary, indent=2))
    return summary


def run_branch(scene: Path, mode: str, twin: int, seed: int, trunk: dict, out: Path, extra: list[str],
               commit: str | None, jobs: int = 1, device: str = "cuda") -> dict:
    """`mode` continues its own copy of the seed's trunk to the end (--resume with its switches).
    Its summary gets the trunk's test points up to the fork, so that its curve reads as one run."""
    name = f"{mode}{f'_twin{twin}' if twin else ''}_seed{seed}"
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(trunk_dir(out, seed), run_dir)
    summary, wall = fit(fit_command(scene, run_dir, mode, ["--resume", *extra, "--set", "train.stop_at=0"], device),
                        run_dir)  # fmt: skip
    fork_at = trunk["steps"]
    summary["test_history"] = [p for p in trunk["test_history"] if p["step"] <= fork_at] + summary["test_history"]
    summary.update(mode=mode, seed=seed, process_wall_s=round(wall, 2), commit=commit, concurrent_jobs=jobs,
                   fork={"at": fork_at, "trunk": trunk["mode"]}, twin=twin)  # fmt: skip
    return save_run(out, name, summary)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' or '0-7' or a mix ('0-3,9')."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    return seeds


def with_twins(modes: list[str]) -> list[tuple[str, int]]:
    """(mode, k): k = how many times the mode came before in the list (0 for its first run)."""
    return [(mode, modes[:i].count(mode)) for i, mode in enumerate(modes)]


def run_all(tasks: list, jobs: int) -> list[dict]:
    """Call every task (a zero-argument function); `jobs` at once."""
    if jobs == 1:
        return [task() for task in tasks]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return [f.result() for f in [pool.submit(task) for task in tasks]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scene", type=Path, nargs="?")
    ap.add_argument("--steps", type=int, default=7000)
    ap.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; with --report, all)")
    ap.add_argument("--pipelines", default="baseline,gstrain", help=", ".join(PIPELINES))
    ap.add_argument("--reference", default="baseline",
                    help="with --report: the pipeline the targets and noise tests compare against")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs")) / "bench_train")
    ap.add_argument("--extra", default="", help="extra flags for gstrain fit, space-separated")
    ap.add_argument("--commit", default=None, help="recorded in each run's JSON (default: git HEAD)")
    ap.add_argument("--report", nargs="+", metavar="DIR",
                    help="print the tables from the per-run JSONs in these folders; runs nothing")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once on the one GPU (quality studies only: shared runs time nothing)")
    ap.add_argument("--fork-at", type=int, default=0,
                    help="paired runs: every pipeline resumes one checkpoint per seed, taken at this step")
    ap.add_argument("--fork-from", default="gstrain", help="with --fork-at: the pipeline that trains up to the fork")
    ap.add_argument("--device", default="cuda", help="the runs' --device (cpu: the scripts' own tests)")
    args = ap.parse_args(argv)
    seeds = parse_seeds(args.seeds) if args.seeds else None
    if args.report:
        report(*load_runs(args.report, seeds), reference=args.reference)
        return
    if args.scene is None:
        ap.error("a scene is needed (or --report DIR ...)")
    seeds = seeds or [0, 1, 2]
    modes = args.pipelines.split(",")
    unknown = [m for m in [*modes, args.fork_from] if m not in PIPELINES]
    if unknown:
        ap.error(f"unknown pipeline(s) {unknown}; choose from {', '.join(PIPELINES)}")
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if not 0 <= args.fork_at < args.steps:
        ap.error("--fork-at must be a step before --steps")
    if len(set(modes)) < len(modes) and not args.fork_at:
        ap.error("a pipeline named twice runs twice from each fork: it needs --fork-at")
    commit = args.commit or git_commit()
    extra = args.extra.split()
    if args.jobs > 1 and args.device == "cuda":
        build_all()  # here, once: parallel first builds would race on the cache

    def show(r: dict) -> dict:
        print(f"{r['mode']}{' twin' if r.get('twin') else ''} seed {r['seed']}: {r['seconds']:.1f}s train loop, "
              f"PSNR {r['final_test_psnr']:.2f}, {r['num_gaussians']} Gaussians, peak {r['peak_gpu_memory_gib']} GiB",
              flush=True)  # fmt: skip
        return r

    # interleaved, so drift of the machine hits every mode alike
    if not args.fork_at:
        rows = run_all([lambda m=m, s=s: show(run_one(args.scene, m, s, args.steps, args.out, extra, commit,
                                                      args.jobs, args.device))
                        for s in seeds for m in modes], args.jobs)  # fmt: skip
    else:
        trunks = run_all([lambda s=s: run_trunk(args.scene, args.fork_from, s, args.steps, args.fork_at, args.out,
                                                extra, args.device) for s in seeds], args.jobs)  # fmt: skip
        rows = run_all([lambda m=m, k=k, s=s, t=t: show(run_branch(args.scene, m, k, s, t, args.out, extra, commit,
                                                                   args.jobs, args.device))
                        for s, t in zip(seeds, trunks, strict=True) for m, k in with_twins(modes)],
                       args.jobs)  # fmt: skip
    (args.out / "bench_train.json").write_text(json.dumps(rows, indent=2))
    report(*split_repeats(rows))  # this call's runs only (--report DIR reads every run in the folder)


if __name__ == "__main__":
    main()
