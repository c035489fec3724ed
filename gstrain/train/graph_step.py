"""dev.cuda_graphs: training steps replayed as one CUDA graph each.

Why: near 3 ms a step on an H200 the step is bound by the host issuing ~60 kernels through
Python (bench/trace_step.py), not by the GPU. A captured graph replays the whole step
(projection, intersection, both raster passes, loss, backward, Adam, statistics) in one launch.
A step trains on B = train.batch_size views (one, or a batch: each view's render and loss, their
mean, one backward, one Adam step, statistics with n_cameras=B, as train/step.py's batch step).

What a graph freezes, and how each is handled:
- shapes and addresses: the intersection is sync-free into fixed-capacity buffers
  (render/isect.PairBudget); parameters, Adam moments and statistics keep their storage between
  densifications. An epoch lasts while those addresses, the SH degree and ARC's threshold stay
  the same, and its graphs are dropped when it ends. The image size: gsplat's projection bakes it
  in, so with one graph per size (a batch: per tuple of its views' sizes) a scene whose views
  differ in size (beer: 35 sizes for 62 views) captures one graph per size per epoch, and
  captures bound the run while it refines. With the fused loss the step runs instead on a canvas
  of the largest size, each view in the top-left corner of its batch slot and its size on the
  device (render/sized_projection.py, the intersection and the loss read it), so one graph serves
  every size. Pair capacity: the sort covers a graph's whole capacity, so each group of views has
  its own, from the most pairs it has had, and on the canvas views share a graph per capacity
  class (train/graph_capacity.py);
- per-step values: Adam's step sizes and bias corrections come from a device tensor refilled
  before each replay (fused_adam.advance); each slot's camera, image and device ints (width,
  height, view index: on the canvas its size and statistics row) are copied into the graph's
  inputs, and each slot's view carries its own pair budget and valid size to the renderer. A
  graph-safe per-view correction (train/corrections.py; train.appearance, train.pose_refine)
  reads the view's index from the device (StepView.slot) and refills its own Adam scalars
  (corrections.advance); one that is not would keep the run off graphs (graphs_possible);
- the rest runs eagerly: steps where the strategy refines or resets, timed steps
  (dev.time_every), ARC's tuning calls, masked views (any of a batch's), the first step, and a
  graph key's first CAPTURE_AFTER steps of an epoch (none: a capture costs the host about what an
  eager step does, bench/graph_study.py).
Exactness: a view whose pairs overflow the capacity sets the budget's sticky flag, and Adam and
the statistics are no-ops while it is set. Before the host reads anything (settle()), it checks
the flag and redoes the steps from the first overflowed one, the overflowed groups' capacities
grown to fit. A graph step computes the eager step's function (tests/test_graph_cuda.py checks
it on a GPU, tests/test_graph_step.py the policy and the redo's bookkeeping on the CPU); a
canvas step equals the step at the view's own size within float tolerance
(tests/test_sized_projection_cuda.py).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from gstrain.render.isect import PairBudget
from gstrain.train import corrections, fused_adam
from gstrain.train.context import StepContext
from gstrain.train.graph_capacity import CAPACITY_MARGIN, PairGroups, canvas_of
from gstrain.train.memory_budget import GIB, cache_crowds_headroom
from gstrain.train.step import StepResult, StepView

INFLIGHT = 8  # replays the host may run ahead of the GPU (pinned scalar buffers in a ring)
MAX_UNSETTLED = 200  # steps between flag checks at most (a redo repeats them)
CAPTURE_AFTER = 0  # eager steps of a graph's key in an epoch before it is captured
# Under a memory budget (train.max_memory_gib), eager steps before which the epoch's graphs are
# dropped: the graphs' pool holds a whole step's gradients and buffers, idle while an eager step
# allocates its own beside it (the peak of a graph run). A refinement or reset that changes the
# model ends the epoch anyway (new tensors); one that changes nothing, a timed step (one in
# dev.time_every) or an ARC round costs the captures after it, a few per cent of the step time,
# which is why runs without a budget keep their graphs. Masked views keep the graphs: they
# interleave with graph steps.
DROP_GRAPHS_FOR = ("strategy", "timed", "arc_tuning")


@dataclass
class _Graph:
    """One captured step (an image size's or a batch's sizes', or a capacity class's on the
    canvas): the graph and its static outputs."""

    graph: torch.cuda.CUDAGraph
    outputs: StepResult
    capacities: tuple[int, ...]  # each batch slot's pair capacity it was captured with


class GraphEngine:
    """The graph step engine (train/engine.py): steps of train.batch_size views on a StepContext,
    replaying a captured graph where it may (see the module docstring).

    A graph is per image size (a batch: per tuple of sizes), or on the canvas per capacity class
    (see the module docstring); the graphs of one epoch (the stretch between two changes of
    _epoch_key) share one memory pool, which is safe because every replay's outputs are read
    before the next. A graph's key is captured once it has come up CAPTURE_AFTER times in the
    epoch. Pair statistics and capacities are kept per group (graph_capacity.PairGroups)."""

    name = "graph"

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.device = ctx.device
        self.batch = max(1, int(ctx.batch_size))  # views a step: the graph's slots
        # Adam's pairs and step counts (fused_adam.graph_scalars), then the step's tag
        n_scalars = fused_adam.graph_scalars(len(ctx.optimizers)) + 1
        self.scalars = torch.zeros(n_scalars, device=self.device)
        self.counts_steps = ctx.cfg.optim.moments != "fp32"
        # the tag and flag every slot's budget shares (its capacity unused: each slot has its own)
        self.budget = PairBudget.on(self.device, 0, tag=self.scalars[-1:])
        self.shapes = ctx.views.shapes()  # read once: a store's shapes come without fetching
        self.canvas = canvas_of(self.shapes, bool(ctx.cfg.dev.fused_ssim))
        self.groups = PairGroups(self.shapes, self.canvas, self.device)
        on_gpu = self.device.type == "cuda"  # (the policy and the bookkeeping also run on the CPU, in tests)
        # per batch slot: its view's width, height and index, refilled before each replay (on the
        # canvas the first two are the valid size, the index picks the statistics row)
        self.view_ints = torch.zeros((self.batch, 3), dtype=torch.int32, device=self.device)
        self.pinned_ints = torch.zeros((INFLIGHT, self.batch, 3), dtype=torch.int32, pin_memory=on_gpu)
        self.pinned = torch.zeros((INFLIGHT, n_scalars), pin_memory=on_gpu)
        self.slot_done: list[torch.cuda.Event | None] = [None] * INFLIGHT
        self.slot = 0
        self.stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.epoch: tuple | None = None
        self.graphs: dict[Any, _Graph] = {}  # this epoch's, by graph key (PairGroups.graph_key)
        self.seen: dict[Any, int] = {}  # graph-safe steps per graph key in this epoch
        self.pool: Any = None
        self.inputs: dict[tuple, list[dict[str, Tensor]]] = {}  # per the slots' shapes: each slot's inputs
        self.image_buffer: Tensor | None = None  # every slot's image inputs: views of one buffer
        self.cameras: list[dict[str, Tensor]] = []  # per slot
        self.unsettled: list[tuple[int, tuple[int, ...]]] = []  # (step, its views) replayed since the last settle
        self.warm = False  # an eager step has run (lazily made state exists)
        self.views = 0  # views of settled graph steps: the views pair_sum counts
        self.captures = 0
        self.redos = 0
        self.redone_steps = 0  # replays repeated by redos (the cost of an overflow)
        self.pool_drops = 0  # epochs ended early for an eager step (DROP_GRAPHS_FOR)
        self.drop_for = DROP_GRAPHS_FOR if ctx.cfg.train.max_memory_gib > 0 else ()
        self.eager_steps: dict[str, int] = {}  # eager steps by reason (eager_reason)

    # ----------------------------------------------------------------- engine
    def step(self, step: int) -> StepResult:
        return self.run(step, self.ctx.views.draw(self.ctx.sampler, self.batch))

    def state_replaced(self) -> None:
        self.warm = False  # new tensors: the next step runs eagerly, then captures

    # ----------------------------------------------------------------- policy
    def eager_reason(self, step: int, idxs: Sequence[int]) -> str | None:
        """Why `step` (on views idxs) must run eagerly; None when a graph may run it."""
        t = self.ctx
        tuner = t.renderer.tuner
        if tuner is not None and tuner.tuning:
            tuner.poll()  # finish a round whose timings are in (never blocks)
        reasons = (
            ("first", not self.warm), ("timed", t.timer.enabled), ("viewer", t.watched),
            ("mask", any(t.views.masks[i] is not None for i in idxs)),
            ("arc_tuning", tuner is not None and tuner.tuning), ("strategy", not t.strategy.graph_safe_at(step)),
        )  # fmt: skip
        return next((name for name, applies in reasons if applies), None)

    def _epoch_key(self, step: int) -> tuple:
        """Everything a captured step bakes in, the image size aside."""
        t = self.ctx
        params = tuple((p.data_ptr(), tuple(p.shape)) for p in t.params.values())
        states = (o.state[o.param_groups[0]["params"][0]] for o in fused_adam.graph_order(t.optimizers))
        keys = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")  # (the scales: int8 moments)
        moments = tuple(tuple(s[k].data_ptr() if k in s else None for k in keys) for s in states)
        return (params, moments, t.strategy.graph_key(step), t.sh_degree(step), t.renderer.atomic_threshold,
                corrections.graph_key(t.corrections, step))

    def _new_epoch(self, key: tuple | None) -> None:
        if self.graphs and self.stream is not None:
            torch.cuda.current_stream().synchronize()  # no replay of a dropped graph is still running
        self.graphs, self.pool, self.epoch, self.seen = {}, None, key, {}
        self.groups.refresh_peaks()  # the replays' largest views: capacities follow the growing model

    def _groups_of(self, idxs: Sequence[int]) -> tuple[Any, ...]:
        return tuple(self.groups.group(i) for i in idxs)

    # ----------------------------------------------------------------- steps
    def run(self, step: int, idxs: Sequence[int]) -> StepResult:
        """Step `step` on training views idxs (one per batch slot): a graph replay, a capture, or
        an eager step."""
        idxs = tuple(idxs)
        reason = self.eager_reason(step, idxs)
        groups = self._groups_of(idxs)
        if reason is None:
            key = self._epoch_key(step)
            if key != self.epoch:
                self.settle(idxs)  # a redo runs with the graphs its steps were captured for
                self._new_epoch(key)
            graph_key = self.groups.graph_key(groups)
            self.seen[graph_key] = self.seen.get(graph_key, 0) + 1
            if graph_key in self.graphs or self.seen[graph_key] > CAPTURE_AFTER:
                return self._graph_step(step, idxs)
            reason = "size_not_captured"
        self.eager_steps[reason] = self.eager_steps.get(reason, 0) + 1
        self.settle(idxs)  # an eager step may read what earlier replays wrote (densification)
        if self.graphs and reason in self.drop_for:  # their pool may be reused by this step
            self._new_epoch(None)
            self.pool_drops += 1
        if self.warm or self.stream is None:
            result = self._eager(step, idxs)
        else:
            # lazily made state (cuBLAS workspaces, Adam moments) made on the capture stream
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                result = self._eager(step, idxs)
            current.wait_stream(self.stream)
        self.warm = True
        if result.view_pairs is not None:
            for group, pairs in zip(groups, result.view_pairs, strict=True):
                self.groups.saw(group, pairs)
        return result

    def _eager(self, step: int, idxs: Sequence[int]) -> StepResult:
        t = self.ctx
        views = [t.views.step_view(i) for i in idxs]
        return t.runner.run(t.params, t.optimizers, step, views, t.sh_degree(step), t.background,
                            scheduler=t.scheduler)  # fmt: skip

    def _graph_step(self, step: int, idxs: tuple[int, ...]) -> StepResult:
        groups = self._groups_of(idxs)
        inputs = self._load(step, idxs)
        capacities = self.groups.slot_capacities(groups)
        graph_key = self.groups.graph_key(groups)
        entry = self.graphs.get(graph_key)
        if entry is None or entry.capacities != capacities:
            budgets = [self._budget(b, g, c) for b, (g, c) in enumerate(zip(groups, capacities, strict=True))]
            entry = self.graphs[graph_key] = self._capture(step, inputs, budgets)
        entry.graph.replay()
        self._release_slot()
        self.unsettled.append((step, idxs))
        if len(self.unsettled) >= MAX_UNSETTLED:
            self.settle()
        # the target by index: the graph's image input holds a later view by the time it is read
        if self.canvas is None:
            return replace(entry.outputs, target=idxs[0])
        height, width = self.shapes[idxs[0]][:2]  # the first view's part of its canvas slot
        return replace(entry.outputs, image=entry.outputs.image[:height, :width], target=idxs[0])

    def _budget(self, b: int, group: Any, capacity: int) -> PairBudget:
        """Batch slot b's pair budget: the shared tag and flag, and its group's statistics
        (on the canvas every view's rows, the row picked on the device by the slot's view index)."""
        if self.groups.view_stats is not None:
            return PairBudget(capacity, self.budget.tag, self.budget.flag, self.groups.view_stats,
                              slot=self.view_ints[b, 2:])  # fmt: skip
        return PairBudget(capacity, self.budget.tag, self.budget.flag, self.groups.stats_of(group))

    def _load(self, step: int, idxs: tuple[int, ...]) -> list[dict[str, Tensor]]:
        """This step's values into the graph's inputs: Adam's scalars (counted on the host here,
        as an eager step counts them), the tag, then per slot the camera, the image and the ints;
        then the rate decay."""
        t = self.ctx
        done = self.slot_done[self.slot]
        if done is not None:
            done.synchronize()  # the ring's slot is free once its copy has run: at most INFLIGHT ahead
        host = self.pinned[self.slot]
        values = fused_adam.advance(t.optimizers)
        if self.counts_steps:  # only bf16 and int8 moments' rounding reads the step counts
            values += fused_adam.step_counts(t.optimizers)
        host[: len(values)] = torch.tensor(values, dtype=torch.float32)
        host[-1] = float(step + 1)
        self.scalars.copy_(host, non_blocking=True)
        corrections.advance(t.corrections, step)
        t.scheduler.step()
        images = [t.views.images[i] for i in idxs]
        if self.image_buffer is None:
            largest = max(math.prod(s) for s in self.shapes) if self.canvas is None else math.prod(self.canvas)
            self.image_buffer = torch.zeros(self.batch * largest, dtype=images[0].dtype, device=images[0].device)
            viewmat, K = t.views.cams[idxs[0]]
            self.cameras = [{"viewmat": viewmat.clone(), "K": K.clone()} for _ in range(self.batch)]
        shapes = tuple(self.canvas if self.canvas is not None else tuple(image.shape) for image in images)
        inputs = self.inputs.get(shapes)
        if inputs is None:
            inputs = self.inputs[shapes] = [self._slot_inputs(b, shape) for b, shape in enumerate(shapes)]
        rows = []
        for b, (idx, image) in enumerate(zip(idxs, images, strict=True)):
            viewmat, K = t.views.cams[idx]
            self.cameras[b]["viewmat"].copy_(viewmat)
            self.cameras[b]["K"].copy_(K)
            height, width = image.shape[:2]  # on the canvas the view in the top-left corner, the rest outside its size
            inputs[b]["image"][:height, :width].copy_(image)
            rows.append((width, height, idx))
        ints = self.pinned_ints[self.slot]
        ints.copy_(torch.tensor(rows, dtype=torch.int32))
        self.view_ints.copy_(ints, non_blocking=True)
        return inputs

    def _slot_inputs(self, b: int, shape: tuple[int, ...]) -> dict[str, Tensor]:
        """Batch slot b's graph inputs for an image of `shape`: its camera, its part of the
        image buffer, and on the canvas its valid size."""
        assert self.image_buffer is not None
        start = b * (self.image_buffer.numel() // self.batch)
        inputs = {**self.cameras[b], "image": self.image_buffer[start : start + math.prod(shape)].view(shape)}
        if self.canvas is not None:
            inputs["valid"] = self.view_ints[b, :2]
        return inputs

    def _release_slot(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.slot_done[self.slot] = event
        self.slot = (self.slot + 1) % INFLIGHT

    def _capture(self, step: int, inputs: list[dict[str, Tensor]], budgets: list[PairBudget]) -> _Graph:
        t = self.ctx
        timed, t.timer.enabled = t.timer.enabled, False  # (a redo can capture during a timed step)
        for p in t.params.values():
            p.grad = None
        if cache_crowds_headroom(t.device, int(t.cfg.train.max_memory_gib * GIB)):
            torch.cuda.empty_cache()  # the capture's allocations get what the eager steps' cache held
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        runner = t.runner
        runner.graph_adam = (self.scalars, self.budget.flag)
        t.strategy.set_skip_flag(self.budget.flag)
        corrections.set_skip_flag(t.corrections, self.budget.flag)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        collecting = gc.isenabled()
        gc.disable()  # no finalizer (an old graph's, a tensor's) may run CUDA calls inside the capture
        try:
            with torch.cuda.stream(self.stream):
                # thread_local: another thread's CUDA call (a checkpoint writer's, a viewer's) must
                # not invalidate this capture, as the default "global" mode lets it
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    # each slot's view carries its own pair budget and valid size to the renderer
                    views = [StepView(i["viewmat"], i["K"], i["image"].float() / 255.0, None, i.get("valid"),
                                      budget=budget, slot=self.view_ints[b, 2:])
                             for b, (i, budget) in enumerate(zip(inputs, budgets, strict=True))]  # fmt: skip
                    result = runner.run(t.params, t.optimizers, step, views, t.sh_degree(step), t.background,
                                        scheduler=None)  # fmt: skip
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
            runner.graph_adam = None
            t.strategy.set_skip_flag(None)
            corrections.set_skip_flag(t.corrections, None)
            t.timer.enabled = timed
        current.wait_stream(self.stream)
        self.captures += 1
        outputs = StepResult(result.loss, result.terms, result.image, False, None)
        return _Graph(graph, outputs, tuple(b.capacity for b in budgets))

    # ----------------------------------------------------------------- exactness
    def settle(self, drawn: Sequence[int] = ()) -> StepResult | None:
        """Wait for the replays so far; if a view overflowed its pair budget, redo the steps from
        that one's on with larger budgets. Returns the last redone step's result (None: no redo).
        drawn: the views of a step already drawn, run after this: a store of streamed images is
        asked for them again behind the redone steps' (the redo's reads may have let them go)."""
        if not self.unsettled:
            return None
        first = int(self.budget.flag.item()) - 1  # the one host sync: the flag, a step's tag or 0
        replayed = sum(len(idxs) for _, idxs in self.unsettled)
        if first < 0:
            self.views += replayed
            self.unsettled.clear()
            return None
        t = self.ctx
        redo = [(s, idxs) for s, idxs in self.unsettled if s >= first]
        self.views += replayed - sum(len(idxs) for _, idxs in redo)
        self.unsettled.clear()
        fused_adam.rewind(t.optimizers, len(redo))  # Adam and the decay count steps, not views
        corrections.rewind(t.corrections, [s for s, _ in redo])
        t.scheduler.rewind(len(redo))
        self.budget.flag.zero_()
        self.groups.grow(self._groups_of(redo[0][1]))  # the overflowed step's groups that did not fit
        self.redos += 1
        self.redone_steps += len(redo)
        result = None
        again_read = [i for _, idxs in redo for i in idxs]  # streamed images: fetched ahead again
        for s, idxs in redo:
            t.views.prefetch(t.sampler, first=[*again_read, *drawn])
            result = self._graph_step(s, idxs)
            again_read = again_read[len(idxs) :]
        again = self.settle(drawn)
        return again if again is not None else result

    def pair_totals(self) -> tuple[int, int, int]:
        """(pairs before the cull, after it, views) over the settled graph steps."""
        self.settle()
        return (*self.groups.totals(), self.views)

    def summary(self) -> dict[str, Any]:
        """For the run record: how the steps ran."""
        return {"captures": self.captures, "graph_steps": self.views, "redos": self.redos,
                "redone_steps": self.redone_steps, "pool_drops": self.pool_drops,
                "pair_capacity": self.groups.summary(),
                "canvas": list(self.canvas[:2]) if self.canvas is not None else None,
                "eager_steps": dict(self.eager_steps)}  # fmt: skip


def _graph_set_up(cfg: Any, renderer: Any, device: torch.device) -> bool:
    """What graphs need of the config and the renderer: our CUDA kernels with the culled
    intersection, dev.cuda_graphs on."""
    return (
        bool(cfg.dev.cuda_graphs) and device.type == "cuda" and renderer.backend == "cuda"
        and renderer.options.ellipse_cull
    )  # fmt: skip


def graphs_planned(cfg: Any, renderer: Any, device: torch.device) -> bool:
    """graphs_possible as far as it is known before the step runner exists (the memory plan asks
    it): fused Adam from dev.fused_adam; the per-view corrections not yet attached (every one
    is graph-safe; one that were not would make a plan count a graph pool the run will not hold:
    the safe side)."""
    return _graph_set_up(cfg, renderer, device) and bool(cfg.dev.fused_adam)


def held_pool_margin(cfg: Any, renderer: Any, device: torch.device, masks: list[Any]) -> float:
    """memory_budget's graph_pair_margin for a set-up: CAPACITY_MARGIN where graphs run and masked
    views' eager steps run beside the graphs' pool (DROP_GRAPHS_FOR leaves them out), else 0."""
    masked = any(m is not None for m in masks)
    return CAPACITY_MARGIN if masked and graphs_planned(cfg, renderer, device) else 0.0


def graphs_possible(cfg: Any, renderer: Any, runner: Any, device: torch.device) -> bool:
    """dev.cuda_graphs applies: our CUDA kernels with the culled intersection, fused Adam, no
    per-view correction that is not graph-safe (corrections.graph_refusers). Any
    train.batch_size: a batch step is captured as one graph of its views."""
    return (
        _graph_set_up(cfg, renderer, device) and runner.fused_adam is not None
        and not corrections.graph_refusers(getattr(runner, "corrections", []))
    )  # fmt: skip
