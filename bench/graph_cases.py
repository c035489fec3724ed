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
                  refine_start: int = 4, batch_size: int = 1, train: dict[str, Any] | None = None,
                  optim: dict[str, Any] | None = None, dev: dict[str, Any] | None = None) -> Trainer:  # fmt: skip
    """A CUDA trainer in root/name, with or without graph steps, on `batch_size` views a step,
    refining every 10 steps from `refine_start` and resetting opacities every 15, its step timing
    left off; `train`, `optim`, `dev`: more keys of those sections (train.appearance, optim.moments)."""
    cfg = build_config(overrides=[{
        "train": {"steps": 500, "device": "cuda", "batch_size": batch_size, **(train or {})},
        "optim": dict(optim or {}),
        "dev": {"cuda_graphs": graphs, **(dev or {})},
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
    """Every eager step as a canvas step: each view (one, or a batch's) padded into the canvas, its
    size on the device and a pair budget of its own, as a graph step runs it (a canvas step equals
    the step at the view's own size within float tolerance: test_sized_projection_cuda.py).
    `monkeypatch`: pytest's, undone by its owner."""
    from gstrain.render.isect import PairBudget
    from gstrain.train.step import StepRunner

    original = StepRunner.run

    def padded(view: Any) -> Any:
        gt = view.gt
        height, width = gt.shape[:2]
        on_canvas = gt.new_zeros((*canvas, gt.shape[2]))
        on_canvas[:height, :width] = gt
        size = torch.tensor([width, height], dtype=torch.int32, device=gt.device)
        return replace(view, gt=on_canvas, valid=size, budget=PairBudget.on(gt.device, 1 << 20))

    def on_canvas(self, params, optimizers, step, views, sh_degree, background, scheduler=None):  # fmt: skip
        if any(v.valid is not None for v in views):  # a graph step's capture
            return original(self, params, optimizers, step, views, sh_degree, background, scheduler=scheduler)
        height, width = views[0].gt.shape[:2]
        result = original(self, params, optimizers, step, [padded(v) for v in views], sh_degree, background,
                          scheduler=scheduler)  # fmt: skip
        return replace(result, image=result.image[:height, :width], target=views[0].gt)

    monkeypatch.setattr(StepRunner, "run", on_canvas)


def graph_and_eager_runs(
    scene: Scene, root: Path, steps: int, monkeypatch: Any, overflow: bool = False, repeats: int = 1, **trainer: Any
) -> tuple[dict[str, Trainer], dict[str, list[float]]]:
    """A graph run ("graph"), an eager run ("eager") and `repeats` more eager runs ("again",
    "again2", ...) from the same start (graph_trainer's, with `trainer`'s keys), `steps` steps
    each, and every step's exact loss by run name (a graph run's settled, so a redone replay's loss
    counts). The repeated eager runs measure what float atomics alone part two runs by. overflow:
    pair buffers for a fifth of the most pairs seen, so the first replays overflow and are redone
    (`monkeypatch`: pytest's, undone by its owner)."""
    from gstrain.train import graph_capacity
    from gstrain.train.trainer import seed_everything

    names = ["graph", "eager", *(("again" if k == 0 else f"again{k + 1}") for k in range(repeats))]
    runs = {}
    for name in names:
        seed_everything(0)
        runs[name] = graph_trainer(scene, root, name, graphs=name == "graph", **trainer)
    assert runs["graph"].engine.name == "graph" and runs["eager"].engine.name == "eager"
    if overflow:
        monkeypatch.setattr(graph_capacity, "CAPACITY_ROUND", 64)
        monkeypatch.setattr(graph_capacity, "CAPACITY_MARGIN", 0.2)
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(steps):
        for name, run in runs.items():
            torch.cuda.manual_seed(1000 + step)
            run.step = step
            loss = run.train_step(step)[0]
            if run.graphs is not None:
                redone = run.graphs.settle()
                loss = redone.loss if redone is not None else loss
            losses[name].append(float(loss))
    return runs, losses


def graph_and_two_eager(scene: Scene, root: Path, steps: int, monkeypatch: Any, overflow: bool = False,
                        **trainer: Any) -> tuple[Trainer, Trainer, Trainer, dict[str, list[float]]]:  # fmt: skip
    """graph_and_eager_runs with one repeated eager run: the graph, eager and repeated runs, and the
    losses by run name."""
    runs, losses = graph_and_eager_runs(scene, root, steps, monkeypatch, overflow, **trainer)
    return runs["graph"], runs["eager"], runs["again"], losses


def captured_step_eagerly(trainer: Trainer, step: int, flag: torch.Tensor) -> None:
    """What a captured step runs, run eagerly (on the CPU too): the view's index only on the device
    (StepView.slot, no host index), the corrections' device scalars set by advance, and their skip
    flag set to `flag` ([1] int)."""
    from gstrain.train import corrections

    ctx = trainer.ctx
    (idx,) = ctx.views.draw(ctx.sampler)
    view = replace(ctx.views.step_view(idx), index=None, slot=torch.tensor([idx], dtype=torch.int32))
    corrections.advance(ctx.corrections, step)
    corrections.set_skip_flag(ctx.corrections, flag)
    try:
        ctx.runner.run(ctx.params, ctx.optimizers, step, [view], ctx.sh_degree(step), ctx.background,
                       scheduler=ctx.scheduler)  # fmt: skip
    finally:
        corrections.set_skip_flag(ctx.corrections, None)
