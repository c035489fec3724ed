"""How many CPU threads torch uses.

On the CPU path the per-step work is small (the demo's 128 px views), so torch's intra-op
threads mostly wait on each other; on a machine that is doing other work too, every extra
thread makes the whole step wait for the slowest one. Measured on 2 cores (README): one
thread is never slower and often much faster. On a GPU, torch's own default is kept.
"""

from __future__ import annotations

import torch

from gstrain.errors import UserError

AUTO_CPU_THREADS = 1


def apply_threads(requested: int, device: torch.device) -> int:
    """Set torch's intra-op thread count: `requested` (> 0), or the automatic choice (0)."""
    if requested < 0:
        raise UserError(f"train.threads must be >= 0 (0: auto); got {requested}")
    if requested == 0:
        if device.type == "cuda":
            return torch.get_num_threads()
        requested = AUTO_CPU_THREADS
    torch.set_num_threads(requested)
    return requested
