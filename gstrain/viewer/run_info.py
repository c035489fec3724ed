"""What the viewer shows of a finished run: its config, latest checkpoint, scores and cameras.

The run itself comes through gstrain.run_dir.open_run (as for eval, render, export and profile);
the viewer only adds the scores, and shows a run whose scene folder has moved without cameras.
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
    from gstrain.data.inputs import load_scene
    from gstrain.errors import UserError
    from gstrain.run_dir import open_run, run_scene

    opened = open_run(run, log=log, load_views=False, renderer=False)
    cfg = opened.cfg
    psnr = _read_json(run / "metrics.json").get("psnr")
    if psnr is None:
        psnr = _read_json(run / "train_summary.json").get("final_test_psnr")
    scene, note = None, None
    try:
        scene = load_scene(run_scene(run, opened.meta), factor=cfg.data.factor, test_every=cfg.data.test_every,
                           background=cfg.data.background, max_side=cfg.data.max_side)
    except UserError as exc:
        note = f"cameras not shown: {exc}"
        log(f"gstrain: {note}")
    params = {k: v.detach() for k, v in opened.params.items()}
    return RunInfo(run, cfg, opened.step, params, psnr, scene, note)
