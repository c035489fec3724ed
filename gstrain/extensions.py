"""gstrain's CUDA extensions, each compiled on first use (gstrain.cuda_build) and loaded once.

This module owns them: their sources, and the one function per extension that builds and loads
it. The modules that launch the kernels (render/cuda.py, render/sized_projection.py,
render/sh_colors.py, train/fused_ssim.py, train/fused_adam.py, train/fused_bilateral.py, the
densification statistics, data/undistort.py)
import their extension from here, and this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from gstrain.cuda_build import load_extension

_RENDER_CSRC = Path(__file__).resolve().parent / "render" / "csrc"
_TRAIN_CSRC = Path(__file__).resolve().parent / "train" / "csrc"
_DATA_CSRC = Path(__file__).resolve().parent / "data" / "csrc"

_RASTER_SOURCES = tuple(_RENDER_CSRC / f for f in (
    "bindings.cpp", "isect_bindings.cpp", "project_bindings.cpp", "raster_fwd.cu", "raster_bwd_scalar.cu",
    "raster_bwd_vec.cu", "isect.cu", "project.cu", "sh_colors.cu",
))  # fmt: skip
_RASTER_HEADERS = tuple(_RENDER_CSRC / f for f in (
    "raster.h", "raster_common.cuh", "raster_bwd.cuh", "isect.h", "isect_bindings.h", "project.h",
    "project_bindings.h", "sh_colors.h", "torch_checks.h",
))  # fmt: skip
_SSIM_SOURCES = (_TRAIN_CSRC / "bindings.cpp", _TRAIN_CSRC / "fused_ssim.cu")
# every extension's binding checks live in one header, render/csrc/torch_checks.h: listed among each
# one's headers, its folder is on each one's include path (cuda_build.load_extension)
_CHECKS_HEADER = _RENDER_CSRC / "torch_checks.h"
_SSIM_HEADERS = (_TRAIN_CSRC / "fused_ssim.h", _CHECKS_HEADER)
_STEP_SOURCES = (_TRAIN_CSRC / "step_bindings.cpp", _TRAIN_CSRC / "step_ops.cu")
_STEP_HEADERS = (_TRAIN_CSRC / "step_ops.h", _CHECKS_HEADER)
_BILATERAL_SOURCES = (_TRAIN_CSRC / "bilateral_bindings.cpp", _TRAIN_CSRC / "bilateral.cu")
_BILATERAL_HEADERS = (_TRAIN_CSRC / "bilateral.h", _CHECKS_HEADER)
_REMAP_SOURCES = (_DATA_CSRC / "remap_bindings.cpp", _DATA_CSRC / "remap.cu")
_REMAP_HEADERS = (_DATA_CSRC / "remap.h", _CHECKS_HEADER)


def raster() -> ModuleType:
    """gstrain_raster: the rasterizer forward and backward, the tile intersection, the sized
    projection and the fused SH colours. UserError (one line) when this machine cannot build it."""
    return load_extension("gstrain_raster", _RASTER_SOURCES, _RASTER_HEADERS)


def ssim() -> ModuleType:
    """gstrain_ssim: the fused SSIM and L1 + SSIM loss, forward and backward."""
    return load_extension(
        "gstrain_ssim", _SSIM_SOURCES, _SSIM_HEADERS,
        what="the fused SSIM kernel", alternative="set dev.fused_ssim=false",
    )  # fmt: skip


def step_ops() -> ModuleType:
    """gstrain_step: the multi-tensor Adam and the densification statistics."""
    return load_extension(
        "gstrain_step", _STEP_SOURCES, _STEP_HEADERS,
        what="the fused Adam / densification-statistics kernels",
        alternative="set dev.fused_adam=false and dev.fast_stats=false",
    )  # fmt: skip


def bilateral() -> ModuleType:
    """gstrain_bilateral: the bilateral grid's slice-and-apply (train.appearance=bilateral), forward and backward."""
    return load_extension(
        "gstrain_bilateral", _BILATERAL_SOURCES, _BILATERAL_HEADERS,
        what="the fused bilateral-grid kernel", alternative="set dev.fused_bilateral=false",
    )  # fmt: skip


def remap() -> ModuleType:
    """gstrain_remap: the undistortion remap of a uint8 image through its coarse map, in one kernel."""
    return load_extension(
        "gstrain_remap", _REMAP_SOURCES, _REMAP_HEADERS,
        what="the fused undistortion kernel", alternative="set dev.fused_remap=false",
    )  # fmt: skip


# name -> the function that builds (first use) and loads that extension: what `python -m bench.builds` names
BUILDERS: dict[str, Callable[[], ModuleType]] = {
    "raster": raster, "ssim": ssim, "step_ops": step_ops, "bilateral": bilateral, "remap": remap,
}  # fmt: skip
