"""Adam per parameter group, as gsplat's strategies expect (one optimizer per parameter name)."""

from __future__ import annotations

from typing import Any

import torch

from gstrain.config import OptimConfig
from gstrain.train.moment_modes import init_optimizer_state


def build_optimizers(
    params: torch.nn.ParameterDict, cfg: OptimConfig, scene_extent: float
) -> dict[str, torch.optim.Optimizer]:
    """One Adam per tensor. The position rate scales with the scene so it is unit-free. With
    optim.moments=bf16 or int8 the state is made here in that mode's layout (the step paths read
    the mode from the state: train/moment_modes.py)."""
    lrs = {
        "means": cfg.means_lr * scene_extent,
        "scales": cfg.scales_lr,
        "quats": cfg.quats_lr,
        "opacities": cfg.opacities_lr,
        "sh0": cfg.sh0_lr,
        "shN": cfg.shN_lr,
    }
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, param in params.items():
        fused = param.is_cuda  # fused Adam is one kernel per tensor on the GPU
        optimizers[name] = torch.optim.Adam(
            [{"params": param, "lr": lrs[name], "name": name}], eps=cfg.eps, betas=(0.9, 0.999), fused=fused
        )
    init_optimizer_state(optimizers, cfg.moments)
    return optimizers


class ExponentialDecay:
    """Decays an optimizer's rate by `gamma` a step, in closed form from the group's initial rate.

    torch's ExponentialLR computes the same rates, but it warns ("lr_scheduler.step() before
    optimizer.step()") on every GPU run: our fused Adam updates all tensors in one launch and
    never calls torch's optimizer.step(), which is what that check watches.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gamma: float) -> None:
        self.optimizer = optimizer
        self.gamma = gamma
        self.steps_done = 0
        for group in optimizer.param_groups:
            # kept in the optimizer's state_dict, so a restored optimizer brings its start rate
            group.setdefault("initial_lr", group["lr"])
        self._apply()

    def step(self) -> None:
        self.steps_done += 1
        self._apply()

    def rewind(self, steps: int) -> None:
        """Take back `steps` steps (CUDA-graph replays whose update was skipped and is redone)."""
        self.steps_done -= int(steps)
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.gamma**self.steps_done

    def state_dict(self) -> dict[str, int]:
        return {"steps_done": self.steps_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # "last_epoch": checkpoints written while this was torch's ExponentialLR
        self.steps_done = int(state["steps_done"] if "steps_done" in state else state["last_epoch"])
        self._apply()


def build_means_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps: int) -> ExponentialDecay:
    """Exponential decay of the position rate from means_lr to means_lr_final over the run."""
    gamma = (cfg.means_lr_final / cfg.means_lr) ** (1.0 / max(steps, 1))
    return ExponentialDecay(optimizer, gamma)


def current_lrs(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, float]:
    return {name: opt.param_groups[0]["lr"] for name, opt in optimizers.items()}
