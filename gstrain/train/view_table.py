"""A table of per-training-view colour-correction parameters learned with the scene: what the
train.appearance models (train/appearance.py's affine, train/bilateral_grid.py's bilateral grid)
share. A model says only how a view's row changes a render (`apply`) and, optionally, a
regulariser of the whole table (`regulariser_grad`); this class does the rest of a
corrections.ViewCorrection: picking the view's row (by its host index, or on the device by
StepView.slot under a captured step), the Adam step with warm-up and the pull toward identity,
the sum of the gradient over torchrun ranks, checkpoints, and the CUDA-graph protocol.

Why one class: every model must behave the same in every engine (eager, batch, graph, torchrun)
and across a resume; one implementation of that protocol keeps them from drifting apart.

Storage: the table, its Adam moments and device scalars keep their storage for the whole run (a
captured graph reads them at fixed addresses): a checkpoint is copied into them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from gstrain.train.capturable_adam import CapturableAdam
from gstrain.train.step import StepView


class ViewTable:
    """Rows table[i] (one per training view) stepped by their own Adam (eps 1e-15) from step `start`
    on, pulled toward `identity` (broadcast against the table) by lr * decay of the difference each
    step. Subclasses define apply(image, row) and may add regulariser_grad."""

    name = "appearance"  # the checkpoint key and the config key (train.appearance) that turns it on
    graph_safe = True

    def __init__(self, initial: Tensor, identity: Tensor, lr: float, decay: float = 0.0, start: int = 0) -> None:
        self.table = torch.nn.Parameter(initial)
        self.identity = identity
        self.lr, self.decay, self.start = float(lr), float(decay), int(start)
        self.optimizer = torch.optim.Adam([self.table], lr=self.lr, eps=1e-15)
        self.graph_adam = CapturableAdam(self.optimizer, pull=self.lr * self.decay)
        self._skip: Tensor | None = None  # the skip flag while a CUDA graph of the step is captured

    # ------------------------------------------------------------ what a model defines
    def apply(self, image: Tensor, row: Tensor, valid: Tensor | None = None) -> Tensor:
        """The render [H, W, 3] through one view's row of the table (valid: StepView.valid, the
        view's (width, height) when the render is a canvas; a model that reads positions needs it)."""
        raise NotImplementedError

    def regulariser_grad(self) -> Tensor | None:
        """The gradient of a regulariser of the whole table, added to the loss's gradient before each
        step (None: no regulariser). Device operations only: a captured step runs it."""
        return None

    # ------------------------------------------------------------ corrections.ViewCorrection
    def camera(self, viewmat: Tensor, view: StepView, step: int) -> Tensor:
        return viewmat  # colours only

    def image(self, image: Tensor, view: StepView) -> Tensor:
        if view.slot is not None:  # a captured step: the row chosen on the device
            return self.apply(image, self.table.index_select(0, view.slot.reshape(1).long())[0], view.valid)
        if view.index is None:  # not a training view: nothing learned for it
            return image
        return self.apply(image, self.table[view.index], view.valid)

    def after_step(self, step: int) -> None:
        if step < self.start:  # warm-up: the table stays identity while the scene settles
            self.table.grad = None
            return
        if self._skip is not None:  # inside a capture: the device-scalar Adam, the same update
            self._add_regulariser_grad()
            self.graph_adam.step(self._skip, self.identity if self.decay else None)
            return
        self._sum_over_ranks()
        self._add_regulariser_grad()  # after the sum: every rank adds the same term once
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.decay:
            with torch.no_grad():
                self.table.sub_((self.table - self.identity) * (self.lr * self.decay))

    def _add_regulariser_grad(self) -> None:
        extra = self.regulariser_grad()
        if extra is None:
            return
        if self.table.grad is None:
            self.table.grad = extra
        else:
            self.table.grad.add_(extra)

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

    # ------------------------------------------------------------ checkpoints
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
