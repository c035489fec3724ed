"""Pieces the renderers share: the per-call raster options, the info dict gsplat's strategies
read, and optional phase timing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class RasterOptions:
    """How one render rasterizes, beyond the scene and camera: one object through every layer
    (Renderer -> render_cuda -> rasterize_splats -> rasterize_cuda) instead of loose arguments.

    gsplat_raster: composite with gsplat's rasterize_to_pixels (render.backend=gsplat) instead of
    our kernels; the other fields then only keep absgrad. atomic_mode / atomic_threshold: our
    backward's reduction (choices.ATOMIC_MODES). tuner: arc's ArcTuner (None: the process-wide
    one). vector_atomics: None = our default for the mode. ellipse_cull: drop the (Gaussian, tile)
    pairs whose alpha is provably < 1/255 on the whole tile before either rasterizer runs.
    fused_sh: the colours from the SH in one kernel each way (render/sh_colors.py) instead of gsplat's
    spherical_harmonics and its surrounding tensor ops; the same function.
    pair_budget: a render/isect.PairBudget makes the culled intersection sync-free (fixed-capacity
    pair buffers, the count kept on the device), as a CUDA-graph step needs.
    valid_size: with a pair budget, a [2] int32 device tensor (width, height): the view is that
    top-left part of the width x height canvas the render is called with, and the projection
    (render/sized_projection.py) and the intersection read its size on the device, so one CUDA
    graph serves views of every size. Pixels outside it are rendered but belong to no view.
    antialiased: each Gaussian's opacity is scaled by sqrt(det(cov2d) / det(cov2d + eps2d I)), the
    share of its mass the 2D low-pass (eps2d) did not spread out (gsplat's rasterize_mode
    "antialiased"; render.antialiased), in the projection of every backend.
    """

    absgrad: bool = False
    atomic_mode: str = "arc"
    atomic_threshold: int = 8
    tuner: Any = None  # gstrain.render.arc.ArcTuner (kept loose: this module loads no CUDA code)
    vector_atomics: bool | None = None
    gsplat_raster: bool = False
    ellipse_cull: bool = False
    fused_sh: bool = False
    pair_budget: Any = None  # gstrain.render.isect.PairBudget
    valid_size: Any = None  # torch.Tensor [2] int32 on the device
    antialiased: bool = False


DEFAULT_OPTIONS = RasterOptions()  # our kernels, arc, no absgrad


def strategy_info(means2d: Tensor, radii: Tensor, depths: Tensor, conics: Tensor, width: int, height: int,
                  tile_size: int = 16) -> dict[str, Any]:
    """What gsplat's DefaultStrategy / MCMCStrategy read from a render, for one camera.

    means2d [1,N,2] must be the tensor that feeds the rasterizer, so that retain_grad() on it
    collects the screen-space gradient (and .absgrad when asked for). radii [1,N,2] int32.
    """
    return {
        "means2d": means2d,
        "radii": radii,
        "depths": depths,
        "conics": conics,
        "width": width,
        "height": height,
        "n_cameras": 1,
        "gaussian_ids": None,  # not packed
        "tile_size": tile_size,
        "valid_size": None,  # [2] int32 on the device when the render was on a canvas (RasterOptions)
    }


def sum_pairs(pairs: list[tuple[int, int] | None]) -> tuple[int, int, int] | None:
    """(pairs before the ellipse cull, after it, views) summed over renders that reported their
    tile-intersection pairs (our CUDA render: info["isect_pairs"]); None when none did."""
    found = [p for p in pairs if p is not None]
    return (sum(p[0] for p in found), sum(p[1] for p in found), len(found)) if found else None


def phase(timer: Any, name: str) -> contextlib.AbstractContextManager:
    """timer.phase(name) when a PhaseTimer is given, else nothing."""
    return timer.phase(name) if timer is not None else contextlib.nullcontext()
