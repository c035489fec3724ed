"""The one piece of torch Adam's per-parameter state that every step path reads the same way:
its step count, kept on the host (fused_adam.py, bf16_moments.py, int8_moments.py)."""

from __future__ import annotations

import torch
from torch import Tensor


def host_step(state: dict) -> Tensor:
    """The state's step as a CPU tensor (a checkpoint of torch's fused Adam has it on the GPU), so
    that counting it and reading it never syncs with the device."""
    step = state["step"]
    if not torch.is_tensor(step):
        step = torch.tensor(float(step), dtype=torch.float32)
    elif step.device.type != "cpu":
        step = step.detach().to("cpu", torch.float32)  # once, after a resume
    state["step"] = step
    return step
