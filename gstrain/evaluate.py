"""`gstrain eval`: evaluate_run renders a run's held-out views and writes metrics.json (the metrics
themselves are gstrain.metrics).

A test view has no learned appearance correction (train.appearance), so every score comes under
two stated protocols (gstrain/train/appearance.py): `raw` (the top-level psnr, ssim, lpips: the
render as it is) and `fitted_half` (a colour transform fitted on each view's left half by least
squares, the right half scored). The PNGs under renders/test/ are the raw renders."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gstrain.errors import UserError
from gstrain.metrics import Metrics, metric_target
from gstrain.train.appearance import FITTED_HALF_PROTOCOL, RAW_PROTOCOL, fitted_half, scores_right_half


def _finite_or_none(value: Any) -> Any:
    """JSON has no Infinity: a perfect render's PSNR is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def evaluate_run(
    run_dir: Path, device: str = "auto", log: Callable[[str], None] = print, allow_older: bool = False,
    scene: Path | None = None,
) -> dict[str, Any]:
    """Render a run's held-out views to <run>/renders/test/ and write <run>/metrics.json; `scene`:
    the run's scene after a move (run_dir.open_run checks and records it)."""
    import imageio.v3 as iio

    from gstrain.files import make_dir, write_text_atomic
    from gstrain.run_dir import METRICS_FILE, open_run

    run = open_run(run_dir, device, allow_older=allow_older, log=log, scene_path=scene)
    scene, dev, renderer, params, state = run.scene, run.device, run.renderer, run.params, run.state
    background, sh_degree = run.background, run.sh_degree  # the degree training had reached
    if not scene.test:
        raise UserError(f"{run.scene_path} has no held-out views (data.test_every={run.cfg.data.test_every})")
    out_dir = run_dir / "renders" / "test"
    make_dir(out_dir)
    # LPIPS weights are fetched on first use unless GSTRAIN_OFFLINE=1 (the test suite sets it)
    metrics = Metrics(dev, lpips_download=os.environ.get("GSTRAIN_OFFLINE", "") != "1")
    fitted = Metrics(dev, lpips_download=False)  # the weights, if any, are there by now
    fitted_names: list[str] = []
    with torch.no_grad():
        for view in scene.test:
            image, _, _ = renderer(
                params, view.viewmat.to(dev), view.K.to(dev), view.width, view.height, sh_degree, background
            )
            image = image.clamp(0, 1)
            # masks: kept pixels only (ignore) or against the composited target (background)
            gt, keep = metric_target(view.image.to(dev).float() / 255.0, view.mask, run.cfg.data.mask_mode, background)
            metrics.add(image, gt, keep)
            if scores_right_half(keep):  # (a mask may keep nothing of the right half)
                fitted.add(*fitted_half(image, gt, keep))
                fitted_names.append(view.name)
            png = (image * 255.0 + 0.5).to(torch.uint8).cpu().numpy()
            iio.imwrite(out_dir / f"{Path(view.name).stem}.png", png)
    summary, half = metrics.summary(), fitted.summary()
    result = {
        "step": int(state["step"]),
        "num_views": summary["count"],
        "num_gaussians": int(state["params"]["means"].shape[0]),
        "psnr": _finite_or_none(summary["psnr"]),
        "ssim": summary["ssim"],
        "lpips": summary["lpips"],
        "lpips_note": summary["lpips_note"],
        "protocol": RAW_PROTOCOL,  # of psnr, ssim, lpips and per_image
        "appearance": run.cfg.train.appearance,  # what training learned per training image (none for test views)
        "fitted_half": {
            "protocol": FITTED_HALF_PROTOCOL,
            "psnr": _finite_or_none(half["psnr"]), "ssim": half["ssim"], "lpips": half["lpips"],
            "per_image": [
                {"name": name, **{k: _finite_or_none(x) for k, x in row.items()}}
                for name, row in zip(fitted_names, half["per_image"], strict=True)
            ],
        },
        # masks: how many test views were scored on their kept pixels only (data.mask_mode=ignore)
        "masked_views": sum(v.mask is not None for v in scene.test) if run.cfg.data.mask_mode == "ignore" else 0,
        "per_image": [
            {"name": v.name, **{k: _finite_or_none(x) for k, x in row.items()}}
            for v, row in zip(scene.test, summary["per_image"], strict=True)
        ],
    }
    write_text_atomic(run_dir / METRICS_FILE, json.dumps(result, indent=2))
    return result
