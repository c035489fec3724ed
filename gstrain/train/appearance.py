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

The model (`bilateral`, train/bilateral_grid.py): per training image a bilateral grid of 3x4
transforms over (x, y, luminance of the render), sliced per pixel by trilinear interpolation: it
also holds what an image-wide affine cannot, such as vignetting or a tone curve, at
12 * X * Y * L numbers a view and a total-variation regulariser that keeps the grids smooth.

The gauge: scaling the scene's colours by G and every correction by G^-1 renders the same
training images, so only corrections relative to one another are determined. train.appearance_decay
pulls every correction toward identity (it pins the common part: the scene keeps the mean colour);
comparisons (tests) divide by the mean gain.

Where it attaches (both models; the shared part is train/view_table.py): one StepRunner.corrections
entry (train/corrections.py ViewCorrection) applied in view_loss and stepped in finish, so every
engine gets it (the CUDA-graph one as below). Under torchrun every rank holds the whole table;
after each backward the table's gradient is summed over the ranks (each view's loss sits on its
home rank, divided by the batch), so every rank takes the same Adam step and the tables stay equal.

Under the CUDA-graph engine (train/graph_step.py) the correction is graph-safe: a captured step
picks the view's row by the view index on the device (StepView.slot), and steps the table with
train/capturable_adam.py, the same update as torch's Adam with its step size and bias corrections
refilled on the device before each replay (advance; rewind for a redo). Before
train.appearance_start a captured step leaves the table as it is, and whether the correction is
active is part of the graph's epoch key (graph_key), so the graph is captured again when it starts.

Test views (eval, the training loop's test evaluations): `raw` scores the render as it is;
`fitted_half` fits the test view's affine correction (an affine for either model: a grid fitted on
one half would not reach the other) by least squares on the left half of the image
(closed form, nothing trained) and scores only the right half (render and photo both cut to it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gstrain.train.bilateral_grid import BilateralAppearance
from gstrain.train.view_table import ViewTable

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


class AffineAppearance(ViewTable):
    """The per-image 3x4 colour transforms of the training views, with their own Adam (a
    corrections.ViewCorrection, graph-safe; train/view_table.py)."""

    def __init__(self, n_views: int, device: torch.device, lr: float, decay: float = 0.0, start: int = 0) -> None:
        super().__init__(identity_table(n_views, device), identity_table(n_views, device), lr, decay, start)

    def apply(self, image: Tensor, row: Tensor, valid: Tensor | None = None) -> Tensor:
        return apply_affine(image, row)  # the same transform at every pixel: the canvas changes nothing


def build_corrections(cfg: Any, n_views: int, device: torch.device) -> list[Any]:
    """The per-view corrections train.appearance asks for (none: an empty list, the plain step)."""
    t = cfg.train
    if t.appearance == "affine":
        return [AffineAppearance(n_views, device, t.appearance_lr, t.appearance_decay, t.appearance_start)]
    if t.appearance == "bilateral":
        grid = (t.bilateral_grid_luma, t.bilateral_grid_y, t.bilateral_grid_x)
        return [BilateralAppearance(n_views, grid, device, t.appearance_lr, t.appearance_decay, t.appearance_start,
                                    t.bilateral_tv, cfg.dev.fused_bilateral, cfg.dev.bilateral_backward)]  # fmt: skip
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
