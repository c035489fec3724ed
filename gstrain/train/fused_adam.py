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

In a CUDA graph the kernel's arguments are frozen, so a graph step passes `scalars`: a device
tensor the host refills before each replay with advance()'s values (the same step sizes and bias
corrections), and `skip`, a device flag that turns the launch into a no-op (an overflowed
intersection, see render/isect.py). rewind() takes back advance()'s steps of skipped replays.

optim.moments=bf16 (train/bf16_moments.py): a tensor whose moments are bfloat16 is updated in
float32 and its moments stored with the same stochastic rounding as bf16_moments.adam_step, whose
hash needs the Adam step count: the host passes it, and a graph step reads it from `scalars` after
the pairs (graph_scalars(): pairs, then one count per tensor). Tensors off the fused path take
moment_modes.adam_step, as float32 ones take torch's.

optim.moments=int8 (train/int8_moments.py): a tensor with 8-bit codes is passed with its two row
scales, and the extension updates it in a kernel of its own (a warp per row: the row's new largest
magnitudes set its scales before any code is stored), reading the same device scalars; the same
codes as int8_moments.step_tensor (moment_modes.adam_step), which steps such tensors off the fused path.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from gstrain import extensions
from gstrain.train import bf16_moments, int8_moments, moment_modes
from gstrain.train.adam_state import host_step

_UNSUPPORTED_OPTIONS = (("weight_decay", 0), ("amsgrad", False), ("maximize", False))


def _supported(opt: torch.optim.Optimizer) -> bool:
    if not isinstance(opt, torch.optim.Adam) or len(opt.param_groups) != 1:
        return False
    group = opt.param_groups[0]
    return all(group.get(key, default) == default for key, default in _UNSUPPORTED_OPTIONS)


def graph_scalars(count: int) -> int:
    """Device scalars a graph step's FusedAdam reads for `count` tensors: a (step size,
    1/sqrt(bc2)) pair each, then each one's step count (bf16 and int8 moments' rounding hash)."""
    return 3 * count


class FusedAdam:
    """Steps a dict of single-tensor torch Adam optimizers together (see the module docstring)."""

    def __init__(self) -> None:
        self.ext = extensions.step_ops()

    def step(self, optimizers: dict[str, torch.optim.Optimizer], visible: Tensor | None = None,
             scalars: Tensor | None = None, skip: Tensor | None = None,
             stepped: Collection[str] = ()) -> None:  # fmt: skip
        """One Adam step of every optimizer whose parameter has a gradient; then grads are set to None.

        With `scalars` (a graph step) the step counts are not advanced here: advance() does it on
        the host before each replay and fills `scalars`, in graph_order()'s order. `stepped`: the
        optimizers (by key) already stepped in this step's backward (train/backward_adam.py)."""
        if stepped:
            kept = [i for i, key in enumerate(optimizers) if key not in stepped]
            if scalars is not None:
                scalars = scalars_of(scalars, kept, len(optimizers))
            optimizers = {key: opt for key, opt in optimizers.items() if key not in stepped}
        params, grads, exp_avgs, exp_avg_sqs, step_sizes, inv_bc2 = [], [], [], [], [], []
        scales: list[Tensor] = []  # per tensor: its two row scales (int8 moments), else its moments (unread)
        steps: list[float] = []  # the step counts (bfloat16 moments' rounding hash)
        salts: list[int] = []  # per tensor: exp_avg's, exp_avg_sq's
        beta1 = beta2 = eps = None
        for opt in optimizers.values():
            group = opt.param_groups[0]
            p = group["params"][0]
            g = p.grad
            if g is None and scalars is not None:
                raise ValueError(f"{group.get('name', '?')} has no gradient: a graph step updates every tensor")
            if g is None:
                continue
            betas = group["betas"]
            eligible = (
                _supported(opt) and p.is_cuda and p.dtype == torch.float32 and p.is_contiguous()
                and g.dtype == torch.float32 and g.is_contiguous() and not g.is_sparse
                and (beta1 is None or (betas == (beta1, beta2) and group["eps"] == eps))
                and (visible is None or (p.dim() >= 1 and p.shape[0] == visible.shape[0]))
            )  # fmt: skip
            if not eligible and scalars is not None:
                raise ValueError(f"{group.get('name', '?')}: a graph step needs every tensor on the fused path")
            bf16 = p in opt.state and opt.state[p].get("exp_avg", p).dtype == torch.bfloat16
            codes = p in opt.state and int8_moments.has_codes(opt.state[p])
            if not eligible and (codes or bf16):
                moment_modes.adam_step({"": opt})  # torch's Adam cannot step bfloat16 or 8-bit moments
                continue
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
                bf16_moments.init_state(state, p, torch.float32)
            step_t = host_step(state)
            if scalars is None:
                step_t += 1
            step = float(step_t) if scalars is None else 1.0  # a graph reads the device scalars
            params.append(p.detach())
            grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            scale_keys = int8_moments.SCALE_KEYS.values() if codes else bf16_moments.MOMENT_KEYS
            scales += [state[key] for key in scale_keys]
            step_sizes.append(group["lr"] / (1.0 - beta1**step))
            inv_bc2.append(1.0 / math.sqrt(1.0 - beta2**step))
            steps.append(step)
            name = str(group.get("name", ""))
            salts += [bf16_moments.moment_salt(name, key) for key in bf16_moments.MOMENT_KEYS]
            p.grad = None
        if params:
            self.ext.adam_step(params, grads, exp_avgs, exp_avg_sqs, step_sizes, inv_bc2,
                               float(beta1), float(beta2), float(eps), visible, scalars, skip,
                               steps, salts, scales, [0] * len(params))  # fmt: skip

    def rows_step(self, opt: torch.optim.Optimizer, scalars: Tensor | None = None, skip: Tensor | None = None,
                  position: int = 0, count: int = 1) -> RowsStep:  # fmt: skip
        """One Adam step of `opt`'s tensor whose gradient comes in slices of rows (RowsStep.rows):
        counted here for an eager step; a graph step reads its scalars at `position` of `count`
        tensors in graph_scalars' layout."""
        group = opt.param_groups[0]
        p = group["params"][0]
        if not (_supported(opt) and p.is_cuda and p.dtype == torch.float32 and p.is_contiguous() and p.dim() >= 1):
            raise ValueError(f"{group.get('name', '?')} cannot be stepped in slices of rows")
        state = opt.state[p]
        if len(state) == 0:
            bf16_moments.init_state(state, p, torch.float32)
        beta1, beta2 = group["betas"]
        if scalars is None:
            step_t = host_step(state)
            step_t += 1
            step = float(step_t)
            pair = (group["lr"] / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step))
        else:
            step, pair = 1.0, (0.0, 0.0)  # read from the device scalars
            scalars = scalars_of(scalars, [position], count)
        return RowsStep(self.ext, opt, state, pair, step, scalars, skip)


class RowsStep:
    """One Adam step of a tensor, applied to row slices as their gradients arrive: the update, the
    scalars and the rounding hash (offset by the slice's first element) of a whole-tensor step."""

    def __init__(self, ext, opt: torch.optim.Optimizer, state: dict, pair: tuple[float, float], step: float,
                 scalars: Tensor | None, skip: Tensor | None) -> None:  # fmt: skip
        self.ext, self.state, self.pair, self.step = ext, state, pair, step
        self.scalars, self.skip = scalars, skip
        group = opt.param_groups[0]
        self.param = group["params"][0].detach()
        self.betas, self.eps = group["betas"], group["eps"]
        self.codes = int8_moments.has_codes(state)
        name = str(group.get("name", ""))
        self.salts = [bf16_moments.moment_salt(name, key) for key in bf16_moments.MOMENT_KEYS]

    def rows(self, start: int, grad: Tensor, visible: Tensor | None = None) -> None:
        """Step rows [start, start + len(grad)) with their gradient `grad`; visible: those rows'
        mask (optim.sparse_adam), or None."""
        end = start + grad.shape[0]
        state = self.state
        keys = int8_moments.SCALE_KEYS.values() if self.codes else bf16_moments.MOMENT_KEYS
        width = self.param[0].numel() if len(self.param) else 0
        self.ext.adam_step([self.param[start:end]], [grad.contiguous()], [state["exp_avg"][start:end]],
                           [state["exp_avg_sq"][start:end]], [self.pair[0]], [self.pair[1]],
                           float(self.betas[0]), float(self.betas[1]), float(self.eps), visible, self.scalars,
                           self.skip, [self.step], self.salts, [state[key][start:end] for key in keys],
                           [start * width])  # fmt: skip


def scalars_of(scalars: Tensor, positions: list[int], count: int) -> Tensor:
    """The device scalars of the tensors at `positions` of `count` (graph_scalars' layout: the
    pairs, then the counts), in that layout for them alone: device slices, no host copy."""
    pairs = [scalars[2 * i : 2 * i + 2] for i in positions]
    counts = [scalars[2 * count + i : 2 * count + i + 1] for i in positions]
    return torch.cat(pairs + counts)


def graph_order(optimizers: dict[str, torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers a graph step updates, in FusedAdam.step's order (every one of a model: each
    parameter gets a gradient every step)."""
    return list(optimizers.values())


def advance(optimizers: dict[str, torch.optim.Optimizer]) -> list[float]:
    """Count one Adam step on the host for each optimizer; its (step size, 1/sqrt(bc2)) pairs,
    flat, in graph_order: what FusedAdam.step computes before its launch."""
    out: list[float] = []
    for opt in graph_order(optimizers):
        group = opt.param_groups[0]
        beta1, beta2 = group["betas"]
        step_t = host_step(opt.state[group["params"][0]])
        step_t += 1
        step = float(step_t)
        out += [group["lr"] / (1.0 - beta1**step), 1.0 / math.sqrt(1.0 - beta2**step)]
    return out


def step_counts(optimizers: dict[str, torch.optim.Optimizer]) -> list[float]:
    """Each optimizer's Adam step count, in graph_order (after advance(): this step's)."""
    return [float(host_step(opt.state[opt.param_groups[0]["params"][0]])) for opt in graph_order(optimizers)]


def rewind(optimizers: dict[str, torch.optim.Optimizer], steps: int) -> None:
    """Take back `steps` of advance()'s counts (replays whose update was skipped)."""
    for opt in graph_order(optimizers):
        host_step(opt.state[opt.param_groups[0]["params"][0]]).sub_(steps)
