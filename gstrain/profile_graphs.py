"""`gstrain profile`'s untimed steps: a workload's steps as `gstrain fit` runs them between its
timed ones, replayed as CUDA graphs (dev.cuda_graphs, train/graph_step.py) where the
configuration allows, else eagerly. Per-phase CUDA events force a step to run eagerly, so the
profile takes its phase rows from timed steps and its wall clock from these.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gstrain.config import Config
from gstrain.train.graph_step import GraphSteps, graphs_possible
from gstrain.train.optim import build_means_scheduler


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GraphHost:
    """What GraphSteps reads of a Trainer, over a profile's WorkloadSteps (gstrain.profile): the
    same parameters, optimizers and step runner, the views as uint8 images, and a rate decay."""

    def __init__(self, steps: Any, cfg: Config) -> None:
        self.device = steps.device
        self.params, self.optimizers, self.runner = steps.params, steps.optimizers, steps.runner
        self.renderer, self.strategy, self.timer = steps.runner.renderer, steps.runner.strategy, steps.timer
        self.background = steps.background
        self.viewer = None
        work = steps.work
        self.train_images = [(t * 255.0).round().clamp(0, 255).to(torch.uint8) for t in work.targets]
        self.train_cams = [(viewmat, K) for viewmat, K, _, _ in work.cameras]
        self.train_masks = [None] * len(self.train_images)
        self.scheduler = build_means_scheduler(self.optimizers["means"], cfg.optim, cfg.train.steps)
        self.sh_degree = work.sh_degree
        self.step = steps.step
        on = graphs_possible(cfg, self.renderer, self.runner, self.device)
        self.graphs: GraphSteps | None = GraphSteps(self) if on else None

    def active_sh_degree(self) -> int:
        return self.sh_degree

    def one_step(self) -> None:
        """The next step on the next view, untimed: a graph step where GraphSteps allows."""
        idx = self.step % len(self.train_images)
        self.timer.enabled = False
        if self.graphs is not None:
            self.graphs.run(self.step, idx)
        else:
            viewmat, K = self.train_cams[idx]
            gt = self.train_images[idx].float() / 255.0
            self.runner.run(self.params, self.optimizers, self.step, viewmat, K, gt, self.sh_degree,
                            self.background, scheduler=self.scheduler)  # fmt: skip
        self.step += 1

    def windows(self, iters: int, window: int) -> tuple[list[float], float]:
        """Wall-clock ms per step of each window of `iters` untimed steps after one warm-up pass
        over the views (each image size captured), and the share of them that ran as graphs."""
        for _ in range(len(self.train_images) + 1):
            self.one_step()
        graph_before = self._graph_steps()
        walls, done = [], 0
        while done < iters:
            n = min(window, iters - done)
            _sync(self.device)
            t0 = time.perf_counter()
            for _ in range(n):
                self.one_step()
            if self.graphs is not None:
                self.graphs.settle()
            _sync(self.device)
            walls.append((time.perf_counter() - t0) * 1e3 / n)
            done += n
        self.timer.enabled = True
        return walls, (self._graph_steps() - graph_before) / max(iters, 1)

    def _graph_steps(self) -> int:
        if self.graphs is None:
            return 0
        self.graphs.settle()
        return self.graphs.views
