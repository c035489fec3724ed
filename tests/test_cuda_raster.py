"""Our CUDA rasterizer against the float64 PyTorch reference, on gsplat-projected random scenes.

Every atomic mode (and both gradient layouts) must give the reference's image, alpha and
gradients within float32 tolerance; the modes must agree with each other; render_cuda must
match render_reference end to end and work under gsplat's DefaultStrategy. Timings are never
asserted here (bench/bench_raster.py measures them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

pytestmark = pytest.mark.cuda

MODES = ("atomic", "warp", "distwar", "arc")
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
    s: Scene, mode: str, absgrad: bool = False, threshold: int = 8, vector: bool | None = None, tuner=None,
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


# ---------------------------------------------------------------------------------------------
# scenes


def scene_random(seed: int = 0) -> Scene:
    return make_scene(300, 67, 45, seed)  # sizes not divisible by 16


def scene_background_1ch(seed: int = 1) -> Scene:
    return make_scene(250, 100, 31, seed, channels=1, background=True)


def scene_empty_tiles(seed: int = 2) -> Scene:
    # everything in the left third: most tiles have no Gaussian at all
    s = make_scene(150, 90, 70, seed, spread=0.25)
    s.means2d[..., 0] = s.means2d[..., 0] * 0.3
    return s


def scene_big_and_tiny(seed: int = 3) -> Scene:
    n_big = 1
    big = {
        "means": torch.tensor([[0.0, 0.0, 3.0]]),
        "scales": torch.full((n_big, 3), math.log(3.0)),
        "quats": torch.tensor([[1.0, 0.0, 0.0, 0.0]]),
    }
    gen = torch.Generator().manual_seed(seed + 100)
    tiny = random_gaussians(200, gen, 1.0, log_scale=(-9.0, -7.0))
    extra = {k: torch.cat([big[k], tiny[k]]) for k in big}
    return make_scene(100, 50, 40, seed, background=True, extra=extra)


def scene_saturated(seed: int = 4) -> Scene:
    # many opaque layers: pixels hit the 1e-4 transmittance stop; alphas come near the 0.999 cap
    # (test_matches_gsplat_rasterizer has an opaque scene where the cap bites)
    return make_scene(600, 40, 33, seed, opacity_range=(0.9, 1.0))


SCENES = {
    "random": scene_random,
    "bg_1ch": scene_background_1ch,
    "empty_tiles": scene_empty_tiles,
    "big_and_tiny": scene_big_and_tiny,
    "saturated": scene_saturated,
}

_ref_cache: dict[tuple[str, bool], dict[str, Tensor]] = {}


def reference_for(name: str, s: Scene, absgrad: bool) -> dict[str, Tensor]:
    key = (name, absgrad)
    if key not in _ref_cache:
        _ref_cache[key] = run_reference(s, absgrad)
    return _ref_cache[key]


# ---------------------------------------------------------------------------------------------
# rasterize_cuda vs reference


@pytest.mark.parametrize("absgrad", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(SCENES))
def test_modes_match_reference(name: str, mode: str, absgrad: bool) -> None:
    s = SCENES[name]()
    ours = run_cuda(s, mode, absgrad=absgrad)
    compare(ours, reference_for(name, s, absgrad), f"{name}/{mode}")


@pytest.mark.parametrize("scatter", [False, True], ids=["butterfly", "scatter"])
@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_layouts_match_reference(mode: str, vector: bool, scatter: bool) -> None:
    s = scene_random(seed=10)
    s.background = torch.rand(1, 3, device="cuda")
    ours = run_cuda(s, mode, absgrad=True, vector=vector, scatter=scatter)
    compare(ours, run_reference(s, absgrad=True), f"{mode}/vector={vector}/scatter={scatter}")


@pytest.mark.parametrize("channels", [2, 4, 5, 8, 40])
def test_channel_counts(channels: int) -> None:
    # 5 is padded to a compiled kernel, 40 is split into chunks of 32 + 8
    absgrad = channels <= 32
    s = make_scene(120, 35, 50, seed=20 + channels, channels=channels, background=True)
    compare(run_cuda(s, "distwar", absgrad=absgrad), run_reference(s, absgrad=absgrad), f"{channels}ch")


def test_absgrad_beyond_one_chunk_is_refused() -> None:
    # |dL/dmean2d| per pixel does not split over channel chunks: refused, not silently wrong
    s = make_scene(20, 20, 20, seed=25, channels=33)
    with pytest.raises(ValueError, match="absgrad"):
        run_cuda(s, "warp", absgrad=True)


def test_several_cameras() -> None:
    s = make_scene(200, 48, 37, seed=30, n_cams=3, background=True)
    compare(run_cuda(s, "arc", absgrad=True), run_reference(s, absgrad=True), "3 cameras")


def test_nothing_visible() -> None:
    s = make_scene(50, 40, 30, seed=31, background=True)
    s.radii.zero_()  # every Gaussian culled: no intersections
    ours = run_cuda(s, "distwar", absgrad=True)
    assert torch.equal(ours["alpha"], torch.zeros_like(ours["alpha"]))
    assert torch.allclose(ours["image"], s.background[:, None, None, :].expand_as(ours["image"]))
    for k in ("d_means2d", "d_conics", "d_colors", "d_opacities", "absgrad"):
        assert torch.count_nonzero(ours[k]) == 0, k
    compare(ours, run_reference(s, absgrad=True), "nothing visible")


def test_modes_and_thresholds_agree() -> None:
    s = make_scene(400, 80, 64, seed=40, background=True)
    base = run_cuda(s, "warp", absgrad=True, vector=False, scatter=False)
    variants = [("atomic", 8), ("arc", 8)] + [("distwar", t) for t in (1, 2, 4, 6, 8, 12, 16, 24, 32)]
    for vector in (False, True):
        for scatter in (False, True):
            for mode, t in variants:
                other = run_cuda(s, mode, absgrad=True, threshold=t, vector=vector, scatter=scatter)
                for k in base:
                    assert_close(f"{mode} T={t} vector={vector} scatter={scatter} {k}", other[k], base[k], 1e-5)


def test_forward_is_deterministic_and_writes_every_pixel() -> None:
    from gstrain.render.cuda import ensure_built

    s = make_scene(200, 53, 29, seed=50, channels=3, background=True)
    offsets, flatten_ids = intersect(s)
    ext = ensure_built()
    args = (
        s.means2d,
        s.conics,
        s.colors,
        s.opacities,
        s.background,
        s.width,
        s.height,
        16,
        offsets,
        flatten_ids,
        None,
    )
    a = ext.rasterize_fwd(*args)
    b = ext.rasterize_fwd(*args)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    image, alpha, t_final, last = a
    assert torch.isfinite(image).all() and torch.isfinite(alpha).all()
    assert torch.allclose(alpha[..., 0], 1 - t_final)
    assert int(last.max()) < flatten_ids.numel()


# ---------------------------------------------------------------------------------------------
# rasterize_cuda vs gsplat's rasterize_to_pixels: `--atomic-mode gsplat` is a speed switch, so
# the two must train the same model; opaque Gaussians (where the alpha cap bites) included


def run_gsplat(s: Scene) -> dict[str, Tensor]:
    from gsplat import rasterize_to_pixels

    offsets, flatten_ids = intersect(s)
    leaves = input_leaves(s)
    image, alpha = rasterize_to_pixels(
        leaves["means2d"], leaves["conics"], leaves["colors"], leaves["opacities"], s.width, s.height, 16,
        offsets, flatten_ids,
    )  # fmt: skip
    ((image * s.w_image).sum() + (alpha * s.w_alpha).sum()).backward()
    out = {"image": image.detach(), "alpha": alpha.detach()}
    out.update({f"d_{k}": v.grad for k, v in leaves.items()})
    return out


@pytest.mark.parametrize("opacity_range", [(0.05, 0.95), (0.99, 1.0)], ids=["translucent", "opaque"])
@pytest.mark.parametrize("mode", ["atomic", "arc"])
def test_matches_gsplat_rasterizer(mode: str, opacity_range: tuple[float, float]) -> None:
    s = make_scene(600, 40, 33, seed=60, opacity_range=opacity_range)
    compare(run_cuda(s, mode), run_gsplat(s), f"gsplat {opacity_range}/{mode}")


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


@pytest.mark.parametrize("mode", MODES)
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
