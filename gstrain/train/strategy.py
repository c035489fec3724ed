"""Densification through gsplat's own strategies (DefaultStrategy, MCMCStrategy), not re-implemented."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from gsplat.strategy import DefaultStrategy, MCMCStrategy
from gsplat.strategy.ops import reset_opa

from gstrain.config import StrategyConfig
from gstrain.errors import UserError


@functools.cache
def gsplat_skips_opacity_reset() -> bool:
    """True for gsplat 1.5.3, whose DefaultStrategy never resets opacities.

    It tests `step % reset_every == 0 & step > 0`, which Python reads as the chained comparison
    `step % reset_every == (0 & step) > 0`, and `0 > 0` is false (gsplat issue #797, fixed
    upstream by PR #776). 1.5.2 and gsplat's main reset as 3DGS does, so the Densifier applies
    gsplat's own `reset_opa` on that schedule when the installed version carries the typo.
    """
    return "== 0 & step > 0" in inspect.getsource(DefaultStrategy.step_post_backward)


class FastStatsStrategy(DefaultStrategy):
    """gsplat's DefaultStrategy with its per-step statistics kept densely.

    Growing, pruning and resets are gsplat's own. Only `_update_state`, which runs every step
    until refine_stop, changes: gsplat gathers the visible Gaussians with torch.where and boolean
    indexing, three host syncs a step; here every Gaussian adds its norm or nothing (one kernel
    on the GPU), which gives the same grad2d and count. Cases that the dense form does not cover
    (packed renders, several cameras, the radii statistic) go to gsplat's code.
    """

    def _update_state(self, params, state, info, packed: bool = False) -> None:  # type: ignore[override]
        if packed or self.refine_scale2d_stop_iter > 0 or info["n_cameras"] != 1:
            return super()._update_state(params, state, info, packed=packed)
        means2d = info[self.key_for_gradient]
        grads = means2d.absgrad if self.absgrad else means2d.grad
        n = len(params["means"])
        if state["grad2d"] is None:
            state["grad2d"] = torch.zeros(n, device=grads.device)
        if state["count"] is None:
            state["count"] = torch.zeros(n, device=grads.device)
        scale_x = info["width"] / 2.0 * info["n_cameras"]
        scale_y = info["height"] / 2.0 * info["n_cameras"]
        radii = info["radii"].reshape(n, 2)
        grads = grads.reshape(n, 2)
        if grads.is_cuda:
            from gstrain.train.step_ops import ensure_built

            ensure_built().grad2d_stats(grads.float().contiguous(), radii.to(torch.int32).contiguous(),
                                        scale_x, scale_y, state["grad2d"], state["count"])  # fmt: skip
            return None
        visible = (radii > 0).all(dim=-1)
        scaled = grads.clone()
        scaled[:, 0] *= scale_x
        scaled[:, 1] *= scale_y
        norms = scaled.norm(dim=-1)
        state["grad2d"] += torch.where(visible, norms, torch.zeros_like(norms))
        state["count"] += visible.to(state["count"].dtype)
        return None


class Densifier:
    """Owns the gsplat strategy and its state; tells the trainer when the Gaussian set changed."""

    def __init__(self, cfg: StrategyConfig, scene_extent: float, device: torch.device) -> None:
        self.cfg = cfg
        if cfg.name == "mcmc":
            if device.type != "cuda":
                raise UserError("strategy.name=mcmc needs a CUDA GPU (gsplat's relocation kernel); use default")
            self.strategy: DefaultStrategy | MCMCStrategy = MCMCStrategy(
                cap_max=cfg.cap_max,
                refine_start_iter=cfg.refine_start,
                refine_stop_iter=cfg.refine_stop,
                refine_every=cfg.refine_every,
            )
            self.state: dict[str, Any] = self.strategy.initialize_state()
        else:
            strategy_cls = FastStatsStrategy if cfg.fast_stats else DefaultStrategy
            self.strategy = strategy_cls(
                prune_opa=cfg.prune_opa,
                grow_grad2d=cfg.grow_grad2d,
                grow_scale3d=cfg.grow_scale3d,
                prune_scale3d=cfg.prune_scale3d,
                refine_start_iter=cfg.refine_start,
                refine_stop_iter=cfg.refine_stop,
                refine_every=cfg.refine_every,
                reset_every=cfg.reset_every,
                absgrad=cfg.absgrad,
            )
            self.state = self.strategy.initialize_state(scene_scale=scene_extent)

    @property
    def is_mcmc(self) -> bool:
        return isinstance(self.strategy, MCMCStrategy)

    def check(self, params: torch.nn.ParameterDict, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.strategy.check_sanity(params, optimizers)

    def pre_backward(self, params, optimizers, step: int, info: dict[str, Any]) -> None:
        self.strategy.step_pre_backward(params, optimizers, self.state, step, info)

    def post_backward(
        self, params, optimizers, step: int, info: dict[str, Any], means_lr: float
    ) -> bool:
        """Run the strategy; True when this step may have changed the Gaussian set (no host sync)."""
        if self.is_mcmc:
            self.strategy.step_post_backward(params, optimizers, self.state, step, info, lr=means_lr)
        else:
            self.strategy.step_post_backward(params, optimizers, self.state, step, info, packed=False)
            if self.resets_at(step) and gsplat_skips_opacity_reset():
                reset_opa(params=params, optimizers=optimizers, state=self.state, value=2.0 * self.cfg.prune_opa)
        return self.refines_at(step)

    def resets_at(self, step: int) -> bool:
        """DefaultStrategy resets opacities (to 2 x prune_opa) after step `step` when 0 < step <
        refine_stop and step % reset_every == 0, as gsplat's fixed condition reads."""
        c = self.cfg
        return not self.is_mcmc and 0 < step < c.refine_stop and step % c.reset_every == 0

    def refines_at(self, step: int) -> bool:
        """gsplat refines after step `step` when step > start, step % every == 0, step < stop."""
        c = self.cfg
        return c.refine_start < step < c.refine_stop and step % c.refine_every == 0

    def mcmc_regularisers(self, params: torch.nn.ParameterDict) -> torch.Tensor | None:
        """MCMC's opacity and scale L1 regularisers (gsplat's recommended 0.01 each)."""
        if not self.is_mcmc:
            return None
        return 0.01 * torch.sigmoid(params["opacities"]).mean() + 0.01 * torch.exp(params["scales"]).mean()

    def state_dict(self) -> dict[str, Any]:
        return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        self.state = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in state.items()}
