"""ARC: pick the rasterizer backward's warp-reduction threshold T at run time.

The backward reduces a warp's gradient adds in registers when at least T lanes contribute to a
Gaussian, and lets each lane add on its own otherwise. The best T depends on the scene, the
resolution and the Gaussian population, so it is timed on real training iterations: after a
start or `invalidate()` (the trainer calls it after each densification), the next backward
calls cycle through the candidates, each timed with CUDA events around the backward kernel,
and the fastest median wins until the next invalidate. The events are only read once the whole
round has been issued and has finished on the GPU (`Event.query()`), so tuning never blocks
the host.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

# Thresholds are lane counts (1..32); 1 reduces whenever any lane contributes (= warp mode).
# On an H200 (bench/NOTES.md, vector atomics) the best T was 8 with scalar atomics and 16-24 with the default
# vector atomics; T <= 2 and T = 32 never won, so the round spends no calls on them.
DEFAULT_CANDIDATES: tuple[int, ...] = (4, 8, 12, 16, 20, 24)
DEFAULT_THRESHOLD = 8


class Probe(Protocol):
    """Times one backward call on the GPU without blocking the host."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def done(self) -> bool: ...

    def elapsed_ms(self) -> float: ...


class CudaEventProbe:
    """A pair of CUDA events recorded on the current stream around the backward kernel."""

    def __init__(self) -> None:
        import torch

        self._start = torch.cuda.Event(enable_timing=True)
        self._stop = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._start.record()

    def stop(self) -> None:
        self._stop.record()

    def done(self) -> bool:
        return bool(self._stop.query())

    def elapsed_ms(self) -> float:
        return float(self._start.elapsed_time(self._stop))


class ArcRound(NamedTuple):
    """One finished tuning round, for logs."""

    round: int  # 0-based
    call: int  # backward calls seen when the choice was made
    threshold: int  # the winner
    timings: dict[int, list[float]]  # candidate -> backward times in ms, in issue order
    costs: dict[int, float]  # candidate -> median ms per unit of work (what was compared)


def pick_threshold(costs: Mapping[int, Sequence[float]]) -> int:
    """The candidate with the smallest median cost; ties go to the smaller threshold."""
    scored = [(statistics.median(v), t) for t, v in costs.items() if len(v) > 0]
    if not scored:
        raise ValueError("pick_threshold needs at least one candidate with timings")
    return min(scored)[1]


class ArcTuner:
    """Run-time tuner of the warp-reduction threshold (see the module docstring).

    Use from the backward:  T, probe = tuner.next_call(work);  probe.start(); kernel(T);
    probe.stop()  (probe is None outside tuning rounds). `work` normalises calls that render
    different views (e.g. the number of tile intersections); pass 1.0 for frozen inputs.
    """

    def __init__(
        self,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        reps: int = 3,
        warmup: int = 1,
        initial: int = DEFAULT_THRESHOLD,
        probe_factory: Callable[[], Probe] | None = None,
    ) -> None:
        cands = tuple(dict.fromkeys(int(c) for c in candidates))  # dedupe, keep order
        if not cands or any(not 1 <= c <= 32 for c in cands):
            raise ValueError(f"ARC candidates must be lane counts in 1..32, got {list(candidates)}")
        if reps < 1 or warmup < 0:
            raise ValueError("reps must be >= 1 and warmup >= 0")
        self.candidates = cands
        self.reps = int(reps)
        self.warmup = int(warmup)
        self.threshold = int(initial)
        self.history: list[ArcRound] = []
        self._probe_factory: Callable[[], Probe] = probe_factory or CudaEventProbe
        self._calls = 0
        self._queue: list[int] = []
        self._warmup_left = 0
        self._inflight: list[tuple[int, Probe, float]] = []
        self.invalidate()

    @property
    def tuning(self) -> bool:
        """True while a round is being issued or waits for its timings."""
        return bool(self._queue or self._inflight)

    @property
    def calls(self) -> int:
        return self._calls

    def invalidate(self) -> None:
        """Start a new round at the next backward call (the population or workload changed)."""
        # interleave candidates so each sees a spread of views and GPU states
        self._queue = [c for _ in range(self.reps) for c in self.candidates]
        self._warmup_left = self.warmup
        self._inflight = []

    def next_call(self, work: float = 1.0) -> tuple[int, Probe | None]:
        """Threshold for this backward call, and a probe to time it when it is a tuning call."""
        self._calls += 1
        self._poll()
        if self._queue and self._warmup_left > 0:
            # untimed: lazy module loading and allocator growth land here, not on a candidate
            self._warmup_left -= 1
            return self.threshold, None
        if self._queue:
            t = self._queue.pop(0)
            probe = self._probe_factory()
            self._inflight.append((t, probe, max(float(work), 1e-12)))
            return t, probe
        return self.threshold, None

    def poll(self) -> bool:
        """Finish the round if its timings are ready (never blocks); True once a round completed."""
        before = len(self.history)
        self._poll()
        return len(self.history) > before

    def _poll(self) -> None:
        if self._queue or not self._inflight:
            return
        if not all(p.done() for _, p, _ in self._inflight):
            return  # try again on a later call: no host sync in the training loop
        timings: dict[int, list[float]] = {}
        costs: dict[int, list[float]] = {}
        for t, p, w in self._inflight:
            ms = p.elapsed_ms()
            timings.setdefault(t, []).append(ms)
            costs.setdefault(t, []).append(ms / w)
        self._inflight = []
        self.threshold = pick_threshold(costs)
        self.history.append(
            ArcRound(
                round=len(self.history),
                call=self._calls,
                threshold=self.threshold,
                timings=timings,
                costs={t: statistics.median(v) for t, v in costs.items()},
            )
        )
