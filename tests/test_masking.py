"""The masked loss (train/masking.py) and masked metrics (gstrain/metrics.py) against independent computations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gstrain.metrics import composite_background, masked_psnr, masked_ssim, metric_target
from gstrain.train.losses import photometric_loss
from gstrain.train.masking import masked_loss, prepare_mask

H, W = 24, 30


def _inputs(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    img = torch.rand(H, W, 3, generator=gen, dtype=torch.float64)
    gt = torch.rand(H, W, 3, generator=gen, dtype=torch.float64)
    keep = torch.ones(H, W, dtype=torch.bool)
    keep[5:15, 8:20] = False  # a blob
    keep[:, :3] = False  # and a strip at the border
    return img.to(device, dtype), gt.to(device, dtype), keep


def _window_2d(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size) - size // 2
    g = np.exp(-(x**2) / (2 * sigma**2))
    g /= g.sum()
    return np.outer(g, g)


def _ssim_map_plain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """SSIM map [H, W, C] with a full 2-D 11x11 window (not the separable path), zero padding."""
    c = x.shape[-1]
    win = torch.from_numpy(_window_2d()).to(x).expand(c, 1, 11, 11)

    def filt(a: torch.Tensor) -> torch.Tensor:
        return F.conv2d(a.permute(2, 0, 1)[None], win, padding=5, groups=c)[0].permute(1, 2, 0)

    mx, my = filt(x), filt(y)
    vx, vy, cxy = filt(x * x) - mx**2, filt(y * y) - my**2, filt(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    return ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))


def _plain_masked_loss(img, gt, keep, lam):
    """The documented definition, written out: kept-pixel L1 plus the rescaled SSIM dissimilarity."""
    m = keep[..., None].to(img)
    n_kept = int(keep.sum())
    kept_err = (img - gt).abs()[keep]  # explicit indexing of the kept pixels: [n_kept, 3]
    l1 = kept_err.sum() / (n_kept * 3)
    comp = img * m + gt * (1 - m)
    dssim = (1 - _ssim_map_plain(comp, gt)).sum() / (n_kept * 3)
    return (1 - lam) * l1 + lam * dssim


@pytest.mark.parametrize("lam", [0.0, 0.2, 1.0])
def test_masked_loss_matches_the_plain_formula_value_and_gradient(lam):
    img, gt, keep = _inputs(dtype=torch.float64)
    mask = prepare_mask(keep, torch.device("cpu"))
    a = img.clone().requires_grad_(True)
    loss, terms = masked_loss(photometric_loss, a, gt, lam, mask, "ignore", None)
    loss.backward()
    b = img.clone().requires_grad_(True)
    ref = _plain_masked_loss(b, gt, keep, lam)
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    # float32 scale factor: 1e-6 relative
    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-9)
    # the L1 term is the mean over kept pixels, by explicit indexing
    assert float(terms["l1"]) == pytest.approx(float((img - gt).abs()[keep].mean()), rel=1e-6)


def test_masked_pixels_get_no_gradient_and_do_not_change_the_loss():
    img, gt, keep = _inputs(seed=1)
    mask = prepare_mask(keep, torch.device("cpu"))
    a = img.clone().requires_grad_(True)
    loss, _ = masked_loss(photometric_loss, a, gt, 0.2, mask, "ignore", None)
    loss.backward()
    assert torch.all(a.grad[~keep] == 0)
    assert torch.all(a.grad[keep].abs().sum(-1) > 0)
    # anything painted into the masked pixels (a magenta passer-by) leaves the loss as it was
    painted = img.clone()
    painted[~keep] = torch.tensor([1.0, 0.0, 1.0])
    loss2, _ = masked_loss(photometric_loss, painted, gt, 0.2, mask, "ignore", None)
    assert float(loss2.detach()) == float(loss.detach())


def test_full_mask_is_the_ordinary_loss():
    img, gt, _ = _inputs(seed=2)
    keep = torch.ones(H, W, dtype=torch.bool)
    loss, _ = masked_loss(photometric_loss, img, gt, 0.2, prepare_mask(keep, torch.device("cpu")), "ignore", None)
    plain, _ = photometric_loss(img, gt, 0.2)
    assert float(loss) == pytest.approx(float(plain), rel=1e-6)


def test_background_mode_trains_masked_pixels_to_the_background():
    img, gt, keep = _inputs(seed=3)
    bg = torch.tensor([0.0, 1.0, 0.25])
    mask = prepare_mask(keep, torch.device("cpu"))
    target = gt.clone()
    target[~keep] = bg  # written out independently
    loss, _ = masked_loss(photometric_loss, img, gt, 0.2, mask, "background", bg)
    ref, _ = photometric_loss(img, target, 0.2)
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)
    # a render that shows the background in the masked pixels and gt elsewhere has zero loss
    perfect = target.clone()
    zero, _ = masked_loss(photometric_loss, perfect, gt, 0.2, mask, "background", bg)
    assert float(zero) == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(composite_background(gt, keep[..., None], bg), target)


def test_masked_metrics_against_numpy():
    img, gt, keep = _inputs(seed=4)
    k = keep.numpy()
    diff = (img.numpy() - gt.numpy())[k]
    assert float(masked_psnr(img, gt, keep)) == pytest.approx(-10 * np.log10(np.mean(diff**2)), rel=1e-5)
    ref_map = _ssim_map_plain(img.double(), gt.double()).numpy()
    assert float(masked_ssim(img, gt, keep)) == pytest.approx(float(ref_map[k].mean()), rel=1e-5)
    # the Metrics hook scores the same way (renders are clamped first: these are in [0, 1] already)
    from gstrain.metrics import Metrics

    row = Metrics("cpu", lpips=False).add(img, gt, keep)
    assert row["psnr"] == pytest.approx(-10 * np.log10(np.mean(diff**2)), rel=1e-5)
    assert row["ssim"] == pytest.approx(float(ref_map[k].mean()), rel=1e-5)
    # metric_target: ignore keeps gt and gives the mask; background composites and scores all
    t, kk = metric_target(gt, keep, "ignore", None)
    assert t is gt and torch.equal(kk, keep)
    bg = torch.tensor([1.0, 1.0, 1.0])
    t, kk = metric_target(gt, keep, "background", bg)
    assert kk is None and torch.all(t[~keep] == 1.0) and torch.equal(t[keep], gt[keep])


@pytest.mark.cuda
def test_masked_fused_loss_equals_masked_conv_loss():
    from gstrain.train.fused_ssim import fused_photometric_loss

    gen = torch.Generator(device="cuda").manual_seed(5)
    img = torch.rand(2 * H + 1, 3 * W + 3, 3, device="cuda", generator=gen)  # odd size: partial tiles
    gt = torch.rand(img.shape, device="cuda", generator=gen)
    keep = torch.ones(img.shape[:2], dtype=torch.bool, device="cuda")
    keep[10:30, 20:60] = False  # a blob, and scattered pixels
    keep &= torch.rand(img.shape[:2], device="cuda", generator=gen) > 0.1
    mask = prepare_mask(keep, torch.device("cuda"))
    out = []
    for fn in (fused_photometric_loss, photometric_loss):
        a = img.clone().requires_grad_(True)
        loss, terms = masked_loss(fn, a, gt, 0.2, mask, "ignore", None)
        loss.backward()
        out.append((loss.detach(), terms, a.grad))
    (lf, tf, gf), (lc, tc, gc) = out
    assert torch.allclose(lf, lc, rtol=1e-4, atol=1e-6)
    assert torch.allclose(tf["l1"], tc["l1"], rtol=1e-4) and torch.allclose(tf["ssim"], tc["ssim"], rtol=1e-4)
    assert torch.allclose(gf, gc, rtol=1e-3, atol=1e-7)
    assert torch.all(gf[~keep] == 0)
