"""optim.moments (fp32, bf16, int8): how each mode lays out Adam's state of the Gaussians'
parameters, what the step paths and the trainer call without knowing the mode's details.

fp32 is torch's own layout (state made at a tensor's first gradient); bf16 (train/bf16_moments.py)
and int8 (train/int8_moments.py: 8-bit shN, bfloat16 elsewhere) make the whole state up front, so
that the step paths can tell the layout from the state itself (a bfloat16 `exp_avg`, or the
8-bit scales), keep it through gsplat's strategy operations (keep_layout) and through checkpoints
(restore: Optimizer.load_state_dict casts every state tensor to the parameter's float32).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gstrain.train import bf16_moments, int8_moments
from gstrain.train.bf16_moments import MOMENT_KEYS, moments_dtype


def _param_of(opt: torch.optim.Optimizer) -> tuple[str, torch.Tensor]:
    group = opt.param_groups[0]
    return str(group.get("name", "")), group["params"][0]


def init_optimizer_state(optimizers: dict[str, torch.optim.Optimizer], mode: str) -> None:
    """Give every optimizer without state its state in `mode`'s layout (nothing for fp32: torch
    makes its own at the first step)."""
    if mode == "fp32":
        return
    for opt in optimizers.values():
        name, p = _param_of(opt)
        state = opt.state[p]
        if len(state) != 0:
            continue
        if mode == "int8" and int8_moments.is_eight_bit(name, int8_moments.row_width(p)):
            int8_moments.init_state(state, p)
        else:
            bf16_moments.init_state(state, p, moments_dtype(mode))


def keep_layout(optimizers: dict[str, torch.optim.Optimizer], mode: str) -> int:
    """Cast state tensors that gsplat's strategy operations promoted (they concatenate float32
    zeros) back to `mode`'s dtypes, exactly (they hold codes, bfloat16 values and zeros); the
    count cast. Host-only dtype checks when nothing changed (no sync)."""
    if mode != "int8":
        return bf16_moments.keep_dtype(optimizers, moments_dtype(mode))
    cast = 0
    for opt in optimizers.values():
        name, p = _param_of(opt)
        state = opt.state.get(p)
        if not state:
            continue
        for key, dtype in int8_moments.layout_dtypes(name, p).items():
            if key in state and state[key].dtype != dtype:
                state[key] = state[key].to(dtype)
                cast += 1
    return cast


def adam_step(optimizers: dict[str, torch.optim.Optimizer]) -> None:
    """The torch-op Adam step of bf16 and int8 state (torch.optim.Adam steps neither): each
    tensor by its own layout; then grads are set to None."""
    for key, opt in optimizers.items():
        _, p = _param_of(opt)
        if p in opt.state and int8_moments.has_codes(opt.state[p]):
            int8_moments.step_tensor(opt)
        else:
            bf16_moments.adam_step({key: opt})


def saved_mode(saved_optimizers: dict[str, dict]) -> str | None:
    """The optim.moments a checkpoint's optimizer state dicts were written in (None: no state)."""
    dtype = None
    for saved in saved_optimizers.values():
        for state in saved.get("state", {}).values():
            if int8_moments.has_codes(state):
                return "int8"
            for key in MOMENT_KEYS:
                if dtype is None and key in state and torch.is_tensor(state[key]):
                    dtype = state[key].dtype
    if dtype is None:
        return None
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def restore(optimizers: dict[str, torch.optim.Optimizer], saved_optimizers: dict[str, dict], mode: str,
            log: Callable[[str], None]) -> None:  # fmt: skip
    """After Optimizer.load_state_dict of `saved_optimizers` (every state tensor now float32,
    values unchanged): the state back in `mode`'s layout. A checkpoint of another mode (saved_mode)
    is converted, said in one line:
    8-bit moments decoded (m = code x scale, v = (code x scale)^2), then float32 moments rounded
    to nearest into bfloat16 or 8-bit codes (bfloat16 to float32 is exact)."""
    saved = saved_mode(saved_optimizers)
    if saved is not None and saved != mode:
        log(f"gstrain: the checkpoint's Adam moments are {saved}; converted to optim.moments={mode}")
    for opt in optimizers.values():
        name, p = _param_of(opt)
        state = opt.state.get(p)
        if not state:
            continue
        eight_bit = mode == "int8" and int8_moments.is_eight_bit(name, int8_moments.row_width(p))
        if int8_moments.has_codes(state) and not eight_bit:
            int8_moments.from_codes(state, p)
        elif eight_bit and not int8_moments.has_codes(state):
            int8_moments.to_codes(state, p)
    keep_layout(optimizers, mode)
    init_optimizer_state(optimizers, mode)


def moment_bytes_per_gaussian(mode: str, widths: dict[str, int]) -> int:
    """Bytes per Gaussian of Adam's two moments under optim.moments=`mode`, for parameters of
    these row widths (values per Gaussian, by name)."""
    if mode == "int8":
        return int8_moments.moment_bytes_per_gaussian(widths)
    return 2 * moments_dtype(mode).itemsize * sum(widths.values())
