"""The reference renderer end to end: render_reference's gradients by central differences, its
absgrad, info and timer; projection and SH against gsplat's own PyTorch implementation; a tiny fit.
"""

from __future__ import annotations

import pytest
import torch
from reference_oracle import (
    F64,
    brute_rasterize,
    camera,
    closest,
    gaussians_3d,
    projected,
    scene_2d,
    single_thread,  # noqa: F401 (autouse: these renders run on one thread)
    world_from_camera,
)

from gstrain.render import reference as ref
from gstrain.render.reference import Projection, project_gaussians, rasterize, render_reference
from gstrain.render.sh import sh_to_color


def test_render_reference_gradcheck() -> None:
    w, h, deg = 24, 20, 3
    viewmat, K = camera(w, h, 22.0)
    # choose a scene whose rasterization decisions sit away from their thresholds
    for seed in range(100):
        p = gaussians_3d(8, seed, deg, scale=0.12)
        proj = project_gaussians(p["means"], p["quats"], p["scales"].exp(), viewmat, K, w, h)
        if (proj.radii == 0).any():
            continue
        # ceil(3.33 sigma) and the tile rule must not sit on an integer either
        det = proj.conics[:, 0] * proj.conics[:, 2] - proj.conics[:, 1] ** 2
        r = 3.33 * (torch.stack([proj.conics[:, 2], proj.conics[:, 0]], -1) / det[:, None]).sqrt()
        edges = torch.cat([r, (proj.means2d - proj.radii) / 16, (proj.means2d + proj.radii) / 16], -1)
        if ((edges - edges.round()).abs() < 1e-4).any():
            continue
        cols = sh_to_color(torch.cat([p["sh0"], p["shN"]], 1), p["means"], deg)
        margins: dict[str, float] = {}
        brute_rasterize(
            proj.means2d, proj.conics, cols, torch.sigmoid(p["opacities"]), proj.radii, proj.depths, w, h,
            margins=margins,
        )  # fmt: skip
        if closest(margins) > 2e-4:
            break
    else:
        raise AssertionError("no safe scene")
    names = ["means", "scales", "quats", "opacities", "sh0", "shN"]
    inputs = [p[k].clone().requires_grad_(True) for k in names]
    bg = torch.tensor([0.1, 0.2, 0.3], dtype=F64)

    def f(*xs):
        image, alpha, _ = render_reference(dict(zip(names, xs, strict=True)), viewmat, K, w, h, deg, bg)
        return image, alpha

    assert torch.autograd.gradcheck(projected(f), inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# absgrad


@pytest.mark.parametrize("segment", [32, 3])
def test_absgrad_matches_per_pixel_brute_force(segment: int) -> None:
    w, h = 13, 11
    m, con, col, op, radii, dep = scene_2d(12, w, h, 5)
    g = torch.Generator().manual_seed(1)
    w_img = torch.randn(h, w, 3, generator=g, dtype=F64)
    w_a = torch.randn(h, w, 1, generator=g, dtype=F64)

    leaves = [t.clone().requires_grad_(True) for t in (m, con, col, op)]
    if segment == 32:
        image, alpha = rasterize(*leaves, radii, dep, w, h, absgrad=True)
    else:
        image, alpha = ref._rasterize(*leaves, radii, dep, w, h, absgrad_owner=leaves[0], segment=segment)
    ((image * w_img).sum() + (alpha * w_a).sum()).backward()
    got = leaves[0].absgrad
    assert got.shape == (12, 2)

    # each pixel's own d loss / d means2d, one backward per pixel (retain_graph: recomputes)
    m2 = m.clone().requires_grad_(True)
    image, alpha = ref._rasterize(m2, con, col, op, radii, dep, w, h, segment=segment)
    pixel_loss = (image * w_img).sum(-1) + (alpha * w_a).sum(-1)
    want = torch.zeros_like(m)
    for y in range(h):
        for x in range(w):
            (gm,) = torch.autograd.grad(pixel_loss[y, x], m2, retain_graph=True)
            want += gm.abs()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    # and the plain gradient is the signed sum (absgrad >= |grad|)
    assert (got + 1e-12 >= leaves[0].grad.abs()).all()


def test_render_reference_info_and_strategy() -> None:
    from gsplat.strategy import DefaultStrategy

    w, h = 30, 22
    viewmat, K = camera(w, h, 25.0, torch.float32)
    p = {k: torch.nn.Parameter(v.float()) for k, v in gaussians_3d(40, 0, 3).items()}
    p["means"].data[:3, 2] = -1.0  # behind the camera: culled
    params = torch.nn.ParameterDict(p)
    for absgrad in (False, True):
        image, alpha, info = render_reference(params, viewmat, K, w, h, 3, absgrad=absgrad)
        assert image.shape == (h, w, 3) and alpha.shape == (h, w, 1)
        assert info["means2d"].shape == (1, 40, 2) and info["radii"].shape == (1, 40, 2)
        assert info["radii"].dtype == torch.int32 and info["depths"].shape == (1, 40)
        assert info["conics"].shape == (1, 40, 3)
        assert (info["width"], info["height"], info["n_cameras"]) == (w, h, 1)
        assert (info["radii"][0, :3] == 0).all() and (info["radii"][0, 3:] > 0).any()

        strategy = DefaultStrategy(absgrad=absgrad, verbose=False)
        optimizers = {k: torch.optim.Adam([v], lr=1e-3) for k, v in params.items()}
        state = strategy.initialize_state()
        strategy.step_pre_backward(params, optimizers, state, 0, info)
        image.sum().backward()
        grad = info["means2d"].absgrad if absgrad else info["means2d"].grad
        assert grad is not None and grad.shape == (1, 40, 2)
        assert torch.equal(grad[0, :3], torch.zeros(3, 2))  # culled: zero, not NaN
        assert torch.isfinite(params["means"].grad).all()
        assert torch.equal(params["means"].grad[:3], torch.zeros(3, 3))
        strategy.step_post_backward(params, optimizers, state, 0, info, packed=False)
        assert state["count"][3:].sum() > 0 and state["count"][:3].sum() == 0
        for v in params.values():
            v.grad = None


def test_render_reference_phase_timer() -> None:
    from gstrain.train.timing import PhaseTimer

    w, h = 30, 22
    viewmat, K = camera(w, h, 25.0, torch.float32)
    p = {k: v.float().requires_grad_(True) for k, v in gaussians_3d(40, 0, 3).items()}
    timer = PhaseTimer(torch.device("cpu"))
    image, alpha, _ = render_reference(p, viewmat, K, w, h, 3, timer=timer)
    plain, _, _ = render_reference(p, viewmat, K, w, h, 3)
    assert torch.equal(image, plain)
    image.sum().backward()
    timer.step_done()
    times = timer.summary()
    assert {"projection", "raster_fwd", "raster_bwd"} <= set(times) and times["raster_bwd"] > 0


# ---------------------------------------------------------------------------------------------
# projection and SH against gsplat's PyTorch implementation


def test_projection_matches_gsplat() -> None:
    from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci

    w, h = 67, 45
    viewmat, K = camera(w, h, 50.0)
    g = torch.Generator().manual_seed(0)
    n = 400
    means = (torch.rand(n, 3, generator=g, dtype=F64) - 0.5) * torch.tensor([8.0, 6.0, 8.0], dtype=F64)
    means[:, 2] += 2.0  # some behind the camera, some far outside the frustum
    near = torch.tensor([[0.001, 0.002, 0.005]], dtype=F64).repeat(5, 1)
    means[:5] = world_from_camera(viewmat, near)  # in front, but closer than the near plane
    quats = torch.randn(n, 4, generator=g, dtype=F64)
    scales = torch.exp(torch.randn(n, 3, generator=g, dtype=F64) * 0.7 - 2.5)

    proj = project_gaussians(means, quats, scales, viewmat, K, w, h)
    covars, _ = _quat_scale_to_covar_preci(quats, scales, compute_preci=False)
    radii, means2d, depths, conics, _ = _fully_fused_projection(means, covars, viewmat[None], K[None], w, h)
    assert isinstance(proj, Projection)
    assert proj.radii.dtype == torch.int32 and torch.equal(proj.radii, radii[0])
    torch.testing.assert_close(proj.depths, depths[0], atol=1e-12, rtol=0)
    front = depths[0] > 0.01
    assert 50 < int((proj.radii > 0).all(-1).sum()) < int(front.sum()) < n  # every case occurs
    torch.testing.assert_close(proj.means2d[front], means2d[0][front], atol=1e-9, rtol=1e-12)
    torch.testing.assert_close(proj.conics[front], conics[0][front], atol=1e-9, rtol=1e-9)
    assert (proj.radii[~front] == 0).all()
    assert (proj.radii[:5] == 0).all()


def test_culled_gaussians_get_zero_gradient() -> None:
    w, h = 20, 16
    viewmat, K = camera(w, h, 20.0)
    p = gaussians_3d(6, 0, 1)
    cam = torch.tensor([[0.01, 0.02, 0.0], [0.3, -0.2, -3.0]], dtype=F64)  # depth 0, and behind
    p["means"][:2] = world_from_camera(viewmat, cam)
    leaves = {k: v.clone().requires_grad_(True) for k, v in p.items()}
    image, alpha, info = render_reference(leaves, viewmat, K, w, h, 1)
    assert (info["radii"][0, :2] == 0).all()
    (image.sum() + alpha.sum()).backward()
    for k, v in leaves.items():
        assert torch.isfinite(v.grad).all(), k
        assert not v.grad[:2].any(), k


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_sh_matches_gsplat(degree: int) -> None:
    from gsplat.cuda._torch_impl import _spherical_harmonics

    g = torch.Generator().manual_seed(degree)
    sh = torch.randn(64, 16, 3, generator=g, dtype=F64)  # more coefficients than needed: ignored
    dirs = torch.randn(64, 3, generator=g, dtype=F64) * 3
    got = sh_to_color(sh, dirs, degree)
    want = torch.clamp_min(_spherical_harmonics(degree, dirs, sh) + 0.5, 0.0)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert (got == 0).any() or degree == 0  # the clamp is exercised
    with pytest.raises(ValueError):
        sh_to_color(sh[:, :3], dirs, 2)


# ---------------------------------------------------------------------------------------------
# a tiny optimisation


def test_fitting_colours_and_opacities_reduces_loss() -> None:
    torch.manual_seed(0)
    w, h, deg = 32, 24, 0
    viewmat, K = camera(w, h, 30.0, torch.float32)
    target_p = {k: v.float() for k, v in gaussians_3d(30, 1, deg, scale=0.25).items()}
    with torch.no_grad():
        target, _, _ = render_reference(target_p, viewmat, K, w, h, deg)
    params = {k: v.clone() for k, v in target_p.items()}
    params["sh0"] = torch.zeros_like(params["sh0"]).requires_grad_(True)
    params["opacities"] = torch.zeros_like(params["opacities"]).requires_grad_(True)
    opt = torch.optim.Adam([params["sh0"], params["opacities"]], lr=0.05)
    losses = []
    for _ in range(60):
        image, _, _ = render_reference(params, viewmat, K, w, h, deg)
        loss = (image - target).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_renderer_picks_backend_and_carries_one_options_object():
    from gstrain.config import RenderConfig
    from gstrain.dev_config import DevConfig
    from gstrain.errors import UserError
    from gstrain.render import Renderer
    from gstrain.render.common import RasterOptions

    cpu = torch.device("cpu")
    renderer = Renderer(RenderConfig(atomic_mode="distwar"), cpu, absgrad=True, dev=DevConfig(atomic_threshold=5))
    assert renderer.backend == "reference" and renderer.atomic_threshold is None
    # the config's ellipse cull and fused SH (on by default) reach the options; only the gsplat
    # backend drops them
    assert renderer.options == RasterOptions(absgrad=True, atomic_mode="distwar", atomic_threshold=5,
                                             ellipse_cull=True, fused_sh=True)  # fmt: skip
    off = Renderer(RenderConfig(), cpu, dev=DevConfig(fused_sh=False))
    assert not off.options.fused_sh and off.options.ellipse_cull
    if not torch.cuda.is_available():
        for backend in ("cuda", "gsplat"):
            with pytest.raises(UserError, match=f"render.backend={backend} needs a CUDA GPU"):
                Renderer(RenderConfig(backend=backend), cpu)
