"""torch.optim.Adam's update of one small tensor (a per-view correction's table), in a form a CUDA
graph can capture, over the torch Adam object's own state.

Why: a captured step freezes every kernel argument, and torch's Adam computes its step size and
bias corrections on the host from the step count (python floats baked into the kernels). Here
the host counts the step and computes those numbers as torch does (advance(), before each replay),
and copies them into a device tensor the captured kernels read. The state stays torch's (`step`
a CPU tensor, `exp_avg`, `exp_avg_sq`), so a checkpoint and an eager torch step see no difference.

The update is torch.optim.Adam's single-tensor one, operation for operation (lerp, mul/addcmul,
sqrt / sqrt(bc2) + eps, param + (exp_avg * -step_size) / denom), then an optional pull of the
tensor toward an anchor at a fixed rate. A `skip` flag on the device (an overflowed intersection,
render/isect.py) turns the whole update into a no-op; rewind() then takes back advance()'s counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gstrain.train.device_feed import DeviceFeed

NEG_STEP_SIZE, BC2_SQRT, PULL_RATE = range(3)  # the device scalars, in order


class CapturableAdam:
    """Steps the single parameter of `optimizer` (a torch.optim.Adam, one group, no weight decay,
    amsgrad or maximize) with its step sizes read from `scalars` on the device, pulling it toward
    an anchor by `pull` of the difference each step (0: no pull)."""

    def __init__(self, optimizer: torch.optim.Adam, pull: float = 0.0) -> None:
        group = optimizer.param_groups[0]
        if len(optimizer.param_groups) != 1 or len(group["params"]) != 1:
            raise ValueError("CapturableAdam steps one parameter in one group")
        if group["weight_decay"] or group["amsgrad"] or group["maximize"]:
            raise ValueError("CapturableAdam has no weight decay, amsgrad or maximize")
        self.optimizer = optimizer
        self.pull = float(pull)
        param = self.param
        self.feed = DeviceFeed((3,), param.device)  # the scalars advance() sends (device_feed.py)
        self.scalars = self.feed.value
        self.ensure_state()

    @property
    def param(self) -> Tensor:
        return self.optimizer.param_groups[0]["params"][0]

    def ensure_state(self) -> dict:
        """The parameter's Adam state, made now as torch's first step would make it (zero moments,
        step 0): a captured step reads the moments at fixed addresses, so they must exist first."""
        state = self.optimizer.state[self.param]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(self.param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(self.param, memory_format=torch.preserve_format)
        return state

    def moments(self) -> tuple[Tensor, Tensor]:
        state = self.ensure_state()
        return state["exp_avg"], state["exp_avg_sq"]

    def hold(self, optimizer: torch.optim.Adam) -> None:
        """Step `optimizer` from now on (a checkpoint's, over the same parameter), its moments
        copied into the storage held so far: graphs captured before read the same addresses."""
        kept = self.moments()
        self.optimizer = optimizer
        state = self.ensure_state()
        for key, storage in zip(("exp_avg", "exp_avg_sq"), kept, strict=True):
            storage.copy_(state[key])
            state[key] = storage

    def advance(self) -> None:
        """Host: count one step (as torch's step does) and send its step size, sqrt of the second
        bias correction and the pull rate to `scalars` (stream-ordered: the next replay reads them)."""
        step_t = self.ensure_state()["step"]
        step_t += 1
        step = float(step_t)
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        values = [0.0] * 3
        values[NEG_STEP_SIZE] = -(group["lr"] / bias_correction1)
        values[BC2_SQRT] = bias_correction2**0.5  # (torch's expression, bit for bit)
        values[PULL_RATE] = self.pull
        self.feed.set(torch.tensor(values, dtype=torch.float32))

    def rewind(self, steps: int) -> None:
        """Take back `steps` of advance()'s counts (replays whose update was skipped)."""
        self.ensure_state()["step"].sub_(steps)

    @torch.no_grad()
    def step(self, skip: Tensor, anchor: Tensor | None = None) -> None:
        """One update from the parameter's gradient with the last advance()'s scalars (no host
        read: capturable); nothing changes where skip (a [1] int tensor) is not 0. Pulls toward
        `anchor` when given. The gradient is then cleared."""
        param = self.param
        grad = param.grad
        param.grad = None
        if grad is None:
            raise ValueError("CapturableAdam.step without a gradient")
        exp_avg, exp_avg_sq = self.moments()
        group = self.optimizer.param_groups[0]
        beta1, beta2 = group["betas"]
        go = skip.eq(0)
        new_avg = exp_avg.lerp(grad, 1 - beta1)
        new_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (new_avg_sq.sqrt() / self.scalars[BC2_SQRT]).add_(group["eps"])
        new_param = param + (new_avg * self.scalars[NEG_STEP_SIZE]) / denom
        if anchor is not None:
            new_param = new_param - (new_param - anchor) * self.scalars[PULL_RATE]
        exp_avg.copy_(torch.where(go, new_avg, exp_avg))
        exp_avg_sq.copy_(torch.where(go, new_avg_sq, exp_avg_sq))
        param.copy_(torch.where(go, new_param, param))
