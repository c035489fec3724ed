"""Per-view corrections: values learned per training view alongside the scene, applied by the step
(train/step.py StepRunner.run) so that every engine that runs StepRunner gets them.

A correction may change a training view's camera before it is rendered (train.pose_refine,
train/pose_refine.py) and/or the rendered image before the loss (an appearance correction), and
takes its own optimizer step after the scene's. StepRunner.corrections is the one list; a
correction that does not touch the camera or the image returns its input unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


class ViewCorrection(Protocol):
    def camera(self, step: int, index: int, viewmat: Tensor) -> Tensor:
        """Training view `index`'s world-to-camera matrix [4,4] as step `step` renders it."""

    def image(self, step: int, index: int, image: Tensor) -> Tensor:
        """Training view `index`'s render [H,W,3] as step `step`'s loss sees it."""

    def optimizer_step(self, step: int) -> None:
        """After the step's backward: update the correction (and clear its gradients)."""


def corrected_camera(corrections: Sequence[ViewCorrection], step: int, index: int | None, viewmat: Tensor) -> Tensor:
    """viewmat through every correction (unchanged for a view that is not a training view's)."""
    if index is None:
        return viewmat
    for correction in corrections:
        viewmat = correction.camera(step, index, viewmat)
    return viewmat


def corrected_image(corrections: Sequence[ViewCorrection], step: int, index: int | None, image: Tensor) -> Tensor:
    """The render through every correction (unchanged for a view that is not a training view's)."""
    if index is None:
        return image
    for correction in corrections:
        image = correction.image(step, index, image)
    return image
