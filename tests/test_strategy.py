"""Densifier: gsplat's DefaultStrategy plus the opacity reset that gsplat 1.5.3 skips."""

from __future__ import annotations

import math

import pytest
import torch
from gsplat.strategy import DefaultStrategy

from gstrain.config import OptimConfig, StrategyConfig
from gstrain.train.optim import build_optimizers
from gstrain.train.strategy import Densifier, gsplat_skips_opacity_reset

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


def step_at(densifier: Densifier, params, optimizers, step: int) -> None:
    densifier.post_backward(params, optimizers, step, render_info(), means_lr=1e-4)


@pytest.mark.parametrize("fast_stats", [True, False])
def test_opacities_reset_on_schedule(fast_stats):
    cfg = StrategyConfig(fast_stats=fast_stats, **QUIET)
    densifier = Densifier(cfg, scene_extent=1.0, device=torch.device("cpu"))
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
    densifier = Densifier(cfg, scene_extent=1.0, device=torch.device("cpu"))
    params, optimizers = make_model()
    before = params["opacities"].detach().clone()
    for step in (6000, 9000):
        step_at(densifier, params, optimizers, step)
    assert torch.equal(params["opacities"], before)
    assert [s for s in range(0, 12_001, 100) if densifier.resets_at(s)] == [3000]


def test_detection_matches_what_gsplat_does():
    """gstrain resets only where the installed gsplat does not: never twice, never not at all."""
    strategy = DefaultStrategy(refine_start_iter=10_000, refine_stop_iter=20_000, reset_every=3000)
    state = strategy.initialize_state(scene_scale=1.0)
    params, optimizers = make_model()
    before = params["opacities"].detach().clone()
    strategy.step_post_backward(params, optimizers, state, 3000, render_info(), packed=False)
    gsplat_reset = not torch.equal(params["opacities"], before)
    assert gsplat_reset is not gsplat_skips_opacity_reset()
