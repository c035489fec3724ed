"""Image-quality metrics for test views — PSNR, SSIM and (when it can run offline) LPIPS — and
`evaluate_run`, which renders a run's held-out views and writes metrics.json.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gstrain.errors import UserError
from gstrain.train.losses import psnr, ssim_conv

# torchvision checkpoint file that lpips' backbone loads through torch.hub, per network.
LPIPS_BACKBONE_FILES = {
    "alex": "alexnet-owt-7be5be79.pth",
    "vgg": "vgg16-397923af.pth",
}

LpipsFn = Callable[[Tensor, Tensor], Tensor]

_lpips_cache: dict[tuple[str, str, str], LpipsFn] = {}


def lpips_backbone_path(net: str = "alex") -> Path:
    """Where torch.hub keeps the backbone weights lpips needs for `net`."""
    return Path(torch.hub.get_dir()) / "checkpoints" / LPIPS_BACKBONE_FILES[net]


def load_lpips(device: torch.device | str, net: str = "alex") -> tuple[LpipsFn | None, str | None]:
    """(fn, None) with fn(img, gt) -> scalar LPIPS, or (None, one-line reason) when it cannot run offline.

    Never downloads: the backbone weights must already be in torch hub's cache before anything
    is constructed (lpips ships its own linear-layer weights). Any failure is a reason, not a crash.
    """
    if net not in LPIPS_BACKBONE_FILES:
        return None, f"unknown LPIPS network '{net}' (choose from {', '.join(LPIPS_BACKBONE_FILES)})"
    try:
        import lpips  # optional, not one of our dependencies
    except ImportError as e:
        if e.name == "lpips":
            return None, "lpips package not installed"
        return None, f"lpips package cannot be imported ({e})"
    except Exception as e:  # a broken install must not break evaluation
        return None, f"lpips package cannot be imported ({type(e).__name__}: {e})"

    weights = lpips_backbone_path(net)
    if not weights.is_file():
        return None, f"LPIPS backbone weights not cached offline ({weights} missing)"

    key = (str(torch.device(device)), net, str(weights))
    if key in _lpips_cache:
        return _lpips_cache[key], None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchvision's 'pretrained' deprecation chatter
            model = lpips.LPIPS(net=net, verbose=False).to(device).eval()
    except Exception as e:
        return None, f"LPIPS could not be set up ({type(e).__name__}: {e})"
    for p in model.parameters():
        p.requires_grad_(False)

    def fn(img: Tensor, gt: Tensor) -> Tensor:
        # lpips takes [B,3,H,W]; normalize=True maps [0,1] to its [-1,1] input range.
        a = img.permute(2, 0, 1).unsqueeze(0)
        b = gt.permute(2, 0, 1).unsqueeze(0)
        with torch.no_grad():
            return model(a, b, normalize=True).mean()

    _lpips_cache[key] = fn
    return fn, None


class Metrics:
    """Accumulates per-image PSNR / SSIM / LPIPS and reports their means."""

    def __init__(self, device: torch.device | str, lpips: bool = True, lpips_net: str = "alex") -> None:
        self.device = torch.device(device)
        self.per_image: list[dict[str, float | None]] = []
        self._lpips: LpipsFn | None = None
        self.lpips_note: str | None = "LPIPS disabled"
        if lpips:
            self._lpips, self.lpips_note = load_lpips(self.device, lpips_net)

    @torch.no_grad()
    def add(self, img: Tensor, gt: Tensor) -> dict[str, float | None]:
        """Score one [H,W,3] render against its ground truth; the render is clamped to [0, 1]."""
        if img.shape != gt.shape or img.dim() != 3:
            raise ValueError(f"expected two [H,W,3] images of one shape, got {tuple(img.shape)} "
                             f"and {tuple(gt.shape)}")
        a = img.to(self.device, torch.float32).clamp(0.0, 1.0)
        b = gt.to(self.device, torch.float32)
        row: dict[str, float | None] = {
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


def _finite_or_none(value: Any) -> Any:
    """JSON has no Infinity: a perfect render's PSNR is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def evaluate_run(
    run_dir: Path, device: str = "auto", log: Callable[[str], None] = print, allow_older: bool = False
) -> dict[str, Any]:
    """Render a run's held-out views to <run>/renders/test/ and write <run>/metrics.json."""
    import imageio.v3 as iio

    from gstrain.files import make_dir, write_text_atomic
    from gstrain.run_dir import open_run

    run = open_run(run_dir, device, allow_older=allow_older, log=log)
    scene, dev, renderer, params, state = run.scene, run.device, run.renderer, run.params, run.state
    background, sh_degree = run.background, run.sh_degree  # the degree training had reached
    if not scene.test:
        raise UserError(f"{run.scene_path} has no held-out views (data.test_every={run.cfg.data.test_every})")
    out_dir = run_dir / "renders" / "test"
    make_dir(out_dir)
    metrics = Metrics(dev)
    with torch.no_grad():
        for view in scene.test:
            image, _, _ = renderer(
                params, view.viewmat.to(dev), view.K.to(dev), view.width, view.height, sh_degree, background
            )
            image = image.clamp(0, 1)
            metrics.add(image, view.image.to(dev).float() / 255.0)
            png = (image * 255.0 + 0.5).to(torch.uint8).cpu().numpy()
            iio.imwrite(out_dir / f"{Path(view.name).stem}.png", png)
    summary = metrics.summary()
    result = {
        "step": int(state["step"]),
        "num_views": summary["count"],
        "num_gaussians": int(state["params"]["means"].shape[0]),
        "psnr": _finite_or_none(summary["psnr"]),
        "ssim": summary["ssim"],
        "lpips": summary["lpips"],
        "lpips_note": summary["lpips_note"],
        "per_image": [
            {"name": v.name, **{k: _finite_or_none(x) for k, x in row.items()}}
            for v, row in zip(scene.test, summary["per_image"], strict=True)
        ],
    }
    write_text_atomic(run_dir / "metrics.json", json.dumps(result, indent=2))
    return result
