"""The fused SSIM kernels against ssim_conv in float64, and how the trainer picks an SSIM.

GPU tests (marked `cuda`) check the value and the gradient on random and structured images of
awkward sizes, identical images, that gt gets no gradient, and the fused loss against
photometric_loss. The CPU tests check which loss a trainer picks, and the fallbacks, without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gstrain import extensions
from gstrain.config import build_config
from gstrain.data.colmap import load_scene
from gstrain.metrics import ssim_conv
from gstrain.train.fused_ssim import fused_photometric_loss, fused_ssim, training_loss_for
from gstrain.train.losses import photometric_loss
from gstrain.train.trainer import Trainer

VALUE_TOL = 1e-5  # relative error of the mean SSIM
GRAD_TOL = 1e-4  # relative L2 error of dSSIM/dimg

SIZES = [(1, 1), (7, 9), (64, 64), (100, 37), (720, 1280)]


def rel_err(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite values"
    return (a - b).norm().item() / max(b.norm().item(), 1e-30)


def random_pair(h: int, w: int, c: int = 3, batch: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A render and a noisy version of it (independent images would give SSIM near 0)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (h, w, c) if batch is None else (batch, h, w, c)
    img = torch.rand(shape, generator=gen)
    gt = (img + 0.1 * torch.randn(shape, generator=gen)).clamp(0, 1)
    return img, gt


def structured_pair(h: int, w: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Smooth shading, a hard-edged disc and a flat background; gt is shifted by a pixel, noisy
    and 8-bit quantised, as a photo against a render."""
    gen = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    base = torch.stack([0.5 + 0.4 * torch.sin(6 * xx + 3 * yy), xx * yy, 0.3 + 0.2 * torch.cos(9 * yy)], -1)
    disc = ((xx - 0.5) ** 2 + (yy - 0.5) ** 2 < 0.08).float()[..., None]
    img = base * (1 - disc) + disc * torch.tensor([0.9, 0.2, 0.1])
    img[: h // 5] = 0.0
    gt = (img.roll(1, dims=1) + 0.02 * torch.randn(h, w, 3, generator=gen)).clamp(0, 1)
    return img, torch.round(gt * 255) / 255


def reference(img: Tensor, gt: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """ssim_conv in float64 (on the images' device): value and d(scale * SSIM)/dimg."""
    x = img.detach().double().requires_grad_(True)
    value = ssim_conv(x, gt.double())
    (scale * value).backward()
    assert x.grad is not None
    return value.detach(), x.grad


def fused_value_grad(img: Tensor, gt: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    x = img.detach().clone().requires_grad_(True)
    value = fused_ssim(x, gt)
    (scale * value).backward()
    assert x.grad is not None
    return value.detach(), x.grad


def check_against_reference(img: Tensor, gt: Tensor, scale: float = 1.0) -> None:
    img, gt = img.cuda(), gt.cuda()
    want_v, want_g = reference(img, gt, scale)
    got_v, got_g = fused_value_grad(img, gt, scale)
    assert got_v.dim() == 0 and got_v.dtype == torch.float32
    assert got_g.shape == img.shape and got_g.dtype == torch.float32
    v_err = abs(got_v.item() - want_v.item()) / abs(want_v.item())
    assert v_err < VALUE_TOL, f"value {got_v.item()} vs {want_v.item()}: relative error {v_err:.3g}"
    g_err = rel_err(got_g, want_g)
    assert g_err < GRAD_TOL, f"gradient: relative error {g_err:.3g}"


# ----------------------------------------------------------------------------- GPU


@pytest.mark.cuda
class TestFusedSsimCuda:
    @pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
    def test_random_matches_reference(self, size):
        check_against_reference(*random_pair(*size))

    @pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
    def test_structured_matches_reference(self, size):
        check_against_reference(*structured_pair(*size))

    def test_batch_other_channel_counts_and_upstream_gradient(self):
        check_against_reference(*random_pair(30, 50, c=1, batch=2, seed=1))
        check_against_reference(*random_pair(20, 45, c=4, seed=2), scale=-2.5)
        check_against_reference(*random_pair(17, 33, c=3, batch=3, seed=3), scale=0.2)

    def test_identical_images_give_one_and_zero_gradient(self):
        img, _ = random_pair(37, 45, seed=4)
        img = img.cuda()
        x = img.clone().requires_grad_(True)
        value = fused_ssim(x, img.clone())
        value.backward()
        assert abs(value.item() - 1.0) < 1e-6
        assert x.grad is not None
        # zero up to float32 rounding of terms of size ~1/C2, relative to the 1/N of a mean
        assert x.grad.abs().max().item() * img.numel() < 1e-3

    def test_gt_gets_no_gradient(self):
        img, gt = (t.cuda() for t in random_pair(24, 40, seed=5))
        x = img.clone().requires_grad_(True)
        y = gt.clone().requires_grad_(True)
        fused_ssim(x, y).backward()
        assert x.grad is not None and y.grad is None

    def test_without_grad_and_non_contiguous(self):
        img, gt = (t.cuda() for t in random_pair(40, 24, seed=6))
        want = reference(img, gt)[0].item()
        with torch.no_grad():
            assert abs(fused_ssim(img, gt).item() - want) / want < VALUE_TOL
        # a [W,H,C] transpose is a non-contiguous view; transposing both keeps SSIM's value
        xt, yt = img.transpose(0, 1), gt.transpose(0, 1)
        assert not xt.is_contiguous()
        check_against_reference(xt, yt)

    def test_photometric_loss_with_fused_matches_conv(self):
        img, gt = (t.cuda() for t in structured_pair(120, 90, seed=7))
        results = []
        # cuDNN may run float32 convolutions in TF32 (PyTorch's default): compare with full float32
        allow_tf32 = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        try:
            for impl in (ssim_conv, fused_ssim):
                x = img.clone().requires_grad_(True)
                loss, terms = photometric_loss(x, gt, ssim_lambda=0.2, ssim_fn=impl)
                loss.backward()
                results.append((loss.detach(), terms["ssim"], x.grad))
        finally:
            torch.backends.cudnn.allow_tf32 = allow_tf32
        (conv_loss, conv_ssim, conv_grad), (fused_loss, fused_s, fused_grad) = results
        assert abs(fused_loss.item() - conv_loss.item()) / conv_loss.item() < VALUE_TOL
        assert abs(fused_s.item() - conv_ssim.item()) / conv_ssim.item() < VALUE_TOL
        assert rel_err(fused_grad, conv_grad) < GRAD_TOL

    @pytest.mark.parametrize("lam", [0.0, 0.2, 1.0])
    def test_fused_loss_matches_unfused_in_float64(self, lam):
        img, gt = structured_pair(75, 130, seed=11)
        gt[:10, :10] = img[:10, :10]  # equal pixels: |x - y| has gradient 0 there, as in torch
        x64 = img.double().requires_grad_(True)
        want, want_terms = photometric_loss(x64, gt.double(), lam)  # ssim_conv in float64
        want.backward()
        x = img.cuda().requires_grad_(True)
        got, terms = fused_photometric_loss(x, gt.cuda(), lam)
        got.backward()
        assert abs(got.item() - want.item()) <= VALUE_TOL * max(abs(want.item()), 1e-3)
        for key in ("l1", "ssim"):
            assert abs(terms[key].item() - want_terms[key].item()) <= VALUE_TOL * abs(want_terms[key].item())
            assert not terms[key].requires_grad
        assert rel_err(x.grad, x64.grad) < GRAD_TOL
        if lam == 0.0:  # pure L1: no gradient where the render already equals the photo
            assert x.grad[:10, :10].abs().max().item() == 0.0

    def test_fused_loss_batched(self):
        img, gt = (t.cuda() for t in random_pair(33, 47, batch=2, seed=5))
        fused, _ = fused_photometric_loss(img, gt, 0.3)
        plain, _ = photometric_loss(img.double(), gt.double(), 0.3)
        assert abs(fused.item() - plain.item()) < VALUE_TOL * plain.item()

    def test_each_cuda_trainer_keeps_its_own_loss(self, demo_scene, tmp_path):
        scene = load_scene(demo_scene)
        trainers = {}
        for enabled in (True, False):
            cfg = build_config(overrides=[{"train": {"steps": 1}, "dev": {"fused_ssim": enabled}}])
            trainers[enabled] = Trainer(cfg, scene, tmp_path / f"run_{enabled}", torch.device("cuda"),
                                        log=lambda m: None)  # fmt: skip
        # the conv trainer, built second, leaves the fused one's loss alone
        assert trainers[True].runner.loss_fn is fused_photometric_loss
        assert trainers[False].runner.loss_fn is photometric_loss
        for trainer in trainers.values():
            loss, _, _, _ = trainer.train_step(0)
            assert torch.isfinite(loss)


# ----------------------------------------------------------------------------- CPU


def test_loss_choice_by_device_and_flag_builds_only_for_the_fused_one(monkeypatch):
    builds = []
    monkeypatch.setattr(extensions, "ssim", lambda: builds.append(1))
    assert training_loss_for(torch.device("cuda"), True) is fused_photometric_loss and builds == [1]
    assert training_loss_for(torch.device("cuda", 0), True) is fused_photometric_loss and builds == [1, 1]
    assert training_loss_for(torch.device("cuda"), False) is photometric_loss
    assert training_loss_for(torch.device("cpu"), True) is photometric_loss
    assert training_loss_for(torch.device("cpu"), False) is photometric_loss
    assert builds == [1, 1]


def test_trainer_on_cpu_trains_with_the_conv_loss(demo_scene, tmp_path):
    scene = load_scene(demo_scene)
    cfg = build_config(overrides=[{"train": {"steps": 1}, "dev": {"fused_ssim": True}}])  # asked for; the CPU cannot
    trainer = Trainer(cfg, scene, tmp_path / "a", torch.device("cpu"), log=lambda m: None)
    assert trainer.runner.loss_fn is photometric_loss


def test_only_the_3dgs_window_is_supported():
    img, gt = random_pair(8, 8)
    with pytest.raises(ValueError, match="window=11"):
        fused_ssim(img, gt, window=7)
    with pytest.raises(ValueError, match="sigma=1.5"):
        fused_ssim(img, gt, 11, 2.0)
    with pytest.raises(ValueError, match="shapes differ"):
        fused_ssim(img, gt[:4])


def _ssim_by_definition(img: Tensor, gt: Tensor) -> float:
    """Mean SSIM straight from its definition, in numpy float64: for every pixel, the 11x11
    Gaussian-weighted (sigma 1.5) means, variances and covariance over the window, with pixels
    outside the image counted as zeros (3DGS's zero padding); C1 = 0.01^2, C2 = 0.03^2."""
    import numpy as np

    a, b = img.double().numpy(), gt.double().numpy()
    h, w, c = a.shape
    r = np.arange(11) - 5
    g = np.exp(-(r**2) / (2 * 1.5**2))
    weights = np.outer(g, g) / np.outer(g, g).sum()
    pa, pb = np.pad(a, ((5, 5), (5, 5), (0, 0))), np.pad(b, ((5, 5), (5, 5), (0, 0)))
    total = 0.0
    for i in range(h):
        for j in range(w):
            for k in range(c):
                x, y = pa[i:i + 11, j:j + 11, k], pb[i:i + 11, j:j + 11, k]
                mx, my = (weights * x).sum(), (weights * y).sum()
                vx, vy = (weights * x * x).sum() - mx * mx, (weights * y * y).sum() - my * my
                cov = (weights * x * y).sum() - mx * my
                total += ((2 * mx * my + 0.01**2) * (2 * cov + 0.03**2)
                          / ((mx * mx + my * my + 0.01**2) * (vx + vy + 0.03**2)))
    return total / (h * w * c)


def test_cpu_images_fall_back_to_conv():
    img, gt = random_pair(12, 10)
    x = img.clone().requires_grad_(True)
    value = fused_ssim(x, gt)
    value.backward()
    assert abs(value.item() - _ssim_by_definition(img, gt)) < 1e-6  # an independent SSIM
    # the gradient: against central differences of the definition at a few pixels
    for (i, j, k) in [(0, 0, 0), (5, 4, 1), (11, 9, 2)]:
        eps = 1e-4
        up, down = img.clone(), img.clone()
        up[i, j, k] += eps
        down[i, j, k] -= eps
        numeric = (_ssim_by_definition(up, gt) - _ssim_by_definition(down, gt)) / (2 * eps)
        assert abs(x.grad[i, j, k].item() - numeric) < 1e-3 * abs(numeric) + 1e-7, (i, j, k, numeric)
