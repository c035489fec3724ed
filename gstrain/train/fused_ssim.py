"""Fused SSIM on the GPU: the value and gradient of losses.ssim_conv from two CUDA kernels.

The forward filters the five moments in shared-memory tiles and keeps, per pixel, dSSIM/dmu1,
dSSIM/dsigma1^2 and dSSIM/dsigma12; the backward is one more Gaussian filtering of those three
maps (csrc/fused_ssim.cu). The same 3DGS definition as ssim_conv: 11x11 Gaussian window with
sigma 1.5, zero padding, same-size map, mean over pixels and channels.

The extension (gstrain_ssim) is compiled on first use. Only `img` gets a gradient; `gt` is
treated as a constant.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from gstrain.cuda_build import load_extension
from gstrain.train.losses import SsimImpl, set_ssim_impl, ssim_conv

WINDOW = 11
SIGMA = 1.5

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCE_PATHS = (_CSRC / "bindings.cpp", _CSRC / "fused_ssim.cu")
_HEADER_PATHS = (_CSRC / "fused_ssim.h",)


def ensure_built() -> ModuleType:
    """Build (first use only) and load gstrain_ssim; UserError when this machine cannot."""
    return load_extension(
        "gstrain_ssim", _SOURCE_PATHS, _HEADER_PATHS,
        what="the fused SSIM kernel", alternative="set train.fused_ssim=false",
    )  # fmt: skip


class _FusedSsim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, img: Tensor, gt: Tensor) -> Tensor:
        save = bool(ctx.needs_input_grad[0])
        value, partials = ensure_built().ssim_fwd(img, gt, save)
        if save:
            ctx.save_for_backward(img, gt, partials)
        return value

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        img, gt, partials = ctx.saved_tensors
        return ensure_built().ssim_bwd(img, gt, partials, grad), None


def fused_ssim(img: Tensor, gt: Tensor, window: int = WINDOW, sigma: float = SIGMA) -> Tensor:
    """Mean SSIM (scalar tensor) of [H,W,C] or [B,H,W,C] images; ssim_conv's contract.

    Float32 CUDA images of at least one pixel take the fused kernels; anything else (CPU,
    another dtype, an empty image) goes to ssim_conv, so an installed fused implementation never
    breaks a caller that scores on the CPU. Only the 3DGS window (11, sigma 1.5) is supported.
    """
    if window != WINDOW or float(sigma) != SIGMA:
        raise ValueError(f"fused SSIM supports only window={WINDOW}, sigma={SIGMA}; got {window}, {sigma}")
    if img.shape != gt.shape:
        raise ValueError(f"image shapes differ: {tuple(img.shape)} vs {tuple(gt.shape)}")
    if img.dim() not in (3, 4):
        raise ValueError(f"expected an image [H,W,C] or [B,H,W,C], got shape {tuple(img.shape)}")
    fused = (
        img.is_cuda and gt.is_cuda and img.dtype == torch.float32 and gt.dtype == torch.float32
        and img.numel() > 0
    )  # fmt: skip
    if not fused:
        return ssim_conv(img, gt, window, sigma)
    if img.dim() == 3:  # views, no copies
        img, gt = img.unsqueeze(0), gt.unsqueeze(0)
    return _FusedSsim.apply(img.contiguous(), gt.detach().contiguous())


def ssim_impl_for(device: torch.device, enabled: bool) -> SsimImpl:
    """The SSIM a trainer on `device` uses: fused on CUDA when enabled, else the convolutions."""
    return fused_ssim if enabled and torch.device(device).type == "cuda" else ssim_conv


def install_ssim_impl(device: torch.device, enabled: bool) -> SsimImpl:
    """Choose and install (set_ssim_impl) the SSIM for `device`; returns it.

    The fused extension is built here, before any timed step, so a compile or a missing
    toolchain shows up at start-up rather than inside the first step.
    """
    impl = ssim_impl_for(device, enabled)
    if impl is fused_ssim:
        ensure_built()
    set_ssim_impl(impl)
    return impl
