"""Image-quality metrics: PSNR, SSIM (the 3DGS definition) and LPIPS (when its weights are here).

Low level on purpose: the trainer (its test evaluations), the losses (SSIM) and `gstrain eval`
all import from here, and this module imports nothing of theirs. Images are [H, W, C] (or
[B, H, W, C]) float in [0, 1]; psnr and ssim_conv never sync with the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gstrain.lpips_net import WEIGHT_FILES, build_lpips, fetch_weights, missing_line, weight_paths

SSIM_WINDOW = 11  # the 3DGS SSIM: an 11x11 Gaussian window of sigma 1.5
SSIM_SIGMA = 1.5
SSIM_C1 = 0.01**2
SSIM_C2 = 0.03**2

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


def psnr(img: Tensor, gt: Tensor) -> Tensor:
    """PSNR in dB for a peak of 1.0 over all pixels and channels (inf for identical images)."""
    mse = (img - gt).square().mean()
    return -10.0 * torch.log10(mse)


def masked_psnr(img: Tensor, gt: Tensor, keep: Tensor) -> Tensor:
    """PSNR (peak 1.0) from the MSE over the kept pixels of [H, W, C] images; keep is [H, W] bool."""
    mse = (img - gt).square()[keep].mean()
    return -10.0 * torch.log10(mse)


def masked_ssim(img: Tensor, gt: Tensor, keep: Tensor) -> Tensor:
    """Mean of the 3DGS SSIM map over the kept pixels (all channels) of [H, W, C] images."""
    per_pixel = ssim_map(img, gt)[0].permute(1, 2, 0)  # [H, W, C]
    return per_pixel[keep].mean()


def composite_background(gt: Tensor, keep: Tensor, background: Tensor | None) -> Tensor:
    """gt where keep, the background colour (black when None) elsewhere; keep is [H, W, 1] bool."""
    bg = torch.zeros(3, dtype=gt.dtype, device=gt.device) if background is None else background.to(gt)
    return torch.where(keep, gt, bg)


def metric_target(
    gt: Tensor, mask: Tensor | None, mode: str, background: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """(target, keep) to score a render with (data.mask_mode): keep is [H, W] bool under ignore, else None.

    background mode composites the target and scores every pixel; no mask scores every pixel.
    """
    if mask is None:
        return gt, None
    keep = mask.to(device=gt.device, dtype=torch.bool)
    if mode == "background":
        return composite_background(gt, keep.unsqueeze(-1), background), None
    return gt, keep


LpipsFn = Callable[[Tensor, Tensor], Tensor]

_lpips_cache: dict[tuple[str, str, str], LpipsFn] = {}


def load_lpips(
    device: torch.device | str, net: str = "alex", download: bool = False
) -> tuple[LpipsFn | None, str | None]:
    """(fn, None) with fn(img, gt) -> scalar LPIPS, or (None, one-line reason) when it cannot run.

    The weights come from torch.hub's cache (gstrain/lpips_net.py); download=True fetches missing
    ones first (gstrain eval, when online), else nothing touches the network. Any failure is a
    reason, not a crash, so PSNR and SSIM are still written.
    """
    if net not in WEIGHT_FILES:
        return None, f"unknown LPIPS network '{net}' (choose from {', '.join(WEIGHT_FILES)})"
    paths = weight_paths(net)
    if not all(p.is_file() for p in paths):
        reason = fetch_weights(net) if download else missing_line(net)
        if reason is not None:
            return None, reason
    key = (str(torch.device(device)), net, str(paths[0]))
    if key in _lpips_cache:
        return _lpips_cache[key], None
    try:
        fn = build_lpips(net, device)
    except Exception as e:  # a truncated or foreign weight file; torch.load's reasons run to many lines
        reason = " ".join(str(e).split())
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        names = " and ".join(p.name for p in paths)
        return None, f"LPIPS could not be set up from {names} in {paths[0].parent} ({type(e).__name__}: {reason})"
    _lpips_cache[key] = fn
    return fn, None


class Metrics:
    """Accumulates per-image PSNR / SSIM / LPIPS and reports their means."""

    def __init__(
        self, device: torch.device | str, lpips: bool = True, lpips_net: str = "alex", lpips_download: bool = False
    ) -> None:
        self.device = torch.device(device)
        self.per_image: list[dict[str, float | None]] = []
        self._lpips: LpipsFn | None = None
        self.lpips_note: str | None = "LPIPS disabled"
        if lpips:
            self._lpips, self.lpips_note = load_lpips(self.device, lpips_net, download=lpips_download)

    @torch.no_grad()
    def add(self, img: Tensor, gt: Tensor, keep: Tensor | None = None) -> dict[str, float | None]:
        """Score one [H,W,3] render against its ground truth; the render is clamped to [0, 1].

        keep ([H, W] bool): score the kept pixels only (masks; gstrain/train/masking.py says how).
        """
        if img.shape != gt.shape or img.dim() != 3:
            raise ValueError(f"expected two [H,W,3] images of one shape, got {tuple(img.shape)} "
                             f"and {tuple(gt.shape)}")
        a = img.to(self.device, torch.float32).clamp(0.0, 1.0)
        b = gt.to(self.device, torch.float32)
        row: dict[str, float | None]
        if keep is not None:
            keep = keep.to(self.device)
            row = {
                "psnr": float(masked_psnr(a, b, keep)),
                "ssim": float(masked_ssim(a, b, keep)),
                "lpips": float(self._lpips(torch.where(keep[..., None], a, b), b)) if self._lpips else None,
            }
        else:
            row = {
                "psnr": float(psnr(a, b)),
                "ssim": float(ssim_conv(a, b)),
                "lpips": float(self._lpips(a, b)) if self._lpips is not None else None,
            }
        self.per_image.append(row)
        return row

    def summary(self) -> dict[str, Any]:
        """Means over the images added so far (None where nothing was measured), plus the rows."""

        def mean(key: str) -> float | None:
            vals = [r[key] for r in self.per_image if r[key] is not None]
            return sum(vals) / len(vals) if vals else None

        return {
            "count": len(self.per_image),
            "psnr": mean("psnr"),
            "ssim": mean("ssim"),
            "lpips": mean("lpips"),
            "lpips_note": self.lpips_note,
            "per_image": list(self.per_image),
        }


def score_images(
    pairs: Iterable[tuple[Tensor, Tensor]],
    device: torch.device | str = "cpu",
    lpips: bool = True,
    lpips_net: str = "alex",
) -> dict[str, Any]:
    """Mean and per-image PSNR / SSIM / LPIPS over (render, ground truth) pairs.

    Returns {"count", "psnr", "ssim", "lpips" (None when unavailable), "lpips_note" (why, or
    None), "per_image": [{"psnr", "ssim", "lpips"}, ...]} with plain floats, ready for JSON.
    """
    metrics = Metrics(device, lpips=lpips, lpips_net=lpips_net)
    for img, gt in pairs:
        metrics.add(img, gt)
    return metrics.summary()
