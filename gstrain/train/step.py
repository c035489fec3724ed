"""One optimisation step: render -> loss -> backward -> Adam -> densification bookkeeping.

Shared by the trainer and `gstrain profile`, so the profile times exactly the step `gstrain fit`
runs, with the same speed switches:
  render.backend       our CUDA rasterizer, or gsplat's (the reference on the CPU)
  render.atomic_mode   our rasterizer's backward reduction (arc)
  dev.fused_ssim       the fused SSIM kernel instead of PyTorch convolutions
  dev.fused_adam       one launch of our multi-tensor Adam instead of six torch Adam steps
  optim.sparse_adam    only the Gaussians drawn this step are updated
  optim.moments        Adam's moments in bfloat16 or 8 bits (train/moment_modes.py): their own
                       torch-op step where the fused kernel is not used
  dev.fast_stats       DefaultStrategy's statistics without its three host syncs a step
  dev.fused_bilateral  train.appearance=bilateral's slice-and-apply in one kernel each way
Nothing here reads a value back from the GPU. dev.cuda_graphs (graph_step.py) captures this
same step as a CUDA graph, with Adam's scalars on the device (graph_adam).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from gstrain.config import Config
from gstrain.render import Renderer
from gstrain.render.common import sum_pairs
from gstrain.render.isect import PairBudget
from gstrain.train import moment_modes
from gstrain.train.backward_adam import KEY, ShnInBackward
from gstrain.train.corrections import ViewCorrection, corrected_camera, corrected_image
from gstrain.train.fused_ssim import training_loss_for
from gstrain.train.masking import ViewMask, masked_loss
from gstrain.train.strategies.base import Strategy
from gstrain.train.timing import PhaseTimer


@dataclass
class StepResult:
    loss: Tensor  # detached, on the device
    terms: dict[str, Tensor]  # detached loss terms
    image: Tensor | None  # the step's first render [H, W, 3], detached (None: this rank rendered none)
    changed: bool  # densification may have changed the set of Gaussians
    # (Gaussian, tile) pairs from the intersection, after dev.ellipse_cull, and views: host ints
    # that our CUDA render reports (None on other backends)
    pairs: tuple[int, int, int] | None = None
    # the first render's target: floats [H, W, 3], or a training view's index (the loop turns it
    # into the image only when it reads the train PSNR); None with no render
    target: Tensor | int | None = None
    comm: tuple[int, int] | None = None  # bytes this rank sent and received (the sharded step)
    records: int = 0  # records this rank's Gaussians sent to other renderers (the sharded step)
    view_pairs: tuple[int, ...] | None = None  # each view's pairs after the cull, as `pairs` (None: not reported)


@dataclass
class StepView:
    """One view of a step: camera, target (float, [H,W,3]) and mask (None: every pixel). `valid`
    ([2] int32 on the device): the target is a canvas whose top-left valid part is the view, as
    the renderer's RasterOptions.valid_size (train/graph_step.py). `budget`: the pair budget this
    view's render uses (a CUDA-graph step's, one per batch slot; None: the renderer's options);
    with it the view's RasterOptions are the renderer's with this budget and `valid`."""

    viewmat: Tensor
    K: Tensor
    gt: Tensor
    mask: ViewMask | None = None
    valid: Tensor | None = None
    index: int | None = None  # the training view's index: per-view corrections read it (None: not a training view)
    budget: PairBudget | None = None
    # the training view's index on the device ([1] int32) in a CUDA-graph step, refilled before
    # each replay: a captured step may not read `index` (the host value is frozen at capture)
    slot: Tensor | None = None


BatchView = StepView  # the name bench scripts know


def _grads_of(tensors: list[Tensor], attr: str) -> Tensor | None:
    grads = [getattr(t, attr, None) for t in tensors]
    if all(g is None for g in grads):
        return None
    return torch.cat([torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True)])


def merge_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """The B single-view infos of a batch step as one gsplat info with n_cameras=B: means2d
    [B,N,2] carries the views' screen-space gradients (.grad, .absgrad), radii [B,N,2]."""
    m2d = [i["means2d"] for i in infos]
    merged = torch.cat([m.detach() for m in m2d])
    merged.grad = _grads_of(m2d, "grad")
    absgrad = _grads_of(m2d, "absgrad")
    if absgrad is not None:
        merged.absgrad = absgrad
    out = dict(infos[0])
    out.update(means2d=merged, n_cameras=len(infos))
    for key in ("radii", "depths", "conics"):
        out[key] = torch.cat([i[key] for i in infos])
    return out


class StepRunner:
    """Runs training steps on a parameter dict and its per-tensor optimizers (both owned by the caller)."""

    def __init__(self, cfg: Config, renderer: Renderer, strategy: Strategy, timer: PhaseTimer,
                 device: torch.device) -> None:  # fmt: skip
        self.cfg = cfg
        self.renderer = renderer
        self.strategy = strategy
        self.timer = timer
        # this runner's own loss: two runners in one process may train with different ones
        self.loss_fn = training_loss_for(device, cfg.dev.fused_ssim)
        self.fused_adam = None
        if device.type == "cuda" and cfg.dev.fused_adam:
            from gstrain.train.fused_adam import FusedAdam

            self.fused_adam = FusedAdam()
        self.sparse_adam = bool(cfg.optim.sparse_adam) and self.fused_adam is not None
        self.moments = cfg.optim.moments
        # (scalars, skip flag) while a CUDA graph of the step is captured (train/graph_step.py)
        self.graph_adam: tuple[Tensor, Tensor] | None = None
        # learned per training view, applied to its camera and render (train/corrections.py)
        self.corrections: list[ViewCorrection] = []
        self.shn_in_backward = ShnInBackward(self.fused_adam, self.moments) if cfg.dev.adam_in_backward else None

    def run(
        self,
        params: torch.nn.ParameterDict,
        optimizers: dict[str, torch.optim.Optimizer],
        step: int,
        views: list[StepView],
        sh_degree: int,
        background: Tensor | None,
        scheduler: Any = None,
    ) -> StepResult:
        """One step on B views (B = train.batch_size; one for the single-view step): loss = the
        mean of the B per-view losses, one backward, one optimizer step; densification sees all
        B views as gsplat's n_cameras=B. One view takes its loss and info as they are."""
        timer = self.timer
        infos, images, losses, terms_sum = [], [], [], {}
        render_params: Any = params  # the strategy and the optimizers keep `params` itself
        if self.steps_shn_in_backward(params, len(views)):
            assert self.shn_in_backward is not None
            render_params = self.shn_in_backward.wrap(params, optimizers, self.graph_adam, self.sparse_adam)
        for v in views:
            height, width = v.gt.shape[:2]
            with timer.phase("forward"):
                viewmat = corrected_camera(self.corrections, v.viewmat, v, step)
                options = None if v.budget is None else replace(self.renderer.options, pair_budget=v.budget,
                                                                valid_size=v.valid)  # fmt: skip
                image, _, info = self.renderer(render_params, viewmat, v.K, width, height, sh_degree, background,
                                               timer=timer, options=options)  # fmt: skip
            self.strategy.step_pre_backward(params, optimizers, step, info)
            with timer.phase("loss"):
                loss, terms = self.view_loss(image, v, background)
            losses.append(loss)
            terms_sum = terms if len(views) == 1 else {k: terms_sum.get(k, 0) + t.detach() for k, t in terms.items()}
            infos.append(info)
            images.append(image)
        loss = losses[0] if len(views) == 1 else torch.stack(losses).mean()
        with timer.phase("loss"):
            reg = self.strategy.loss_term(params)
            if reg is not None:
                loss = loss + reg
        info_fn = (lambda: infos[0]) if len(views) == 1 else (lambda: merge_infos(infos))
        changed = self.finish(params, optimizers, step, loss, info_fn, scheduler)
        terms_mean = {k: t.detach() / len(views) if len(views) > 1 else t.detach() for k, t in terms_sum.items()}
        view_pairs = [i.get("isect_pairs") for i in infos]
        kept = tuple(p[1] for p in view_pairs) if all(p is not None for p in view_pairs) else None
        return StepResult(loss.detach(), terms_mean, images[0].detach(), changed, sum_pairs(view_pairs),
                          target=views[0].gt, view_pairs=kept)  # fmt: skip

    def steps_shn_in_backward(self, params: Any, n_views: int) -> bool:
        """Whether this step's backward steps shN (dev.adam_in_backward, train/backward_adam.py):
        one view, and either our fused SH colours with fused Adam on a GPU (slices) or the CPU
        reference renderer with torch's Adam (the whole gradient; torch's fused CUDA Adam wants
        the gradients autograd accumulates, so a GPU without our fused Adam keeps the plain step)."""
        if self.shn_in_backward is None or n_views != 1 or KEY not in params:
            return False
        if self.fused_adam is not None:
            return self.renderer.backend == "cuda" and self.renderer.options.fused_sh
        return self.renderer.backend == "reference"

    def view_loss(self, image: Tensor, view: StepView, background: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """One view's photometric loss and its terms: on a canvas the fused loss over the valid
        part; else the view's mask (None: every pixel) under data.mask_mode (train/masking.py).
        The per-view corrections apply first: the loss sees the corrected render."""
        image = corrected_image(self.corrections, image, view)
        if view.valid is not None:
            from gstrain.train.fused_ssim import fused_photometric_loss

            return fused_photometric_loss(image, view.gt, self.cfg.train.ssim_lambda, valid=view.valid)
        return masked_loss(self.loss_fn, image, view.gt, self.cfg.train.ssim_lambda, view.mask,
                           self.cfg.data.mask_mode, background)  # fmt: skip

    def finish(self, params: torch.nn.ParameterDict, optimizers: dict[str, torch.optim.Optimizer], step: int,
               loss: Tensor, info_fn: Any, scheduler: Any = None) -> bool:  # fmt: skip
        """Backward, optimizer (and scheduler) step, densification; info_fn() gives the strategy
        info once the gradients exist. True when the set of Gaussians may have changed."""
        timer = self.timer
        with timer.phase("backward"):
            loss.backward()
        stepped: tuple[str, ...] = ()
        if self.shn_in_backward is not None and self.shn_in_backward.take_done():
            stepped = (KEY,)
            if params[KEY].grad is not None:
                raise RuntimeError(f"{KEY} was stepped in the backward but has another gradient")
        info = info_fn()
        with timer.phase("optimizer"):
            self.optimizer_step(optimizers, info, stepped)
            if scheduler is not None:
                scheduler.step()
            for correction in self.corrections:
                correction.after_step(step)
        with timer.phase("densify"):
            means_lr = optimizers["means"].param_groups[0]["lr"]
            changed = self.strategy.step_post_backward(params, optimizers, step, info, means_lr)
            if self.moments != "fp32":  # gsplat's operations grow the state in float32
                moment_modes.keep_layout(optimizers, self.moments)
        if changed:
            self.renderer.gaussians_changed(len(params["means"]), params)
        timer.step_done()
        return changed

    def optimizer_step(self, optimizers: dict[str, torch.optim.Optimizer], info: dict[str, Any],
                       stepped: tuple[str, ...] = ()) -> None:  # fmt: skip
        """Adam on every tensor but those `stepped` in the backward."""
        if self.fused_adam is None and stepped:
            optimizers = {key: opt for key, opt in optimizers.items() if key not in stepped}
        if self.fused_adam is None and self.moments != "fp32":
            moment_modes.adam_step(optimizers)
            return
        if self.fused_adam is None:
            for opt in optimizers.values():
                opt.step()
                opt.zero_grad(set_to_none=True)
            return
        # drawn by any of the step's views (radii [B,N,2])
        visible = (info["radii"] > 0).all(dim=-1).any(0) if self.sparse_adam else None
        scalars, skip = self.graph_adam if self.graph_adam is not None else (None, None)
        self.fused_adam.step(optimizers, visible, scalars=scalars, skip=skip, stepped=stepped)
