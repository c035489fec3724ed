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
from gstrain.run_lock import LOCK_FILE, RunLock
from gstrain.train.checkpoint import find_checkpoint, list_checkpoints, set_aside
from gstrain.train.run_record import SUMMARY_FILE
from gstrain.train.run_state import _StopFlag

if TYPE_CHECKING:
    import torch

    from gstrain.data.scene import Scene
    from gstrain.render import Renderer

RUN_FILE = "run.json"
METRICS_FILE = "metrics.json"  # written by gstrain eval
CONFIG_FILE = "config.yaml"
# What a run folder records about itself: no output of gstrain (an export, a render) may land on
# these files or inside these folders, even with --force; losing them loses the run.
RECORD_FILES = (CONFIG_FILE, RUN_FILE, SUMMARY_FILE, METRICS_FILE, LOCK_FILE)
RECORD_FOLDERS = ("ckpt", "tb")
SCENE_DIGEST = "scene_digest"  # run.json: which scene, wherever it moves (data.colmap.scene_digest)


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
    if any(p.name != LOCK_FILE for p in run_dir.iterdir()):  # a lock alone: a fit that died at once
        raise UserError(f"--out {run_dir} holds files that gstrain did not write; choose a new or empty folder")
    return False


def create_run_dir(run_dir: Path, scene: Path, cfg: Config, lock: RunLock | None = None) -> None:
    """The run folder of a fresh fit; `lock` is taken before its first file is written. A Ctrl-C
    or SIGTERM meanwhile waits for run.json, so the folder is left as one a fit takes up again."""
    check_new_run_dir(run_dir)
    meta = {"scene": str(scene.resolve()), "created": time.strftime("%Y-%m-%d %H:%M:%S"), "gstrain": __version__}
    digest = _scene_digest_or_none(scene)
    if digest is not None:  # fit has loaded the scene by now; only a caller without one has none
        meta[SCENE_DIGEST] = digest
    with _StopFlag(abort_on_second=False) as stop:  # the training loop's flag: a stop waits for run.json
        make_dir(run_dir)
        if lock is not None:
            lock.acquire()
            check_new_run_dir(run_dir)  # again under the lock: a fit that started meanwhile has written it
        save_config(cfg, run_dir / CONFIG_FILE)
        write_text_atomic(run_dir / RUN_FILE, json.dumps(meta, indent=2))
    if stop.requested:
        raise KeyboardInterrupt


def _scene_digest_or_none(scene: Path) -> str | None:
    from gstrain.data.inputs import scene_digest

    try:
        return scene_digest(scene)
    except UserError:
        return None


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
        raise UserError(f"the scene this run was trained on is missing: {path} (from {run_dir / RUN_FILE}); "
                        "if it moved, give its new folder with --scene")
    return path


def check_moved_scene(run_dir: Path, meta: dict[str, Any], scene: Path) -> None:
    """May `scene` stand in for the scene run.json names? It must be the same COLMAP model
    (cameras, poses, image names) as recorded; a run from before the record is checked by its
    training views instead, once they load (check_views_fit)."""
    from gstrain.data.inputs import scene_digest

    if not scene.is_dir():
        raise UserError(f"scene folder not found: {scene}")
    recorded = meta.get(SCENE_DIGEST)
    if isinstance(recorded, str) and scene_digest(scene) != recorded:
        raise UserError(f"{scene} is not the scene {run_dir} was trained on ({meta.get('scene')}): "
                        "its COLMAP cameras or images differ")


def record_scene(run_dir: Path, scene: Path, log: Callable[[str], None] | None = None) -> None:
    """run.json names `scene` from now on (a moved scene that passed check_moved_scene)."""
    from gstrain.data.inputs import scene_digest

    _cfg, meta = load_run(run_dir)
    meta = {**meta, "scene": str(scene.resolve()), SCENE_DIGEST: scene_digest(scene)}
    write_text_atomic(run_dir / RUN_FILE, json.dumps(meta, indent=2))
    if log is not None:
        log(f"gstrain: {run_dir / RUN_FILE} now names the scene at {scene.resolve()}")


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
    moved_to: Path | None = None  # the scene's new folder, recorded in run.json by commit_resume


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
    moved_to = None
    if isinstance(recorded, str) and recorded and Path(recorded) != scene.resolve():
        if Path(recorded).exists():
            raise UserError(f"--resume: {run_dir} was trained on {recorded}, not {scene.resolve()}; "
                            "give that scene or choose another --out")
        check_moved_scene(run_dir, meta, scene)  # the recorded folder is gone: moved here?
        moved_to = scene
    cfg = merge_config(config_from_dict(saved.to_dict()), [*(config_files or [])], overrides)
    changed = changed_fixed_keys(saved, cfg)
    if changed:
        raise UserError(f"--resume cannot change {'; '.join(changed)} (the run is built on them); "
                        "start a new run with another --out")
    found = find_checkpoint(run_dir, "cpu", allow_older=allow_older, log=log)
    if found is None:
        return ResumePlan(cfg, None, None, moved_to=moved_to)
    state, path, damaged = found
    shn = state["params"].get("shN")
    expected = (cfg.model.sh_degree + 1) ** 2 - 1
    if shn is None or shn.dim() < 2 or shn.shape[1] != expected:
        raise UserError(f"checkpoint {path} does not fit model.sh_degree={cfg.model.sh_degree} of {run_dir}")
    return ResumePlan(cfg, state, path, damaged, moved_to)


def check_scene_fits(plan: ResumePlan, scene: Scene, scene_path: Path) -> None:
    """The loaded views must be the ones the checkpoint was trained on (count of training views)."""
    if plan.state is not None and plan.checkpoint is not None:
        check_views_fit(plan.state, plan.checkpoint, scene, scene_path, "--resume")


def check_views_fit(state: dict[str, Any], checkpoint: Path, scene: Scene, scene_path: Path, what: str) -> None:
    """The checkpoint's view order must index the loaded training views one for one."""
    sampler = state.get("sampler", {})
    order = sampler.get("order") if isinstance(sampler, dict) else None
    if order and (max(order) >= len(scene.train) or len(order) != len(scene.train)):
        raise UserError(f"{what}: {scene_path} has {len(scene.train)} training views, but the checkpoint "
                        f"{checkpoint} was trained on {len(order)}; the scene has changed")


def commit_resume(run_dir: Path, plan: ResumePlan, log: Callable[[str], None], lock: RunLock | None = None) -> None:
    """The first writes of a resumed fit (under `lock`): damaged checkpoints set aside, the merged
    config saved."""
    if lock is not None:
        lock.acquire()
    if plan.moved_to is not None:
        record_scene(run_dir, plan.moved_to, log)
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
    scene_path: Path | None = None,
) -> OpenRun:
    """Config, scene, parameters of the newest good checkpoint and a renderer of a trained run.

    `load_views=False` skips the scene (export); `renderer=False` skips the device (export);
    `scene_path` (--scene) points the run at its moved scene: checked, then recorded in run.json.
    """
    import torch

    cfg, meta = load_run(run_dir)
    moved = scene_path is not None and load_views
    if moved:
        check_moved_scene(run_dir, meta, scene_path)
    else:
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
        from gstrain.train.pose_refine import pose_state, refined_views

        scene = load_scene(scene_path, factor=cfg.data.factor, test_every=cfg.data.test_every,
                           background=cfg.data.background, max_side=cfg.data.max_side)
        if moved:
            check_views_fit(state, path, scene, scene_path, "--scene")
            record_scene(run_dir, scene_path, log)
        # train.pose_refine: the training views at the poses the run learned (test views as given)
        scene.train = refined_views(scene.train, pose_state(state))
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
