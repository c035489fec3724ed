"""The host side of dev.cuda_graphs (gstrain/train/graph_step.py), on the CPU: Adam's counts
and the rate decay advanced per replay and taken back for a redo, which steps a strategy lets a
graph replay, and when ARC re-tunes. The graphs themselves: tests/test_graph_cuda.py."""

from __future__ import annotations

import math

import torch

from gstrain.config import StrategyConfig, build_config
from gstrain.dev_config import DevConfig
from gstrain.render import Renderer
from gstrain.train import fused_adam
from gstrain.train.optim import ExponentialDecay
from gstrain.train.run_state import ViewSampler
from gstrain.train.strategies.default import DefaultStrategy
from gstrain.train.timing import PhaseTimer


def _adams(lrs=(0.1, 0.02)):
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in lrs]
    pairs = enumerate(zip(params, lrs, strict=True))
    opts = {f"p{i}": torch.optim.Adam([p], lr=lr, betas=(0.9, 0.999)) for i, (p, lr) in pairs}
    for p in params:
        p.grad = torch.ones_like(p)
    for opt in opts.values():  # torch's own Adam makes the state: step 1, then 2
        opt.step()
        opt.step()
    return opts


def test_advance_counts_a_step_and_gives_torch_adams_bias_corrections():
    opts = _adams()
    values = fused_adam.advance(opts)
    # torch.optim.Adam at step 3: step size lr / (1 - b1^3), denominator sqrt(v) / sqrt(1 - b2^3)
    expected = []
    for lr in (0.1, 0.02):
        expected += [lr / (1 - 0.9**3), 1 / math.sqrt(1 - 0.999**3)]
    assert values == expected
    steps = [float(o.state[o.param_groups[0]["params"][0]]["step"]) for o in opts.values()]
    assert steps == [3.0, 3.0]
    fused_adam.rewind(opts, 2)
    steps = [float(o.state[o.param_groups[0]["params"][0]]["step"]) for o in opts.values()]
    assert steps == [1.0, 1.0]


def test_decay_rewind_gives_the_rate_of_fewer_steps():
    def opt():
        return torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    a, b = ExponentialDecay(opt(), 0.9), ExponentialDecay(opt(), 0.9)
    for _ in range(5):
        a.step()
    a.rewind(2)
    for _ in range(3):
        b.step()
    assert a.steps_done == 3 and a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"] == 0.9**3


def test_default_strategy_lets_graphs_replay_only_statistics_steps():
    cfg = StrategyConfig(refine_start=500, refine_stop=15_000, refine_every=100, reset_every=3000)
    s = DefaultStrategy(cfg, 1.0, torch.device("cpu"))
    assert s.graph_safe_at(1) and s.graph_safe_at(599) and s.graph_safe_at(20_000)
    assert s.graph_safe_at(500)  # gsplat refines only after refine_start
    assert not s.graph_safe_at(600) and not s.graph_safe_at(14_900)  # refinements
    assert not s.graph_safe_at(3000) and not s.graph_safe_at(6000)  # opacity resets (3000: both)
    assert s.graph_safe_at(15_000) and s.graph_safe_at(18_000)  # past refine_stop: nothing happens
    assert s.graph_key(14_999)[0] is True and s.graph_key(15_000) == (False,)  # statistics kept, or not
    slow = DefaultStrategy(StrategyConfig(), 1.0, torch.device("cpu"), DevConfig(fast_stats=False))
    assert not slow.graph_safe_at(1)  # gsplat's own statistics sync: never in a graph


class _CountingTuner:
    def __init__(self) -> None:
        self.rounds = 0
        self.threshold = 8
        self.tuning = False

    def invalidate(self) -> None:
        self.rounds += 1


def test_arc_retunes_once_the_population_moved_a_fifth():
    renderer = Renderer(build_config().render, torch.device("cpu"))
    tuner = _CountingTuner()
    renderer.tuner = tuner
    counts = [1000, 1100, 1190, 1250, 1400, 990, 900]
    rounds = []
    for n in counts:
        renderer.gaussians_changed(n)
        rounds.append(tuner.rounds)
    # 1000 starts a round; 1100 and 1190 are within 20% of it; 1250 is not; 1400 is within 20% of
    # 1250; 990 is 21% below 1250; 900 is within 20% of 990
    assert rounds == [1, 1, 1, 2, 2, 3, 3]
    renderer.gaussians_changed()  # no count: always
    assert tuner.rounds == 4


def _policy_run(demo_scene, tmp_path, monkeypatch, steps: int = 30, keep: bool = False,
                memory_gib: float = 0.0) -> tuple[list, object]:  # fmt: skip
    """A CPU trainer whose graph engine decides as on a GPU; a graph step (capture or replay) is
    stood in for by the eager step, so the run trains, and is recorded as "graph". keep: the
    stand-in also keeps a placeholder as its key's graph, as a capture would. memory_gib: the run's
    train.max_memory_gib."""
    from gstrain.data.colmap import load_scene
    from gstrain.train.graph_step import GraphEngine
    from gstrain.train.trainer import Trainer

    scene = load_scene(demo_scene)
    cfg = build_config(overrides=[{
        "train": {"steps": 500, "max_memory_gib": memory_gib},
        "strategy": {"refine_start": 4, "refine_every": 10, "reset_every": 15, "grow_grad2d": 0.0},
    }])  # fmt: skip
    trainer = Trainer(cfg, scene, tmp_path / "run", torch.device("cpu"), log=lambda m: None)
    graphs = GraphEngine(trainer.ctx)
    kinds = []

    def graph_step(step: int, idxs: tuple[int, ...]):
        kinds[-1] = "graph"
        if keep:
            graphs.graphs.setdefault(graphs.groups.graph_key(graphs._groups_of(idxs)), "captured")
        return graphs._eager(step, idxs)

    monkeypatch.setattr(graphs, "_graph_step", graph_step)
    trainer.graphs = graphs
    for step in range(steps):
        trainer.timer.enabled = step % 7 == 0 and step > 0  # as fit does with dev.time_every=7
        before = dict(graphs.eager_steps)
        kinds.append(None)
        trainer.train_step(step)
        if kinds[-1] is None:
            (reason,) = [k for k, n in graphs.eager_steps.items() if n != before.get(k, 0)]
            kinds[-1] = reason
    return kinds, graphs


def test_graph_policy_step_by_step(demo_scene, tmp_path, monkeypatch):
    kinds, graphs = _policy_run(demo_scene, tmp_path, monkeypatch)
    # worked by hand: step 0 runs eagerly (first); refinements at 10, 20 and the opacity reset at 15
    # run eagerly (strategy), and so do timed steps (every 7th); every other step is a graph step
    g = "graph"
    expected = [
        "first", g, g, g, g, g, g, "timed", g, g,  # 0-9
        "strategy", g, g, g, "timed", "strategy", g, g, g, g,  # 10-19
        "strategy", "timed", g, g, g, g, g, g, "timed", g,  # 20-29
    ]
    assert kinds == expected
    assert graphs.eager_steps == {"first": 1, "timed": 4, "strategy": 3}
    assert graphs.pool_drops == 0  # no memory budget: the graphs stay (their captures cost time)


def test_eager_steps_that_may_reuse_the_graphs_pool_drop_the_graphs(demo_scene, tmp_path, monkeypatch):
    """Under a memory budget, a refinement, a reset, a timed step or an ARC round runs eagerly
    without the epoch's graphs: their pool (a whole step's gradients and buffers) is free for it.
    Worked by hand from the policy above: graphs exist before the timed steps 7, 14 and 28 and the
    refinements 10 and 20; at the reset 15 and the timed step 21 the step before had already
    dropped them."""
    from gstrain.train.graph_step import DROP_GRAPHS_FOR

    assert set(DROP_GRAPHS_FOR) == {"strategy", "timed", "arc_tuning"}  # not "mask": those interleave
    kinds, graphs = _policy_run(demo_scene, tmp_path, monkeypatch, keep=True, memory_gib=16.0)
    assert kinds[:10] == ["first", *["graph"] * 6, "timed", "graph", "graph"]  # the same steps as without
    assert graphs.pool_drops == 5 and graphs.summary()["pool_drops"] == 5
    assert graphs.graphs == {graphs.groups.graph_key(graphs._groups_of((0,))): "captured"}  # step 29's epoch


def test_graph_policy_waits_capture_after_steps_per_epoch(demo_scene, tmp_path, monkeypatch):
    from gstrain.train import graph_step

    monkeypatch.setattr(graph_step, "CAPTURE_AFTER", 2)
    kinds, graphs = _policy_run(demo_scene, tmp_path, monkeypatch)
    # as above, but the refinements and the reset start epochs whose first two graph-safe steps
    # run eagerly (the one image size is captured on its third)
    snc, g = "size_not_captured", "graph"
    expected = [
        "first", snc, snc, g, g, g, g, "timed", g, g,  # 0-9
        "strategy", snc, snc, g, "timed", "strategy", snc, snc, g, g,  # 10-19
        "strategy", "timed", snc, snc, g, g, g, g, "timed", g,  # 20-29
    ]
    assert kinds == expected
    assert graphs.eager_steps == {"first": 1, "timed": 4, "strategy": 3, snc: 8}


class _FakeContext:
    """What the graph engine's settle reads of its StepContext: two Adams and a position-rate decay
    (views: one 4x4 image unless given, with (viewmat, K) cameras; B = batch)."""

    def __init__(self, images: list | None = None, cams: list | None = None, cfg: object = None,
                 batch: int = 1) -> None:  # fmt: skip
        from gstrain.train.context import TrainViews

        self.cfg = build_config() if cfg is None else cfg
        self.device = torch.device("cpu")
        self.params = {"a": torch.nn.Parameter(torch.zeros(3)), "b": torch.nn.Parameter(torch.zeros(2))}
        self.optimizers = {k: torch.optim.Adam([p], lr=0.1) for k, p in self.params.items()}
        for p in self.params.values():
            p.grad = torch.ones_like(p)
        for opt in self.optimizers.values():
            opt.step()  # step 1: the state exists, as after the first eager step
        self.scheduler = ExponentialDecay(self.optimizers["a"], 0.5)
        self.strategy = DefaultStrategy(StrategyConfig(), 1.0, self.device)
        self.renderer = type("R", (), {"atomic_threshold": 8, "tuner": None})()
        self.timer = PhaseTimer(self.device, enabled=False)
        images = [torch.zeros(4, 4, 3, dtype=torch.uint8)] if images is None else images
        self.views = TrainViews(images, [] if cams is None else cams, [None] * len(images))
        self.sampler = ViewSampler(len(images), 0)
        self.watched = False
        self.corrections: list = []  # per-view corrections (StepContext.corrections): none here
        self.batch_size = batch

    def sh_degree(self, step: int) -> int:
        return 0

    def adam_steps(self) -> list[float]:
        return [float(o.state[o.param_groups[0]["params"][0]]["step"]) for o in self.optimizers.values()]


def test_settle_redoes_the_steps_from_the_first_overflow(monkeypatch):
    from gstrain.train.graph_step import GraphEngine

    t = _FakeContext()
    graphs = GraphEngine(t)
    runs = []

    def graph_step(step: int, idxs: tuple[int, ...]):  # the host's share of a replay: counts, decay, bookkeeping
        fused_adam.advance(t.optimizers)
        t.scheduler.step()
        graphs.unsettled.append((step, idxs))
        runs.append(step)

    monkeypatch.setattr(graphs, "_graph_step", graph_step)
    for step in range(1, 9):
        graphs._graph_step(step, (0,))
    assert t.adam_steps() == [9.0, 9.0] and t.scheduler.steps_done == 8
    size = tuple(t.views.images[0].shape)
    graphs.groups.capacities[size] = 1 << 16
    graphs.groups.stats[size] = torch.tensor([0, 0, 3_000_000])  # the overflowed view's pairs, as the kernel keeps them
    graphs.budget.flag.fill_(5 + 1)  # step 5's tag: it overflowed, and (the flag is sticky) 6-8 were skipped
    assert graphs.settle() is None  # the fake replays return nothing
    # 5-8 again, in order (each step's number passed on: what it reads, the SH degree, follows it)
    assert runs == [*range(1, 9), *range(5, 9)]
    assert t.adam_steps() == [9.0, 9.0] and t.scheduler.steps_done == 8  # rewound by 4, advanced by 4
    assert graphs.views == 8 and graphs.redos == 1 and graphs.redone_steps == 4 and not graphs.unsettled
    assert int(graphs.budget.flag) == 0
    assert graphs.groups.capacities[size] >= 3_000_000 and graphs.groups.peak[size] == 3_000_000
    graphs.budget.flag.zero_()
    assert graphs.settle() is None and runs[-1] == 8 and len(runs) == 12  # nothing in flight: no redo


def test_each_image_size_gets_a_capacity_from_its_own_views():
    """The sort covers a graph's whole pair capacity, so a size's capacity follows its own views:
    replays' per-size maxima (device statistics, read when an epoch ends) grow it, a size never
    seen starts at the largest, and a capacity never shrinks."""
    from gstrain.train.graph_step import GraphEngine

    graphs = GraphEngine(_FakeContext())
    groups = graphs.groups
    small, large, unseen = (700, 1200, 3), (720, 1280, 3), (710, 1250, 3)
    groups.peak[small] = 200_000  # from eager steps
    groups.stats[large] = torch.tensor([0, 0, 3_000_000])  # from replays, on the device
    graphs._new_epoch(("key",))
    assert groups.peak[large] == 3_000_000
    cap_small, cap_large = groups.capacity(small), groups.capacity(large)
    assert 200_000 < cap_small < 1_000_000 and cap_large > 3_000_000
    assert groups.capacity(unseen) >= 3_000_000  # no count yet: the largest known
    groups.stats[small] = torch.tensor([0, 0, 150_000])  # fewer pairs now: the capacity stays
    graphs._new_epoch(("key2",))
    assert groups.capacity(small) == cap_small
    groups.stats[small] = torch.tensor([0, 0, cap_small])  # grown past the headroom: regrown
    graphs._new_epoch(("key3",))
    assert groups.capacity(small) > cap_small
    summary = graphs.summary()["pair_capacity"]
    assert summary["groups"] == 3 and summary["max"] == max(groups.capacities.values())


def test_capacity_classes_hold_the_count_within_one_and_a_half_times():
    from gstrain.train.graph_capacity import CAPACITY_ROUND, capacity_class

    last = 0
    for n in [1, CAPACITY_ROUND, CAPACITY_ROUND + 1, 700_001, 1_048_576, 1_048_577, 3_000_000, 4_700_000]:
        c = capacity_class(n)
        k = c.bit_length() - 1
        assert c in (1 << k, 3 << (k - 1))  # 2^k or 1.5 * 2^k
        assert c >= max(n, CAPACITY_ROUND) and c <= 1.5 * max(n, CAPACITY_ROUND)
        assert c >= last  # monotone
        last = c
    assert len({capacity_class(n) for n in range(600_000, 4_800_000, 10_000)}) == 7  # two per doubling


def test_views_of_several_sizes_share_a_canvas_and_graphs_by_capacity_class():
    """With views of several sizes and the fused loss, pair statistics are per view (a row each,
    picked on the device), a view's capacity is a capacity class, views of one class share one
    graph key, and an overflow grows only the overflowed view's class."""
    from gstrain.train.graph_step import GraphEngine

    t = _FakeContext()
    t.cfg = build_config(overrides=[{"dev": {"fused_ssim": True}}])
    t.views.images = [torch.zeros(h, w, 3, dtype=torch.uint8) for h, w in ((60, 80), (64, 70), (50, 90), (60, 80))]
    graphs = GraphEngine(t)
    groups = graphs.groups
    assert graphs.canvas == (64, 90, 3)
    assert groups.view_stats.shape == (4, 3) and groups.group(2) == 2
    groups.peak[0] = 500_000  # an eager step's count
    groups.view_stats[1] = torch.tensor([0, 0, 520_000])  # replays' rows
    groups.view_stats[2] = torch.tensor([0, 0, 2_000_000])
    graphs._new_epoch(("key",))
    assert groups.peak == {0: 500_000, 1: 520_000, 2: 2_000_000}  # view 3: no count yet
    caps = [groups.capacity(i) for i in range(4)]
    assert caps[0] == caps[1] >= 1.5 * 520_000  # one class: one graph for both views
    assert caps[2] >= 3_000_000 and caps[3] == caps[2]  # no count: the largest known
    assert groups.graph_key((0,)) == groups.graph_key((1,)) != groups.graph_key((2,))
    # view 1 overflowed at step 5 with 1.2M pairs: its class grows, view 0's does not
    monkey_runs = []
    graphs._graph_step = lambda step, idxs: monkey_runs.append((step, idxs))  # type: ignore[method-assign]
    graphs.unsettled = [(4, (0,)), (5, (1,)), (6, (0,))]
    groups.view_stats[1, 2] = 1_200_000
    graphs.budget.flag.fill_(6)
    graphs.settle()
    assert monkey_runs == [(5, (1,)), (6, (0,))]
    assert groups.capacity(1) >= 1.5 * 1_200_000 and groups.capacity(0) == caps[0]
    assert graphs.summary()["canvas"] == [64, 90]


def test_a_canvas_render_without_the_capped_intersection_is_refused():
    """A valid size means a canvas, which only the capped intersection clips to: without a pair
    budget (or the cull) the render would quietly take the whole canvas as the view."""
    import pytest

    from gstrain.render.cuda import project_splats
    from gstrain.render.isect import PairBudget

    params = {"means": torch.zeros(2, 3), "quats": torch.ones(2, 4), "scales": torch.zeros(2, 3),
              "opacities": torch.zeros(2)}  # fmt: skip
    valid = torch.tensor([30, 20], dtype=torch.int32)
    budget = PairBudget.on(torch.device("cpu"), 64)
    for kwargs in ({"ellipse_cull": True}, {"ellipse_cull": False, "budget": budget}):
        with pytest.raises(ValueError, match="pair budget and ellipse_cull"):
            project_splats(params, torch.eye(4), torch.eye(3), 64, 48, valid=valid, **kwargs)


def test_a_redo_asks_again_for_the_images_of_the_step_it_runs_before(monkeypatch):
    """A settle before a step already drawn (an eager step, a new epoch) may redo earlier steps,
    whose reads push the drawn step's image out of a disk store; the store is asked for it again
    behind the redone steps' images, so the step reads nothing the store was not asked for."""
    from test_image_store import LoggedView

    from gstrain.data.image_store import DiskStore, TrainImages
    from gstrain.train.graph_step import GraphEngine

    views = [LoggedView(i, []) for i in range(12)]  # one pass covers the 9 steps: all distinct views
    store = DiskStore(views, torch.device("cpu"), workers=1, depth=2, decode_in="threads")
    t = _FakeContext(images=TrainImages(store), cams=[(torch.eye(4), torch.eye(3))] * len(views))  # type: ignore[arg-type]
    graphs = GraphEngine(t)

    def graph_step(step: int, idxs: tuple[int, ...]):  # the host's share of a replay, reading its images as _load does
        fused_adam.advance(t.optimizers)
        t.scheduler.step()
        for idx in idxs:
            t.views.images[idx]
        graphs.unsettled.append((step, idxs))

    monkeypatch.setattr(graphs, "_graph_step", graph_step)
    t.views.prefetch(t.sampler)  # as the Trainer does when it is built
    for step in range(1, 9):
        graphs._graph_step(step, tuple(t.views.draw(t.sampler)))
    drawn = t.views.draw(t.sampler)  # step 9's view: read once, kept for the step's reads
    size = t.views.shapes()[0]
    graphs.groups.capacities[size] = 1 << 16
    graphs.groups.stats[size] = torch.tensor([0, 0, 3_000_000])
    graphs.budget.flag.fill_(5 + 1)  # step 5 overflowed: 5-8 are redone before step 9 runs
    graphs.settle(drawn)
    assert graphs.redone_steps == 4
    assert torch.equal(t.views.images[drawn[0]], views[drawn[0]].pixels)  # step 9 reads its image
    assert store.unasked == 0 and store.gets == 9 + 4 + 1
    store.close()
