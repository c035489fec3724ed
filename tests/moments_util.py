"""The CPU trainer the optim.moments tests (bf16, int8) train the demo scene with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gstrain.config import build_config
from gstrain.data.scene import Scene
from gstrain.train.trainer import Trainer


def moments_trainer(scene: Scene, run_dir: Path, moments: str, steps: int = 24, strategy: dict | None = None,
                    model: dict | None = None, eval_steps: tuple[int, ...] = (), dev: dict | None = None,
                    **train: Any) -> Trainer:
    """A CPU trainer of `scene` in run_dir with optim.moments=`moments`: SH degree 1, refining every
    6 steps from step 6, no checkpoints or exports, evaluations only at `eval_steps`; its log lines
    kept in `.lines`. strategy, model, dev, train: more keys of those sections."""
    cfg = build_config(overrides=[{
        "train": {"steps": steps, "seed": 7, "device": "cpu", **train}, "optim": {"moments": moments},
        "model": {"sh_degree": 1, **(model or {})},
        "strategy": {"refine_start": 6, "refine_every": 6, **(strategy or {})},
        "log": {"progress_every": 1000, "ckpt_every": 0, "tb_every": 100_000,
                "eval_steps": list(eval_steps), "save_steps": []},
        "dev": dev or {},
    }])  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    trainer = Trainer(cfg, scene, run_dir, torch.device("cpu"), log=lines.append)
    trainer.lines = lines
    return trainer
