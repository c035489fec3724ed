"""ARC tuner selection logic and the CUDA module's pure helpers: CPU only, no GPU, no timings."""

from __future__ import annotations

import pytest
import torch

from gstrain import extensions
from gstrain.cuda_build import gencode_flags
from gstrain.errors import UserError
from gstrain.render.arc import DEFAULT_CANDIDATES, ArcTuner, pick_threshold
from gstrain.render.cuda import resolve_threshold


class FakeProbe:
    """Stands in for a CUDA event pair: its time comes from a table, done() when released."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.threshold: int | None = None
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.stopped = True

    def done(self) -> bool:
        return self.stopped and self.clock.released

    def elapsed_ms(self) -> float:
        assert self.done(), "events read before they completed"
        self.clock.reads += 1
        return self.clock.times[self.threshold].pop(0)


class FakeClock:
    def __init__(self, times: dict[int, list[float]]) -> None:
        self.times = {k: list(v) for k, v in times.items()}
        self.released = False
        self.reads = 0
        self.probes: list[FakeProbe] = []

    def factory(self) -> FakeProbe:
        p = FakeProbe(self)
        self.probes.append(p)
        return p


def drive(tuner: ArcTuner, clock: FakeClock, calls: int, work: float = 1.0) -> list[int]:
    """Simulate `calls` backward calls; returns the thresholds they ran with."""
    used = []
    for _ in range(calls):
        t, probe = tuner.next_call(work)
        if probe is not None:
            probe.threshold = t
            probe.start()
            probe.stop()
        used.append(t)
    return used


def test_pick_threshold_takes_the_smallest_median():
    assert pick_threshold({1: [5.0, 5.1, 9.0], 4: [4.0, 4.2, 4.1], 8: [4.5, 3.0, 4.6]}) == 4
    # one outlier does not move a median of three
    assert pick_threshold({2: [3.0, 3.0, 100.0], 8: [3.5, 3.5, 3.5]}) == 2


def test_pick_threshold_ties_go_to_the_smaller_threshold():
    assert pick_threshold({16: [2.0], 4: [2.0], 8: [2.0]}) == 4


def test_pick_threshold_skips_empty_and_rejects_nothing():
    assert pick_threshold({4: [], 8: [1.0]}) == 8
    with pytest.raises(ValueError):
        pick_threshold({})
    with pytest.raises(ValueError):
        pick_threshold({4: []})


def test_round_cycles_candidates_then_keeps_the_winner():
    times = {1: [5.0, 5.0], 4: [3.0, 3.2], 8: [3.5, 3.4]}
    clock = FakeClock(times)
    tuner = ArcTuner(candidates=(1, 4, 8), reps=2, warmup=1, initial=8, probe_factory=clock.factory)
    assert tuner.tuning
    used = drive(tuner, clock, 1 + 3 * 2)
    assert used[0] == 8  # warm-up call at the current threshold, untimed
    assert used[1:] == [1, 4, 8, 1, 4, 8]  # interleaved so each candidate sees a spread of calls
    assert len(clock.probes) == 6
    # the GPU has not finished: the tuner keeps the old threshold and reads nothing
    assert drive(tuner, clock, 3) == [8, 8, 8]
    assert clock.reads == 0 and tuner.history == []
    clock.released = True
    assert drive(tuner, clock, 2) == [4, 4]
    assert tuner.threshold == 4 and not tuner.tuning
    (rnd,) = tuner.history
    assert rnd.round == 0 and rnd.threshold == 4
    assert rnd.timings == {1: [5.0, 5.0], 4: [3.0, 3.2], 8: [3.5, 3.4]}
    assert rnd.costs[4] == pytest.approx(3.1)
    assert clock.reads == 6  # each event pair read exactly once


def test_invalidate_starts_a_new_round():
    clock = FakeClock({2: [1.0, 9.0], 8: [2.0, 1.0]})
    clock.released = True
    tuner = ArcTuner(candidates=(2, 8), reps=1, warmup=0, probe_factory=clock.factory)
    drive(tuner, clock, 3)
    assert tuner.threshold == 2 and len(tuner.history) == 1
    tuner.invalidate()
    assert tuner.tuning
    assert drive(tuner, clock, 2) == [2, 8]
    assert tuner.poll()
    assert tuner.threshold == 8 and [r.round for r in tuner.history] == [0, 1]


def test_invalidate_mid_round_discards_partial_timings():
    clock = FakeClock({2: [1.0, 1.0], 8: [5.0, 5.0]})
    tuner = ArcTuner(candidates=(2, 8), reps=1, warmup=0, probe_factory=clock.factory)
    drive(tuner, clock, 1)  # only T=2 timed
    tuner.invalidate()
    clock.released = True
    drive(tuner, clock, 2)
    assert tuner.poll()
    assert tuner.history[0].timings == {2: [1.0], 8: [5.0]}


def test_work_normalises_views_of_different_cost():
    # T=8 ran on a view with twice the intersections: per unit of work it is the faster one
    clock = FakeClock({4: [2.0], 8: [3.0]})
    clock.released = True
    tuner = ArcTuner(candidates=(4, 8), reps=1, warmup=0, probe_factory=clock.factory)
    for work in (1.0, 2.0):
        t, probe = tuner.next_call(work)
        probe.threshold = t
        probe.start()
        probe.stop()
    assert tuner.poll()
    assert tuner.threshold == 8
    assert tuner.history[0].timings == {4: [2.0], 8: [3.0]}  # raw ms are kept for the logs


def test_candidates_are_validated():
    with pytest.raises(ValueError):
        ArcTuner(candidates=())
    with pytest.raises(ValueError):
        ArcTuner(candidates=(0, 8))
    with pytest.raises(ValueError):
        ArcTuner(candidates=(8, 33))
    with pytest.raises(ValueError):
        ArcTuner(reps=0)
    assert ArcTuner(candidates=(4, 4, 8), probe_factory=lambda: None).candidates == (4, 8)
    assert all(1 <= c <= 32 for c in DEFAULT_CANDIDATES)


def test_mode_thresholds():
    assert resolve_threshold("atomic", 8) > 32  # more lanes than a warp holds: never warp-reduce
    assert resolve_threshold("warp", 8) == 1
    assert resolve_threshold("distwar", 6) == 6
    assert resolve_threshold("arc", 8) is None
    with pytest.raises(UserError):
        resolve_threshold("distwar", 0)
    with pytest.raises(UserError):
        resolve_threshold("fast", 8)


def testgencode_flags():
    assert gencode_flags(["9.0"]) == ["-gencode=arch=compute_90,code=sm_90"]
    assert gencode_flags(["8.6", "9.0+PTX"]) == [
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_building_without_cuda_is_a_user_error():
    with pytest.raises(UserError) as err:
        extensions.raster()
    assert "\n" not in str(err.value)
