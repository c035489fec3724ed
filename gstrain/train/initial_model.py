"""The model a run starts from: one Gaussian per SfM point, or random points where there are none
(model.init=random, or a format without a point cloud)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from gstrain.data.view_volume import view_volume_points
from gstrain.errors import UserError
from gstrain.model import init_gaussians, random_points


def initial_params(cfg: Any, scene: Any, device: torch.device, log: Callable[[str], None] = print,
                   ) -> torch.nn.ParameterDict:  # fmt: skip
    """The run's first parameters from `scene` (its SfM points, or random ones) under cfg.model."""
    model, points, colors = cfg.model, scene.points, scene.point_colors
    if model.init == "random" or len(points) == 0:
        if model.init != "random" and scene.points_expected:
            raise UserError(
                "the sparse model has no 3D points; pass --set model.init=random to start from random points"
            )
        if scene.points_expected:  # a ball around the cameras (unchanged, so runs repeat)
            centers = np.stack([v.camera_center.numpy() for v in scene.train])
            points, colors = random_points(model.init_points, centers.mean(axis=0), scene.extent, seed=cfg.train.seed)
        else:  # a format without a point cloud (transforms.json): where the cameras look
            points, colors = view_volume_points(scene.train, model.init_points, scene.extent, cfg.train.seed)
        log(f"gstrain: initialising {model.init_points} random Gaussians (no SfM points used)")
    return init_gaussians(
        points, colors, sh_degree=model.sh_degree, init_opacity=model.init_opacity,
        init_scale=model.init_scale, device=device,
    )
