import time

import torch

from gstrain.train.timing import PhaseTimer


def test_phases_average_over_steps():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(3):
        with timer.phase("a"):
            time.sleep(0.01)
        timer.step_done()
    summary = timer.summary()
    assert 8 < summary["a"] < 60
    assert timer.summary() == {}  # reset after reading


def test_backward_span_times_only_the_wrapped_op():
    timer = PhaseTimer(torch.device("cpu"))
    x = torch.randn(4, requires_grad=True)

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v * 2

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.05)
            return g * 2

    span = timer.backward_span("slow_bwd")
    y = span.output(Slow.apply(span.input(x * 3)))
    (y.sum() * 1).backward()
    timer.step_done()
    summary = timer.summary()
    assert 45 < summary["slow_bwd"] < 200
    assert torch.allclose(x.grad, torch.full((4,), 6.0))  # the hooks are identities for gradients


def test_untimed_steps_do_not_count():
    timer = PhaseTimer(torch.device("cpu"))
    for step in range(8):
        timer.enabled = step % 4 == 0
        with timer.phase("a"):
            time.sleep(0.01 if timer.enabled else 0.05)
        timer.step_done()
    assert timer.pending_steps == 2
    summary = timer.summary()
    assert 8 < summary["a"] < 40  # the mean of the two timed 10 ms steps, not of all eight
    assert timer.last_host_ms["a"] == summary["a"]  # on the CPU host time is the phase time
