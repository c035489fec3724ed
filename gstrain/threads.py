"""How many CPU threads torch uses.

On the CPU path the per-step work is small (the demo's 128 px views), so torch's intra-op
threads mostly wait on each other; on a machine that is doing other work too, every extra
thread makes the whole step wait for the slowest one. Measured on 2 cores (README): one
thread is never slower and often much faster. On a GPU, torch's own default is kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from gstrain.errors import UserError

AUTO_CPU_THREADS = 1


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container or taskset may allow fewer
    than the machine has)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def apply_threads(requested: int, device: torch.device, log: Callable[[str], None] | None = None) -> int:
    """Set torch's intra-op thread count: `requested` (> 0), or the automatic choice (0).

    More threads than CPUs only queue behind each other (hundreds of times slower), so a larger
    count is capped at the CPUs available, with a one-line note: a config written on a bigger
    machine still runs here."""
    if requested < 0:
        raise UserError(f"train.threads must be >= 0 (0: auto); got {requested}")
    if requested == 0:
        if device.type == "cuda":
            return torch.get_num_threads()
        requested = AUTO_CPU_THREADS
    cpus = available_cpus()
    if requested > cpus:
        if log is not None:
            log(f"gstrain: train.threads={requested} is more than the {cpus} CPUs this process may use; "
                f"using {cpus}")
        requested = cpus
    torch.set_num_threads(requested)
    return requested
