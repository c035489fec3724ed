"""The training-step speed switches: fused Adam, sync-free densification statistics, and the
step runner they plug into.

CPU tests check the dense statistics against gsplat's own DefaultStrategy code. GPU tests
(marked `cuda`) check our kernels against torch.optim.Adam and gsplat, including after gsplat's
strategy rewrote the optimizer state (densification) and across a checkpoint round trip.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gsplat.strategy import DefaultStrategy
from gsplat.strategy.ops import duplicate

from gstrain.config import StrategyConfig, build_config
from gstrain.dev_config import DevConfig
from gstrain.train.optim import build_optimizers
from gstrain.train.strategies import build_strategy
from gstrain.train.strategies.default import FastStatsStrategy

N = 1000


def _info(n: int, device: str, seed: int = 0, absgrad: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    means2d = torch.zeros(1, n, 2, device=device, requires_grad=True)
    grad = torch.randn(1, n, 2, generator=gen).to(device)
    means2d.grad = grad
    if absgrad:
        means2d.absgrad = grad.abs() * 2
    radii = torch.randint(0, 4, (1, n, 2), generator=gen, dtype=torch.int32).to(device)
    radii[0, : n // 4] = 0  # a quarter off screen
    radii[0, n // 4 : n // 3, 1] = 0  # one radius zero: also not counted
    return {"means2d": means2d, "radii": radii, "width": 320, "height": 200, "n_cameras": 1, "gaussian_ids": None}


def _params(n: int, device: str) -> torch.nn.ParameterDict:
    gen = torch.Generator().manual_seed(1)
    shapes = {"means": (n, 3), "scales": (n, 3), "quats": (n, 4), "opacities": (n,), "sh0": (n, 1, 3),
              "shN": (n, 15, 3)}  # fmt: skip
    return torch.nn.ParameterDict(
        {k: torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for k, s in shapes.items()}
    )


def _run_stats(strategy_cls, device: str, absgrad: bool, steps: int = 3) -> dict:
    strategy = strategy_cls(absgrad=absgrad)
    state = strategy.initialize_state(scene_scale=1.0)
    params = _params(N, device)
    for seed in range(steps):
        strategy._update_state(params, state, _info(N, device, seed, absgrad))
    return state


@pytest.mark.parametrize("absgrad", [False, True])
def test_fast_stats_equal_gsplat_on_cpu(absgrad):
    ours = _run_stats(FastStatsStrategy, "cpu", absgrad)
    theirs = _run_stats(DefaultStrategy, "cpu", absgrad)
    assert torch.equal(ours["count"], theirs["count"])
    assert torch.allclose(ours["grad2d"], theirs["grad2d"], rtol=1e-6, atol=0)
    assert 0 < int((ours["count"] > 0).sum()) < N  # some counted, some not


def test_default_strategy_picks_fast_stats_by_config():
    on = build_strategy(StrategyConfig(), 1.0, torch.device("cpu"), DevConfig(fast_stats=True))
    off = build_strategy(StrategyConfig(), 1.0, torch.device("cpu"), DevConfig(fast_stats=False))
    assert type(on.gsplat) is FastStatsStrategy
    assert type(off.gsplat) is DefaultStrategy


def test_fast_stats_defers_to_gsplat_for_radii_statistic():
    strategy = FastStatsStrategy(refine_scale2d_stop_iter=100)
    state = strategy.initialize_state(scene_scale=1.0)
    info = _info(N, "cpu")
    strategy._update_state(_params(N, "cpu"), state, info)
    # brute force, one Gaussian at a time: seen when both radii are > 0; then the radii statistic
    # is its larger radius over the image's longer side, the count 1, and grad2d the norm of its
    # gradient in [-1, 1] screen units (x by width / 2, y by height / 2)
    width, height = info["width"], info["height"]
    radii, grads = info["radii"][0].tolist(), info["means2d"].grad[0].tolist()
    want_radii, want_count, want_grad = [], [], []
    for (rx, ry), (gx, gy) in zip(radii, grads, strict=True):
        seen = rx > 0 and ry > 0
        want_radii.append(max(rx, ry) / max(width, height) if seen else 0.0)
        want_count.append(1.0 if seen else 0.0)
        want_grad.append(math.hypot(gx * width / 2, gy * height / 2) if seen else 0.0)
    assert 0 < sum(want_count) < N
    assert torch.allclose(state["radii"], torch.tensor(want_radii), rtol=1e-6, atol=0)  # ours keeps no radii
    assert torch.equal(state["count"], torch.tensor(want_count))
    assert torch.allclose(state["grad2d"], torch.tensor(want_grad), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------ GPU

cuda = pytest.mark.cuda


@cuda
@pytest.mark.parametrize("absgrad", [False, True])
def test_stats_kernel_equals_gsplat(absgrad):
    ours = _run_stats(FastStatsStrategy, "cuda", absgrad)
    theirs = _run_stats(DefaultStrategy, "cuda", absgrad)
    assert torch.equal(ours["count"], theirs["count"])
    assert torch.allclose(ours["grad2d"], theirs["grad2d"], rtol=1e-6, atol=1e-7)


def _adam_pair(device: str = "cuda"):
    cfg = build_config().optim
    a = _params(N, device)
    b = copy.deepcopy(a)
    return a, build_optimizers(a, cfg, 2.0), b, build_optimizers(b, cfg, 2.0)


def _set_grads(params, seed: int, visible: torch.Tensor | None = None) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for p in params.values():
        g = torch.randn(p.shape, generator=gen).to(p.device)
        if visible is not None:  # what a render gives: zero gradient off screen
            g[~visible.cpu()] = 0
        p.grad = g


def _step_both(fused, ours, ours_opt, ref, ref_opt, seed: int, visible: torch.Tensor | None = None) -> None:
    """The same gradients into both models; ours steps with FusedAdam, the reference with torch."""
    _set_grads(ours, seed, visible)
    _set_grads(ref, seed, visible)
    fused.step(ours_opt, visible)
    for opt in ref_opt.values():
        opt.step()
        opt.zero_grad(set_to_none=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()  # parameters: float() of a grad-tracking tensor warns
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@cuda
def test_fused_adam_matches_torch_adam():
    from gstrain.train.fused_adam import FusedAdam

    ours, ours_opt, ref, ref_opt = _adam_pair()
    fused = FusedAdam()
    for step in range(5):
        for opt in (ours_opt, ref_opt):  # a schedule: the rate changes between steps
            opt["means"].param_groups[0]["lr"] *= 0.9
        _step_both(fused, ours, ours_opt, ref, ref_opt, step)
    for name in ours:
        assert ours[name].grad is None
        assert _rel(ours[name].detach(), ref[name].detach()) < 1e-6, name
        s_ours, s_ref = ours_opt[name].state[ours[name]], ref_opt[name].state[ref[name]]
        assert float(s_ours["step"]) == float(s_ref["step"]) == 5
        assert _rel(s_ours["exp_avg"], s_ref["exp_avg"]) < 1e-6
        assert _rel(s_ours["exp_avg_sq"], s_ref["exp_avg_sq"]) < 1e-6


@cuda
@pytest.mark.parametrize("sparse", [False, True])
def test_fused_adam_matches_torch_adam_on_tails_and_unaligned_storage(sparse):
    """The kernel moves four elements at a time from 16-byte aligned storage: here every tensor's
    size leaves a tail (1001 rows), and one parameter starts an element into its buffer."""
    from gstrain.train.fused_adam import FusedAdam

    n = 1001
    gen = torch.Generator().manual_seed(7)
    shapes = {"means": (n, 3), "opacities": (n,), "shN": (n, 15, 3)}
    values = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    buffer = torch.zeros(n * 3 + 1, device="cuda")  # means one float into it: not 16-byte aligned
    buffer[1:] = values["means"].flatten().cuda()
    ours = torch.nn.ParameterDict({"means": torch.nn.Parameter(buffer[1:].view(n, 3))})
    ours.update({k: torch.nn.Parameter(v.cuda()) for k, v in values.items() if k != "means"})
    assert ours["means"].data_ptr() % 16 != 0
    ref = torch.nn.ParameterDict({k: torch.nn.Parameter(v.cuda()) for k, v in values.items()})
    cfg = build_config().optim
    ours_opt, ref_opt = build_optimizers(ours, cfg, 2.0), build_optimizers(ref, cfg, 2.0)
    visible = torch.rand(n, generator=torch.Generator().manual_seed(3)).cuda() > 0.3 if sparse else None
    before = {k: v.detach().clone() for k, v in ours.items()}
    fused = FusedAdam()
    for step in range(3):
        _step_both(fused, ours, ours_opt, ref, ref_opt, step, visible)
    for name in ours:
        shown = visible if sparse else torch.ones(n, dtype=torch.bool, device="cuda")
        # the same arithmetic as torch's per element: equal to the last bit is not promised, 1e-6 is
        assert _rel(ours[name][shown].detach(), ref[name][shown].detach()) < 1e-6, name
        assert torch.equal(ours[name][~shown], before[name][~shown]), name


@cuda
def test_fused_adam_sparse_leaves_hidden_rows_alone():
    from gstrain.train.fused_adam import FusedAdam

    ours, ours_opt, ref, ref_opt = _adam_pair()
    visible = torch.rand(N, generator=torch.Generator().manual_seed(3)).cuda() > 0.3
    before = {k: v.detach().clone() for k, v in ours.items()}
    fused = FusedAdam()
    for step in range(3):
        _step_both(fused, ours, ours_opt, ref, ref_opt, step, visible)
    for name in ours:
        assert torch.equal(ours[name][~visible], before[name][~visible]), name
        # rows drawn every step follow dense Adam exactly (their gradients are never skipped)
        assert _rel(ours[name][visible], ref[name][visible]) < 1e-6, name
        moments = ours_opt[name].state[ours[name]]["exp_avg"]
        assert torch.count_nonzero(moments[~visible]) == 0


@cuda
def test_fused_adam_after_densification_and_resume(tmp_path):
    """gsplat's strategy ops rewrite the optimizer state; a torch fused-Adam checkpoint resumes."""
    from gstrain.train.fused_adam import FusedAdam

    ours, ours_opt, ref, ref_opt = _adam_pair()
    fused = FusedAdam()
    for params, opts in ((ours, ours_opt), (ref, ref_opt)):
        _set_grads(params, 0)
        for opt in opts.values():
            opt.step()  # torch's fused Adam (device step tensors) for the first step
            opt.zero_grad(set_to_none=True)
        mask = torch.zeros(N, dtype=torch.bool, device="cuda")
        mask[::7] = True
        duplicate(params, opts, {}, mask)  # gsplat's own op: new rows, zero moments
    n = len(ours["means"])
    assert n > N
    for step in range(1, 4):
        _step_both(fused, ours, ours_opt, ref, ref_opt, step)
    for name in ours:
        assert ours[name].shape[0] == n
        assert _rel(ours[name], ref[name]) < 1e-6, name
    # the state is torch's layout: it loads into a plain torch Adam
    state = {k: o.state_dict() for k, o in ours_opt.items()}
    torch.save(state, tmp_path / "opt.pt")
    reloaded = build_optimizers(ours, build_config().optim, 2.0)
    for k, o in reloaded.items():
        o.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=False)[k])
    _set_grads(ours, 9)
    for o in reloaded.values():
        o.step()
    assert all(torch.isfinite(p).all() for p in ours.values())


@cuda
def test_fit_with_each_switch_off_still_trains(demo_scene, tmp_path):
    import json

    from cli_util import run_cli

    for flag in ("dev.fused_adam=false", "dev.fast_stats=false", "optim.sparse_adam=true"):
        run = tmp_path / flag.split("=")[0]
        proc = run_cli("fit", demo_scene, "--out", run, "--steps", "200", "--device", "cuda", "--set", flag,
                       "--set", "strategy.refine_start=50", "--set", "strategy.refine_every=50",
                       "--set", "log.eval_steps=[0]")
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((run / "train_summary.json").read_text())
        assert summary["final_test_psnr"] > summary["initial_test_psnr"] + 3.0, (flag, summary)
