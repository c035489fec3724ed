"""Host values for a CUDA graph's replays: a device tensor the host refills before each replay.

A captured step reads values (Adam's step sizes, a rate) from fixed device storage; the host sets
them for each replay through a ring of pinned buffers, so the copy is asynchronous and stream-
ordered (a replay reads what was set before it) and a buffer is not refilled before its copy has
run. Used by train/capturable_adam.py (appearance) and train/pose_adam.py (pose refinement).
"""

from __future__ import annotations

import torch
from torch import Tensor

RING = 8  # pinned host buffers: the host may run this many replays ahead of the GPU


class DeviceFeed:
    """`value`: a float32 device tensor of `shape` that set() refills (plain copies on the CPU)."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.value = torch.zeros(shape, device=device)
        on_gpu = self.value.device.type == "cuda"
        self._ring = torch.zeros((RING, *shape), pin_memory=True) if on_gpu else None
        self._copied: list[torch.cuda.Event | None] = [None] * RING
        self._slot = 0

    def set(self, host: Tensor | float) -> None:
        """The next replays read `host` (a tensor of the value's shape, or a number for every element)."""
        if self._ring is None:
            self.value.copy_(torch.as_tensor(host, dtype=torch.float32).expand_as(self.value))
            return
        copied = self._copied[self._slot]
        if copied is not None:
            copied.synchronize()  # this slot's previous copy has been read: it may be refilled
        buffer = self._ring[self._slot]
        buffer.copy_(torch.as_tensor(host, dtype=torch.float32).expand_as(buffer))
        self.value.copy_(buffer, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._slot] = event
        self._slot = (self._slot + 1) % RING
