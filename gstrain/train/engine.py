"""Step engines: how one training step runs, chosen once at set-up; the loop (train/trainer.py)
is the same for all of them.

An engine gets a StepContext: the named things a step reads and updates (parameters,
optimizers, rate schedule, strategy, renderer, the training views and their order, the SH
schedule, the phase timer, the background). It never sees the trainer, and never reaches back
into the loop: a step returns a StepResult, and the loop decides what to read, log and save.

The engines (ENGINES names the module of each; a new engine is a module and a line there):
  eager    one view a step, every kernel launched from Python (train/step.py)
  batch    train.batch_size views a step, one backward and one optimizer step (train/step.py)
  graph    train.batch_size views a step (the eager or batch step's function), replayed as a
           CUDA graph where it may (train/graph_step.py)
  sharded  each rank renders its share of the batch from records every owner sends
           (gstrain/distributed/sharded_step.py); only under torchrun with more than one rank
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from gstrain.train.context import StepContext
from gstrain.train.graph_step import graphs_possible
from gstrain.train.step import StepResult

ENGINES = {  # name -> "module:class"; every class takes (StepContext) and follows StepEngine
    "eager": "gstrain.train.engine:EagerEngine",
    "batch": "gstrain.train.engine:EagerEngine",  # the eager engine on train.batch_size views
    "graph": "gstrain.train.graph_step:GraphEngine",
    "sharded": "gstrain.distributed.sharded_step:ShardedEngine",
}


class StepEngine(Protocol):
    """One training step at a time, on the context it was built with."""

    name: str

    def step(self, step: int) -> StepResult:
        """Run step `step` (0-based) on the next view(s) of ctx.sampler."""

    def settle(self) -> StepResult | None:
        """Make every step so far exact before the loop reads anything; a redone last step's
        result, or None."""

    def state_replaced(self) -> None:
        """The context's tensors were replaced (a checkpoint, a migration)."""

    def summary(self) -> dict[str, Any] | None:
        """For the run record: how the steps ran (None: nothing to say)."""

    def pair_totals(self) -> tuple[int, int, int] | None:
        """Pairs the engine counted itself, not in the StepResults (None: none)."""


class UncapturedEngine:
    """What an engine that launches every step from Python says to the loop: nothing to settle,
    nothing held of the context's tensors, no summary or pair counts of its own."""

    def settle(self) -> StepResult | None:
        return None

    def state_replaced(self) -> None:
        pass

    def summary(self) -> dict[str, Any] | None:
        return None

    def pair_totals(self) -> tuple[int, int, int] | None:
        return None


class EagerEngine(UncapturedEngine):
    """train.batch_size views a step (one for the single-view step), every kernel launched from
    Python: StepRunner.run."""

    name = "eager"

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.name = "batch" if ctx.batch_size > 1 else "eager"

    def step(self, step: int) -> StepResult:
        ctx = self.ctx
        with ctx.timer.phase("data"):
            views = [ctx.views.step_view(idx) for idx in ctx.views.draw(ctx.sampler, ctx.batch_size)]
        return ctx.runner.run(ctx.params, ctx.optimizers, step, views, ctx.sh_degree(step), ctx.background,
                              scheduler=ctx.scheduler)  # fmt: skip


def choose_engine(ctx: StepContext) -> str:
    """The engine this set-up runs: sharded across several ranks, the CUDA-graph engine where
    dev.cuda_graphs applies (graph_step.graphs_possible; any batch size), else eager (batch for
    B > 1). One rank under torchrun owns every Gaussian: the sharded step would be the plain step
    with an exchange to itself, so it runs the plain engines."""
    if ctx.shard is not None and ctx.shard.world > 1:
        return "sharded"
    if graphs_possible(ctx.cfg, ctx.renderer, ctx.runner, ctx.device):  # (none with a non-graph-safe correction)
        return "graph"
    return "batch" if ctx.batch_size > 1 else "eager"


def build_engine(name: str, ctx: StepContext) -> StepEngine:
    """The engine `name` (a key of ENGINES) on `ctx`."""
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(ctx)
