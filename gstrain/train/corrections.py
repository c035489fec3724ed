"""Per-view corrections: values learned per training view alongside the scene (train.pose_refine,
train/pose_refine.py; train.appearance, train/appearance.py), applied by the step
(train/step.py StepRunner) so that every engine that runs it gets them.

A correction may change a training view's camera before it is rendered (`camera`) and/or its
render before the loss (`image`), and steps its own parameters after the scene's optimizer
(`after_step`). A correction that does not touch the camera or the image returns its input
unchanged; a view that is not a training view's (view.index and view.slot None) gets nothing. StepRunner.corrections
is the one list, checkpointed under CHECKPOINT_KEY as {name: state_dict}.

Under the CUDA-graph engine (train/graph_step.py) a captured step replays fixed kernels, so a
correction runs there only if it is `graph_safe`: it reads the training view's index from the
device (view.slot) and steps its parameters from device scalars the host refills before each
replay (advance; rewind for the replays a redo repeats; set_skip_flag while a step is captured),
and says through graph_key what a captured step bakes in of it. graph_step.graphs_possible
refuses graphs while any correction is not graph-safe, and engine_note names those in one line.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from torch import Tensor

CHECKPOINT_KEY = "corrections"  # a checkpoint's {correction name: its state_dict}


class ViewCorrection(Protocol):
    name: str  # its key under the checkpoint's CHECKPOINT_KEY (and the config key that turns it on)
    graph_safe: bool  # a CUDA graph may capture its step (the four methods below)

    def camera(self, viewmat: Tensor, view: Any, step: int) -> Tensor:
        """The world-to-camera matrix [4,4] step `step` renders training view `view` (a
        step.StepView) through."""

    def image(self, image: Tensor, view: Any) -> Tensor:
        """The render [H,W,3] as the loss compares it with view.gt."""

    def after_step(self, step: int) -> None:
        """After the backward of step `step`: step its own parameters (and clear their gradients)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def graph_key(self, step: int) -> Hashable:
        """What a captured step `step` bakes in of it: a change starts a new graph epoch."""

    def advance(self, step: int) -> None:
        """Host, before each replay of step `step`: count its optimizer step and fill its device scalars."""

    def rewind(self, steps: Sequence[int]) -> None:
        """Take back advance()'s counts of replayed `steps` whose updates were skipped (a redo repeats them)."""

    def set_skip_flag(self, flag: Tensor | None) -> None:
        """A capture of the step begins (flag: [1] int on the device, its update a no-op while
        not 0) or ends (None)."""


def is_training_view(view: Any) -> bool:
    """Whether a step's view is a training view's: its index on the host, or (a captured step) on the device."""
    return view.index is not None or getattr(view, "slot", None) is not None


def corrected_camera(corrections: Sequence[ViewCorrection], viewmat: Tensor, view: Any, step: int) -> Tensor:
    """viewmat through every correction (unchanged for a view that is not a training view's)."""
    if not is_training_view(view):
        return viewmat
    for correction in corrections:
        viewmat = correction.camera(viewmat, view, step)
    return viewmat


def corrected_image(corrections: Sequence[ViewCorrection], image: Tensor, view: Any) -> Tensor:
    """The render through every correction (unchanged for a view that is not a training view's)."""
    if not is_training_view(view):
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


def graph_refusers(corrections: Sequence[ViewCorrection]) -> list[ViewCorrection]:
    """The corrections that keep the step out of CUDA graphs (none: graphs may run)."""
    return [c for c in corrections if not c.graph_safe]


def graph_key(corrections: Sequence[ViewCorrection], step: int) -> tuple:
    """What a captured step `step` bakes in of every correction (graph_step's epoch key)."""
    return tuple(c.graph_key(step) for c in corrections)


def advance(corrections: Sequence[ViewCorrection], step: int) -> None:
    """Before a replay of step `step`: every correction counts its step and fills its device scalars."""
    for c in corrections:
        c.advance(step)


def rewind(corrections: Sequence[ViewCorrection], steps: Sequence[int]) -> None:
    """A redo repeats the replays of `steps`: every correction takes back their counts."""
    for c in corrections:
        c.rewind(steps)


def set_skip_flag(corrections: Sequence[ViewCorrection], flag: Tensor | None) -> None:
    """A capture begins (the overflow flag that turns the updates into no-ops) or ends (None)."""
    for c in corrections:
        c.set_skip_flag(flag)


def engine_note(corrections: Sequence[ViewCorrection], engine: str) -> str:
    """The one line that says which corrections keep the run off CUDA graphs (graph_refusers)."""
    names = ", ".join(f"train.{c.name}" for c in graph_refusers(corrections))
    return f"gstrain: note: {names} runs the {engine} step engine (no CUDA graphs with this per-view correction)"
