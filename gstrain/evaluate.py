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
from gstrain.render.sh import sh_degree_at


def _finite_or_none(value: Any) -> Any:
    """JSON has no Infinity: a perfect render's PSNR is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def evaluate_run(run_dir: Path, device: str = "auto", log: Callable[[str], None] = print) -> dict[str, Any]:
    """Render a run's held-out views to <run>/renders/test/ and write <run>/metrics.json."""
    import imageio.v3 as iio

    from gstrain.data.colmap import load_scene
    from gstrain.render import Renderer, resolve_device
    from gstrain.run_dir import load_run
    from gstrain.train.checkpoint import require_checkpoint

    cfg, meta = load_run(run_dir)
    dev = resolve_device(device)
    state = require_checkpoint(run_dir, map_location="cpu")
    scene = load_scene(Path(meta["scene"]), factor=cfg.data.factor, test_every=cfg.data.test_every)
    if not scene.test:
        raise UserError(f"{meta['scene']} has no held-out views (data.test_every={cfg.data.test_every})")
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.to(dev)) for k, v in state["params"].items()})
    renderer = Renderer(cfg.render, dev)
    background = torch.tensor(cfg.data.background, dtype=torch.float32, device=dev)
    # The SH degree active at the checkpoint's step, exactly as training would render it.
    sh_degree = sh_degree_at(int(state["step"]), cfg.train.sh_degree_interval, cfg.model.sh_degree)
    out_dir = run_dir / "renders" / "test"
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = Metrics(dev)
    with torch.no_grad():
        for view in scene.test:
            image, _, _ = renderer(
                params, view.viewmat.to(dev), view.K.to(dev), view.width, view.height, sh_degree, background
            )
            image = image.clamp(0, 1)
            # masks: kept pixels only (ignore) or against the composited target (background)
            gt, keep = metric_target(view.image.to(dev).float() / 255.0, view.mask, cfg.data.mask_mode, background)
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
        "masked_views": sum(v.mask is not None for v in scene.test) if cfg.data.mask_mode == "ignore" else 0,
        "per_image": [
            {"name": v.name, **{k: _finite_or_none(x) for k, x in row.items()}}
            for v, row in zip(scene.test, summary["per_image"], strict=True)
        ],
    }
    (run_dir / "metrics.json").write_text(json.dumps(result, indent=2))
    return result
