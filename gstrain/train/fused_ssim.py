"""Fused SSIM on the GPU: the value and gradient of losses.ssim_conv from two CUDA kernels.

The forward filters the five moments in shared-memory tiles and keeps, per pixel, dSSIM/dmu1,
dSSIM/dsigma1^2 and dSSIM/dsigma12; the backward is one more Gaussian filtering of those three
maps (csrc/fused_ssim.cu). The same 3DGS definition as ssim_conv: 11x11 Gaussian window with
sigma 1.5, zero padding, same-size map, mean over pixels and channels.

fused_photometric_loss goes one step further: the whole 3DGS loss, (1 - lambda) L1 +
lambda (1 - SSIM), from the same two kernels (the L1 sum rides along in the forward's block
sums, its sign in the backward), which saves the dozen small launches and autograd nodes of the
conv loss: host time, on a GPU that waits for the host.

The extension (gstrain_ssim, gstrain.extensions.ssim) is compiled on first use. Only `img` gets a
gradient; `gt` is treated as a constant. training_loss_for picks, per trainer, this loss or
losses.photometric_loss.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gstrain import extensions
from gstrain.metrics import SSIM_SIGMA, SSIM_WINDOW, ssim_conv
from gstrain.train.losses import LossFn, photometric_loss


class _FusedSsim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, img: Tensor, gt: Tensor) -> Tensor:
        save = bool(ctx.needs_input_grad[0])
        value, partials = extensions.ssim().ssim_fwd(img, gt, save)
        if save:
            ctx.save_for_backward(img, gt, partials)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        img, gt, partials = ctx.saved_tensors
        return extensions.ssim().ssim_bwd(img, gt, partials, grad), None


class _FusedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, img: Tensor, gt: Tensor, ssim_lambda: float,
                valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        save = bool(ctx.needs_input_grad[0])
        loss, ssim_value, l1, partials = extensions.ssim().loss_fwd(img, gt, float(ssim_lambda), save, valid)
        if save:
            ctx.save_for_backward(img, gt, partials)
        ctx.ssim_lambda = float(ssim_lambda)
        ctx.valid = valid
        ctx.mark_non_differentiable(ssim_value, l1)
        return loss, ssim_value, l1

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor, _g_ssim: Tensor, _g_l1: Tensor) -> tuple[Tensor | None, None, None, None]:
        img, gt, partials = ctx.saved_tensors
        return extensions.ssim().loss_bwd(img, gt, partials, grad, ctx.ssim_lambda, ctx.valid), None, None, None


def _fusable(img: Tensor, gt: Tensor) -> bool:
    return (
        img.is_cuda and gt.is_cuda and img.dtype == torch.float32 and gt.dtype == torch.float32
        and img.numel() > 0
    )  # fmt: skip


def fused_photometric_loss(img: Tensor, gt: Tensor, ssim_lambda: float = 0.2,
                           valid: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """losses.photometric_loss in one forward and one backward kernel: L1 and SSIM fused.

    (1 - lambda) L1 + lambda (1 - SSIM) with the 3DGS SSIM; terms come back detached. Inputs
    the kernels do not take (CPU, another dtype) go to the unfused loss. With `valid` ([2] int32
    on the device: width, height) the images are canvases and the loss is the one of their
    top-left valid parts (a CUDA-graph step shared by views of every size); CUDA only.
    """
    if valid is not None:
        if not (img.shape == gt.shape and img.dim() in (3, 4) and _fusable(img, gt)):
            raise ValueError("a loss on a canvas (valid=...) needs float32 CUDA images of one shape")
    elif img.shape != gt.shape or img.dim() not in (3, 4) or not _fusable(img, gt):
        return photometric_loss(img, gt, ssim_lambda)
    if img.dim() == 3:
        img, gt = img.unsqueeze(0), gt.unsqueeze(0)
    loss, ssim_value, l1 = _FusedLoss.apply(img.contiguous(), gt.detach().contiguous(), float(ssim_lambda), valid)
    return loss, {"l1": l1, "ssim": ssim_value, "loss": loss.detach()}


def fused_ssim(img: Tensor, gt: Tensor, window: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA) -> Tensor:
    """Mean SSIM (scalar tensor) of [H,W,C] or [B,H,W,C] images; ssim_conv's contract.

    Float32 CUDA images of at least one pixel take the fused kernels; anything else (CPU,
    another dtype, an empty image) goes to ssim_conv, so an installed fused implementation never
    breaks a caller that scores on the CPU. Only the 3DGS window (11, sigma 1.5) is supported.
    """
    if window != SSIM_WINDOW or float(sigma) != SSIM_SIGMA:
        raise ValueError(f"fused SSIM supports only window={SSIM_WINDOW}, sigma={SSIM_SIGMA}; got {window}, {sigma}")
    if img.shape != gt.shape:
        raise ValueError(f"image shapes differ: {tuple(img.shape)} vs {tuple(gt.shape)}")
    if img.dim() not in (3, 4):
        raise ValueError(f"expected an image [H,W,C] or [B,H,W,C], got shape {tuple(img.shape)}")
    if not _fusable(img, gt):
        return ssim_conv(img, gt, window, sigma)
    if img.dim() == 3:  # views, no copies
        img, gt = img.unsqueeze(0), gt.unsqueeze(0)
    return _FusedSsim.apply(img.contiguous(), gt.detach().contiguous())


def training_loss_for(device: torch.device, fused: bool) -> LossFn:
    """The loss a trainer on `device` trains with: the fused kernels on CUDA when enabled, else
    L1 + SSIM as PyTorch convolutions (photometric_loss).

    The fused extension is built here, before any timed step, so a compile or a missing
    toolchain shows up at start-up rather than inside the first step.
    """
    if fused and torch.device(device).type == "cuda":
        extensions.ssim()
        return fused_photometric_loss
    return photometric_loss
