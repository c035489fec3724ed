"""Ellipse culling of (Gaussian, tile) pairs (gstrain/render/cull.py, dev.ellipse_cull).

The pair lists here are built by an independent loop over CONVENTIONS' tile rule (gsplat's
isect_tiles is CUDA only); every dropped pair is checked by brute force over its tile's pixel
centres in float64, and the rebuilt offsets against a per-tile filter of the original lists.
The `cuda` tests at the end render through our kernels with the switch on and off, and check
our culled intersection kernel (gstrain/render/isect.py) pair for pair against gsplat's
isect_tiles followed by cull_pairs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gstrain.choices import ATOMIC_MODES
from gstrain.render.alpha_bound import min_sigma_on_rect
from gstrain.render.cull import cull_pairs, keep_mask, pair_tiles

TILE = 16


def random_splats(n: int, seed: int, width: int, height: int, cams: int = 1, max_log_scale: float = 3.5,
                  opacity: tuple[float, float] = (0.002, 1.0)) -> dict[str, Tensor]:  # fmt: skip
    """Projected Gaussians as gsplat gives them: conic = inverse(R S^2 R^T + 0.3 I), radius per
    axis ceil(3.33 sigma), depths, opacities; float32 [C, N, ...]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (cams, n)
    means = torch.rand(*shape, 2, generator=gen, dtype=torch.float64)
    means = means * torch.tensor([width + 40.0, height + 40.0], dtype=torch.float64) - 20.0
    s = torch.exp(torch.empty(*shape, 2, dtype=torch.float64).uniform_(-1.0, max_log_scale, generator=gen))
    th = torch.rand(*shape, generator=gen, dtype=torch.float64) * math.pi
    rot = torch.stack([torch.cos(th), -torch.sin(th), torch.sin(th), torch.cos(th)], -1).reshape(*shape, 2, 2)
    cov = rot @ torch.diag_embed(s * s) @ rot.transpose(-1, -2) + 0.3 * torch.eye(2, dtype=torch.float64)
    inv = torch.linalg.inv(cov)
    conics = torch.stack([inv[..., 0, 0], inv[..., 0, 1], inv[..., 1, 1]], -1)
    radii = torch.ceil(3.33 * torch.sqrt(torch.diagonal(cov, dim1=-2, dim2=-1))).int()
    lo, hi = opacity
    return {
        "means2d": means.float(),
        "conics": conics.float(),
        "opacities": (lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)).float(),
        "radii": radii,
        "depths": (1 + torch.rand(*shape, generator=gen)).float(),
    }


def bbox_pairs(sp: dict[str, Tensor], width: int, height: int) -> tuple[Tensor, Tensor, list[list[int]]]:
    """isect_offsets [C,th,tw], flatten_ids [M] and each flat tile's list, by the bounding-box rule:
    floor((mean - r)/16) <= t < ceil((mean + r)/16) on each axis, clamped; depth order per tile."""
    cams, n = sp["depths"].shape
    tw, th = math.ceil(width / TILE), math.ceil(height / TILE)
    lists: list[list[int]] = [[] for _ in range(cams * th * tw)]
    for c in range(cams):
        for g in sorted(range(n), key=lambda i: (float(sp["depths"][c, i]), i)):
            mx, my = (float(v) for v in sp["means2d"][c, g])
            rx, ry = (int(v) for v in sp["radii"][c, g])
            x0, x1 = max(math.floor((mx - rx) / TILE), 0), min(math.ceil((mx + rx) / TILE), tw)
            y0, y1 = max(math.floor((my - ry) / TILE), 0), min(math.ceil((my + ry) / TILE), th)
            for ty in range(y0, y1):
                for tx in range(x0, x1):
                    lists[(c * th + ty) * tw + tx].append(c * n + g)
    offsets, start = [], 0
    for ids in lists:
        offsets.append(start)
        start += len(ids)
    flat = torch.tensor([g for ids in lists for g in ids], dtype=torch.int32)
    return torch.tensor(offsets, dtype=torch.int32).reshape(cams, th, tw), flat, lists


def tile_max_alpha(sp: dict[str, Tensor], flat_tile: int, gid: int, width: int, height: int,
                   dtype: torch.dtype = torch.float64) -> float:  # fmt: skip
    """Brute force: the largest opacity * exp(-sigma) over the tile's pixel centres inside the
    image (sigma < 0 is skipped by the rasterizer, as is alpha < 1/255); float32 as the kernels."""
    cams, n = sp["depths"].shape
    tw, th = math.ceil(width / TILE), math.ceil(height / TILE)
    t = flat_tile % (th * tw)
    tx, ty = t % tw, t // tw
    xs = torch.arange(tx * TILE, min(tx * TILE + TILE, width), dtype=dtype) + 0.5
    ys = torch.arange(ty * TILE, min(ty * TILE + TILE, height), dtype=dtype) + 0.5
    mean = sp["means2d"].reshape(-1, 2)[gid].to(dtype)
    a, b, c = sp["conics"].reshape(-1, 3)[gid].to(dtype)
    dx = mean[0] - xs[None, :]
    dy = mean[1] - ys[:, None]
    sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
    alpha = sp["opacities"].reshape(-1)[gid].to(dtype) * torch.exp(-sigma)
    return float(torch.where(sigma >= 0, alpha, torch.zeros_like(alpha)).max())


def run_cull(sp: dict[str, Tensor], width: int, height: int):
    offsets, flat, lists = bbox_pairs(sp, width, height)
    out = cull_pairs(sp["means2d"], sp["conics"], sp["opacities"], offsets, flat, width, height, TILE)
    return offsets, flat, lists, out


def kept_lists(offsets: Tensor, flat: Tensor) -> list[list[int]]:
    starts = offsets.reshape(-1).tolist() + [flat.numel()]
    ids = flat.tolist()
    return [ids[starts[t]:starts[t + 1]] for t in range(len(starts) - 1)]


@pytest.mark.parametrize(("seed", "width", "height", "cams"), [(0, 70, 45, 1), (1, 64, 48, 2), (2, 33, 97, 1)])
def test_every_dropped_pair_is_below_the_cutoff_on_its_whole_tile(seed: int, width: int, height: int,
                                                                  cams: int) -> None:  # fmt: skip
    sp = random_splats(120, seed, width, height, cams)
    _, _, lists, out = run_cull(sp, width, height)
    after = kept_lists(out.isect_offsets, out.flatten_ids)
    dropped = kept = 0
    for t, (before, now) in enumerate(zip(lists, after, strict=True)):
        now_set = set(now)
        for g in before:
            if g in now_set:
                kept += 1
                continue
            dropped += 1
            alpha = tile_max_alpha(sp, t, g, width, height)
            assert alpha < 1.0 / 255.0, (t, g, alpha)
            alpha32 = tile_max_alpha(sp, t, g, width, height, torch.float32)
            assert alpha32 < torch.tensor(1.0 / 255.0, dtype=torch.float32).item(), (t, g, alpha32)
    assert dropped > 0 and kept > 0, (dropped, kept)
    print(f"seed {seed}: {out.pairs_before} pairs -> {out.pairs_after}")


def test_the_kept_lists_are_each_tiles_list_filtered_in_order() -> None:
    width, height = 70, 45
    sp = random_splats(150, 3, width, height, cams=2)
    offsets, flat, lists, out = run_cull(sp, width, height)
    assert out.isect_offsets.shape == offsets.shape and out.isect_offsets.dtype == offsets.dtype
    assert out.flatten_ids.dtype == flat.dtype
    tiles = pair_tiles(offsets, flat.numel())
    expected_tiles = torch.tensor([t for t, ids in enumerate(lists) for _ in ids])
    assert torch.equal(tiles, expected_tiles)
    keep = keep_mask(tiles, flat, sp["means2d"], sp["conics"], sp["opacities"], width, height, TILE)
    flags = iter(keep.tolist())
    expected = [[g for g in ids if next(flags)] for ids in lists]
    assert kept_lists(out.isect_offsets, out.flatten_ids) == expected
    assert (out.pairs_before, out.pairs_after) == (flat.numel(), sum(map(len, expected)))


def test_gsplat_intersection_layout() -> None:
    """gsplat's own PyTorch isect_tiles / isect_offset_encode (its CUDA ones follow them) give
    the same lists as the rule above, and pair_tiles reads each pair's tile from the offsets."""
    from gsplat.cuda._torch_impl import _isect_offset_encode, _isect_tiles

    width, height = 70, 45
    sp = random_splats(40, 8, width, height, cams=2)
    tw, th = math.ceil(width / TILE), math.ceil(height / TILE)
    _, isect_ids, flat = _isect_tiles(sp["means2d"], sp["radii"], sp["depths"], TILE, tw, th)
    offsets = _isect_offset_encode(isect_ids, 2, tw, th)
    ours_offsets, ours_flat, _ = bbox_pairs(sp, width, height)
    assert torch.equal(flat, ours_flat) and torch.equal(offsets, ours_offsets)
    tile_bits = (tw * th).bit_length()
    hi = isect_ids >> 32
    assert torch.equal(pair_tiles(offsets, flat.numel()), (hi >> tile_bits) * (tw * th) + (hi & ((1 << tile_bits) - 1)))
    out = cull_pairs(sp["means2d"], sp["conics"], sp["opacities"], offsets, flat, width, height, TILE)
    assert out.pairs_after < out.pairs_before


def test_thin_tilted_and_faint_gaussians_lose_pairs() -> None:
    width, height = 160, 160
    # a 45-degree needle through the centre: its box covers all 100 tiles, its ellipse about a diagonal
    cov = torch.tensor([[900.0, 899.0], [899.0, 900.0]], dtype=torch.float64) + 0.3 * torch.eye(2, dtype=torch.float64)
    inv = torch.linalg.inv(cov)
    needle = {
        "means2d": torch.tensor([[[80.0, 80.0]]]),
        "conics": torch.tensor([[[inv[0, 0], inv[0, 1], inv[1, 1]]]]).float(),
        "opacities": torch.tensor([[0.9]]),
        "radii": torch.ceil(3.33 * cov.diagonal().sqrt()).int().reshape(1, 1, 2),
        "depths": torch.tensor([[1.0]]),
    }
    _, _, lists, out = run_cull(needle, width, height)
    assert out.pairs_before == 100
    assert 10 <= out.pairs_after <= 40, out.pairs_after  # the diagonal and its neighbours
    assert set(kept_lists(out.isect_offsets, out.flatten_ids)[0]) == {0}  # the corner tile it crosses

    faint = random_splats(200, 4, 96, 64, opacity=(0.004, 0.05))
    _, _, _, out = run_cull(faint, 96, 64)
    assert out.pairs_after < 0.6 * out.pairs_before, (out.pairs_before, out.pairs_after)


def test_zero_opacity_drops_everything_and_a_bad_conic_keeps_everything() -> None:
    width, height = 48, 48
    sp = random_splats(20, 5, width, height)
    sp["opacities"][0, :10] = 0.0
    sp["conics"][0, 10:15] = torch.tensor([1.0, 2.0, 1.0])  # not positive definite
    sp["conics"][0, 15:20, 1] = float("nan")
    offsets, flat, lists, out = run_cull(sp, width, height)
    kept = {g for ids in kept_lists(out.isect_offsets, out.flatten_ids) for g in ids}
    assert not kept & set(range(10))
    for g in range(10, 20):
        before = sum(ids.count(g) for ids in lists)
        after = sum(ids.count(g) for ids in kept_lists(out.isect_offsets, out.flatten_ids))
        assert before == after, g


def test_no_pairs() -> None:
    sp = random_splats(3, 6, 32, 32)
    offsets = torch.zeros(1, 2, 2, dtype=torch.int32)
    out = cull_pairs(sp["means2d"], sp["conics"], sp["opacities"], offsets, torch.zeros(0, dtype=torch.int32),
                     32, 32, TILE)  # fmt: skip
    assert out.flatten_ids.numel() == 0 and (out.pairs_before, out.pairs_after) == (0, 0)


def test_min_sigma_on_rect_is_a_tight_lower_bound() -> None:
    """Against a dense grid over the rectangle, in float64: never above the grid's minimum (a
    higher value could drop a pair that contributes), and not far below it."""
    gen = torch.Generator().manual_seed(7)
    n = 400
    lo = torch.empty(n, 2, dtype=torch.float64).uniform_(-30, 20, generator=gen)
    hi = lo + torch.empty(n, 2, dtype=torch.float64).uniform_(0, 15, generator=gen)
    s = torch.exp(torch.empty(n, 2, dtype=torch.float64).uniform_(-1, 3, generator=gen))
    th = torch.rand(n, generator=gen, dtype=torch.float64) * math.pi
    rot = torch.stack([torch.cos(th), -torch.sin(th), torch.sin(th), torch.cos(th)], -1).reshape(n, 2, 2)
    inv = torch.linalg.inv(rot @ torch.diag_embed(s * s) @ rot.transpose(-1, -2) + 0.3 * torch.eye(2).double())
    conics = torch.stack([inv[:, 0, 0], inv[:, 0, 1], inv[:, 1, 1]], -1)
    got = min_sigma_on_rect(lo, hi, conics)
    k = 301
    f = torch.linspace(0, 1, k, dtype=torch.float64)
    grid = torch.empty(n, dtype=torch.float64)
    for rows in torch.arange(n).split(25):  # [25, k, k] at a time: a few MiB, not 1.5 GiB of temporaries
        ux = lo[rows, 0:1, None] + (hi - lo)[rows, 0:1, None] * f[None, None, :]  # [r,1,k]
        uy = lo[rows, 1:2, None] + (hi - lo)[rows, 1:2, None] * f[None, :, None]  # [r,k,1]
        a, b, c = (v[:, None, None] for v in conics[rows].unbind(-1))
        grid[rows] = (0.5 * (a * ux * ux + c * uy * uy) + b * ux * uy).flatten(1).amin(1)
    assert (got <= grid + 1e-9).all()
    assert (grid - got <= 0.02 * (1 + grid)).all(), float((grid - got).max())


def test_the_switch_is_on_by_default_and_reaches_the_renderer() -> None:
    from gstrain.config import build_config
    from gstrain.errors import UserError
    from gstrain.render import Renderer

    assert build_config().dev.ellipse_cull is True
    cfg = build_config(overrides=[{"dev": {"ellipse_cull": False}}])
    assert Renderer(cfg.render, torch.device("cpu"), dev=cfg.dev).options.ellipse_cull is False
    assert Renderer(build_config().render, torch.device("cpu")).options.ellipse_cull is True
    with pytest.raises(UserError, match="dev.ellipse_cull"):
        build_config(overrides=[{"dev": {"ellipse_cull": "yes"}}])


# ---------------------------------------------------------------------------------------------
# on the GPU: our kernels with and without the cull, and the reference renderer


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [*ATOMIC_MODES, "gsplat"])
def test_render_cuda_with_and_without_cull(mode: str) -> None:
    """Our kernels in every atomic mode (and gsplat's rasterizer) give the same image and
    gradients with the cull as without it, and the reference's; pytest -s prints the pair counts."""
    from gstrain.render.common import RasterOptions
    from gstrain.render.cuda import render_cuda
    from gstrain.render.reference import render_reference

    width, height = 93, 77
    n = 600
    gen = torch.Generator().manual_seed(11)
    z = 2.0 + 4.0 * torch.rand(n, generator=gen)
    xy = (torch.rand(n, 2, generator=gen) * 2 - 1) * 0.5 * z[:, None]
    raw = {
        "means": torch.cat([xy, z[:, None]], 1),
        # anisotropic: one axis much longer, so the bounding boxes hold many empty tiles
        "scales": torch.stack([torch.full((n,), -1.8), torch.full((n,), -4.0), torch.full((n,), -4.0)], 1)
        + 0.5 * torch.randn(n, 3, generator=gen),
        "quats": torch.randn(n, 4, generator=gen),
        "opacities": torch.logit(0.01 + 0.9 * torch.rand(n, generator=gen)),
        "sh0": 0.5 * torch.randn(n, 1, 3, generator=gen),
        "shN": 0.2 * torch.randn(n, 15, 3, generator=gen),
    }
    f = 0.9 * max(width, height)
    viewmat = torch.eye(4)
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]])
    bg = torch.tensor([0.2, 0.5, 0.9])
    w_img = torch.randn(height, width, 3, generator=gen)
    w_a = torch.randn(height, width, 1, generator=gen)

    def run(dtype: torch.dtype, fn, **kw):
        p = {k: v.to("cuda", dtype).detach().clone().requires_grad_(True) for k, v in raw.items()}
        image, alpha, info = fn(p, viewmat.cuda().to(dtype), K.cuda().to(dtype), width, height, 3,
                                bg.cuda().to(dtype), **kw)  # fmt: skip
        ((image * w_img.cuda().to(dtype)).sum() + (alpha * w_a.cuda().to(dtype)).sum()).backward()
        out = {"image": image.detach(), "alpha": alpha.detach()}
        out.update({f"d_{k}": v.grad for k, v in p.items()})
        return out, info

    kind = {"gsplat_raster": True} if mode == "gsplat" else {"atomic_mode": mode}
    off, info_off = run(torch.float32, render_cuda, options=RasterOptions(**kind))
    on, info_on = run(torch.float32, render_cuda, options=RasterOptions(**kind, ellipse_cull=True))
    ref, _ = run(torch.float64, render_reference)
    before, after = info_on["isect_pairs"]
    print(f"{mode}: pairs {before} -> {after} ({after / max(before, 1):.1%})")
    assert info_off["isect_pairs"] == (before, before) and after < 0.9 * before
    for k in off:
        a, b = on[k].double().cpu(), off[k].double().cpu()
        err = (a - b).norm().item() / max(b.norm().item(), 1e-12)
        if k in ("image", "alpha"):
            assert (a - b).abs().max().item() < 1e-5, k  # culled pairs are skipped at every pixel anyway
        else:
            assert err < 1e-4, (k, err)  # only the order of float atomics may differ
        r = ref[k].double().cpu()
        err_ref = (a - r).norm().item() / max(r.norm().item(), 1e-12)
        err_off = (b - r).norm().item() / max(r.norm().item(), 1e-12)  # says whether the scene or the cull
        assert err_ref < (1e-4 if k in ("image", "alpha") else 2e-3), (k, err_ref, "without cull", err_off)



# ---------------------------------------------------------------------------------------------
# on the GPU: our culled intersection kernel (gstrain/render/isect.py) against gsplat's
# isect_tiles followed by the PyTorch cull_pairs, pair for pair


def kernel_and_oracle(sp: dict[str, Tensor], width: int, height: int):
    from gsplat import isect_offset_encode, isect_tiles

    from gstrain import extensions
    from gstrain.render.isect import culled_intersection

    g = {k: v.cuda() for k, v in sp.items()}
    cams = g["depths"].shape[0]
    tw, th = math.ceil(width / TILE), math.ceil(height / TILE)
    _, isect_ids, flat = isect_tiles(g["means2d"], g["radii"], g["depths"], TILE, tw, th, n_images=cams)
    offsets = isect_offset_encode(isect_ids, cams, tw, th)
    oracle = cull_pairs(g["means2d"], g["conics"], g["opacities"], offsets, flat, width, height, TILE)
    ours = culled_intersection(extensions.raster(), g["means2d"], g["radii"], g["depths"], g["conics"], g["opacities"],
                               width, height, TILE)  # fmt: skip
    return ours, oracle, flat.numel()


def assert_same_pairs(ours, oracle, bbox_pairs_count: int) -> None:
    assert ours.isect_offsets.dtype == torch.int32 and ours.flatten_ids.dtype == torch.int32
    assert ours.isect_offsets.shape == oracle.isect_offsets.shape
    assert torch.equal(ours.isect_offsets, oracle.isect_offsets)
    assert torch.equal(ours.flatten_ids, oracle.flatten_ids)
    assert (ours.pairs_before, ours.pairs_after) == (bbox_pairs_count, oracle.pairs_after)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("n", "seed", "width", "height", "cams", "tied_depths"),
    [(300, 20, 93, 77, 1, False), (2000, 21, 250, 170, 2, False), (3000, 22, 333, 215, 2, True),
     (30000, 23, 1001, 601, 1, False), (20000, 24, 517, 389, 1, True)],
)  # fmt: skip
def test_kernel_intersection_equals_isect_tiles_then_cull(n: int, seed: int, width: int, height: int, cams: int,
                                                          tied_depths: bool) -> None:  # fmt: skip
    """Beer-like random splats (sizes not multiples of 16, means up to 20 px off screen, boxes
    past the edges): the same tiles' lists, in the same order, as isect_tiles + cull_pairs. Tied
    depths check the sort is stable (equal keys keep Gaussian order, as gsplat's radix sort)."""
    sp = random_splats(n, seed, width, height, cams)
    if tied_depths:
        sp["depths"] = (sp["depths"] * 4).round() / 4  # 5 distinct depths
    ours, oracle, before = kernel_and_oracle(sp, width, height)
    assert 0 < oracle.pairs_after < before
    assert_same_pairs(ours, oracle, before)
    print(f"n={n} {width}x{height} C={cams}: pairs {before} -> {ours.pairs_after}")


@pytest.mark.cuda
def test_kernel_intersection_edge_cases() -> None:
    """Zero radii (no tiles), zero opacity (all culled), conics that are not positive definite or
    NaN (all kept), negative depths (their bits sort last, as gsplat's), a NaN opacity (kept);
    then no pairs at all."""
    width, height = 75, 50
    sp = random_splats(200, 25, width, height, cams=2)
    sp["radii"][0, :20] = 0
    sp["radii"][1, 20:30, 1] = 0
    sp["opacities"][:, 30:50] = 0.0
    sp["conics"][:, 50:60] = torch.tensor([1.0, 2.0, 1.0])
    sp["conics"][:, 60:70, 1] = float("nan")
    sp["opacities"][:, 70:80] = float("nan")
    sp["depths"][:, 80:100] *= -1
    ours, oracle, before = kernel_and_oracle(sp, width, height)
    assert_same_pairs(ours, oracle, before)
    kept = set(ours.flatten_ids.tolist())
    assert not kept & set(range(20)) and not kept & {200 + g for g in range(20, 30)}
    assert not kept & ({g for g in range(30, 50)} | {200 + g for g in range(30, 50)})

    sp["radii"].zero_()
    ours, oracle, before = kernel_and_oracle(sp, width, height)
    assert before == 0 and ours.flatten_ids.numel() == 0 and ours.pairs_after == 0
    assert torch.equal(ours.isect_offsets, torch.zeros_like(ours.isect_offsets))


@pytest.mark.cuda
def test_project_splats_kernel_and_pytorch_cull_agree() -> None:
    """Through gsplat's projection of a 3D scene: project_splats' kernel cull (the default with
    ellipse_cull) and its PyTorch one give the same pairs, and the same counts as no cull."""
    from gstrain.render.cuda import project_splats

    width, height = 211, 133
    n = 4000
    gen = torch.Generator().manual_seed(26)
    z = 2.0 + 6.0 * torch.rand(n, generator=gen)
    xy = (torch.rand(n, 2, generator=gen) * 2 - 1) * 0.8 * z[:, None]  # some project off screen
    params = {
        "means": torch.cat([xy, z[:, None]], 1).cuda(),
        "scales": (torch.tensor([-2.0, -4.0, -4.0]) + 0.7 * torch.randn(n, 3, generator=gen)).cuda(),
        "quats": torch.randn(n, 4, generator=gen).cuda(),
        "opacities": torch.logit(0.005 + 0.9 * torch.rand(n, generator=gen)).cuda(),
    }
    f = 0.9 * width
    viewmat = torch.eye(4).cuda()
    K = torch.tensor([[f, 0.0, width / 2], [0.0, f, height / 2], [0.0, 0.0, 1.0]]).cuda()
    with torch.no_grad():
        off = project_splats(params, viewmat, K, width, height)
        ours = project_splats(params, viewmat, K, width, height, ellipse_cull=True)
        oracle = project_splats(params, viewmat, K, width, height, ellipse_cull=True, cull_kernel=False)
    assert torch.equal(ours.isect_offsets, oracle.isect_offsets)
    assert torch.equal(ours.flatten_ids, oracle.flatten_ids)
    assert ours.pairs == oracle.pairs and ours.pairs[0] == off.flatten_ids.numel() > ours.pairs[1] > 0
