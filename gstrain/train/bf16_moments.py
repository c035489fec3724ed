"""optim.moments=bf16: Adam's two moments (`exp_avg`, `exp_avg_sq`) stored in bfloat16, half the
bytes of float32 (59 floats a Gaussian at SH degree 3: 236 B less), with the math in float32.

Why stochastic rounding: with beta2 = 0.999 one step changes `exp_avg_sq` by about 0.1% of its
value, below bfloat16's resolution (8 bits of mantissa, about 0.4%), so rounding to nearest
returns the old value and v freezes. Stochastic rounding (SR) rounds up with probability equal
to the distance from the lower neighbour: unbiased, so the small updates survive on average.

The rounding is deterministic and identical on the CPU (torch ops, here) and in CUDA
(csrc/step_ops.cu): the noise is a counter-based hash of (element index, Adam step count, a salt
per tensor and moment), 16 bits of it; bfloat16 = the upper 16 bits of (float32 bits + noise).
The bit pattern of a float32 is sign and magnitude, so adding to its low bits rounds the
magnitude up or down: symmetric for negative numbers. NaN stays NaN (canonical 0x7FC0), infinities
stay infinite, and a finite value never rounds up to infinity (it stops at the largest finite).

The state stays in the torch Adam objects' `state` dict under torch's names (`step` a CPU
tensor, `exp_avg`, `exp_avg_sq`), only in bfloat16, so checkpoints and gsplat's strategies see
torch's layout. torch.optim.Adam cannot step with bfloat16 state: adam_step() here is its update
for that case (torch ops, any device; FusedAdam does the same in one kernel on the GPU).
"""

from __future__ import annotations

import math
import struct
import zlib

import torch
from torch import Tensor

from gstrain.choices import MOMENTS
from gstrain.train.adam_state import host_step

MASK32 = 0xFFFFFFFF
# lowbias32-style mixer (xorshift-multiply rounds). Both multipliers are odd and below 2**31, so a
# product with a 32-bit value stays below 2**63: exact in int64 tensors, and its low 32 bits are
# what a uint32 multiply in CUDA gives.
_MUL_A = 0x7FEB352D
_MUL_B = 0x1B873593
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
BF16_MAX_BITS = 0x7F7F  # the largest finite bfloat16 magnitude
BF16_INF_BITS = 0x7F80
BF16_NAN_BITS = 0x7FC0


def moments_dtype(mode: str) -> torch.dtype:
    """The storage dtype of optim.moments=`mode` (int8: of its 16-bit moments)."""
    if mode not in MOMENTS:
        raise ValueError(f"optim.moments must be one of {', '.join(MOMENTS)}; got {mode!r}")
    # int8: the moments that stay 16-bit (train/int8_moments.py keeps shN's in 8 bits)
    return torch.float32 if mode == "fp32" else torch.bfloat16


def mix32(x: int | Tensor) -> int | Tensor:
    """A 32-bit integer hash (bijective): of a Python int, or of an int64 tensor of 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & MASK32
    return x ^ (x >> 16)


def moment_salt(name: str, key: str) -> int:
    """The salt of one moment of one parameter tensor (its optimizer's name): fixed across runs."""
    return zlib.crc32(f"{name}/{key}".encode()) & MASK32


def step_seed(step: int, salt: int) -> int:
    """One tensor's hash seed at Adam step `step` (the count after this step, 1 first)."""
    return int(mix32(salt ^ int(mix32(int(step) & MASK32))))


def rounding_noise(numel: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """16 bits of noise per element index (int64 in [0, 65536)): the hash of (index, seed)."""
    idx = torch.arange(numel, dtype=torch.int64, device=device)
    h = mix32((idx & MASK32) ^ seed)
    if numel > 2**32:  # indices past 32 bits mix their high word in too (as the kernel does)
        hi = idx >> 32
        h = torch.where(hi != 0, mix32(h ^ hi), h)
    return h >> 16


def stochastic_round_bf16(x: Tensor, seed: int) -> Tensor:
    """float32 x as bfloat16, rounded stochastically with the noise of `seed` (see the module
    docstring); the same bits as the CUDA kernel's rounding."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, not {x.dtype}")
    flat = x.contiguous().view(-1)
    bits = flat.view(torch.int32).to(torch.int64) & MASK32
    r = ((bits + rounding_noise(flat.numel(), seed, flat.device)) >> 16) & 0xFFFF
    overflowed = ((r & 0x7FFF) == BF16_INF_BITS) & torch.isfinite(flat)
    r = torch.where(overflowed, (r & 0x8000) | BF16_MAX_BITS, r)
    r = torch.where(torch.isnan(flat), torch.full_like(r, BF16_NAN_BITS), r)
    signed = r - ((r >> 15) << 16)  # 0x8000.. as negative int16, so the cast keeps the bits
    return signed.to(torch.int16).view(torch.bfloat16).view(x.shape)


def float32(value: float) -> float:
    """`value` rounded to the nearest float32 (as the kernel receives it)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def update_moments(g: Tensor, m: Tensor, v: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """Adam's new moments in float32 from bfloat16 (or float32) ones: m + (1 - b1)(g - m) and
    b2 v + (1 - b2) g^2, one rounded float32 operation at a time (no fused multiply-add), in the
    order the CUDA kernel uses, so both give the same bits before the moments are rounded."""
    b1, b2 = float32(beta1), float32(beta2)
    c1, c2 = float32(1.0 - b1), float32(1.0 - b2)
    m32 = m.float()
    m32 = m32 + (g - m32) * c1
    v32 = v.float() * b2 + (g * g) * c2
    return m32, v32


def _name_of(opt: torch.optim.Optimizer) -> str:
    return str(opt.param_groups[0].get("name", ""))


def adam_step(optimizers: dict[str, torch.optim.Optimizer]) -> None:
    """One Adam step of every optimizer whose parameter has a gradient, with bfloat16 moments
    (fp32 math, stochastic rounding on store); then grads are set to None. Equal to
    torch.optim.Adam (single tensor, no weight decay) up to the rounding of the moments."""
    for opt in optimizers.values():
        group = opt.param_groups[0]
        p = group["params"][0]
        g = p.grad
        if g is None:
            continue
        state = opt.state[p]
        if len(state) == 0:
            init_state(state, p, torch.bfloat16)
        step_t = host_step(state)
        step_t += 1
        step = int(step_t)
        beta1, beta2 = group["betas"]
        g = g.detach().float()
        m32, v32 = update_moments(g, state["exp_avg"], state["exp_avg_sq"], beta1, beta2)
        step_size = group["lr"] / (1.0 - beta1**step)
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        denom = (v32.sqrt() / bc2_sqrt).add_(group["eps"])
        with torch.no_grad():
            p.addcdiv_(m32, denom, value=-step_size)
        name = _name_of(opt)
        state["exp_avg"] = stochastic_round_bf16(m32, step_seed(step, moment_salt(name, "exp_avg")))
        state["exp_avg_sq"] = stochastic_round_bf16(v32, step_seed(step, moment_salt(name, "exp_avg_sq")))
        p.grad = None


def init_state(state: dict, p: Tensor, dtype: torch.dtype) -> None:
    """torch.optim.Adam's fresh state (step 0 on the host, zero moments) with moments in `dtype`."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    for key in MOMENT_KEYS:
        state[key] = torch.zeros(p.shape, dtype=dtype, device=p.device)


def init_optimizer_state(optimizers: dict[str, torch.optim.Optimizer], dtype: torch.dtype) -> None:
    """Give every optimizer its state up front, moments in `dtype` (bfloat16: the step paths see
    the mode in the moments' dtype)."""
    for opt in optimizers.values():
        p = opt.param_groups[0]["params"][0]
        if len(opt.state[p]) == 0:
            init_state(opt.state[p], p, dtype)


def moments_of(optimizers: dict[str, torch.optim.Optimizer]) -> list[Tensor]:
    """Every moment tensor the optimizers hold."""
    out = []
    for opt in optimizers.values():
        state = opt.state.get(opt.param_groups[0]["params"][0], {})
        out += [state[k] for k in MOMENT_KEYS if k in state]
    return out


def stored_dtype(optimizers: dict[str, torch.optim.Optimizer]) -> torch.dtype | None:
    """The moments' dtype (None: no state yet)."""
    moments = moments_of(optimizers)
    return moments[0].dtype if moments else None


def keep_dtype(optimizers: dict[str, torch.optim.Optimizer], dtype: torch.dtype) -> int:
    """Cast moments that are not in `dtype` back to it; the count cast. gsplat's strategy
    operations grow the state by concatenating float32 zeros, which promotes a bfloat16 moment to
    float32; its values are still bfloat16 values or zeros, so the cast back is exact. Host-only
    dtype checks when nothing changed (no sync)."""
    cast = 0
    for opt in optimizers.values():
        state = opt.state.get(opt.param_groups[0]["params"][0])
        if not state:
            continue
        for key in MOMENT_KEYS:
            if key in state and state[key].dtype != dtype:
                state[key] = state[key].to(dtype)
                cast += 1
    return cast
