"""The context a step engine works on (train/engine.py): named, typed, and nothing else of the
trainer's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gstrain.data.image_store import TrainImages, image_shapes
from gstrain.train.masking import ViewMask
from gstrain.train.step import StepRunner, StepView
from gstrain.train.strategies.base import Strategy
from gstrain.train.timing import PhaseTimer


@dataclass
class TrainViews:
    """The training views: images as uint8 on the training device (a quarter of float32,
    converted per step), cameras (viewmat, K) and masks (None: every pixel).

    images: a list of resident tensors, or TrainImages (data/image_store.py) over the store that
    data.images_on chose, whose indexing fetches one image (host: its copy started a step ahead;
    disk: decoded by workers in the sampler's order). Engines draw through draw(), which
    tells the store what comes next, and read sizes through shapes(), which fetches nothing."""

    images: TrainImages | list[Tensor]
    cams: list[tuple[Tensor, Tensor]]
    masks: list[ViewMask | None]

    def target(self, idx: int) -> Tensor:
        """View idx's image as floats in 0..1."""
        return self.images[idx].float() / 255.0

    def step_view(self, idx: int) -> StepView:
        viewmat, K = self.cams[idx]
        return StepView(viewmat, K, self.target(idx), self.masks[idx], index=idx)

    def draw(self, sampler: Any, count: int = 1) -> list[int]:
        """The next `count` view indices from the sampler. A store fetches their images (kept for
        the step's reads), then starts fetching the views after them, in the order the sampler
        will draw them (ViewSampler.peek)."""
        drawn = [sampler.next() for _ in range(count)]
        if isinstance(self.images, TrainImages):
            for idx in drawn:  # this step's first (the store keeps them for the step's reads)
                self.images[idx]
        self.prefetch(sampler)
        return drawn

    def prefetch(self, sampler: Any, first: Sequence[int] = ()) -> None:
        """Start fetching the views the sampler will draw next (before the first step, so that it
        does not wait for its images either); nothing for resident images. `first`: views read
        again before those (a graph engine's redo of steps already drawn)."""
        if isinstance(self.images, TrainImages):
            self.images.prefetch([*first, *sampler.peek(self.images.lookahead)])

    def shapes(self) -> list[tuple[int, ...]]:
        """Each training image's (H, W, 3), without fetching any."""
        return image_shapes(self.images)


@dataclass
class ShardInfo:
    """What the sharded engine needs of the distributed trainer: this rank, the world size, and
    each batch view's rendering rank (a function of the batch, the same on every rank)."""

    rank: int
    world: int
    homes: Callable[[list[int]], list[int]]


@dataclass
class StepContext:
    """What a step engine reads and updates. The owner (the trainer, or `gstrain profile`) keeps
    it current: `params`, `optimizers` and `scheduler` are replaced when a checkpoint loads or
    Gaussians move between ranks (and the owner then calls the engine's state_replaced())."""

    cfg: Any  # gstrain.config.Config
    device: torch.device
    params: torch.nn.ParameterDict
    optimizers: dict[str, torch.optim.Optimizer]
    scheduler: Any  # the position rate's decay (train/optim.py): step(), rewind(n)
    strategy: Strategy
    runner: StepRunner  # the step's arithmetic: render, loss, backward, Adam, densification
    views: TrainViews
    sampler: Any  # next() -> the next training view's index
    sh_degree: Callable[[int], int]  # the SH degree a step uses
    timer: PhaseTimer
    background: Tensor
    watched: bool = False  # a live viewer reads the parameters between steps (fit --viewer)
    shard: ShardInfo | None = None  # set under torchrun: the sharded engine's
    batch_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # an engine's own set-up values

    @property
    def renderer(self) -> Any:
        return self.runner.renderer

    @property
    def corrections(self) -> list[Any]:
        """The per-view corrections every engine's step applies (corrections.ViewCorrection; the runner's)."""
        return self.runner.corrections
