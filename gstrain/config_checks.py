"""Checks of a whole config that a type check cannot do: allowed values, ranges and combinations.
One UserError line each. config.build_config and merge_config run them on every config they make."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gstrain.choices import (
    APPEARANCE_MODES,
    ATOMIC_MODES,
    BACKENDS,
    BILATERAL_BACKWARDS,
    COMPRESSIONS,
    DECODE_IN,
    DEVICES,
    DIST_BACKENDS,
    IMAGES_ON,
    INIT_MODES,
    MASK_MODES,
    MOMENTS,
    PARTITIONS,
)
from gstrain.errors import UserError
from gstrain.train.strategies.registry import STRATEGY_NAMES

if TYPE_CHECKING:
    from gstrain.config import Config

# train.seed seeds numpy's legacy generator too (np.random.seed), the narrowest of the three
SEED_MAX = 2**32 - 1
DECODE_WORKERS_MAX = 256
# dist.timeout_s below this cannot even set the process group up (the ranks' first handshake)
MIN_DIST_TIMEOUT_S = 1.0
# train.bilateral_grid_*: cells per axis. 64 x 64 x 64 cells of 12 floats are 12.6 MB a training
# image (and as much again for each Adam moment and the gradient): more is no longer a coarse grid
BILATERAL_GRID_MAX = 64


def validate(cfg: Config) -> Config:
    """Cross-field checks that a type check cannot do."""

    def choice(value: str, options: tuple[str, ...], key: str) -> None:
        if value not in options:
            raise UserError(f"{key} must be one of {', '.join(options)}; got '{value}'")

    choice(cfg.render.backend, BACKENDS, "render.backend")
    check_atomic_mode(cfg.render.atomic_mode)
    choice(cfg.train.device, DEVICES, "train.device")
    choice(cfg.strategy.name, STRATEGY_NAMES, "strategy.name")
    choice(cfg.model.init, INIT_MODES, "model.init")
    choice(cfg.data.mask_mode, MASK_MODES, "data.mask_mode")
    choice(cfg.data.images_on, IMAGES_ON, "data.images_on")
    choice(cfg.dev.decode_in, DECODE_IN, "dev.decode_in")
    choice(cfg.dev.bilateral_backward, BILATERAL_BACKWARDS, "dev.bilateral_backward")
    choice(cfg.train.appearance, APPEARANCE_MODES, "train.appearance")
    if cfg.train.appearance_lr <= 0 or cfg.train.appearance_decay < 0 or cfg.train.appearance_start < 0:
        raise UserError("train.appearance_lr must be > 0, train.appearance_decay and train.appearance_start >= 0; "
                        f"got {cfg.train.appearance_lr}, {cfg.train.appearance_decay}, {cfg.train.appearance_start}")
    check_bilateral_grid(cfg)
    choice(cfg.optim.moments, MOMENTS, "optim.moments")
    if cfg.optim.moments != "fp32" and cfg.optim.sparse_adam:
        # the visible-only update is fused Adam's float32 path only
        raise UserError(f"optim.moments={cfg.optim.moments} needs optim.sparse_adam=false")
    choice(cfg.dist.partition, PARTITIONS, "dist.partition")
    choice(cfg.dist.compress, COMPRESSIONS, "dist.compress")
    choice(cfg.dist.backend, DIST_BACKENDS, "dist.backend")
    if cfg.dist.reprofile_every < 0:
        raise UserError(f"dist.reprofile_every must be >= 0 (0: never); got {cfg.dist.reprofile_every}")
    if cfg.dist.rebalance_above != 0 and cfg.dist.rebalance_above < 1:
        raise UserError(f"dist.rebalance_above must be 0 (off) or >= 1 (max/mean load); got {cfg.dist.rebalance_above}")
    if cfg.dist.rebalance_window < 1:
        raise UserError(f"dist.rebalance_window must be >= 1 (steps); got {cfg.dist.rebalance_window}")
    by_load = cfg.dist.partition == "views" or (cfg.dist.partition == "locality" and cfg.dist.count_weight < 1)
    if cfg.dist.rebalance_above and not by_load:
        # random and round robin ignore load, as does a locality cut with count_weight 1: partitioning
        # again would not even it out, only move every Gaussian at every check
        raise UserError("dist.rebalance_above needs dist.partition=views, or locality with dist.count_weight < 1")
    if cfg.dist.max_imbalance < 1:
        raise UserError(f"dist.max_imbalance must be >= 1 (max/mean); got {cfg.dist.max_imbalance}")
    if not 0.0 <= cfg.dist.count_weight <= 1.0:
        raise UserError(f"dist.count_weight must be in [0, 1]; got {cfg.dist.count_weight}")
    if not cfg.dist.timeout_s >= MIN_DIST_TIMEOUT_S:  # also NaN
        raise UserError(f"dist.timeout_s must be >= {MIN_DIST_TIMEOUT_S:g} (seconds); got {cfg.dist.timeout_s:g}")
    if cfg.train.batch_size < 1:
        raise UserError(f"train.batch_size must be >= 1; got {cfg.train.batch_size}")
    if cfg.train.steps < 1:
        raise UserError(f"train.steps must be >= 1; got {cfg.train.steps}")
    if not 0 <= cfg.train.stop_at <= cfg.train.steps:
        raise UserError(f"train.stop_at must be 0 (off) or a step up to train.steps ({cfg.train.steps}); "
                        f"got {cfg.train.stop_at}")
    if cfg.data.factor < 1:
        raise UserError(f"data.factor must be >= 1; got {cfg.data.factor}")
    if not 0 <= cfg.model.sh_degree <= 3:
        raise UserError(f"model.sh_degree must be 0..3; got {cfg.model.sh_degree}")
    if not 1 <= cfg.dev.atomic_threshold <= 32:
        raise UserError(f"dev.atomic_threshold must be 1..32; got {cfg.dev.atomic_threshold}")
    if not 0.0 <= cfg.render.filter_3d < 100.0:
        raise UserError(f"render.filter_3d must be 0 (off) or a variance in pixels^2 below 100; "
                        f"got {cfg.render.filter_3d}")
    if len(cfg.data.background) != 3:
        raise UserError("data.background must be three numbers (RGB in 0..1)")
    if cfg.viewer.refresh_every < 1:
        raise UserError(f"viewer.refresh_every must be >= 1; got {cfg.viewer.refresh_every}")
    for key in ("refine_every", "reset_every"):
        if getattr(cfg.strategy, key) < 1:
            raise UserError(f"strategy.{key} must be >= 1; got {getattr(cfg.strategy, key)}")
    if cfg.dev.time_every < 1:
        raise UserError(f"dev.time_every must be >= 1; got {cfg.dev.time_every}")
    if not 0.0 <= cfg.train.ssim_lambda <= 1.0:
        raise UserError(f"train.ssim_lambda must be in [0, 1]; got {cfg.train.ssim_lambda}")
    _validate_ranges(cfg)
    return cfg


def check_atomic_mode(mode: str, flag: bool = False) -> None:
    """UserError unless `mode` is one of ATOMIC_MODES; 'gsplat' names the backend it now is.

    flag: word the message for the --atomic-mode command-line flag rather than the config key.
    """
    key, backend = ("--atomic-mode", "--backend gsplat") if flag else ("render.atomic_mode", "render.backend=gsplat")
    if mode == "gsplat":
        raise UserError(f"{key} gsplat is no longer an atomic mode: gsplat's rasterizer is a backend, use {backend}")
    if mode not in ATOMIC_MODES:
        raise UserError(f"{key} must be one of {', '.join(ATOMIC_MODES)}; got '{mode}'")


def _validate_ranges(cfg: Config) -> None:
    """Values that pass the type check but would crash or silently misbehave later."""
    at_least = {
        "log.progress_every": (cfg.log.progress_every, 1), "log.tb_every": (cfg.log.tb_every, 1),
        "train.sh_degree_interval": (cfg.train.sh_degree_interval, 1),
        "log.ckpt_every": (cfg.log.ckpt_every, 0), "log.keep_ckpts": (cfg.log.keep_ckpts, 0),
        "data.test_every": (cfg.data.test_every, 0), "model.init_points": (cfg.model.init_points, 1),
        "train.threads": (cfg.train.threads, 0), "train.seed": (cfg.train.seed, 0),
        "train.pose_refine_start": (cfg.train.pose_refine_start, 0),
        "strategy.cap_max": (cfg.strategy.cap_max, 1), "data.max_side": (cfg.data.max_side, 0),
        "data.decode_workers": (cfg.data.decode_workers, 0),
    }
    for key, (value, low) in at_least.items():
        if value < low:
            raise UserError(f"{key} must be >= {low}; got {value}")
    if cfg.data.decode_workers > DECODE_WORKERS_MAX:
        raise UserError(f"data.decode_workers must be 0..{DECODE_WORKERS_MAX} (each is a process); "
                        f"got {cfg.data.decode_workers}")  # fmt: skip
    if cfg.train.seed > SEED_MAX:
        raise UserError(f"train.seed must be 0..{SEED_MAX} (numpy's seed range); got {cfg.train.seed}")
    for name in ("means_lr", "means_lr_final", "scales_lr", "quats_lr", "opacities_lr", "sh0_lr", "shN_lr", "pose_lr",
                 "pose_lr_final"):
        value = getattr(cfg.optim, name)
        if not value >= 0.0 or value == float("inf"):  # also NaN
            raise UserError(f"optim.{name} must be a learning rate >= 0; got {value}")
    if not 0.0 <= cfg.train.max_memory_gib < float("inf"):  # also NaN
        raise UserError(f"train.max_memory_gib must be a size in GiB >= 0 (0: no budget); "
                        f"got {cfg.train.max_memory_gib}")
    if not cfg.optim.eps > 0.0:
        raise UserError(f"optim.eps must be > 0; got {cfg.optim.eps}")
    if not 0.0 < cfg.model.init_opacity < 1.0:
        raise UserError(f"model.init_opacity must be in (0, 1) (it is stored as a logit); got {cfg.model.init_opacity}")
    if not cfg.model.init_scale > 0.0:
        raise UserError(f"model.init_scale must be > 0; got {cfg.model.init_scale}")
    if not all(0.0 <= c <= 1.0 for c in cfg.data.background):
        raise UserError(f"data.background must be three numbers in [0, 1]; got {cfg.data.background}")
    if any(s < 0 for s in cfg.log.eval_steps):
        raise UserError(f"log.eval_steps must list steps >= 0 (0: the initial model); got {cfg.log.eval_steps}")
    if any(s < 1 for s in cfg.log.save_steps):
        raise UserError(f"log.save_steps must list steps >= 1; got {cfg.log.save_steps}")


def check_bilateral_grid(cfg: Config) -> None:
    """train.bilateral_grid_x, _y, _luma in [1, BILATERAL_GRID_MAX]; train.bilateral_tv finite and >= 0."""
    t = cfg.train
    for key in ("bilateral_grid_x", "bilateral_grid_y", "bilateral_grid_luma"):
        value = getattr(t, key)
        if not 1 <= value <= BILATERAL_GRID_MAX:
            raise UserError(f"train.{key} must be in [1, {BILATERAL_GRID_MAX}] (cells); got {value}")
    if not 0.0 <= t.bilateral_tv < float("inf"):  # also NaN
        raise UserError(f"train.bilateral_tv must be >= 0 and finite; got {t.bilateral_tv}")
