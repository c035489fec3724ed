"""The developer's settings: the `dev:` section of a config, set with `--set dev.KEY=VALUE`.

None of them chooses what a run trains. The speed switches compute the same function their fast
way or the plain way (`gstrain profile --switches` times each one turned off); the rest set how a
run is observed (time_every), a tuning constant (atomic_threshold) or which path a one-process
torchrun takes (always_distributed). They exist to measure and debug gstrain; users leave them.

Runs written before this section existed saved these keys in other sections: move_legacy_keys
moves them here, so such a run's config.yaml still loads (config.upgrade_saved_config), and a
config file or --set that still names an old key works, with a note.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass
class DevConfig:
    # --- speed switches (CUDA only; each gives the same function as the plain way)
    fused_ssim: bool = True  # the fused SSIM kernels on a GPU (the convolutions on the CPU either way)
    fused_adam: bool = True  # one kernel launch steps all six tensors (gstrain/train/fused_adam.py)
    fast_stats: bool = True  # DefaultStrategy's per-step statistics without host syncs (same values)
    # drop (Gaussian, tile) pairs whose alpha is provably < 1/255 on the whole tile, inside our
    # intersection kernel (gstrain/render/isect.py, test in cull.py); images and gradients stay the
    # same. render.backend=gsplat keeps gsplat's own intersection
    ellipse_cull: bool = True
    # the colours from the SH in one kernel each way (gstrain/render/sh_colors.py) instead of
    # gsplat's spherical_harmonics and the tensor ops around it (a [N, 16, 3] concatenation among
    # them). It saves memory and eager steps' launches; in graph steps it is level with gsplat's
    fused_sh: bool = True
    # train.appearance=bilateral's slice-and-apply in one kernel each way (gstrain/train/fused_bilateral.py)
    # instead of F.grid_sample, whose backward adds every pixel into the small grid with global atomics
    fused_bilateral: bool = True
    bilateral_backward: str = "row_runs"  # its backward's way of summing into the grid (choices.BILATERAL_BACKWARDS)
    # replay training steps (one view, or train.batch_size views) as CUDA graphs (our CUDA kernels
    # with ellipse_cull and fused Adam): far less host time a step (gstrain/train/graph_step.py)
    cuda_graphs: bool = True
    # undistort a streamed or uploaded distorted image in one kernel through its coarse map
    # (gstrain/data/csrc/remap.cu) instead of F.interpolate to a full-resolution map and F.grid_sample
    fused_remap: bool = True
    # shN's Adam step inside the backward, slice by slice, so its gradient (180 bytes a Gaussian)
    # is never whole at the step's memory peak (gstrain/train/backward_adam.py): the same update
    adam_in_backward: bool = True
    # --- the rest
    atomic_threshold: int = 8  # render.atomic_mode=distwar's lane threshold T, 1..32 (arc tunes its own)
    # time the phases of every Nth step from step N // 2 on (not the first step, which pays one-time
    # costs; events cost host time; 1 = every step). A timed step runs eagerly, not as a CUDA graph,
    # and waits for the queued replays first, so timing often slows the run: 197 keeps 152 samples
    # in 30k steps (49 had 612). A prime: timed steps meet refinements (every 100) at their own rate
    time_every: int = 197
    # who decodes data.images_on=disk's images: worker processes (each with its own GIL; the
    # default where the OS allows) or threads in the training process (gstrain/data/decoders.py)
    decode_in: str = "processes"
    always_distributed: bool = False  # torchrun with one process takes the distributed path too (its overhead)


# old "section.key" -> its dev key
LEGACY_KEYS = {
    "train.fused_ssim": "fused_ssim",
    "optim.fused_adam": "fused_adam",
    "strategy.fast_stats": "fast_stats",
    "render.ellipse_cull": "ellipse_cull",
    "render.fused_sh": "fused_sh",
    "train.cuda_graphs": "cuda_graphs",
    "render.atomic_threshold": "atomic_threshold",
    "log.time_every": "time_every",
    "dist.always": "always_distributed",
}


def move_legacy_keys(data: Any) -> tuple[Any, list[str]]:
    """`data` ({section: {key: value}}) with each old key moved to dev (a key the same mapping
    also sets under dev keeps the dev value), and 'old -> dev.new' for each one moved. Anything
    that is not a mapping of mappings comes back as it is, for the config's own checks."""
    if not isinstance(data, dict) or not isinstance(data.get("dev", {}), dict):
        return data, []
    out = copy.copy(data)
    moved = []
    for old, new in LEGACY_KEYS.items():
        section, key = old.split(".")
        values = out.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        values = dict(values)
        value = values.pop(key)
        out[section] = values
        dev = out.get("dev")
        dev = dict(dev) if isinstance(dev, dict) else {}
        dev.setdefault(new, value)
        out["dev"] = dev
        moved.append(f"{old} -> dev.{new}")
    return out, moved

