"""In-memory scene: posed views with their images, and the SfM point cloud."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch


@dataclass
class View:
    """One posed image at the resolution we train on (pinhole, already undistorted)."""

    name: str
    image: torch.Tensor  # [H, W, 3] uint8, CPU
    K: torch.Tensor  # [3, 3] float32 intrinsics for this resolution
    viewmat: torch.Tensor  # [4, 4] float32 world-to-camera (COLMAP convention: x right, y down, z forward)
    mask: torch.Tensor | None = None  # [H, W] bool, True = pixel counts; None = all do (data/masks.py)

    @property
    def width(self) -> int:
        return int(self.image.shape[1])

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    def with_pose(self, viewmat: torch.Tensor) -> View:
        """This view seen from another pose (a refined camera): the same image, intrinsics and mask."""
        return replace(self, viewmat=viewmat)

    @property
    def camera_center(self) -> torch.Tensor:
        """Camera centre in world coordinates, [3]."""
        R = self.viewmat[:3, :3]
        t = self.viewmat[:3, 3]
        return -R.T @ t


@dataclass
class Scene:
    """A loaded scene: train/test split, SfM points, and a scale for learning rates."""

    train: list[View]
    test: list[View]
    points: np.ndarray  # [P, 3] float32, world frame
    point_colors: np.ndarray  # [P, 3] uint8
    extent: float  # radius of the camera centres around their mean, times 1.1 (3DGS convention)
    notes: list[str] = field(default_factory=list)  # things the user should be told (undistortion, ...)
    # False where the input format has no SfM cloud of its own (transforms.json; its ply_file_path is
    # optional): no points then means "start from random points in the view volume", not "the SfM
    # failed", and model.init=random draws there too (train/trainer.py)
    points_expected: bool = True
