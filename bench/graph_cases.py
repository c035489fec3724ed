"""The graph-step cases shared by the CUDA graph tests (tests/test_graph_cuda.py) and the studies
that pick their results apart (bench/graph_twins.py, bench/canvas_spread.py): the trainer they
build, the demo scene at four sizes, and eager steps run the way a graph step runs them.

Here, in bench/, because a study imports nothing from tests/; the tests import from here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gstrain.config import build_config
from gstrain.data.scene import Scene
from gstrain.train.trainer import Trainer


def graph_trainer(scene: Scene, root: Path, name: str, graphs: bool, mode: str = "warp",
                  refine_start: int = 4, train: dict[str, Any] | None = None) -> Trainer:  # fmt: skip
    """A CUDA trainer in root/name, with or without graph steps, refining every 10 steps from
    `refine_start` and resetting opacities every 15, its step timing left off; `train`: more
    train.* keys (train.appearance, say)."""
    cfg = build_config(overrides=[{
        "train": {"steps": 500, "device": "cuda", **(train or {})}, "dev": {"cuda_graphs": graphs},
        "render": {"atomic_mode": mode},
        "strategy": {"refine_start": refine_start, "refine_every": 10, "reset_every": 15},
    }])  # fmt: skip
    trainer = Trainer(cfg, scene, root / name, torch.device("cuda"), log=lambda m: None)
    trainer.timer.enabled = False  # the loop sets it per step (dev.time_every); timed steps run eagerly
    return trainer


def mixed_sizes(scene: Scene) -> Scene:
    """The scene with its training views cropped (bottom and right: K stays) to four sizes."""
    crops = [(64, 64), (57, 60), (64, 47), (41, 33)]
    train = [replace(v, image=v.image[: crops[i % 4][0], : crops[i % 4][1]].contiguous())
             for i, v in enumerate(scene.train)]  # fmt: skip
    return replace(scene, train=train)


def eager_steps_on_the_canvas(monkeypatch: Any, canvas: tuple[int, int]) -> None:
    """Every eager step as a canvas step: the view padded into the canvas, its size on the device,
    as a graph step runs it (a canvas step equals the step at the view's own size within float
    tolerance: test_sized_projection_cuda.py). `monkeypatch`: pytest's, undone by its owner."""
    from gstrain.render.isect import PairBudget
    from gstrain.train.step import StepRunner

    original = StepRunner.run

    def on_canvas(self, params, optimizers, step, views, sh_degree, background, scheduler=None):  # fmt: skip
        if len(views) != 1 or views[0].valid is not None:  # a batch, or a graph step's capture
            return original(self, params, optimizers, step, views, sh_degree, background, scheduler=scheduler)
        view = views[0]
        gt = view.gt
        height, width = gt.shape[:2]
        padded = gt.new_zeros((*canvas, gt.shape[2]))
        padded[:height, :width] = gt
        size = torch.tensor([width, height], dtype=torch.int32, device=gt.device)
        options = self.renderer.options
        self.renderer.options = replace(options, pair_budget=PairBudget.on(gt.device, 1 << 20), valid_size=size)
        try:
            result = original(self, params, optimizers, step, [replace(view, gt=padded, valid=size)], sh_degree,
                              background, scheduler=scheduler)  # fmt: skip
        finally:
            self.renderer.options = options
        return replace(result, image=result.image[:height, :width])

    monkeypatch.setattr(StepRunner, "run", on_canvas)
