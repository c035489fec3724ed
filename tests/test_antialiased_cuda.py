"""render.antialiased on the GPU: our render (gsplat's projection with its compensations, or our
device-sized projection kernel's) is the same function as gsplat's own
rasterization(rasterize_mode="antialiased"), in images and in the gradients of every parameter.
gsplat bounds radii by opacity there and ours by 3.33 sigma; the extra pairs have alpha < 1/255 on
every pixel, which both rasterizers skip, so images and gradients agree to rounding. The CPU side:
tests/test_antialiased.py; the canvas (graph step) path: test_sized_projection_cuda.py."""

from __future__ import annotations

import pytest
import torch
from cuda_scenes import FWD_TOL, GRAD_TOL, assert_close, camera, random_gaussians
from torch import Tensor

pytestmark = pytest.mark.cuda

WIDTH, HEIGHT, SH_DEGREE = 67, 45, 2


def _params(n: int, seed: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # small Gaussians (sub-pixel to a few pixels): the compensation matters
    g = random_gaussians(n, gen, 1.0, log_scale=(-5.0, -2.0))
    k = (SH_DEGREE + 1) ** 2 - 1
    return {
        "means": g["means"], "scales": g["scales"], "quats": g["quats"],
        "opacities": torch.logit(0.05 + 0.9 * torch.rand(n, generator=gen)),
        "sh0": 0.5 * torch.randn(n, 1, 3, generator=gen), "shN": 0.2 * torch.randn(n, k, 3, generator=gen),
    }  # fmt: skip


def _run(raw: dict[str, Tensor], render, background: Tensor | None) -> dict[str, Tensor]:
    p = {k: v.cuda().detach().clone().requires_grad_(True) for k, v in raw.items()}
    image, alpha, means2d = render(p)
    means2d.retain_grad()
    gen = torch.Generator().manual_seed(7)
    w_img = torch.randn(HEIGHT, WIDTH, 3, generator=gen).cuda()
    w_a = torch.randn(HEIGHT, WIDTH, 1, generator=gen).cuda()
    ((image * w_img).sum() + (alpha * w_a).sum()).backward()
    out = {"image": image.detach(), "alpha": alpha.detach(), "d_means2d": means2d.grad.reshape(-1, 2)}
    out.update({f"d_{k}": v.grad for k, v in p.items()})
    return out


def _gsplat(background: Tensor | None):
    from gsplat import rasterization

    viewmat, K = camera(WIDTH, HEIGHT)

    def render(p):
        colors = torch.cat([p["sh0"], p["shN"]], 1)
        image, alpha, meta = rasterization(
            p["means"], p["quats"], torch.exp(p["scales"]), torch.sigmoid(p["opacities"]), colors,
            viewmat[None].cuda(), K[None].cuda(), WIDTH, HEIGHT, sh_degree=SH_DEGREE, packed=False,
            backgrounds=None if background is None else background[None], rasterize_mode="antialiased",
        )  # fmt: skip
        return image[0], alpha[0], meta["means2d"]

    return render


def _ours(background: Tensor | None, **options):
    from gstrain.render.common import RasterOptions
    from gstrain.render.cuda import render_cuda

    viewmat, K = camera(WIDTH, HEIGHT)

    def render(p):
        image, alpha, info = render_cuda(p, viewmat.cuda(), K.cuda(), WIDTH, HEIGHT, SH_DEGREE, background,
                                         RasterOptions(antialiased=True, **options))  # fmt: skip
        return image, alpha, info["means2d"]

    return render


@pytest.mark.parametrize(
    "options",
    [
        {"atomic_mode": "warp"},
        {"atomic_mode": "arc", "ellipse_cull": True, "fused_sh": True},
        {"gsplat_raster": True},  # render.backend=gsplat
    ],
)
@pytest.mark.parametrize("background", [False, True])
def test_render_cuda_antialiased_equals_gsplats_antialiased_rasterization(options: dict, background: bool) -> None:
    raw = _params(600, seed=80)
    bg = torch.tensor([0.2, 0.5, 0.9]).cuda() if background else None
    ref = _run(raw, _gsplat(bg), bg)
    ours = _run(raw, _ours(bg, **options), bg)
    for k, v in ref.items():
        assert_close(f"antialiased {options} {k}", ours[k], v, FWD_TOL if k in ("image", "alpha") else GRAD_TOL)
    # the mode matters on this scene: the classic render differs
    from gstrain.render.common import RasterOptions
    from gstrain.render.cuda import render_cuda

    viewmat, K = camera(WIDTH, HEIGHT)
    p = {k: v.cuda() for k, v in raw.items()}
    classic = render_cuda(p, viewmat.cuda(), K.cuda(), WIDTH, HEIGHT, SH_DEGREE, bg, RasterOptions(**options))[0]
    assert float((classic - ref["image"]).abs().max()) > 0.05


def test_render_cuda_antialiased_equals_the_float64_reference() -> None:
    from gstrain.render.reference import render_reference

    raw = _params(400, seed=81)
    viewmat, K = camera(WIDTH, HEIGHT)
    ours = _run(raw, _ours(None, atomic_mode="warp"), None)

    def reference(p):
        q = {k: v.double() for k, v in p.items()}
        image, alpha, info = render_reference(q, viewmat.cuda().double(), K.cuda().double(), WIDTH, HEIGHT,
                                              SH_DEGREE, antialiased=True)  # fmt: skip
        return image.float(), alpha.float(), info["means2d"]

    ref = _run(raw, reference, None)
    for k, v in ref.items():
        if k == "d_means2d":
            continue  # a float64 leaf's gradient: compared through the parameters' gradients
        assert_close(f"antialiased vs reference {k}", ours[k], v, 1e-4 if k in ("image", "alpha") else 2e-3)


@pytest.mark.parametrize("size", [(64, 48), (61, 37)])
def test_sized_projection_compensations_equal_gsplats(size) -> None:
    """Our device-sized kernel (the graph step's projection) with compensations against gsplat's
    fully_fused_projection(calc_compensations=True): outputs and the gradients of a loss that
    reads the compensations too (their backward runs through the covariance)."""
    from gsplat import fully_fused_projection

    from gstrain.render.sized_projection import project_sized_compensated

    width, height = size
    K = torch.tensor([[50.0, 0, 30.5], [0, 52.0, 22.0], [0, 0, 1]], device="cuda")
    viewmat = torch.eye(4, device="cuda")
    viewmat[:3, 3] = torch.tensor([0.1, -0.2, 0.3])
    gen = torch.Generator().manual_seed(width)
    n = 3000
    base = {
        "means": torch.cat([(torch.rand(n, 2, generator=gen) - 0.5) * 6.0, torch.rand(n, 1, generator=gen) * 6.0 - 0.5],
                           1).cuda(),
        "quats": torch.randn(n, 4, generator=gen).cuda(),
        "scales": torch.exp(torch.randn(n, 3, generator=gen) * 0.8 - 3.0).cuda(),
    }  # fmt: skip
    results = {}
    for name in ("gsplat", "ours"):
        p = {k: v.clone().requires_grad_(True) for k, v in base.items()}
        if name == "gsplat":
            radii, m2d, depths, conics, comp = fully_fused_projection(
                p["means"], None, p["quats"], p["scales"], viewmat[None], K[None], width, height, eps2d=0.3,
                near_plane=0.01, packed=False, calc_compensations=True)  # fmt: skip
        else:
            valid = torch.tensor([width, height], dtype=torch.int32, device="cuda")
            radii, m2d, depths, conics, comp = project_sized_compensated(p["means"], p["quats"], p["scales"], viewmat,
                                                                         K, valid)  # fmt: skip
        seen = (radii > 0).all(-1)
        g = torch.Generator(device="cuda").manual_seed(1)
        w2, w3, w1 = (torch.randn(t.shape, generator=g, device="cuda") for t in (m2d, conics, depths))
        wc = torch.randn(comp.shape, generator=g, device="cuda") * 10.0
        loss = ((m2d * w2).sum(-1) + (conics * w3).sum(-1) + depths * w1 + comp * wc)[seen].sum()
        loss.backward()
        results[name] = (radii, comp.detach(), {k: v.grad for k, v in p.items()})
    ref, out = results["gsplat"], results["ours"]
    assert torch.equal(out[0], ref[0])
    seen = (ref[0] > 0).all(-1)
    assert 500 < int(seen.sum()) < 2900
    assert float(ref[1][seen].min()) < 0.5  # small Gaussians: compensations far from 1
    assert torch.allclose(out[1][seen], ref[1][seen], rtol=1e-5, atol=1e-6)
    for key, gref in ref[2].items():
        # gsplat divides by (compensation + 1e-6) in its backward, we by the compensation
        err = float((out[2][key] - gref).norm() / gref.norm())
        assert err < 1e-4, (key, err)
