"""The reference renderer's rasterizer against the per-pixel oracle (reference_oracle.py) and
central differences (torch.autograd.gradcheck, float64): images, stop/skip/cap rules, segments,
and gradients.
"""

from __future__ import annotations

import pytest
import torch
from reference_oracle import (
    F64,
    brute_rasterize,
    closest,
    projected,
    run,
    safe_scene_2d,
    scene_2d,
    single_thread,  # noqa: F401 (autouse: these renders run on one thread)
)
from torch import Tensor

from gstrain.render import reference as ref
from gstrain.render.reference import rasterize

# ---------------------------------------------------------------------------------------------
# rasterize against the per-pixel loop


@pytest.mark.parametrize(
    ("width", "height", "n", "seed"), [(37, 29, 40, 0), (17, 33, 25, 1), (50, 19, 60, 2), (5, 3, 6, 3)]
)
def test_rasterize_matches_brute_force(width: int, height: int, n: int, seed: int) -> None:
    m, con, col, op, radii, dep = scene_2d(n, width, height, seed)
    bg = torch.tensor([0.2, 0.5, 0.9], dtype=F64)
    want = brute_rasterize(m, con, col, op, radii, dep, width, height, bg)
    # neither sub-tile culling nor composing in segments may change a single pixel
    for cell, segment in ((16, 32), (8, 32), (4, 32), (8, 3), (16, 1)):
        got = run(ref._rasterize, m, con, col, op, radii, dep, width, height, bg, cell=cell, segment=segment)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def dense_scene() -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor]]:
    # many opaque Gaussians: half the pixels stop, at different places within a cell's list
    w, h = 31, 22
    m, con, col, op, radii, dep = scene_2d(300, w, h, 11, max_std=4.0)
    op = 0.5 + 0.5 * op  # up to 0.975
    op[::9] = 0.9995  # capped where the mean sits on a pixel centre (sigma < 5e-4 there)
    m[::9] = torch.floor(m[::9]) + 0.5
    margins: dict[str, float] = {}
    want = brute_rasterize(m, con, col, op, radii, dep, w, h, margins=margins)
    assert margins["n_stop"] > w * h // 3 and margins["n_cap"] > 0
    return (m, con, col, op, radii, dep), want


@pytest.mark.parametrize("segment", [32, 3, 1])
def test_dense_scene_matches_brute_force(dense_scene, segment: int) -> None:
    (m, con, col, op, radii, dep), want = dense_scene
    got = run(ref._rasterize, m, con, col, op, radii, dep, 31, 22, segment=segment)
    for g, wnt in zip(got, want, strict=True):
        torch.testing.assert_close(g, wnt, atol=1e-6, rtol=0)


def test_second_backward_after_another_render() -> None:
    # retain_graph: the 2nd backward must not read intermediates another render has overwritten
    w, h = 29, 21
    sc = scene_2d(80, w, h, 4)
    leaves = [t.clone().requires_grad_(True) for t in sc[:4]]
    image, alpha = rasterize(*leaves, sc[4], sc[5], w, h)
    loss = image.sum() + alpha.sum()
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    other = scene_2d(80, w, h, 5)
    o_leaves = [t.clone().requires_grad_(True) for t in other[:4]]
    o_image, _ = rasterize(*o_leaves, other[4], other[5], w, h)  # reuses the freed buffers
    second = torch.autograd.grad(loss, leaves)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    o_image.sum().backward()


def test_stop_rule_skip_rule_and_cap() -> None:
    # five opaque Gaussians stacked on one pixel: T = 0.05^k crosses 1e-4 at the third (stop,
    # not composited); a faint one (alpha < 1/255) in front is skipped without touching T
    n = 6
    m = torch.full((n, 2), 10.5, dtype=F64)
    con = torch.tensor([[0.02, 0.0, 0.02]] * n, dtype=F64)
    op = torch.tensor([0.003, 0.95, 0.95, 0.95, 0.95, 0.9999], dtype=F64)
    col = torch.eye(3, dtype=F64).repeat(2, 1)
    radii = torch.full((n, 2), 24, dtype=torch.int32)
    dep = torch.arange(1, n + 1, dtype=F64)
    image, alpha = run(rasterize, m, con, col, op, radii, dep, 21, 20)
    want = brute_rasterize(m, con, col, op, radii, dep, 21, 20)
    torch.testing.assert_close(image, want[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha, want[1], atol=1e-12, rtol=0)
    # at the centre (sigma = 0): the faint red one is skipped; the 0.95 ones (green, blue, red)
    # leave T = 0.05, 0.0025, 1.25e-4; the 4th would take T below 1e-4, so the pixel stops
    want_centre = torch.tensor([0.95 * 0.05**2, 0.95, 0.95 * 0.05], dtype=F64)
    torch.testing.assert_close(image[10, 10], want_centre, atol=1e-12, rtol=0)
    torch.testing.assert_close(alpha[10, 10, 0], torch.tensor(1 - 0.05**3, dtype=F64))
    # opacity 0.9999 is capped at gsplat's 0.999 in front of everything
    image2, alpha2 = run(rasterize, m[5:], con[5:], col[5:], op[5:], radii[5:], dep[5:], 21, 20)
    torch.testing.assert_close(alpha2[10, 10, 0], torch.tensor(0.999, dtype=F64))


@pytest.mark.parametrize(
    ("dtype", "ops"),
    [(F64, (0.928, 0.863, 0.9898621248986212)), (torch.float32, (0.942, 0.947, 0.9674690961837769))],
)
def test_exact_thresholds_are_inclusive(dtype: torch.dtype, ops: tuple[float, ...]) -> None:
    # on a pixel centre sigma = 0 and alpha = opacity: these three leave T == 1e-4 exactly in
    # dtype, which does not stop the pixel (the stop is T < 1e-4); a 4th behind them does. An
    # opacity of exactly 1/255 is composited (the skip is alpha < 1/255).
    m = torch.tensor([[10.5, 8.5]] * 4 + [[3.5, 3.5]], dtype=dtype)
    con = torch.tensor([[1.0, 0.0, 1.0]] * 5, dtype=dtype)
    op = torch.tensor([*ops, 0.5, 1.0 / 255.0], dtype=dtype)
    col = torch.tensor([[1.0], [1.0], [1.0], [100.0], [1.0]], dtype=dtype)
    radii = torch.full((5, 2), 4, dtype=torch.int32)
    dep = torch.arange(1.0, 6.0, dtype=dtype)
    image, alpha = run(rasterize, m, con, col, op, radii, dep, 20, 18)
    t = torch.ones((), dtype=dtype)
    for o in ops:
        t = t * (1 - torch.tensor(o, dtype=dtype))
    assert t == torch.tensor(1e-4, dtype=dtype)  # the premise
    assert alpha[8, 10, 0] == 1 - t and image[8, 10, 0] < 1.0  # the 4th (colour 100) is not reached
    assert image[3, 3, 0] == torch.tensor(1.0 / 255.0, dtype=dtype)
    if dtype == F64:  # (the float32 premise does not hold in the float64 loop)
        want = brute_rasterize(m, con, col, op, radii, dep, 20, 18)
        torch.testing.assert_close(image, want[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("channels", [1, 3, 5])
def test_channels_and_float32(channels: int) -> None:
    w, h = 41, 23
    m, con, col, op, radii, dep = scene_2d(50, w, h, 7, channels=channels)
    want = brute_rasterize(m, con, col, op, radii, dep, w, h)
    got64 = run(rasterize, m, con, col, op, radii, dep, w, h)
    f32 = [t.float() for t in (m, con, col, op)]
    got32 = run(rasterize, *f32, radii, dep.float(), w, h)
    assert got32[0].dtype == torch.float32 and got32[0].shape == (h, w, channels)
    for g64, g32, wnt in zip(got64, got32, want, strict=True):
        torch.testing.assert_close(g64, wnt, atol=1e-6, rtol=0)
        torch.testing.assert_close(g32.double(), wnt, atol=1e-5, rtol=0)


def test_edge_cases() -> None:
    w, h = 23, 18
    bg = torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    # no Gaussians at all
    empty = [torch.zeros(0, k, dtype=F64) for k in (2, 3, 3)]
    leaves = [t.requires_grad_(True) for t in (*empty, torch.zeros(0, dtype=F64))]
    image, alpha = rasterize(*leaves, torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=F64), w, h, bg)
    assert torch.equal(image, bg.expand(h, w, 3)) and torch.equal(alpha, torch.zeros(h, w, 1, dtype=F64))
    (image.sum() + alpha.sum()).backward()
    assert leaves[0].grad is not None and leaves[0].grad.shape == (0, 2)

    # everything culled (radii 0): background only, zero gradients
    m, con, col, op, radii, dep = scene_2d(10, w, h, 0)
    leaves = [t.clone().requires_grad_(True) for t in (m, con, col, op)]
    image, alpha = rasterize(*leaves, torch.zeros_like(radii), dep, w, h, bg)
    assert torch.equal(image, bg.expand(h, w, 3)) and not alpha.any()
    (image.sum() + alpha.sum()).backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t)) for t in leaves)

    # one Gaussian covering the whole image, and tiny ones (cov2d = eps2d only)
    big = torch.tensor([[w / 2, h / 2]], dtype=F64), torch.tensor([[1e-3, 0.0, 1e-3]], dtype=F64)
    tiny_m = torch.rand(20, 2, dtype=F64) * torch.tensor([w, h], dtype=F64)
    tiny_c = torch.tensor([[1 / 0.3, 0.0, 1 / 0.3]] * 20, dtype=F64)
    m = torch.cat([big[0], tiny_m])
    con = torch.cat([big[1], tiny_c])
    radii = torch.cat([torch.tensor([[200, 200]]), torch.full((20, 2), 2)]).to(torch.int32)
    col = torch.rand(21, 3, dtype=F64)
    op = torch.rand(21, dtype=F64) * 0.9 + 0.05
    dep = torch.rand(21, dtype=F64) + 1
    got = run(rasterize, m, con, col, op, radii, dep, w, h, bg)
    want = brute_rasterize(m, con, col, op, radii, dep, w, h, bg)
    for g, wnt in zip(got, want, strict=True):
        torch.testing.assert_close(g, wnt, atol=1e-6, rtol=0)
    assert (got[1] > 0).all()  # the big one reaches every pixel

    with pytest.raises(ValueError, match="conics"):
        rasterize(m, con[:, :2], col, op, radii, dep, w, h)


def test_hand_written_backward_matches_autograd() -> None:
    # the fast path's backward is written by hand; the same compositing under autograd checks it
    w, h = 45, 38
    for dtype, tol in ((F64, 1e-10), (torch.float32, 1e-4)):
        sc = scene_2d(150, w, h, 3, dtype=dtype)
        sc[3][::7] = 0.9995  # capped at 0.999 where the mean sits on a pixel centre
        sc[0][::7] = torch.floor(sc[0][::7]) + 0.5
        bg = torch.tensor([0.3, 0.6, 0.1], dtype=dtype)
        g = torch.Generator().manual_seed(0)
        w_img = torch.randn(h, w, 3, generator=g, dtype=dtype)
        w_a = torch.randn(h, w, 1, generator=g, dtype=dtype)
        results = []
        for use_autograd, segment in ((True, 0), (False, 32), (False, 5)):
            leaves = [t.clone().requires_grad_(True) for t in (*sc[:4], bg)]
            image, alpha = ref._rasterize(
                *leaves[:4], sc[4], sc[5], w, h, leaves[4], use_autograd=use_autograd, chunk_elems=1 << 12,
                segment=segment or 32,
            )  # fmt: skip
            ((image * w_img).sum() + (alpha * w_a).sum()).backward()
            results.append([image, alpha] + [t.grad for t in leaves])
        for fast in results[1:]:
            for a, b in zip(fast, results[0], strict=True):
                scale = b.abs().max().clamp_min(1.0)
                torch.testing.assert_close(a / scale, b / scale, atol=tol, rtol=0)


# ---------------------------------------------------------------------------------------------
# gradients against finite differences (float64)


def test_rasterize_gradcheck() -> None:
    w, h = 24, 20
    m, con, col, op, radii, dep = safe_scene_2d(8, w, h, 0, max_std=3.0)
    bg = torch.tensor([0.3, 0.7, 0.2], dtype=F64)
    inputs = [t.clone().requires_grad_(True) for t in (m, con, col, op, bg)]

    def f(m_, con_, col_, op_, bg_):
        return rasterize(m_, con_, col_, op_, radii, dep, w, h, bg_)

    assert torch.autograd.gradcheck(projected(f), inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_rasterize_gradcheck_dense() -> None:
    # opaque, overlapping Gaussians: pixels stop early and some alphas sit at the 0.999 cap
    w, h = 19, 17
    for seed in range(100):
        m, con, col, op, radii, dep = scene_2d(10, w, h, seed, channels=1, max_std=5.0)
        m = m * 0.3 + torch.tensor([w * 0.35, h * 0.35], dtype=F64)
        op = 0.85 + 0.14 * op
        m[0], op[0] = torch.tensor([9.5, 8.5], dtype=F64), 0.9998  # on a pixel centre: capped there
        margins: dict[str, float] = {}
        brute_rasterize(m, con, col, op, radii, dep, w, h, margins=margins)
        if closest(margins) > 2e-4 and margins.get("n_stop", 0) > 10 and margins.get("n_cap", 0) > 0:
            break
    else:
        raise AssertionError("no safe scene")
    inputs = [t.clone().requires_grad_(True) for t in (m, con, col, op)]
    for segment in (32, 3):  # also across segment boundaries, where the backward carries state

        def f(*xs):
            return ref._rasterize(*xs, radii, dep, w, h, segment=segment)  # noqa: B023

        assert torch.autograd.gradcheck(projected(f), inputs, eps=1e-6, atol=1e-6, rtol=1e-4)
