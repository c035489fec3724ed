"""train.appearance: a per-image colour correction learned with the scene, and the honest ways to
score test views, which have none.

Why: phone captures change exposure and white balance from frame to frame. Without a correction
the Gaussians absorb each frame's colour cast as view-dependent colour (floaters, SH noise); with
one, the scene keeps one colour and each training image its own transform.

The model (`affine`): per training image a 3x4 matrix [A | b], the loss comparing
A @ render + b with the photo. Initialised to identity and zero, so a run starts as without it.
A 3x4 affine holds both a per-channel gain (exposure, white balance: a diagonal A) and the
cross-channel mixing of a camera's colour matrix, at 12 numbers a view: a per-channel gain and
bias alone is its diagonal special case, and costs the same (one small matmul on the image).

The gauge: scaling the scene's colours by G and every correction by G^-1 renders the same
training images, so only corrections relative to one another are determined. train.appearance_decay
pulls every correction toward identity (it pins the common part: the scene keeps the mean colour);
comparisons (tests) divide by the mean gain.

Where it attaches: one StepRunner.corrections entry (train/corrections.py ViewCorrection) applied in
view_loss and stepped in finish, so every engine gets it (the CUDA-graph one as below). Under
torchrun every rank holds the whole table; after each backward the table's gradient is summed
over the ranks (each view's loss sits on its home rank, divided by the batch), so every rank takes
the same Adam step and the tables stay equal.

Under the CUDA-graph engine (train/graph_step.py) the correction is graph-safe: a captured step
picks the view's row by the view index on the device (StepView.slot), and steps the table with
train/capturable_adam.py, the same update as torch's Adam with its step size and bias corrections
refilled on the device before each replay (advance; rewind for a redo). Before
train.appearance_start a captured step leaves the table as it is, and whether the correction is
active is part of the graph's epoch key (graph_key), so the graph is captured again when it starts.

Test views (eval, the training loop's test evaluations): `raw` scores the render as it is;
`fitted_half` fits the test view's affine correction by least squares on the left half of the image
(closed form, nothing trained) and scores only the right half (render and photo both cut to it).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from gstrain.train.capturable_adam import CapturableAdam
from gstrain.train.step import StepView

# How each test-view protocol is named in metrics.json and the printed lines
RAW_PROTOCOL = "raw: the render as it is, no per-image correction"
FITTED_HALF_PROTOCOL = ("fitted_half: a 3x4 colour transform fitted by least squares on the left half of each "
                        "test image, render and photo scored on the right half only")
FIT_RIDGE = 1e-3  # pulls the half-image fit toward identity: a flat or empty half still gives a transform


def render_protocol(cfg: Any) -> str:
    """The line `render` and `view` show: their images are raw renders."""
    if cfg.train.appearance == "none":
        return "renders are raw (protocol raw; the run learned no per-image correction)"
    return (f"renders are raw (protocol raw): the per-image corrections train.appearance={cfg.train.appearance} "
            "learned belong to the training photos and are not applied")


def identity_table(n_views: int, device: torch.device | str = "cpu") -> Tensor:
    """[n_views, 3, 4]: every view's [A | b] = [I | 0]."""
    table = torch.zeros((n_views, 3, 4), device=device)
    table[:, :, :3] = torch.eye(3, device=device)
    return table


def apply_affine(image: Tensor, transform: Tensor) -> Tensor:
    """A @ rgb + b per pixel: image [..., 3], transform [3, 4]."""
    return image @ transform[:, :3].T + transform[:, 3]


class AffineAppearance:
    """The per-image 3x4 colour transforms of the training views, with their own Adam (a
    corrections.ViewCorrection, graph-safe). The table, its Adam moments and device scalars keep
    their storage for the whole run (a captured graph reads them): a checkpoint is copied into them."""

    name = "appearance"
    graph_safe = True

    def __init__(self, n_views: int, device: torch.device, lr: float, decay: float = 0.0, start: int = 0) -> None:
        self.table = torch.nn.Parameter(identity_table(n_views, device))
        self.identity = identity_table(n_views, device)
        self.lr, self.decay, self.start = float(lr), float(decay), int(start)
        self.optimizer = torch.optim.Adam([self.table], lr=self.lr, eps=1e-15)
        self.graph_adam = CapturableAdam(self.optimizer, pull=self.lr * self.decay)
        self._skip: Tensor | None = None  # the skip flag while a CUDA graph of the step is captured

    def camera(self, viewmat: Tensor, view: StepView, step: int) -> Tensor:
        return viewmat  # colours only

    def image(self, image: Tensor, view: StepView) -> Tensor:
        if view.slot is not None:  # a captured step: the row chosen on the device
            return apply_affine(image, self.table.index_select(0, view.slot.reshape(1).long())[0])
        if view.index is None:  # not a training view: nothing learned for it
            return image
        return apply_affine(image, self.table[view.index])

    def after_step(self, step: int) -> None:
        if step < self.start:  # warm-up: the transforms stay identity while the scene settles
            self.table.grad = None
            return
        if self._skip is not None:  # inside a capture: the device-scalar Adam, the same update
            self.graph_adam.step(self._skip, self.identity if self.decay else None)
            return
        self._sum_over_ranks()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.decay:
            with torch.no_grad():
                self.table.sub_((self.table - self.identity) * (self.lr * self.decay))

    # ------------------------------------------------------------ CUDA graphs (corrections.py)
    def graph_key(self, step: int) -> Hashable:
        """What a captured step bakes in: whether the table learns at `step`, and the addresses
        of the table and its moments (kept for the run; a change would need a new capture)."""
        exp_avg, exp_avg_sq = self.graph_adam.moments()
        return (step >= self.start, self.table.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr())

    def advance(self, step: int) -> None:
        """Before a replay of step `step`: count the table's Adam step as after_step would."""
        if step >= self.start:
            self.graph_adam.advance()

    def rewind(self, steps: Sequence[int]) -> None:
        """Take back advance()'s counts of the replayed `steps` a redo repeats."""
        counted = sum(1 for s in steps if s >= self.start)
        if counted:
            self.graph_adam.rewind(counted)

    def set_skip_flag(self, flag: Tensor | None) -> None:
        """A capture begins (flag: the device flag that makes the update a no-op) or ends (None)."""
        self._skip = flag
        self.table.grad = None

    def _sum_over_ranks(self) -> None:
        """Under torchrun each view's gradient is on its home rank only: the sum makes every rank's
        step the same (a rank that rendered none of the batch adds zeros)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        if self.table.grad is None:
            self.table.grad = torch.zeros_like(self.table)
        dist.all_reduce(self.table.grad)

    def state_dict(self) -> dict[str, Any]:
        return {"table": self.table.detach(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        table = state["table"]
        if tuple(table.shape) != tuple(self.table.shape):
            raise ValueError(f"appearance table of shape {tuple(table.shape)}, the run has {tuple(self.table.shape)}")
        with torch.no_grad():
            self.table.copy_(table)
        self.optimizer = torch.optim.Adam([self.table], lr=self.lr, eps=1e-15)
        self.optimizer.load_state_dict(state["optimizer"])
        self.graph_adam.hold(self.optimizer)


def build_corrections(cfg: Any, n_views: int, device: torch.device) -> list[Any]:
    """The per-view corrections train.appearance asks for (none: an empty list, the plain step)."""
    t = cfg.train
    if t.appearance == "affine":
        return [AffineAppearance(n_views, device, t.appearance_lr, t.appearance_decay, t.appearance_start)]
    return []


def fit_affine(render: Tensor, target: Tensor, keep: Tensor | None = None, ridge: float = FIT_RIDGE) -> Tensor:
    """The [3, 4] transform M minimising sum |M @ [rgb, 1] - target|^2 over the kept pixels, with
    `ridge` * |M - [I | 0]|^2 added (float64 normal equations; closed form)."""
    x = render.reshape(-1, 3).double()
    y = target.reshape(-1, 3).double()
    if keep is not None:
        k = keep.reshape(-1).to(torch.bool)
        x, y = x[k], y[k]
    x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)  # [P, 4]
    prior = identity_table(1, render.device)[0].double().T  # [4, 3]
    gram = x.T @ x + ridge * torch.eye(4, dtype=torch.float64, device=render.device)
    solution = torch.linalg.solve(gram, x.T @ y + ridge * prior)  # [4, 3]
    return solution.T.to(render.dtype)


def fitted_half(render: Tensor, target: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The fitted_half protocol on one test view ([H, W, 3] each; keep [H, W] bool or None):
    (corrected right half of the render, right half of the target, right half of keep). A view
    whose right half keeps no pixel has nothing to score there: see scores_right_half."""
    half = render.shape[1] // 2
    left_keep = keep[:, :half] if keep is not None else None
    transform = fit_affine(render[:, :half], target[:, :half], left_keep)
    right_keep = keep[:, half:] if keep is not None else None
    return apply_affine(render[:, half:], transform), target[:, half:], right_keep


def scores_right_half(keep: Tensor | None) -> bool:
    """Whether the fitted_half protocol scores the view: its mask keeps a pixel of the right half."""
    return keep is None or bool(keep[:, keep.shape[1] // 2 :].any())
