"""The oracles and scenes of the reference renderer's tests (test_reference_raster.py,
test_reference_render.py): a brute-force per-pixel loop written straight from CONVENTIONS.md,
the cameras and Gaussians the tests draw, and gradcheck's output projection."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

F64 = torch.float64
CAP = 0.999  # gsplat's alpha cap, which the reference must share (CONVENTIONS.md)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
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
