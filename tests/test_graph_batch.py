"""The graph engine on batches (train.batch_size = B > 1), host side, on the CPU: which graph a
batch runs and each slot's pair capacity, each slot's inputs, the eager reasons, the redo of a
batch (Adam and the rate decay rewound by steps, views counted as views), and that the engine's
B views a step are the batch engine's. The graphs themselves: tests/test_graph_cuda.py."""

from __future__ import annotations

import torch
from test_graph_step import _FakeContext

from gstrain.config import build_config
from gstrain.train import fused_adam
from gstrain.train.step import StepResult, StepView

SIZES = ((60, 80), (64, 70), (50, 90), (60, 80))  # (height, width) of four views: a canvas of 64 x 90


class _Context(_FakeContext):
    """What the graph engine reads of its StepContext, without a renderer: two Adams, a rate
    decay, four views (random images, distinct cameras) and B = `batch`."""

    def __init__(self, batch: int, sizes=SIZES, fused_loss: bool = True) -> None:
        gen = torch.Generator().manual_seed(0)
        images = [torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8) for h, w in sizes]
        cams = [(torch.eye(4) * (i + 1), torch.eye(3) * (i + 2)) for i in range(len(sizes))]
        super().__init__(images, cams, build_config(overrides=[{"dev": {"fused_ssim": fused_loss}}]), batch)


def _engine(ctx):
    from gstrain.train.graph_step import GraphEngine

    return GraphEngine(ctx)


def test_a_batch_on_the_canvas_runs_the_graph_of_its_largest_capacity_class():
    graphs = _engine(_Context(batch=2))
    groups = graphs.groups
    assert graphs.canvas == (64, 90, 3) and graphs.view_ints.shape == (2, 3) and graphs.pinned_ints.shape[1:] == (2, 3)
    groups.peak.update({0: 500_000, 1: 2_000_000})
    # worked by hand: 1.5 x 500k = 750k, rounded up to 12 x 65536 = 786432, which is 1.5 x 2^19 (its
    # own class); 1.5 x 2M = 3M, rounded to 46 x 65536 = 3014656, in the class 1.5 x 2^21 = 3145728
    assert groups.capacity(0) == 786_432 and groups.capacity(1) == 3_145_728
    assert groups.graph_key((0, 0)) == 786_432
    assert groups.graph_key((0, 1)) == groups.graph_key((1, 0)) == groups.graph_key((1, 1)) == 3_145_728
    assert groups.slot_capacities((0, 1)) == (3_145_728, 3_145_728)  # every slot takes the graph's
    assert groups.capacity(0) == 786_432  # a view's own capacity is unchanged by its batch


def test_a_batch_per_size_runs_the_graph_of_its_sizes_each_slot_with_its_own_capacity():
    graphs = _engine(_Context(batch=2, fused_loss=False))  # no fused loss: a graph per size
    groups = graphs.groups
    assert graphs.canvas is None
    a, b = (60, 80, 3), (64, 70, 3)
    assert groups.group(0) == groups.group(3) == a and groups.group(1) == b
    groups.peak.update({a: 200_000, b: 1_000_000})
    # 1.5 x 200k = 300k -> 5 x 65536; 1.5 x 1M = 1.5M -> 23 x 65536 (no classes per size)
    assert groups.graph_key((a, b)) == (a, b) != groups.graph_key((b, a))
    assert groups.slot_capacities((a, b)) == (327_680, 1_507_328)
    assert groups.slot_capacities((a, a)) == (327_680, 327_680)


def test_each_slot_gets_its_views_camera_image_and_ints():
    t = _Context(batch=2)
    graphs = _engine(t)
    inputs = graphs._load(7, (2, 0))
    assert t.adam_steps() == [2.0, 2.0] and t.scheduler.steps_done == 1  # one step of two views
    assert float(graphs.scalars[-1]) == 8.0  # the step's tag
    assert graphs.view_ints.tolist() == [[90, 50, 2], [80, 60, 0]]  # (width, height, index) per slot
    for b, idx in enumerate((2, 0)):
        h, w = SIZES[idx]
        image = inputs[b]["image"]
        assert image.shape == (64, 90, 3)  # a canvas-sized slot, the view in its top-left corner
        assert torch.equal(image[:h, :w], t.views.images[idx])
        viewmat, K = t.views.cams[idx]
        assert torch.equal(inputs[b]["viewmat"], viewmat) and torch.equal(inputs[b]["K"], K)
        assert inputs[b]["valid"].data_ptr() == graphs.view_ints[b].data_ptr()  # the graph reads the refilled ints
    # the slots' images are disjoint parts of one buffer
    assert inputs[1]["image"].data_ptr() - inputs[0]["image"].data_ptr() == 64 * 90 * 3
    again = graphs._load(8, (1, 3))
    assert again is inputs  # the same inputs: one capture serves every batch on the canvas
    assert torch.equal(inputs[0]["image"][:64, :70], t.views.images[1])
    assert graphs.view_ints.tolist() == [[70, 64, 1], [80, 60, 3]]


def test_each_slot_per_size_has_an_image_input_of_its_views_shape():
    t = _Context(batch=2, fused_loss=False)
    graphs = _engine(t)
    inputs = graphs._load(0, (1, 2))
    assert [tuple(i["image"].shape) for i in inputs] == [(64, 70, 3), (50, 90, 3)]
    assert torch.equal(inputs[0]["image"], t.views.images[1]) and torch.equal(inputs[1]["image"], t.views.images[2])
    assert "valid" not in inputs[0]
    assert graphs.view_ints[:, 2].tolist() == [1, 2]  # the device view index (per-view corrections read it)
    assert graphs._load(1, (2, 1)) is not inputs  # other sizes in the slots: other inputs


def test_a_batch_runs_eagerly_when_any_of_its_views_must():
    t = _Context(batch=2)
    t.views.masks[1] = object()  # (only its presence is read)
    graphs = _engine(t)
    graphs.warm = True
    assert graphs.eager_reason(1, (0, 2)) is None
    assert graphs.eager_reason(1, (0, 1)) == "mask" and graphs.eager_reason(1, (1, 3)) == "mask"


def test_an_eager_batch_step_counts_each_views_pairs_for_its_own_group(monkeypatch):
    t = _Context(batch=2)
    graphs = _engine(t)
    result = StepResult(torch.zeros(()), {}, None, False, (1, 1_000_000, 2), view_pairs=(100_000, 900_000))
    monkeypatch.setattr(graphs, "_eager", lambda step, idxs: result)
    assert graphs.run(0, (2, 0)) is result  # the first step runs eagerly
    assert graphs.eager_steps == {"first": 1}
    assert graphs.groups.peak == {2: 100_000, 0: 900_000}  # each view its own count, not the sum


def _redo_run(graphs, t, steps):
    """Replays stood in for by their host share (Adam's count, the decay, the bookkeeping)."""
    runs = []

    def graph_step(step, idxs):
        fused_adam.advance(t.optimizers)
        t.scheduler.step()
        graphs.unsettled.append((step, idxs))
        runs.append((step, idxs))

    graphs._graph_step = graph_step
    for step, idxs in steps:
        graphs._graph_step(step, idxs)
    return runs


def test_settle_redoes_the_batches_from_the_first_overflowed_one():
    t = _Context(batch=2)
    graphs = _engine(t)
    groups = graphs.groups
    groups.peak.update({i: 500_000 for i in range(4)})
    assert [groups.capacity(i) for i in range(4)] == [786_432] * 4  # one class (see above)
    batches = [(1, (0, 1)), (2, (2, 3)), (3, (1, 0)), (4, (3, 2)), (5, (0, 2)), (6, (1, 3))]
    runs = _redo_run(graphs, t, batches)
    assert t.adam_steps() == [7.0, 7.0] and t.scheduler.steps_done == 6  # a count per step, not per view
    # step 4 overflowed: view 2's slot kept 1.5M pairs; view 3 (its batch partner) 600k fit
    groups.view_stats[2, 2] = 1_500_000
    groups.view_stats[3, 2] = 600_000
    graphs.budget.flag.fill_(4 + 1)
    graphs.settle()
    assert runs == [*batches, *batches[3:]]  # steps 4-6 again, in order, each with its views
    assert t.adam_steps() == [7.0, 7.0] and t.scheduler.steps_done == 6  # rewound by 3 steps, advanced by 3
    assert graphs.redos == 1 and graphs.redone_steps == 3 and not graphs.unsettled
    assert graphs.views == 12 and int(graphs.budget.flag) == 0  # six steps of two views, all settled
    # 1.5 x 1.5M = 2.25M -> 35 x 65536 = 2293760, in the class 3 x 2^20 = 3145728; the others keep theirs
    assert groups.capacities == {0: 786_432, 1: 786_432, 2: 3_145_728, 3: 786_432}
    assert groups.peak[2] == 1_500_000 and groups.graph_key((3, 2)) == 3_145_728


def test_a_per_size_redo_grows_only_the_sizes_that_overflowed():
    t = _Context(batch=2, fused_loss=False)
    graphs = _engine(t)
    groups = graphs.groups
    a, b, c = (60, 80, 3), (64, 70, 3), (50, 90, 3)
    groups.peak.update({a: 200_000, b: 200_000, c: 200_000})
    for size in (a, b, c):
        groups.capacity(size)
        groups.stats_of(size)
    _redo_run(graphs, t, [(1, (0, 1)), (2, (2, 1))])
    groups.stats[c][2] = 400_000  # past its 327680
    groups.stats[b][2] = 300_000  # within
    graphs.budget.flag.fill_(2 + 1)
    graphs.settle()
    assert t.adam_steps() == [3.0, 3.0] and graphs.views == 4 and graphs.redone_steps == 1
    # 1.5 x 400k = 600k -> 10 x 65536
    assert groups.capacities == {a: 327_680, b: 327_680, c: 655_360}


def test_the_graph_engines_batches_are_the_batch_engines_steps(demo_scene, tmp_path, monkeypatch):
    """B = 2 on a CPU trainer: the graph engine decides as on a GPU and its graph steps (capture
    or replay) are stood in for by its eager step, so what it feeds a step is checked: the same
    two views a step, drawn as the batch engine draws them, give the same parameters, bit for bit."""
    from gstrain.data.colmap import load_scene
    from gstrain.train.graph_step import GraphEngine
    from gstrain.train.trainer import Trainer, seed_everything

    scene = load_scene(demo_scene)
    cfg = build_config(overrides=[{
        "train": {"steps": 500, "batch_size": 2},
        "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 15, "grow_grad2d": 0.0},
    }])  # fmt: skip
    trainers = []
    for name in ("graph", "batch"):
        seed_everything(0)
        trainers.append(Trainer(cfg, scene, tmp_path / name, torch.device("cpu"), log=lambda m: None))
    graph_run, batch_run = trainers
    assert batch_run.engine.name == "batch"
    graphs = GraphEngine(graph_run.ctx)
    batches = []

    def graph_step(step: int, idxs: tuple[int, ...]):
        batches.append(idxs)
        return graphs._eager(step, idxs)

    monkeypatch.setattr(graphs, "_graph_step", graph_step)
    graph_run.graphs = graphs
    for step in range(14):
        for run in (graph_run, batch_run):
            run.timer.enabled = False  # (fit times every dev.time_every-th step: those run eagerly)
            torch.manual_seed(100 + step)  # a split samples positions: the same draws
            run.train_step(step)
    assert len(batches) == 14 - 2 and all(len(b) == 2 and b[0] != b[1] for b in batches)  # 0, 10: eager
    assert graphs.eager_steps == {"first": 1, "strategy": 1}
    for k, v in batch_run.params.items():
        assert torch.equal(graph_run.params[k], v), k


def test_a_views_pair_budget_reaches_the_renderer_for_that_view_only(demo_scene, tmp_path, monkeypatch):
    """A captured batch's views each carry their own pair budget; the runner renders each with the
    renderer's options and that budget, and leaves the renderer's own options as they were."""
    from gstrain.data.colmap import load_scene
    from gstrain.render import Renderer
    from gstrain.render.isect import PairBudget
    from gstrain.train.trainer import Trainer

    cfg = build_config(overrides=[{"train": {"steps": 50}}])
    trainer = Trainer(cfg, load_scene(demo_scene), tmp_path / "run", torch.device("cpu"), log=lambda m: None)
    seen = []
    render = Renderer.__call__

    def recording(self, *args, options=None, **kwargs):
        seen.append(options)
        return render(self, *args, options=options, **kwargs)

    monkeypatch.setattr(Renderer, "__call__", recording)
    budget = PairBudget.on(torch.device("cpu"), 4096)
    plain, budgeted = (trainer.batch_view(i) for i in (0, 1))
    budgeted = StepView(budgeted.viewmat, budgeted.K, budgeted.gt, budget=budget)
    own = trainer.renderer.options
    trainer.runner.run(trainer.params, trainer.optimizers, 0, [plain, budgeted], 0, trainer.background)
    assert seen[0] is None and seen[1].pair_budget is budget and seen[1].valid_size is None
    assert seen[1].atomic_mode == own.atomic_mode and seen[1].ellipse_cull == own.ellipse_cull
    assert trainer.renderer.options is own and own.pair_budget is None


def test_a_batch_set_up_chooses_the_graph_engine_where_graphs_apply():
    """graphs_possible no longer asks for one view a step; where it says no (the CPU), a batch
    runs the eager batch engine as before."""
    from types import SimpleNamespace

    from gstrain.train.engine import choose_engine
    from gstrain.train.graph_step import graphs_possible

    cfg = SimpleNamespace(dev=SimpleNamespace(cuda_graphs=True), train=SimpleNamespace(batch_size=2))
    renderer = SimpleNamespace(backend="cuda", options=SimpleNamespace(ellipse_cull=True))
    runner = SimpleNamespace(fused_adam=object(), corrections=[], renderer=renderer)
    assert graphs_possible(cfg, renderer, runner, torch.device("cuda"))
    ctx = SimpleNamespace(shard=None, cfg=cfg, renderer=renderer, runner=runner, device=torch.device("cuda"),
                          batch_size=2)  # fmt: skip
    assert choose_engine(ctx) == "graph"
    ctx.device = torch.device("cpu")
    assert choose_engine(ctx) == "batch"
