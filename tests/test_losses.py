"""L1, SSIM, PSNR and the photometric training loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gstrain.metrics import psnr, ssim_conv
from gstrain.train.losses import l1_loss, photometric_loss


def _img(h: int, w: int, seed: int) -> torch.Tensor:
    return torch.rand(h, w, 3, generator=torch.Generator().manual_seed(seed))


def _ssim_brute_force(a: np.ndarray, b: np.ndarray, window: int = 11, sigma: float = 1.5) -> float:
    """Per-pixel SSIM in float64 with an explicit 2-D Gaussian window and zero padding (3DGS)."""
    h, w, c = a.shape
    x = np.arange(window) - window // 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    g /= g.sum()
    win = np.outer(g, g)
    pad = window // 2
    total = 0.0
    for ch in range(c):
        ap = np.pad(a[:, :, ch], pad)
        bp = np.pad(b[:, :, ch], pad)
        for i in range(h):
            for j in range(w):
                pa = ap[i:i + window, j:j + window]
                pb = bp[i:i + window, j:j + window]
                mx = (win * pa).sum()
                my = (win * pb).sum()
                vx = (win * pa * pa).sum() - mx * mx
                vy = (win * pb * pb).sum() - my * my
                cxy = (win * pa * pb).sum() - mx * my
                c1, c2 = 0.01**2, 0.03**2
                total += ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return total / (h * w * c)


def test_ssim_identical_is_one():
    img = _img(20, 17, 0)
    assert torch.allclose(ssim_conv(img, img), torch.tensor(1.0), atol=1e-6)


@pytest.mark.parametrize("shape", [(9, 13), (16, 6)])
def test_ssim_matches_brute_force(shape):
    a = _img(*shape, 1)
    b = (a + 0.2 * _img(*shape, 2)).clamp(0, 1)
    want = _ssim_brute_force(a.double().numpy(), b.double().numpy())
    got64 = ssim_conv(a.double(), b.double())
    assert got64.dtype == torch.float64
    assert math.isclose(float(got64), want, rel_tol=1e-10, abs_tol=1e-12)
    assert math.isclose(float(ssim_conv(a, b)), want, rel_tol=1e-4)
    assert float(ssim_conv(a, b)) < 0.99


def test_ssim_batched_equals_mean_of_singles():
    a = torch.stack([_img(8, 8, 3), _img(8, 8, 4)])
    b = torch.stack([_img(8, 8, 5), _img(8, 8, 6)])
    single = (ssim_conv(a[0], b[0]) + ssim_conv(a[1], b[1])) / 2
    assert torch.allclose(ssim_conv(a, b), single, atol=1e-6)


def test_ssim_gradient_matches_finite_differences_of_the_brute_force():
    """dSSIM/dimg from autograd through ssim_conv, against central differences of the float64
    brute-force SSIM, at pixels in the corners (zero padding), on the edges and inside."""
    gt = _img(7, 6, 7).double()
    img = _img(7, 6, 8).double().requires_grad_(True)
    ssim_conv(img, gt).backward()
    a, b, h = img.detach().numpy(), gt.numpy(), 1e-6
    for i, j, c in [(0, 0, 0), (6, 5, 2), (0, 3, 1), (3, 0, 2), (3, 2, 0), (4, 4, 1), (6, 1, 0)]:
        up, down = a.copy(), a.copy()
        up[i, j, c] += h
        down[i, j, c] -= h
        numeric = (_ssim_brute_force(up, b) - _ssim_brute_force(down, b)) / (2 * h)
        assert abs(numeric) > 1e-5, (i, j, c)  # a gradient worth comparing
        assert math.isclose(float(img.grad[i, j, c]), numeric, rel_tol=1e-5, abs_tol=1e-9), (i, j, c)


def test_psnr_known_mse():
    gt = torch.zeros(4, 5, 3)
    img = torch.full((4, 5, 3), 0.1)  # MSE = 0.01 -> 20 dB
    assert torch.allclose(psnr(img, gt), torch.tensor(20.0), atol=1e-4)
    assert torch.isinf(psnr(gt, gt))


def test_l1():
    a = torch.zeros(2, 2, 3)
    b = torch.full((2, 2, 3), 0.25)
    assert torch.allclose(l1_loss(a, b), torch.tensor(0.25))


def test_photometric_loss_combination():
    gt = _img(10, 11, 9)
    img = _img(10, 11, 10).requires_grad_(True)
    loss, terms = photometric_loss(img, gt, ssim_lambda=0.3)
    want = 0.7 * l1_loss(img, gt) + 0.3 * (1 - ssim_conv(img, gt))
    assert torch.allclose(loss, want, atol=1e-6)
    assert torch.allclose(terms["l1"], l1_loss(img, gt).detach())
    assert torch.allclose(terms["ssim"], ssim_conv(img, gt).detach())
    assert not terms["l1"].requires_grad
    loss.backward()
    # d/dimg: 0.7 sign(img - gt) / numel from the L1 (known), and 0.3 x -dSSIM/dimg
    ssim_img = img.detach().clone().requires_grad_(True)
    ssim_conv(ssim_img, gt).backward()
    want_grad = 0.7 * torch.sign(img.detach() - gt) / img.numel() - 0.3 * ssim_img.grad
    assert torch.allclose(img.grad, want_grad, rtol=1e-5, atol=1e-8)


def test_photometric_loss_takes_its_ssim_as_an_argument():
    calls = []

    def fake(img, gt, window, sigma):
        calls.append((window, sigma))
        return torch.tensor(0.5)

    loss, terms = photometric_loss(_img(4, 4, 0), _img(4, 4, 0), ssim_lambda=1.0, ssim_fn=fake)
    assert float(loss) == 0.5 and float(terms["ssim"]) == 0.5
    assert calls == [(11, 1.5)]  # the 3DGS window
    # without one it is the convolution reference: identical images score SSIM 1, loss 0
    loss, terms = photometric_loss(_img(4, 4, 0), _img(4, 4, 0), ssim_lambda=1.0)
    assert float(loss) == pytest.approx(0.0, abs=1e-6) and float(terms["ssim"]) == pytest.approx(1.0, abs=1e-6)
