"""Micro-benchmarks that turn a machine into a hardware profile (commsim-hw-profile v1).

Every rank runs every benchmark at the same time, with the executor's own kernels and
backend, because that is how a schedule will run: on a shared CPU two ranks' matmuls
compete for the same cores, on GPUs each rank has its own.

Measured:
* GEMM throughput by size (the executor's batched matmul), as (flops, flops/s) points;
* memory-bound kernels by size, on data not in the cache (as a step's tensors are):
  a table, and a fixed cost per kernel and bandwidth (a least-squares fit of time over
  bytes), used for elementwise ops and copies;
* each collective kind separately (all-gather, reduce-scatter, all-reduce, broadcast)
  over the whole group: latency and bandwidth from a fit of time over bytes, never
  assuming one kind from another (gloo's reduce-scatter, for one, costs an all-reduce);
* how much slower compute runs while a collective is in flight, and the reverse (a
  collective's bandwidth and its latency separately);
* the executor's own per-op costs: host time to issue a device op, and per-op overhead;
* allocation cost by size, in a step-like steady state (heap reuse vs fresh pages),
  and on CPUs what the first write of a fresh page costs;
* on CPUs, the cores and, with more ranks than cores, the OS time slice; with at most
  one rank per core, how each rank's speed drifts apart from the others'
  (``runtime.calibrate_cpu``).

``Calibrator.run`` runs them all, in a fixed order, and returns the profile document
(``runtime.calibrate_profile``). Which of them apply, and how memory is allocated and
kernels waited for, follows the backend's platform (``commsim.hardware.platform``).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from commsim.hardware.platform import KernelExecution, platform_of_backend
from commsim.ir import ops as O
from commsim.ir.schedule import Program, Schedule
from runtime.calibrate_cpu import cpu_cores, rank_noise, time_slice
from runtime.calibrate_profile import Measured, profile_document
from runtime.collectives import all_gather, reduce_scatter
from runtime.executor import RankExecutor, RankOptions
from runtime.kernels import Kernels, default_precision, device_of

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def _latency_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Latency from the smallest transfer, bandwidth from the slope between the smallest
    and the largest (a least-squares intercept is dominated by the big sizes' noise)."""
    points = sorted(points)
    (x0, y0), (x1, y1) = points[0], points[-1]
    bw = (x1 - x0) / (y1 - y0) if y1 > y0 else x1 / max(y1, 1e-9)
    return max(0.0, y0 - x0 / bw), bw


class Calibrator:
    """One rank's calibration: the benchmarks, each run on every rank at once with the
    executor's own kernels and backend (``run`` runs them all)."""

    def __init__(self, rank: int, world: int, backend: str, quick: bool = False, log: Callable[[str], None] = print,
                 shapes: tuple[tuple[str, int, int, int, int], ...] = (), ranks_per_node: int | None = None):
        self.rank, self.world, self.backend = rank, world, backend
        self.ranks_per_node = ranks_per_node or world
        self.shapes = shapes  # (dtype, m, n, k, batch) of the GEMMs some schedules will run
        self.platform = platform_of_backend(backend)
        self.device = device_of(self.platform)
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[default_precision(self.platform)]
        self.kernels = Kernels(self.device, self.dtype)
        self._shape_kernels: dict[str, Kernels] = {}
        self._shape_times: dict[tuple[str, int, int, int, int], list[float]] = {}
        self.min_s = 0.05 if quick else 0.2
        self.quick = quick
        self.log = log if rank == 0 else (lambda _m: None)

    def sync(self) -> None:
        """Wait for the kernels this rank queued (none are where they run inline)."""
        if self.platform.kernels is KernelExecution.QUEUED:
            torch.cuda.synchronize(self.device)

    def agree(self, x: float) -> float:
        """The largest of every rank's ``x``."""
        out = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return float(out.item())

    def _together(self, fn: Callable[[], Any]) -> float:
        """Time ``fn`` on all ranks at once; the slowest rank's mean counts. Every rank
        runs the same number of calls (a collective inside must match on all ranks).

        The mean, not the median: with more ranks than cores, the OS time-slices them in
        slices of milliseconds, so a call shorter than a slice usually runs at a whole
        core's speed and now and then waits out another rank's slice. The median keeps
        only the fast calls; the mean is what such calls cost on average in a step (the
        median underpriced memory-bound kernels and copies; traces/README.md)."""
        dist.barrier()
        t = time.perf_counter()
        fn()
        self.sync()
        first = self.agree(time.perf_counter() - t)
        reps = int(min(200, max(3, self.min_s / max(first, 1e-7))))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return self.agree(statistics.fmean(times))

    # ------------------------------------------------------------ compute
    def gemm(self, dtype: torch.dtype) -> list[list[float]]:
        sizes = [16, 32, 64, 128, 256, 512] if self.quick else [16, 32, 64, 128, 192, 256, 384, 512, 768, 1024]
        cpu_bf16 = dtype == torch.bfloat16 and self.platform.inline_kernels
        if cpu_bf16:
            # slow on CPUs without bf16 units (a large batched GEMM takes seconds); the
            # curve is flat well before these sizes
            sizes = [s for s in sizes if s <= (128 if self.quick else 256)]
        kernels = Kernels(self.device, dtype)
        # square matmuls, batched ones, and the tall-and-skinny shapes of transformer
        # layers (tokens x hidden x 4*hidden and their gradients)
        shapes = [(n, n, n, b) for n in sizes for b in (1, 8)]
        if not self.quick and not cpu_bf16:
            shapes += [(t, 4 * h, h, 1) for t in (256, 1024) for h in (256, 512)]
            shapes += [(4 * h, h, t, 1) for t in (256, 1024) for h in (256, 512)]
        points = []
        for m, n, k, batch in shapes:
            op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * m * n * k * batch, 0, 0,
                           O.GemmShape(m, n, k, batch))
            t = self._together(lambda op=op: kernels.run(op))
            points.append([float(op.flops), op.flops / t])
        # one rate per flop count (shapes of equal work measured with and without batching)
        by_flops: dict[float, list[float]] = {}
        for f, r in points:
            by_flops.setdefault(f, []).append(r)
        points = sorted([f, statistics.mean(rs)] for f, rs in by_flops.items())
        self.log(f"gemm {str(dtype).removeprefix('torch.')}: {points[0][1] / 1e9:.1f} .. "
                 f"{max(p[1] for p in points) / 1e9:.1f} GFLOP/s")
        return points

    def gemm_shapes_round(self) -> None:
        """Time each exact GEMM shape of the schedules given (``calibrate --schedule``)
        once more, on all ranks at once like every other benchmark: a rate by flops
        alone misses how a shape uses caches (an LM head's long, thin GEMM and a batched
        square one of similar flops run at very different rates)."""
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        for shape in self.shapes:
            dt, m, n, k, batch = shape
            kernels = self._shape_kernels.setdefault(dt, Kernels(self.device, dtypes[dt]))
            op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * m * n * k * batch, 0, 0, O.GemmShape(m, n, k, batch))
            t = self._together(lambda op=op, kernels=kernels: kernels.run(op))
            self._shape_times.setdefault(shape, []).append(t)

    def gemm_shapes(self) -> dict[str, list[list[float]]]:
        """Each exact shape's rate from the mean of its rounds. The rounds lie apart (at
        the start, the middle and the end of a calibration): on a shared machine a
        kernel's speed drifts over seconds (traces/README.md, runs M to P), and a step's
        GEMMs run across all of it, so one short window misprices all of them at once."""
        out: dict[str, list[list[float]]] = {}
        for (dt, m, n, k, batch), times in self._shape_times.items():
            out.setdefault(dt, []).append([m, n, k, batch, 2 * m * n * k * batch / statistics.fmean(times)])
        if self.shapes:
            rounds = len(next(iter(self._shape_times.values())))
            self.log(f"gemm shapes: {len(self.shapes)} measured, {rounds} rounds each")
        return out

    def memory(self) -> tuple[float, float, list[list[float]]]:
        """Memory-bound kernels by size (a table), as the executor runs them: each call on
        the next region of a ring larger than the last-level cache, so its data comes
        from memory, as a step's tensors do (``Kernels``); below a few MiB the cost is
        mostly the call's fixed overhead and the cold cache lines' latency."""
        sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20] + ([] if self.quick else [32 << 20, 128 << 20])
        pts = []
        for nbytes in sizes:
            op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.ELEMENTWISE, 0, nbytes // 2, nbytes // 2)
            pts.append((float(nbytes), self._together(lambda op=op: self.kernels.run(op))))
        a, bw = _latency_bandwidth(pts)
        self.log(f"memory-bound kernels: {a * 1e6:.1f} us + {bw / 1e9:.2f} GB/s "
                 f"({pts[-1][0] / pts[-1][1] / 1e9:.2f} GB/s at {pts[-1][0] / 2**20:.0f} MiB)")
        return a, bw, [[int(x), y] for x, y in pts]

    # ------------------------------------------------------------ collectives
    def _collective(self, kind: str, nbytes: int) -> Callable[[], Any]:
        p = self.world
        n = max(p, nbytes // 4 // p * p)
        buf = torch.ones(n, dtype=torch.float32, device=self.device)
        shard = torch.ones(n // p, dtype=torch.float32, device=self.device)
        if kind == "all_gather":
            return lambda: all_gather(buf, shard)
        if kind == "reduce_scatter":
            return lambda: reduce_scatter(shard, buf)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(buf)
        return lambda: dist.broadcast(buf, src=0)

    def collectives(self) -> dict[str, dict[str, dict[str, Any]]]:
        sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20] + ([] if self.quick else [16 << 20, 64 << 20])
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for kind in KINDS:
            pts = [(float(s), self._together(self._collective(kind, s))) for s in sizes]
            a, bw = _latency_bandwidth(pts)
            out[kind] = {str(self.world): {"latency_ns": int(a * 1e9), "bytes_per_s": bw,
                                           "points": [[int(x), y] for x, y in pts]}}
            self.log(f"{kind} over {self.world} ranks: {a * 1e6:.0f} us + {bw / 1e9:.2f} GB/s")
        return out

    def contention(self) -> tuple[float, float, float]:
        """(compute slowdown while a collective runs, collective bandwidth slowdown while
        compute runs, collective latency slowdown while compute runs).

        A fixed number of collectives run in a background thread (the same count on every
        rank, so none is left waiting) while the foreground runs matmuls until they are
        done; each side's rate is compared with its rate alone. Twice: a 4 MiB all-reduce,
        whose time is mostly bandwidth, and a 64 KiB all-gather, whose time is mostly
        latency. On a CPU backend the collective's own thread then competes for the core
        with the rank's kernels, and a small collective waits for the scheduler at every
        message of its protocol, so its latency suffers more than a large one's
        bandwidth."""
        n = 256 if self.quick else 384
        op = O.Compute(O.OpId(0), "c", "", O.ComputeKind.GEMM, 2 * n ** 3 * 4, 0, 0, O.GemmShape(n, n, n, 4))
        compute_alone = self._together(lambda: self.kernels.run(op))
        slow_c, slow_n = self._under_compute(op, compute_alone, self._collective("all_reduce", 4 << 20))
        _, slow_lat = self._under_compute(op, compute_alone, self._collective("all_gather", 64 << 10))
        self.log(f"contention: compute x{slow_c:.2f} while communicating, communication x{slow_n:.2f} "
                 f"(bandwidth) and x{slow_lat:.2f} (latency) while computing")
        return slow_c, slow_n, slow_lat

    def _under_compute(self, op: O.Compute, compute_alone: float, comm: Callable[[], Any]) -> tuple[float, float]:
        """(compute slowdown, collective slowdown) with ``comm`` in a background thread."""
        comm_alone = self._together(comm)
        budget = 0.1 if self.quick else 0.3
        reps = max(3 if self.quick else 4, int(budget / max(comm_alone, 1e-6)))
        done = threading.Event()
        comm_elapsed = [0.0]

        def background() -> None:
            t = time.perf_counter()
            for _ in range(reps):
                comm()
            self.sync()
            comm_elapsed[0] = time.perf_counter() - t
            done.set()

        dist.barrier()
        th = threading.Thread(target=background, daemon=True)
        t = time.perf_counter()
        th.start()
        count = 0
        while not done.is_set():
            self.kernels.run(op)
            self.sync()
            count += 1
        fg = time.perf_counter() - t
        th.join()
        compute_busy = fg / max(count, 1)
        comm_busy = comm_elapsed[0] / reps
        res = torch.tensor([compute_busy / compute_alone, comm_busy / comm_alone], dtype=torch.float64)
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
        return max(1.0, float(res[0])), max(1.0, float(res[1]))

    # ------------------------------------------------------------ executor costs
    def executor_overheads(self) -> tuple[int, int]:
        """(host ns to issue a device op, per-op overhead ns) of the executor itself."""
        n = 300
        step = tuple(O.Compute(O.OpId(i + 1), "compute", "tiny", O.ComputeKind.ELEMENTWISE, 0, 64, 64)
                     for i in range(n))
        sched = Schedule.uniform(self.world, Program((), step))
        ex = RankExecutor(sched, self.rank, self.backend, RankOptions(steps=3, warmup=1))
        run = ex.run()
        per_op = statistics.median(run.step_times_ns) / n
        issue = [r for r in run.records if r.stream != "host"]
        # issue cost: how fast the host hands ops over (start of the i-th op can be no
        # earlier than i issues); estimate from the worker's inter-op gaps and span
        starts = sorted(r.start_ns for r in issue if r.step == 0)
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        issue_ns = int(statistics.median(gaps)) if gaps else 0
        res = torch.tensor([per_op, issue_ns], dtype=torch.float64)
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
        self.log(f"executor: {res[0] / 1e3:.1f} us per op, host issue {res[1] / 1e3:.1f} us")
        return int(res[1]), int(res[0])

    def alloc(self) -> tuple[float, float, list[list[float]]]:
        """Allocations as the executor makes them (on CPUs: zeroed host memory), in a
        steady state like a training step's: each round allocates every size in turn,
        holds them all, then frees them. Returns the latency-bandwidth line and the
        per-size table. With a caching allocator (GPUs) the cache is emptied between
        rounds, so each round times cudaMalloc itself (what a cache miss costs). With
        malloc (CPUs) the table matters: glibc reuses heap pages below its mmap threshold
        (up to 32 MiB) and maps fresh ones above it, so the cost per byte jumps across
        it; sizes on both sides of 32 MiB are measured."""
        sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 30 << 20, 34 << 20, 64 << 20]
        if self.quick:
            sizes = [4 << 10, 1 << 20, 16 << 20, 34 << 20]
        if self.platform.caching_allocator:
            make = (lambda n: torch.empty(n, dtype=torch.uint8, device=self.device))
        else:
            make = (lambda n: torch.zeros(n, dtype=torch.uint8))
        rounds = 4 if self.quick else 8
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(rounds + 1):
            dist.barrier()
            live = []
            for n in sizes:
                t = time.perf_counter()
                live.append(make(n))
                self.sync()
                if r:  # the first round warms the heap up
                    times[n].append(time.perf_counter() - t)
            del live
            if self.platform.caching_allocator:  # each round's allocations are cudaMalloc calls, not cache hits
                self.sync()
                torch.cuda.empty_cache()
        mean = torch.tensor([statistics.fmean(times[n]) for n in sizes], dtype=torch.float64)  # see _together
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        pts = [(float(n), float(t)) for n, t in zip(sizes, mean.tolist())]
        a, bw = _latency_bandwidth(pts)
        self.log("allocation: " + ", ".join(f"{n / 2**20:g} MiB {t * 1e3:.2f} ms" for n, t in pts))
        return a, 1.0 / bw, [[int(x), y] for x, y in pts]

    def first_touch(self) -> float:
        """Host memory: seconds per byte that a fresh page's first write costs over a
        write to touched memory, plus its unmap at free. A block above glibc's mmap
        threshold is fresh pages: ``torch.empty`` costs nothing until it is written,
        then each page faults and the kernel zeroes it. Frameworks allocate such
        blocks and write only part of them (DeepSpeed's gradient bucket). Measured
        as fill(empty(n)) - fill again + free, n = 64 MiB. With a caching allocator
        (GPUs): 0 (device memory is mapped whole by cudaMalloc)."""
        if self.platform.caching_allocator:
            return 0.0
        n = 64 << 20
        rounds = 3 if self.quick else 6
        per_round = []
        for r in range(rounds + 1):
            dist.barrier()
            x = torch.empty(n, dtype=torch.uint8)
            t0 = time.perf_counter()
            x.fill_(1)
            t1 = time.perf_counter()
            x.fill_(2)
            t2 = time.perf_counter()
            del x
            t3 = time.perf_counter()
            if r:  # the first round warms the code path up
                per_round.append(((t1 - t0) - (t2 - t1) + (t3 - t2)) / n)
        mean = torch.tensor([max(0.0, statistics.fmean(per_round))], dtype=torch.float64)  # see _together
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        self.log(f"first touch of fresh pages: {mean.item() * 1e9:.3f} ns/B")
        return float(mean.item())

    # ------------------------------------------------------------ all
    def run(self) -> dict[str, Any]:
        """Every benchmark, in an order that spreads the exact GEMM shapes' rounds over
        the calibration; returns the profile document."""
        t0 = time.perf_counter()
        gemm_by_dtype = {"fp32": self.gemm(torch.float32), "bf16": self.gemm(torch.bfloat16)}
        self.gemm_shapes_round()  # exact shapes: at the start, the middle and the end (not quick)
        mem_a, mem_bw, mem_points = self.memory()
        colls = self.collectives()
        if not self.quick:
            self.gemm_shapes_round()
        slow_c, slow_n, slow_lat = self.contention()
        issue_ns, per_op_ns = self.executor_overheads()
        alloc_a, alloc_per_byte, alloc_points = self.alloc()
        first_touch = self.first_touch()
        if not self.quick:
            self.gemm_shapes_round()
        shapes = self.gemm_shapes()
        cores = cpu_cores()
        slice_ns = time_slice(self, cores)
        noise = rank_noise(self, cores)
        self.log(f"calibration took {time.perf_counter() - t0:.0f} s")
        measured = Measured(
            gemm_by_dtype=gemm_by_dtype, gemm_shapes_by_dtype=shapes, mem_latency_s=mem_a, mem_bytes_per_s=mem_bw,
            mem_points=mem_points, collectives=colls, comm_slowdown=slow_c, comm_slowdown_during_compute=slow_n,
            comm_latency_slowdown_during_compute=slow_lat, issue_ns=issue_ns, per_op_ns=per_op_ns,
            alloc_latency_s=alloc_a, alloc_s_per_byte=alloc_per_byte, alloc_points=alloc_points,
            first_touch_s_per_byte=first_touch, cpu_cores=cores, time_slice_ns=slice_ns, rank_noise=noise)
        return profile_document(measured, self.platform, self.device, self.world, self.ranks_per_node)
