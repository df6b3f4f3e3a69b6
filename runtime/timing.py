"""Timing a benchmark's calls, on whichever device runs them.

A ``Timer`` times a batch of calls issued back to back: ``batch(fn, n)`` returns the
seconds from the first call's start to the last one's end *on the device that runs
them*. Two implementations:

* ``HostTimer``: the host's monotonic clock around the batch; right where kernels run
  inline on the host thread (CPUs), since a call has finished when it returns.
* ``CudaTimer``: CUDA events recorded on a stream before the first call and after the
  last, read after one synchronisation at the end. The host queues the whole batch
  without waiting, so the figure is the device's time per call: neither the launch
  nor a synchronise round trip is counted per call, as neither is in a step where the
  host runs ahead of its streams (``perf_counter`` around a device synchronise counts
  both, tens of microseconds, and made every GEMM up to 1024^3 look launch-bound).

What to time and how many calls is the same on every device, and lives here as plain
functions of a ``Timer`` (``calls_for``, ``per_call``, ``mutual_slowdown``), so that the
bookkeeping is tested on CPUs with a fake clock. Seconds throughout.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Protocol


class Timer(Protocol):
    """Times batches of calls on the device that runs them."""

    def batch(self, fn: Callable[[], Any], n: int) -> float:
        """Seconds that ``n`` calls of ``fn``, issued back to back, take on the device."""
        ...

    def sync(self) -> None:
        """Wait until everything issued so far has run."""
        ...


class HostTimer:
    """The host's clock around the batch: for kernels that run on the host thread."""

    def batch(self, fn: Callable[[], Any], n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - t

    def sync(self) -> None:
        pass


# torch.cuda._sleep spins a GPU for a number of its clock cycles: about 2e9 a second on
# the GPUs commsim has presets of (A100 1.41 GHz, H100 and H200 1.98 GHz boost). It sets
# only how long a stream is held before a timed batch, never what is timed.
GPU_CYCLES_PER_S = 2e9
# Host time to issue one call, generously (a GEMM launch or an NCCL call from Python
# takes 5-20 us): a batch's stream is held this long per call it will run.
ISSUE_BUDGET_S = 50e-6


class CudaTimer:
    """CUDA events around the batch on ``stream`` (the calls are issued on it).

    Before the batch the stream is held by a spinning kernel long enough for the host
    to queue every call, so the calls then run back to back at the device's own pace:
    the batch is timed from the end of the hold to the end of the last call. Without
    the hold, calls shorter than their launch (a small memory-bound kernel, 2-5 us)
    would be timed at the host's launch rate."""

    def __init__(self, device: Any, stream: Any = None):
        import torch

        self.torch = torch
        self.device = device
        self.stream = stream if stream is not None else torch.cuda.current_stream(device)

    def _hold(self, calls: int) -> None:
        sleep = getattr(self.torch.cuda, "_sleep", None)
        if sleep is not None:  # a private API; without it the first calls are launch-bound
            sleep(int(min(calls * ISSUE_BUDGET_S, 0.5) * GPU_CYCLES_PER_S))

    def batch(self, fn: Callable[[], Any], n: int) -> float:
        torch = self.torch
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self._hold(n)
            begin.record(self.stream)
            for _ in range(n):
                fn()
            end.record(self.stream)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3  # ms -> s

    def beside(self, fn: Callable[[], Any], n: int, other: "CudaTimer", background: Callable[[], Any],
               n_background: int) -> float:
        """Seconds of ``n`` calls of ``fn`` on this stream while ``n_background`` calls of
        ``background`` run on ``other``'s stream. Both wait for one event recorded after
        this stream's hold, so they start together, on the device, whatever order the
        host queued them in; the background has enough calls to outlast the batch."""
        torch = self.torch
        go = torch.cuda.Event()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self._hold(n + n_background)
            go.record(self.stream)
        other.stream.wait_event(go)
        with torch.cuda.stream(other.stream):
            for _ in range(n_background):
                background()
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            for _ in range(n):
                fn()
            end.record(self.stream)
        self.sync()  # the background too
        return begin.elapsed_time(end) / 1e3

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)


# A measured batch lasts at least this long, or holds MAX_CALLS calls: a CUDA event's
# resolution is about 0.5 us (cudaEventElapsedTime), so even the shortest batch is
# timed to better than 1%.
MIN_CALLS = 3
MAX_CALLS = 200
# A batch of host-thread calls of a few microseconds (a PyTorch op's dispatch) is capped
# here instead, so that it lasts the whole ``min_s``: capped at MAX_CALLS, a 3 us call's
# batch lasted 0.6 ms, and one time slice of another process inside it (1-4 ms on the
# development VM) made the mean 40x the call's cost (129 us for a 3-5 us dispatch).
# Over ``min_s`` (25 ms quick, 200 ms full) such slices count at their share of the
# time, as they do in a step.
HOST_MAX_CALLS = 1_000_000
# Times a batch may be sized again (``per_call``) when it lasted under half of ``min_s``.
RESIZES = 3


def calls_for(first_s: float, min_s: float, lo: int = MIN_CALLS, hi: int = MAX_CALLS) -> int:
    """How many calls make a batch of about ``min_s`` seconds, given one call's time
    (``first_s``, which every rank must agree on: a collective inside must be called
    as often on every rank); at least ``lo``, at most ``hi``."""
    return int(min(hi, max(lo, min_s / max(first_s, 1e-7))))


def per_call(timer: Timer, fn: Callable[[], Any], min_s: float, agree: Callable[[float], float],
             min_calls: int = MIN_CALLS, result: Callable[[float], float] | None = None,
             max_calls: int = MAX_CALLS) -> float:
    """Seconds per call of ``fn``: one call first (a warm-up, and the estimate that
    sizes the batch), then one batch of at least ``min_calls``, timed whole. ``agree``
    makes every rank use the same figure (the largest) for the batch size, so that
    every rank makes the same calls; ``result`` (``agree`` where not given) makes the
    figure every rank returns: the largest, or the ranks' mean where each rank's own
    cost is wanted. A batch that lasted under half of ``min_s`` though it could hold
    more calls (the warm-up call was slow) is run again, sized from its own figure, up
    to ``RESIZES`` times. ``max_calls`` caps the batch (``HOST_MAX_CALLS`` for calls of a few
    microseconds on the host thread).

    The batch's mean, not a median of calls: where ranks time-slice a CPU, a call
    shorter than a slice usually runs at a whole core's speed and now and then waits
    out another rank's slice, and the mean is what such calls cost in a step."""
    first = agree(timer.batch(fn, 1))
    n = calls_for(first, min_s, lo=min_calls, hi=max_calls)
    figure = (result or agree)(timer.batch(fn, n) / n)
    for _ in range(RESIZES):
        # a warm-up call that a time slice of another process landed in sized the batch
        # far too small: size it again from the batch's figure (agreed: every rank
        # decides alike, so every rank makes the same calls)
        if n >= max_calls or n * figure >= min_s / 2:
            break
        n = calls_for(figure, min_s, lo=min_calls, hi=max_calls)
        figure = (result or agree)(timer.batch(fn, n) / n)
    return figure


def covering_calls(span_s: float, call_s: float, margin: float = 2.0) -> int:
    """Calls of ``call_s`` each (alone) that keep a stream busy for ``span_s`` (the
    batch's time alone) with a margin, so that a batch timed beside them is overlapped
    from its first call to its last: the margin covers the batch slowing down by up to
    that factor more than the background does."""
    return max(1, math.ceil(round(margin * span_s / max(call_s, 1e-9), 6)))


def mutual_slowdown(a_alone: float, b_alone: float, min_s: float, a_beside_b: Callable[[int, int], float],
                    b_beside_a: Callable[[int, int], float], agree: Callable[[float], float]) -> tuple[float, float]:
    """(a's slowdown while b runs, b's slowdown while a runs), each at least 1: two
    runs, one per direction. ``a_alone`` / ``b_alone``: seconds per call of each alone
    (agreed by every rank). ``a_beside_b(n, nb)``: seconds of ``n`` calls of a timed
    while ``nb`` calls of b run beside them, enough to cover the whole batch
    (``covering_calls``); ``b_beside_a`` the reverse. Call counts follow from agreed
    figures only, so every rank makes the same calls (collectives must match)."""
    n = calls_for(a_alone, min_s)
    a = agree(a_beside_b(n, covering_calls(n * a_alone, b_alone)) / n)
    n = calls_for(b_alone, min_s)
    b = agree(b_beside_a(n, covering_calls(n * b_alone, a_alone)) / n)
    return max(1.0, a / a_alone), max(1.0, b / b_alone)


def latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Latency from the smallest transfer, bandwidth from the slope between the smallest
    and the largest (a least-squares intercept is dominated by the big sizes' noise)."""
    points = sorted(points)
    (x0, y0), (x1, y1) = points[0], points[-1]
    bw = (x1 - x0) / (y1 - y0) if y1 > y0 else x1 / max(y1, 1e-9)
    return max(0.0, y0 - x0 / bw), bw
