"""`gstrain eval`: evaluate_run renders a run's held-out views and writes metrics.json (the metrics
themselves are gstrain.metrics)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gstrain.errors import UserError
from gstrain.metrics import Metrics, metric_target


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
    from gstrain.run_dir import open_run

    run = open_run(run_dir, device, allow_older=allow_older, log=log, scene_path=scene)
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
            # masks: kept pixels only (ignore) or against the composited target (background)
            gt, keep = metric_target(view.image.to(dev).float() / 255.0, view.mask, run.cfg.data.mask_mode, background)
            metrics.add(image, gt, keep)
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
        # masks: how many test views were scored on their kept pixels only (data.mask_mode=ignore)
        "masked_views": sum(v.mask is not None for v in scene.test) if run.cfg.data.mask_mode == "ignore" else 0,
        "per_image": [
            {"name": v.name, **{k: _finite_or_none(x) for k, x in row.items()}}
            for v, row in zip(scene.test, summary["per_image"], strict=True)
        ],
    }
    write_text_atomic(run_dir / "metrics.json", json.dumps(result, indent=2))
    return result
