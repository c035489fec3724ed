"""train.pose_refine: a learned pose correction per training view, optimised with the scene.

Each training view i has six numbers delta_i = (omega, tau), zero at the start (the identity).
The view is rendered through

    viewmat_i' = [R  extent * tau + p_i - R p_i] @ viewmat_i,   R = exp([omega]x)
                 [0  1                         ]

in camera coordinates: a rotation (axis-angle, radians) about the point p_i = (0, 0, d_i) on the
optical axis at the scene's median depth d_i (pivot_depths), then a translation in units of the
scene extent, so that one rate (optim.pose_lr) fits every scene. Gradients reach delta through
the renderer's projection and SH directions (the reference renderer is PyTorch; gsplat's
fully_fused_projection returns viewmat gradients; our fused SH kernel does not, so the trainer
renders SH colours through gsplat while poses are refined).

The update is Adam, per view: a view's row moves only at the steps that render it (a dense Adam
would keep moving every view on its momentum), with its own step count for the bias correction.
The rate decays exponentially from optim.pose_lr to optim.pose_lr_final between
train.pose_refine_start and train.steps; before the start the views render as given.

After each update the corrections lose their gauge component (train/pose_gauge.py): the seven
directions in which every camera moves by one similarity of the world, which the images cannot
see, and the three of a common rotation of every camera in its own frame, which they barely see.
Held there, the refined cameras stay in the given poses' frame on average, which is the frame the
test views are given in; left free they co-rotate with the scene and the test views, rendered
at their given poses, fall out of register (demo scene, 1 degree / 1% perturbation, 1000 steps:
test PSNR 22.08 dB free, 26.11 dB held, 21.92 dB without refinement).

Test views get no correction: their poses are not learned, so `gstrain eval` scores them as given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gstrain.data.scene import View
from gstrain.errors import UserError
from gstrain.train.corrections import EagerOnly, saved_correction
from gstrain.train.pose_gauge import gauge_basis, without_gauge

_BETAS = (0.9, 0.999)
_EPS = 1e-15
STATE_KEY = "pose_refine"  # its name among the checkpoint's corrections (train/corrections.py)


def correction_matrices(delta: Tensor, extent: float, pivots: Tensor) -> Tensor:
    """The [V,4,4] rigid transforms of V corrections delta [V,6] (axis-angle, translation / extent),
    each rotating about the point at depth pivots [V] on its camera's optical axis."""
    omega, tau = delta[:, :3], delta[:, 3:]
    zero = torch.zeros_like(omega[:, 0])
    skew = torch.stack([zero, -omega[:, 2], omega[:, 1],
                        omega[:, 2], zero, -omega[:, 0],
                        -omega[:, 1], omega[:, 0], zero], dim=-1).reshape(-1, 3, 3)  # fmt: skip
    rot = torch.linalg.matrix_exp(skew)
    pivot = torch.stack([zero, zero, pivots.to(delta)], dim=-1)  # [V,3] in camera coordinates
    shift = tau * extent + pivot - (rot @ pivot[:, :, None])[:, :, 0]
    top = torch.cat([rot, shift[:, :, None]], dim=2)
    bottom = torch.zeros_like(top[:, :1])
    bottom[:, 0, 3] = 1.0
    return torch.cat([top, bottom], dim=1)


def pivot_depths(viewmats: Sequence[Tensor], points: Any, extent: float) -> Tensor:
    """Each view's rotation pivot: the median depth of the scene's points in front of it (the
    extent where it sees none). Rotating about the scene rather than the camera centre keeps the
    well-seen image shift in the translation and leaves the rotation with the parallax, two
    directions of very different sensitivity that a per-coordinate Adam then scales apart."""
    pts = torch.as_tensor(points, dtype=torch.float64).reshape(-1, 3)
    depths = []
    for viewmat in viewmats:
        vm = viewmat.detach().double().cpu()
        z = pts @ vm[2, :3] + vm[2, 3]
        z = z[z > 0]
        depths.append(float(z.median()) if len(z) else float(extent))
    return torch.tensor(depths, dtype=torch.float32)


class PoseRefiner(EagerOnly):
    """The training views' pose corrections and their per-view Adam (a ViewCorrection,
    train/corrections.py; not graph-safe: its rows and step counts are chosen on the host).
    `gauge` is the basis whose span each step removes (None: the frame is pinned otherwise, as
    with a frozen scene, and nothing is removed)."""

    name = STATE_KEY

    def __init__(self, viewmats: Sequence[Tensor], pivots: Tensor, extent: float, cfg: Any,
                 device: torch.device) -> None:  # fmt: skip
        n_views = len(pivots)
        self.extent = float(extent)
        self.pivots = pivots.to(device)
        self.viewmats = [torch.as_tensor(m).detach().double().cpu() for m in viewmats]  # as given
        # the corrections that move every camera by one similarity of the world (train/pose_gauge.py)
        self.gauge = gauge_basis(self.viewmats, self.pivots, self.extent).to(device)
        self.delta = torch.zeros(n_views, 6, device=device, requires_grad=True)
        self.exp_avg = torch.zeros(n_views, 6, device=device)
        self.exp_avg_sq = torch.zeros(n_views, 6, device=device)
        self.updates = torch.zeros(n_views, dtype=torch.int64)  # Adam steps per view (host: no sync)
        self.lr, self.lr_final = float(cfg.optim.pose_lr), float(cfg.optim.pose_lr_final)
        self.start, self.steps = int(cfg.train.pose_refine_start), int(cfg.train.steps)
        self._rendered: list[int] = []  # the views this step rendered through a correction

    # ------------------------------------------------------------ ViewCorrection
    def camera(self, viewmat: Tensor, view: Any, step: int) -> Tensor:
        index = view.index
        if step < self.start or index is None:
            return viewmat
        self._rendered.append(index)
        fix = correction_matrices(self.delta[index : index + 1], self.extent, self.pivots[index : index + 1])[0]
        return fix.to(viewmat) @ viewmat

    def image(self, image: Tensor, view: Any) -> Tensor:
        return image

    def after_step(self, step: int) -> None:
        rendered, self._rendered = sorted(set(self._rendered)), []
        grad = self.delta.grad
        self.delta.grad = None
        if not rendered or grad is None:
            return
        rows = torch.tensor(rendered, device=self.delta.device)
        self.updates[rendered] += 1
        t = self.updates[rendered].to(self.delta)[:, None]
        g = grad[rows]
        b1, b2 = _BETAS
        with torch.no_grad():
            m = self.exp_avg[rows].mul_(b1).add_(g, alpha=1 - b1)
            v = self.exp_avg_sq[rows].mul_(b2).addcmul_(g, g, value=1 - b2)
            self.exp_avg[rows] = m
            self.exp_avg_sq[rows] = v
            step_size = self.rate(step) / (1 - b1**t)
            denom = (v / (1 - b2**t)).sqrt() + _EPS
            self.delta[rows] -= step_size * m / denom
            if self.gauge is not None:
                self.delta.copy_(without_gauge(self.delta, self.gauge))

    def rate(self, step: int) -> float:
        """The rate at step `step`: pose_lr at pose_refine_start, pose_lr_final at train.steps."""
        span = max(self.steps - self.start, 1)
        frac = min(max((step - self.start) / span, 0.0), 1.0)
        if self.lr <= 0.0 or self.lr_final <= 0.0:
            return self.lr * (1.0 - frac) if self.lr_final <= 0.0 else self.lr
        return self.lr * math.exp(frac * math.log(self.lr_final / self.lr))

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (train/state_file.py)."""
        return {"delta": self.delta.detach(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "updates": self.updates, "extent": self.extent, "pivots": self.pivots}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.delta.copy_(state["delta"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.updates.copy_(state["updates"])
        self.extent = float(state["extent"])
        self.pivots.copy_(state["pivots"])
        self.gauge = gauge_basis(self.viewmats, self.pivots, self.extent).to(self.delta.device)

    def refined(self, views: Sequence[View]) -> list[View]:
        """The training views with their learned poses (no gradients)."""
        return refined_views(views, self.state_dict())


def pose_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The pose corrections a checkpoint holds (None: the run did not refine poses)."""
    return saved_correction(checkpoint, STATE_KEY)


def refined_views(views: Sequence[View], state: dict[str, Any] | None) -> list[View]:
    """`views` (a run's training views, in training order) with the corrections of a checkpoint's
    STATE_KEY entry applied; unchanged when `state` is None (a run without train.pose_refine)."""
    if state is None:
        return list(views)
    delta = state["delta"].detach().float().cpu()
    if len(delta) != len(views):
        raise UserError(f"the checkpoint has {len(delta)} pose corrections (train.pose_refine) but the scene "
                        f"has {len(views)} training views; was the scene folder changed?")
    with torch.no_grad():
        fixes = correction_matrices(delta, float(state["extent"]), state["pivots"].float().cpu())
    return [v.with_pose((fix @ v.viewmat.float().cpu()).contiguous()) for v, fix in zip(views, fixes, strict=True)]


def attach_pose_refiner(cfg: Any, views: Sequence[View], points: Any, extent: float, renderer: Any, runner: Any,
                        device: torch.device, log: Any = print) -> PoseRefiner | None:  # fmt: skip
    """With train.pose_refine: a PoseRefiner on the step's corrections (None without). The paths
    that cannot give viewmat gradients are switched off: our fused SH kernel (SH colours go through
    gsplat's, said in one line); CUDA graphs, as it is not graph-safe (graph_step.graphs_possible)."""
    if not cfg.train.pose_refine:
        return None
    if renderer.backend == "cuda" and renderer.options.fused_sh:
        log("gstrain: train.pose_refine: SH colours through gsplat (the fused SH kernel has no camera gradient)")
        renderer.options = dataclasses.replace(renderer.options, fused_sh=False)
    viewmats = [v.viewmat for v in views]
    refiner = PoseRefiner(viewmats, pivot_depths(viewmats, points, extent), extent, cfg, device)
    runner.corrections.append(refiner)
    return refiner
