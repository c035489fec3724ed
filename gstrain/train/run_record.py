"""The run record: what one `fit` process reports about itself, written once as train_summary.json.

The trainer feeds it (timings per logged window, Gaussian counts, test evaluations) and calls
write_run_record at the end; studies (bench/) derive their statistics from the JSON, the trainer
keeps none of its own. Field names are stable: scripts read them.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gstrain.files import write_text_atomic

SUMMARY_FILE = "train_summary.json"


@dataclass
class FitResult:
    status: str  # "done" | "stopped" (at train.stop_at) | "interrupted" | "nan"
    step: int  # steps completed
    seconds: float
    num_gaussians: int
    initial_test_psnr: float | None
    final_test_psnr: float | None
    checkpoint: Path | None
    final_train_psnr: float | None = None  # on the last progress step's training view
    startup_s: float | None = None  # the process's start to its first training step (None: not known)


@dataclass
class RunRecord:
    """Accumulated during one fit process (a resumed run starts a new record at first_step)."""

    first_step: int = 0
    max_gaussians: int = 0  # the most Gaussians in this process's fit (peak memory follows it)
    test_history: list[dict[str, float]] = field(default_factory=list)  # {step, psnr, ssim}
    last_test_views: tuple[int, dict[str, float]] | None = None  # (step, PSNR per test view)
    phase_ms_sum: dict[str, float] = field(default_factory=dict)  # over logged windows
    host_ms_sum: dict[str, float] = field(default_factory=dict)
    phase_steps: int = 0
    # bytes this rank sent to / received from other ranks over this process's steps (sharded runs)
    comm_sent: int = 0
    comm_received: int = 0
    rebalanced_at: list[int] = field(default_factory=list)  # steps a sharded run partitioned again at
    # tile-intersection pairs summed over the rendered training views (our CUDA render reports them)
    pairs_before: int = 0
    pairs_after: int = 0  # after dev.ellipse_cull (equal to pairs_before without it)
    pairs_views: int = 0
    graphs: dict[str, int] | None = None  # dev.cuda_graphs: captures, graph steps, redos, capacity
    startup_s: float | None = None  # from the process's start to its first training step (None: not known)
    startup_phases: dict[str, float] = field(default_factory=dict)  # the trainer's own parts of it, seconds
    pose_change: dict[str, Any] | None = None  # train.pose_refine: how far the cameras moved (pose_change)

    def add_pairs(self, pairs: tuple[int, int, int] | None) -> None:
        if pairs is not None:
            self.pairs_before += pairs[0]
            self.pairs_after += pairs[1]
            self.pairs_views += pairs[2]

    def add_window(self, phase_ms: dict[str, float], host_ms: dict[str, float], steps: int) -> None:
        """Per-step means of one timing window of `steps` steps."""
        for phase, ms in phase_ms.items():
            self.phase_ms_sum[phase] = self.phase_ms_sum.get(phase, 0.0) + ms * steps
        for phase, ms in host_ms.items():
            self.host_ms_sum[phase] = self.host_ms_sum.get(phase, 0.0) + ms * steps
        self.phase_steps += steps

    def per_step(self, sums: dict[str, float]) -> dict[str, float] | None:
        return {k: round(v / self.phase_steps, 4) for k, v in sums.items()} if self.phase_steps else None


def write_run_record(
    run_dir: Path,
    record: RunRecord,
    result: FitResult,
    final: dict[str, float] | None,
    train_views: dict[str, Any] | None,
    backend: str,
    atomic_mode: str | None,
    atomic_threshold: int | None,
    device: torch.device,
) -> dict[str, Any]:
    """Write <run>/train_summary.json for this fit process; returns what it wrote."""
    test_views = record.last_test_views
    summary = {
        "status": result.status,
        "steps": result.step,
        "first_step": record.first_step,  # where this process began (> 0: resumed)
        "seconds": round(result.seconds, 2),
        # the command's start-up: from the process's start (interpreter, imports, scene, model,
        # the step-0 evaluation) to the first training step
        "startup_seconds": None if record.startup_s is None else round(record.startup_s, 2),
        # its parts: the interpreter, imports and config; reading the scene; the renderer (CUDA
        # context, kernels); decoding the images (data.images_on gpu/host); the initial model (the
        # SfM points' neighbour search); the step-0 evaluation; and what none of them covers
        "startup_phases": startup_parts(record),
        "num_gaussians": result.num_gaussians,
        "max_gaussians": record.max_gaussians,  # set at the start of fit, raised on every change
        "initial_test_psnr": result.initial_test_psnr,
        "final_test_psnr": result.final_test_psnr,
        "final_test_ssim": final["ssim"] if final else None,
        # test views have no learned correction: the raw render above, and the fitted_half protocol
        # (a colour transform fitted on each view's left half, its right half scored; train/appearance.py)
        "final_test_psnr_fitted_half": final.get("psnr_fitted_half") if final else None,
        "final_train_psnr": result.final_train_psnr,
        "test_history": record.test_history,  # {step, psnr, ssim, *_fitted_half} at step 0 and every evaluation
        "final_test_views_psnr": test_views[1] if final and test_views and test_views[0] == result.step else None,
        # log.eval_train_views: every training view scored after the loop (not in `seconds`)
        "final_train_views": None if train_views is None else {
            "psnr": train_views["psnr"], "ssim": train_views["ssim"],
            "min_psnr": min(train_views["views_psnr"].values()), "views_psnr": train_views["views_psnr"],
        },
        "backend": backend,
        "atomic_mode": atomic_mode,  # our CUDA backward's reduction; None on other backends
        "atomic_threshold": atomic_threshold,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "phase_ms_per_step": record.per_step(record.phase_ms_sum),
        "host_ms_per_step": record.per_step(record.host_ms_sum),
        "wall_ms_per_step": round(result.seconds * 1e3 / max(result.step - record.first_step, 1), 4),
        "peak_gpu_memory_gib": (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None
        ),
    }  # fmt: skip
    if record.pairs_views:  # per rendered training view, mean over the run
        summary["isect_pairs_per_view"] = {"before_cull": round(record.pairs_before / record.pairs_views),
                                           "after_cull": round(record.pairs_after / record.pairs_views)}
    if record.graphs is not None:
        summary["cuda_graphs"] = dict(record.graphs)
    if record.pose_change is not None:  # degrees and fractions of the scene extent, per view and overall
        summary["pose_refinement"] = record.pose_change
    if record.rebalanced_at:
        summary["rebalanced_at"] = list(record.rebalanced_at)
    if record.comm_sent or record.comm_received:  # the writing rank's own exchange, per step
        steps = max(result.step - record.first_step, 1)
        summary["comm_bytes_per_step"] = {"sent": round(record.comm_sent / steps),
                                          "received": round(record.comm_received / steps)}
    write_text_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    return summary


def startup_parts(record: RunRecord) -> dict[str, float]:
    """The record's start-up phases, rounded, with "other": the start-up no phase accounts for."""
    parts = dict(record.startup_phases)
    if record.startup_s is not None and parts:
        parts["other"] = max(record.startup_s - sum(parts.values()), 0.0)
    return {k: round(v, 2) for k, v in parts.items()}


def seconds_since_process_start() -> float | None:
    """Seconds since this process started, from the kernel's record of its start (Linux
    /proc/self/stat, field 22, in clock ticks since boot, against CLOCK_BOOTTIME); None elsewhere."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of the whole line
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
