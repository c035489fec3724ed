"""train.max_memory_gib: how many Gaussians fit in a GPU memory budget, and the one gate that
densification asks before it grows ("may the model grow to N Gaussians?").

The budget is split into fixed costs (the training images when they live on the GPU, and the
per-step buffers that scale with the pixels of a step's views) and a cost per Gaussian: every
parameter float with its gradient and Adam's two moments, the strategy's per-Gaussian statistics,
and the per-step buffers that scale with the Gaussians (projection outputs and their gradients,
the tile-intersection pairs). The largest count is what is left after the fixed costs, divided by
the cost per Gaussian. Pure arithmetic: it runs and is tested on the CPU.

On a GPU the gate also reads the allocator's peak (torch.cuda.max_memory_allocated, a host counter:
no sync) at refine steps, the only steps it is asked at, and refuses growth that the measured peak
plus the new Gaussians' bytes would carry over the budget.

per_gaussian_breakdown lists the cost per Gaussian by what holds it. Its step-buffer and pair
constants are counted from the tensors the render creates (gsplat's projection, our rasterizer);
bench/memory_per_gaussian.py measures the peak per Gaussian on a GPU against them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gstrain.errors import UserError
from gstrain.train.moment_modes import moment_bytes_per_gaussian

FLOAT = 4  # bytes: every parameter, gradient and statistic is float32 (radii int32)
# The parameter layout of gstrain.model.init_gaussians, floats per Gaussian (shN by SH degree).
PARAM_FLOATS_BASE = {"means": 3, "scales": 3, "quats": 4, "opacities": 1, "sh0": 3}
# Each parameter float is kept four times at the backward's peak: the value and its gradient
# (FLOAT each), Adam's exp_avg and exp_avg_sq in optim.moments' layout (float32, bfloat16's 2
# bytes, or int8's 8-bit shN with a scale per Gaussian: moment_modes.moment_bytes_per_gaussian).

# The strategy's per-Gaussian state: DefaultStrategy keeps grad2d and count (float32 each);
# gsplat's MCMC keeps only a fixed binomial table (no per-Gaussian state).
STRATEGY_FLOATS = {"default": 2, "mcmc": 0}
# Per-step buffers per Gaussian, bytes, live at the backward's peak of gstrain's step (gsplat's
# fully_fused_projection, the fused SH colours, our rasterizer; render/cuda.render_cuda):
STEP_BYTES = {
    # saved for the backward: radii 2 int32, means2d 2, depths 1, conics 3, exp(scales) 3,
    # sigmoid(opacities) 1, colours 3 -> 15 x 4 B
    "projection outputs": 60,
    # the rasterizer's backward: means2d 2, conics 3, colours 3, opacities 1 -> 9 x 4 B
    "their gradients": 36,
    # before they reach the parameters' .grad: the second means gradient (projection and SH each
    # give one, added into means.grad), d exp(scales) 3 and d sigmoid 1 -> 7 x 4 B
    "backward intermediates": 28,
}
ABSGRAD_BYTES = 2 * FLOAT  # means2d.absgrad
# Tile-intersection pairs: an int64 key and an int32 Gaussian id per pair, twice for the sort's
# double buffer; pairs per Gaussian grow with the Gaussians' screen size (an estimate).
PAIR_BYTES = 24
PAIRS_PER_GAUSSIAN = 4.0
# Per-step buffers per pixel of a step's views (estimates): render 3 + grad 3, alpha 1 + grad 1,
# last ids 1, target 3, and the SSIM loss's maps (about 4 more).
PIXEL_BYTES = 16 * FLOAT
# Share of the budget the counted tensors may take: the allocator's rounding and fragmentation,
# cuBLAS workspaces and CUDA graph pools take the rest.
USABLE_SHARE = 0.9
GIB = 2**30


def shn_floats(sh_degree: int) -> int:
    """Floats of the higher SH bands per Gaussian: 3 colours x ((d + 1)^2 - 1) coefficients."""
    return 3 * ((sh_degree + 1) ** 2 - 1)


def param_floats(sh_degree: int) -> int:
    """Parameter floats per Gaussian (59 at SH degree 3)."""
    return sum(PARAM_FLOATS_BASE.values()) + shn_floats(sh_degree)


def per_gaussian_breakdown(
    sh_degree: int,
    strategy: str = "default",
    absgrad: bool = False,
    step_bytes: dict[str, int] | None = None,
    pairs_per_gaussian: float = PAIRS_PER_GAUSSIAN,
    graph_pair_margin: float = 0.0,
    moments: str = "fp32",
    shn_in_backward: bool = False,
) -> dict[str, int]:
    """GPU bytes one Gaussian costs at the peak of a step, by what holds them: each parameter
    tensor, the gradients, Adam's moments (in optim.moments' layout `moments`), the strategy's
    statistics, the step's buffers (STEP_BYTES unless given) and its tile pairs.

    graph_pair_margin > 0: the CUDA-graph engine runs the steps and keeps its graphs through some
    eager steps (train/graph_step.py: those of masked views; its CAPACITY_MARGIN). The graphs' pool
    holds one step's gradients and buffers, with pair buffers of that margin times the pairs, and
    such an eager step allocates its own beside it: at that step they are held twice. (Before
    refinements, timed steps and ARC rounds the engine drops its graphs, so their pool can serve
    the eager step.) shn_in_backward: shN is stepped in the backward slice by slice
    (train/backward_adam.py), so its gradient is not among the peak's."""
    if strategy not in STRATEGY_FLOATS:
        raise ValueError(f"no per-Gaussian state known for strategy {strategy!r}")
    layout = {**PARAM_FLOATS_BASE, "shN": shn_floats(sh_degree)}
    rows = {f"parameter {name}": floats * FLOAT for name, floats in layout.items()}
    params = param_floats(sh_degree) * FLOAT
    if shn_in_backward:
        params -= shn_floats(sh_degree) * FLOAT
    rows["gradients"] = params
    rows["Adam moments"] = moment_bytes_per_gaussian(moments, layout)
    rows["strategy statistics"] = STRATEGY_FLOATS[strategy] * FLOAT
    step = dict(STEP_BYTES if step_bytes is None else step_bytes)
    if absgrad:
        step["their gradients"] = step.get("their gradients", 0) + ABSGRAD_BYTES
    rows.update({f"step: {name}": b for name, b in step.items()})
    rows["step: tile pairs"] = math.ceil(pairs_per_gaussian * PAIR_BYTES)
    if graph_pair_margin > 0:
        rows["graph pool: a step's gradients and buffers"] = (
            params + sum(step.values()) + math.ceil(pairs_per_gaussian * graph_pair_margin * PAIR_BYTES))
    return rows


def bytes_per_gaussian(sh_degree: int, **breakdown: Any) -> int:
    """GPU bytes one Gaussian costs at the peak of a step: the sum of per_gaussian_breakdown(sh_degree,
    **breakdown)."""
    return sum(per_gaussian_breakdown(sh_degree, **breakdown).values())


def step_pixel_bytes(largest_view_pixels: int, views_per_step: int = 1, pixel_bytes: int = PIXEL_BYTES) -> int:
    """Per-step buffers that scale with the pixels: a step's views, each at most the largest."""
    return largest_view_pixels * views_per_step * pixel_bytes


@dataclass(frozen=True)
class MemoryBudget:
    """What train.max_memory_gib allows: max_gaussians at per_gaussian bytes each after fixed_bytes."""

    limit_gib: float
    per_gaussian: int
    fixed_bytes: int
    max_gaussians: int
    usable_bytes: int = 0  # the part of the budget counted (USABLE_SHARE of it)

    def describe(self) -> str:
        return (f"train.max_memory_gib={self.limit_gib:g}: at most {self.max_gaussians:,} Gaussians "
                f"({self.per_gaussian} bytes each, {self.fixed_bytes / GIB:.2f} GiB for images and per-step "
                f"buffers, {USABLE_SHARE:.0%} of the budget counted)")


def plan_budget(
    max_memory_gib: float,
    per_gaussian: int,
    device_image_bytes: int,
    largest_view_pixels: int,
    views_per_step: int = 1,
    usable_share: float = USABLE_SHARE,
) -> MemoryBudget | None:
    """The largest Gaussian count train.max_memory_gib allows (None when it is 0: no budget).

    device_image_bytes: the training images' bytes on the GPU (0 with data.images_on=host/disk but
    for the step's own copies, which step_pixel_bytes' target counts). UserError when the fixed
    costs alone fill the budget."""
    if max_memory_gib <= 0:
        return None
    if per_gaussian <= 0:
        raise ValueError("per_gaussian must be > 0")
    usable = int(max_memory_gib * GIB * usable_share)
    fixed = device_image_bytes + step_pixel_bytes(largest_view_pixels, views_per_step)
    if fixed >= usable:
        raise UserError(
            f"train.max_memory_gib={max_memory_gib:g} leaves no room for Gaussians: the images on the GPU "
            f"and the per-step buffers take {fixed / GIB:.2f} GiB of the {usable / GIB:.2f} GiB counted "
            "(try data.images_on=host or disk, a larger data.factor or a smaller data.max_side)"
        )
    return MemoryBudget(max_memory_gib, per_gaussian, fixed, (usable - fixed) // per_gaussian, usable)


def shn_stepped_in_backward(cfg: Any, gpu: bool) -> bool:
    """Whether a run's steps step shN in the backward slice by slice (train/step.py
    steps_shn_in_backward): on a GPU, dev.adam_in_backward with fused Adam and fused SH colours,
    one view a step (the CPU path steps the whole gradient, which the peak then holds)."""
    dev = cfg.dev
    return bool(gpu and dev.adam_in_backward and dev.fused_adam and dev.fused_sh and cfg.train.batch_size == 1
                and cfg.render.backend in ("auto", "cuda"))


def budget_gate(cfg: Any, device_image_bytes: int, image_shapes: list[tuple[int, ...]],
                log: Callable[[str], None] = print, graph_pair_margin: float = 0.0, gpu: bool = False) -> GrowthGate:
    """The run's GrowthGate for train.max_memory_gib (a gate that allows everything at 0).
    device_image_bytes: the training images kept on the device (data.images_on=gpu);
    graph_pair_margin: per_gaussian_breakdown's (> 0 when the CUDA-graph engine runs the steps);
    gpu: the run trains on a GPU."""
    if cfg.train.max_memory_gib <= 0:
        return GrowthGate(None, log)
    per = bytes_per_gaussian(cfg.model.sh_degree, strategy=cfg.strategy.name, absgrad=cfg.strategy.absgrad,
                             graph_pair_margin=graph_pair_margin, moments=cfg.optim.moments,
                             shn_in_backward=shn_stepped_in_backward(cfg, gpu))
    largest = max((s[0] * s[1] for s in image_shapes), default=0)
    return GrowthGate(plan_budget(cfg.train.max_memory_gib, per, device_image_bytes, largest,
                                  cfg.train.batch_size), log)


def check_budget_first(cfg: Any, scene: Any) -> None:
    """UserError before anything is written when train.max_memory_gib cannot hold the start even
    with the images off the GPU: the per-step buffers, and the initial Gaussians (the SfM points,
    or model.init_points). The trainer checks again with the images where data.images_on put them."""
    if cfg.train.max_memory_gib <= 0:
        return
    gate = budget_gate(cfg, 0, [(v.height, v.width, 3) for v in scene.train], lambda _m: None)
    random = cfg.model.init == "random" or len(scene.points) == 0
    gate.check_start(cfg.model.init_points if random else len(scene.points))


def budget_free(cfg: Any, device: torch.device) -> int | None:
    """What data.images_on=auto may weigh as the GPU's free memory: the free bytes, or under a
    train.max_memory_gib budget the budget if smaller. None where auto measures it itself (no
    budget) or there is no GPU."""
    if device.type != "cuda" or cfg.train.max_memory_gib <= 0:
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return min(int(free), int(cfg.train.max_memory_gib * GIB))


def cache_crowds_headroom(device: torch.device, budget_bytes: int = 0) -> bool:
    """The allocator's cached but unused blocks exceed what is left to allocate: under the device's
    size, the per-process fraction (torch.cuda.set_per_process_memory_fraction) and `budget_bytes`
    (train.max_memory_gib; 0 none). A graph capture cannot release cached blocks when it runs out,
    as an eager allocation does, so the graph engine empties the cache first (host counters and
    one driver query; no stream sync)."""
    if device.type != "cuda":
        return False
    if device.index is None:  # the trainer's "cuda": the per-process queries want an index
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    limit = total * torch.cuda.get_per_process_memory_fraction(device)
    if budget_bytes > 0:
        limit = min(limit, budget_bytes)
    reserved = torch.cuda.memory_reserved(device)
    idle = reserved - torch.cuda.memory_allocated(device)
    return idle > min(limit - reserved, free)


def measured_peak(device: torch.device) -> int | None:
    """The allocator's peak on a CUDA device (a host counter, no sync); None on the CPU."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


class GrowthGate:
    """What a strategy asks before it grows: may_grow_to(n). The first refusal is said in one line
    (densification stops growing there); so is a cap lowered to fit (cap_for)."""

    def __init__(self, budget: MemoryBudget | None, log: Callable[[str], None] = print) -> None:
        self.budget = budget
        self.log = log
        self.said = False

    @property
    def limit(self) -> int | None:
        return None if self.budget is None else self.budget.max_gaussians

    def check_start(self, n: int) -> None:
        """UserError when the model does not fit before training starts (initial points)."""
        if self.budget is not None and n > self.budget.max_gaussians:
            raise UserError(f"the {n:,} initial Gaussians do not fit: {self.budget.describe()}")

    def may_grow_to(self, n: int, adding: int = 0, peak_bytes: int | None = None) -> bool:
        """True when n Gaussians fit; the first False is said once. peak_bytes: the allocator's
        measured peak so far (a GPU's), which with `adding` new Gaussians must stay in the budget."""
        if self.budget is None:
            return True
        fits = n <= self.budget.max_gaussians
        if fits and peak_bytes is not None:
            fits = peak_bytes + adding * self.budget.per_gaussian <= self.budget.usable_bytes
        if fits:
            return True
        if not self.said:
            self.said = True
            if n > self.budget.max_gaussians:
                where = f"at {self.budget.max_gaussians:,} Gaussians (asked for {n:,})"
            else:
                where = (f"at {n - adding:,} Gaussians (the measured peak, {(peak_bytes or 0) / GIB:.2f} GiB, "
                         f"leaves no room for {adding:,} more)")
            self.log(f"gstrain: densification stops growing {where}: {self.budget.describe()}; pruning goes on")
        return False

    def cap_for(self, requested: int) -> int:
        """A strategy's own cap (strategy.cap_max) lowered to what fits, said once when it is."""
        if self.budget is None or requested <= self.budget.max_gaussians:
            return requested
        if not self.said:
            self.said = True
            self.log(f"gstrain: strategy.cap_max {requested:,} lowered to {self.budget.max_gaussians:,}: "
                     f"{self.budget.describe()}")
        return self.budget.max_gaussians


def resident_bytes_per_gaussian(tensors: list[torch.Tensor], n: int) -> float:
    """Measured: bytes per Gaussian of the tensors (parameters, their .grad, optimizer moments,
    strategy statistics) whose first dimension is the Gaussian count n. Checks the layout count
    above against what a run really holds (strategies or optimizers that keep more state)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == n and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total / max(n, 1)
