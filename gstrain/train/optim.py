"""Adam per parameter group, as gsplat's strategies expect (one optimizer per parameter name)."""

from __future__ import annotations

import torch

from gstrain.config import OptimConfig


def build_optimizers(
    params: torch.nn.ParameterDict, cfg: OptimConfig, scene_extent: float
) -> dict[str, torch.optim.Optimizer]:
    """One Adam per tensor. The position rate scales with the scene so it is unit-free."""
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
    return optimizers


def build_means_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, steps: int
) -> torch.optim.lr_scheduler.ExponentialLR:
    """Exponential decay of the position rate from means_lr to means_lr_final over the run."""
    gamma = (cfg.means_lr_final / cfg.means_lr) ** (1.0 / max(steps, 1))
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=gamma)


def current_lrs(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, float]:
    return {name: opt.param_groups[0]["lr"] for name, opt in optimizers.items()}
