"""Where a training step's host and GPU time go, op by op: torch.profiler over gstrain's own step.

    python3 scripts/trace_step.py SCENE_OR_RUN [--steps 20] [--warmup 30] [--set section.key=value ...]

Loads the workload as `gstrain profile` does (a scene's SfM points or a run's last checkpoint),
warms up, then profiles `--steps` steps and prints the ops with the most host (self CPU) time and
the kernels with the most GPU time. A development tool: `gstrain profile` is the user-facing one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from gstrain.config import build_config, parse_override
from gstrain.profile import load_workload
from gstrain.render import Renderer
from gstrain.train.fused_ssim import install_ssim_impl
from gstrain.train.optim import build_optimizers
from gstrain.train.step import StepRunner
from gstrain.train.strategy import Densifier
from gstrain.train.timing import PhaseTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    cfg = build_config(overrides=[parse_override(s) for s in args.sets])
    cfg.strategy.refine_start = 10**9  # bookkeeping every step, no change of the Gaussian set
    device = torch.device("cuda")
    work = load_workload(args.target, cfg, device)
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone()) for k, v in work.params.items()})
    optimizers = build_optimizers(params, cfg.optim, work.extent)
    renderer = Renderer(cfg.render, device)
    install_ssim_impl(device, cfg.train.fused_ssim)
    runner = StepRunner(cfg, renderer, Densifier(cfg.strategy, work.extent, device), PhaseTimer(device), device)
    background = torch.zeros(3, device=device)

    def step(i: int) -> None:
        viewmat, K, _, _ = work.cameras[i % len(work.cameras)]
        runner.run(params, optimizers, i, viewmat, K, work.targets[i % len(work.targets)], work.sh_degree, background)

    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"{len(params['means'])} Gaussians, {args.steps} steps; totals over all steps")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
