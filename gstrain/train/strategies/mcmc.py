"""strategy.name=mcmc: gsplat's MCMCStrategy (relocation of dead Gaussians, noise on positions)
with its opacity and scale regularisers. On the CPU gsplat's CUDA-only steps are mcmc_cpu.py's.
With several ranks each owner relocates and samples among its own Gaussians, up to its share of
strategy.cap_max."""

from __future__ import annotations

from typing import Any

import torch
from gsplat.strategy import MCMCStrategy

from gstrain.config import StrategyConfig
from gstrain.dev_config import DevConfig
from gstrain.train.strategies.base import GsplatStrategy, Optimizers, Params
from gstrain.train.strategies.mcmc_cpu import cpu_ops

OPACITY_REG = 0.01  # gsplat's recommended weights of the two L1 regularisers
SCALE_REG = 0.01


class McmcStrategy(GsplatStrategy):
    capped = True  # train.max_memory_gib lowers strategy.cap_max (train/memory_budget.py)
    share = 1.0  # the part of the model this process owns (for_owners)

    def __init__(self, cfg: StrategyConfig, scene_extent: float, device: torch.device,
                 dev: DevConfig | None = None) -> None:  # fmt: skip
        super().__init__(cfg, scene_extent, device, dev)
        self.gsplat = MCMCStrategy(
            cap_max=cfg.cap_max,
            refine_start_iter=cfg.refine_start,
            refine_stop_iter=cfg.refine_stop,
            refine_every=cfg.refine_every,
        )
        self.state = self.gsplat.initialize_state()

    def step_post_backward(
        self, params: Params, optimizers: Optimizers, step: int, info: dict[str, Any], means_lr: float
    ) -> bool:
        if self.device.type == "cuda":
            self.gsplat.step_post_backward(params, optimizers, self.state, step, info, lr=means_lr)
        else:
            with cpu_ops():
                self.gsplat.step_post_backward(params, optimizers, self.state, step, info, lr=means_lr)
        return self.refines_at(step)

    def for_owners(self, world: int) -> None:
        """Each of `world` owners grows its shard to cap_max / world, and its regulariser (a mean
        over its own Gaussians) weighs a 1/world share, as in the whole model's mean."""
        self.share = 1.0 / world
        self.gsplat.cap_max = max(1, self.cfg.cap_max // world)

    def loss_term(self, params: Params) -> torch.Tensor:
        """MCMC's opacity and scale L1 regularisers."""
        reg = OPACITY_REG * torch.sigmoid(params["opacities"]).mean() + SCALE_REG * torch.exp(params["scales"]).mean()
        return reg * self.share if self.share != 1.0 else reg
