"""Our CUDA rasterizer against the float64 PyTorch reference, on gsplat-projected random scenes.

Every atomic mode (and both gradient layouts) must give the reference's image, alpha and
gradients within float32 tolerance; the modes must agree with each other and with gsplat's
rasterizer. render_cuda end to end is in test_cuda_render.py, the scenes in cuda_scenes.py.
Timings are never asserted here (bench/bench_raster.py measures them).
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_scenes import (
    Scene,
    assert_close,
    compare,
    input_leaves,
    intersect,
    make_scene,
    random_gaussians,
    run_cuda,
    run_reference,
)
from torch import Tensor

from gstrain.choices import ATOMIC_MODES

pytestmark = pytest.mark.cuda


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
@pytest.mark.parametrize("mode", ATOMIC_MODES)
@pytest.mark.parametrize("name", sorted(SCENES))
def test_modes_match_reference(name: str, mode: str, absgrad: bool) -> None:
    s = SCENES[name]()
    ours = run_cuda(s, mode, absgrad=absgrad)
    compare(ours, reference_for(name, s, absgrad), f"{name}/{mode}")


@pytest.mark.parametrize("scatter", [False, True], ids=["butterfly", "scatter"])
@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("mode", ATOMIC_MODES)
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
    from gstrain import extensions

    s = make_scene(200, 53, 29, seed=50, channels=3, background=True)
    offsets, flatten_ids = intersect(s)
    ext = extensions.raster()
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
