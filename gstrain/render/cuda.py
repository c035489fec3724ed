"""Our CUDA rasterizer: autograd Function and render_cuda(params, camera) (gstrain.extensions builds it).

Projection, spherical harmonics and tile intersection come from gsplat (the intersection
from our csrc/isect.cu when dev.ellipse_cull is on, the colours from our fused kernel
csrc/sh_colors.cu when dev.fused_sh is); rasterize forward and
backward are ours (gstrain/render/csrc), with the backward's atomic mode chosen per call:
  atomic   every contributing lane adds its own gradients (the original 3DGS kernel)
  warp     always reduce across the warp, lane 0 adds (gsplat's way)
  distwar  reduce when at least `atomic_threshold` lanes contribute, else per-lane adds
  arc      as distwar, with the threshold tuned at run time by an ArcTuner
render.backend=gsplat runs the same projection with gsplat's rasterize_to_pixels instead
(RasterOptions.gsplat_raster). The per-call options travel as one RasterOptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gstrain import extensions
from gstrain.choices import ATOMIC_MODES
from gstrain.errors import UserError
from gstrain.render.arc import ArcTuner
from gstrain.render.common import DEFAULT_OPTIONS, RasterOptions, phase, strategy_info
from gstrain.render.isect import PairBudget, capped_intersection
from gstrain.render.projection import camera_centre
from gstrain.render.sh_colors import sh_colors
from gstrain.render.sized_projection import EPS2D, NEAR_PLANE, project_sized, project_sized_compensated

THRESHOLD_NEVER = 33  # more lanes than a warp has: never reduce (csrc/raster.h kThresholdNever)
TILE_SIZE = 16
MAX_ABSGRAD_CHANNELS = 32  # csrc/raster.h kMaxChunkChannels

# sm_90 float4/float2 atomics on a padded gradient layout (the candidate beyond DISTWAR): 3
# atomic instructions instead of 9 per flush; measured faster in every mode on an H200
# (docs/benchmarks.md), so the default unless a call says otherwise.
VECTOR_ATOMICS_DEFAULT = True

# The warp reduction as a reduce-scatter (csrc/raster_bwd.cuh warp_sum_scatter): 16 shuffles
# and one atomic instruction across lanes instead of 5 shuffles per slot and lane 0's adds.
# Applies where a Gaussian's slots fit 16 (up to 8 channels); wider kernels keep the butterfly.
SCATTER_REDUCE_DEFAULT = True

_default_tuner: ArcTuner | None = None


def default_tuner() -> ArcTuner:
    """The process-wide tuner used by atomic_mode='arc' calls that bring none."""
    global _default_tuner
    if _default_tuner is None:
        _default_tuner = ArcTuner()
    return _default_tuner


def resolve_threshold(mode: str, atomic_threshold: int) -> int | None:
    """The fixed threshold a mode uses; None for arc (the tuner decides per call)."""
    if mode == "atomic":
        return THRESHOLD_NEVER
    if mode == "warp":
        return 1
    if mode == "distwar":
        if not 1 <= int(atomic_threshold) <= 32:
            raise UserError(f"atomic_threshold must be a lane count in 1..32, got {atomic_threshold}")
        return int(atomic_threshold)
    if mode == "arc":
        return None
    raise UserError(f"unknown atomic mode {mode!r}; choose one of {', '.join(ATOMIC_MODES)}")


class _BackwardPlan:
    """How the backward accumulates: a fixed threshold or a tuner, and the gradient layout."""

    __slots__ = ("scatter", "threshold", "tuner", "vector")

    def __init__(self, threshold: int | None, tuner: ArcTuner | None, vector: bool, scatter: bool) -> None:
        self.threshold = threshold
        self.tuner = tuner
        self.vector = vector
        self.scatter = scatter


class _RasterizeCuda(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        means2d: Tensor,
        conics: Tensor,
        colors: Tensor,
        opacities: Tensor,
        backgrounds: Tensor | None,
        width: int,
        height: int,
        tile_size: int,
        isect_offsets: Tensor,
        flatten_ids: Tensor,
        absgrad: bool,
        plan: _BackwardPlan,
        n_isects: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        ext = extensions.raster()
        image, alpha, t_final, last_ids = ext.rasterize_fwd(
            means2d,
            conics,
            colors,
            opacities,
            backgrounds,
            width,
            height,
            tile_size,
            isect_offsets,
            flatten_ids,
            n_isects,
        )
        ctx.save_for_backward(
            means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, t_final, last_ids, n_isects
        )
        ctx.dims = (width, height, tile_size)
        ctx.absgrad = absgrad
        ctx.plan = plan
        return image, alpha

    @staticmethod
    def backward(ctx: Any, v_image: Tensor, v_alpha: Tensor) -> tuple[Tensor | None, ...]:
        (means2d, conics, colors, opacities, backgrounds, isect_offsets, flatten_ids, t_final, last_ids,
         n_isects) = ctx.saved_tensors  # fmt: skip
        width, height, tile_size = ctx.dims
        plan: _BackwardPlan = ctx.plan
        probe = None
        if plan.tuner is not None:
            # normalise by the intersection count (host-known, no sync): views differ in cost
            threshold, probe = plan.tuner.next_call(work=max(flatten_ids.numel(), 1) / 1e6)
        else:
            assert plan.threshold is not None
            threshold = plan.threshold
        if probe is not None:
            probe.start()
        v_means2d, v_conics, v_colors, v_opacities, v_abs = extensions.raster().rasterize_bwd(
            means2d,
            conics,
            colors,
            opacities,
            backgrounds,
            width,
            height,
            tile_size,
            isect_offsets,
            flatten_ids,
            t_final,
            last_ids,
            v_image.contiguous(),
            v_alpha.contiguous(),
            ctx.absgrad,
            threshold,
            plan.vector,
            plan.scatter,
            n_isects,
        )
        if probe is not None:
            probe.stop()
        if ctx.absgrad:
            means2d.absgrad = v_abs  # read by gsplat's DefaultStrategy(absgrad=True)
        v_bg = None
        if backgrounds is not None and ctx.needs_input_grad[4]:
            v_bg = (v_image * t_final.unsqueeze(-1)).sum(dim=(1, 2))
        return (v_means2d, v_conics, v_colors, v_opacities, v_bg) + (None,) * 8


def rasterize_cuda(
    means2d: Tensor,
    conics: Tensor,
    colors: Tensor,
    opacities: Tensor,
    width: int,
    height: int,
    tile_size: int,
    isect_offsets: Tensor,
    flatten_ids: Tensor,
    backgrounds: Tensor | None = None,
    absgrad: bool = False,
    atomic_mode: str = "arc",
    atomic_threshold: int = 8,
    tuner: ArcTuner | None = None,
    vector_atomics: bool | None = None,
    scatter_reduce: bool | None = None,
    n_isects: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Composite projected Gaussians: means2d [C,N,2], conics [C,N,3], colors [C,N,ch],
    opacities [C,N], isect_offsets [C,th,tw], flatten_ids [M] (gsplat's non-packed outputs),
    backgrounds [C,ch] -> image [C,H,W,ch], alpha [C,H,W,1].

    n_isects ([1] int32 on the device): flatten_ids is a capacity whose first n_isects entries
    are the pairs (the sync-free intersection, isect.capped_intersection).

    With absgrad, means2d.absgrad holds sum over pixels of |dL/dmeans2d| after backward.
    scatter_reduce: how a warp reduces (None: SCATTER_REDUCE_DEFAULT); same sums either way.
    """
    if means2d.dim() != 3 or means2d.shape[-1] != 2:
        raise ValueError(f"means2d must be [C, N, 2], got {tuple(means2d.shape)}")
    if absgrad and colors.shape[-1] > MAX_ABSGRAD_CHANNELS:
        # channels beyond one kernel are done in chunks; |dL/dmean2d| per pixel is not additive
        raise ValueError(f"absgrad supports at most {MAX_ABSGRAD_CHANNELS} channels, got {colors.shape[-1]}")
    if absgrad and not means2d.is_contiguous():
        # a contiguous copy would receive .absgrad instead of the caller's tensor
        raise ValueError("absgrad=True needs a contiguous means2d")
    threshold = resolve_threshold(atomic_mode, atomic_threshold)
    if threshold is None and tuner is None:
        tuner = default_tuner()
    if vector_atomics is None:
        # `atomic` is the original 3DGS kernel: one scalar atomicAdd per float per lane
        vector_atomics = VECTOR_ATOMICS_DEFAULT and atomic_mode != "atomic"
    scatter = SCATTER_REDUCE_DEFAULT if scatter_reduce is None else bool(scatter_reduce)
    plan = _BackwardPlan(threshold, tuner if threshold is None else None, bool(vector_atomics), scatter)
    bg = backgrounds.float().contiguous() if backgrounds is not None else None
    return _RasterizeCuda.apply(
        means2d.contiguous(),
        conics.contiguous(),
        colors.contiguous(),
        opacities.contiguous(),
        bg,
        int(width),
        int(height),
        int(tile_size),
        isect_offsets.contiguous(),
        flatten_ids.contiguous(),
        bool(absgrad),
        plan,
        n_isects,
    )


@dataclass
class Splats:
    """Gaussians projected into one camera by gsplat: what the rasterizer consumes ([1, N, ...])."""

    means2d: Tensor  # [1, N, 2]
    conics: Tensor  # [1, N, 3]
    depths: Tensor  # [1, N]
    radii: Tensor  # [1, N, 2] int32
    opacities: Tensor  # [1, N]
    isect_offsets: Tensor  # [1, tiles_y, tiles_x]
    flatten_ids: Tensor  # [M]
    width: int
    height: int
    pairs: tuple[int, int] | None = (0, 0)  # (Gaussian, tile) pairs from isect_tiles, and after the cull
    n_isects: Tensor | None = None  # [1] int32 on the device when flatten_ids is a capacity (budget)


def project_splats(
    params: torch.nn.ParameterDict | dict[str, Tensor], viewmat: Tensor, K: Tensor, width: int, height: int,
    ellipse_cull: bool = False, cull_kernel: bool = True, budget: PairBudget | None = None,
    valid: Tensor | None = None, antialiased: bool = False,
) -> Splats:
    """gsplat's public projection and tile intersection for one camera; with ellipse_cull, the
    pairs whose alpha is provably < 1/255 on their whole tile are dropped (intersect_splats).
    With a budget and `valid` (RasterOptions.valid_size), width x height is a canvas and the view
    the valid part of it: the device-sized projection replaces gsplat's. antialiased: the
    opacities are scaled by the projection's compensations (RasterOptions.antialiased)."""
    compensations = None
    if valid is not None:
        if budget is None or not ellipse_cull:  # a canvas only means something to the capped intersection
            raise ValueError("a canvas render (valid size) needs a pair budget and ellipse_cull")
        scales = torch.exp(params["scales"])
        if antialiased:
            radii, means2d, depths, conics, compensations = project_sized_compensated(
                params["means"], params["quats"], scales, viewmat, K, valid)  # fmt: skip
        else:
            radii, means2d, depths, conics = project_sized(params["means"], params["quats"], scales, viewmat, K, valid)
    else:
        from gsplat import fully_fused_projection

        radii, means2d, depths, conics, compensations = fully_fused_projection(
            params["means"], None, params["quats"], torch.exp(params["scales"]),
            viewmat[None].float(), K[None].float(), width, height, eps2d=EPS2D, near_plane=NEAR_PLANE,
            packed=False, calc_compensations=antialiased,
        )  # fmt: skip
    opacities = torch.sigmoid(params["opacities"])[None]
    if compensations is not None:
        opacities = opacities * compensations
    if budget is not None and ellipse_cull:
        kept = capped_intersection(extensions.raster(), means2d, radii, depths, conics, opacities, width, height,
                                   TILE_SIZE, budget, valid)  # fmt: skip
        return Splats(means2d, conics, depths, radii, opacities, kept.isect_offsets, kept.flatten_ids, width, height,
                      None, kept.n_isects)  # fmt: skip
    return intersect_splats(means2d, conics, opacities, radii, depths, width, height, ellipse_cull, cull_kernel)


def intersect_splats(
    means2d: Tensor, conics: Tensor, opacities: Tensor, radii: Tensor, depths: Tensor, width: int, height: int,
    ellipse_cull: bool = False, cull_kernel: bool = True,
) -> Splats:
    """Tile intersection of splats already projected into one camera ([1, N, ...]: from
    project_splats, or records received by a sharded render): gsplat's isect_tiles, or with
    ellipse_cull only the pairs that can reach 1/255 on their tile, found by our intersection
    kernel before the sort (gstrain/render/isect.py), or with cull_kernel=False by the PyTorch
    cull_pairs after isect_tiles (gstrain/render/cull.py: the oracle, and bench_cull's
    comparison). Both culls give the same pairs."""
    from gsplat import isect_offset_encode, isect_tiles

    if ellipse_cull and cull_kernel:
        from gstrain.render.isect import culled_intersection

        kept = culled_intersection(extensions.raster(), means2d, radii, depths, conics, opacities, width, height,
                                   TILE_SIZE)  # fmt: skip
        return Splats(means2d, conics, depths, radii, opacities, kept.isect_offsets, kept.flatten_ids, width, height,
                      (kept.pairs_before, kept.pairs_after))  # fmt: skip
    tiles_x = (width + TILE_SIZE - 1) // TILE_SIZE
    tiles_y = (height + TILE_SIZE - 1) // TILE_SIZE
    _, isect_ids, flatten_ids = isect_tiles(
        means2d, radii, depths, TILE_SIZE, tiles_x, tiles_y, packed=False, n_images=1
    )
    isect_offsets = isect_offset_encode(isect_ids, 1, tiles_x, tiles_y)
    pairs = (flatten_ids.numel(), flatten_ids.numel())
    if ellipse_cull:
        from gstrain.render.cull import cull_pairs

        kept = cull_pairs(means2d, conics, opacities, isect_offsets, flatten_ids, width, height, TILE_SIZE)
        isect_offsets, flatten_ids, pairs = kept.isect_offsets, kept.flatten_ids, (kept.pairs_before, kept.pairs_after)
    return Splats(means2d, conics, depths, radii, opacities, isect_offsets, flatten_ids, width, height, pairs)


def splat_colors(params: torch.nn.ParameterDict | dict[str, Tensor], viewmat: Tensor, sh_degree: int,
                 radii: Tensor, fused: bool = False) -> Tensor:
    """colour = max(SH(dirs) + 0.5, 0) with dirs = mean - camera centre ([1, N, 3]): via gsplat, or
    with `fused` in one kernel each way (render/sh_colors.py, the same function)."""
    if fused:
        return sh_colors(params["means"], params["sh0"], params["shN"], viewmat, radii, sh_degree)
    from gsplat import spherical_harmonics

    means = params["means"]
    # -R^T t of the rigid world-to-camera matrix: torch.linalg.inv would sync to check for errors
    campos = camera_centre(viewmat.float())[None]  # [1, 3]
    dirs = means[None] - campos[:, None, :]
    coeffs = torch.cat([params["sh0"], params["shN"]], dim=1)[None]
    visible = (radii > 0).all(dim=-1)  # skips SH work for Gaussians off screen
    colors = spherical_harmonics(sh_degree, dirs, coeffs, masks=visible)
    return torch.clamp_min(colors + 0.5, 0.0)


def rasterize_splats(
    splats: Splats,
    colors: Tensor,
    background: Tensor | None = None,
    options: RasterOptions = DEFAULT_OPTIONS,
    conics: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Composite projected splats with our kernels, or gsplat's own when options.gsplat_raster.

    `conics` may replace splats.conics (a timing hook wraps it). Returns image, alpha [1,H,W,ch/1].
    """
    conics = splats.conics if conics is None else conics
    backgrounds = None if background is None else background.reshape(1, -1)
    if options.gsplat_raster:
        from gsplat import rasterize_to_pixels

        return rasterize_to_pixels(
            splats.means2d, conics, colors, splats.opacities, splats.width, splats.height, TILE_SIZE,
            splats.isect_offsets, splats.flatten_ids, backgrounds=backgrounds, absgrad=options.absgrad,
        )  # fmt: skip
    return rasterize_cuda(
        splats.means2d, conics, colors, splats.opacities, splats.width, splats.height, TILE_SIZE,
        splats.isect_offsets, splats.flatten_ids, backgrounds=backgrounds, absgrad=options.absgrad,
        atomic_mode=options.atomic_mode, atomic_threshold=options.atomic_threshold, tuner=options.tuner,
        vector_atomics=options.vector_atomics, n_isects=splats.n_isects,
    )  # fmt: skip


def render_cuda(
    params: torch.nn.ParameterDict | dict[str, Tensor],
    viewmat: Tensor,
    K: Tensor,
    width: int,
    height: int,
    sh_degree: int,
    background: Tensor | None = None,
    options: RasterOptions = DEFAULT_OPTIONS,
    timer: Any = None,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Render one view: image [H,W,3], alpha [H,W,1], info (what gsplat's strategies read).

    With a PhaseTimer, the time splits into projection (gsplat projection, SH, tile
    intersection), raster_fwd, and raster_bwd (the rasterizer's share of backward).
    """
    with phase(timer, "projection"):
        splats = project_splats(params, viewmat, K, width, height, options.ellipse_cull,
                                budget=options.pair_budget, valid=options.valid_size,
                                antialiased=options.antialiased)  # fmt: skip
        colors = splat_colors(params, viewmat, sh_degree, splats.radii, fused=options.fused_sh)
    with phase(timer, "raster_fwd"):
        span = timer.backward_span("raster_bwd") if timer is not None else None
        conics = span.input(splats.conics) if span is not None else None
        image, alpha = rasterize_splats(splats, colors, background, options, conics)
        if span is not None:
            image = span.output(image)
    info = strategy_info(splats.means2d, splats.radii, splats.depths, splats.conics, width, height, TILE_SIZE)
    if options.pair_budget is not None:
        info["valid_size"] = options.valid_size
    # host ints (before, after the cull): reading them costs no sync; None with a pair budget (counted
    # on the device, PairBudget.pair_sum)
    info["isect_pairs"] = splats.pairs
    return image[0], alpha[0], info


def render_depth_cuda(
    params: torch.nn.ParameterDict | dict[str, Tensor], viewmat: Tensor, K: Tensor, width: int, height: int,
    gsplat_raster: bool = False, antialiased: bool = False,
) -> tuple[Tensor, Tensor]:
    """Camera-space depth composited like colour (1 channel): (sum w_i d_i [H,W,1], alpha [H,W,1]),
    on our kernels or (gsplat_raster) on gsplat's; antialiased as RasterOptions.antialiased."""
    splats = project_splats(params, viewmat, K, width, height, antialiased=antialiased)
    options = RasterOptions(atomic_mode="warp", gsplat_raster=gsplat_raster)
    acc, alpha = rasterize_splats(splats, splats.depths[..., None], options=options)
    return acc[0], alpha[0]
