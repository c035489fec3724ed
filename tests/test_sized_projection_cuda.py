"""One CUDA graph for views of every size (train/graph_step.py's canvas): the device-sized
projection against gsplat's, and a render, intersection and loss on a canvas against the same
view rendered at its own size. The graph steps themselves: tests/test_graph_cuda.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gstrain.config import build_config
from gstrain.render import Renderer
from gstrain.render.isect import PairBudget

pytestmark = pytest.mark.cuda


def _gaussians(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Gaussians in front of, around and behind a camera at the origin looking down +z: some far
    outside the frustum (the Jacobian's clamp), some behind it and some tiny (culled)."""
    g = torch.Generator().manual_seed(seed)
    xy = (torch.rand(n, 2, generator=g) - 0.5) * 6.0
    z = torch.rand(n, 1, generator=g) * 6.0 - 0.5
    return {
        "means": torch.cat([xy, z], 1),
        "quats": torch.randn(n, 4, generator=g),
        "scales": torch.exp(torch.randn(n, 3, generator=g) * 0.8 - 2.0),
    }


@pytest.mark.parametrize("size", [(64, 48), (61, 37)])
def test_sized_projection_equals_gsplats(size):
    from gsplat import fully_fused_projection

    from gstrain.render.sized_projection import project_sized

    width, height = size
    K = torch.tensor([[50.0, 0, 30.5], [0, 52.0, 22.0], [0, 0, 1]], device="cuda")
    viewmat = torch.eye(4, device="cuda")
    viewmat[:3, 3] = torch.tensor([0.1, -0.2, 0.3])
    base = {k: v.cuda() for k, v in _gaussians(4000, seed=width).items()}
    results = {}
    for name in ("gsplat", "ours"):
        p = {k: v.clone().requires_grad_(True) for k, v in base.items()}
        if name == "gsplat":
            radii, m2d, depths, conics, _ = fully_fused_projection(
                p["means"], None, p["quats"], p["scales"], viewmat[None], K[None], width, height, eps2d=0.3,
                near_plane=0.01, packed=False)  # fmt: skip
        else:
            valid = torch.tensor([width, height], dtype=torch.int32, device="cuda")
            radii, m2d, depths, conics = project_sized(p["means"], p["quats"], p["scales"], viewmat, K, valid)
        seen = (radii > 0).all(-1)
        g = torch.Generator(device="cuda").manual_seed(1)
        w2, w3, w1 = (torch.randn(t.shape, generator=g, device="cuda") for t in (m2d, conics, depths))
        # only what the rasterizer reads: culled Gaussians' outputs are unspecified
        loss = ((m2d * w2).sum(-1) + (conics * w3).sum(-1) + depths * w1)[seen].sum()
        loss.backward()
        results[name] = (radii, m2d.detach(), depths.detach(), conics.detach(), {k: v.grad for k, v in p.items()})
    ref, out = results["gsplat"], results["ours"]
    assert torch.equal(out[0], ref[0])  # the same Gaussians kept, with the same integer radii
    seen = (ref[0] > 0).all(-1)
    assert 500 < int(seen.sum()) < 3900  # culls and keeps, both exercised
    for a, b in zip(out[1:4], ref[1:4], strict=True):
        assert torch.allclose(a[seen], b[seen], rtol=1e-5, atol=1e-5)
    for key, gref in ref[4].items():
        err = float((out[4][key] - gref).norm() / gref.norm())
        assert err < 1e-5, (key, err)


@pytest.mark.parametrize("identity", [True, False])
def test_turning_a_sphere_has_no_gradient(identity):
    """An isotropic Gaussian looks the same however it is turned, so its quaternion gradient is
    zero: exactly so at the identity rotation (every Gaussian starts there; Adam makes any noise
    left there a full learning-rate step), to rounding otherwise. Its scale and mean do get
    gradients (the same upstream weights as above)."""
    from gstrain.render.sized_projection import project_sized

    K = torch.tensor([[50.0, 0, 30.5], [0, 52.0, 22.0], [0, 0, 1]], device="cuda")
    viewmat = torch.eye(4, device="cuda")
    viewmat[:3, :3] = torch.linalg.matrix_exp(torch.tensor([[0, -0.3, 0.2], [0.3, 0, -0.1], [-0.2, 0.1, 0]]))
    viewmat[:3, 3] = torch.tensor([0.1, -0.2, 0.3])
    base = _gaussians(4000, seed=5)
    n = base["means"].shape[0]
    quats = torch.tensor([[1.0, 0, 0, 0]]).repeat(n, 1) if identity else base["quats"]
    p = {"means": base["means"], "quats": quats, "scales": base["scales"][:, :1].repeat(1, 3)}
    p = {k: v.cuda().requires_grad_(True) for k, v in p.items()}
    valid = torch.tensor([64, 48], dtype=torch.int32, device="cuda")
    radii, m2d, depths, conics = project_sized(p["means"], p["quats"], p["scales"], viewmat, K, valid)
    seen = (radii > 0).all(-1)[0]
    assert int(seen.sum()) > 500
    g = torch.Generator(device="cuda").manual_seed(1)
    w2, w3, w1 = (torch.randn(t.shape, generator=g, device="cuda") for t in (m2d, conics, depths))
    ((m2d * w2).sum(-1) + (conics * w3).sum(-1) + depths * w1).sum().backward()
    assert bool((p["scales"].grad[seen] != 0).all()) and bool((p["means"].grad[seen] != 0).all())
    if identity:
        assert int((p["quats"].grad != 0).any(-1).sum()) == 0
    else:  # rounding, against the gradient a stretch gets (the same units: the loss per unit)
        stretch = (p["scales"].grad * p["scales"]).detach()[seen].norm()
        assert float(p["quats"].grad[seen].norm() / stretch) < 1e-5


def _splats(scene):
    from gstrain.model import init_gaussians

    params = init_gaussians(scene.points, scene.point_colors, sh_degree=1, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        params["scales"].add_(0.6 * torch.randn(params["scales"].shape, generator=gen, device="cuda"))
        params["opacities"].add_(2.0 * torch.randn(params["opacities"].shape, generator=gen, device="cuda"))
    return params


@pytest.mark.parametrize(("crop", "antialiased"),
                         [((64, 64), False), ((57, 60), False), ((64, 47), False), ((41, 33), False),
                          ((64, 64), True), ((41, 33), True)])  # fmt: skip
def test_canvas_step_equals_the_step_at_the_views_size(demo_scene, crop, antialiased):
    """The same view cropped to (height, width), rendered at that size with gsplat's projection
    and the synced intersection, against the 64x64 canvas with the size on the device: the image
    in the view's part, the loss, the parameters' gradients and the screen-space statistics.
    antialiased: gsplat's compensations against our device-sized kernel's."""
    from gstrain.data.colmap import load_scene
    from gstrain.train.fused_ssim import fused_photometric_loss

    scene = load_scene(demo_scene)
    base = _splats(scene)
    view = scene.train[4]
    height, width = crop
    gt = (view.image[:height, :width].float() / 255.0).cuda()
    canvas_gt = torch.rand(64, 64, 3, device="cuda")  # whatever lies outside the view: must not matter
    canvas_gt[:height, :width] = gt
    valid = torch.tensor([width, height], dtype=torch.int32, device="cuda")
    out = {}
    for name in ("view", "canvas"):
        cfg = build_config(overrides=[{"render": {"atomic_mode": "warp", "antialiased": antialiased},
                                       "dev": {"ellipse_cull": True}}])  # fmt: skip
        renderer = Renderer(cfg.render, torch.device("cuda"), dev=cfg.dev)
        budget = PairBudget.on(torch.device("cuda"), 1 << 16)
        renderer.options = replace(renderer.options, pair_budget=budget,
                                   valid_size=valid if name == "canvas" else None)  # fmt: skip
        params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.detach().clone()) for k, v in base.items()})
        size = (64, 64) if name == "canvas" else (width, height)
        image, _, info = renderer(params, view.viewmat.cuda(), view.K.cuda(), *size, 1, torch.zeros(3, device="cuda"))
        info["means2d"].retain_grad()
        target = canvas_gt if name == "canvas" else gt
        loss, terms = fused_photometric_loss(image, target, 0.2, valid=valid if name == "canvas" else None)
        loss.backward()
        out[name] = (image.detach()[:height, :width], terms, {k: p.grad for k, p in params.items()},
                     info["means2d"].grad[0], info["radii"][0], budget.pair_sum.tolist())  # fmt: skip
    ref, got = out["view"], out["canvas"]
    assert torch.allclose(got[0], ref[0], atol=1e-6)
    for key in ("loss", "l1", "ssim"):
        assert abs(float(got[1][key]) - float(ref[1][key])) < 1e-6, key
    for key, g in ref[2].items():
        assert g.norm() > 0, key
        assert float((got[2][key] - g).norm() / g.norm()) < 1e-5, key
    assert torch.equal(got[4], ref[4])  # visible in the view, as its own size's projection says
    assert float((got[3] - ref[3]).norm() / ref[3].norm()) < 1e-5
    assert got[5] == ref[5]  # pairs before and after the cull: none outside the view


def test_loss_on_a_canvas_equals_the_loss_on_the_crop():
    from gstrain.train.fused_ssim import fused_photometric_loss

    g = torch.Generator(device="cuda").manual_seed(3)
    img = torch.rand(70, 90, 3, generator=g, device="cuda", requires_grad=True)
    gt = torch.rand(70, 90, 3, generator=g, device="cuda")
    height, width = 53, 71
    valid = torch.tensor([width, height], dtype=torch.int32, device="cuda")
    loss, terms = fused_photometric_loss(img, gt, 0.2, valid=valid)
    loss.backward()
    crop = img.detach()[:height, :width].clone().requires_grad_(True)
    ref, ref_terms = fused_photometric_loss(crop, gt[:height, :width].contiguous(), 0.2)
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-6
    assert abs(float(terms["ssim"]) - float(ref_terms["ssim"])) < 1e-6
    assert torch.allclose(img.grad[:height, :width], crop.grad, rtol=1e-5, atol=1e-9)
    outside = torch.ones_like(img.grad, dtype=torch.bool)
    outside[:height, :width] = False
    assert float(img.grad[outside].abs().max()) == 0.0
