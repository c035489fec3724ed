"""strategy.name=default: gsplat's DefaultStrategy (clone, split, prune, opacity reset), driven
as gsplat ships it, with two changes of ours: FastStatsStrategy's per-step statistics without
host syncs, and the opacity reset that gsplat 1.5.3 skips (see gsplat_skips_opacity_reset)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from gsplat.strategy import DefaultStrategy as GsplatDefaultStrategy
from gsplat.strategy.ops import reset_opa

from gstrain.config import StrategyConfig
from gstrain.dev_config import DevConfig
from gstrain.train.memory_budget import measured_peak
from gstrain.train.strategies.base import GsplatStrategy, Optimizers, Params


class _ResetProbe(GsplatDefaultStrategy):
    """gsplat's DefaultStrategy with no statistics: its post-backward step needs no gradients."""

    def _update_state(self, *args: Any, **kwargs: Any) -> None:
        return None


@functools.cache
def gsplat_skips_opacity_reset() -> bool:
    """True when the installed gsplat's DefaultStrategy does not reset opacities on its schedule.

    Found by running it, not by reading its version or source: two Gaussians of opacity 0.5 go
    through step_post_backward at a reset step (reset_every=2, step 2, no refinement due), and a
    reset would lower them to 2 x prune_opa. gsplat 1.5.3 tests `step % reset_every == 0 & step > 0`,
    which Python reads as the chained comparison `step % reset_every == (0 & step) > 0` and
    never resets (gsplat issue #797, fixed upstream by PR #776); 1.5.2 and main reset.
    """
    params = torch.nn.ParameterDict({
        "means": torch.zeros(2, 3), "scales": torch.zeros(2, 3), "quats": torch.tensor([[1.0, 0, 0, 0]] * 2),
        "opacities": torch.zeros(2), "sh0": torch.zeros(2, 1, 3), "shN": torch.zeros(2, 0, 3),
    })  # fmt: skip
    optimizers: Optimizers = {k: torch.optim.Adam([p], lr=0.0) for k, p in params.items()}
    probe = _ResetProbe(refine_start_iter=10, refine_stop_iter=100, refine_every=10, reset_every=2)
    state = probe.initialize_state(scene_scale=1.0)
    probe.step_post_backward(params, optimizers, state, step=2, info={}, packed=False)
    return bool(torch.equal(params["opacities"].detach(), torch.zeros(2)))


class FastStatsStrategy(GsplatDefaultStrategy):
    """gsplat's DefaultStrategy with its per-step statistics kept densely.

    Growing, pruning and resets are gsplat's own. Only `_update_state`, which runs every step
    until refine_stop, changes: gsplat gathers the visible Gaussians with torch.where and boolean
    indexing, three host syncs a step; here every Gaussian adds its norm or nothing (one kernel
    on the GPU), which gives the same grad2d and count. Cases that the dense form does not cover
    (packed renders, the radii statistic) go to gsplat's code. Several cameras (a batch step,
    means2d [B,N,2]) add each camera's norm, as gsplat does. skip_flag (a device int32, set while a
    CUDA graph is captured): when non-zero at run time, the update is skipped (render/isect.py).
    """

    skip_flag = None

    def _update_state(self, params, state, info, packed: bool = False) -> None:  # type: ignore[override]
        if packed or self.refine_scale2d_stop_iter > 0:
            return super()._update_state(params, state, info, packed=packed)
        means2d = info[self.key_for_gradient]
        grads = means2d.absgrad if self.absgrad else means2d.grad
        n = len(params["means"])
        cams = int(info["n_cameras"])  # B views of a batch step: each adds its own norm
        if state["grad2d"] is None:
            state["grad2d"] = torch.zeros(n, device=grads.device)
        if state["count"] is None:
            state["count"] = torch.zeros(n, device=grads.device)
        # the loss is the mean over the cameras: gsplat scales the gradients back by their number
        scale_x = info["width"] / 2.0 * cams
        scale_y = info["height"] / 2.0 * cams
        radii = info["radii"].reshape(cams, n, 2)
        grads = grads.reshape(cams, n, 2)
        if grads.is_cuda:
            from gstrain import extensions

            size = info.get("valid_size")  # a render on a canvas: the view's size is on the device
            if size is not None:
                scale_x = scale_y = 0.5 * cams
            for c in range(cams):
                extensions.step_ops().grad2d_stats(
                    grads[c].float().contiguous(), radii[c].to(torch.int32).contiguous(), scale_x, scale_y,
                    state["grad2d"], state["count"], self.skip_flag, size,
                )  # fmt: skip
            return None
        visible = (radii > 0).all(dim=-1)
        scaled = grads.clone()
        scaled[..., 0] *= scale_x
        scaled[..., 1] *= scale_y
        norms = scaled.norm(dim=-1)
        state["grad2d"] += torch.where(visible, norms, torch.zeros_like(norms)).sum(0)
        state["count"] += visible.to(state["count"].dtype).sum(0)
        return None


class DefaultStrategy(GsplatStrategy):
    """gsplat's DefaultStrategy (FastStatsStrategy unless dev.fast_stats=false) and its state."""

    def __init__(self, cfg: StrategyConfig, scene_extent: float, device: torch.device,
                 dev: DevConfig | None = None) -> None:  # fmt: skip
        super().__init__(cfg, scene_extent, device, dev)
        strategy_cls = FastStatsStrategy if self.dev.fast_stats else GsplatDefaultStrategy
        self.gsplat = strategy_cls(
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
        self.state = self.gsplat.initialize_state(scene_scale=scene_extent)
        grow = self.gsplat._grow_gs

        def gated_grow(params: Params, optimizers: Optimizers, state: dict[str, Any], step: int) -> tuple[int, int]:
            """gsplat's growth, skipped when train.max_memory_gib has no room for it (pruning goes on)."""
            if self.gate is not None and self.gate.budget is not None and not self._may_grow(params, state, step):
                return 0, 0
            return grow(params, optimizers, state, step)

        self.gsplat._grow_gs = gated_grow

    def _may_grow(self, params: Params, state: dict[str, Any], step: int) -> bool:
        """Whether the Gaussians gsplat's growth would add (one each: a duplicate, or a split that
        replaces one with two) fit the memory budget. A refine step's count: gsplat reads its own
        counts back there too, so this costs no extra sync on the steps between."""
        g = self.gsplat
        high = state["grad2d"] / state["count"].clamp_min(1) > g.grow_grad2d
        if step < g.refine_scale2d_stop_iter:
            high |= state["radii"] > g.grow_scale2d
        adding = int(high.sum())
        return self.gate.may_grow_to(len(params["means"]) + adding, adding, measured_peak(self.device))

    def step_post_backward(
        self, params: Params, optimizers: Optimizers, step: int, info: dict[str, Any], means_lr: float
    ) -> bool:
        self.gsplat.step_post_backward(params, optimizers, self.state, step, info, packed=False)
        if self.resets_at(step) and gsplat_skips_opacity_reset():
            reset_opa(params=params, optimizers=optimizers, state=self.state, value=2.0 * self.cfg.prune_opa)
        return self.refines_at(step)

    def graph_safe_at(self, step: int) -> bool:
        """Only the per-step statistics happen after `step` (no refinement, no reset), and they
        are FastStatsStrategy's kernel: a CUDA graph of the step can replay it."""
        if not isinstance(self.gsplat, FastStatsStrategy) or self.gsplat.refine_scale2d_stop_iter > 0:
            return False
        return not self.refines_at(step) and not self.resets_at(step)

    def graph_key(self, step: int) -> tuple:
        """What a graph captured at one graph-safe step must share with a step that replays it:
        whether statistics are kept, and the tensors they live in."""
        if step >= self.cfg.refine_stop:
            return (False,)
        grad2d, count = self.state.get("grad2d"), self.state.get("count")
        ptrs = tuple(t.data_ptr() if torch.is_tensor(t) else None for t in (grad2d, count))
        return (True, *ptrs)

    def set_skip_flag(self, flag: torch.Tensor | None) -> None:
        if isinstance(self.gsplat, FastStatsStrategy):
            self.gsplat.skip_flag = flag

    def resets_at(self, step: int) -> bool:
        """Opacities reset (to 2 x prune_opa) after step `step` when 0 < step < refine_stop and
        step % reset_every == 0, as gsplat's fixed condition reads."""
        c = self.cfg
        return 0 < step < c.refine_stop and step % c.reset_every == 0
