"""Adam for the whole Gaussian model in one kernel launch, over the torch Adam objects' own state.

gsplat's strategies need one torch.optim.Adam per parameter (they rewrite `optimizer.state` and
`param_groups` when Gaussians are added or removed), and `torch.optim.Adam(fused=True)` then costs
one launch and a Python `step()` per tensor: six a step, most of it host time. FusedAdam keeps
those objects as the holders of the learning rates and of the state (`step`, `exp_avg`,
`exp_avg_sq`, in torch's layout, so checkpoints and the strategies see no difference) and does
the arithmetic for all of them in one launch of csrc/step_ops.cu.

`step` stays a CPU tensor (as in torch's non-fused Adam), so the bias corrections are computed
on the host and passed to the kernel: no device scalar, no sync.

With `visible` (a [N] bool mask of the Gaussians drawn this step), the update is sparse: the
rows of Gaussians off screen keep their parameters and moments (gsplat's SelectiveAdam rule).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gstrain.train.step_ops import ensure_built

_UNSUPPORTED_OPTIONS = (("weight_decay", 0), ("amsgrad", False), ("maximize", False))


def _supported(opt: torch.optim.Optimizer) -> bool:
    if not isinstance(opt, torch.optim.Adam) or len(opt.param_groups) != 1:
        return False
    group = opt.param_groups[0]
    return all(group.get(key, default) == default for key, default in _UNSUPPORTED_OPTIONS)


def _host_step(state: dict) -> Tensor:
    """The state's step as a CPU tensor (a checkpoint of torch's fused Adam has it on the GPU)."""
    step = state["step"]
    if not torch.is_tensor(step):
        step = torch.tensor(float(step), dtype=torch.float32)
    elif step.device.type != "cpu":
        step = step.detach().to("cpu", torch.float32)  # once, after a resume
    state["step"] = step
    return step


class FusedAdam:
    """Steps a dict of single-tensor torch Adam optimizers together (see the module docstring)."""

    def __init__(self) -> None:
        self.ext = ensure_built()

    def step(self, optimizers: dict[str, torch.optim.Optimizer], visible: Tensor | None = None) -> None:
        """One Adam step of every optimizer whose parameter has a gradient; then grads are set to None."""
        params, grads, exp_avgs, exp_avg_sqs, step_sizes, inv_bc2 = [], [], [], [], [], []
        beta1 = beta2 = eps = None
        for opt in optimizers.values():
            group = opt.param_groups[0]
            p = group["params"][0]
            g = p.grad
            if g is None:
                continue
            betas = group["betas"]
            eligible = (
                _supported(opt) and p.is_cuda and p.dtype == torch.float32 and p.is_contiguous()
                and g.dtype == torch.float32 and g.is_contiguous() and not g.is_sparse
                and (beta1 is None or (betas == (beta1, beta2) and group["eps"] == eps))
                and (visible is None or (p.dim() >= 1 and p.shape[0] == visible.shape[0]))
            )  # fmt: skip
            if not eligible:
                # anything unusual takes torch's own path; its fused kernel wants `step` on the
                # parameter's device, where FusedAdam keeps it on the host
                state = opt.state.get(p)
                if state and group.get("fused") and torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device)
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            beta1, beta2 = betas
            eps = group["eps"]
            state = opt.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step_t = _host_step(state)
            step_t += 1
            step = float(step_t)
            params.append(p.detach())
            grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            step_sizes.append(group["lr"] / (1.0 - beta1**step))
            inv_bc2.append(1.0 / math.sqrt(1.0 - beta2**step))
            p.grad = None
        if params:
            self.ext.adam_step(params, grads, exp_avgs, exp_avg_sqs, step_sizes, inv_bc2,
                               float(beta1), float(beta2), float(eps), visible)  # fmt: skip
