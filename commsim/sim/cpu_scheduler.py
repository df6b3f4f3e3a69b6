"""A CPU node's cores, time-sliced between runnable threads as the OS does (round robin).

Used when a measured CPU platform puts more ranks on a node than it has cores: every
rank's host thread (kernels, host work, allocations) and every collective's backend
threads then queue for a core. A thread holds its core across consecutive work until it
blocks or its time slice runs out while another thread waits; a thread that wakes from
blocking is served before one whose slice ran out (as Linux favours waking threads).
"""

from __future__ import annotations

import simpy


class CpuThread:
    """A thread the CPU scheduler runs: holds a core across consecutive work until it
    blocks or its time slice runs out while another thread waits."""

    __slots__ = ("req", "used_ns", "preempted")

    def __init__(self) -> None:
        self.req = None
        self.used_ns = 0
        self.preempted = False


class CpuScheduler:
    """One node's cores, time-sliced between runnable threads (round robin)."""

    def __init__(self, env: simpy.Environment, cores: int, slice_ns: int):
        assert cores >= 1 and slice_ns > 0
        self.env = env
        self.cores = simpy.PriorityResource(env, capacity=cores)
        self.slice_ns = slice_ns

    def run(self, th: CpuThread, work_ns: int):
        """Give ``th`` ``work_ns`` of one core's time; returns when it has had it."""
        env = self.env
        while work_ns > 0:
            if th.req is None:
                # woken threads first; a thread whose slice ran out queues behind them
                th.req = self.cores.request(priority=1 if th.preempted else 0)
                th.used_ns = 0
                yield th.req
            chunk = min(work_ns, self.slice_ns - th.used_ns)
            yield env.timeout(chunk)
            work_ns -= chunk
            th.used_ns += chunk
            if th.used_ns >= self.slice_ns:
                if self.cores.queue:
                    self.release(th)
                    th.preempted = True
                else:
                    th.used_ns = 0  # nobody waits: a fresh slice on the same core

    def release(self, th: CpuThread) -> None:
        """``th`` blocks (or ends): its core goes to the next runnable thread."""
        if th.req is not None:
            self.cores.release(th.req)
            th.req = None
        th.preempted = False

    def run_thread(self, work_ns: int):
        """A short-lived thread (a collective's backend thread) doing ``work_ns``, then ending."""
        th = CpuThread()
        yield from self.run(th, work_ns)
        self.release(th)
