"""Per-phase timing of a training step: CUDA events on the GPU, wall clock on the CPU.

Recording never synchronises the host with the GPU: events are read only when the trainer asks
for a summary (at logging steps), after one synchronise.

On the GPU each phase also gets its host time (the wall clock the Python side spent issuing it):
when a step's host time exceeds its GPU time, the GPU waits on the host, and the events then
time those waits too. Comparing the two says which side bounds a phase.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Phases of a training step, in order. The render and backward phases are split further on the
# CUDA path: projection + raster_fwd make up forward, raster_bwd is the part of backward spent
# in the rasterizer kernel.
PHASES = ("data", "projection", "raster_fwd", "forward", "loss", "raster_bwd", "backward", "optimizer", "densify")


def timed_step(step: int, every: int) -> bool:
    """Whether the loop times step `step` (dev.time_every = every): every Nth step from N // 2 on,
    so the first step, which pays one-time costs (lazy set-up, kernel loading), never stands for
    the run's steps."""
    return step % every == every // 2


class _BackwardHook(torch.autograd.Function):
    """Identity in forward; calls `hook()` when the gradient passes through in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hook) -> torch.Tensor:  # type: ignore[override]
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.hook()
        return grad, None


class PhaseTimer:
    """Accumulates per-phase durations (ms) over the steps since the last `summary()`."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._pending: list[tuple[str, object, object]] = []  # (phase, start, end)
        self._totals: dict[str, float] = defaultdict(float)
        self._host_totals: dict[str, float] = defaultdict(float)
        self._steps = 0
        self.last_host_ms: dict[str, float] = {}  # host ms per step of each phase, as of the last summary()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self.cuda:
            t0 = time.perf_counter()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
            self._host_totals[name] += (time.perf_counter() - t0) * 1e3
        else:
            t0 = time.perf_counter()
            yield
            self._totals[name] += (time.perf_counter() - t0) * 1e3

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def backward_span(self, name: str) -> BackwardSpan:
        """Time the backward of one op: wrap its input with `span.input(x)` before calling it and
        its output with `span.output(y)` after. The gradient reaching the output starts the clock;
        the gradient leaving through the input stops it. No host sync."""
        return BackwardSpan(self, name)

    def step_done(self) -> None:
        """End of a step; it counts towards the means only if it was timed (`enabled`)."""
        if self.enabled:
            self._steps += 1

    @property
    def pending_steps(self) -> int:
        """Timed steps recorded since the last summary()."""
        return self._steps

    def summary(self) -> dict[str, float]:
        """Mean ms per step for each phase since the last call (one sync on the GPU), then reset."""
        if self.cuda and self._pending:
            self._pending[-1][2].synchronize()  # type: ignore[attr-defined]
            for name, start, end in self._pending:
                self._totals[name] += start.elapsed_time(end)  # type: ignore[attr-defined]
        steps = max(self._steps, 1)
        out = {name: total / steps for name, total in self._totals.items()}
        host = self._host_totals if self.cuda else self._totals
        self.last_host_ms = {name: total / steps for name, total in host.items()}
        self._pending.clear()
        self._totals = defaultdict(float)
        self._host_totals = defaultdict(float)
        self._steps = 0
        return out


class BackwardSpan:
    """See PhaseTimer.backward_span."""

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer = timer
        self.name = name
        self._start: object | None = None

    def _active(self) -> bool:
        return self.timer.enabled and torch.is_grad_enabled()

    def output(self, y: torch.Tensor) -> torch.Tensor:
        if not self._active():
            return y

        def start() -> None:
            self._start = self.timer._stamp()

        return _BackwardHook.apply(y, start)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        if not self._active():
            return x

        def end() -> None:
            if self._start is None:
                return
            timer = self.timer
            if timer.cuda:
                timer._pending.append((self.name, self._start, timer._stamp()))
            else:
                timer._totals[self.name] += (time.perf_counter() - self._start) * 1e3  # type: ignore[operator]

        return _BackwardHook.apply(x, end)
