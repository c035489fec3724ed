"""train.pose_refine: a learned pose correction per training view, optimised with the scene.

Each training view i has six numbers delta_i = (omega, tau), zero at the start (the identity).
The view is rendered through

    viewmat_i' = [R  extent * tau + p_i - R p_i] @ viewmat_i,   R = exp([omega]x)
                 [0  1                         ]

in camera coordinates: a rotation (axis-angle, radians) about the point p_i = (0, 0, d_i) on the
optical axis at the scene's median depth d_i (pivot_depths), then a translation in units of the
scene extent, so that one rate (optim.pose_lr) fits every scene. Gradients reach delta through
the renderer's projection and SH directions (the reference renderer is PyTorch; gsplat's
fully_fused_projection returns viewmat gradients, as do our canvas projection and fused SH
colours, render/camera_grad.py). The rotation is Rodrigues' closed form of exp([omega]x):
torch.linalg.matrix_exp reads norms back to the host on CUDA, which a captured step cannot.

The update is Adam, per view: a view's row moves only at the steps that render it (a dense Adam
would keep moving every view on its momentum), with its own step count for the bias correction
(train/pose_adam.py). The rate decays exponentially from optim.pose_lr to optim.pose_lr_final
between train.pose_refine_start and train.steps; before the start the views render as given.

Under the CUDA-graph engine (train/graph_step.py) the correction is graph-safe
(train/corrections.py): a captured step picks the view's row by its index on the device
(StepView.slot), counts the rendered rows' steps on the device, reads the step's rate from a
device scalar the host sets before each replay (advance), and removes the gauge on the device.
Whether the poses learn at a step (train.pose_refine_start) is part of the graph's key.

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

import math
import statistics
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from gstrain.data.scene import View
from gstrain.errors import UserError
from gstrain.train.corrections import saved_correction
from gstrain.train.device_feed import DeviceFeed
from gstrain.train.pose_adam import row_adam_step
from gstrain.train.pose_align import view_errors
from gstrain.train.pose_gauge import gauge_basis

STATE_KEY = "pose_refine"  # its name among the checkpoint's corrections (train/corrections.py)
# below this squared angle (radians^2) the rotation's coefficients come from their Taylor series:
# their closed forms divide by the angle, and its square root has no gradient at zero
_SMALL_ANGLE_SQUARED = 1e-4


def _skew(vectors: Tensor) -> Tensor:
    """[V,3,3] matrices [v]x with [v]x w = v x w."""
    x, y, z = vectors.unbind(-1)
    zero = torch.zeros_like(x)
    return torch.stack([zero, -z, y, z, zero, -x, -y, x, zero], dim=-1).reshape(-1, 3, 3)


def rotation_exp(omega: Tensor) -> Tensor:
    """exp([omega]x) of axis-angle vectors omega [V,3] (radians): Rodrigues' formula
    I + sin(t)/t K + (1 - cos(t))/t^2 K^2 with K = [omega]x, t = |omega|, the second coefficient
    written as 2 (sin(t/2)/t)^2 (no cancellation at small angles). Device operations only, finite
    gradients at omega = 0."""
    skew = _skew(omega)
    t2 = (omega * omega).sum(-1)
    small = t2 < _SMALL_ANGLE_SQUARED
    t = torch.where(small, torch.ones_like(t2), t2).sqrt()
    sin_over_t = torch.where(small, 1 - t2 / 6 + t2 * t2 / 120, torch.sin(t) / t)
    half = torch.sin(t / 2) / t
    cos_term = torch.where(small, 0.5 - t2 / 24 + t2 * t2 / 720, 2 * half * half)
    eye = torch.eye(3, dtype=omega.dtype, device=omega.device)
    return eye + sin_over_t[:, None, None] * skew + cos_term[:, None, None] * (skew @ skew)


def correction_matrices(delta: Tensor, extent: float, pivots: Tensor) -> Tensor:
    """The [V,4,4] rigid transforms of V corrections delta [V,6] (axis-angle, translation / extent),
    each rotating about the point at depth pivots [V] on its camera's optical axis."""
    omega, tau = delta[:, :3], delta[:, 3:]
    rot = rotation_exp(omega)
    zero = torch.zeros_like(omega[:, 0])
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


class PoseRefiner:
    """The training views' pose corrections and their per-view Adam (a ViewCorrection,
    train/corrections.py, graph-safe: see the module docstring). `gauge` is the basis whose span
    each step removes (None: the frame is pinned otherwise, as with a frozen scene, and nothing is
    removed).

    Storage: delta, its moments, the step counts, the pivots, the gauge and the rate scalar keep
    their storage for the run (a captured graph reads them at fixed addresses): a checkpoint is
    copied into them."""

    name = STATE_KEY
    graph_safe = True

    def __init__(self, viewmats: Sequence[Tensor], pivots: Tensor, extent: float, cfg: Any,
                 device: torch.device) -> None:  # fmt: skip
        n_views = len(pivots)
        self.extent = float(extent)
        self.pivots = pivots.to(device)
        self.viewmats = [torch.as_tensor(m).detach().double().cpu() for m in viewmats]  # as given
        # the corrections that move every camera by one similarity of the world (train/pose_gauge.py)
        self.gauge: Tensor | None = gauge_basis(self.viewmats, self.pivots, self.extent).to(device)
        self.delta = torch.zeros(n_views, 6, device=device, requires_grad=True)
        self.exp_avg = torch.zeros(n_views, 6, device=device)
        self.exp_avg_sq = torch.zeros(n_views, 6, device=device)
        self.updates = torch.zeros(n_views, dtype=torch.int64, device=device)  # Adam steps per view
        self.lr, self.lr_final = float(cfg.optim.pose_lr), float(cfg.optim.pose_lr_final)
        self.start, self.steps = int(cfg.train.pose_refine_start), int(cfg.train.steps)
        self.rate_feed = DeviceFeed((), torch.device(device))  # a captured step's rate (advance)
        # the views this step rendered through a correction: host indices, or (a captured step) device ones
        self._rendered: list[int | Tensor] = []
        self._skip: Tensor | None = None  # the skip flag while a CUDA graph of the step is captured

    # ------------------------------------------------------------ ViewCorrection
    def camera(self, viewmat: Tensor, view: Any, step: int) -> Tensor:
        if step < self.start:
            return viewmat
        slot = getattr(view, "slot", None)
        if slot is not None:  # a captured step: the row chosen on the device
            row = slot.reshape(1).long()
            self._rendered.append(row)
            fix = correction_matrices(self.delta.index_select(0, row), self.extent, self.pivots.index_select(0, row))
        elif view.index is None:  # not a training view: nothing learned for it
            return viewmat
        else:
            index = view.index
            self._rendered.append(index)
            fix = correction_matrices(self.delta[index : index + 1], self.extent, self.pivots[index : index + 1])
        return fix[0].to(viewmat) @ viewmat

    def image(self, image: Tensor, view: Any) -> Tensor:
        return image

    def after_step(self, step: int) -> None:
        rendered, self._rendered = self._rendered, []
        grad = self.delta.grad
        self.delta.grad = None
        if not rendered or grad is None:
            return
        device = self.delta.device
        on_host = sorted({r for r in rendered if isinstance(r, int)})
        on_device = [r for r in rendered if isinstance(r, Tensor)]
        if on_host:  # (never inside a capture: a host-to-device copy cannot be captured)
            on_device.append(torch.tensor(on_host, dtype=torch.int64, device=device))
        rows = torch.cat(on_device)
        # a captured step reads the rate the host set before its replay; an eager one its own
        rate = self.rate_feed.value if self._skip is not None else torch.tensor(self.rate(step), dtype=torch.float32)
        row_adam_step(self.delta, grad, self.exp_avg, self.exp_avg_sq, self.updates, rows, rate, self.gauge,
                      self._skip)  # fmt: skip

    def rate(self, step: int) -> float:
        """The rate at step `step`: pose_lr at pose_refine_start, pose_lr_final at train.steps."""
        span = max(self.steps - self.start, 1)
        frac = min(max((step - self.start) / span, 0.0), 1.0)
        if self.lr <= 0.0 or self.lr_final <= 0.0:
            return self.lr * (1.0 - frac) if self.lr_final <= 0.0 else self.lr
        return self.lr * math.exp(frac * math.log(self.lr_final / self.lr))

    # ------------------------------------------------------------ CUDA graphs (corrections.py)
    def graph_key(self, step: int) -> Hashable:
        """What a captured step bakes in: whether the poses learn at `step`, the extent, and the
        addresses (and the gauge's shape) of what it reads and writes."""
        tensors = (self.delta, self.exp_avg, self.exp_avg_sq, self.updates, self.pivots, self.rate_feed.value)
        gauge = None if self.gauge is None else (self.gauge.data_ptr(), tuple(self.gauge.shape))
        return (step >= self.start, self.extent, gauge, *(t.data_ptr() for t in tensors))

    def advance(self, step: int) -> None:
        """Before a replay of step `step`: its rate into the device scalar the captured step reads."""
        if step >= self.start:
            self.rate_feed.set(self.rate(step))

    def rewind(self, steps: Sequence[int]) -> None:
        """Nothing to take back: the step counts are kept on the device, and a skipped replay left
        them as they were."""

    def set_skip_flag(self, flag: Tensor | None) -> None:
        """A capture begins (flag: the device flag that makes the update a no-op) or ends (None)."""
        self._skip = flag
        self.delta.grad = None
        self._rendered = []

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Plain tensors and numbers (train/state_file.py); the step counts on the host, as the
        checkpoints have always held them."""
        return {"delta": self.delta.detach(), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "updates": self.updates.cpu(), "extent": self.extent, "pivots": self.pivots}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.delta.copy_(state["delta"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.updates.copy_(state["updates"])
        self.extent = float(state["extent"])
        self.pivots.copy_(state["pivots"])
        gauge = gauge_basis(self.viewmats, self.pivots, self.extent).to(self.delta.device)
        if self.gauge is not None and self.gauge.shape == gauge.shape:
            self.gauge.copy_(gauge)  # in the storage graphs captured before read
        else:
            self.gauge = gauge

    def refined(self, views: Sequence[View]) -> list[View]:
        """The training views with their learned poses (no gradients)."""
        return refined_views(views, self.state_dict())

    @torch.no_grad()
    def change(self, names: Sequence[str]) -> dict[str, Any]:
        """How far the corrections move each training camera (named by `names`, in training order)
        from its given pose: pose_change of the given and the corrected world-to-camera matrices."""
        delta = self.delta.detach().double().cpu()
        fixes = correction_matrices(delta, self.extent, self.pivots.detach().double().cpu())
        return pose_change(self.viewmats, [fix @ m for fix, m in zip(fixes, self.viewmats, strict=True)],
                           self.extent, names)  # fmt: skip


def pose_change(given: Sequence[Tensor], moved: Sequence[Tensor], extent: float,
                names: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """Each camera's change from `given` to `moved` (world-to-camera [4,4] matrices): the angle of
    the rotation between them in degrees, and the distance between their centres as a fraction of
    `extent` (pose_align.view_errors); per view by name, and their medians and maxima with the
    view that moved most."""
    as_arrays = lambda mats: [m.detach().double().cpu().numpy() for m in mats]  # noqa: E731
    rotation, centre = (dict(zip(names, errors.tolist(), strict=True))
                        for errors in view_errors(as_arrays(moved), as_arrays(given), extent))  # fmt: skip

    def spread(values: dict[str, float]) -> dict[str, Any]:
        most = max(values, key=values.__getitem__)
        return {"median": statistics.median(values.values()), "max": values[most], "max_view": most}

    return {"rotation_deg": spread(rotation), "centre_of_extent": spread(centre),
            "views": {name: [rotation[name], centre[name]] for name in names}}  # fmt: skip


def describe_change(change: dict[str, Any]) -> str:
    """One line for the log: how far refinement moved the training cameras (pose_change)."""
    rot, centre = change["rotation_deg"], change["centre_of_extent"]
    return (f"pose refinement moved the training cameras by {rot['median']:.3f} deg (median; at most "
            f"{rot['max']:.3f}, {rot['max_view']}) and {centre['median']:.2%} of the scene extent (at most "
            f"{centre['max']:.2%}, {centre['max_view']})")


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


def attach_pose_refiner(cfg: Any, views: Sequence[View], points: Any, extent: float, runner: Any,
                        device: torch.device) -> PoseRefiner | None:  # fmt: skip
    """With train.pose_refine: a PoseRefiner on the step's corrections (None without). Every
    renderer path gives it viewmat gradients (the fused SH colours and the canvas projection
    through render/camera_grad.py), so the run keeps its renderer and its CUDA graphs."""
    if not cfg.train.pose_refine:
        return None
    viewmats = [v.viewmat for v in views]
    refiner = PoseRefiner(viewmats, pivot_depths(viewmats, points, extent), extent, cfg, device)
    runner.corrections.append(refiner)
    return refiner
