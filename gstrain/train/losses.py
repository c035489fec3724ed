"""Photometric losses and image metrics: L1, SSIM, PSNR.

Images are [H, W, C] (or [B, H, W, C]) float in [0, 1]. Everything stays on the images'
device and never syncs with the host (no .item()), so it can sit inside a timed training step.

SSIM here is separable Gaussian convolutions in plain PyTorch, the reference. The fused CUDA
loss (fused_ssim.py) has the same contract; each StepRunner picks its own (no global switch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

SSIM_WINDOW = 11  # the 3DGS SSIM: an 11x11 Gaussian window of sigma 1.5
SSIM_SIGMA = 1.5
SSIM_C1 = 0.01**2
SSIM_C2 = 0.03**2

# (img, gt, window, sigma) -> scalar mean SSIM; the same contract as ssim_conv.
SsimImpl = Callable[[Tensor, Tensor, int, float], Tensor]

_window_cache: dict[tuple[int, float, torch.device, torch.dtype], Tensor] = {}


def gaussian_window_1d(window: int, sigma: float, device: torch.device, dtype: torch.dtype) -> Tensor:
    """Normalised 1-D Gaussian taps, [window]; cached so a training step builds no tensors from host data."""
    key = (window, float(sigma), torch.device(device), dtype)
    taps = _window_cache.get(key)
    if taps is None:
        x = torch.arange(window, dtype=torch.float64) - window // 2
        g = torch.exp(-(x**2) / (2.0 * sigma**2))
        taps = (g / g.sum()).to(device=device, dtype=dtype)
        _window_cache[key] = taps
    return taps


def _as_nchw(img: Tensor) -> Tensor:
    if img.dim() == 3:
        img = img.unsqueeze(0)
    if img.dim() != 4:
        raise ValueError(f"expected an image [H,W,C] or [B,H,W,C], got shape {tuple(img.shape)}")
    return img.permute(0, 3, 1, 2)


def ssim_conv(img: Tensor, gt: Tensor, window: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> Tensor:
    """Mean SSIM with a Gaussian window, as the original 3DGS computes it (the mean of ssim_map)."""
    return ssim_map(img, gt, window, sigma).mean()


def ssim_map(img: Tensor, gt: Tensor, window: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> Tensor:
    """Per-pixel SSIM, [B, C, H, W]: masked metrics average it over the kept pixels only.

    Same-size output: zero padding of window // 2 on each side, so border pixels are included
    (with the zero-padded statistics 3DGS uses). The 2-D window is the outer product of the
    1-D taps, applied as two 1-D convolutions, which is exact with zero padding.
    """
    if img.shape != gt.shape:
        raise ValueError(f"image shapes differ: {tuple(img.shape)} vs {tuple(gt.shape)}")
    x = _as_nchw(img)
    y = _as_nchw(gt)
    c = x.shape[1]
    taps = gaussian_window_1d(window, sigma, x.device, x.dtype)
    pad = window // 2
    # All five statistics in one grouped convolution pair instead of five.
    stats = torch.cat([x, y, x * x, y * y, x * y], dim=1)
    groups = stats.shape[1]
    stats = F.conv2d(stats, taps.view(1, 1, 1, window).expand(groups, 1, 1, window), padding=(0, pad),
                     groups=groups)
    stats = F.conv2d(stats, taps.view(1, 1, window, 1).expand(groups, 1, window, 1), padding=(pad, 0),
                     groups=groups)
    mu_x, mu_y, e_xx, e_yy, e_xy = stats.split(c, dim=1)
    mu_xx = mu_x * mu_x
    mu_yy = mu_y * mu_y
    mu_xy = mu_x * mu_y
    num = (2.0 * mu_xy + SSIM_C1) * (2.0 * (e_xy - mu_xy) + SSIM_C2)
    den = (mu_xx + mu_yy + SSIM_C1) * ((e_xx - mu_xx) + (e_yy - mu_yy) + SSIM_C2)
    return num / den


def l1_loss(img: Tensor, gt: Tensor) -> Tensor:
    return (img - gt).abs().mean()


def psnr(img: Tensor, gt: Tensor) -> Tensor:
    """PSNR in dB for a peak of 1.0 over all pixels and channels (inf for identical images)."""
    mse = (img - gt).square().mean()
    return -10.0 * torch.log10(mse)


# (img, gt, ssim_lambda) -> (loss, detached terms): the contract of every training loss.
LossFn = Callable[[Tensor, Tensor, float], tuple[Tensor, dict[str, Tensor]]]


def photometric_loss(
    img: Tensor, gt: Tensor, ssim_lambda: float = 0.2, ssim_fn: SsimImpl = ssim_conv
) -> tuple[Tensor, dict[str, Tensor]]:
    """(1 - λ)·L1 + λ·(1 - SSIM), the 3DGS training loss; terms come back detached for logging."""
    l1 = l1_loss(img, gt)
    s = ssim_fn(img, gt, SSIM_WINDOW, SSIM_SIGMA)
    loss = (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - s)
    return loss, {"l1": l1.detach(), "ssim": s.detach(), "loss": loss.detach()}
