"""Where a training step's host and GPU time go, op by op: torch.profiler over gstrain's own step.

    python -m bench.trace_step SCENE_OR_RUN [--steps 20] [--warmup 30] [--set section.key=value ...]

Loads the workload as `gstrain profile` does (a scene's SfM points or a run's last checkpoint),
warms up, then profiles `--steps` steps and prints the ops with the most host (self CPU) time and
the kernels with the most GPU time. A development tool: `gstrain profile` is the user-facing one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from gstrain.config import build_config, parse_override
from gstrain.profile import WorkloadSteps, load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--time-steps", type=int, default=200, help="unprofiled steps timed for the wall figure")
    args = ap.parse_args()
    cfg = build_config(overrides=[parse_override(s) for s in args.sets])
    work = load_workload(args.target, cfg, torch.device("cuda"))
    step = WorkloadSteps(work, cfg)  # the trainer's own step, as gstrain profile runs it
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.time_steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3 / max(args.time_steps, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages()
    print(f"{len(step.params['means'])} Gaussians, {args.steps} steps; totals over all steps")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    # kernels' own time per step against the unprofiled wall: how busy the step keeps the GPU
    # (only the device-side rows: an op's row repeats its kernels' time)
    kernel_ms = sum(e.self_device_time_total for e in table if e.device_type == DeviceType.CUDA) / 1e3 / args.steps
    launches = sum(e.count for e in table if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(f"wall {wall_ms:.3f} ms/step over {args.time_steps} unprofiled steps; kernels {kernel_ms:.3f} ms/step "
          f"(GPU busy {kernel_ms / wall_ms:.0%}); {launches / args.steps:.0f} kernel launches per step")


if __name__ == "__main__":
    main()
