"""PhaseTimer's bookkeeping on the CPU, against a fake clock: exact figures, no sleeps."""

import pytest
import torch

from gstrain.train import timing
from gstrain.train.timing import PhaseTimer


class FakeClock:
    """Stands in for the `time` module in timing.py: perf_counter moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_phases_average_over_steps(clock):
    timer = PhaseTimer(torch.device("cpu"))
    for ms in (10, 20, 60):
        with timer.phase("a"):
            clock.advance(ms)
        clock.advance(1000)  # between phases: not counted
        timer.step_done()
    summary = timer.summary()
    assert summary["a"] == pytest.approx(30.0)
    assert timer.summary() == {}  # reset after reading


def test_backward_span_times_only_the_wrapped_op(clock):
    timer = PhaseTimer(torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)

    def op(backward_ms: float):
        """An identity-like op whose backward takes backward_ms on the fake clock."""

        class Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx, v):
                return v * 2

            @staticmethod
            def backward(ctx, g):
                clock.advance(backward_ms)
                return g * 2

        return Op.apply

    slow, outside = op(50), op(700)  # outside the span: its time is not counted

    span = timer.backward_span("slow_bwd")
    y = span.output(slow(span.input(outside(x * 3))))
    (y.sum() * 1).backward()
    timer.step_done()
    summary = timer.summary()
    assert summary["slow_bwd"] == pytest.approx(50.0)
    assert torch.allclose(x.grad, torch.full((4,), 12.0))  # 3 * 2 * 2: the hooks are identities for gradients


def test_untimed_steps_do_not_count(clock):
    timer = PhaseTimer(torch.device("cpu"))
    for step in range(8):
        timer.enabled = step % 4 == 0
        with timer.phase("a"):
            clock.advance(10 if timer.enabled else 50)
        timer.step_done()
    assert timer.pending_steps == 2
    summary = timer.summary()
    assert summary["a"] == pytest.approx(10.0)  # the mean of the two timed 10 ms steps, not of all eight
    assert timer.last_host_ms["a"] == summary["a"]  # on the CPU host time is the phase time


@pytest.mark.parametrize("every", [1, 2, 7, 49, 197])
def test_timed_steps_come_every_nth_step_and_skip_the_first(every):
    steps = 30_000
    timed = [s for s in range(steps) if timing.timed_step(s, every)]
    assert all(b - a == every for a, b in zip(timed, timed[1:], strict=False))  # evenly spaced, every Nth
    assert timed[0] < every  # the first comes within the first N steps ...
    assert (0 in timed) == (every == 1)  # ... and is not step 0 (one-time costs) unless every step is timed
    assert len(timed) in (steps // every, steps // every + 1)
