"""The host side of train.cuda_graphs (gstrain/train/graph_step.py), on the CPU: Adam's counts
and the rate decay advanced per replay and taken back for a redo, which steps a strategy lets a
graph replay, and when ARC re-tunes. The graphs themselves: tests/test_graph_cuda.py."""

from __future__ import annotations

import math

import torch

from gstrain.config import StrategyConfig, build_config
from gstrain.render import Renderer
from gstrain.train import fused_adam
from gstrain.train.optim import ExponentialDecay
from gstrain.train.strategies.default import DefaultStrategy


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
    slow = DefaultStrategy(StrategyConfig(fast_stats=False), 1.0, torch.device("cpu"))
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
