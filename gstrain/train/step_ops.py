"""The training-step kernels (csrc/step_ops.cu), built on first use like the other extensions."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from gstrain.cuda_build import load_extension

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE_PATHS = (_CSRC / "step_bindings.cpp", _CSRC / "step_ops.cu")
_HEADER_PATHS = (_CSRC / "step_ops.h",)


def ensure_built() -> ModuleType:
    """Build (first use only) and load gstrain_step; UserError when this machine cannot."""
    return load_extension(
        "gstrain_step", _SOURCE_PATHS, _HEADER_PATHS,
        what="the fused Adam / densification-statistics kernels",
        alternative="set optim.fused_adam=false and strategy.fast_stats=false",
    )  # fmt: skip
