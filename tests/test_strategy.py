"""Strategies: the registry, gsplat's DefaultStrategy plus the opacity reset that gsplat 1.5.3
skips, and MCMC's regularisers."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from gsplat.strategy import DefaultStrategy as GsplatDefaultStrategy

from gstrain.config import OptimConfig, StrategyConfig, build_config
from gstrain.dev_config import DevConfig
from gstrain.errors import UserError
from gstrain.train.optim import build_optimizers
from gstrain.train.strategies import build_strategy, strategy_class
from gstrain.train.strategies.base import Strategy
from gstrain.train.strategies.default import DefaultStrategy, gsplat_skips_opacity_reset
from gstrain.train.strategies.mcmc import McmcStrategy
from gstrain.train.strategies.registry import REGISTRY, STRATEGY_NAMES

N = 16
# no growing or pruning before step 10,000, so only the reset can touch the opacities
QUIET = dict(refine_start=10_000, refine_stop=20_000, reset_every=3000)


def make_model() -> tuple[torch.nn.ParameterDict, dict[str, torch.optim.Optimizer]]:
    gen = torch.Generator().manual_seed(0)
    params = torch.nn.ParameterDict({
        "means": torch.randn(N, 3, generator=gen),
        "scales": torch.full((N, 3), -3.0),
        "quats": torch.randn(N, 4, generator=gen),
        "opacities": torch.linspace(-1.0, 3.0, N),  # sigmoid 0.27 .. 0.95, all above the reset value
        "sh0": torch.randn(N, 1, 3, generator=gen),
        "shN": torch.zeros(N, 15, 3),
    })
    optimizers = build_optimizers(params, OptimConfig(), scene_extent=1.0)
    for p in params.values():  # one step, so every Adam has moments to reset
        p.grad = torch.ones_like(p)
    for opt in optimizers.values():
        opt.step()
    return params, optimizers


def render_info() -> dict:
    means2d = torch.zeros(1, N, 2, requires_grad=True)
    means2d.grad = torch.full((1, N, 2), 1e-6)
    radii = torch.full((1, N, 2), 3, dtype=torch.int32)
    return {"means2d": means2d, "radii": radii, "width": 64, "height": 48, "n_cameras": 1, "gaussian_ids": None}


def step_at(strategy: Strategy, params, optimizers, step: int) -> bool:
    return strategy.step_post_backward(params, optimizers, step, render_info(), means_lr=1e-4)


@pytest.mark.parametrize("fast_stats", [True, False])
def test_opacities_reset_on_schedule(fast_stats):
    cfg = StrategyConfig(**QUIET)
    densifier = build_strategy(cfg, scene_extent=1.0, device=torch.device("cpu"), dev=DevConfig(fast_stats=fast_stats))
    params, optimizers = make_model()
    before = params["opacities"].detach().clone()

    step_at(densifier, params, optimizers, 2900)  # not a reset step
    assert torch.equal(params["opacities"], before)

    step_at(densifier, params, optimizers, 3000)
    ceiling = math.log(0.01 / 0.99)  # logit(2 x prune_opa)
    assert torch.allclose(params["opacities"].detach(), before.clamp(max=ceiling))
    assert float(torch.sigmoid(params["opacities"].detach()).max()) == pytest.approx(0.01, rel=1e-5)
    # the optimizer now holds the new tensor, with its moments zeroed and its step count kept
    opt = optimizers["opacities"]
    assert opt.param_groups[0]["params"][0] is params["opacities"]
    state = opt.state[params["opacities"]]
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert float(state["step"]) == 1.0
    # the other tensors are untouched
    assert optimizers["means"].state[params["means"]]["exp_avg"].abs().sum() > 0


def test_no_reset_from_refine_stop_on():
    cfg = StrategyConfig(refine_start=10_000, refine_stop=6000, reset_every=3000)
    densifier = build_strategy(cfg, scene_extent=1.0, device=torch.device("cpu"))
    params, optimizers = make_model()
    before = params["opacities"].detach().clone()
    for step in (6000, 9000):
        step_at(densifier, params, optimizers, step)
    assert torch.equal(params["opacities"], before)
    assert [s for s in range(0, 12_001, 100) if densifier.resets_at(s)] == [3000]


def test_detection_matches_what_gsplat_does():
    """gstrain resets only where the installed gsplat does not: never twice, never not at all."""
    strategy = GsplatDefaultStrategy(refine_start_iter=10_000, refine_stop_iter=20_000, reset_every=3000)
    state = strategy.initialize_state(scene_scale=1.0)
    params, optimizers = make_model()
    before = params["opacities"].detach().clone()
    strategy.step_post_backward(params, optimizers, state, 3000, render_info(), packed=False)
    gsplat_reset = not torch.equal(params["opacities"], before)
    assert gsplat_reset is not gsplat_skips_opacity_reset()


def test_detection_follows_a_fixed_gsplat(monkeypatch):
    """The behaviour check reads what gsplat does, not its version: the installed code's own
    typo (read from its source here, as an independent witness) decides, and a gsplat whose
    step_post_backward resets (as 1.5.2 and main do) is detected as not skipping."""
    typo = "== 0 & step > 0" in inspect.getsource(GsplatDefaultStrategy.step_post_backward)
    gsplat_skips_opacity_reset.cache_clear()
    assert gsplat_skips_opacity_reset() is typo

    from gsplat.strategy.ops import reset_opa

    original = GsplatDefaultStrategy.step_post_backward

    def fixed(self, params, optimizers, state, step, info, packed=False):
        original(self, params, optimizers, state, step, info, packed=packed)
        if typo and step % self.reset_every == 0 and step > 0:  # the condition as upstream fixed it
            reset_opa(params=params, optimizers=optimizers, state=state, value=self.prune_opa * 2.0)

    monkeypatch.setattr(GsplatDefaultStrategy, "step_post_backward", fixed)
    gsplat_skips_opacity_reset.cache_clear()
    try:
        assert gsplat_skips_opacity_reset() is False
    finally:
        gsplat_skips_opacity_reset.cache_clear()


def test_registry_names_are_the_config_choices_and_build_their_classes():
    assert STRATEGY_NAMES == tuple(REGISTRY) == ("default", "mcmc")
    assert strategy_class("default") is DefaultStrategy and strategy_class("mcmc") is McmcStrategy
    with pytest.raises(UserError, match="strategy.name must be one of default, mcmc; got 'nope'"):
        strategy_class("nope")
    with pytest.raises(UserError, match="strategy.name must be one of"):
        build_config(overrides=[{"strategy": {"name": "nope"}}])


def test_one_registry_line_adds_a_strategy(monkeypatch):
    monkeypatch.setitem(REGISTRY, "twin", "default:DefaultStrategy")
    strategy = build_strategy(StrategyConfig(name="twin"), 1.0, torch.device("cpu"))
    assert isinstance(strategy, DefaultStrategy)


def test_refines_at_follows_gsplat_schedule():
    strategy = build_strategy(StrategyConfig(refine_start=500, refine_stop=1500, refine_every=100), 1.0,
                              torch.device("cpu"))  # fmt: skip
    # gsplat refines when step > start, step % every == 0 and step < stop
    assert [s for s in range(0, 2001, 100) if strategy.refines_at(s)] == list(range(600, 1500, 100))
    params, optimizers = make_model()
    assert step_at(strategy, params, optimizers, 600) is True
    assert step_at(strategy, params, optimizers, 650) is False


def test_default_has_no_loss_term():
    params, _ = make_model()
    assert build_strategy(StrategyConfig(), 1.0, torch.device("cpu")).loss_term(params) is None


def _relocated_by_hand(o: float, s: float, n: int) -> tuple[float, float]:
    """Eq. 9 of the 3DGS-MCMC paper written out term by term, with math.comb."""
    new_o = 1.0 - (1.0 - o) ** (1.0 / n)
    denom = sum(math.comb(i - 1, k) * (-1) ** k / math.sqrt(k + 1) * new_o ** (k + 1)
                for i in range(1, n + 1) for k in range(i))  # fmt: skip
    return new_o, o / denom * s


def test_cpu_relocation_is_the_papers_formula():
    from gstrain.train.strategies.mcmc_cpu import relocation

    binoms = torch.tensor([[math.comb(i, k) for k in range(51)] for i in range(51)], dtype=torch.float32)
    cases = [(0.3, 0.5, 1), (0.3, 0.5, 2), (0.9, 0.1, 3), (0.05, 2.0, 7), (0.6, 1.0, 12)]
    o, s, n = (torch.tensor(c) for c in zip(*cases, strict=True))
    new_o, new_s = relocation(o.float(), s.float()[:, None].repeat(1, 3), n.int(), binoms)
    for i, (oi, si, ni) in enumerate(cases):
        want_o, want_s = _relocated_by_hand(oi, si, ni)
        assert abs(float(new_o[i]) - want_o) < 1e-6 and abs(float(new_s[i, 0]) - want_s) < 1e-5 * want_s, cases[i]
    assert float(new_o[0]) == pytest.approx(0.3) and float(new_s[0, 0]) == pytest.approx(0.5)  # one copy: unchanged


def test_mcmc_relocates_dead_gaussians_on_the_cpu():
    cfg = StrategyConfig(name="mcmc", cap_max=N + 1000, refine_start=1, refine_every=10, refine_stop=1000)
    strategy = build_strategy(cfg, 1.0, torch.device("cpu"))
    params, optimizers = make_model()
    n = len(params["means"])
    params["opacities"].data[: n // 2] = -20.0  # dead: below gsplat's min opacity
    for p in params.values():
        p.grad = torch.zeros_like(p)
    assert strategy.step_post_backward(params, optimizers, 10, {}, 1e-3) is True
    assert len(params["means"]) == int(1.05 * n)  # gsplat's growth, 5% rounded down (none at n=16)
    assert float(torch.sigmoid(params["opacities"].detach()[: n // 2]).min()) > 0.005  # every dead one relocated


def test_mcmc_loss_term_is_gsplats_regularisers():
    params, _ = make_model()
    strategy = McmcStrategy.__new__(McmcStrategy)  # no gsplat state needed for the loss term
    opacity = 1 / (1 + torch.exp(-params["opacities"].detach()))
    want = 0.01 * opacity.mean() + 0.01 * params["scales"].detach().exp().mean()
    assert torch.allclose(strategy.loss_term(params).detach(), want)
