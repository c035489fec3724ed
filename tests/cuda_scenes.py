"""Scenes and comparisons shared by the CUDA rasterizer's tests (test_cuda_raster.py,
test_cuda_render.py): gsplat-projected random Gaussians, our kernels and the float64 reference run
on the same inputs, and the tolerances they must agree within."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

FWD_TOL = 2e-5  # relative L2 error of image / alpha
GRAD_TOL = 1e-3  # relative L2 error of each gradient


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite values"
    den = b.norm().item()
    return (a - b).norm().item() / max(den, 1e-12)


def assert_close(name: str, a: Tensor, b: Tensor, tol: float) -> None:
    err = rel_err(a, b)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:g}"


@dataclass
class Scene:
    means2d: Tensor  # [C,N,2]
    conics: Tensor  # [C,N,3]
    colors: Tensor  # [C,N,ch]
    opacities: Tensor  # [C,N]
    radii: Tensor  # [C,N,2]
    depths: Tensor  # [C,N]
    background: Tensor | None  # [C,ch]
    width: int
    height: int
    w_image: Tensor  # loss weights [C,H,W,ch]
    w_alpha: Tensor  # [C,H,W,1]


def camera(width: int, height: int, shift: float = 0.0) -> tuple[Tensor, Tensor]:
    viewmat = torch.eye(4)
    viewmat[0, 3] = shift
    f = 0.9 * max(width, height)
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
    return viewmat, K


def random_gaussians(
    n: int, gen: torch.Generator, spread: float = 1.0, log_scale: tuple[float, float] = (-3.5, -1.5)
) -> dict[str, Tensor]:
    z = 2.0 + 4.0 * torch.rand(n, generator=gen)
    xy = (torch.rand(n, 2, generator=gen) * 2 - 1) * spread * 0.5 * z[:, None]
    means = torch.cat([xy, z[:, None]], dim=1)
    lo, hi = log_scale
    scales = lo + (hi - lo) * torch.rand(n, 3, generator=gen)
    quats = torch.randn(n, 4, generator=gen)
    return {"means": means, "scales": scales, "quats": quats}


def make_scene(
    n: int,
    width: int,
    height: int,
    seed: int,
    channels: int = 3,
    n_cams: int = 1,
    background: bool = False,
    extra: dict[str, Tensor] | None = None,
    spread: float = 1.0,
    opacity_range: tuple[float, float] = (0.05, 0.95),
) -> Scene:
    from gsplat import fully_fused_projection

    gen = torch.Generator().manual_seed(seed)
    g = random_gaussians(n, gen, spread)
    if extra is not None:
        for k in g:
            g[k] = torch.cat([g[k], extra[k]], dim=0)
    n = g["means"].shape[0]
    cams = [camera(width, height, shift=0.3 * i) for i in range(n_cams)]
    viewmats = torch.stack([c[0] for c in cams]).cuda()
    Ks = torch.stack([c[1] for c in cams]).cuda()
    radii, means2d, depths, conics, _ = fully_fused_projection(
        g["means"].cuda(), None, g["quats"].cuda(), torch.exp(g["scales"]).cuda(), viewmats, Ks,
        width, height, eps2d=0.3, near_plane=0.01, packed=False,
    )  # fmt: skip
    lo, hi = opacity_range
    opac = lo + (hi - lo) * torch.rand(n_cams, n, generator=gen)
    colors = torch.rand(n_cams, n, channels, generator=gen)
    bg = torch.rand(n_cams, channels, generator=gen) if background else None
    return Scene(
        means2d=means2d.detach(),
        conics=conics.detach(),
        colors=colors.cuda(),
        opacities=opac.cuda(),
        radii=radii,
        depths=depths.detach(),
        background=None if bg is None else bg.cuda(),
        width=width,
        height=height,
        w_image=torch.randn(n_cams, height, width, channels, generator=gen).cuda(),
        w_alpha=torch.randn(n_cams, height, width, 1, generator=gen).cuda(),
    )


def intersect(s: Scene, tile_size: int = 16) -> tuple[Tensor, Tensor]:
    from gsplat import isect_offset_encode, isect_tiles

    c = s.means2d.shape[0]
    tw = math.ceil(s.width / tile_size)
    th = math.ceil(s.height / tile_size)
    _, isect_ids, flatten_ids = isect_tiles(s.means2d, s.radii, s.depths, tile_size, tw, th, packed=False, n_images=c)
    return isect_offset_encode(isect_ids, c, tw, th), flatten_ids


def input_leaves(s: Scene) -> dict[str, Tensor]:
    """The rasterizer's float inputs as fresh leaves that collect gradients."""
    return {k: getattr(s, k).clone().requires_grad_(True) for k in ("means2d", "conics", "colors", "opacities")}


def run_cuda(
    s: Scene,
    mode: str,
    absgrad: bool = False,
    threshold: int = 8,
    vector: bool | None = None,
    tuner=None,
    scatter: bool | None = None,
) -> dict[str, Tensor]:
    from gstrain.render.arc import ArcTuner
    from gstrain.render.cuda import rasterize_cuda

    offsets, flatten_ids = intersect(s)
    leaves = input_leaves(s)
    if s.background is not None:
        leaves["background"] = s.background.clone().requires_grad_(True)
    if mode == "arc" and tuner is None:
        tuner = ArcTuner()
    image, alpha = rasterize_cuda(
        leaves["means2d"], leaves["conics"], leaves["colors"], leaves["opacities"], s.width, s.height, 16,
        offsets, flatten_ids, backgrounds=leaves.get("background"), absgrad=absgrad, atomic_mode=mode,
        atomic_threshold=threshold, tuner=tuner, vector_atomics=vector, scatter_reduce=scatter,
    )  # fmt: skip
    ((image * s.w_image).sum() + (alpha * s.w_alpha).sum()).backward()
    out = {"image": image.detach(), "alpha": alpha.detach()}
    out.update({f"d_{k}": v.grad for k, v in leaves.items()})
    if absgrad:
        out["absgrad"] = leaves["means2d"].absgrad
    return out


def run_reference(s: Scene, absgrad: bool = False) -> dict[str, Tensor]:
    from gstrain.render.reference import rasterize

    c = s.means2d.shape[0]
    outs: list[dict[str, Tensor]] = []
    for i in range(c):
        leaves = {
            "means2d": s.means2d[i].double().clone().requires_grad_(True),
            "conics": s.conics[i].double().clone().requires_grad_(True),
            "colors": s.colors[i].double().clone().requires_grad_(True),
            "opacities": s.opacities[i].double().clone().requires_grad_(True),
        }
        if s.background is not None:
            leaves["background"] = s.background[i].double().clone().requires_grad_(True)
        image, alpha = rasterize(
            leaves["means2d"], leaves["conics"], leaves["colors"], leaves["opacities"], s.radii[i],
            s.depths[i].double(), s.width, s.height, background=leaves.get("background"), tile_size=16,
            absgrad=absgrad,
        )  # fmt: skip
        ((image * s.w_image[i].double()).sum() + (alpha * s.w_alpha[i].double()).sum()).backward()
        o = {"image": image.detach(), "alpha": alpha.detach()}
        o.update({f"d_{k}": v.grad for k, v in leaves.items()})
        if absgrad:
            o["absgrad"] = leaves["means2d"].absgrad
        outs.append(o)
    return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}


def compare(ours: dict[str, Tensor], ref: dict[str, Tensor], label: str) -> None:
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    for k in ref:
        tol = FWD_TOL if k in ("image", "alpha") else GRAD_TOL
        assert_close(f"{label} {k}", ours[k], ref[k], tol)
