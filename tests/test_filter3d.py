"""render.filter_3d (Mip-Splatting's 3D smoothing filter): the sampling rates against a per-Gaussian,
per-camera loop; the filtered scales and opacities against the 3x3 covariances built by hand; the
Renderer's hook (rates from the training views, recomputed after densification; a clear error
without views); the config check."""

from __future__ import annotations

import math

import pytest
import torch
from cli_util import call_cli

from gstrain.config import build_config
from gstrain.errors import UserError
from gstrain.render import Renderer
from gstrain.render.filter3d import apply_filter_3d, filter_std, max_sampling_rate
from gstrain.render.reference import render_reference

F64 = torch.float64


def _cameras():
    """Three cameras looking down +z from different distances, and one looking down -z."""
    views = []
    for dz, f, (w, h) in ((0.0, 30.0, (40, 30)), (-2.0, 50.0, (32, 32)), (1.0, 20.0, (24, 20))):
        vm = torch.eye(4, dtype=F64)
        vm[2, 3] = -dz  # camera at z = dz
        views.append((vm, torch.tensor([[f, 0, w / 2], [0, f * 0.9, h / 2], [0, 0, 1]], dtype=F64), (w, h)))
    back = torch.diag(torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=F64))  # turned around, at z = 8
    back[2, 3] = 8.0
    views.append((back, torch.tensor([[25.0, 0, 16], [0, 25.0, 16], [0, 0, 1]], dtype=F64), (32, 32)))
    return views


def _brute_rate(means: torch.Tensor, views) -> list[float]:
    rates = []
    for p in means.tolist():
        best = 0.0
        for vm, K, (w, h) in views:
            x, y, z = (sum(vm[r, c].item() * p[c] for c in range(3)) + vm[r, 3].item() for r in range(3))
            if z <= 0.2:
                continue
            u = K[0, 0].item() * x / z + K[0, 2].item()
            v = K[1, 1].item() * y / z + K[1, 2].item()
            if -0.15 * w <= u <= 1.15 * w and -0.15 * h <= v <= 1.15 * h:
                best = max(best, max(K[0, 0].item(), K[1, 1].item()) / z)
        if best == 0.0:  # seen by none: the finest a camera turned towards it would sample it
            for vm, K, _ in views:
                rot = vm[:3, :3]
                centre = -(rot.T @ vm[:3, 3])
                dist = max(sum((p[c] - centre[c].item()) ** 2 for c in range(3)) ** 0.5, 0.2)
                best = max(best, max(K[0, 0].item(), K[1, 1].item()) / dist)
        rates.append(best)
    return rates


def test_max_sampling_rate_equals_a_loop_over_gaussians_and_cameras() -> None:
    g = torch.Generator().manual_seed(3)
    means = (torch.rand(200, 3, generator=g, dtype=F64) - 0.5) * torch.tensor([6.0, 6.0, 12.0], dtype=F64) + 3.0
    means[0] = torch.tensor([100.0, 100.0, 3.0], dtype=F64)  # outside every frustum
    views = _cameras()
    rate = max_sampling_rate(means, torch.stack([v[0] for v in views]), torch.stack([v[1] for v in views]),
                             [v[2] for v in views])  # fmt: skip
    expect = torch.tensor(_brute_rate(means, views), dtype=F64)
    assert torch.allclose(rate, expect, rtol=1e-12)
    assert 0 < float(rate[0]) < float(expect[1:].min())  # unseen, far away: a low rate of its own
    assert len(set(expect.tolist())) > 50  # rates differ per Gaussian


def test_filtered_gaussian_is_the_convolution_with_the_3d_low_pass() -> None:
    """scale'^2 = scale^2 + f^2 is Sigma + f^2 I in the world frame, and opacity' keeps the
    Gaussian's integral: opacity * sqrt(det Sigma / det(Sigma + f^2 I)), both from 3x3 matrices."""
    from gstrain.render.projection import _quat_to_rotmat

    g = torch.Generator().manual_seed(4)
    n = 50
    params = {
        "means": torch.randn(n, 3, generator=g, dtype=F64),
        "quats": torch.randn(n, 4, generator=g, dtype=F64),
        "scales": torch.randn(n, 3, generator=g, dtype=F64) - 3.0,
        "opacities": torch.randn(n, generator=g, dtype=F64) * 3.0,
    }
    params["opacities"][0] = 40.0  # saturated: the logit must stay finite
    std = torch.rand(n, generator=g, dtype=F64) * 0.05
    std[1] = 0.0  # no filter: unchanged
    out = apply_filter_3d(params, std)
    rot = _quat_to_rotmat(params["quats"])

    def cov(log_s):
        m = rot * torch.exp(log_s)[:, None, :]
        return m @ m.transpose(1, 2)

    sigma = cov(params["scales"])
    blurred = sigma + std[:, None, None] ** 2 * torch.eye(3, dtype=F64)
    assert torch.allclose(cov(out["scales"]), blurred, rtol=1e-10, atol=1e-14)
    expect = torch.sigmoid(params["opacities"]) * torch.sqrt(torch.det(sigma) / torch.det(blurred))
    got = torch.sigmoid(out["opacities"])
    assert torch.allclose(got[1:], expect[1:], rtol=1e-9)
    assert abs(float(got[0]) - float(expect[0])) < 1e-6  # the saturated one: capped just below 1
    assert torch.equal(out["scales"][1], params["scales"][1])
    assert out["means"] is params["means"]

    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    filt = apply_filter_3d(leaves, std)
    (filt["scales"].sum() + torch.sigmoid(filt["opacities"]).sum()).backward()
    assert all(torch.isfinite(leaves[k].grad).all() for k in ("scales", "opacities"))


def _params(n: int = 60) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    means = torch.cat([(torch.rand(n, 2, generator=g) - 0.5) * 2, 2 + 3 * torch.rand(n, 1, generator=g)], 1)
    return {
        "means": means, "quats": torch.randn(n, 4, generator=g), "scales": torch.randn(n, 3, generator=g) * 0.3 - 4,
        "opacities": torch.randn(n, generator=g), "sh0": torch.randn(n, 1, 3, generator=g) * 0.4,
        "shN": torch.zeros(n, 15, 3),
    }  # fmt: skip


class _View:
    def __init__(self, viewmat: torch.Tensor, K: torch.Tensor, w: int, h: int) -> None:
        self.viewmat, self.K, self.width, self.height = viewmat, K, w, h


def test_renderer_filters_with_the_training_views_rates_and_recomputes_them() -> None:
    cfg = build_config(None, [{"render": {"filter_3d": 0.2}}])
    renderer = Renderer(cfg.render, torch.device("cpu"))
    params = _params()
    K = torch.tensor([[40.0, 0, 16], [0, 40.0, 12], [0, 0, 1]])
    viewmat = torch.eye(4)
    with pytest.raises(UserError, match="filter_3d needs the training views"):
        renderer(params, viewmat, K, 32, 24, 0)
    renderer.set_training_views([_View(viewmat, K, 32, 24)])
    image = renderer(params, viewmat, K, 32, 24, 0)[0]
    std = math.sqrt(0.2) * params["means"][:, 2] / 40.0  # every mean is in view: rate = f / z
    expect = render_reference(apply_filter_3d(params, std), viewmat, K, 32, 24, 0)[0]
    assert torch.allclose(image, expect, atol=1e-6)
    assert not torch.allclose(image, render_reference(params, viewmat, K, 32, 24, 0)[0], atol=1e-3)

    moved = {**params, "means": params["means"] * torch.tensor([1.0, 1.0, 2.0])}  # twice as far: half the rate
    renderer.gaussians_changed(60, moved)
    far = renderer(moved, viewmat, K, 32, 24, 0)[0]
    expect = render_reference(apply_filter_3d(moved, 2 * std), viewmat, K, 32, 24, 0)[0]
    assert torch.allclose(far, expect, atol=1e-6)


def test_filter_std_is_sqrt_variance_over_rate() -> None:
    rate = torch.tensor([10.0, 0.0, 40.0])
    assert torch.allclose(filter_std(rate, 0.2), torch.tensor([0.2**0.5 / 10, 0.0, 0.2**0.5 / 40]))


@pytest.mark.parametrize("value", ["-0.1", "1000", ".nan", "true"])
def test_bad_filter_3d_is_one_line(value: str, demo_scene, tmp_path) -> None:
    code, err = call_cli("fit", demo_scene, "--out", tmp_path / "run", "--set", f"render.filter_3d={value}")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gstrain: error:"), err
    assert "render.filter_3d" in lines[0], err
