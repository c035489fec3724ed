"""`gstrain profile`'s untimed steps: a workload's steps as `gstrain fit` runs them between its
timed ones, by the step engine `gstrain fit` would choose (train/engine.py): CUDA-graph replays
(dev.cuda_graphs) where the configuration allows, else eager steps. Per-phase CUDA events
force a step to run eagerly, so the
profile takes its phase rows from timed steps and its wall clock from these.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gstrain.config import Config
from gstrain.train.context import StepContext, TrainViews
from gstrain.train.engine import build_engine, choose_engine
from gstrain.train.optim import build_means_scheduler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Cycle:
    """The views in turn from `start` (the profile's view order), as a step engine draws them."""

    def __init__(self, n: int, start: int) -> None:
        self.n, self.i = n, start

    def next(self) -> int:
        idx = self.i % self.n
        self.i += 1
        return idx


class ProfileSteps:
    """A profile's WorkloadSteps (gstrain.profile) run by the step engine fit would choose: the
    same parameters, optimizers and step runner in a StepContext, the views as uint8 images, and
    a rate decay."""

    def __init__(self, steps: Any, cfg: Config) -> None:
        self.device = steps.device
        work = steps.work
        images = [(t * 255.0).round().clamp(0, 255).to(torch.uint8) for t in work.targets]
        self.ctx = StepContext(
            cfg=cfg, device=steps.device, params=steps.params, optimizers=steps.optimizers,
            scheduler=build_means_scheduler(steps.optimizers["means"], cfg.optim, cfg.train.steps),
            strategy=steps.runner.strategy, runner=steps.runner,
            views=TrainViews(images, [(viewmat, K) for viewmat, K, _, _ in work.cameras], [None] * len(images)),
            sampler=_Cycle(len(images), steps.step), sh_degree=lambda step: work.sh_degree, timer=steps.timer,
            background=steps.background,
        )  # fmt: skip
        self.engine = build_engine(choose_engine(self.ctx), self.ctx)
        self.n_views = len(images)
        self.step = steps.step

    def one_step(self) -> None:
        """The next step on the next view, untimed: a graph step where the graph engine allows."""
        self.ctx.timer.enabled = False
        self.engine.step(self.step)
        self.step += 1

    def windows(self, iters: int, window: int) -> tuple[list[float], float]:
        """Wall-clock ms per step of each window of `iters` untimed steps after one warm-up pass
        over the views (each image size captured), and the share of them that ran as graphs."""
        for _ in range(self.n_views + 1):
            self.one_step()
        graph_before = self._graph_steps()
        walls, done = [], 0
        while done < iters:
            n = min(window, iters - done)
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(n):
                self.one_step()
            self.engine.settle()
            _sync(self.device)
            walls.append((time.perf_counter() - t0) * 1e3 / n)
            done += n
        self.ctx.timer.enabled = True
        return walls, (self._graph_steps() - graph_before) / max(iters, 1)

    def _graph_steps(self) -> int:
        self.engine.settle()
        return getattr(self.engine, "views", 0)  # the graph engine's settled graph steps
