"""The pure-PyTorch reference renderer against CONVENTIONS.md, gsplat and finite differences.

A brute-force per-pixel loop, written straight from CONVENTIONS.md, is the oracle for images;
gsplat's own PyTorch implementation is the oracle for projection and SH; central differences
(torch.autograd.gradcheck, float64) are the oracle for gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gstrain.render import reference as ref
from gstrain.render.reference import Projection, project_gaussians, rasterize, render_reference
from gstrain.render.sh import sh_to_color

F64 = torch.float64
CAP = 0.999  # gsplat's alpha cap, which the reference must share (CONVENTIONS.md)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These renders are tiny: on a busy 2-core machine OpenMP's second thread only adds waits
    (measured 10x slower), so run this module single-threaded and restore the setting after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def projected(fn, n_proj: int = 2):
    """fn's outputs reduced to n_proj random linear combinations: gradcheck then needs n_proj
    backward passes instead of one per pixel, and still checks every input element by
    central differences."""
    weights: list[Tensor] = []

    def g(*xs):
        outs = fn(*xs)
        if not weights:
            gen = torch.Generator().manual_seed(123)
            weights.extend(torch.randn((n_proj,) + o.shape, generator=gen, dtype=o.dtype) for o in outs)
        return sum((w * o).flatten(1).sum(1) for w, o in zip(weights, outs, strict=True))

    return g


# ---------------------------------------------------------------------------------------------
# the oracle: CONVENTIONS.md as a per-pixel loop


def brute_rasterize(
    means2d: Tensor,
    conics: Tensor,
    colors: Tensor,
    opacities: Tensor,
    radii: Tensor,
    depths: Tensor,
    width: int,
    height: int,
    background: Tensor | None = None,
    margins: dict[str, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """image [H,W,C], alpha [H,W,1] in float64. With `margins`, records how close any decision
    came to its threshold (relative; keys cap, skip, stop), so that scenes for finite differences
    can avoid them, and how often pixels stopped or alphas were capped (n_stop, n_cap)."""
    m, con, col = means2d.tolist(), conics.tolist(), colors.tolist()
    op, rad, dep = opacities.tolist(), radii.tolist(), depths.tolist()
    nc = colors.shape[1]
    bg = background.tolist() if background is not None else [0.0] * nc
    order = sorted(range(len(dep)), key=lambda i: dep[i])  # stable: ties keep index order
    image = torch.zeros(height, width, nc, dtype=F64)
    alpha_img = torch.zeros(height, width, 1, dtype=F64)

    def near(name: str, value: float, thr: float) -> None:
        if margins is not None:
            margins[name] = min(margins.get(name, math.inf), abs(value - thr) / thr)

    def count(name: str, hit: bool) -> None:
        if margins is not None:
            margins[name] = margins.get(name, 0) + int(hit)

    for y in range(height):
        for x in range(width):
            tx, ty = x // 16, y // 16
            px, py = x + 0.5, y + 0.5
            t = 1.0
            acc = [0.0] * nc
            for i in order:
                rx, ry = rad[i]
                if rx <= 0 or ry <= 0:
                    continue
                mx, my = m[i]
                if not (math.floor((mx - rx) / 16) <= tx < math.ceil((mx + rx) / 16)):
                    continue
                if not (math.floor((my - ry) / 16) <= ty < math.ceil((my + ry) / 16)):
                    continue
                a, b, c = con[i]
                dx, dy = mx - px, my - py
                sigma = 0.5 * (a * dx * dx + c * dy * dy) + b * dx * dy
                if sigma < 0:
                    continue
                raw = op[i] * math.exp(-sigma)
                near("cap", raw, CAP)
                count("n_cap", raw > CAP)
                alpha = min(CAP, raw)
                near("skip", alpha, 1.0 / 255.0)
                if alpha < 1.0 / 255.0:
                    continue
                next_t = t * (1.0 - alpha)
                near("stop", next_t, 1e-4)
                if next_t < 1e-4:
                    count("n_stop", True)
                    break
                for k in range(nc):
                    acc[k] += col[i][k] * alpha * t
                t = next_t
            for k in range(nc):
                image[y, x, k] = acc[k] + t * bg[k]
            alpha_img[y, x, 0] = 1.0 - t
    return image, alpha_img


# ---------------------------------------------------------------------------------------------
# scenes


def camera(width: int, height: int, f: float, dtype: torch.dtype = F64) -> tuple[Tensor, Tensor]:
    """A slightly rotated and shifted world-to-camera matrix, and pinhole intrinsics."""
    ang = 0.1
    r = torch.tensor([[math.cos(ang), 0, math.sin(ang)], [0, 1, 0], [-math.sin(ang), 0, math.cos(ang)]], dtype=dtype)
    viewmat = torch.eye(4, dtype=dtype)
    viewmat[:3, :3] = r
    viewmat[:3, 3] = torch.tensor([0.05, -0.02, 0.1], dtype=dtype)
    K = torch.tensor([[f, 0, width / 2 + 0.3], [0, f * 1.05, height / 2 - 0.2], [0, 0, 1]], dtype=dtype)
    return viewmat, K


def gaussians_3d(n: int, seed: int, sh_degree: int = 3, scale: float = 0.15, dtype=F64) -> dict[str, Tensor]:
    """Gaussians in front of camera(): x, y in [-1, 1] at depth 2..4 (CONVENTIONS names)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.rand(n, 3, generator=g, dtype=dtype) * torch.tensor([2.0, 2.0, 2.0], dtype=dtype)
    means = means + torch.tensor([-1.0, -1.0, 2.0], dtype=dtype)
    return {
        "means": means,
        "scales": torch.log(scale * (0.4 + torch.rand(n, 3, generator=g, dtype=dtype))),
        "quats": torch.randn(n, 4, generator=g, dtype=dtype),
        "opacities": torch.logit(0.3 + 0.6 * torch.rand(n, generator=g, dtype=dtype)),
        "sh0": torch.randn(n, 1, 3, generator=g, dtype=dtype) * 0.5,
        "shN": torch.randn(n, (sh_degree + 1) ** 2 - 1, 3, generator=g, dtype=dtype) * 0.2,
    }


def scene_2d(n: int, width: int, height: int, seed: int, channels: int = 3, dtype=F64, max_std: float = 4.0):
    """Projected-looking 2D Gaussians: means2d, conics, colors, opacities, radii, depths."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(n, 2, generator=g, dtype=dtype) * torch.tensor([width + 8.0, height + 8.0], dtype=dtype) - 4
    std = 0.3 + torch.rand(n, 2, generator=g, dtype=dtype) * max_std
    th = torch.rand(n, generator=g, dtype=dtype) * math.pi
    c, s = torch.cos(th), torch.sin(th)
    c00 = c * c * std[:, 0] ** 2 + s * s * std[:, 1] ** 2 + 0.3
    c11 = s * s * std[:, 0] ** 2 + c * c * std[:, 1] ** 2 + 0.3
    c01 = c * s * (std[:, 0] ** 2 - std[:, 1] ** 2)
    det = c00 * c11 - c01 * c01
    conics = torch.stack([c11 / det, -c01 / det, c00 / det], -1)
    radii = torch.stack([torch.ceil(3.33 * c00.sqrt()), torch.ceil(3.33 * c11.sqrt())], -1).to(torch.int32)
    colors = torch.rand(n, channels, generator=g, dtype=dtype)
    opacities = 0.05 + 0.9 * torch.rand(n, generator=g, dtype=dtype)
    depths = 1 + 5 * torch.rand(n, generator=g, dtype=dtype)
    return m, conics, colors, opacities, radii, depths


def closest(margins: dict[str, float]) -> float:
    return min((v for k, v in margins.items() if not k.startswith("n_")), default=1.0)


def world_from_camera(viewmat: Tensor, p_cam: Tensor) -> Tensor:
    """World points [N,3] that land at camera-space p_cam [N,3]."""
    return (p_cam - viewmat[:3, 3]) @ viewmat[:3, :3]


def safe_scene_2d(n: int, width: int, height: int, seed: int, **kw):
    """A scene whose skip / stop / cap decisions all sit >= 2e-4 (relative) from their thresholds,
    so finite differences (steps of 1e-6) never cross one."""
    for s in range(seed, seed + 200):
        sc = scene_2d(n, width, height, s, **kw)
        margins: dict[str, float] = {}
        brute_rasterize(*sc, width, height, margins=margins)
        if closest(margins) > 2e-4:
            return sc
    raise AssertionError("no safe scene found")


def run(fn, *args, **kw) -> tuple[Tensor, Tensor]:
    image, alpha = fn(*args, **kw)
    return image.detach(), alpha.detach()


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
    from gstrain.errors import UserError
    from gstrain.render import Renderer
    from gstrain.render.common import RasterOptions

    cpu = torch.device("cpu")
    renderer = Renderer(RenderConfig(atomic_mode="distwar", atomic_threshold=5), cpu, absgrad=True)
    assert renderer.backend == "reference" and renderer.atomic_threshold is None
    # the config's ellipse cull and fused SH (on by default) reach the options; only the gsplat
    # backend drops them
    assert renderer.options == RasterOptions(absgrad=True, atomic_mode="distwar", atomic_threshold=5,
                                             ellipse_cull=True, fused_sh=True)  # fmt: skip
    off = Renderer(RenderConfig(fused_sh=False), cpu)
    assert not off.options.fused_sh and off.options.ellipse_cull
    if not torch.cuda.is_available():
        for backend in ("cuda", "gsplat"):
            with pytest.raises(UserError, match=f"render.backend={backend} needs a CUDA GPU"):
                Renderer(RenderConfig(backend=backend), cpu)
