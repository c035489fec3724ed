"""One typed config: dataclass defaults, merged with configs/*.yaml and command-line overrides.

Unknown keys and values of the wrong type are user errors (exit 2), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gstrain.config_checks import validate
from gstrain.dev_config import DevConfig, move_legacy_keys
from gstrain.errors import UserError
from gstrain.files import write_text_atomic


@dataclass
class DataConfig:
    factor: int = 1  # downscale factor; images_<factor>/ is used when present
    test_every: int = 8  # every Nth image (sorted by name) is held out; 0 = none
    background: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    # masked pixels (masks/ or alpha): "ignore" leaves them out of loss and metrics; "background"
    # trains them to data.background (object captures) and scores all pixels against that target
    mask_mode: str = "ignore"
    # where the training images live while training: gpu | host | disk | auto (the first that fits,
    # said in one line); gstrain/data/image_store.py
    images_on: str = "auto"
    max_side: int = 0  # downscale (after factor) so the longer side is at most this many pixels; 0: no limit
    # images_on=disk: how many decode the images; 0: the machine's cores less two, 4 to 16
    decode_workers: int = 0


@dataclass
class ModelConfig:
    sh_degree: int = 3
    init: str = "sfm"  # sfm | random (random points when the SfM cloud is empty or unwanted)
    init_points: int = 100_000  # count for init=random
    init_opacity: float = 0.1
    init_scale: float = 1.0


@dataclass
class OptimConfig:
    # 3DGS / gsplat defaults. The position rate is multiplied by the scene extent and decays
    # exponentially to means_lr_final over the run.
    means_lr: float = 1.6e-4
    means_lr_final: float = 1.6e-6
    scales_lr: float = 5e-3
    quats_lr: float = 1e-3
    opacities_lr: float = 5e-2
    sh0_lr: float = 2.5e-3
    shN_lr: float = 2.5e-3 / 20
    eps: float = 1e-15
    # update only the Gaussians drawn this step (gsplat's SelectiveAdam rule; CUDA only)
    sparse_adam: bool = False
    # Adam's moments (exp_avg, exp_avg_sq) of the Gaussians' parameters: fp32, bf16 (half their
    # bytes, 236 B a Gaussian less at SH degree 3; float32 math, stochastic rounding on store so
    # small updates of exp_avg_sq are not lost) or int8 (shN's in 8 bits with a scale per
    # Gaussian, the rest bf16: 86 B less than bf16). bf16 and int8 need sparse_adam=false; the
    # per-view appearance and pose tables keep float32 moments (they are small).
    moments: str = "fp32"
    # train.pose_refine: the per-view pose corrections' rate (rotation in radians, translation in
    # units of the scene extent), decaying exponentially to pose_lr_final over the run
    pose_lr: float = 1e-3
    pose_lr_final: float = 1e-4


@dataclass
class TrainConfig:
    steps: int = 30_000
    ssim_lambda: float = 0.2
    sh_degree_interval: int = 1000  # raise the active SH degree every N steps
    seed: int = 42
    device: str = "auto"  # auto | cpu | cuda
    stop_at: int = 0  # pause after this step (0: run to `steps`); schedules still span `steps`
    # keep the run under this many GiB of GPU memory (0: no budget): densification stops growing at
    # the Gaussian count that fits, MCMC's cap is lowered to it (gstrain/train/memory_budget.py)
    max_memory_gib: float = 0.0
    threads: int = 0  # CPU threads for torch (0: auto, see gstrain/threads.py)
    # views per step: the loss is the mean of their losses (one backward, one optimizer step); under
    # torchrun it is the GLOBAL batch: each view is rendered by its home rank
    batch_size: int = 1
    # learn a rotation and translation correction per training view (train/pose_refine.py),
    # from step pose_refine_start on
    pose_refine: bool = False
    pose_refine_start: int = 0
    # a per-image colour correction learned with the scene (gstrain/train/appearance.py): none,
    # affine (a 3x4 colour matrix and bias per training image, from identity), or bilateral (per
    # training image a grid of such transforms over x, y and the render's luminance, blended per
    # pixel: also vignetting and tone curves; gstrain/train/bilateral_grid.py) applied to the render
    # before the loss; test views have none, so eval reports the raw render and a fitted-on-half score
    appearance: str = "none"
    appearance_lr: float = 1e-3  # Adam's rate for the corrections
    appearance_decay: float = 0.0  # per step, pulls each correction toward identity by lr * decay
    appearance_start: int = 0  # the corrections stay identity (not learned) before this step
    # appearance=bilateral: the grid's cells across the image (x, y) and the luminance (1 to 64 each),
    # and the weight of the grids' total variation (the sum over the three axes of the mean squared
    # difference of neighbouring cells) added to the loss: it keeps each image's grid smooth
    bilateral_grid_x: int = 16
    bilateral_grid_y: int = 16
    bilateral_grid_luma: int = 8
    bilateral_tv: float = 10.0


@dataclass
class StrategyConfig:
    name: str = "default"  # default (gsplat DefaultStrategy) | mcmc (gsplat MCMCStrategy; CPU too)
    refine_start: int = 500
    refine_stop: int = 15_000
    refine_every: int = 100
    reset_every: int = 3000  # opacities reset to 2 x prune_opa every N steps until refine_stop
    grow_grad2d: float = 2e-4
    grow_scale3d: float = 0.01
    prune_opa: float = 0.005
    prune_scale3d: float = 0.1
    absgrad: bool = False
    cap_max: int = 1_000_000  # mcmc only


@dataclass
class RenderConfig:
    backend: str = "auto"  # auto: our CUDA kernels on a GPU, the PyTorch reference on the CPU
    atomic_mode: str = "arc"  # our CUDA backward's reduction: atomic | warp | distwar (dev.atomic_threshold) | arc
    # scale each Gaussian's opacity by sqrt(det(cov2d) / det(cov2d + 0.3 I)): the 0.3-pixel 2D blur
    # then no longer brightens small Gaussians, so renders at other scales than training (zoomed
    # out) alias less (gsplat's rasterize_mode="antialiased"; every backend)
    antialiased: bool = False
    # Mip-Splatting's 3D smoothing filter: a 3D Gaussian low-pass whose variance is this many
    # pixels^2 at each Gaussian's highest sampling rate over the training views (focal / depth),
    # added to the Gaussian's covariance with its opacity compensated (gstrain/render/filter3d.py).
    # 0 = off; the paper uses 0.2
    filter_3d: float = 0.0


@dataclass
class LogConfig:
    progress_every: int = 100  # progress bar / NaN check cadence (each is one host sync: it drains the GPU queue)
    tb_every: int = 100  # TensorBoard scalars and per-phase timings (of the steps dev.time_every times)
    # test evaluations (and the end of the run); 0 also scores the initial model before the first
    # step, which that step then waits for (250 test views at 1080p: about 4 s)
    eval_steps: list[int] = field(default_factory=lambda: [7000, 30_000])
    save_steps: list[int] = field(default_factory=lambda: [7000, 30_000])  # PLY exports
    ckpt_every: int = 1000  # full checkpoints, so a crash or NaN loses at most this many steps
    keep_ckpts: int = 2
    # at the end, also score every training view: a view the model never fitted shows a failed
    # fit, where a low test score alone could be overfitting
    eval_train_views: bool = False


@dataclass
class ViewerConfig:  # gstrain fit --viewer
    refresh_every: int = 100  # steps between splat updates in the browser (each copies the splats to the host)
    port: int = 8080
    host: str = "127.0.0.1"


@dataclass
class DistConfig:  # torchrun --nproc-per-node=G -m gstrain fit ... (README "Several GPUs")
    partition: str = "locality"  # who owns which Gaussian: locality | random | round_robin | views
    compress: str = "none"  # records on the wire: none | fp16 (opacity, colour 16-bit; gradients bfloat16)
    timeout_s: float = 600.0  # a collective waiting longer than this ends the run (a rank died)
    # auto: nccl on GPUs, gloo on the CPU; gloo on GPUs lets ranks share one GPU (correctness runs)
    backend: str = "auto"
    reprofile_every: int = 0  # partition again every N steps (0: never): load follows densification
    # partition again when the busiest owner sent more than this many times the mean records over
    # the last rebalance_window steps (0: never; >= 1 otherwise); checked when the ranks agree
    # (log.progress_every), once the window spans rebalance_window steps
    rebalance_above: float = 0.0
    rebalance_window: int = 500
    # locality cuts balance (1 - w) * load + w * count: 0 = views' load only (uneven memory), 1 = counts
    count_weight: float = 0.5
    # partition=views falls back to locality beyond this x the mean load or count (unless locality is worse)
    max_imbalance: float = 1.5


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    log: LogConfig = field(default_factory=LogConfig)
    viewer: ViewerConfig = field(default_factory=ViewerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    dev: DevConfig = field(default_factory=DevConfig)  # gstrain's own switches (gstrain/dev_config.py)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check/convert one value against its dataclass annotation; raise UserError on mismatch."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise UserError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, item_type, key) for v in value]
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported annotation for {key}")  # not used by our dataclasses
    # Strings are never numbers or booleans: `steps: "7"` is a quoted string in YAML, a mistake.
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"config key '{key}' expects true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"config key '{key}' expects an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise UserError(f"config key '{key}' expects a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise UserError(f"config key '{key}' expects a string, got {value!r}")
    raise TypeError(f"unsupported annotation {annotation!r} for {key}")


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def merge_dict(cfg: Config, updates: dict[str, Any], origin: str = "config") -> Config:
    """Apply a nested {section: {key: value}} mapping onto cfg in place; unknown keys are errors.
    A key that moved to dev (dev_config.LEGACY_KEYS) is set there, with a one-line note."""
    if not isinstance(updates, dict):
        raise UserError(f"{origin}: expected a mapping of sections, got {type(updates).__name__}")
    updates, moved = move_legacy_keys(updates)
    for change in moved:
        print(f"gstrain: note: {origin}: {change.replace(' -> ', ' is now ')}", file=sys.stderr)
    sections = _field_types(cfg)
    for section, values in updates.items():
        if section not in sections:
            raise UserError(f"{origin}: unknown config section '{section}' (known: {', '.join(sections)})")
        sub = getattr(cfg, section)
        if not isinstance(values, dict):
            raise UserError(f"{origin}: section '{section}' must be a mapping")
        types_ = _field_types(sub)
        for key, value in values.items():
            if key not in types_:
                raise UserError(
                    f"{origin}: unknown config key '{section}.{key}' (known: {', '.join(types_)})"
                )
            setattr(sub, key, _coerce(value, types_[key], f"{section}.{key}"))
    return cfg


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` (no dot) as a string; as in YAML 1.2, it is a float here."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = _yaml(path.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "parse error"
        raise UserError(f"config file {path} is not valid YAML: {first}") from None
    return data or {}


def parse_override(text: str) -> dict[str, Any]:
    """'section.key=value' -> {section: {key: value}}, value parsed as YAML (numbers, lists, bools)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"override '{text}' must look like section.key=value (e.g. train.steps=1000)")
    dotted, raw = text.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = _yaml(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return {section: {key: value}}


def upgrade_saved_config(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config as this version reads it: the keys that moved to dev in dev (silently: the
    run wrote them), and render.atomic_mode=gsplat, which runs from before render.backend=gsplat
    existed saved for gsplat's rasterizer, as that backend."""
    data, _ = move_legacy_keys(data)
    render = data.get("render") if isinstance(data, dict) else None
    if isinstance(render, dict) and render.get("atomic_mode") == "gsplat":
        render = {**render, "backend": "gsplat", "atomic_mode": RenderConfig.atomic_mode}
        data = {**data, "render": render}
    return data


def build_config(
    config_files: list[str | Path] | None = None,
    overrides: list[dict[str, Any]] | None = None,
) -> Config:
    """Defaults <- each YAML file in order <- each override mapping in order, then validated."""
    return merge_config(Config(), config_files, overrides)


def merge_config(
    cfg: Config,
    config_files: list[str | Path] | None = None,
    overrides: list[dict[str, Any]] | None = None,
) -> Config:
    """cfg <- each YAML file in order <- each override mapping in order, then validated (in place)."""
    for path in config_files or []:
        merge_dict(cfg, load_yaml(path), origin=str(path))
    for update in overrides or []:
        merge_dict(cfg, update, origin="command line")
    return validate(cfg)


# What a run is built on: changing one of these on --resume would not fit its checkpoint or its views.
RUN_FIXED_KEYS = ("data.factor", "data.max_side", "data.test_every", "model.sh_degree", "strategy.name",
                  "train.appearance", "train.bilateral_grid_x", "train.bilateral_grid_y", "train.bilateral_grid_luma")


def changed_fixed_keys(old: Config, new: Config) -> list[str]:
    """'key: old -> new' for each RUN_FIXED_KEYS entry that differs."""
    changed = []
    for dotted in RUN_FIXED_KEYS:
        section, key = dotted.split(".")
        a, b = getattr(getattr(old, section), key), getattr(getattr(new, section), key)
        if a != b:
            changed.append(f"{dotted}: {a} -> {b}")
    return changed


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from its saved dict (config.yaml of a run, or a checkpoint)."""
    return validate(merge_dict(Config(), upgrade_saved_config(data), origin="saved config"))


def save_config(cfg: Config, path: Path) -> None:
    write_text_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
