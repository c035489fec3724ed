"""What holds GPU memory at the peak of a training step: the CUDA allocator's history over gstrain's
own step, replayed to the moment of most memory, with the live blocks grouped by where they were
allocated.

    python -m bench.memory_step TARGET [--scale 2] [--switches] [--set section.key=value ...]

TARGET is what `gstrain profile` takes (a scene, a run, a test_garden-style .npz). Two steps are
recorded: a plain one and one where gsplat's DefaultStrategy grows and prunes. What lives across
steps (parameters, Adam moments, the workload's images) is one figure; the table lists what the
step allocates on top of it, at its peak. With --switches, every configuration of `gstrain profile
--switches`. A development tool, like trace_step.py.
"""

from __future__ import annotations

import argparse
import gc
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from gstrain.config import build_config, parse_override
from gstrain.profile import WorkloadSteps, load_workload, switch_variants

MIB = 2**20


def where(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in gstrain, gsplat or a script, else torch's own: file:line function."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in ("gstrain/", "gsplat/", "bench/")):
            short = name.split("site-packages/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "?"


def peak_blocks(trace: list[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """Replay an allocator trace: the most bytes live at once relative to the start (blocks from
    before the recording count when freed), and the blocks allocated in the trace that were live
    then, grouped by `where` they were allocated."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, where(event.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)[0]
        elif action == "free_requested":  # a block from before the recording (old parameters, say)
            total -= size
    groups: dict[str, int] = defaultdict(int)
    for size, origin in at_peak.values():
        groups[origin] += size
    return peak, dict(groups)


def record_step(step: WorkloadSteps) -> tuple[int, int, dict[str, int]]:
    """One step under the allocator's history: (bytes resident before it, its peak on top, groups)."""
    device = step.device
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    step()
    torch.cuda.synchronize(device)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, groups = peak_blocks(snapshot["device_traces"][device.index or 0])
    return resident, peak, groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--scale", type=int, default=1, help="resolution scale for a .npz target")
    ap.add_argument("--switches", action="store_true", help="every configuration of `gstrain profile --switches`")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    cfg = build_config(overrides=[parse_override(s) for s in args.sets])
    work = load_workload(args.target, cfg, torch.device("cuda"), npz_scale=args.scale)
    variants = switch_variants(cfg) if args.switches else {"as configured": cfg}
    width, height = work.cameras[0][2], work.cameras[0][3]
    print(f"{work.name}: {len(work.params['means'])} Gaussians, {width}x{height}")
    for label, variant in variants.items():
        gc.collect()
        torch.cuda.empty_cache()
        step = WorkloadSteps(work, variant)
        strategy = step.runner.strategy.gsplat
        # gsplat grows and prunes after step s when s > refine_start and s % refine_every == 0
        strategy.refine_start_iter = 0
        while step.step < strategy.refine_every - 1:
            step()
        for kind in ("plain step", "refine step"):
            resident, peak, groups = record_step(step)
            print(f"\n{label}, {kind}: resident before it {resident / MIB:.1f} MiB, its peak on top "
                  f"{peak / MIB:.1f} MiB (max_memory_allocated {torch.cuda.max_memory_allocated() / MIB:.1f} MiB), "
                  f"{len(step.params['means'])} Gaussians after it")
            for origin, size in sorted(groups.items(), key=lambda kv: -kv[1])[: args.rows]:
                print(f"  {size / MIB:8.1f} MiB  {origin}")
        del step, strategy


if __name__ == "__main__":
    main()
