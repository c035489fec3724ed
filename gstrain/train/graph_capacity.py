"""The graph engine's pair capacities (train/graph_step.py): how many (Gaussian, tile) pairs each
captured step's fixed buffers hold, kept per group of views, and which graph runs a step.

A group is an image size (one graph per size), or on the canvas a view (views share graphs by
capacity class). Each group's most pairs come from eager steps (host ints) and from replays
(PairBudget.pair_sum on the device, read when an epoch ends or a step overflowed). A batch step
(train.batch_size = B views) has one group per slot: per size its graph is the tuple of the B sizes
and each slot keeps its own group's capacity; on the canvas every slot takes the largest capacity
class of the B views, so a batch graph is keyed by that one number as a single view's is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

CAPACITY_MARGIN = 1.5  # pair buffers hold this many times the most pairs an eager step has seen
CAPACITY_HEADROOM = 1.1  # ... and grow once that many times the most pairs would not fit
CAPACITY_ROUND = 1 << 16


def _round_up(n: float) -> int:
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


class PairGroups:
    """Pair statistics and capacities per group (see the module docstring).

    stats: per group, PairBudget.pair_sum on the device (pairs before / after the cull over the
    settled replays, and the most one view kept); on the canvas the rows of one [views, 3] tensor
    (view_stats), the row chosen on the device by the view's index. peak: the most pairs a group
    has had as the host knows it. capacities: the pair capacity each group's slot is captured with."""

    def __init__(self, shapes: list[tuple[int, ...]], canvas: tuple[int, ...] | None, device: torch.device) -> None:
        self.shapes = shapes
        self.canvas = canvas
        self.device = device
        self.stats: dict[Any, Tensor] = {}
        self.peak: dict[Any, int] = {}
        self.capacities: dict[Any, int] = {}
        self.view_stats: Tensor | None = None
        if canvas is not None:
            self.view_stats = torch.zeros((len(shapes), 3), dtype=torch.int64, device=device)
            self.stats = dict(enumerate(self.view_stats))

    def group(self, idx: int) -> Any:
        """The key view idx's statistics and capacity are kept under: its image size, or on the
        canvas the view itself."""
        return idx if self.canvas is not None else self.shapes[idx]

    def fit(self, pairs: float) -> int:
        """A capacity for `pairs`: rounded up, on the canvas to its capacity class."""
        return capacity_class(_round_up(pairs)) if self.canvas is not None else _round_up(pairs)

    def capacity(self, group: Any) -> int:
        """The pair capacity for `group`: CAPACITY_MARGIN times its most pairs, regrown once that
        many times CAPACITY_HEADROOM no longer fits (a group never seen takes the largest)."""
        peak = self.peak.get(group)
        if peak is None:  # only until the group has a count of its own
            peak = max(self.peak.values(), default=0)
        capacity = self.capacities.get(group, 0)
        if capacity == 0 or peak * CAPACITY_HEADROOM > capacity:
            capacity = self.capacities[group] = max(capacity, self.fit(peak * CAPACITY_MARGIN))
        return capacity

    def graph_key(self, groups: tuple[Any, ...]) -> Any:
        """Which of the epoch's graphs runs a step on these groups (one per batch slot): on the
        canvas the largest of their capacities, else their sizes."""
        if self.canvas is not None:
            return max(self.capacity(g) for g in groups)
        return groups

    def slot_capacities(self, groups: tuple[Any, ...]) -> tuple[int, ...]:
        """Each slot's pair capacity in the graph that runs these groups: on the canvas all share
        the graph's (the largest class), else each its own group's."""
        if self.canvas is not None:
            return (self.graph_key(groups),) * len(groups)
        return tuple(self.capacity(g) for g in groups)

    def stats_of(self, group: Any) -> Tensor:
        """The group's statistics on the device (made at its first replay, per size)."""
        stats = self.stats.get(group)
        if stats is None:
            stats = self.stats[group] = torch.zeros(3, dtype=torch.int64, device=self.device)
        return stats

    def saw(self, group: Any, pairs: int) -> None:
        """An eager step's count for one view of `group`."""
        self.peak[group] = max(self.peak.get(group, 0), int(pairs))

    def refresh_peaks(self) -> None:
        """The replays' largest views into the peaks (at an epoch's end: one read of the device),
        so that capacities follow the growing model."""
        if not self.stats:
            return
        groups = list(self.stats)
        most = torch.stack([self.stats[g][2] for g in groups]).tolist()
        for group, m in zip(groups, most, strict=True):
            if m > 0:  # (a canvas view not replayed yet has no count)
                self.saw(group, m)

    def grow(self, groups: tuple[Any, ...]) -> list[Any]:
        """After an overflow of the step on `groups`: every group whose most pairs (the overflowed
        view included) exceeded the capacity its slot ran with gets a capacity that holds them,
        and at least one CAPACITY_ROUND more than before, so the redo makes progress. Returns the
        grown groups (all of them when none shows the excess, which the kernel's count rules out)."""
        ran_with = dict(zip(groups, self._ran_with(groups), strict=True))
        most = {g: int(self.stats[g][2]) if g in self.stats else 0 for g in ran_with}
        grown = [g for g in ran_with if most[g] > ran_with[g]] or list(ran_with)
        for group in grown:
            self.saw(group, most[group])
            fitted = self.fit(most[group] * max(CAPACITY_MARGIN, 1.0))  # at least the overflowed view
            self.capacities[group] = max(fitted, self.fit(self.capacities.get(group, 0) + CAPACITY_ROUND))
        return grown

    def _ran_with(self, groups: tuple[Any, ...]) -> tuple[int, ...]:
        """The capacities the slots of `groups` were captured with (read without regrowing)."""
        own = tuple(self.capacities.get(g, 0) for g in groups)
        return (max(own),) * len(own) if self.canvas is not None else own

    def totals(self) -> tuple[int, int]:
        """(pairs before the cull, after it) over the settled replays."""
        if not self.stats:
            return 0, 0
        before, after, _ = (int(v) for v in torch.stack(list(self.stats.values())).sum(0).tolist())
        return before, after

    def summary(self) -> dict[str, int]:
        capacities = sorted(self.capacities.values())
        return {"groups": len(capacities), "max": capacities[-1] if capacities else 0,
                "median": capacities[len(capacities) // 2] if capacities else 0}  # fmt: skip
