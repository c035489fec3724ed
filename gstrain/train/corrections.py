"""Per-view corrections: values learned per training view alongside the scene (train.pose_refine,
train/pose_refine.py; train.appearance, train/appearance.py), applied by the step
(train/step.py StepRunner) so that every engine that runs it gets them.

A correction may change a training view's camera before it is rendered (`camera`) and/or its
render before the loss (`image`), and steps its own parameters after the scene's optimizer
(`after_step`). A correction that does not touch the camera or the image returns its input
unchanged; a view that is not a training view's (view.index None) gets nothing. StepRunner.corrections
is the one list, checkpointed under CHECKPOINT_KEY as {name: state_dict}.

A captured CUDA-graph step replays fixed cameras and images with a graph-safe Adam, so it runs no
correction: graph_step.graphs_possible refuses graphs while the list is not empty, and
engine_note says so in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

CHECKPOINT_KEY = "corrections"  # a checkpoint's {correction name: its state_dict}


class ViewCorrection(Protocol):
    name: str  # its key under the checkpoint's CHECKPOINT_KEY (and the config key that turns it on)

    def camera(self, viewmat: Tensor, view: Any, step: int) -> Tensor:
        """The world-to-camera matrix [4,4] step `step` renders training view `view` (a
        step.StepView) through."""

    def image(self, image: Tensor, view: Any) -> Tensor:
        """The render [H,W,3] as the loss compares it with view.gt."""

    def after_step(self, step: int) -> None:
        """After the backward of step `step`: step its own parameters (and clear their gradients)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def corrected_camera(corrections: Sequence[ViewCorrection], viewmat: Tensor, view: Any, step: int) -> Tensor:
    """viewmat through every correction (unchanged for a view that is not a training view's)."""
    if view.index is None:
        return viewmat
    for correction in corrections:
        viewmat = correction.camera(viewmat, view, step)
    return viewmat


def corrected_image(corrections: Sequence[ViewCorrection], image: Tensor, view: Any) -> Tensor:
    """The render through every correction (unchanged for a view that is not a training view's)."""
    if view.index is None:
        return image
    for correction in corrections:
        image = correction.image(image, view)
    return image


def corrections_state(corrections: Sequence[ViewCorrection]) -> dict[str, Any]:
    """The checkpoint entry {CHECKPOINT_KEY: {name: state}}; none: no key (the plain checkpoint)."""
    if not corrections:
        return {}
    return {CHECKPOINT_KEY: {c.name: c.state_dict() for c in corrections}}


def saved_correction(state: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Correction `name`'s state in checkpoint `state` (None: the run did not learn it)."""
    return state.get(CHECKPOINT_KEY, {}).get(name)


def engine_note(corrections: Sequence[ViewCorrection], engine: str) -> str:
    """The one line that says why a run with corrections does not run CUDA graphs."""
    names = ", ".join(f"train.{c.name}" for c in corrections)
    return f"gstrain: note: {names} runs the {engine} step engine (no CUDA graphs with a per-view correction)"
