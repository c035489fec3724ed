"""train.appearance=affine under the CUDA-graph engine, its host side on the CPU: the capturable
Adam (train/capturable_adam.py) driven eagerly against torch.optim.Adam, the device-side view
index, checkpoints, and the graph engine's keys, loads and redo bookkeeping for the correction;
the engine's keys and the captured step's path also with train.appearance=bilateral (its own
grid tests: tests/test_bilateral_grid.py).
The captured graphs themselves: tests/test_appearance_graph_cuda.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from bench.graph_cases import captured_step_eagerly
from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.train.appearance import AffineAppearance, identity_table
from gstrain.train.step import StepView
from gstrain.train.trainer import Trainer

V = 6
LR, DECAY, START = 0.02, 0.3, 7


def _view_grad(step: int) -> torch.Tensor:
    """A step's table gradient as a one-view step gives it: one row (the view's), the rest zero."""
    gen = torch.Generator().manual_seed(step)
    grad = torch.zeros(V, 3, 4)
    grad[int(torch.randint(V, (1,), generator=gen))] = torch.randn(3, 4, generator=gen)
    return grad


class _Reference:
    """The table as the eager step defines it, written out here: nothing moves before START; then
    torch.optim.Adam (eps 1e-15) and a pull toward identity by LR * DECAY of the difference."""

    def __init__(self) -> None:
        self.table = torch.nn.Parameter(identity_table(V))
        self.adam = torch.optim.Adam([self.table], lr=LR, eps=1e-15)

    def step(self, step: int, grad: torch.Tensor) -> None:
        if step < START:
            return
        self.table.grad = grad.clone()
        self.adam.step()
        with torch.no_grad():
            self.table.sub_((self.table - identity_table(V)) * (LR * DECAY))

    def count(self) -> float:
        state = self.adam.state[self.table]
        return float(state["step"]) if state else 0.0  # torch makes the state at its first step


def _graph_protocol_step(model: AffineAppearance, step: int, grad: torch.Tensor, flag: torch.Tensor) -> None:
    """One step as a graph replay drives the correction: the host's advance, then the captured
    update (set_skip_flag on: the device-scalar path), the gradient as the backward left it."""
    model.advance(step)
    model.set_skip_flag(flag)
    model.table.grad = grad.clone()
    model.after_step(step)
    model.set_skip_flag(None)


def _count(model: AffineAppearance) -> float:
    return float(model.optimizer.state[model.table]["step"])


def test_capturable_adam_is_torch_adam_with_warm_up_decay_skips_and_redos():
    model = AffineAppearance(V, torch.device("cpu"), lr=LR, decay=DECAY, start=START)
    ref = _Reference()
    flag = torch.zeros(1, dtype=torch.int32)
    skipped = (list(range(3, 9)), list(range(40, 45)))  # one window across the warm-up's end, one after
    for step in range(120):
        grad = _view_grad(step)
        window = next((w for w in skipped if w[0] == step), None)
        if window is not None:  # an overflow from this step on: every update a no-op, then the redo
            before = (model.table.detach().clone(), *(t.clone() for t in model.graph_adam.moments()))
            flag.fill_(step + 1)
            for s in window:
                _graph_protocol_step(model, s, _view_grad(s), flag)
            after = (model.table.detach(), *model.graph_adam.moments())
            assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True)), step
            assert _count(model) == ref.count() + sum(s >= START for s in window)  # counted from START on
            model.rewind(window)
            assert _count(model) == ref.count()
            flag.zero_()
        _graph_protocol_step(model, step, grad, flag)
        ref.step(step, grad)
        if step < START:
            assert torch.equal(model.table.detach(), identity_table(V)), step
        assert model.table.grad is None
    assert torch.equal(model.table.detach(), ref.table.detach())  # the same float32 operations, bit for bit
    exp_avg, exp_avg_sq = model.graph_adam.moments()
    assert torch.equal(exp_avg, ref.adam.state[ref.table]["exp_avg"])
    assert torch.equal(exp_avg_sq, ref.adam.state[ref.table]["exp_avg_sq"])
    assert _count(model) == ref.count() == 120 - START
    assert not torch.equal(model.table.detach(), identity_table(V))  # it learned


def test_the_device_index_picks_the_same_row_and_gradient_as_the_host_index():
    model = AffineAppearance(4, torch.device("cpu"), lr=0.1)
    with torch.no_grad():
        model.table[2, 0, 0] = 2.0  # view 2 doubles red
        model.table[2, 1, 3] = 0.5  # and adds 0.5 to green
    image = torch.rand(3, 5, 3, generator=torch.Generator().manual_seed(0))
    expected = image.clone()
    expected[..., 0] *= 2.0
    expected[..., 1] += 0.5
    grads = []
    for view in (StepView(torch.eye(4), torch.eye(3), image, index=2),
                 StepView(torch.eye(4), torch.eye(3), image, slot=torch.tensor([2], dtype=torch.int32))):  # fmt: skip
        out = model.image(image, view)
        assert torch.allclose(out, expected, atol=1e-6)
        (out * torch.arange(3.0)).sum().backward()
        grads.append(model.table.grad)
        model.table.grad = None
    assert torch.equal(grads[0], grads[1]) and grads[0][[0, 1, 3]].abs().sum() == 0  # only view 2's row


def test_state_after_graph_steps_resumes_exactly_on_either_path_in_the_same_storage():
    trained = AffineAppearance(V, torch.device("cpu"), lr=LR, decay=DECAY, start=START)
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(25):
        _graph_protocol_step(trained, step, _view_grad(step), flag)
    saved = copy.deepcopy(trained.state_dict())
    eager, graphed = (AffineAppearance(V, torch.device("cpu"), lr=LR, decay=DECAY, start=START) for _ in range(2))
    key = graphed.graph_key(30)
    storage = [t.data_ptr() for t in (graphed.table, *graphed.graph_adam.moments(), graphed.graph_adam.scalars)]
    for model in (eager, graphed):
        model.load_state_dict(copy.deepcopy(saved))
    # the loaded values in the storage a graph captured before the load reads
    assert storage == [t.data_ptr() for t in (graphed.table, *graphed.graph_adam.moments(), graphed.graph_adam.scalars)]
    assert graphed.graph_key(30) == key
    assert graphed.optimizer.state[graphed.table]["exp_avg"] is graphed.graph_adam.moments()[0]
    ref = _Reference()  # the saved state continued by torch's own Adam
    with torch.no_grad():
        ref.table.copy_(saved["table"])
    ref.adam.load_state_dict(copy.deepcopy(saved["optimizer"]))
    for step in range(25, 40):
        grad = _view_grad(step)
        eager.table.grad = grad.clone()
        eager.after_step(step)
        _graph_protocol_step(graphed, step, grad, flag)
        ref.step(step, grad)
    for model in (eager, graphed):
        assert torch.equal(model.table.detach(), ref.table.detach())
        assert _count(model) == ref.count() == 40 - START


def test_a_checkpoint_without_adam_state_starts_the_table_adam_fresh():
    """A checkpoint taken before the table's first step holds no Adam state (torch makes it
    lazily): loading it gives step 0 and zero moments, what torch's first step would make."""
    blank = torch.optim.Adam([torch.nn.Parameter(identity_table(V))], lr=LR, eps=1e-15).state_dict()
    model = AffineAppearance(V, torch.device("cpu"), lr=LR, decay=DECAY, start=START)
    model.load_state_dict({"table": identity_table(V), "optimizer": blank})
    ref = _Reference()
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(START, START + 10):
        _graph_protocol_step(model, step, _view_grad(step), flag)
        ref.step(step, _view_grad(step))
    assert torch.equal(model.table.detach(), ref.table.detach()) and _count(model) == 10


# each train.appearance model with its own small configuration (a 4 x 4 x 4 bilateral grid: quick on the CPU)
MODELS = {"affine": {"appearance": "affine"},
          "bilateral": {"appearance": "bilateral", "bilateral_grid_x": 4, "bilateral_grid_y": 4,
                        "bilateral_grid_luma": 4}}  # fmt: skip


def _cpu_trainer(demo_scene: Path, tmp_path: Path, model: str = "affine") -> Trainer:
    cfg = build_config(overrides=[{
        "train": {"steps": 100, "device": "cpu", "appearance_start": 5, **MODELS[model]},
        "strategy": {"refine_start": 1000},
    }])  # fmt: skip
    return Trainer(cfg, load_scene(demo_scene), tmp_path / "run", torch.device("cpu"), log=lambda m: None)


@pytest.mark.parametrize("model", list(MODELS))
def test_graph_engine_keys_loads_and_redoes_the_correction(demo_scene, tmp_path, monkeypatch, model):
    """The graph engine's host side with appearance, on the CPU: the epoch key changes when the
    table starts learning (the graph is captured again) and not after; each graph step's load puts
    the view's index on the device and counts the table's step from the start on; a redo takes
    back the counts of the replays it repeats."""
    from gstrain.train import graph_step

    # the scene's Adam counts are not under test here (tests/test_graph_step.py): held at zero
    monkeypatch.setattr(graph_step.fused_adam, "advance", lambda optimizers: [0.0] * (2 * len(optimizers)))
    monkeypatch.setattr(graph_step.fused_adam, "step_counts", lambda optimizers: [0.0] * len(optimizers))
    monkeypatch.setattr(graph_step.fused_adam, "rewind", lambda optimizers, steps: None)
    trainer = _cpu_trainer(demo_scene, tmp_path, model)
    engine = graph_step.GraphEngine(trainer.ctx)
    assert engine.canvas is None  # the demo's views are one size: the per-size path
    (appearance,) = trainer.ctx.corrections
    assert engine._epoch_key(4) != engine._epoch_key(5)
    assert engine._epoch_key(5) == engine._epoch_key(6) == engine._epoch_key(50)
    views = [3, 1, 4, 1, 5, 0, 2, 6, 3]
    for step, idx in enumerate(views, start=1):
        engine._budget(0, engine.groups.group(idx), 1 << 16)  # the group's statistics, as a capture makes them
        engine._load(step, (idx,))
        assert int(engine.view_ints[0, 2]) == idx
        engine.unsettled.append((step, (idx,)))
    assert _count(appearance) == len([s for s in range(1, 10) if s >= 5]) == 5
    reloads = []

    def replay(step: int, idxs: tuple[int, ...]):  # what a replay does on the host: load (the capture is the GPU's)
        reloads.append((step, *idxs))
        engine._load(step, idxs)

    monkeypatch.setattr(engine, "_graph_step", replay)
    engine.budget.flag.fill_(7 + 1)  # step 7 overflowed: steps 7-9 are redone
    engine.settle()
    assert reloads == [(7, 2), (8, 6), (9, 3)]
    assert _count(appearance) == 5  # not 8: the redone replays' counts were taken back first


@pytest.mark.parametrize("model", list(MODELS))
def test_the_captured_steps_path_trains_as_the_eager_step_on_the_cpu(demo_scene, tmp_path, model):
    """What a captured step runs, run eagerly on the CPU: the view's index only on the device
    (StepView.slot, no host index), the table's Adam from device scalars (advance, the skip flag
    set). Twenty steps across the warm-up's end train the very model and table the eager engine
    trains, bit for bit."""
    runs = [_cpu_trainer(demo_scene, tmp_path / name, model) for name in ("eager", "captured")]
    flag = torch.zeros(1, dtype=torch.int32)
    for step in range(20):
        runs[0].train_step(step)
        captured_step_eagerly(runs[1], step, flag)
    (a,), (b,) = runs[0].ctx.corrections, runs[1].ctx.corrections
    assert not torch.equal(a.table.detach(), a.identity.expand_as(a.table))
    assert torch.equal(a.table.detach(), b.table.detach())
    assert _count(a) == _count(b) == 20 - 5
    for key in runs[0].params:
        assert torch.equal(runs[0].params[key], runs[1].params[key]), key
