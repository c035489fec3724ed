"""A run folder (runs/<name>/): where it goes, what it records about its scene, and loading it back."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from gstrain import __version__
from gstrain.config import Config, config_from_dict, save_config
from gstrain.errors import UserError

RUN_FILE = "run.json"


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


def create_run_dir(run_dir: Path, scene: Path, cfg: Config) -> None:
    if is_run_dir(run_dir):
        raise UserError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    meta = {"scene": str(scene.resolve()), "created": time.strftime("%Y-%m-%d %H:%M:%S"), "gstrain": __version__}
    (run_dir / RUN_FILE).write_text(json.dumps(meta, indent=2))


def load_run(run_dir: Path) -> tuple[Config, dict[str, Any]]:
    """(resolved config, run.json) of an existing run; a user error if the folder is not a run."""
    if not run_dir.exists():
        raise UserError(f"run folder not found: {run_dir}")
    if not is_run_dir(run_dir):
        raise UserError(f"{run_dir} is not a gstrain run (no {RUN_FILE}); train one with: gstrain fit SCENE")
    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        meta = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, yaml.YAMLError, json.JSONDecodeError) as exc:
        raise UserError(f"{run_dir}: cannot read config.yaml / {RUN_FILE}: {exc}") from None
    return config_from_dict(data), meta


def update_run_config(run_dir: Path, cfg: Config) -> None:
    save_config(cfg, run_dir / "config.yaml")
