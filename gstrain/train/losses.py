"""The training loss: (1 - lambda) L1 + lambda (1 - SSIM) in plain PyTorch, and its contract.

Images are [H, W, C] (or [B, H, W, C]) float in [0, 1]. Everything stays on the images'
device and never syncs with the host (no .item()), so it can sit inside a timed training step.

SSIM here is gstrain.metrics.ssim_conv, separable Gaussian convolutions in plain PyTorch. The
fused CUDA loss (fused_ssim.py) has the same contract; each StepRunner picks its own with
fused_ssim.training_loss_for (no global switch).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from gstrain.metrics import SSIM_SIGMA, SSIM_WINDOW, ssim_conv

# (img, gt, window, sigma) -> scalar mean SSIM; the same contract as ssim_conv.
SsimImpl = Callable[[Tensor, Tensor, int, float], Tensor]


def l1_loss(img: Tensor, gt: Tensor) -> Tensor:
    return (img - gt).abs().mean()


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
