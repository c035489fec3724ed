"""What a run carries between steps besides the model: the view order, the random generators'
state, the Ctrl-C / SIGTERM flag the training loops poll, and what a step is due for or the
ranks agreed on."""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class ViewSampler:
    """Shuffled passes over the training views, reproducible and resumable."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.pos = 0

    def next(self) -> int:
        if self.pos >= len(self.order):
            self.order = torch.randperm(self.n, generator=self.gen).tolist()
            self.pos = 0
        idx = self.order[self.pos]
        self.pos += 1
        return idx

    def peek(self, count: int) -> list[int]:
        """The next `count` indices next() will return, without drawing them: the image store
        fetches ahead in this order. Passes not drawn yet come from a copy of the generator."""
        ahead = self.order[self.pos : self.pos + count]
        if len(ahead) < count:
            gen = torch.Generator().manual_seed(0)
            gen.set_state(self.gen.get_state())
            while len(ahead) < count:
                ahead += torch.randperm(self.n, generator=gen).tolist()
        return ahead[:count]

    def state_dict(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.gen.set_state(state["gen"])
        self.order = list(state["order"])
        self.pos = int(state["pos"])


class _StopFlag:
    """First Ctrl-C (or SIGTERM) asks the loop to stop after the current step and save; a second
    aborts, unless not `abort_on_second`: under torchrun, which forwards SIGTERM after the
    terminal's SIGINT, the ranks agree on the stop at their next sync step instead."""

    def __init__(self, abort_on_second: bool = True) -> None:
        self.abort_on_second = abort_on_second
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        def handler(signum: int, frame: Any) -> None:
            if self.requested and self.abort_on_second:
                raise KeyboardInterrupt
            self.requested = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. called from a test runner thread)
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    """Every generator's state as plain data (a checkpoint holds no numpy objects: state_file.py)."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}},
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):  # else the tuple of numpy.random.get_state() (older checkpoints)
        key = np.asarray(numpy_state["state"]["key"], dtype=np.uint32)
        numpy_state = {**numpy_state, "state": {**numpy_state["state"], "key": key}}
    np.random.set_state(numpy_state)
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Agreement:
    """What the loop knows at a sync step: the loss (summed over ranks), the Gaussian count, and
    whether any rank asked to stop or went non-finite."""

    loss: float
    count: int
    stop: bool
    bad: bool


@dataclass
class _Due:
    """What a step is due for."""

    logging: bool
    progress: bool
    saving: bool
    evaluating: bool
    exporting: bool

    @property
    def any(self) -> bool:
        return self.logging or self.progress or self.saving or self.evaluating or self.exporting
