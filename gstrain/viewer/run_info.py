"""What the viewer shows of a finished run: its config, latest checkpoint, scores and cameras.

A small local loader; gstrain.run_dir.open_run() is meant to replace `load_run_info` once it lands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gstrain.config import Config
from gstrain.data.scene import Scene


@dataclass
class RunInfo:
    path: Path
    cfg: Config
    step: int
    params: dict[str, torch.Tensor]
    test_psnr: float | None  # metrics.json (gstrain eval) first, else train_summary.json
    scene: Scene | None  # None when the scene folder has moved: the page then has no cameras
    note: str | None = None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def load_run_info(run: Path, log=print) -> RunInfo:
    """Everything the viewer needs from a run folder; UserError (one line) if it is not a trained run."""
    from gstrain.data.colmap import load_scene
    from gstrain.errors import UserError
    from gstrain.run_dir import load_run
    from gstrain.train.checkpoint import require_checkpoint

    cfg, meta = load_run(run)
    state = require_checkpoint(run)
    psnr = _read_json(run / "metrics.json").get("psnr")
    if psnr is None:
        psnr = _read_json(run / "train_summary.json").get("final_test_psnr")
    scene, note = None, None
    scene_dir = Path(meta.get("scene", ""))
    if scene_dir.is_dir():
        try:
            scene = load_scene(scene_dir, factor=cfg.data.factor, test_every=cfg.data.test_every)
        except UserError as exc:
            note = f"cameras not shown: {exc}"
    else:
        note = f"cameras not shown: scene folder {scene_dir} not found"
    if note:
        log(f"gstrain: {note}")
    return RunInfo(run, cfg, int(state["step"]), state["params"], psnr, scene, note)
