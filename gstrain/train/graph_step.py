"""dev.cuda_graphs: single-view training steps replayed as one CUDA graph each.

Why: near 3 ms a step on an H200 the step is bound by the host issuing ~60 kernels through
Python (bench/trace_step.py), not by the GPU. A captured graph replays the whole step
(projection, intersection, both raster passes, loss, backward, Adam, statistics) in one launch.

What a graph freezes, and how each is handled:
- shapes and addresses: the intersection is sync-free into fixed-capacity buffers
  (render/isect.PairBudget); parameters, Adam moments and statistics keep their storage between
  densifications. An epoch lasts while those addresses, the SH degree and ARC's threshold stay
  the same, and its graphs are dropped when it ends. The image size: gsplat's projection bakes it
  in, so with one graph per size a scene whose views differ in size (beer: 35 sizes for 62 views)
  captures one graph per size per epoch, and captures bound the run while it refines. With the
  fused loss the step runs instead on a canvas of the largest size, the view in its top-left
  corner and its size on the device (render/sized_projection.py, the intersection and the loss
  read it), so one graph serves every size. Pair capacity: the sort covers a graph's whole
  capacity, so each view (per-size graphs: each size) has its own, from the most pairs it has had,
  and on the canvas views share a graph per capacity class (capacity_class);
- per-step values: Adam's step sizes and bias corrections come from a device tensor refilled
  before each replay (fused_adam.advance); the view's camera, image (and on the canvas its size
  and statistics row) are copied into the graph's inputs;
- the rest runs eagerly: steps where the strategy refines or resets, timed steps
  (dev.time_every), ARC's tuning calls, masked views, the first step, and a graph key's first
  CAPTURE_AFTER steps of an epoch (none: a capture costs the host about what an eager step does,
  bench/graph_study.py). Batches (train.batch_size > 1) never use graphs.
Exactness: a view whose pairs overflow the capacity sets the budget's sticky flag, and Adam and
the statistics are no-ops while it is set. Before the host reads anything (settle()), it checks
the flag and redoes the steps from the first overflowed one, its group's capacity grown to fit. A
graph step computes the eager step's function (tests/test_graph_cuda.py checks it on a GPU,
tests/test_graph_step.py the policy and the redo's bookkeeping on the CPU); a canvas step equals
the step at the view's own size within float tolerance (tests/test_sized_projection_cuda.py).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from gstrain.render.isect import PairBudget
from gstrain.train import fused_adam
from gstrain.train.context import StepContext
from gstrain.train.step import StepResult, StepView

CAPACITY_MARGIN = 1.5  # pair buffers hold this many times the most pairs an eager step has seen
CAPACITY_HEADROOM = 1.1  # ... and grow once that many times the most pairs would not fit
CAPACITY_ROUND = 1 << 16
INFLIGHT = 8  # replays the host may run ahead of the GPU (pinned scalar buffers in a ring)
MAX_UNSETTLED = 200  # steps between flag checks at most (a redo repeats them)
CAPTURE_AFTER = 0  # eager steps of a graph's key in an epoch before it is captured
# Eager steps before which the epoch's graphs are dropped: the graphs' pool holds a whole step's
# gradients and buffers, idle while an eager step allocates its own beside it (the peak of a graph
# run). A refinement or reset that changes the model ends the epoch anyway (new tensors); one that
# changes nothing, a timed step or an ARC round costs one capture after it. Masked views keep the
# graphs: they interleave with graph steps.
DROP_GRAPHS_FOR = ("strategy", "timed", "arc_tuning")


def _round_up(n: int) -> int:
    return max(CAPACITY_ROUND, -(-int(n) // CAPACITY_ROUND) * CAPACITY_ROUND)


def capacity_class(n: int) -> int:
    """The canvas graphs' capacities: the smallest of 2^k and 1.5 * 2^k that holds n (at least
    CAPACITY_ROUND). A view sorts at most 1.5x the pairs its own capacity would, and an epoch
    captures a graph per class its views fall in (a handful) instead of one per image size."""
    n = max(int(n), CAPACITY_ROUND)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= n else power


def canvas_of(image_shapes: list[tuple[int, ...]], fused_loss: bool) -> tuple[int, ...] | None:
    """The canvas shape (the largest height, width) when the steps run on one: views of several
    sizes and the fused loss (the only one that takes a valid size); else None (a graph per size)."""
    shapes = set(image_shapes)
    if len(shapes) < 2 or not fused_loss:
        return None
    return (max(s[0] for s in shapes), max(s[1] for s in shapes), *next(iter(shapes))[2:])


@dataclass
class _Graph:
    """One captured step (an image size's, or a capacity class's on the canvas): the graph and its
    static outputs."""

    graph: torch.cuda.CUDAGraph
    outputs: StepResult
    capacity: int  # the pair capacity it was captured with


class GraphEngine:
    """The graph step engine (train/engine.py): single-view steps on a StepContext, replaying a
    captured graph where it may (see the module docstring).

    A graph is per image size, or on the canvas per capacity class (see the module docstring);
    the graphs of one epoch (the stretch between two changes of _epoch_key) share one memory
    pool, which is safe because every replay's outputs are read before the next. A graph's key
    is captured once it has come up CAPTURE_AFTER times in the epoch. Pair statistics and
    capacities are kept per group: an image size, or on the canvas a view (its index)."""

    name = "graph"

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.device = ctx.device
        n_scalars = 2 * len(ctx.optimizers) + 1  # Adam's pairs, then the step's tag
        self.scalars = torch.zeros(n_scalars, device=self.device)
        self.budget = PairBudget.on(self.device, CAPACITY_ROUND, tag=self.scalars[-1:])  # the shared tag and flag
        self.shapes = ctx.views.shapes()  # read once: a store's shapes come without fetching
        self.canvas = canvas_of(self.shapes, bool(ctx.cfg.dev.fused_ssim))
        # per group (an image size; on the canvas a view): pair statistics on the device
        # (PairBudget.pair_sum; on the canvas rows of one [views, 3] tensor, the row chosen on the
        # device), the most pairs it has had as the host knows it, and its pair capacity
        self.group_stats: dict[Any, Tensor] = {}
        self.group_peak: dict[Any, int] = {}
        self.capacities: dict[Any, int] = {}
        self.view_stats: Tensor | None = None
        on_gpu = self.device.type == "cuda"  # (the policy and the bookkeeping also run on the CPU, in tests)
        if self.canvas is not None:
            self.view_stats = torch.zeros((len(self.shapes), 3), dtype=torch.int64, device=self.device)
            self.group_stats = dict(enumerate(self.view_stats))
        # on the canvas: the view's width, height and index, refilled before each replay
        self.view_ints = torch.zeros(3, dtype=torch.int32, device=self.device)
        self.pinned_ints = torch.zeros((INFLIGHT, 3), dtype=torch.int32, pin_memory=on_gpu)
        self.pinned = torch.zeros((INFLIGHT, n_scalars), pin_memory=on_gpu)
        self.slot_done: list[torch.cuda.Event | None] = [None] * INFLIGHT
        self.slot = 0
        self.stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.epoch: tuple | None = None
        self.graphs: dict[Any, _Graph] = {}  # this epoch's, by image shape (on the canvas: capacity)
        self.seen: dict[Any, int] = {}  # graph-safe steps per graph key in this epoch
        self.pool: Any = None
        self.inputs: dict[tuple, dict[str, Tensor]] = {}  # per image shape (or the canvas's): the graph's inputs
        self.image_buffer: Tensor | None = None
        self.camera: dict[str, Tensor] = {}
        self.unsettled: list[tuple[int, int]] = []  # (step, view) replayed since the last settle
        self.warm = False  # an eager step has run (lazily made state exists)
        self.views = 0  # settled graph steps: the views pair_sum counts
        self.captures = 0
        self.redos = 0
        self.redone_steps = 0  # replays repeated by redos (the cost of an overflow)
        self.pool_drops = 0  # epochs ended early for an eager step (DROP_GRAPHS_FOR)
        self.eager_steps: dict[str, int] = {}  # eager steps by reason (eager_reason)

    # ----------------------------------------------------------------- engine
    def step(self, step: int) -> StepResult:
        return self.run(step, self.ctx.views.draw(self.ctx.sampler)[0])

    def state_replaced(self) -> None:
        self.warm = False  # new tensors: the next step runs eagerly, then captures

    # ----------------------------------------------------------------- policy
    def eager_reason(self, step: int, idx: int) -> str | None:
        """Why `step` (on view idx) must run eagerly; None when a graph may run it."""
        t = self.ctx
        tuner = t.renderer.tuner
        if tuner is not None and tuner.tuning:
            tuner.poll()  # finish a round whose timings are in (never blocks)
        reasons = (
            ("first", not self.warm), ("timed", t.timer.enabled), ("viewer", t.watched),
            ("mask", t.views.masks[idx] is not None), ("arc_tuning", tuner is not None and tuner.tuning),
            ("strategy", not t.strategy.graph_safe_at(step)),
        )  # fmt: skip
        return next((name for name, applies in reasons if applies), None)

    def _epoch_key(self, step: int) -> tuple:
        """Everything a captured step bakes in, the image size aside."""
        t = self.ctx
        params = tuple((p.data_ptr(), tuple(p.shape)) for p in t.params.values())
        states = (o.state[o.param_groups[0]["params"][0]] for o in fused_adam.graph_order(t.optimizers))
        moments = tuple(tuple(s[k].data_ptr() if k in s else None for k in ("exp_avg", "exp_avg_sq")) for s in states)
        return (params, moments, t.strategy.graph_key(step), t.sh_degree(step), t.renderer.atomic_threshold)

    def _new_epoch(self, key: tuple | None) -> None:
        if self.graphs and self.stream is not None:
            torch.cuda.current_stream().synchronize()  # no replay of a dropped graph is still running
        self.graphs, self.pool, self.epoch, self.seen = {}, None, key, {}
        if self.group_stats:  # the replays' largest views: capacities follow the growing model
            groups = list(self.group_stats)
            most = torch.stack([self.group_stats[g][2] for g in groups]).tolist()
            for group, m in zip(groups, most, strict=True):
                if m > 0:  # (a canvas view not replayed yet has no count)
                    self.group_peak[group] = max(self.group_peak.get(group, 0), int(m))

    def _group(self, idx: int) -> Any:
        """The key pair statistics and capacities are kept under: view idx's image size, or on the
        canvas the view itself."""
        return idx if self.canvas is not None else self.shapes[idx]

    def _fit(self, pairs: float) -> int:
        """A capacity for `pairs`: rounded up, on the canvas to its capacity class."""
        return capacity_class(_round_up(pairs)) if self.canvas is not None else _round_up(pairs)

    def _capacity(self, group: Any) -> int:
        """The pair capacity for `group`: CAPACITY_MARGIN times its most pairs, regrown once that
        many times CAPACITY_HEADROOM no longer fits (a group never seen takes the largest)."""
        peak = self.group_peak.get(group)
        if peak is None:  # only until the group has a count of its own
            peak = max(self.group_peak.values(), default=0)
        capacity = self.capacities.get(group, 0)
        if capacity == 0 or peak * CAPACITY_HEADROOM > capacity:
            capacity = self.capacities[group] = max(capacity, self._fit(peak * CAPACITY_MARGIN))
        return capacity

    def _graph_key(self, group: Any) -> Any:
        """Which of the epoch's graphs runs the group's views: its size's, or its capacity's."""
        return self._capacity(group) if self.canvas is not None else group

    # ----------------------------------------------------------------- steps
    def run(self, step: int, idx: int) -> StepResult:
        """Step `step` on training view idx: a graph replay, a capture, or an eager step."""
        reason = self.eager_reason(step, idx)
        group = self._group(idx)
        if reason is None:
            key = self._epoch_key(step)
            if key != self.epoch:
                self.settle()  # a redo runs with the graphs its steps were captured for
                self._new_epoch(key)
            graph_key = self._graph_key(group)
            self.seen[graph_key] = self.seen.get(graph_key, 0) + 1
            if graph_key in self.graphs or self.seen[graph_key] > CAPTURE_AFTER:
                return self._graph_step(step, idx)
            reason = "size_not_captured"
        self.eager_steps[reason] = self.eager_steps.get(reason, 0) + 1
        self.settle()  # an eager step may read what earlier replays wrote (densification)
        if self.graphs and reason in DROP_GRAPHS_FOR:  # their pool may be reused by this step
            self._new_epoch(None)
            self.pool_drops += 1
        if self.warm or self.stream is None:
            result = self._eager(step, idx)
        else:
            # lazily made state (cuBLAS workspaces, Adam moments) made on the capture stream
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                result = self._eager(step, idx)
            current.wait_stream(self.stream)
        self.warm = True
        if result.pairs is not None:
            self.group_peak[group] = max(self.group_peak.get(group, 0), result.pairs[1])
        return result

    def _eager(self, step: int, idx: int) -> StepResult:
        t = self.ctx
        return t.runner.run(t.params, t.optimizers, step, [t.views.step_view(idx)], t.sh_degree(step), t.background,
                            scheduler=t.scheduler)  # fmt: skip

    def _graph_step(self, step: int, idx: int) -> StepResult:
        group = self._group(idx)
        inputs = self._load(step, idx)
        capacity = self._capacity(group)
        graph_key = self._graph_key(group)
        entry = self.graphs.get(graph_key)
        if entry is None or entry.capacity != capacity:
            entry = self.graphs[graph_key] = self._capture(step, inputs, self._budget(group, capacity))
        entry.graph.replay()
        self._release_slot()
        self.unsettled.append((step, idx))
        if len(self.unsettled) >= MAX_UNSETTLED:
            self.settle()
        # the target by index: the graph's image input holds a later view by the time it is read
        if self.canvas is None:
            return replace(entry.outputs, target=idx)
        height, width = self.shapes[idx][:2]  # the view's part of the canvas
        return replace(entry.outputs, image=entry.outputs.image[:height, :width], target=idx)

    def _budget(self, group: Any, capacity: int) -> PairBudget:
        """A graph's pair budget: the shared tag and flag, and its group's statistics (on the
        canvas every view's rows, the row picked by the view's index on the device)."""
        if self.view_stats is not None:
            return PairBudget(capacity, self.budget.tag, self.budget.flag, self.view_stats, slot=self.view_ints[2:])
        stats = self.group_stats.get(group)
        if stats is None:
            stats = self.group_stats[group] = torch.zeros(3, dtype=torch.int64, device=self.device)
        return PairBudget(capacity, self.budget.tag, self.budget.flag, stats)

    def _load(self, step: int, idx: int) -> dict[str, Tensor]:
        """This step's values into the graph's inputs: Adam's scalars (counted on the host here,
        as an eager step counts them), the tag, the camera and the image; then the rate decay."""
        t = self.ctx
        done = self.slot_done[self.slot]
        if done is not None:
            done.synchronize()  # the ring's slot is free once its copy has run: at most INFLIGHT ahead
        host = self.pinned[self.slot]
        host[:-1] = torch.tensor(fused_adam.advance(t.optimizers), dtype=torch.float32)
        host[-1] = float(step + 1)
        self.scalars.copy_(host, non_blocking=True)
        t.scheduler.step()
        viewmat, K = t.views.cams[idx]
        image = t.views.images[idx]
        if self.image_buffer is None:  # every size's image input is a view of one buffer
            largest = max(math.prod(s) for s in self.shapes) if self.canvas is None else math.prod(self.canvas)
            self.image_buffer = torch.zeros(largest, dtype=image.dtype, device=image.device)
            self.camera = {"viewmat": viewmat.clone(), "K": K.clone()}
        shape = self.canvas if self.canvas is not None else tuple(image.shape)
        inputs = self.inputs.get(shape)
        if inputs is None:
            view = self.image_buffer[: math.prod(shape)].view(shape)
            inputs = self.inputs[shape] = {**self.camera, "image": view}
            if self.canvas is not None:
                inputs["valid"] = self.view_ints[:2]
        self.camera["viewmat"].copy_(viewmat)
        self.camera["K"].copy_(K)
        if self.canvas is not None:  # the view in the top-left corner; the rest is outside its size
            height, width = image.shape[:2]
            inputs["image"][:height, :width].copy_(image)
            ints = self.pinned_ints[self.slot]
            ints[0], ints[1], ints[2] = width, height, idx
            self.view_ints.copy_(ints, non_blocking=True)
        else:
            inputs["image"].copy_(image)
        return inputs

    def _release_slot(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.slot_done[self.slot] = event
        self.slot = (self.slot + 1) % INFLIGHT

    def _capture(self, step: int, inputs: dict[str, Tensor], budget: PairBudget) -> _Graph:
        t = self.ctx
        timed, t.timer.enabled = t.timer.enabled, False  # (a redo can capture during a timed step)
        for p in t.params.values():
            p.grad = None
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        renderer, runner = t.renderer, t.runner
        options = renderer.options
        renderer.options = replace(options, pair_budget=budget, valid_size=inputs.get("valid"))
        runner.graph_adam = (self.scalars, self.budget.flag)
        t.strategy.set_skip_flag(self.budget.flag)
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
                    gt = inputs["image"].float() / 255.0
                    view = StepView(inputs["viewmat"], inputs["K"], gt, None, inputs.get("valid"))
                    result = runner.run(t.params, t.optimizers, step, [view], t.sh_degree(step), t.background,
                                        scheduler=None)  # fmt: skip
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
            renderer.options = options
            runner.graph_adam = None
            t.strategy.set_skip_flag(None)
            t.timer.enabled = timed
        current.wait_stream(self.stream)
        self.captures += 1
        return _Graph(graph, StepResult(result.loss, result.terms, result.image, False, None), budget.capacity)

    # ----------------------------------------------------------------- exactness
    def settle(self) -> StepResult | None:
        """Wait for the replays so far; if a view overflowed its pair budget, redo the steps from
        that one on with a larger budget. Returns the last redone step's result (None: no redo)."""
        if not self.unsettled:
            return None
        first = int(self.budget.flag.item()) - 1  # the one host sync: the flag, a step's tag or 0
        if first < 0:
            self.views += len(self.unsettled)
            self.unsettled.clear()
            return None
        t = self.ctx
        redo = [(s, i) for s, i in self.unsettled if s >= first]
        self.views += len(self.unsettled) - len(redo)
        self.unsettled.clear()
        fused_adam.rewind(t.optimizers, len(redo))
        t.scheduler.rewind(len(redo))
        self.budget.flag.zero_()
        # the overflowed view's group: its most pairs (the overflowed view included) set its new capacity
        group = self._group(redo[0][1])
        most = int(self.group_stats[group][2])
        self.group_peak[group] = max(self.group_peak.get(group, 0), most)
        grown = self._fit(most * max(CAPACITY_MARGIN, 1.0))  # at least the overflowed view
        self.capacities[group] = max(grown, self._fit(self.capacities.get(group, 0) + CAPACITY_ROUND))
        self.redos += 1
        self.redone_steps += len(redo)
        result = None
        for s, i in redo:
            result = self._graph_step(s, i)
        again = self.settle()
        return again if again is not None else result

    def pair_totals(self) -> tuple[int, int, int]:
        """(pairs before the cull, after it, views) over the settled graph steps."""
        self.settle()
        if not self.group_stats:
            return 0, 0, self.views
        before, after, _ = (int(v) for v in torch.stack(list(self.group_stats.values())).sum(0).tolist())
        return before, after, self.views

    def summary(self) -> dict[str, Any]:
        """For the run record: how the steps ran."""
        capacities = sorted(self.capacities.values())
        return {"captures": self.captures, "graph_steps": self.views, "redos": self.redos,
                "redone_steps": self.redone_steps, "pool_drops": self.pool_drops,
                "pair_capacity": {"groups": len(capacities), "max": capacities[-1] if capacities else 0,
                                  "median": capacities[len(capacities) // 2] if capacities else 0},
                "canvas": list(self.canvas[:2]) if self.canvas is not None else None,
                "eager_steps": dict(self.eager_steps)}  # fmt: skip


def _graph_set_up(cfg: Any, renderer: Any, device: torch.device) -> bool:
    """What graphs need of the config and the renderer: our CUDA kernels with the culled
    intersection, single-view steps, dev.cuda_graphs on."""
    return (
        bool(cfg.dev.cuda_graphs) and device.type == "cuda" and renderer.backend == "cuda"
        and renderer.options.ellipse_cull and cfg.train.batch_size == 1
    )  # fmt: skip


def graphs_planned(cfg: Any, renderer: Any, device: torch.device) -> bool:
    """graphs_possible as far as it is known before the step runner exists (the memory plan asks
    it): fused Adam from dev.fused_adam; per-view corrections, which rule graphs out, not yet
    attached (a plan then counts a graph pool the run will not hold: the safe side)."""
    return _graph_set_up(cfg, renderer, device) and bool(cfg.dev.fused_adam)


def held_pool_margin(cfg: Any, renderer: Any, device: torch.device, masks: list[Any]) -> float:
    """memory_budget's graph_pair_margin for a set-up: CAPACITY_MARGIN where graphs run and masked
    views' eager steps run beside the graphs' pool (DROP_GRAPHS_FOR leaves them out), else 0."""
    masked = any(m is not None for m in masks)
    return CAPACITY_MARGIN if masked and graphs_planned(cfg, renderer, device) else 0.0


def graphs_possible(cfg: Any, renderer: Any, runner: Any, device: torch.device) -> bool:
    """dev.cuda_graphs applies: our CUDA kernels with the culled intersection, fused Adam,
    single-view steps, no per-view correction (its Adam and view index are not graph-safe)."""
    return (
        _graph_set_up(cfg, renderer, device) and runner.fused_adam is not None
        and not getattr(runner, "corrections", None)
    )  # fmt: skip
