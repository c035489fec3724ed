"""dev.adam_in_backward: shN's Adam step runs inside the backward, so its gradient is never whole.

Why: shN holds 45 of a Gaussian's 59 floats. Its gradient (180 bytes a Gaussian) lives from the
SH colours' backward to the optimizer step, across the step's memory peak: with 8-bit moments it
is a quarter of the peak bytes per Gaussian. Here the SH backward (render/sh_colors.py) computes
shN's gradient in slices of rows and hands each slice to ShnInBackward, which applies the same
Adam update to those rows (FusedAdam's kernel with the step's scalars, visibility, skip flag and
its rounding hash offset to the slice: fused_adam.RowsStep) and lets the slice go. Renderers whose
SH colours are autograd ops (the CPU reference) hand over the whole gradient once, stepped with
the function the optimizer step would use (moment_modes.adam_step or torch's Adam). Either way the
step's result is the plain step's: tests/test_backward_adam.py (CPU) and
tests/test_backward_adam_cuda.py compare them.

When: a step of one view (one SH backward a step) on the engines that call StepRunner.run (not
the sharded step): on a GPU with our fused Adam and fused SH colours, on the CPU with the
reference renderer (train/step.py steps_shn_in_backward); nothing else may give shN a gradient
(StepRunner checks it after the backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gstrain.train import moment_modes

KEY = "shN"  # the parameter stepped in the backward
# rows of shN's gradient the fused SH backward computes at a time: a slice is at most this, or a
# sixteenth of the model, whichever is larger (a few launches a step, a slice's bytes negligible)
SLICE_ROWS = 1 << 20


class _Marked(torch.autograd.Function):
    """shN as it is, with the backward's whole gradient (when it comes whole) stepped here."""

    @staticmethod
    def forward(ctx: Any, shN: Tensor, owner: ShnInBackward) -> Tensor:
        ctx.owner = owner
        ctx.set_materialize_grads(False)
        return shN.view_as(shN)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[None, None]:
        if grad is not None:
            ctx.owner.whole(grad)
        return None, None


class ShnInBackward:
    """Arms one step's shN update in the backward (wrap), then says whether it ran (take_done)."""

    def __init__(self, fused_adam: Any, moments: str) -> None:
        self.fused_adam = fused_adam  # train/fused_adam.FusedAdam on a GPU, None on the CPU
        self.moments = moments
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.graph: tuple[Tensor, Tensor] | None = None
        self.sparse = False
        self.started: Any = None  # this step's fused_adam.RowsStep, once the first slice came
        self.done = False

    def wrap(self, params: Any, optimizers: dict[str, torch.optim.Optimizer], graph: tuple[Tensor, Tensor] | None,
             sparse: bool) -> dict[str, Tensor]:  # fmt: skip
        """The parameters to render this step with: shN marked so that its backward steps it.
        graph: (scalars, skip flag) of a CUDA-graph capture; sparse: optim.sparse_adam."""
        self.optimizers, self.graph, self.sparse = optimizers, graph, sparse
        self.started, self.done = None, False
        marked = _Marked.apply(params[KEY], self)
        marked.shn_in_backward = self  # render/sh_colors.py steps the slices it computes
        return {**dict(params.items()), KEY: marked}

    @staticmethod
    def slice_rows(n: int) -> int:
        """Rows per slice of an n-row gradient."""
        return max(SLICE_ROWS, -(-n // 16))

    def take_done(self) -> bool:
        """Whether this step's backward stepped shN (then the optimizer step skips it)."""
        done, self.done, self.started = self.done, False, None
        return done

    def rows(self, start: int, grad: Tensor, radii: Tensor) -> None:
        """Step shN's rows [start, start + len(grad)) with their gradient; radii [1, n, 2] of
        those rows (their visibility under optim.sparse_adam)."""
        if self.started is None:
            opt = self.optimizers[KEY]
            if self.graph is None:
                self.started = self.fused_adam.rows_step(opt)
            else:
                scalars, skip = self.graph
                keys = list(self.optimizers)
                self.started = self.fused_adam.rows_step(opt, scalars, skip, keys.index(KEY), len(keys))
        visible = (radii[0] > 0).all(dim=-1) if self.sparse else None
        self.started.rows(start, grad, visible)
        self.done = True

    def whole(self, grad: Tensor) -> None:
        """The whole gradient at once (autograd SH colours): the optimizer step's own function."""
        if self.fused_adam is not None:  # (not reached: the GPU path takes fused SH colours' slices)
            raise RuntimeError("dev.adam_in_backward on a GPU needs the fused SH colours")
        opt = self.optimizers[KEY]
        param = opt.param_groups[0]["params"][0]
        param.grad = grad
        with torch.no_grad():
            if self.moments != "fp32":
                moment_modes.adam_step({KEY: opt})
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        self.done = True
