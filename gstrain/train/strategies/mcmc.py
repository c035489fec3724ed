"""strategy.name=mcmc: gsplat's MCMCStrategy (relocation of dead Gaussians, noise on positions)
with its opacity and scale regularisers. Needs CUDA: gsplat's relocation is a CUDA kernel."""

from __future__ import annotations

from typing import Any

import torch
from gsplat.strategy import MCMCStrategy

from gstrain.config import StrategyConfig
from gstrain.dev_config import DevConfig
from gstrain.errors import UserError
from gstrain.train.strategies.base import GsplatStrategy, Optimizers, Params

OPACITY_REG = 0.01  # gsplat's recommended weights of the two L1 regularisers
SCALE_REG = 0.01


class McmcStrategy(GsplatStrategy):
    def __init__(self, cfg: StrategyConfig, scene_extent: float, device: torch.device,
                 dev: DevConfig | None = None) -> None:  # fmt: skip
        super().__init__(cfg, scene_extent, device, dev)
        if device.type != "cuda":
            raise UserError("strategy.name=mcmc needs a CUDA GPU (gsplat's relocation kernel); use default")
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
        self.gsplat.step_post_backward(params, optimizers, self.state, step, info, lr=means_lr)
        return self.refines_at(step)

    def loss_term(self, params: Params) -> torch.Tensor:
        """MCMC's opacity and scale L1 regularisers."""
        return OPACITY_REG * torch.sigmoid(params["opacities"]).mean() + SCALE_REG * torch.exp(params["scales"]).mean()
