"""A run folder (runs/<name>/): where it goes, what it records about its scene, and loading it back.

Nothing here writes before every check has passed, and nothing writes over a file that gstrain
did not put there: a fresh run goes into a new or empty folder, or into a run folder that
holds no checkpoint yet (one left behind by a crash or an early Ctrl-C).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gstrain import __version__
from gstrain.config import (
    Config,
    changed_fixed_keys,
    config_from_dict,
    merge_config,
    save_config,
)
from gstrain.errors import UserError
from gstrain.files import make_dir, write_text_atomic
from gstrain.render.sh import sh_degree_at
from gstrain.train.checkpoint import find_checkpoint, list_checkpoints, set_aside
from gstrain.train.run_record import SUMMARY_FILE

if TYPE_CHECKING:
    import torch

    from gstrain.data.scene import Scene
    from gstrain.render import Renderer

RUN_FILE = "run.json"
METRICS_FILE = "metrics.json"  # written by gstrain eval
CONFIG_FILE = "config.yaml"
# What a run folder records about itself: no output of gstrain (an export, a render) may land on
# these files or inside these folders, even with --force; losing them loses the run.
RECORD_FILES = (CONFIG_FILE, RUN_FILE, SUMMARY_FILE, METRICS_FILE)
RECORD_FOLDERS = ("ckpt", "tb")


def default_run_dir(scene: Path, runs_root: Path = Path("runs")) -> Path:
    """runs/<scene name>, or runs/<scene name>-2, -3, ... so an earlier run is never overwritten."""
    base = runs_root / scene.resolve().name
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = runs_root / f"{base.name}-{n}"
    return candidate


def is_run_dir(path: Path) -> bool:
    return (path / RUN_FILE).is_file()


def check_not_run_record(path: Path) -> None:
    """Refuse an output path inside a run's ckpt/ or tb/, or on one of its record files."""
    target = Path(path).parent.resolve() / Path(path).name
    if target.name in RECORD_FILES and is_run_dir(target.parent):
        raise UserError(f"--out {path} is the {target.name} of the run {target.parent}, which gstrain never "
                        "replaces (not even with --force); choose another path")
    for folder in target.parents:
        if folder.name in RECORD_FOLDERS and is_run_dir(folder.parent):
            raise UserError(f"--out {path} is inside the {folder.name}/ folder of the run {folder.parent}, where "
                            "gstrain writes nothing else (not even with --force); choose another path")


def check_new_run_dir(run_dir: Path) -> bool:
    """May a fresh fit use run_dir? True when it reuses a run folder that has no checkpoint yet."""
    if not run_dir.exists():
        if run_dir.is_symlink():
            raise UserError(f"--out {run_dir} is a dangling symbolic link")
        return False
    if not run_dir.is_dir():
        raise UserError(f"--out {run_dir} is a file, not a folder; choose a folder for the run")
    if is_run_dir(run_dir):
        if list_checkpoints(run_dir):
            raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
        return True  # a run that never reached its first checkpoint: start it again
    if any(run_dir.iterdir()):
        raise UserError(f"--out {run_dir} holds files that gstrain did not write; choose a new or empty folder")
    return False


def create_run_dir(run_dir: Path, scene: Path, cfg: Config) -> None:
    check_new_run_dir(run_dir)
    make_dir(run_dir)
    save_config(cfg, run_dir / CONFIG_FILE)
    meta = {"scene": str(scene.resolve()), "created": time.strftime("%Y-%m-%d %H:%M:%S"), "gstrain": __version__}
    write_text_atomic(run_dir / RUN_FILE, json.dumps(meta, indent=2))


def load_run(run_dir: Path) -> tuple[Config, dict[str, Any]]:
    """(resolved config, run.json) of an existing run; a user error if the folder is not a run."""
    if not run_dir.exists():
        raise UserError(f"run folder not found: {run_dir}")
    if not is_run_dir(run_dir):
        raise UserError(f"{run_dir} is not a gstrain run (no {RUN_FILE}); train one with: gstrain fit SCENE")
    try:
        data = yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}
        meta = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{run_dir}: cannot read config.yaml / {RUN_FILE}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(meta, dict):
        raise UserError(f"{run_dir}: config.yaml or {RUN_FILE} is not a mapping")
    return config_from_dict(data), meta


def run_scene(run_dir: Path, meta: dict[str, Any]) -> Path:
    """The scene folder run.json names; a user error when it names none or it is gone."""
    scene = meta.get("scene")
    if not isinstance(scene, str) or not scene:
        raise UserError(f"{run_dir / RUN_FILE} does not name the scene the run was trained on")
    path = Path(scene)
    if not path.is_dir():
        raise UserError(f"the scene this run was trained on is missing: {path} (from {run_dir / RUN_FILE})")
    return path


def update_run_config(run_dir: Path, cfg: Config) -> None:
    save_config(cfg, run_dir / CONFIG_FILE)


# ------------------------------------------------------------------------------------- resume
@dataclass
class ResumePlan:
    """What `fit --resume` will continue: checked in full before anything is written."""

    cfg: Config
    state: dict[str, Any] | None  # None: the run has no checkpoint yet and starts at step 0
    checkpoint: Path | None
    damaged: list[Path] = field(default_factory=list)  # newer unreadable checkpoints, passed over


def plan_resume(
    run_dir: Path,
    scene: Path,
    config_files: list[Path] | None,
    overrides: list[dict[str, Any]],
    allow_older: bool = False,
    log: Callable[[str], None] | None = None,
) -> ResumePlan:
    """The run's config with the new files and flags merged, its checkpoint, and every check
    that can fail (scene, fixed keys, the checkpoint against the config), without writing."""
    saved, meta = load_run(run_dir)
    recorded = meta.get("scene")
    if isinstance(recorded, str) and recorded and Path(recorded) != scene.resolve():
        raise UserError(f"--resume: {run_dir} was trained on {recorded}, not {scene.resolve()}; "
                        "give that scene or choose another --out")
    cfg = merge_config(config_from_dict(saved.to_dict()), [*(config_files or [])], overrides)
    changed = changed_fixed_keys(saved, cfg)
    if changed:
        raise UserError(f"--resume cannot change {'; '.join(changed)} (the run is built on them); "
                        "start a new run with another --out")
    found = find_checkpoint(run_dir, "cpu", allow_older=allow_older, log=log)
    if found is None:
        return ResumePlan(cfg, None, None)
    state, path, damaged = found
    shn = state["params"].get("shN")
    expected = (cfg.model.sh_degree + 1) ** 2 - 1
    if shn is None or shn.dim() < 2 or shn.shape[1] != expected:
        raise UserError(f"checkpoint {path} does not fit model.sh_degree={cfg.model.sh_degree} of {run_dir}")
    return ResumePlan(cfg, state, path, damaged)


def check_scene_fits(plan: ResumePlan, scene: Scene, scene_path: Path) -> None:
    """The loaded views must be the ones the checkpoint was trained on (count of training views)."""
    if plan.state is None:
        return
    sampler = plan.state.get("sampler", {})
    order = sampler.get("order") if isinstance(sampler, dict) else None
    if order and (max(order) >= len(scene.train) or len(order) != len(scene.train)):
        raise UserError(f"--resume: {scene_path} has {len(scene.train)} training views, but the checkpoint "
                        f"{plan.checkpoint} was trained on {len(order)}; the scene has changed")


def commit_resume(run_dir: Path, plan: ResumePlan, log: Callable[[str], None]) -> None:
    """The first writes of a resumed fit: damaged checkpoints set aside, the merged config saved."""
    set_aside(plan.damaged, log)
    update_run_config(run_dir, plan.cfg)


# ------------------------------------------------------------------------------------- open
@dataclass
class OpenRun:
    """A trained run, ready to render: for eval, render, export and profile."""

    run_dir: Path
    cfg: Config
    meta: dict[str, Any]
    scene_path: Path | None
    scene: Scene | None
    state: dict[str, Any]
    checkpoint: Path
    step: int
    params: Any  # torch.nn.ParameterDict on `device`, no gradients
    device: torch.device | None
    renderer: Renderer | None
    sh_degree: int  # the degree training had reached at `step`
    background: torch.Tensor | None


def open_run(
    run_dir: Path,
    device: str = "auto",
    allow_older: bool = False,
    log: Callable[[str], None] | None = None,
    load_views: bool = True,
    renderer: bool = True,
) -> OpenRun:
    """Config, scene, parameters of the newest good checkpoint and a renderer of a trained run.

    `load_views=False` skips the scene (export); `renderer=False` skips the device (export).
    """
    import torch

    cfg, meta = load_run(run_dir)
    scene_path = run_scene(run_dir, meta) if load_views else None
    found = find_checkpoint(run_dir, "cpu", allow_older=allow_older, log=log)
    if found is None:
        raise UserError(f"no checkpoint found under {run_dir / 'ckpt'} (the run never reached one)")
    state, path, _damaged = found
    step = int(state["step"])
    stored = state["params"]["shN"].shape[1] if "shN" in state["params"] else 0
    stored_degree = int(round((stored + 1) ** 0.5)) - 1
    sh_degree = sh_degree_at(step, cfg.train.sh_degree_interval, cfg.model.sh_degree, stored_degree)
    scene = None
    if scene_path is not None:
        from gstrain.data.inputs import load_scene
        from gstrain.train.pose_refine import STATE_KEY as POSE_KEY
        from gstrain.train.pose_refine import refined_views

        scene = load_scene(scene_path, factor=cfg.data.factor, test_every=cfg.data.test_every,
                           background=cfg.data.background)
        # train.pose_refine: the training views at the poses the run learned (test views as given)
        scene.train = refined_views(scene.train, state.get(POSE_KEY))
    dev, rend, background = None, None, None
    params_device = "cpu"
    if renderer:
        import dataclasses

        from gstrain.render import CUDA_BACKENDS, Renderer, resolve_device

        dev = resolve_device(device)
        rcfg = cfg.render
        if dev.type != "cuda" and rcfg.backend in CUDA_BACKENDS:
            rcfg = dataclasses.replace(rcfg, backend="reference")  # trained on a GPU, rendered without one
        rend = Renderer(rcfg, dev, dev=cfg.dev)
        if scene is not None:
            rend.set_training_views(scene.train)  # render.filter_3d's sampling rates
        background = torch.tensor(cfg.data.background, dtype=torch.float32, device=dev)
        params_device = dev
    params = torch.nn.ParameterDict({
        k: torch.nn.Parameter(v.detach().to(params_device, torch.float32), requires_grad=False)
        for k, v in state["params"].items()
    })
    return OpenRun(run_dir, cfg, meta, scene_path, scene, state, path, step, params, dev, rend, sh_degree,
                   background)
