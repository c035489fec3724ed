"""render.antialiased on the reference renderer (CPU), against an independent oracle: gsplat's
pure-PyTorch projection (gsplat.cuda._torch_impl, which computes the compensations the way its
rasterize_mode="antialiased" uses them) with gsplat's PyTorch SH, all in float64. The image is
composited by the per-pixel loop of reference_oracle.py; the gradients (that loop has none) flow
through the reference compositing, checked on its own against the loop and finite differences in
test_reference_raster.py, so what they test here is the projection and its compensation. The
CUDA kernels' side: tests/test_antialiased_cuda.py."""

from __future__ import annotations

import pytest
import torch
from reference_oracle import (
    F64,
    brute_rasterize,
    camera,
    gaussians_3d,
    single_thread,  # noqa: F401 (autouse: these renders run on one thread)
)
from torch import Tensor

from gstrain.render.reference import project_gaussians, rasterize, render_reference

WIDTH, HEIGHT, SH_DEGREE = 23, 19, 1


def oracle_render(p: dict[str, Tensor], viewmat: Tensor, K: Tensor, antialiased: bool,
                  composite=brute_rasterize) -> tuple[Tensor, Tensor]:  # fmt: skip
    from gsplat.cuda._torch_impl import _fully_fused_projection, _quat_scale_to_covar_preci, _spherical_harmonics

    covars, _ = _quat_scale_to_covar_preci(p["quats"], torch.exp(p["scales"]), compute_preci=False)
    radii, means2d, depths, conics, comp = _fully_fused_projection(
        p["means"], covars, viewmat[None], K[None], WIDTH, HEIGHT, eps2d=0.3, calc_compensations=antialiased,
    )  # fmt: skip
    campos = -viewmat[:3, :3].T @ viewmat[:3, 3]
    coeffs = torch.cat([p["sh0"], p["shN"][:, :3]], 1)
    colors = torch.clamp_min(_spherical_harmonics(SH_DEGREE, p["means"] - campos, coeffs) + 0.5, 0.0)
    opac = torch.sigmoid(p["opacities"])
    if antialiased:
        opac = opac * comp[0]
    return composite(means2d[0], conics[0], colors, opac, radii[0], depths[0], WIDTH, HEIGHT)


def _grads(fn, raw: dict[str, Tensor]) -> dict[str, Tensor]:
    p = {k: v.clone().requires_grad_(True) for k, v in raw.items()}
    image, alpha = fn(p)
    g = torch.Generator().manual_seed(5)
    loss = (image * torch.randn(image.shape, generator=g, dtype=F64)).sum()
    loss = loss + (alpha * torch.randn(alpha.shape, generator=g, dtype=F64)).sum()
    loss.backward()
    out = {"image": image.detach(), "alpha": alpha.detach()}
    out.update({f"d_{k}": v.grad for k, v in p.items()})
    return out


def _scene() -> dict[str, Tensor]:
    # small Gaussians (0.2..0.8 px sigma at this focal and depth): the compensation is far from 1
    raw = gaussians_3d(30, seed=11, sh_degree=SH_DEGREE, scale=0.03)
    raw["scales"] = raw["scales"] + torch.log(torch.linspace(0.3, 3.0, 30, dtype=F64))[:, None]
    return raw


@pytest.mark.parametrize("antialiased", [True, False])
def test_reference_equals_gsplats_torch_projection_with_brute_compositing(antialiased: bool) -> None:
    raw = _scene()
    viewmat, K = camera(WIDTH, HEIGHT, f=20.0)
    ours = _grads(lambda p: render_reference(p, viewmat, K, WIDTH, HEIGHT, SH_DEGREE, antialiased=antialiased)[:2],
                  raw)  # fmt: skip
    ref = _grads(lambda p: oracle_render(p, viewmat, K, antialiased, composite=rasterize), raw)
    brute = oracle_render(raw, viewmat, K, antialiased)
    ref["image"], ref["alpha"] = brute
    for k, v in ref.items():
        assert torch.isfinite(ours[k]).all(), k
        err = float((ours[k] - v).norm() / v.norm().clamp_min(1e-30))
        assert err < 1e-9, (k, err)


def test_compensation_is_the_determinant_ratio_and_changes_the_image() -> None:
    raw = _scene()
    viewmat, K = camera(WIDTH, HEIGHT, f=20.0)
    proj = project_gaussians(raw["means"], raw["quats"], torch.exp(raw["scales"]), viewmat, K, WIDTH, HEIGHT,
                             antialiased=True)  # fmt: skip
    seen = (proj.radii > 0).all(-1)
    assert int(seen.sum()) > 15
    # the conic is inverse(cov2d + 0.3 I): recover cov2d from it and take the ratio by hand
    a, b, c = proj.conics.unbind(-1)
    det_inv = a * c - b * b
    blurred = torch.stack([c / det_inv, -b / det_inv, a / det_inv], -1)  # cov2d + 0.3 I as (xx, xy, yy)
    plain = blurred - torch.tensor([0.3, 0.0, 0.3], dtype=F64)
    expect = torch.sqrt((plain[:, 0] * plain[:, 2] - plain[:, 1] ** 2) / (1.0 / det_inv))
    assert torch.allclose(proj.compensations[seen], expect[seen], rtol=1e-9)
    comp = proj.compensations[seen]
    assert float(comp.min()) < 0.5 and float(comp.max()) < 1.0  # small Gaussians lose much of their opacity
    on = render_reference(raw, viewmat, K, WIDTH, HEIGHT, SH_DEGREE, antialiased=True)[0]
    off = render_reference(raw, viewmat, K, WIDTH, HEIGHT, SH_DEGREE)[0]
    assert float((on - off).abs().max()) > 0.05


def test_flat_gaussians_get_zero_compensation_and_finite_gradients() -> None:
    """A Gaussian flat along the view ray's plane (one scale ~0, seen edge-on) has det(cov2d) ~ 0:
    compensation 0 and no NaN from sqrt at 0 in the backward."""
    raw = _scene()
    raw["scales"][:5, 0] = -60.0  # exp(-60): a disc
    raw["quats"][:5] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)  # its flat axis along x...
    raw["means"][:5, 0] = 0.0  # ...and its centre in the plane x = 0 with the camera's
    viewmat = torch.eye(4, dtype=F64)
    K = torch.tensor([[20.0, 0, WIDTH / 2], [0, 20.0, HEIGHT / 2], [0, 0, 1]], dtype=F64)
    out = _grads(lambda p: render_reference(p, viewmat, K, WIDTH, HEIGHT, SH_DEGREE, antialiased=True)[:2], raw)
    for k, v in out.items():
        assert torch.isfinite(v).all(), k
    proj = project_gaussians(raw["means"], raw["quats"], torch.exp(raw["scales"]), viewmat, K, WIDTH, HEIGHT,
                             antialiased=True)  # fmt: skip
    # so the camera sees the disc edge-on: a line, of (near) zero area
    assert float(proj.compensations[:5].max()) < 1e-6
