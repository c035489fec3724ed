"""render_cuda end to end: against render_reference (every atomic mode, SH degrees, absgrad,
background), under gsplat's DefaultStrategy, and the ARC tuner's rounds on the GPU. Scenes and
tolerances: cuda_scenes.py. Timings are never asserted here.
"""

from __future__ import annotations

import pytest
import torch
from cuda_scenes import (
    assert_close,
    camera,
    make_scene,
    random_gaussians,
    run_cuda,
)
from torch import Tensor

from gstrain.choices import ATOMIC_MODES

pytestmark = pytest.mark.cuda


# ---------------------------------------------------------------------------------------------
# render_cuda vs render_reference, and gsplat's strategy on top


def make_params(n: int, seed: int, sh_degree: int = 3) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    g = random_gaussians(n, gen, 1.0, log_scale=(-3.0, -1.5))
    k = (sh_degree + 1) ** 2 - 1
    return {
        "means": g["means"],
        "scales": g["scales"],
        "quats": g["quats"],
        "opacities": torch.logit(0.05 + 0.9 * torch.rand(n, generator=gen)),
        "sh0": 0.5 * torch.randn(n, 1, 3, generator=gen),
        "shN": 0.2 * torch.randn(n, k, 3, generator=gen),
    }


@pytest.mark.parametrize("mode", ATOMIC_MODES)
@pytest.mark.parametrize(("sh_degree", "absgrad", "background"), [(3, True, True), (1, False, False)])
def test_render_cuda_matches_reference(mode: str, sh_degree: int, absgrad: bool, background: bool) -> None:
    from gstrain.render.common import RasterOptions
    from gstrain.render.cuda import render_cuda
    from gstrain.render.reference import render_reference

    width, height = 61, 47
    raw = make_params(400, seed=60 + sh_degree)
    viewmat, K = camera(width, height)
    bg = torch.tensor([0.2, 0.5, 0.9]) if background else None
    gen = torch.Generator().manual_seed(61)
    w_img = torch.randn(height, width, 3, generator=gen)
    w_a = torch.randn(height, width, 1, generator=gen)

    def run(dtype: torch.dtype, fn, **kw):
        p = {k: v.to("cuda", dtype).detach().clone().requires_grad_(True) for k, v in raw.items()}
        image, alpha, info = fn(
            p, viewmat.cuda().to(dtype), K.cuda().to(dtype), width, height, sh_degree,
            None if bg is None else bg.cuda().to(dtype), **kw,
        )  # fmt: skip
        info["means2d"].retain_grad()
        loss = (image * w_img.cuda().to(dtype)).sum() + (alpha * w_a.cuda().to(dtype)).sum()
        loss.backward()
        out = {"image": image.detach(), "alpha": alpha.detach()}
        out.update({f"d_{k}": v.grad for k, v in p.items()})
        out["d_means2d"] = info["means2d"].grad
        if absgrad:
            out["absgrad"] = info["means2d"].absgrad
        return out, info

    ours, info = run(torch.float32, render_cuda, options=RasterOptions(absgrad=absgrad, atomic_mode=mode))
    ref, ref_info = run(torch.float64, render_reference, absgrad=absgrad)
    assert set(ref_info) <= set(info)
    assert info["radii"].dtype == torch.int32 and info["radii"].shape == (1, 400, 2)
    assert info["means2d"].shape == (1, 400, 2)
    assert (info["width"], info["height"], info["n_cameras"]) == (width, height, 1)
    # float32 (gsplat) and float64 (reference) may round ceil(3.33 sigma) apart, very rarely
    assert (info["radii"].cpu() != ref_info["radii"].cpu()).any(-1).float().mean() < 0.01
    for k in ref:
        # float32 projection (gsplat) against float64 (reference) adds its own rounding
        tol = 1e-4 if k in ("image", "alpha") else 2e-3
        assert_close(f"render/{mode} {k}", ours[k], ref[k], tol)


@pytest.mark.parametrize("absgrad", [False, True])
def test_default_strategy_runs_on_render_cuda(absgrad: bool) -> None:
    from gsplat.strategy import DefaultStrategy

    from gstrain.render.arc import ArcTuner
    from gstrain.render.common import RasterOptions
    from gstrain.render.cuda import render_cuda

    width, height = 64, 48
    raw = make_params(300, seed=70)
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.cuda()) for k, v in raw.items()})
    optimizers = {k: torch.optim.Adam([p], lr=1e-3) for k, p in params.items()}
    strategy = DefaultStrategy(refine_start_iter=1, refine_every=2, reset_every=1000, absgrad=absgrad,
                               grow_grad2d=1e-9, verbose=False)  # fmt: skip
    strategy.check_sanity(params, optimizers)
    state = strategy.initialize_state()
    viewmat, K = camera(width, height)
    tuner = ArcTuner(candidates=(2, 8), reps=1)
    n0 = len(params["means"])
    for step in range(4):
        image, alpha, info = render_cuda(
            params,
            viewmat.cuda(),
            K.cuda(),
            width,
            height,
            1,
            options=RasterOptions(absgrad=absgrad, atomic_mode="arc", tuner=tuner),
        )
        strategy.step_pre_backward(params, optimizers, state, step, info)
        image.mean().backward()
        if absgrad:
            assert info["means2d"].absgrad.shape == (1, len(params["means"]), 2)
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        n_before = len(params["means"])
        strategy.step_post_backward(params, optimizers, state, step, info, packed=False)
        if len(params["means"]) != n_before:
            tuner.invalidate()
    assert len(params["means"]) > n0  # grew, so the gradients reached the strategy


def test_arc_tuner_rounds_on_the_gpu() -> None:
    from gstrain.render.arc import ArcTuner

    s = make_scene(300, 70, 50, seed=80)
    tuner = ArcTuner(candidates=(1, 4, 8, 16), reps=2, warmup=1)
    first = run_cuda(s, "warp")
    for _ in range(1 + 4 * 2):
        out = run_cuda(s, "arc", tuner=tuner)
        for k in first:
            assert_close(f"arc tuning {k}", out[k], first[k], 1e-5)
    torch.cuda.synchronize()
    assert tuner.poll()
    assert len(tuner.history) == 1 and tuner.history[0].threshold in (1, 4, 8, 16)
    assert sorted(tuner.history[0].timings) == [1, 4, 8, 16]
    assert all(len(v) == 2 for v in tuner.history[0].timings.values())
    assert tuner.threshold == tuner.history[0].threshold
    tuner.invalidate()
    assert tuner.tuning
