"""Calibration's host-side measurements: on CPUs a framework's launch cost (a PyTorch
op's dispatch), the executor's own per-op costs, allocation cost by size in a step-like
steady state, the first touch of fresh host pages (and, on a VM that reports free
memory to its hypervisor, of reported ones), and the caching allocator's statistics on
GPUs.

A mixin of ``runtime.calibrate.Calibrator``: it uses the calibrator's rank, world,
backend, platform, device, ``quick``, ``sync``, ``agree`` / ``agree_all``, ``rank_mean`` /
``mean_of_ranks`` and ``log``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from runtime.calibrate_cpu import cpu_cores
from runtime.calibrate_profile import host_memory
from runtime.executor import RankExecutor, RankOptions
from runtime.executor_loop import COLD_REPS, HOST_OP_KINDS, RECORD_KINDS, LoopCosts, loop_costs, loop_schedule
from runtime.page_reporting import balloon_reports, reported_extra, reported_met, reporting_period_s
from runtime.timing import HOST_MAX_CALLS, HostTimer, latency_bandwidth, per_call

# the most a rank holds to find reported pages: past the guest's unreported free pages
# (768 MiB to 1.75 GiB on this project's VM: traces/README.md)
REPORTED_BUDGET_BYTES = 2 << 30


class HostMeasurements:
    """Host-side benchmarks of a ``Calibrator``."""

    rank: int
    world: int
    backend: str
    platform: Any
    device: Any
    quick: bool
    min_s: float
    ranks_per_node: int

    def launch_costs(self) -> dict[str, Any] | None:
        """CPUs: a framework's host cost per kernel on this machine, for the schedule's
        launch host ops: one small PyTorch op's dispatch (``x.mul_(1.0)`` on 256
        elements, whose kernel is a few ns), the mean of a batch that lasts the whole
        ``min_s`` (``runtime.timing.HOST_MAX_CALLS``), the ranks' mean.
        A CPU has no cudaLaunchKernel, which the default launch costs include. A
        collective's launch is 0: its call is priced by the backend's own measured call
        time (``call_points``), which includes c10d's dispatch. None on GPUs, whose
        launches keep the cited figures (``commsim.strategies.knobs.HostCosts``)."""
        if not self.platform.inline_kernels:
            return None
        x = torch.zeros(256, device=self.device)
        t = per_call(HostTimer(), lambda: x.mul_(1.0), self.min_s, self.agree, result=self.rank_mean,
                     max_calls=HOST_MAX_CALLS)
        self.log(f"launch: {t * 1e6:.2f} us per PyTorch op's dispatch")
        return {"launch_ns": int(t * 1e9), "collective_launch_ns": 0,
                "source": "launches timed by commsim calibrate (a PyTorch op's dispatch on this CPU; collective calls "
                          "priced by the backend's call time)"}

    def executor_overheads(self) -> LoopCosts:
        """The executor's own cost per op (``runtime.executor_loop``): a step of tiny
        kernels and of host ops of no duration, each kind in a block, run as
        ``commsim execute`` runs it; the ranks' mean of each figure."""
        inline = self.platform.inline_kernels
        sched = loop_schedule(self.world, cold_reps=(COLD_REPS // (3 if self.quick else 1)) if inline else 0)
        run = RankExecutor(sched, self.rank, self.backend, RankOptions(steps=3, warmup=1)).run()
        costs = [loop_costs([r for r in run.records if r.step == s], inline) for s in range(3)]
        mine = [statistics.median(getattr(c, f) for c in costs) for f in ("issue_ns", "kernel_ns")]
        kinds = HOST_OP_KINDS + RECORD_KINDS
        mine += [statistics.median(c.host_op_ns[k] for c in costs) for k in kinds]
        cold_keys = [(cls, i) for cls, pts in costs[0].cold_points.items() for i in range(len(pts))]
        mine += [statistics.median(c.cold_points[cls][i][1] for c in costs) for cls, i in cold_keys]
        mean = self.mean_of_ranks([float(x) for x in mine])  # a rank's own: see _together
        cold = {cls: [[x, 0.0] for x, _ in pts] for cls, pts in costs[0].cold_points.items()}
        for (cls, i), v in zip(cold_keys, mean[2 + len(kinds):]):
            cold[cls][i][1] = v
        out = LoopCosts(int(mean[0]), int(mean[1]), {k: int(v) for k, v in zip(kinds, mean[2:])}, cold)
        self.log(f"executor: host issue {out.issue_ns / 1e3:.1f} us per device op"
                 + (f", a tiny kernel {out.kernel_ns / 1e3:.1f} us" if out.kernel_ns else "")
                 + "; per host op " + ", ".join(f"{k} {v / 1e3:.1f} us" for k, v in out.host_op_ns.items()))
        if cold:
            self.log("Python after a kernel, over after a tiny one: "
                     + ", ".join(f"{x / 2**20:g} MiB {y / 1e3:.0f} us" for x, y in cold["memory"][1:])
                     + "; GEMMs " + ", ".join(f"{(x / 2) ** (1 / 3):.0f}^3 {y / 1e3:.0f} us" for x, y in cold["gemm"]))
        return out

    def alloc(self) -> tuple[float, float, list[list[float]]]:
        """Allocations as the executor makes them (on CPUs: zeroed host memory), in a
        steady state like a training step's: each round allocates every size in turn,
        holds them all, then frees them. Returns the latency-bandwidth line and the
        per-size table. With a caching allocator (GPUs) the cache is emptied between
        rounds, so each round times cudaMalloc itself (what a cache miss costs): the
        host's time for the call, with the device idle before it (cudaMalloc waits for
        it), and no synchronise after it (the allocation queues nothing). With malloc
        (CPUs) the table matters: glibc reuses heap pages below its mmap threshold (up
        to 32 MiB) and maps fresh ones above it, so the cost per byte jumps across it;
        sizes on both sides of 32 MiB are measured.

        On CPUs each call is timed in wall time with a core per measuring rank (the
        ranks take turns, as many at once as the node has cores: ``_turns``), then
        scaled to the profile's convention for host work (wall time with every rank of
        the node busy: one core's worth / the core share, ``Platform.cpu.core_share``).
        Not in the thread's CPU time: in a virtual machine a fresh page's fault can be
        served by the hypervisor (memory the guest freed and reported back to the host
        is mapped again on its next touch), which no guest clock of the thread counts:
        64 MiB filled fresh took 17-125 ms of wall time and 20 ms of thread CPU time on
        a Firecracker VM with free-page reporting (traces/README.md, "Fresh pages in
        wall time"). Not all ranks at once with more ranks than cores: the ranks leaving
        the barrier preempt each other, the first size allocated after it waited for a
        core, 4 KiB measured 380-403 us on 4 ranks over 2 cores (50 us on 2)."""
        sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 30 << 20, 34 << 20, 64 << 20]
        if self.quick:
            sizes = [4 << 10, 1 << 20, 16 << 20, 34 << 20]
        if self.platform.caching_allocator:
            make = (lambda n: torch.empty(n, dtype=torch.uint8, device=self.device))
        else:
            make = (lambda n: torch.zeros(n, dtype=torch.uint8, device=self.device))
        rounds = 4 if self.quick else 8
        clock, share = self._host_work_clock()
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(rounds + 1):
            for mine in self._turns():
                if not mine:
                    continue
                make(sizes[0])  # the first allocation after the barrier runs cold: not timed
                live = []
                for n in sizes:
                    self.sync()  # GPUs: the device idle, as cudaMalloc waits for it
                    t = clock()
                    live.append(make(n))
                    if r:  # the first round warms the heap up
                        times[n].append((clock() - t) / share)
                del live
                if self.platform.caching_allocator:  # each round's allocations are cudaMalloc calls, not cache hits
                    self.sync()
                    torch.cuda.empty_cache()
        mean = self.mean_of_ranks([statistics.fmean(times[n]) for n in sizes])  # a rank's own: see _together
        pts = [(float(n), float(t)) for n, t in zip(sizes, mean)]
        a, bw = latency_bandwidth(pts)
        self.log("allocation: " + ", ".join(f"{n / 2**20:g} MiB {t * 1e3:.2f} ms" for n, t in pts))
        return a, 1.0 / bw, [[int(x), y] for x, y in pts]

    def _host_work_clock(self) -> tuple[Any, float]:
        """The clock for host work and the core share its readings are divided by: the
        wall clock (a fresh page's fault, kernel and hypervisor time alike, included),
        read by ranks that have a core each (``_turns``). GPUs: share 1 (each rank has
        its own core; cudaMalloc's time is the host's). CPUs: divided by cores / ranks
        so that the profile holds wall time with every rank busy, as for every other
        host cost it measures (the simulator takes one core's worth back,
        ``Simulator.core_work_ns``)."""
        share = 1.0 if self.platform.caching_allocator else min(1.0, cpu_cores() / self.ranks_per_node)
        return time.perf_counter, share

    def _turns(self):
        """Barriers that let the node's ranks measure host work in turns, as many at
        once as the node has cores (GPUs and CPUs with a core per rank: all at once):
        yields, per turn, whether this rank measures in it. Every rank passes every
        barrier, so the world stays in step."""
        cores = self.ranks_per_node if self.platform.caching_allocator else max(1, cpu_cores())
        turns = -(-self.ranks_per_node // cores)
        for turn in range(turns):
            dist.barrier()
            yield (self.rank % self.ranks_per_node) // cores == turn

    def allocator_stats(self) -> dict[str, int] | None:
        """GPUs: the caching allocator's statistics after the calibration
        (``torch.cuda.memory_stats``): retries (cache flushes), out-of-memory errors,
        peak reserved and allocated bytes, cudaMalloc and cudaFree calls. What a run on
        this device did, recorded with the profile; None on CPUs (malloc keeps none)."""
        if self.device.type != "cuda":
            return None
        stats = torch.cuda.memory_stats(self.device)
        keys = {"num_alloc_retries": "num_alloc_retries", "num_ooms": "num_ooms",
                "reserved_bytes.all.peak": "reserved_bytes_peak", "allocated_bytes.all.peak": "allocated_bytes_peak",
                "num_device_alloc": "num_device_alloc", "num_device_free": "num_device_free"}
        return {name: int(stats.get(key, 0)) for key, name in keys.items()}

    def first_touch(self) -> tuple[float, float]:
        """Host memory: (seconds per byte that a fresh page's first write costs over a
        write to touched memory, seconds per byte of its unmap at free). A block above
        glibc's mmap threshold is fresh pages: ``torch.empty`` costs nothing until it is
        written, then each page faults and the kernel zeroes it; its free unmaps the
        written pages, which the kernel tears down one by one (the simulator charges
        that to the free, not the allocation: an executor's or framework's free is
        often in another phase than its allocation). Frameworks allocate such blocks
        and write only part of them (DeepSpeed's gradient bucket). Measured as
        fill(empty(n)) - fill again, and free, n = 64 MiB. With a caching allocator
        (GPUs): 0, 0 (device memory is mapped whole by cudaMalloc, and kept)."""
        if self.platform.caching_allocator:
            return 0.0, 0.0
        n = 64 << 20
        rounds = 3 if self.quick else 6
        clock, share = self._host_work_clock()  # wall time, in turns: see alloc
        per_round, unmaps = [], []
        for r in range(rounds + 1):
            for mine in self._turns():
                if not mine:
                    continue
                x = torch.empty(n, dtype=torch.uint8, device=self.device)
                t0 = clock()
                x.fill_(1)
                t1 = clock()
                x.fill_(2)
                t2 = clock()
                del x
                t3 = clock()
                if r:  # the first round warms the code path up
                    per_round.append(((t1 - t0) - (t2 - t1)) / n / share)
                    unmaps.append((t3 - t2) / n / share)
        # a rank's own: see _together
        fault, unmap = self.mean_of_ranks([max(0.0, statistics.fmean(per_round)), statistics.fmean(unmaps)])
        self.log(f"first touch of fresh pages: {fault * 1e9:.3f} ns/B; their unmap at free {unmap * 1e9:.3f} ns/B")
        return fault, unmap

    def reported_pages(self, pass_times_s: list[float]) -> tuple[float, float] | None:
        """A guest that reports the memory its processes free to its hypervisor
        (``runtime.page_reporting``): (its reporting period in seconds, what a reported
        page's first write costs over a fast fresh page, seconds a byte), or None where
        the guest does not report or no reported page was met. The period: from the times
        the kernel's pass counter moved during the calibration (``pass_times_s``:
        ``page_reporting.PassWatch``), else the kernel's delay. The extra: fresh 64 MiB
        blocks written and held, in turns as ``alloc`` does, until four in a row come
        back slow (``reported_met``: after eight at least) or REPORTED_BUDGET_BYTES are held (half with ``quick``): the first
        blocks take the free pages the guest has not reported yet, the rest reported
        ones."""
        if self.platform.caching_allocator or not balloon_reports():
            return None
        period = reporting_period_s(pass_times_s)
        piece = 64 << 20
        budget = min(REPORTED_BUDGET_BYTES // (2 if self.quick else 1), host_memory() // (4 * self.ranks_per_node))
        clock, share = self._host_work_clock()  # wall time, in turns: see alloc
        rates: list[float] = []
        for mine in self._turns():
            if not mine:
                continue
            held = []
            while (len(held) + 1) * piece <= budget:
                x = torch.empty(piece, dtype=torch.uint8, device=self.device)
                t0 = clock()
                x.fill_(1)
                rates.append((clock() - t0) / piece / share * 1e9)
                held.append(x)
                if reported_met(rates):
                    break
            del held
        extra = reported_extra(rates)
        extra_s = self.agree((extra or 0.0) / 1e9)
        period = self.agree(period)
        self.log(f"page reporting: a pass every {period:.2f} s; reported pages "
                 + (f"{extra_s * 1e9:.2f} ns/B over fast ones" if extra_s > 0 else "not met")
                 + f" ({len(rates)} blocks of 64 MiB)")
        return (period, extra_s) if extra_s > 0 else None
