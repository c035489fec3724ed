"""train.appearance=affine and =bilateral on the CUDA-graph engine: graph steps (the table's row
picked on the device, its Adam captured with device scalars; the grids' TV gradient too) compute
the eager steps' function, on one image size and on the canvas (views of four sizes), with and
without overflow redos, across the warm-up's end (appearance_start: a new epoch, captured again);
the bilateral grid sliced by the fused kernels (the default) and by F.grid_sample.
The host side: tests/test_appearance_graph.py.
Run by bench/gpu_tests.sh."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from test_graph_cuda import _same_model

from bench.graph_cases import eager_steps_on_the_canvas, graph_and_two_eager, mixed_sizes
from gstrain.data.colmap import load_scene
from gstrain.data.scene import Scene

pytestmark = pytest.mark.cuda

APPEARANCE = {"appearance": "affine", "appearance_lr": 0.01, "appearance_start": 3, "appearance_decay": 0.1}
# each model's keys: the bilateral grid with its TV regulariser on (the captured step runs its gradient too)
MODELS = {"affine": APPEARANCE,
          "bilateral": {**APPEARANCE, "appearance": "bilateral", "bilateral_grid_x": 8, "bilateral_grid_y": 8,
                        "bilateral_grid_luma": 4, "bilateral_tv": 10.0}}  # fmt: skip
# the bilateral grid sliced by F.grid_sample instead of the fused kernels (dev.fused_bilateral=false)
MODELS["bilateral_grid_sample"] = MODELS["bilateral"]
DEV = {"bilateral_grid_sample": {"fused_bilateral": False}}
STEPS = 30
TABLE_TOL = 1e-3  # a tenth of one Adam step of the table (its rate 0.01): a lost, doubled or stale step moves more


def _exposed(scene: Scene) -> Scene:
    """The scene with each training photo given its own colour gains, so the table has something to learn."""
    train = []
    for i, v in enumerate(scene.train):
        gain = torch.tensor([1 + 0.2 * math.sin(i), 1 + 0.15 * math.cos(i), 1 - 0.1 * math.sin(2 * i)])
        image = (v.image.float() * gain).clamp(0, 255).round().to(torch.uint8)
        train.append(replace(v, image=image))
    return replace(scene, train=train)


def _run_pair(scene: Scene, tmp_path, monkeypatch, overflow: bool, model: str = "affine") -> tuple:
    """bench/graph_cases.graph_and_two_eager with the appearance model (grid_sample's backward adds
    into the grid with atomics, which the second eager run's spread covers)."""
    return graph_and_two_eager(scene, tmp_path, STEPS, monkeypatch, overflow, train=MODELS[model], dev=DEV.get(model))


def _same_table(graphed, eager, again) -> None:
    """The graph run's table within TABLE_TOL of the eager run's, or within 3x what the second eager
    run differs by (Adam turns a cell's near-zero, atomics-noisy gradient into a whole step)."""
    (a,), (b,), (c,) = graphed.ctx.corrections, eager.ctx.corrections, again.ctx.corrections
    moved = float((b.table.detach() - b.identity.expand_as(b.table)).abs().max())
    assert moved > 10 * TABLE_TOL, moved  # it learned: the comparison below means something
    diff = float((a.table.detach() - b.table.detach()).abs().max())
    noise = float((c.table.detach() - b.table.detach()).abs().max())
    assert diff < max(TABLE_TOL, 3 * noise), (diff, noise)
    steps = [float(c.optimizer.state[c.table]["step"]) for c in (a, b)]
    assert steps == [STEPS - APPEARANCE["appearance_start"]] * 2, steps  # no Adam step lost or doubled
    for x, y, z in zip(a.graph_adam.moments(), b.graph_adam.moments(), c.graph_adam.moments(), strict=True):
        bound = max(1e-3 * float(y.abs().max()), 3 * float((z - y).abs().max())) + 1e-12
        assert float((x - y).abs().max()) <= bound


def _same_losses(losses: dict[str, list[float]]) -> None:
    """Each step's graph loss within 1e-5 of the eager one's, or 3x the two eager runs' difference."""
    for step, (x, y, z) in enumerate(zip(losses["graph"], losses["eager"], losses["again"], strict=True)):
        assert abs(x - y) <= max(1e-5 * abs(y), 3 * abs(z - y)), (step, x, y, z)


def _graph_steps_ran(g, overflow: bool) -> None:
    assert g.views >= 20 and g.captures >= 3, g.summary()  # the warm-up's end starts an epoch of its own
    assert sum(g.eager_steps.values()) + g.views == STEPS, g.summary()
    assert g.redos >= 1 or not overflow, g.summary()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("overflow", [False, True])
def test_graph_steps_with_appearance_equal_eager_steps(demo_scene, tmp_path, monkeypatch, overflow, model):
    graphed, eager, again, losses = _run_pair(_exposed(load_scene(demo_scene)), tmp_path, monkeypatch, overflow, model)
    g = graphed.graphs
    assert g.canvas is None, g.summary()  # one size: the per-size path, its view index added for the table
    _graph_steps_ran(g, overflow)
    _same_losses(losses)
    _same_table(graphed, eager, again)
    _same_model(graphed, eager, 1e-4)


# Seen on the H200 at 9762de4, with grid_sample slicing (the fused kernels came later: unmeasured):
# with the bilateral grid, canvas graph steps part from eager canvas steps by 8e-5 of the loss at
# step 24, 13x what two eager runs part by (2e-6); the per-size graph path agrees. Not explained
# yet; a small numerical difference, not a lost or doubled step (those move the loss by percents).
CANVAS_MODELS = ["affine"] + [pytest.param(name, marks=pytest.mark.xfail(
    reason="bilateral canvas graph steps differ from eager canvas steps by 8e-5 of the loss (unexplained)",
    strict=False)) for name in ("bilateral", "bilateral_grid_sample")]  # fmt: skip


@pytest.mark.parametrize("model", CANVAS_MODELS)
@pytest.mark.parametrize("overflow", [False, True])
def test_canvas_graph_steps_with_appearance_equal_eager_canvas_steps(demo_scene, tmp_path, monkeypatch, overflow,
                                                                      model):  # fmt: skip
    scene = mixed_sizes(_exposed(load_scene(demo_scene)))
    eager_steps_on_the_canvas(monkeypatch, (64, 64))
    graphed, eager, again, losses = _run_pair(scene, tmp_path, monkeypatch, overflow, model)
    g = graphed.graphs
    assert g.canvas is not None and g.canvas[:2] == (64, 64), g.summary()
    _graph_steps_ran(g, overflow)
    _same_losses(losses)
    _same_table(graphed, eager, again)
    _same_model(graphed, eager, 1e-4)
