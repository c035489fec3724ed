"""The per-view Adam of train.pose_refine (train/pose_refine.py PoseRefiner), in one form that both
the eager step and a captured CUDA-graph step run.

Why per row: a view's correction moves only at the steps that render it (a dense Adam would keep
moving every view on its momentum), with its own step count for the bias correction. Why on the
device: a captured step cannot read which views it rendered, nor their step counts, on the host
(both are frozen at capture). So the rows a step rendered arrive as a device index (the eager
step's host indices, or a graph step's StepView.slot), the step counts live on the device and
advance where a row is rendered, and the step's rate is a device scalar the host refills before
each replay (train/device_feed.py). The update is computed for every row and kept only for the rendered
ones (and nowhere while the skip flag of an overflowed graph step is set): per element the same
operations as updating the rendered rows alone, so eager and graph steps agree bit for bit on
the CPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gstrain.train.pose_gauge import without_gauge

BETAS = (0.9, 0.999)
EPS = 1e-15


@torch.no_grad()
def row_adam_step(delta: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, updates: Tensor,
                  rows: Tensor, rate: Tensor, gauge: Tensor | None, skip: Tensor | None = None) -> None:  # fmt: skip
    """One Adam step, in place, of the rows `rows` (a device index, repeats allowed) of delta [V,6]
    with moments exp_avg, exp_avg_sq [V,6] and per-row step counts `updates` [V] (int64), at rate
    `rate` (a float32 scalar tensor), then delta less its component in `gauge`'s span (None: none
    removed). Nothing changes where `skip` ([1] int, a graph step's overflow flag) is not 0. No
    host read: a CUDA graph may capture it."""
    rendered = torch.zeros(len(delta), dtype=torch.bool, device=delta.device).index_fill_(0, rows, True)
    counts = updates + rendered.to(updates.dtype)
    t = counts.to(delta)[:, None]
    b1, b2 = BETAS
    m = exp_avg.mul(b1).add_(grad, alpha=1 - b1)
    v = exp_avg_sq.mul(b2).addcmul_(grad, grad, value=1 - b2)
    step_size = rate / (1 - b1**t)  # (rows not rendered divide by zero: their values are not kept)
    denom = (v / (1 - b2**t)).sqrt() + EPS
    keep = rendered[:, None]
    moved = torch.where(keep, delta - step_size * m / denom, delta)
    if gauge is not None:
        moved = without_gauge(moved, gauge)
    if skip is not None:
        go = skip.reshape(()).eq(0)
        keep = keep & go
        moved = torch.where(go, moved, delta)
        rendered = rendered & go
    exp_avg.copy_(torch.where(keep, m, exp_avg))
    exp_avg_sq.copy_(torch.where(keep, v, exp_avg_sq))
    updates.copy_(torch.where(rendered, counts, updates))
    delta.copy_(moved)
