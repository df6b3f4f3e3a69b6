"""The timing bookkeeping every device shares (runtime.timing), on a fake clock: how many
calls a batch holds, what every rank agrees on, and how an overlap is measured in both
directions. The CUDA timer itself needs a GPU (bench/gpu_check.py runs it)."""

import pytest

from runtime.timing import (HOST_MAX_CALLS, MAX_CALLS, MIN_CALLS, RESIZES, HostTimer, calls_for, covering_calls,
                            mutual_slowdown, per_call)


class FakeTimer:
    """A device whose calls take ``cost_s`` each; records every batch it timed."""

    def __init__(self, cost_s: float, first_s: float | None = None):
        self.cost_s, self.first_s = cost_s, first_s
        self.batches: list[int] = []
        self.calls = 0

    def batch(self, fn, n):
        self.batches.append(n)
        for _ in range(n):
            fn()
        self.calls += n
        if len(self.batches) == 1 and self.first_s is not None:
            return self.first_s  # a warm-up call is slower
        return n * self.cost_s

    def sync(self):
        pass


def test_calls_per_batch():
    assert calls_for(0.01, 0.2) == 20
    assert calls_for(1.0, 0.2) == MIN_CALLS  # a long call: still a few, for a mean
    assert calls_for(1e-9, 0.2) == MAX_CALLS  # a tiny one: capped
    assert calls_for(0.0, 0.2) == MAX_CALLS
    assert covering_calls(0.1, 0.01) == 20 and covering_calls(0.1, 0.03) == 7 and covering_calls(0.0, 1.0) == 1


def test_per_call_agrees_on_the_batch_and_the_result():
    """One warm-up call sizes the batch from the figure every rank agrees on (the
    largest), so that every rank makes the same calls; the result is the batch's mean,
    agreed too."""
    agreed = []

    def agree(x):  # another rank was twice as slow
        agreed.append(x)
        return 2 * x

    timer, calls = FakeTimer(0.004, first_s=0.005), []
    t = per_call(timer, lambda: calls.append(1), 0.2, agree)
    assert timer.batches == [1, 20]  # 0.2 s / (2 x 5 ms)
    assert agreed == [0.005, pytest.approx(0.004)] and t == pytest.approx(0.008)
    assert len(calls) == 21
    # a long call: the batch holds at least min_calls (calibrate's large collectives)
    timer, calls = FakeTimer(0.1, first_s=0.1), []
    per_call(timer, lambda: calls.append(1), 0.2, lambda x: x, min_calls=10)
    assert timer.batches == [1, 10]
    timer = FakeTimer(0.1, first_s=0.1)
    per_call(timer, lambda: None, 0.2, lambda x: x)
    assert timer.batches == [1, MIN_CALLS]


def test_per_call_can_return_the_ranks_mean():
    """With ``result`` the batch is still sized by the agreed (largest) figure, so every
    rank makes the same calls, but the figure returned is ``result``'s: the ranks'
    mean where a rank's own cost is wanted (calibrate's kernels: the simulator draws
    each rank's drift itself)."""
    agreed, means = [], []

    def agree(x):  # the other rank was twice as slow
        agreed.append(x)
        return 2 * x

    def mean(x):  # ... so the two ranks' mean is 1.5 x this rank's
        means.append(x)
        return 1.5 * x

    timer = FakeTimer(0.004, first_s=0.005)
    t = per_call(timer, lambda: None, 0.2, agree, result=mean)
    assert timer.batches == [1, 20]
    assert agreed == [0.005] and means == [pytest.approx(0.004)] and t == pytest.approx(0.006)


class SlicedTimer(FakeTimer):
    """Calls of ``cost_s``; the batches listed in ``slices`` (by index) also hold one
    time slice of another process, ``slice_s`` long."""

    def __init__(self, cost_s: float, slice_s: float, slices: set[int]):
        super().__init__(cost_s)
        self.slice_s, self.slices = slice_s, slices

    def batch(self, fn, n):
        k = len(self.batches)
        return super().batch(fn, n) + (self.slice_s if k in self.slices else 0.0)


def test_a_short_call_on_the_host_is_timed_over_the_whole_min_s():
    """A 4 us call (a PyTorch op's dispatch) with a 3 ms time slice in its warm-up call:
    capped at MAX_CALLS, the batch was sized from the slow warm-up and lasted well
    under a millisecond; with HOST_MAX_CALLS it is sized again from its own figure
    until it lasts about ``min_s``, and the slice of the first batch is not in the
    figure."""
    timer = SlicedTimer(4e-6, 3e-3, {0})
    t = per_call(timer, lambda: None, 0.025, lambda x: x, max_calls=HOST_MAX_CALLS)
    assert timer.batches == [1, 8, 6250] and t == pytest.approx(4e-6)
    # a slice in the batch itself is counted at its share of the 25 ms: 4 us + 3 ms / 6250
    timer = SlicedTimer(4e-6, 3e-3, {1})
    assert per_call(timer, lambda: None, 0.025, lambda x: x, max_calls=HOST_MAX_CALLS) == \
        pytest.approx(4e-6 + 3e-3 / 6250) and timer.batches == [1, 6250]
    # capped at MAX_CALLS the same call is timed over 200 calls, and nothing is resized
    timer = SlicedTimer(4e-6, 3e-3, {1})
    t = per_call(timer, lambda: None, 0.025, lambda x: x)
    assert timer.batches == [1, MAX_CALLS] and t == pytest.approx(4e-6 + 3e-3 / MAX_CALLS)
    # every batch sliced: resized RESIZES times, then the last figure is kept
    timer = SlicedTimer(4e-6, 3e-3, set(range(10)))
    per_call(timer, lambda: None, 0.025, lambda x: x, max_calls=HOST_MAX_CALLS)
    assert len(timer.batches) == 2 + RESIZES


def test_host_timer_runs_every_call():
    calls = []
    assert HostTimer().batch(lambda: calls.append(1), 7) >= 0 and len(calls) == 7


class FakeDevice:
    """Two streams: a's calls take 1 ms alone and 1.5 ms while b runs; b's 4 ms alone
    and 6 ms while a runs. ``beside`` checks the background covers the batch."""

    A, B, A_SLOW, B_SLOW = 1e-3, 4e-3, 1.5e-3, 6e-3

    def __init__(self):
        self.runs = []

    def a_beside_b(self, n, nb):
        self.runs.append(("a", n, nb))
        assert nb * self.B_SLOW >= n * self.A_SLOW, "the background must outlast the batch"
        return n * self.A_SLOW

    def b_beside_a(self, n, na):
        self.runs.append(("b", n, na))
        assert na * self.A_SLOW >= n * self.B_SLOW, "the background must outlast the batch"
        return n * self.B_SLOW


def test_mutual_slowdown_measures_each_direction_with_a_covering_background():
    dev = FakeDevice()
    slow_a, slow_b = mutual_slowdown(dev.A, dev.B, 0.2, dev.a_beside_b, dev.b_beside_a, lambda x: x)
    assert (slow_a, slow_b) == (pytest.approx(1.5), pytest.approx(1.5))
    # a: 200 calls of 1 ms beside 2 x 0.2 s / 4 ms = 100 of b; b: 50 calls of 4 ms
    # beside 2 x 0.2 s / 1 ms = 400 of a
    assert dev.runs == [("a", 200, 100), ("b", 50, 400)]


def test_mutual_slowdown_is_never_a_speed_up():
    """Noise can make a side look faster beside the other: that is no slowdown (1)."""
    slow = mutual_slowdown(1e-3, 1e-3, 0.01, lambda n, nb: n * 0.9e-3, lambda n, nb: n * 1.2e-3, lambda x: x)
    assert slow == (1.0, pytest.approx(1.2))
