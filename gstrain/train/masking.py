"""Masked training loss (data.mask_mode = ignore | background); the masked metrics are in gstrain.metrics.

ignore — the loss. With keep = the view's mask (1 = pixel counts) the render is composited onto
the ground truth, img' = keep·img + (1 − keep)·gt, and the ordinary loss (L1 + SSIM, fused CUDA
kernels or PyTorch convolutions alike) is taken on (img', gt) and multiplied by s = N / N_kept
(pixels over kept pixels, fixed per view at load time: no host sync in the step):

    loss = s · [(1 − λ)·L1(img', gt) + λ·(1 − SSIM(img', gt))]

- The L1 term is exactly the mean absolute error over the kept pixels: img' = gt on the others.
- The SSIM term is s times the mean of (1 − SSIM map) over all pixels, that is the sum of the
  per-pixel dissimilarity over every window divided by N_kept, with masked pixels standing in as
  perfect (equal to the ground truth). Windows wholly inside the masked area add nothing; windows
  across the mask edge see the kept pixels' errors only. Because the composite is formed before
  the loss, both loss implementations compute this same function without any change to CUDA code.
- Gradients on masked pixels are zero (the composite does not depend on them there).
Reported terms: l1 is the kept-pixel L1, ssim is 1 − s·(1 − SSIM(img', gt)).

background — masked pixels are trained towards data.background: the target is
keep·gt + (1 − keep)·background and the ordinary loss runs on all pixels; metrics likewise score
every pixel against that composited target.

Metrics under ignore: PSNR from the MSE over kept pixels only; SSIM as the mean of the SSIM map
over kept pixels; LPIPS (when available) on the composite img' against gt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from gstrain.metrics import composite_background
from gstrain.train.losses import LossFn


class ViewMask(NamedTuple):
    keep: Tensor  # [H, W, 1] bool on the training device, True = the pixel counts
    scale: Tensor  # 0-dim float32 on the device: pixels / kept pixels


def prepare_mask(mask: Tensor | None, device: torch.device) -> ViewMask | None:
    """A View's [H, W] bool mask as the step wants it; done once per view at load time."""
    if mask is None:
        return None
    kept = max(int(mask.sum()), 1)  # a view with nothing kept trains on nothing (loss 0), not on NaN
    scale = torch.tensor(mask.numel() / kept, dtype=torch.float32, device=device)
    return ViewMask(mask.to(device=device, dtype=torch.bool).unsqueeze(-1), scale)


def masked_loss(
    loss_fn: LossFn,
    img: Tensor,
    gt: Tensor,
    ssim_lambda: float,
    mask: ViewMask | None,
    mode: str,
    background: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss_fn(img, gt, λ) with the view's mask applied as the module docstring defines."""
    if mask is None:
        return loss_fn(img, gt, ssim_lambda)
    if mode == "background":
        return loss_fn(img, composite_background(gt, mask.keep, background), ssim_lambda)
    composite = torch.where(mask.keep, img, gt)
    loss, terms = loss_fn(composite, gt, ssim_lambda)
    s = mask.scale
    out = {k: v * s for k, v in terms.items() if k != "ssim"}
    if "ssim" in terms:
        out["ssim"] = 1.0 - (1.0 - terms["ssim"]) * s
    return loss * s, out
