"""optim.moments=int8: the SH rest's Adam moments in 8 bits with a scale per row, every other
parameter's in bfloat16 (train/bf16_moments.py); the math in float32.

Layout (a row = one Gaussian's slice of one parameter tensor, e.g. its 45 shN values):
  exp_avg           int8 codes in [-127, 127]     m = code * exp_avg_scale[row]
  exp_avg_sq        uint8 codes in [0, 255]       sqrt(v) = code * exp_avg_sq_scale[row]
  exp_avg_scale     bfloat16 [N]                   (the names under torch Adam's `state`, beside
  exp_avg_sq_scale  bfloat16 [N]                    `step`, so checkpoints and strategies keep them)

Which parameters: a row of w values costs w + 2 bytes a moment in 8 bits with its scale, 2w in
bfloat16, so 8 bits only pay from w = 3 and pay well only for a wide row. Only shN has one (45
values at SH degree 3, 76% of the 59 floats); means, scales, quats, opacities and sh0 (3, 3, 4, 1,
3 values) would save 1 to 2 bytes a Gaussian between them while their moments steer the
geometry, so they stay bfloat16. Bytes per Gaussian of the moments at SH degree 3:
  fp32 472, bf16 236, int8 150 (shN 2 x (45 + 2) = 94, the 14 other floats 2 x 14 x 2 = 56):
  86 B less than bf16. (A float32 scale would make it 82 B; a float16 one cannot hold the small
  moments of rarely drawn Gaussians, 1e-10 and below, so the scale is bfloat16, float32's range.)

The second moment spans many decades within a row (one colour channel's gradient can be 1e4
times another's): linear codes of v would put every v below 1/255 of the row's largest at 0, and
then m / (sqrt(v) + eps) explodes. The codes hold sqrt(v) instead (half the decades: a linear
map of the quantity the update divides by, so the relative error of the denominator is what the
code step gives). Their stochastic rounding is unbiased in v, not in sqrt(v): the EMA carries v,
and a rounding unbiased in sqrt(v) adds scale^2 p (1 - p) to E[v] every step, which
1 / (1 - beta2) = 1000 steps of memory pile up (38% too large a v at a tenth of the row's largest
sqrt(v)). The rounding noise itself is kept by the EMA too, about sqrt(1 / (1 - beta2^2)) = 22
times one rounding: some % on the row's largest v, more on the small ones, a jitter of Adam's
step size that stays unbiased. A denominator rounded to 0 can still meet an m that survived, so the update is
guarded: denominator = max(sqrt(v_hat) + eps, |m|), which bounds every step to lr / (1 - beta1^t)
(lr once the bias correction has faded), Adam's own scale of a step; plain Adam stays under it
unless the gradient jumps by a large factor at once.

Scales: the row's largest magnitude over 127 (255 for sqrt(v)), rounded up to a bfloat16 so that
no code overflows. Codes are rounded stochastically (unbiased, for the same reason as bf16's:
beta2's small steps would be lost to rounding to nearest), with the counter-based noise of
bf16_moments (element index within the tensor, Adam step, a salt per tensor and moment): the
CUDA kernel (csrc/step_ops.cu, FusedAdam) and the torch ops here store the same codes, bit for
bit (quantise_rows); a NaN row gets codes 0 and a NaN scale, an infinite one the largest finite
bfloat16 as its scale.

Measured on the CPU demo scene (64x64 views, SH degree 3 from step 75, default densification,
200 steps; seeds 7, 8, 9): test PSNR fp32 23.57 / 23.46 / 23.52 dB (mean 23.51), int8 23.48 /
23.49 / 23.44 (mean 23.47), bf16 23.39 / 23.52 / 23.49 (mean 23.47): the runs' spread over seeds
(about 0.1 dB) is larger than the modes' difference. The paired GPU study at a fixed budget is
bench/bench_train.py's int8-moments pipeline.

gsplat's strategy operations concatenate float32 zeros onto every state tensor of a row
(duplicate, split, sample_add), index rows (remove) or zero them (relocate): the codes and their
row's scale move together because both are row-aligned, and keep_layout() casts the promoted
tensors back (exact: they hold codes, bfloat16 values and zeros).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gstrain.train.adam_state import host_step
from gstrain.train.bf16_moments import (
    BF16_MAX_BITS,
    BF16_NAN_BITS,
    MASK32,
    MOMENT_KEYS,
    moment_salt,
    rounding_noise,
    step_seed,
    update_moments,
)

EIGHT_BIT_PARAMS = ("shN",)  # the parameters whose moments are 8-bit (see the module docstring)
MIN_ROW = 3  # values a row needs for 8 bits to save bytes (w + 2 < 2w)
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
CODE_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
LEVELS = {"exp_avg": 127, "exp_avg_sq": 255}  # the largest code of each moment's map
SCALE_BYTES = 2  # bfloat16
NOISE_STEPS = 65536.0  # 16 bits of rounding noise


def row_width(p: Tensor) -> int:
    """Values per Gaussian of a parameter tensor (its first dimension is the Gaussians)."""
    return math.prod(p.shape[1:]) if p.dim() >= 1 else 0


def is_eight_bit(name: str, width: int) -> bool:
    """Whether the parameter `name`, `width` values a row, keeps 8-bit moments under optim.moments=int8."""
    return name in EIGHT_BIT_PARAMS and width >= MIN_ROW


def moment_bytes_per_gaussian(widths: dict[str, int]) -> int:
    """Bytes per Gaussian of both moments under optim.moments=int8 for parameters of these row
    widths: w + 2 per moment for an 8-bit one, 2w (bfloat16) for the others."""
    return sum(2 * (w + SCALE_BYTES if is_eight_bit(name, w) else 2 * w) for name, w in widths.items())


def has_codes(state: dict) -> bool:
    """Whether a parameter's Adam state holds 8-bit codes (it has the scales)."""
    return SCALE_KEYS["exp_avg"] in state


def scale_up_bf16(x: Tensor) -> Tensor:
    """float32 x >= 0 as the next bfloat16 at or above it; past the largest finite bfloat16 (and
    infinity) the largest finite one, NaN the canonical NaN."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & MASK32
    r = (bits + 0xFFFF) >> 16
    r = torch.where(r >= 0x7F80, torch.full_like(r, BF16_MAX_BITS), r)
    r = torch.where(torch.isnan(x), torch.full_like(r, BF16_NAN_BITS), r)
    return r.to(torch.int16).view(torch.bfloat16).view(x.shape)


def quantise_rows(x: Tensor, levels: int, seed: int | None, squares: bool = False) -> tuple[Tensor, Tensor]:
    """float32 rows x [N, w] as codes (int16 values in [-levels, levels]) and a bfloat16 scale
    per row: scale = the row's largest |x| / levels rounded up; y = x / scale, code = floor(y + u)
    with u the 16-bit noise of `seed` over 2^16 (stochastic rounding, unbiased in x), or u = 1/2
    with seed None (to nearest: conversions). `squares` (x >= 0, sqrt(v)): code = lo + (u < f),
    lo = floor(y), f = (y^2 - lo^2) / (2 lo + 1), which is unbiased in x^2 = v instead."""
    n, w = x.shape
    largest = x.abs().amax(dim=1) if w > 0 else torch.zeros(n, device=x.device)
    scale = scale_up_bf16(largest / torch.full_like(largest, float(levels)))
    s = scale.float()[:, None].expand_as(x)
    y = torch.where(s == 0, torch.zeros_like(x), x / s)
    if seed is None:
        u = torch.full_like(x, 0.5)
    else:
        u = rounding_noise(x.numel(), seed, x.device).view(n, w).float() / NOISE_STEPS
    if squares:
        lo = torch.floor(y)
        f = (y * y - lo * lo) / (lo * 2.0 + 1.0)
        q = lo + (u < f).float()
    else:
        q = torch.floor(y + u)
    q = q.clamp_(-levels, levels)
    q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
    return q.to(torch.int16), scale


def dequantise_rows(codes: Tensor, scale: Tensor) -> Tensor:
    """Codes [N, ...] and their rows' scales [N] as float32 values [N, w]."""
    n = codes.shape[0]
    return codes.reshape(n, -1).float() * scale.float()[:, None]


def init_state(state: dict, p: Tensor) -> None:
    """A fresh 8-bit state (step 0 on the host, zero codes and scales) for parameter p."""
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    for key in MOMENT_KEYS:
        state[key] = torch.zeros(p.shape, dtype=CODE_DTYPES[key], device=p.device)
        state[SCALE_KEYS[key]] = torch.zeros(p.shape[0], dtype=torch.bfloat16, device=p.device)


def store(state: dict, key: str, values: Tensor, shape: torch.Size, seed: int | None) -> None:
    """float32 rows of moment `key` (m, or sqrt(v) for exp_avg_sq, rounded unbiased in v) into
    the state as codes and scales."""
    codes, scale = quantise_rows(values, LEVELS[key], seed, squares=key == "exp_avg_sq")
    state[key] = codes.to(CODE_DTYPES[key]).view(shape)
    state[SCALE_KEYS[key]] = scale


def step_tensor(opt: torch.optim.Optimizer) -> None:
    """One Adam step of a single-tensor optimizer with 8-bit moments (torch ops, any device; the
    CUDA kernel stores the same codes): the moments decoded to float32, updated as
    bf16_moments.update_moments does, the guarded update applied, the new moments coded with
    stochastic rounding. Then the gradient is set to None."""
    group = opt.param_groups[0]
    p = group["params"][0]
    g = p.grad
    if g is None:
        return
    state = opt.state[p]
    step_t = host_step(state)
    step_t += 1
    step = int(step_t)
    n = p.shape[0]
    if n > 0:
        beta1, beta2 = group["betas"]
        rows = g.detach().float().reshape(n, -1)
        m0 = dequantise_rows(state["exp_avg"], state["exp_avg_scale"])
        r0 = dequantise_rows(state["exp_avg_sq"], state["exp_avg_sq_scale"])
        m, v = update_moments(rows, m0, r0 * r0, beta1, beta2)
        r = v.sqrt()
        step_size = group["lr"] / (1.0 - beta1**step)
        inv_bc2 = 1.0 / math.sqrt(1.0 - beta2**step)
        denom = torch.maximum(r * inv_bc2 + group["eps"], m.abs())  # the guard: |m| / denom <= 1
        with torch.no_grad():
            p.view(n, -1).addcdiv_(m, denom, value=-step_size)
        name = str(group.get("name", ""))
        store(state, "exp_avg", m, p.shape, step_seed(step, moment_salt(name, "exp_avg")))
        store(state, "exp_avg_sq", r, p.shape, step_seed(step, moment_salt(name, "exp_avg_sq")))
    p.grad = None


def layout_dtypes(name: str, p: Tensor) -> dict[str, torch.dtype]:
    """The state dtypes of parameter `name` under optim.moments=int8, by state key."""
    if not is_eight_bit(name, row_width(p)):
        return {key: torch.bfloat16 for key in MOMENT_KEYS}
    return {**CODE_DTYPES, **{scale: torch.bfloat16 for scale in SCALE_KEYS.values()}}


def to_codes(state: dict, p: Tensor) -> None:
    """A parameter's float32 (or bfloat16) moments as 8-bit codes, rounded to nearest (a
    checkpoint of another mode)."""
    n = p.shape[0]
    m = state["exp_avg"].float().reshape(n, -1)
    r = state["exp_avg_sq"].float().reshape(n, -1).clamp_min(0).sqrt()
    store(state, "exp_avg", m, p.shape, None)
    store(state, "exp_avg_sq", r, p.shape, None)


def from_codes(state: dict, p: Tensor) -> None:
    """A parameter's 8-bit moments (codes possibly cast to float32 by Optimizer.load_state_dict,
    exactly) as float32 moments m and v, the scales dropped."""
    shape = state["exp_avg"].shape
    m = dequantise_rows(state["exp_avg"], state.pop(SCALE_KEYS["exp_avg"]))
    r = dequantise_rows(state["exp_avg_sq"], state.pop(SCALE_KEYS["exp_avg_sq"]))
    state["exp_avg"] = m.view(shape).to(p.device)
    state["exp_avg_sq"] = (r * r).view(shape).to(p.device)
