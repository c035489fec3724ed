"""The interface every densification strategy implements.

The trainer and `gstrain profile` call, per step: step_pre_backward (after the render, before
the loss), loss_term (added to the loss; None for none), step_post_backward (after the optimizer
step; True when the set of Gaussians may have changed). `state` is what a checkpoint stores.
Nothing here may read a value back from the GPU: it runs inside the timed step.
"""

from __future__ import annotations

from typing import Any

import torch

from gstrain.config import StrategyConfig
from gstrain.dev_config import DevConfig

Params = torch.nn.ParameterDict
Optimizers = dict[str, torch.optim.Optimizer]


class Strategy:
    """Base class: holds the config and the state dict; subclasses fill in the steps. `dev`: the
    config's dev section, for the speed switches a strategy has (None: their defaults).

    train.max_memory_gib reaches a strategy one of two ways: a strategy with its own Gaussian cap
    (`capped`: strategy.cap_max) is built with the cap lowered to what fits; one that grows freely
    asks `gate` (train/memory_budget.py GrowthGate, set by the trainer) before it grows."""

    capped = False  # the strategy keeps at most strategy.cap_max Gaussians

    def __init__(self, cfg: StrategyConfig, scene_extent: float, device: torch.device,
                 dev: DevConfig | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.dev = dev if dev is not None else DevConfig()
        self.scene_extent = scene_extent
        self.device = device
        self.state: dict[str, Any] = {}
        self.gate: Any = None  # a GrowthGate (train/memory_budget.py) or None: grow freely

    def check(self, params: Params, optimizers: Optimizers) -> None:
        """Raise when params and optimizers do not fit this strategy (called once, at set-up)."""

    def step_pre_backward(self, params: Params, optimizers: Optimizers, step: int, info: dict[str, Any]) -> None:
        """After the render of `step`, before its loss: e.g. ask for the screen-space gradient."""

    def step_post_backward(
        self, params: Params, optimizers: Optimizers, step: int, info: dict[str, Any], means_lr: float
    ) -> bool:
        """After the optimizer step of `step`; True when this step may have changed the Gaussian set."""
        raise NotImplementedError

    def loss_term(self, params: Params) -> torch.Tensor | None:
        """A regulariser added to the training loss, or None."""
        return None

    def for_owners(self, world: int) -> None:
        """Under `world` ranks this strategy sees one owner's Gaussians and their statistics
        (densification stays with the owner); a strategy with model-wide limits splits them here."""

    def graph_safe_at(self, step: int) -> bool:
        """True when a CUDA graph captured at another graph-safe step can stand for this step's
        strategy calls (dev.cuda_graphs); a strategy that does not say so always runs eagerly."""
        return False

    def graph_key(self, step: int) -> tuple:
        """What changes a graph-safe step's captured work (see DefaultStrategy)."""
        return ()

    def set_skip_flag(self, flag: torch.Tensor | None) -> None:
        """A device flag that makes this strategy's per-step kernels no-ops while non-zero."""

    def refines_at(self, step: int) -> bool:
        """gsplat refines after step `step` when start < step < stop and step % every == 0."""
        c = self.cfg
        return c.refine_start < step < c.refine_stop and step % c.refine_every == 0

    def state_dict(self) -> dict[str, Any]:
        return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.state = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in state.items()}


class GsplatStrategy(Strategy):
    """A strategy that drives one of gsplat's (self.gsplat), with its state in self.state."""

    gsplat: Any

    def check(self, params: Params, optimizers: Optimizers) -> None:
        self.gsplat.check_sanity(params, optimizers)

    def step_pre_backward(self, params: Params, optimizers: Optimizers, step: int, info: dict[str, Any]) -> None:
        self.gsplat.step_pre_backward(params, optimizers, self.state, step, info)
