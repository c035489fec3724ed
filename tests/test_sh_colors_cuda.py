"""The fused SH colours (render/sh_colors.py, csrc/sh_colors.cu) against gsplat's path
(render/cuda.splat_colors without `fused`: gsplat's spherical_harmonics between tensor ops) and
against the float64 reference (render/sh.py), forward and backward, at every degree; and a whole
render with dev.fused_sh on against off."""

from __future__ import annotations

import pytest
import torch

from gstrain.config import build_config
from gstrain.render import Renderer
from gstrain.render.cuda import splat_colors
from gstrain.render.projection import camera_centre
from gstrain.render.sh import sh_to_color

pytestmark = pytest.mark.cuda

N = 6000


def _splats(seed: int, rest: int = 15) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Gaussians with SH large enough that some colours clamp at 0, a camera, and radii with a
    fifth of the Gaussians invisible (one radius or both 0). `rest`: shN's coefficients per
    Gaussian (15 for degree 3; more leaves some above every degree)."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "means": torch.randn(N, 3, generator=g) * 2.0,
        "sh0": torch.randn(N, 1, 3, generator=g) * 1.5,
        "shN": torch.randn(N, rest, 3, generator=g) * 0.6,
    }
    viewmat = torch.eye(4)
    angle = torch.tensor(0.7)
    viewmat[0, 0], viewmat[0, 2], viewmat[2, 0], viewmat[2, 2] = angle.cos(), angle.sin(), -angle.sin(), angle.cos()
    viewmat[:3, 3] = torch.tensor([0.3, -0.2, 4.0])
    radii = torch.randint(1, 9, (1, N, 2), generator=g, dtype=torch.int32)
    hidden = torch.rand(N, generator=g) < 0.2
    radii[0, hidden, torch.randint(0, 2, (int(hidden.sum()),), generator=g)] = 0
    return {k: v.cuda() for k, v in params.items()}, viewmat.cuda(), radii.cuda()


def _colours_and_grads(base, viewmat, radii, degree, how):
    p = {k: v.clone().requires_grad_(True) for k, v in base.items()}
    if how == "reference":  # float64, on the visible Gaussians only
        p64 = {k: v.double() for k, v in p.items()}
        sh = torch.cat([p64["sh0"], p64["shN"]], 1)
        colors = sh_to_color(sh, p64["means"] - camera_centre(viewmat.double()), degree)[None]
        colors = torch.where((radii > 0).all(-1)[..., None], colors, torch.full_like(colors, 0.5))
    else:
        colors = splat_colors(p, viewmat, degree, radii, fused=how == "fused")
    g = torch.Generator(device="cuda").manual_seed(degree)  # the same weights for every path
    weights = torch.randn(colors.shape, generator=g, device="cuda").to(colors.dtype)
    (colors * weights).sum().backward()
    # (the reference builds no graph to the inputs a degree does not read: their gradient is zero)
    return colors.detach().double(), {k: (v.grad if v.grad is not None else torch.zeros_like(v)).double()
                                      for k, v in p.items()}  # fmt: skip


# N = 6000 is no multiple of the backward's block: its last block stages a partial slice; 19
# coefficients make another row length (the backward stages rows through shared memory)
@pytest.mark.parametrize(("degree", "rest"), [(0, 15), (1, 15), (2, 15), (3, 15), (1, 19), (3, 19)])
def test_fused_sh_colours_equal_gsplats_and_the_reference(degree, rest):
    base, viewmat, radii = _splats(degree, rest)
    seen = (radii > 0).all(-1)[0]
    fused = _colours_and_grads(base, viewmat, radii, degree, "fused")
    for how, tol in (("gsplat", 1e-5), ("reference", 2e-5)):
        colors, grads = _colours_and_grads(base, viewmat, radii, degree, how)
        assert (colors[0, seen] == 0).any()  # the clamp is exercised
        # gsplat leaves the masked Gaussians' colours unwritten: only the visible ones compare
        torch.testing.assert_close(fused[0][0, seen], colors[0, seen], atol=tol, rtol=tol)
        for k, want in grads.items():
            got = fused[1][k]
            if (k == "means" or k == "shN") and degree == 0:  # no direction, no shN: no gradient at all
                assert not got.any() and not want.any(), (how, k)
                continue
            err = float((got - want).norm() / want.norm())
            assert err < tol, (how, k, err)
    hidden = ~seen
    assert hidden.any() and (fused[0][0, hidden] == 0.5).all()
    for k in base:  # invisible Gaussians: no gradient; shN above the degree: none either
        assert not fused[1][k][hidden].any(), k
    assert not fused[1]["shN"][:, (degree + 1) ** 2 - 1 :].any()


def test_the_fused_sh_colours_refuse_more_coefficients_than_the_backward_stages():
    base, viewmat, radii = _splats(0, rest=129)
    with pytest.raises(ValueError, match="at most 128 shN coefficients"):
        splat_colors(base, viewmat, 3, radii, fused=True)


def test_a_render_with_fused_sh_equals_one_without():
    g = torch.Generator().manual_seed(5)
    n = 3000
    base = {
        "means": torch.randn(n, 3, generator=g) * 0.8 + torch.tensor([0.0, 0.0, 3.0]),
        "quats": torch.randn(n, 4, generator=g),
        "scales": torch.randn(n, 3, generator=g) * 0.5 - 3.0,
        "opacities": torch.randn(n, generator=g),
        "sh0": torch.randn(n, 1, 3, generator=g) * 0.5,
        "shN": torch.randn(n, 15, 3, generator=g) * 0.2,
    }
    K = torch.tensor([[90.0, 0, 48.0], [0, 90.0, 40.0], [0, 0, 1]], device="cuda")
    viewmat = torch.eye(4, device="cuda")
    out = {}
    for fused in (False, True):
        cfg = build_config(overrides=[{"render": {"atomic_mode": "warp"}, "dev": {"fused_sh": fused}}])
        renderer = Renderer(cfg.render, torch.device("cuda"), dev=cfg.dev)
        assert renderer.options.fused_sh == fused
        params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.cuda()) for k, v in base.items()})
        image, _, _ = renderer(params, viewmat, K, 96, 80, 3, torch.zeros(3, device="cuda"))
        weights = torch.linspace(-1, 1, image.numel(), device="cuda").reshape(image.shape)
        (image * weights).sum().backward()
        out[fused] = (image.detach(), {k: p.grad for k, p in params.items()})
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=1e-5)
    for k, want in out[False][1].items():
        assert want.norm() > 0, k
        err = float((out[True][1][k] - want).norm() / want.norm())
        assert err < 1e-5, (k, err)
