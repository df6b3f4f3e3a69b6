"""Calibration of the contention between compute and collectives: how much slower a
kernel runs while a collective is in flight, and how much slower a collective's
bandwidth and latency get while kernels run. On GPUs, real overlap on two streams of
their own, each direction timed by CUDA events (``runtime.timing.mutual_slowdown``); on
CPUs, gloo's blocking collectives in a background thread beside matmuls on the rank's
thread, as a rank's comm thread competes with its kernels for the cores.

A mixin of ``runtime.calibrate.Calibrator``: it uses the calibrator's world, ``quick``,
``queued``, ``kernels``, ``timer`` / ``comm_timer``, ``min_s``, ``_together``,
``_collective``, ``agree`` / ``agree_all`` and ``log``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from commsim.ir import ops as O
from runtime.timing import mutual_slowdown


class ContentionMeasurements:
    """Contention benchmarks of a ``Calibrator``."""

    world: int
    quick: bool
    queued: bool
    kernels: Any
    timer: Any
    comm_timer: Any
    min_s: float

    def contention(self) -> tuple[float, float, float]:
        """(compute slowdown while a collective runs, collective bandwidth slowdown while
        compute runs, collective latency slowdown while compute runs).

        Twice: a 4 MiB all-reduce, whose time is mostly bandwidth, and a 64 KiB
        all-gather, whose time is mostly latency. With one rank there is no collective
        to overlap: 1 (no slowdown) for all three."""
        if self.world < 2:
            self.log("contention: not measured (one rank: no collective to overlap)")
            return 1.0, 1.0, 1.0
        n = 256 if self.quick else 384
        if self.queued:
            n = 2048 if self.quick else 4096  # a GEMM that keeps a GPU busy for a while
        op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * n ** 3 * 4, 0, 0, O.GemmShape(n, n, n, 4))
        compute_alone = self._together(lambda: self.kernels.run(op), slowest=True)  # as the slowdowns
        under = self._overlapped if self.queued else self._under_compute
        slow_c, slow_n = under(op, compute_alone, self._collective("all_reduce", 4 << 20))
        _, slow_lat = under(op, compute_alone, self._collective("all_gather", 64 << 10))
        self.kernels.operands.clear()
        self.log(f"contention: compute x{slow_c:.2f} while communicating, communication x{slow_n:.2f} "
                 f"(bandwidth) and x{slow_lat:.2f} (latency) while computing")
        return slow_c, slow_n, slow_lat

    def _overlapped(self, op: O.Compute, compute_alone: float, comm: Callable[[], Any]) -> tuple[float, float]:
        """GPUs: (compute slowdown, collective slowdown), each side timed by CUDA events
        on its own stream while the other side's calls run on theirs, both released at
        the same moment (``CudaTimer.beside``): real overlap on the device, in each
        direction separately (``runtime.timing.mutual_slowdown``)."""
        comm_alone = self._together(comm, self.comm_timer, slowest=True)

        def gemm() -> None:
            self.kernels.run(op)

        def compute_beside(n: int, nb: int) -> float:
            dist.barrier()
            return self.timer.beside(gemm, n, self.comm_timer, comm, nb)

        def comm_beside(n: int, nb: int) -> float:
            dist.barrier()
            return self.comm_timer.beside(comm, n, self.timer, gemm, nb)

        return mutual_slowdown(compute_alone, comm_alone, self.min_s, compute_beside, comm_beside, self.agree)

    def _under_compute(self, op: O.Compute, compute_alone: float, comm: Callable[[], Any]) -> tuple[float, float]:
        """CPUs: (compute slowdown, collective slowdown) with ``comm`` in a background
        thread, as gloo's collectives block the thread that calls them.

        A fixed number of collectives run in the background (the same count on every
        rank, so none is left waiting) while the foreground runs matmuls until they are
        done; each side's rate is compared with its rate alone. The collective's own
        thread then competes for the core with the rank's kernels, and a small
        collective waits for the scheduler at every message of its protocol, so its
        latency suffers more than a large one's bandwidth."""
        comm_alone = self._together(comm, slowest=True)
        budget = 0.1 if self.quick else 0.3
        reps = max(3 if self.quick else 4, int(budget / max(comm_alone, 1e-6)))
        done = threading.Event()
        comm_elapsed = [0.0]

        def background() -> None:
            t = time.perf_counter()
            for _ in range(reps):
                comm()
            comm_elapsed[0] = time.perf_counter() - t
            done.set()

        dist.barrier()
        th = threading.Thread(target=background, daemon=True)
        t = time.perf_counter()
        th.start()
        count = 0
        while not done.is_set():
            self.kernels.run(op)
            count += 1
        fg = time.perf_counter() - t
        th.join()
        compute_busy = fg / max(count, 1)
        comm_busy = comm_elapsed[0] / reps
        slow = self.agree_all([compute_busy / compute_alone, comm_busy / comm_alone])
        return max(1.0, slow[0]), max(1.0, slow[1])
